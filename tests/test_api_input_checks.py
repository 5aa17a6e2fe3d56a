"""Bad input to the public API is a ValueError naming the argument (README, *Use*), in every
mode of the head and in the folded head, the engine and the scorers: never a plausible wrong
answer (integer hidden states through the fold, a str tagged letter by letter, prompt 1.9
scored on prompt 1's scale) nor a traceback from deep inside."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mhmla_fast import FusedLayerAttention, layer_attention
from mhmla_fast.modules.layer_attention_linear import LayerAttentionLinear

H, NL = 8, 3


@pytest.mark.parametrize("mode", ["mhmla", "shmla", "avgl", "last"])
def test_every_mode_and_the_fold_check_their_input(mode):
    torch.manual_seed(0)
    head = FusedLayerAttention(H, NL, num_heads=2, mode=mode, backend="torch").eval()
    fold = LayerAttentionLinear(head, torch.nn.Linear(H, 2))
    good = torch.randn(NL + 1, 2, 3, H)
    for net in (head, fold):
        assert net(good).shape[:2] == (2, 3)
        for bad, message in (
                (torch.randn(NL + 1, 2, 3, 10), r"H = 8|\[L, H, H\] = \[3, 10, 10\]"),
                (torch.randn(NL + 1, 0, 3, H), "empty input"),
                (tuple(torch.randn(2, 3 + i, H) for i in range(NL + 1)), "same shape"),
                (torch.randint(-3, 4, (NL + 1, 2, 3, H)), "floating-point dtype"),
                ((*torch.randn(NL, 2, H).unbind(0), torch.randn(2, H, dtype=torch.float64)),
                 "dtype/device")):
            with pytest.raises(ValueError, match=message):
                net(bad)


def test_functional_refuses_a_non_tensor_key_weight_and_a_rate_that_is_no_number():
    L, K, J = 3, 6, 2
    w = dict(w_v=torch.randn(L, H, H), b_v=torch.randn(L, H), w_k=torch.randn(L, H, K),
             b_k=torch.randn(L, K), w_a=torch.randn(L, K, J), b_a=torch.randn(L, J))
    h = torch.randn(L, 4, H)
    with pytest.raises(ValueError, match="w_k: expected a tensor"):
        layer_attention(h, **{**w, "w_k": w["w_k"].numpy()}, num_heads=J)
    for rate in (None, "0.1", True):
        with pytest.raises(ValueError, match="dropout_h: expected a rate in"):
            layer_attention(h, **w, num_heads=J, dropout_h=rate)
    assert layer_attention(h, **w, num_heads=J, dropout_h=np.float32(0.1)).shape == (4, H)


@pytest.mark.parametrize("kw, message", [
    (dict(layers=[1.5]), "layers: expected hidden-state indices"),
    (dict(layers="12"), "layers: expected hidden-state indices"),
    (dict(layers=3), "layers: expected hidden-state indices"),
    (dict(key_size=True), "key_size: expected a positive integer"),
    (dict(block_diagonal="no"), "block_diagonal: expected True or False"),
    (dict(include_embeddings=1), "include_embeddings: expected True or False"),
    (dict(layers=[2, 3], include_embeddings=True), "include_embeddings: applies to the default"),
    (dict(dropout="0.3"), "dropout: expected a rate"),
])
def test_head_options_of_the_wrong_type_are_refused_not_reinterpreted(kw, message):
    with pytest.raises(ValueError, match=message):
        FusedLayerAttention(H, NL, num_heads=2, **kw)
    assert FusedLayerAttention(H, NL, num_heads=2, layers=np.array([1, 3])).layers == [1, 3]


def test_engine_refuses_a_str_and_bad_options(tiny_tagger_dir, tiny_engine):
    with pytest.raises(ValueError, match=r"texts: expected a sequence of strings, got a str; pass \[text\] for one text$"):
        tiny_engine.tag_texts("He go to school .")
    with pytest.raises(ValueError, match=r"texts\[1\]: expected a string, got NoneType"):
        tiny_engine.tag_texts(["ok", None])
    assert len(tiny_engine.tag_texts(["He go .", ""])) == 2
    for value in (float("nan"), 2, -0.1, "0.5"):
        with pytest.raises(ValueError, match="threshold: expected a probability"):
            tiny_engine.threshold = value
    from mhmla_fast.serve.engine import Engine

    for kw, message in ((dict(max_batch=0), "max_batch: expected a positive integer"),
                        (dict(max_padding=-1), "max_padding: expected a share"),
                        (dict(threads=0), "threads: expected a positive integer"),
                        (dict(threshold=float("nan")), "threshold: expected a probability")):
        with pytest.raises(ValueError, match=message):
            Engine.load(tiny_tagger_dir, backend="torch", device="cpu", **kw)
    with pytest.raises(ValueError, match="model_dir: empty path"):
        Engine.load("", backend="torch")


def test_scorers_refuse_a_str_and_a_prompt_that_is_not_an_integer(tiny_scorer):
    prompt = tiny_scorer.config.prompts[0]
    with pytest.raises(ValueError, match="texts: expected a sequence of essays, got a str"):
        tiny_scorer.predict_scores("Computers help people .", prompt)
    for bad in (prompt + 0.9, str(prompt), True, [float(prompt)]):
        with pytest.raises(ValueError, match="prompts: expected integers"):
            tiny_scorer.predict_scores(["Computers help people ."], bad)
    assert tiny_scorer.predict_scores(["Computers help people ."], np.int64(prompt)).shape == (1,)


def test_score_essays_refuses_a_prompt_that_is_not_an_integer_and_a_lone_surrogate(tiny_scorer):
    """``score_essays`` (the CLI's, Ray's and HTTP's entry) turned prompt 1.9 into 1 before the
    scorer's check, scoring the essay on prompt 1's scale; a lone surrogate in an essay failed
    the call with a TypeError naming nothing."""
    from mhmla_fast.serve.score import score_essays

    prompt = tiny_scorer.config.prompts[0]
    essays = ["Computers help people .", "They do ."]
    for bad in ([prompt, prompt + 0.9], [prompt, True], [prompt, str(prompt)]):
        with pytest.raises(ValueError, match="prompts: expected integers"):
            score_essays(tiny_scorer, essays, bad)
    with pytest.raises(ValueError, match=r"texts\[1\]: holds a lone surrogate U\+D800"):
        score_essays(tiny_scorer, [essays[0], "They \ud800 do ."], [prompt, prompt])
    with pytest.raises(ValueError, match=r"texts\[0\]: holds a lone surrogate U\+DC80"):
        tiny_scorer.predict_scores(["\udc80"], prompt)
    got = score_essays(tiny_scorer, essays, [prompt, np.int64(prompt)])
    assert [r["prompt"] for r in got] == [prompt, prompt]
    assert all(type(r["prompt"]) is int for r in got)


def test_kernels_for_a_ridge_scorer_are_refused_whatever_the_backend():
    from mhmla_fast.serve.score import default_scorer_path, load_scorer

    for backend in ("auto", "torch"):
        with pytest.raises(ValueError, match="kernels: .* is a ridge scorer"):
            load_scorer(default_scorer_path(), backend=backend, device="cpu", kernels="torch")


def test_text_list_is_the_one_check_of_the_taggers_and_scorers_texts():
    """``texts.text_list``: a list back for any iterable of str (generators read once, str
    subclasses kept), one str or bytes refused with the unit named, non-iterables and non-str
    elements refused by index."""
    from mhmla_fast.texts import text_list

    class Note(str):
        pass

    assert text_list(t for t in ("a", "b")) == ["a", "b"]
    kept = text_list(("a", Note("b")))
    assert kept == ["a", "b"] and type(kept[1]) is Note
    with pytest.raises(ValueError, match=r"texts: expected a sequence of essays, got a bytes; pass \[text\] for one essay"):
        text_list(b"essay", "essay")
    with pytest.raises(ValueError, match="texts: expected a sequence of strings, got int"):
        text_list(3)
    with pytest.raises(ValueError, match=r"texts\[2\]: expected a string, got bytes"):
        text_list(["a", "b", b"c"])


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_scorers_refuse_an_essay_that_gives_no_word_pieces(backend):
    """predict_scores gave "", blank and zero-width essays plausible scores (prompt 8's 10 for
    three spaces) where ``mhmla-serve score`` answers an error record; now a ValueError names
    the essay, in predict_scores and in plan_essay (the HTTP batcher's)."""
    from mhmla_fast.serve.score import default_scorer_path, load_scorer

    scorer = load_scorer(default_scorer_path(), backend=backend, threads=1)
    for texts, first in ((["", "Dear"], 0), (["Dear", "   "], 1), (["Dear", "x", "\u200b"], 2)):
        with pytest.raises(ValueError, match=rf"texts\[{first}\]: gives no word pieces"):
            scorer.predict_scores(texts, [8] * len(texts))
    with pytest.raises(ValueError, match="text: gives no word pieces"):
        scorer.plan_essay(" \t ", 1)
    assert scorer.predict_scores(["Dear", "x"], [1, 1]).shape == (2,)


def test_the_triton_backend_without_triton_installed_names_the_extra():
    """Without the triton package (a CPU install of the wheel), backend="triton" ended in a
    bare ModuleNotFoundError from deep inside; the module, the function and the training
    check now say which package to install."""
    import subprocess
    import sys

    script = """
import sys
sys.modules["triton"] = None  # as if it were not installed
import torch
from mhmla_fast import FusedLayerAttention, layer_attention
from mhmla_fast.dispatch import backend_unavailable
for make in (lambda: FusedLayerAttention(8, 2, 2, backend="triton"),
             lambda: layer_attention(torch.randn(2, 3, 8), torch.randn(2, 8, 8), torch.randn(2, 8),
                                     torch.randn(2, 8, 8), torch.randn(2, 8), torch.randn(2, 8, 2),
                                     torch.randn(2, 2), 2, backend="triton")):
    try:
        make()
        print("no error")
    except ValueError as err:
        print(err)
print(backend_unavailable("triton", "cuda"))
print(FusedLayerAttention(8, 2, 2, backend="auto")(torch.randn(3, 4, 8)).shape)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 4, lines
    for line in lines[:3]:
        assert "needs the triton package: pip install 'mhmla-fast[triton]'" in line, line
    assert lines[3] == "torch.Size([4, 8])"


def test_the_readmes_use_snippet_runs_as_written():
    """The README's *Use* block named undefined variables (path, batch, hidden, w_*): a user
    copying it got a NameError. It runs as written, with the shapes its comments give."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Use\n\n```python\n(.*?)```", readme, re.S).group(1)
    scope: dict = {}
    exec(compile(block, "README.md (Use)", "exec"), scope)
    tokens = scope["batch"]["input_ids"].shape[1]
    assert scope["p"].shape == (1, tokens, 6, 12) and scope["logits"].shape == (1, tokens, 2)
    assert scope["c"].shape == (9, 384)


def test_load_scorer_defaults_to_the_shipped_scorer_as_engine_load_does():
    from mhmla_fast.serve.score import default_scorer_path, load_scorer

    essay = ["Computers help us learn, and they help us talk with our friends."]
    shipped = load_scorer(default_scorer_path(), backend="torch", threads=1)
    default = load_scorer(backend="torch", threads=1)
    assert default.config.prompts == shipped.config.prompts
    assert default.predict_scores(essay, 1).tolist() == shipped.predict_scores(essay, 1).tolist()
    with pytest.raises(ValueError, match="path: empty path; None means the shipped scorer"):
        load_scorer("", backend="torch")
