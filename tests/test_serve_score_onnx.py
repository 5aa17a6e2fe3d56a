"""``backend="auto"`` for the essay scorer (``mhmla_fast.serve.score_onnx`` and the export cache):
on the CPU it scores with ONNX Runtime on a cached export, with torch's integer scores (tiny
scorers with attention and [CLS] pooling, classification and regression, and the shipped one);
the HTTP batcher's window-by-window path agrees; a failed validation (outputs apart, or outputs
close but a score different) is recorded and falls back to torch with one line; a warm start
imports no torch; ``--no-cache``/``--backend torch`` keep torch; the scorer's and the tagger's
entries share one cache under different keys."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx", reason="the ONNX export needs onnx (pip install onnx)")
pytest.importorskip("onnxruntime", reason="the ONNX runner needs onnxruntime")

from mhmla_fast.aes.model import EssayScorer  # noqa: E402
from mhmla_fast.aes.scoring import default_model_path  # noqa: E402
from mhmla_fast.serve import export_cache, score_onnx  # noqa: E402
from mhmla_fast.serve.export_cache import (  # noqa: E402
    SCORER, TAGGER, ensure_export, entry_key, lookup,
)
from mhmla_fast.serve.onnx_export import ExportValidationError  # noqa: E402
from mhmla_fast.serve.score import load_scorer  # noqa: E402
from mhmla_fast.serve.score_onnx import VALIDATION_ESSAYS, OnnxScorer, export_scorer  # noqa: E402
from mhmla_fast.serve.score import NO_PIECES  # noqa: E402
from essay_pieces import NO_PIECES_TEXTS, UNK_TEXTS  # noqa: E402
from export_cache_fixtures import Lines, cache  # noqa: E402, F401 - the fixture

WORDS = ("the a cat dog house school every day he she they we go goes went see sees because "
         "computers people library books café naïve don't 3.14 !? …").split()


def essays(n: int, seed: int = 3) -> list[str]:
    """``n`` random essays, every fourth one long enough for several 62-piece windows."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(150, 260) if k % 4 == 3
                                                      else rng.choice([3, 12, 30, 55]))) + " ."
            for k in range(n)]


@pytest.fixture(scope="module")
def warm(tiny_scorer_dir, tmp_path_factory) -> Path:
    """A cache holding the tiny scorer's real export (made once for the module)."""
    root = tmp_path_factory.mktemp("warm-scorer-cache")
    log = Lines()
    entry = ensure_export(tiny_scorer_dir, root, log=log)
    assert (entry.path / "model.onnx").is_file() and (entry.path / "tokenizer.json").is_file()
    (line,) = log.lines  # one line: what, where, how long
    assert line.startswith("mhmla-fast: exporting scorer to ONNX once") and str(entry.path) in line
    assert " done in " in line
    return root


@pytest.fixture(scope="module")
def cls_regression_scorer_dir(tiny_scorer_dir, tmp_path_factory) -> Path:
    """A tiny scorer like the shipped one ([CLS] pooling, regression, all 8 prompts) on the tiny
    scorer's random encoder; output layers scaled up so that scores spread."""
    import torch

    from mhmla_fast.aes.model import ScorerConfig

    encoder = json.loads((tiny_scorer_dir / "config.json").read_text())["encoder_spec"]
    torch.manual_seed(99)
    scorer = EssayScorer(ScorerConfig(encoder=encoder["name_or_path"], num_heads=4,
                                      objective="regression"), backend="torch")
    with torch.no_grad():
        for layer in scorer.head.outputs.values():
            layer.weight.mul_(40.0)
    return scorer.save(tmp_path_factory.mktemp("tiny-reg") / "scorer",
                       tokenizer=EssayScorer.load(tiny_scorer_dir, device="cpu").tokenizer)


