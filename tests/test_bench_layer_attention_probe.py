"""bench/layer_attention_probe.py: one shape's fused forward against float64 and eager, on the
interpreter (CPU, fp32), and its config overrides for the GPU fault probe."""

from __future__ import annotations

import os

import pytest

from bench_scripts import load_bench_script

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the fused kernels run on CPU under TRITON_INTERPRET=1")


def test_probe_reports_ok_and_applies_config_overrides(monkeypatch, capsys):
    import mhmla_fast.kernels.layer_attention as kernels

    monkeypatch.setattr(kernels, "_FIXED", dict(kernels._FIXED))
    probe = load_bench_script("layer_attention_probe")
    assert probe.main(["2", "5", "120", "72", "3", "float32", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("ok")
    with pytest.raises(SystemExit):  # overrides need the fixed configs
        probe.main(["2", "5", "120", "72", "3", "float32", "--device", "cpu", "--stages", "1"])
    monkeypatch.setenv("MHMLA_TRITON_CONFIGS", "fixed")
    assert probe.main(["2", "5", "120", "72", "3", "float32", "--device", "cpu",
                       "--stages", "1", "--warps", "8"]) == 0
    assert "stages=1 warps=8" in capsys.readouterr().out
    assert all(w == 8 and s == 1 for _, w, s in kernels._FIXED.values())
