"""The command-line tools' numeric flags (mhmla_fast.commands.argtypes): each bad value is a
usage error naming the flag before anything is loaded, and the training configs refuse the same
values when built from Python."""

from __future__ import annotations

import argparse
import math

import pytest

from mhmla_fast.commands import argtypes


@pytest.mark.parametrize("check, good, bad", [
    (argtypes.positive_int, [("1", 1), ("64", 64)], ["0", "-3", "2.5", "x", ""]),
    (argtypes.non_negative_int, [("0", 0), ("7", 7)], ["-1", "1e3", "x"]),
    (argtypes.positive_float, [("5e-5", 5e-5), ("2", 2.0)], ["0", "-1e-5", "nan", "inf", "x"]),
    (argtypes.non_negative_float, [("0", 0.0), ("60", 60.0)], ["-0.5", "nan", "inf", "-inf"]),
    (argtypes.probability, [("0", 0.0), ("1", 1.0), ("0.35", 0.35)], ["1.01", "-0.1", "nan"]),
    (argtypes.rate, [("0", 0.0), ("0.3", 0.3)], ["1", "1.5", "-0.1", "nan"]),
])
def test_each_type_keeps_its_range(check, good, bad):
    for text, value in good:
        assert check(text) == value and type(check(text)) is type(value)
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match="expected"):
            check(text)


def _usage_error(main, argv, capsys) -> str:
    """Standard error of ``main(argv)``, which must end in exit status 2 (argparse's SystemExit,
    or mhmla-serve's returned status)."""
    try:
        status = main(argv)
    except SystemExit as exit_:
        status = exit_.code
    assert status == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["ged", "--threads", "0"], "--threads"),
    (["ged", "--threads", "-2"], "--threads"),
    (["aes", "--lr", "nan"], "--lr"),
    (["aes", "--finetune", "--head-lr", "0"], "--head-lr"),
    (["aes", "--epochs", "0"], "--epochs"),
    (["aes", "--batch-size", "-8"], "--batch-size"),
    (["aes", "--patience", "0"], "--patience"),
    (["aes", "--num-heads", "0"], "--num-heads"),  # given (not absent) and refused, with or
    (["aes", "--finetune", "--num-heads", "0"], "--num-heads"),  # without --finetune
])
def test_train_flags_are_usage_errors(argv, flag, capsys):
    from mhmla_fast.commands.train import main

    err = _usage_error(main, argv, capsys)
    assert f"argument {flag}: expected" in err


@pytest.mark.parametrize("argv, flag", [
    (["ged", "--data", "x.tsv", "--batch-size", "0"], "--batch-size"),
    (["ged-suite", "--out", "x.json", "--batch-size", "x"], "--batch-size"),
    (["ged", "--data", "x.m2", "--annotator", "-1"], "--annotator"),
    (["aes", "--token-budget", "0"], "--token-budget"),
])
def test_eval_flags_are_usage_errors(argv, flag, capsys):
    from mhmla_fast.commands.eval import main

    err = _usage_error(main, argv, capsys)
    assert f"argument {flag}: expected" in err


@pytest.mark.parametrize("argv, flag", [
    (["tag", "--threads", "0"], "--threads"),
    (["tag", "--threshold", "1.5"], "--threshold"),
    (["http", "--graceful-timeout", "-1"], "--graceful-timeout"),
    (["http", "--max-wait-ms", "nan"], "--max-wait-ms"),
])
def test_serve_flags_are_usage_errors(argv, flag, capsys):
    from mhmla_fast.commands.serve import main

    err = _usage_error(main, argv, capsys)
    assert f"argument {flag}: expected" in err


def test_training_configs_refuse_what_the_flags_refuse(tmp_path):
    from mhmla_fast.aes.finetune import FinetuneConfig
    from mhmla_fast.aes.heads import HeadTrainConfig
    from mhmla_fast.ged.train import TrainConfig

    ged = {"out": str(tmp_path / "run"), "train": "t.tsv", "dev": "d.tsv"}
    cases = [
        (TrainConfig, {**ged, "lr": -1e-5}, "lr: expected a finite number > 0, got -1e-05"),
        (TrainConfig, {**ged, "lr": math.nan}, "lr: expected a finite number > 0, got nan"),
        (TrainConfig, {**ged, "weight_decay": -0.1}, "weight_decay: expected a finite number >= 0"),
        (TrainConfig, {**ged, "epochs": True}, "epochs: expected a whole number of at least 1, got True"),
        (HeadTrainConfig, {"patience": 0}, "patience: expected a whole number of at least 1"),
        (HeadTrainConfig, {"lr": math.inf}, "lr: expected a finite number > 0, got inf"),
        (HeadTrainConfig, {"weight_decay": math.nan}, "weight_decay: expected a finite number >= 0"),
        (FinetuneConfig, {"out": "x", "epochs": 0}, "epochs: expected a whole number of at least 1"),
        (FinetuneConfig, {"out": "x", "batch_size": 2.0}, "batch_size: expected a whole number"),
        (FinetuneConfig, {"out": "x", "head_lr": 0}, "head_lr: expected a finite number > 0, got 0"),
    ]
    for cls, kwargs, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            cls(**kwargs)
    # the defaults, a zero weight decay and an integer lr pass
    TrainConfig(**ged, weight_decay=0, lr=1)
    HeadTrainConfig()
    FinetuneConfig(out="x")


def test_port_is_a_tcp_port(capsys):
    """uvicorn took --port 99999 and listened on 34463 while its log said 99999; -1 failed
    only after the models loaded. argparse refuses both by name."""
    from mhmla_fast.commands.argtypes import port
    from mhmla_fast.commands.serve import main

    assert port("0") == 0 and port("8000") == 8000 and port("65535") == 65535
    for bad in ("99999", "-1", "80.5", "http"):
        assert main(["http", "--port", bad]) == 2
        assert "argument --port: expected a port from 0 to 65535" in capsys.readouterr().err
