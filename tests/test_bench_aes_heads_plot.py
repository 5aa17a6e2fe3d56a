"""bench/aes_heads_plot.py: the head values it draws are the seed summaries' (in %), a missing
model is refused by name, and the PNG is written."""

from __future__ import annotations

import json

import pytest

from bench_scripts import load_bench_script

MODELS = [f"{h}-{o}" for o in ("cls", "reg") for h in ("last", "avgl", "mhmla")]


def _summary(offset: float, drop: str | None = None) -> dict:
    models = {}
    for i, name in enumerate(MODELS):
        if name == drop:
            continue
        per_seed = {"0": 0.6 + offset + 0.01 * i, "1": 0.62 + offset + 0.01 * i}
        models[name] = {"per_seed": per_seed, "mean": sum(per_seed.values()) / 2, "std": 0.014}
    return {"models": models}


def test_values_plot_and_refusals(tmp_path, capsys):
    bench = load_bench_script("aes_heads_plot")
    values = bench.head_values({"A": _summary(0.0), "B": _summary(0.05)})
    assert list(values) == ["A", "B"] and list(values["A"]) == MODELS
    assert values["B"]["avgl-reg"]["mean"] == pytest.approx(100 * (0.61 + 0.05 + 0.04))
    assert values["A"]["last-cls"]["per_seed"] == pytest.approx({"0": 60.0, "1": 62.0})
    assert values["A"]["mhmla-cls"]["std"] == pytest.approx(1.4)
    with pytest.raises(KeyError, match="B: no model 'mhmla-reg'"):
        bench.head_values({"A": _summary(0.0), "B": _summary(0.0, drop="mhmla-reg")})

    pytest.importorskip("matplotlib")
    paths = {}
    inputs = (("a", _summary(0.0)), ("b", _summary(0.05)), ("bad", _summary(0.0, "avgl-cls")))
    for name, s in inputs:
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(s))
    png = tmp_path / "out" / "heads.png"
    assert bench.main([f"A={paths['a']}", f"B={paths['b']}", "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "avgl-reg 70.00" in capsys.readouterr().out.splitlines()[1]
    assert bench.main([f"A={paths['a']}", f"C={paths['bad']}", "--out", str(png)]) == 2
    assert "C: no model 'avgl-cls'" in capsys.readouterr().err
    assert bench.main([str(paths["a"]), "--out", str(png)]) == 2  # no NAME=
    assert bench.main([f"A={paths['a']}", f"A={paths['b']}", "--out", str(png)]) == 2
