"""Issue 11's training check: does fast GPU training reach the same dev F0.5 as the recipe's
runs, within seed noise? From the ``log.json`` of GPU runs and the ged-suite files of reference
runs (the same recipe, other hardware).

    python bench/ged_gpu_seed_check.py \\
        --runs 'bench/results/gpu_2026-11-27b/train_real_seed*_log.json' \\
        --header bench/results/gpu_2026-11-27b/tag_engine_real.json \\
        --reference 'bench/results/ged_table2_cpu_bf16/ged_minilm_mhmla_seed*.json' \\
        --out bench/results/gpu_2026-11-27b/ged_gpu_seed_check.json

Per run (``..._seed<k>_log.json``, the seed from the name): the selected epoch's dev F0.5 (the
first epoch of highest dev F0.5, as training selects it), every epoch's F0.5, seconds, seconds
of steps (``train_seconds``) and sentences/s of steps. Per reference file: ``training.dev.f05``,
the dev F0.5 of the epoch that run selected. In points, over the S runs of each side::

    mean = (1/S) sum_s x_s,   std = sqrt(sum_s (x_s - mean)^2 / (S - 1))
    Welch's t-test (scipy.stats.ttest_ind, equal_var=False), two-sided: the sides are not
    paired (same seeds, different hardware and kernels, so different random streams)

and the median over runs of the warm epochs' (every epoch but the first, which compiles)
seconds of steps: the figure issue 11's epoch goal (<= 5 s) is about. ``--header``: a
benchmark_serve JSON of the same device call, whose header (device, versions, commit) the
output repeats. Written: ``--out`` JSON; a summary is printed.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _files(pattern: str) -> list[Path]:
    paths = sorted(Path(p) for p in glob.glob(pattern))
    if not paths:
        raise SystemExit(f"no file matches {pattern!r}")
    return paths


def _seed(path: Path) -> int:
    m = re.search(r"seed(\d+)", path.name)
    if m is None:
        raise SystemExit(f"{path}: no seed<k> in the file name")
    return int(m.group(1))


def run_row(path: Path) -> dict[str, Any]:
    """A GPU run's selected dev F0.5 and its epochs' times, in points and seconds."""
    log = json.loads(path.read_text())
    epochs = [e for e in log if "dev" in e]
    if not epochs:
        raise SystemExit(f"{path}: no finished epoch")
    f05 = [100 * e["dev"]["f05"] for e in epochs]
    best = max(range(len(f05)), key=lambda k: (f05[k], -k))  # the first best, as training keeps
    return {"path": str(path), "seed": _seed(path), "epochs": len(epochs),
            "selected_epoch": epochs[best]["epoch"], "dev_f05": f05[best], "dev_f05_per_epoch": f05,
            "seconds": [e["seconds"] for e in epochs],
            "train_seconds": [e.get("train_seconds") for e in epochs],
            "train_sentences_per_s": [e.get("train_sentences_per_s") for e in epochs]}


def reference_row(path: Path) -> dict[str, Any]:
    suite = json.loads(path.read_text())
    training = suite.get("training") or {}
    if "dev" not in training:
        raise SystemExit(f"{path}: no training.dev (not a ged-suite file of a trained run)")
    return {"path": str(path), "seed": int(training["config"]["seed"]),
            "selected_epoch": training.get("epoch"), "dev_f05": 100 * training["dev"]["f05"],
            "device": suite.get("device"), "commit": suite.get("commit")}


def spread(values: Sequence[float]) -> dict[str, Any]:
    return {"n": len(values), "mean": statistics.mean(values),
            "std": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values), "max": max(values), "per_seed": list(values)}


def check(runs: list[dict], reference: list[dict]) -> dict[str, Any]:
    """Both sides' dev F0.5 spread, Welch's test between them, the warm epochs' step times."""
    from scipy import stats

    a = [r["dev_f05"] for r in runs]
    b = [r["dev_f05"] for r in reference]
    out: dict[str, Any] = {"gpu_dev_f05": spread(a), "reference_dev_f05": spread(b)}
    if len(a) > 1 and len(b) > 1:
        t = stats.ttest_ind(a, b, equal_var=False)
        out["welch"] = {"difference": statistics.mean(a) - statistics.mean(b),
                        "t": float(t.statistic), "p": float(t.pvalue),
                        "verdict": "no significant difference at 5%" if t.pvalue >= 0.05
                        else ("GPU higher" if t.statistic > 0 else "GPU lower") + " at 5%"}
    warm = [s for r in runs for s in r["train_seconds"][1:] if s is not None]
    if warm:
        out["warm_epoch_train_seconds"] = {"median": statistics.median(warm), "min": min(warm),
                                           "max": max(warm), "n": len(warm)}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", required=True, help="glob of the GPU runs' log.json copies")
    p.add_argument("--reference", required=True, help="glob of the reference ged-suite files")
    p.add_argument("--header", help="a benchmark_serve JSON of the same device call")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    runs = [run_row(f) for f in _files(args.runs)]
    reference = [reference_row(f) for f in _files(args.reference)]
    header = json.loads(Path(args.header).read_text())["header"] if args.header else None
    result = {"header": header, "command": "python bench/ged_gpu_seed_check.py " + " ".join(
        sys.argv[1:] if argv is None else argv), "unit": "F0.5 in points; seconds",
        "runs": runs, "reference": reference, **check(runs, reference)}
    Path(args.out).write_text(json.dumps(result, indent=1))
    g, r = result["gpu_dev_f05"], result["reference_dev_f05"]
    print(f"GPU dev F0.5 {g['mean']:.2f} ± {g['std'] or 0:.2f} over {g['n']} seeds; "
          f"reference {r['mean']:.2f} ± {r['std'] or 0:.2f} over {r['n']}")
    if "welch" in result:
        w = result["welch"]
        print(f"difference {w['difference']:+.2f}, Welch p = {w['p']:.3f}: {w['verdict']}")
    if "warm_epoch_train_seconds" in result:
        s = result["warm_epoch_train_seconds"]
        print(f"warm epochs' steps: median {s['median']:.2f} s ({s['min']:.2f}-{s['max']:.2f}, "
              f"{s['n']} epochs)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
