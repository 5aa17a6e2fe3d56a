"""bench/aes_seed_summary.py: seed statistics of AES protocol results, checked against numpy."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench_scripts import load_bench_script


def _result(seed: int, qwk: dict[str, dict[str, float]], lr: float = 1e-3) -> dict:
    models = {}
    for name, per_prompt in qwk.items():
        models[name] = {"settings": {"lr": lr, "seed": seed}, "per_prompt_qwk": per_prompt,
                        "mean_qwk": float(np.mean(list(per_prompt.values())))}
    return {"folds": [0, 1], "prompts": [3, 4], "models": models,
            "head_overrides": {"seed": seed} if seed else {},
            "provenance": {"commit": f"c{seed}"}}


def test_summary_matches_numpy_and_refuses_mismatched_runs(tmp_path, capsys):
    bench = load_bench_script("aes_seed_summary")
    rng = np.random.default_rng(0)
    values = rng.uniform(0.5, 0.8, size=(3, 2))  # seeds x prompts
    runs = [_result(s, {"mhmla-reg": {"3": values[s, 0], "4": values[s, 1]},
                        "only-seed0": {"3": 0.1, "4": 0.2}} if s == 0 else
                    {"mhmla-reg": {"3": values[s, 0], "4": values[s, 1]}}) for s in range(3)]
    out = bench.summarise(runs)
    assert out["seeds"] == [0, 1, 2] and set(out["models"]) == {"mhmla-reg"}
    m = out["models"]["mhmla-reg"]
    per_seed = values.mean(1)
    assert list(m["per_seed"].values()) == pytest.approx(per_seed.tolist())
    assert m["mean"] == pytest.approx(per_seed.mean())
    assert m["std"] == pytest.approx(per_seed.std(ddof=1))
    assert m["min"] == pytest.approx(per_seed.min()) and m["max"] == pytest.approx(per_seed.max())
    assert m["per_prompt"]["4"]["std"] == pytest.approx(values[:, 1].std(ddof=1))

    with pytest.raises(ValueError, match="repeat a seed"):
        bench.summarise([runs[0], runs[0]])
    other = _result(1, {"mhmla-reg": {"3": 0.5, "4": 0.5}}, lr=1e-2)
    with pytest.raises(ValueError, match="more than the seed"):
        bench.summarise([runs[0], other])

    paths = []
    for s, r in enumerate(runs):
        paths.append(tmp_path / f"seed{s}.json")
        paths[-1].write_text(json.dumps(r))
    dest = tmp_path / "seeds.json"
    assert bench.main([*map(str, paths), "--out", str(dest)]) == 0
    written = json.loads(dest.read_text())
    assert [x["commit"] for x in written["inputs"]] == ["c0", "c1", "c2"]
    assert "commit" in written["provenance"] and "mhmla-reg" in capsys.readouterr().out
    assert bench.main([str(paths[0]), "--out", str(dest)]) == 2  # one run: no spread