def torch_scores(model_dir: Path, texts, prompts) -> tuple[np.ndarray, list]:
    """Torch fp32's scores and averaged outputs, on one thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        scorer = load_scorer(model_dir, backend="torch", device="cpu")
        return scorer.predict_scores(texts, prompts, return_outputs=True)
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------ the rule


def test_auto_scores_with_the_cached_export_like_torch(warm, tiny_scorer_dir, tiny_scorer,
                                                       monkeypatch):
    monkeypatch.setenv("MHMLA_CACHE_DIR", str(warm))
    scorer = load_scorer(tiny_scorer_dir, device="cpu", threads=1)  # backend auto by default
    assert isinstance(scorer, OnnxScorer)
    assert scorer.path.parent == warm / "onnx" and scorer.config.prompts == (1, 2, 3, 4, 5, 6, 7)
    texts = essays(24) + list(VALIDATION_ESSAYS)
    prompts = [1 + k % 7 for k in range(len(texts))]
    got, got_out = scorer.predict_scores(texts, prompts, token_budget=512, return_outputs=True)
    want, want_out = tiny_scorer.predict_scores(texts, prompts, token_budget=512,
                                                return_outputs=True)
    assert got.tolist() == want.tolist()
    assert len(set(want.tolist())) > 3, "the tiny scorer gives different scores"
    np.testing.assert_allclose(np.concatenate(got_out), np.concatenate(want_out), atol=1e-5)
    # the HTTP batcher's path: windows in any batches, then combined
    plans = [scorer.plan_essay(t, p) for t, p in zip(texts, prompts)]
    pairs = [(plan, w) for plan in reversed(plans) for w in range(len(plan.windows))]
    outs = dict(zip(((id(p), w) for p, w in pairs), scorer.score_windows(pairs, token_budget=200)))
    finished = [scorer.finish_essay(p, [outs[id(p), w] for w in range(len(p.windows))])
                for p in plans]
    assert finished == want.tolist() and max(len(p.windows) for p in plans) > 3
    # the empty-essay rule asks the export's own tokenizer (no transformers), as torch's does
    from mhmla_fast.serve.score import essay_pieces_check, piece_encoder

    assert piece_encoder(scorer) == scorer.encode
    tricky = [*NO_PIECES_TEXTS, *UNK_TEXTS, "\u200b", "\u0301", "\ue000", "\u65e5", "x\u200b"]
    got = essay_pieces_check(scorer)(tricky)
    assert got == essay_pieces_check(tiny_scorer)(tricky)
    assert [g is None for g in got] == [False, False, True, True, False, False, False, True, True]


def test_a_cls_regression_scorer_like_the_shipped_one(cls_regression_scorer_dir, cache):
    texts = essays(16, seed=8) + list(VALIDATION_ESSAYS)
    prompts = [1 + k % 8 for k in range(len(texts))]
    want, want_out = torch_scores(cls_regression_scorer_dir, texts, prompts)
    log = Lines()
    entry = ensure_export(cls_regression_scorer_dir, cache, log=log)
    scorer = load_scorer(cls_regression_scorer_dir, threads=1)
    assert isinstance(scorer, OnnxScorer) and scorer.path == entry.path
    got, got_out = scorer.predict_scores(texts, prompts, return_outputs=True)
    assert got.tolist() == want.tolist() and len(set(want.tolist())) > 3
    np.testing.assert_allclose(np.array(got_out), np.array(want_out), atol=1e-5)
    meta = json.loads((entry.path / "export.json").read_text())
    assert meta["objective"] == "regression" and meta["pooling"] == "cls"
    assert meta["graph"] == "cls-last-layer" and meta["attention"] == "eager"
    assert meta["columns"] == {str(p): [p - 1, p] for p in range(1, 9)}
    valid = meta["validation"]
    assert valid["windows"]["essay_scores"] == {"compared": 8 * len(VALIDATION_ESSAYS),
                                                "differing": 0}
    assert valid["essays"]["differing"] == 0 and valid["essays"]["pieces_equal"]


def test_the_exported_forms_compute_what_the_scorer_computes(cls_regression_scorer_dir,
                                                            tiny_scorer_dir):
    """The [CLS]-only last layer (cls pooling) and the unindexed attention pooling, in torch,
    against the scorer's own ``pooled_windows`` on ragged windows."""
    import torch

    from mhmla_fast.serve.score_onnx import export_graph, window_outputs_module

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 20000, (4, 40), generator=g)
    mask = torch.ones_like(ids)
    for b, n in enumerate((40, 1, 17, 33)):
        mask[b, n:] = 0
        ids[b, n:] = 0
    for path, graph in [(cls_regression_scorer_dir, "cls-last-layer"),
                        (tiny_scorer_dir, "attention-pooling")]:
        scorer = EssayScorer.load(path, device="cpu", backend="torch").eval()
        assert export_graph(scorer) == graph
        reference, _ = window_outputs_module(scorer)
        form, _ = window_outputs_module(scorer, graph)
        with torch.no_grad():
            torch.testing.assert_close(form(ids, mask), reference(ids, mask), atol=1e-5,
                                       rtol=1e-5)
    with pytest.raises(ValueError, match="graph: expected one of"):
        window_outputs_module(scorer, "fast")


