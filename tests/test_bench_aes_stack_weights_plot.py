"""bench/aes_stack_weights_plot.py: the weights it draws are the stack's, averaged over folds
(a member absent from a cell counts 0), ordered by their mean; a cell without a stack is
refused by name; the PNG is written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench_scripts import load_bench_script


def _cell(weights: dict) -> dict:
    return {"members": {}, "stack-blend": {"weights": weights, "test_qwk": 0.7}}


def _result() -> dict:
    return {"folds": {
        "0": {"fold": 0, "cells": {"3": _cell({"a": 0.75, "b": 0.25}), "4": _cell({"a": 1.0})}},
        "1": {"fold": 1, "cells": {"3": _cell({"a": 0.25, "c": 0.75}),
                                   "4": _cell({"b": 0.5, "c": 0.5})}}}}


def test_table_plot_and_refusal(tmp_path, capsys):
    bench = load_bench_script("aes_stack_weights_plot")
    members, prompts, W = bench.stack_weights_table(_result())
    assert prompts == [3, 4]
    want = {"a": [0.5, 0.5], "b": [0.125, 0.25], "c": [0.375, 0.25]}
    assert members == ["a", "c", "b"]  # by mean weight: 0.5, 0.3125, 0.1875
    np.testing.assert_allclose(W, [want[m] for m in members])
    np.testing.assert_allclose(W.sum(axis=0), 1.0)
    one = _result()["folds"]["0"]  # a one-fold file of aes_ensemble.py
    members, _, W = bench.stack_weights_table(one)
    np.testing.assert_allclose(W, [[0.75, 1.0], [0.25, 0.0]])

    broken = _result()
    del broken["folds"]["1"]["cells"]["4"]["stack-blend"]
    with pytest.raises(ValueError, match="fold 1 prompt 4: no stack-blend row"):
        bench.stack_weights_table(broken)

    pytest.importorskip("matplotlib")
    src, png = tmp_path / "ens.json", tmp_path / "out" / "w.png"
    src.write_text(json.dumps(_result()))
    assert bench.main([str(src), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "mean 0.500" in capsys.readouterr().out.splitlines()[0]
    src.write_text(json.dumps(broken))
    assert bench.main([str(src), "--out", str(png)]) == 2
    assert "no stack-blend row" in capsys.readouterr().err
