"""Seconds of ``fit_cutpoints`` against an earlier revision's, on the protocol's own inputs.

    python bench/aes_fit_cutpoints_cpu.py --units runs/aes-cpu/units --fold 0 \\
        --reference-rev cc5cba8^ --out bench/results/aes_fit_cutpoints_cpu_2026-12-07.json

For every cut unit of ``--fold`` in a CPU protocol run folder (``<model>-fold<k>-p<p>.json``
with continuous predictions), the cutpoints are fitted on the unit's out-of-fold training
predictions and the training essays' gold scores (read from ``--data-dir``) by this tree's
``mhmla_fast.aes.cutpoints.fit_cutpoints`` and by the one of ``--reference-rev`` (its
``cutpoints.py`` read with ``git show`` and loaded as a module of its own, with this tree's
other modules), one after the other in one process. Rows: seconds of each per unit, whether
the cutpoints are identical, and the totals. CPU only; the JSON names the device, versions
and commit.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

UNIT = re.compile(r"^(?P<name>.+-cuts)-fold(?P<fold>\d+)-p(?P<prompt>\d)\.json$")


def load_reference(rev: str):
    """The ``mhmla_fast.aes.cutpoints`` module of git revision ``rev``, loaded as
    ``mhmla_fast.aes._cutpoints_reference`` (its relative imports resolve in this tree)."""
    source = subprocess.run(["git", "show", f"{rev}:mhmla_fast/aes/cutpoints.py"], check=True,
                            capture_output=True, text=True).stdout
    name = "mhmla_fast.aes._cutpoints_reference"
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "mhmla_fast.aes"
    exec(compile(source, f"{rev}:mhmla_fast/aes/cutpoints.py", "exec"), module.__dict__)
    return module


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--units", required=True, help="a CPU protocol run's units folder")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--reference-rev", required=True, help="git revision of the reference")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import mhmla_fast.aes  # noqa: F401 - the package the reference's imports resolve in
    from mhmla_fast.aes.cutpoints import fit_cutpoints
    from mhmla_fast.aes.data import split_essays
    from mhmla_fast.aes.splits import read_asap_folds
    from mhmla_fast.provenance import provenance

    reference = load_reference(args.reference_rev)
    essays, folds = read_asap_folds(args.data_dir)
    rows = []
    for path in sorted(Path(args.units).iterdir()):
        m = UNIT.match(path.name)
        if not m or int(m["fold"]) != args.fold:
            continue
        unit = json.loads(path.read_text())
        if "continuous" not in unit:
            continue
        prompt = int(m["prompt"])
        gold = np.array([e.score for e in split_essays(essays, folds, args.fold,
                                                        prompt=prompt)["train"]])
        x = np.array(unit["continuous"]["train_oof"])
        t0 = time.perf_counter()
        new = fit_cutpoints(x, gold, prompt)
        t1 = time.perf_counter()
        old = reference.fit_cutpoints(x, gold, prompt)
        t2 = time.perf_counter()
        rows.append({"unit": path.name, "prompt": prompt, "essays": int(gold.size),
                     "seconds": t1 - t0, "reference_seconds": t2 - t1,
                     "identical": bool(np.array_equal(new, old))})
        print(f"{path.name}: {t1 - t0:.3f} s against {t2 - t1:.3f} s, identical "
              f"{rows[-1]['identical']}", flush=True)
    if not rows:
        print(f"no cut units of fold {args.fold} in {args.units}", file=sys.stderr)
        return 1
    total, ref = sum(r["seconds"] for r in rows), sum(r["reference_seconds"] for r in rows)
    result = {"units": args.units, "fold": args.fold, "reference_rev": args.reference_rev,
              "rows": rows, "total_seconds": total, "reference_total_seconds": ref,
              "speedup": ref / total, "all_identical": all(r["identical"] for r in rows),
              "provenance": provenance()}
    print(f"{len(rows)} units: {total:.2f} s against {ref:.2f} s ({ref / total:.1f}x), "
          f"identical {result['all_identical']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