def test_torch_where_asked_or_where_only_torch_honours_the_options(warm, tiny_scorer_dir,
                                                                   cache, monkeypatch):
    assert isinstance(load_scorer(tiny_scorer_dir, backend="torch", device="cpu"), EssayScorer)
    assert isinstance(load_scorer(tiny_scorer_dir, dtype="bfloat16", device="cpu"), EssayScorer)
    assert isinstance(load_scorer(tiny_scorer_dir, cache=False), EssayScorer)
    monkeypatch.setenv("MHMLA_NO_CACHE", "1")
    assert isinstance(load_scorer(tiny_scorer_dir), EssayScorer)
    assert not cache.exists()  # nothing read or written
    monkeypatch.delenv("MHMLA_NO_CACHE")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # "import onnxruntime" fails
    assert isinstance(load_scorer(tiny_scorer_dir), EssayScorer) and not cache.exists()


def test_the_score_command_runs_auto_and_no_cache_keeps_torch(warm, tiny_scorer_dir, tiny_scorer,
                                                              tmp_path, monkeypatch):
    from mhmla_fast.commands import serve as cli
    from mhmla_fast.serve import score

    seen = []
    real = score.load_scorer

    def spy(path, **kw):
        scorer = real(path, **kw)
        seen.append(type(scorer).__name__)
        return scorer

    monkeypatch.setattr(score, "load_scorer", spy)
    texts = essays(6, seed=5)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t, "prompt": 1 + k % 7}) + "\n"
                           for k, t in enumerate(texts)))
    want = tiny_scorer.predict_scores(texts, [1 + k % 7 for k in range(6)]).tolist()
    fresh = tmp_path / "fresh-cache"
    for env, extra, kind in [(warm, [], "OnnxScorer"), (fresh, ["--no-cache"], "EssayScorer"),
                             (fresh, ["--backend", "torch"], "EssayScorer")]:
        monkeypatch.setenv("MHMLA_CACHE_DIR", str(env))
        out = tmp_path / f"out{len(seen)}.jsonl"
        assert cli.main(["score", str(src), "-o", str(out), "--model", str(tiny_scorer_dir),
                         "--no-progress", "--threads", "1", *extra]) == 0
        assert seen[-1] == kind
        assert [json.loads(x)["score"] for x in out.read_text().splitlines()] == want
        made = json.loads(Path(f"{out}.meta.json").read_text())["made_from"]
        assert made["backend"] == ("torch" if "torch" in extra else "auto")
    assert not fresh.exists()
    # the export folder itself as --model runs as it is (it was refused for want of
    # model.safetensors, though load_scorer takes it)
    (entry,) = [p for p in (warm / "onnx").iterdir() if (p / "model.onnx").is_file()]
    out = tmp_path / "from-export.jsonl"
    assert cli.main(["score", str(src), "-o", str(out), "--model", str(entry),
                     "--no-progress", "--threads", "1"]) == 0
    assert seen[-1] == "OnnxScorer"
    assert [json.loads(x)["score"] for x in out.read_text().splitlines()] == want


