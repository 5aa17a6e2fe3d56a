"""Seed variance of the AES CPU protocol: mean QWK per model over runs that differ only in seed.

    python bench/aes_seed_summary.py bench/results/aes_cpu-frozen-encoder.json \\
        bench/results/aes_cpu-frozen-encoder-seed1.json bench/results/aes_cpu-frozen-encoder-seed2.json

Each input is a results file of ``mhmla-train aes`` (seed 0 is the main file; the others come
from ``mhmla-train aes --seed S --results ...``, see ``training/aes_cpu.sh``). For every model
present in all inputs, with the same folds and prompts::

    per_seed[s] = mean over the 8 prompts of (mean over the 5 folds of test QWK)   (run s)
    mean = (1/S) sum_s per_seed[s],   std = sqrt((1/(S-1)) sum_s (per_seed[s] - mean)^2)

and the same per prompt. Models whose settings differ in anything but the seed are refused
(they are not seeds of one model). Deterministic models (ridge, TF-IDF, surface) have std 0 by
construction and are listed only when every input holds them.

JSON (``--out``, default ``bench/results/aes_cpu-frozen-encoder-seeds.json``): ``inputs`` (path,
seed, commit of each), ``models`` (per model: ``per_seed``, ``mean``, ``std``, ``min``, ``max``,
``per_prompt`` {prompt: {mean, std}}), ``provenance``. A table is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "aes_cpu-frozen-encoder-seeds.json"


def _seed_of(result: dict) -> int:
    return int(result.get("head_overrides", {}).get("seed", 0))


def without_seed(settings: dict) -> dict:
    """A model's settings but its seed (runs of one model differ in nothing else)."""
    return {k: v for k, v in settings.items() if k != "seed"}


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def summarise(results: Sequence[dict]) -> dict[str, Any]:
    """The per-model seed statistics of ``results`` (see the module doc); raises ValueError when
    the runs are not comparable (folds, prompts, a model's settings) or repeat a seed."""
    if len(results) < 2:
        raise ValueError("need at least two runs")
    seeds = [_seed_of(r) for r in results]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"runs repeat a seed: {seeds}")
    first = results[0]
    for r in results[1:]:
        if r["folds"] != first["folds"] or r["prompts"] != first["prompts"]:
            raise ValueError("runs differ in folds or prompts")
    common = [m for m in first["models"] if all(m in r["models"] for r in results)]
    models: dict[str, Any] = {}
    for m in common:
        ref = without_seed(first["models"][m]["settings"])
        for r in results[1:]:
            if without_seed(r["models"][m]["settings"]) != ref:
                raise ValueError(f"{m}: settings differ in more than the seed")
        per_seed = [r["models"][m]["mean_qwk"] for r in results]
        per_prompt = {}
        for p in first["models"][m]["per_prompt_qwk"]:
            v = [r["models"][m]["per_prompt_qwk"][p] for r in results]
            per_prompt[p] = {k: x for k, x in _spread(v).items() if k in ("mean", "std")}
        models[m] = {"per_seed": dict(zip(map(str, seeds), per_seed)), **_spread(per_seed),
                     "per_prompt": per_prompt}
    return {"seeds": seeds, "folds": first["folds"], "prompts": first["prompts"],
            "models": models}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Seed variance of the AES CPU protocol.")
    p.add_argument("inputs", nargs="+", help="results files of mhmla-train aes (one per seed)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="summary JSON")
    args = p.parse_args(argv)
    from mhmla_fast.provenance import provenance

    try:
        results = [json.loads(Path(x).read_text()) for x in args.inputs]
        summary = summarise(results)
    except (OSError, ValueError, KeyError) as err:
        print(f"aes_seed_summary: {err}", file=sys.stderr)
        return 2
    summary["inputs"] = [{"path": x, "seed": _seed_of(r), "commit": r["provenance"]["commit"]}
                         for x, r in zip(args.inputs, results)]
    summary["provenance"] = provenance()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{'model':<18} {'mean QWK %':>10} {'std':>6}   per seed")
    for m, s in summary["models"].items():
        seeds = "  ".join(f"{100 * v:.2f}" for v in s["per_seed"].values())
        print(f"{m:<18} {100 * s['mean']:>10.2f} {100 * s['std']:>6.2f}   {seeds}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
