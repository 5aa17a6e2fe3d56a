"""bench/aes_finetune_progress.py: a fine-tuning cell's epochs so far, read from the
checkpoint of a real (tiny) run, before and after it finishes."""

from __future__ import annotations

import json
import random

import pytest

from bench_scripts import load_bench_script
from mhmla_fast.aes.data import Essay
from test_ged_train import tiny_encoder  # noqa: F401 - the same tiny BERT

WORDS = "the a student school book write read essay good bad long short day".split()


def test_progress_reports_the_checkpoints_epochs(tmp_path, tiny_encoder, capsys):  # noqa: F811
    from mhmla_fast.aes.finetune import FinetuneConfig, finetune

    script = load_bench_script("aes_finetune_progress")
    rng = random.Random(2)
    train = [Essay(i, 3, " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))),
                   i % 4, i % 4, i % 4, i + 1) for i in range(16)]
    cell = tmp_path / "fold0-p3"
    cfg = FinetuneConfig(out=str(cell), prompts=(3,), encoder=tiny_encoder, num_heads=4,
                         batch_size=4, lr=1e-3, head_lr=3e-3, backend="torch", epochs=2)
    _, state = finetune(cfg, train, train[:6], log=None)
    out = tmp_path / "results" / "progress.json"
    assert script.main([str(cell), "--run-command", "mhmla-train aes --finetune ...",
                        "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [r["epoch"] for r in got["log"]] == [1, 2] and got["epochs_done"] == 2
    assert got["epochs"] == 2 and got["steps_done_of_next_epoch"] == 0
    for mine, theirs in zip(got["log"], state["log"]):
        assert mine["dev_mean_qwk"] == pytest.approx(100 * theirs["dev_mean_qwk"])
        assert mine["dev_qwk"]["3"] == pytest.approx(100 * theirs["dev_qwk"]["3"])
    assert got["best_epoch"] == state["best_epoch"]
    assert got["best_dev_mean_qwk"] == pytest.approx(100 * state["best"])
    assert got["finished"] is False  # no test.json: the CLI writes it once the test split is scored
    # a test.json of this run finishes it; one left by a shorter run that is being extended
    # (its checkpoint's config asks for more epochs) does not
    (cell / "test.json").write_text(json.dumps({"settings": {"epochs": 2}}))
    assert script.progress(cell)["finished"] is True
    (cell / "test.json").write_text(json.dumps({"settings": {"epochs": 1}}))
    assert script.progress(cell)["finished"] is False
    assert got["settings"]["batch_size"] == 4 and "out" not in got["settings"]
    assert got["run_command"].startswith("mhmla-train aes") and "commit" in got["provenance"]
    assert "epochs 2/2" in capsys.readouterr().out
    assert script.main([str(tmp_path / "none"), "--run-command", "x", "--out", str(out)]) == 2
    assert "no readable fine-tuning checkpoint" in capsys.readouterr().err