def test_the_http_scorer_follows_the_taggers_backend(warm, tiny_scorer_dir, monkeypatch):
    from mhmla_fast.commands import serve as cli

    monkeypatch.setenv("MHMLA_CACHE_DIR", str(warm))
    base = ["http", "--scorer", str(tiny_scorer_dir), "--threads", "1"]
    for extra, kind in [([], OnnxScorer), (["--backend", "torch"], EssayScorer),
                        (["--no-cache"], EssayScorer)]:
        _, scorer = cli.load_http_scorer(cli.build_parser().parse_args([*base, *extra]))
        assert isinstance(scorer, kind), extra


def test_the_http_servers_kernels_option_spares_a_ridge_scorer(monkeypatch, capsys):
    """--kernels is the tagger's: with the shipped ridge scorer (no layer attention) it
    stopped the server at start; now the scorer runs as it is, with a note. load_scorer checks
    threads as Engine.load does."""
    from mhmla_fast.commands import serve as cli
    from mhmla_fast.serve.score import default_scorer_path, load_scorer

    args = cli.build_parser().parse_args(["http", "--kernels", "torch", "--backend", "torch",
                                          "--threads", "1"])
    path, scorer = cli.load_http_scorer(args)
    assert path == default_scorer_path() and scorer is not None
    assert "--kernels torch is the tagger's" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kernels: .* is a ridge scorer"):
        load_scorer(default_scorer_path(), backend="torch", kernels="torch")
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="threads: expected a positive integer"):
            load_scorer(default_scorer_path(), backend="torch", threads=bad)


# ---------------------------------------------------------------------------- failures


def test_a_failed_validation_is_recorded_and_falls_back_to_torch(tiny_scorer_dir, cache,
                                                                 monkeypatch, capsys):
    """Real exports whose validation fails: torch's reference moved by 0.01 (outputs apart)."""
    calls = []
    real = score_onnx._torch_outputs

    def moved(module, batches):
        calls.append(1)
        return [out + 0.01 for out in real(module, batches)]

    monkeypatch.setattr(score_onnx, "_torch_outputs", moved)
    scorer = load_scorer(tiny_scorer_dir, threads=1)
    assert isinstance(scorer, EssayScorer) and calls
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2  # the export's own line (ending in "failed"), then why torch runs
    assert err[0].startswith("mhmla-fast: exporting scorer") and " failed after " in err[0]
    assert err[1].startswith("mhmla-fast: backend auto runs torch for scorer: its ONNX export "
                             "failed on ") and "ExportValidationError" in err[1]
    (record,) = (cache / "onnx").glob("*.failed.json")
    data = json.loads(record.read_text())
    assert data["kind"] == "scorer" and "differ by max abs" in data["error"]
    # the next run does not try again: one line, no export
    n = len(calls)
    assert isinstance(load_scorer(tiny_scorer_dir, threads=1), EssayScorer) and len(calls) == n
    (line,) = capsys.readouterr().err.splitlines()
    assert "delete it to try again" in line and str(record) in line


def test_close_outputs_with_a_different_score_fail_the_validation(tiny_scorer_dir, tmp_path,
                                                                  monkeypatch):
    """With a tolerance that every output meets, a reference whose argmax differs (each prompt's
    probabilities reversed) still fails: the integer scores must be identical."""
    real = score_onnx._torch_outputs

    def reversed_per_prompt(module, batches):
        meta = json.loads(next(tmp_path.glob("out/.onnx-export-*/export.json")).read_text())
        outs = real(module, batches)
        for out in outs:
            for a, b in meta["columns"].values():
                out[:, a:b] = out[:, a:b][:, ::-1]
        return outs

    monkeypatch.setattr(score_onnx, "_torch_outputs", reversed_per_prompt)
    with pytest.raises(ExportValidationError, match="the integer score differs from torch's"):
        export_scorer(tiny_scorer_dir, tmp_path / "out", atol=1.0, threads=1)
    assert not (tmp_path / "out").exists()  # nothing written, nor the folder it made


def test_another_kind_of_model_is_refused_not_exported(tiny_tagger_dir, cache):
    with pytest.raises(ValueError, match="a tagger .*not a scorer"):
        load_scorer(tiny_tagger_dir)
    with pytest.raises(ValueError, match="a tagger .*not a scorer"):
        ensure_export(tiny_tagger_dir, cache, kind=SCORER)
    assert not (cache / "onnx").exists() or not list((cache / "onnx").glob("*.failed.json"))


