"""How often a scorer's advisories fire on real essays: per fold split and margin.

    python bench/aes_advisories.py                       # the shipped scorer, fold 0, margins 0 0.1 0.25
    python bench/aes_advisories.py --model DIR --folds 0 1 --out bench/results/aes_advisories.json

``mhmla_fast.aes.scoring.surface_advisories`` flags an essay whose surface features lie beyond
its prompt's training range (the scorer's ``surface_bounds``) by more than ``margin`` x the
range's width. For each fold, split (dev, test) and margin this counts the essays of the ASAP
folds (``$MHMLA_SHARED_DATA`` or ``../shared/data``; research data, read in place) that get one,
and which features fire. Only the shipped scorer's fold (its bounds are fold 0's training
split's) tells the rate on unseen essays: another fold's dev and test hold fold 0's training
essays, inside the bounds by construction. Also the essays the review found scored at the
top of prompts 4 and 5 (one word repeated), which must all get one. No encoder runs: surface
features only, seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="aes_advisories.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a scorer folder (default: the shipped scorer)")
    p.add_argument("--data-dir", default=os.environ.get("MHMLA_SHARED_DATA", str(REPO_ROOT.parent / "shared" / "data")))
    p.add_argument("--folds", nargs="+", type=int, default=[0])
    p.add_argument("--margins", nargs="+", type=float, default=[0.0, 0.1, 0.25])
    p.add_argument("--out", default=str(REPO_ROOT / "bench" / "results" / "aes_advisories_fold0.json"))
    args = p.parse_args(argv)

    from mhmla_fast.aes.data import read_asap, read_folds, split_essays
    from mhmla_fast.aes.scoring import ADVISORY_MARGIN, default_model_path, read_scorer_config, surface_advisories
    from mhmla_fast.provenance import provenance

    model = Path(args.model) if args.model else default_model_path()
    try:
        config = read_scorer_config(model)
    except (OSError, ValueError) as e:
        print(f"aes_advisories.py: {e}", file=sys.stderr)
        return 2
    bounds = {int(p): v for p, v in (config.get("surface_bounds") or {}).items()}
    if not bounds:
        print(f"{model}: a scorer without surface_bounds gives no advisories", file=sys.stderr)
        return 2
    data = Path(args.data_dir) / "asap_aes"
    essays = read_asap(data / "training_set_rel3.nea_utf8.tsv")
    folds = read_folds(data / "nea_folds")
    rows = []
    for fold in args.folds:
        split = split_essays(essays, folds, fold)
        for name in ("dev", "test"):
            texts, prompts = [e.text for e in split[name]], [e.prompt for e in split[name]]
            for margin in args.margins:
                flagged = surface_advisories(texts, prompts, bounds, margin)
                features = Counter(a["feature"] for f in flagged for a in f)
                rows.append({"fold": fold, "split": name, "margin": margin, "essays": len(texts),
                             "with_advisories": sum(bool(f) for f in flagged),
                             "features": dict(features.most_common())})
                print(f"fold {fold} {name:4s} margin {margin:<5} {rows[-1]['with_advisories']:4d} of "
                      f"{len(texts)}  {dict(features.most_common(4))}")
    repeated = [(w, n, p) for w in ("the", "a", "because") for n in (100, 300, 510) for p in (4, 5)]
    got = surface_advisories([" ".join([w] * n) for w, n, _ in repeated], [p for *_, p in repeated],
                             bounds, ADVISORY_MARGIN)
    degenerate = {"essays": len(repeated), "with_advisories": sum(bool(g) for g in got),
                  "margin": ADVISORY_MARGIN, "texts": "one word (the, a, because) x 100, 300, 510 "
                                                      "on prompts 4 and 5"}
    print(f"one word repeated: {degenerate['with_advisories']} of {degenerate['essays']} get an advisory "
          f"at margin {ADVISORY_MARGIN}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "aes_advisories", "model": str(model.name),
                               "default_margin": ADVISORY_MARGIN, "rows": rows,
                               "one_word_repeated": degenerate, "provenance": provenance()},
                              indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