# ------------------------------------------------------------------------- one cache


def test_the_tagger_and_the_scorer_share_one_cache_under_their_own_keys(tiny_tagger_dir,
                                                                       tiny_scorer_dir, cache):
    def fake(model_dir: Path, out: Path) -> dict:
        (out / "model.onnx").write_bytes(model_dir.name.encode())
        return {}

    tagger = ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake)
    scorer = ensure_export(tiny_scorer_dir, cache, log=Lines(), exporter=fake)
    assert tagger.path.parent == scorer.path.parent == cache / "onnx"
    assert tagger.key != scorer.key
    assert [json.loads((e.path / "cache.json").read_text())["kind"] for e in (tagger, scorer)] == [
        "tagger", "scorer"]
    assert (scorer.path / "model.onnx").read_bytes() == b"scorer"
    assert lookup(tiny_tagger_dir, cache).entry == tagger
    assert lookup(tiny_scorer_dir, cache).entry == scorer
    kinds = sorted(json.loads(p.read_text())["kind"] for p in (cache / "onnx" / "index").iterdir())
    assert kinds == ["scorer", "tagger"]
    # the same content and versions under the two kinds: two keys
    versions = export_cache.runtime_versions()
    assert entry_key("0" * 64, versions, TAGGER) != entry_key("0" * 64, versions, SCORER)
    # a failure of one kind is not the other's
    (cache / "onnx" / f"{scorer.key}.failed.json").write_text('{"error": "x"}')
    assert lookup(tiny_tagger_dir, cache).failed is None


# ---------------------------------------------------------------------- the processes


def test_a_warm_start_imports_no_torch(warm, tiny_scorer_dir, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"text": t, "prompt": 1}) + "\n" for t in [
        "Dear editor , computers help people .", NO_PIECES_TEXTS[0], UNK_TEXTS[0]]))
    code = ("import sys; from mhmla_fast.commands.serve import main; "
            f"rc = main(['score', {str(src)!r}, '-o', {str(out)!r}, '--model', "
            f"{str(tiny_scorer_dir)!r}, '--no-progress', '--threads', '1']); "
            "print(rc, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "MHMLA_CACHE_DIR": str(warm)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "[]"], done.stdout + done.stderr  # 1: an error record
    assert "mhmla-fast" not in done.stderr  # nothing to say on a warm start
    first, empty, unk = map(json.loads, out.read_text().splitlines())
    assert first["prompt"] == 1 and unk["prompt"] == 1 and "score" in unk
    assert empty == {"index": 2, "id": 2, "error": f"{src}: line 2: {NO_PIECES}"}


@pytest.mark.skipif(not (default_model_path() / "config.json").is_file(),
                    reason="the shipped scorer is not installed")
def test_the_shipped_scorer_on_auto_scores_like_torch_fp32(cache, capsys):
    """The shipped scorer's validated export (a few seconds to make here) gives torch fp32's
    scores on essays under every prompt, and ``load_scorer()`` finds it."""
    entry = ensure_export(default_model_path(), cache, log=Lines())
    meta = json.loads((entry.path / "export.json").read_text())
    assert meta["validation"]["windows"]["essay_scores"]["differing"] == 0
    texts = [*VALIDATION_ESSAYS[:-1], *(t.replace(".", " ,") for t in VALIDATION_ESSAYS[:8])]
    texts += ["a" * 2000, VALIDATION_ESSAYS[0] + " " + "x" * 3000]  # clipped surface features
    prompts = [1 + k % 8 for k in range(len(texts))]
    want, _ = torch_scores(default_model_path(), texts, prompts)
    assert meta["surface_bounds"]  # the export carries the clipping
    scorer = load_scorer(default_model_path(), threads=2)  # the defaults: auto
    assert isinstance(scorer, OnnxScorer) and scorer.path == entry.path
    assert capsys.readouterr().err == ""  # found, not exported again
    assert scorer.predict_scores(texts, prompts).tolist() == want.tolist()
