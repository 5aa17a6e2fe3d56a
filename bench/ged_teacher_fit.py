"""How closely a distillation teacher's probabilities on the training words follow their gold
labels (``mhmla-train ged --teacher``): a teacher that has memorised its training sentences
gives back little beyond the labels (``mhmla_fast.ged.crossfit``).

    python bench/ged_teacher_fit.py --train ../shared/data/fce/fce-public.train.original.tsv \\
        --probs "last, 1 epoch=runs/STUDENT/teacher_probs.safetensors" ... --out FILE.json

Per teacher, over every training word, q the teacher's error probability and y the gold label:
precision, recall and F0.5 of ``q > 0.5``, mean |q - y|, and the mean binary entropy of q
(nats). Written: ``--out`` (JSON, with provenance) and one line per teacher on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import numpy as np


def fit(q: np.ndarray, gold: np.ndarray) -> dict[str, float]:
    """The statistics of the module doc for probabilities ``q`` and labels ``gold`` [words]."""
    from mhmla_fast.ged.metrics import ged_scores

    scores = ged_scores(gold.astype(np.int64), (q > 0.5).astype(np.int64))
    qc = np.clip(q.astype(np.float64), 1e-12, 1 - 1e-12)
    entropy = float(np.mean(-(qc * np.log(qc) + (1 - qc) * np.log(1 - qc))))
    return {"precision": scores.precision, "recall": scores.recall, "f05": scores.f05,
            "mean_abs_q_minus_gold": float(np.mean(np.abs(q - gold))), "mean_entropy": entropy}


def main(argv: Sequence[str] | None = None) -> int:
    from safetensors.numpy import load_file

    from mhmla_fast.ged.data import read_ged

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", required=True, help="the training file the teachers labelled")
    ap.add_argument("--probs", action="append", required=True,
                    help="LABEL=PATH of a run folder's teacher_probs.safetensors (repeatable)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    sentences = read_ged(args.train)
    gold = np.array([y for s in sentences for y in s.labels], dtype=np.float32)
    counts = [len(s.labels) for s in sentences]
    rows = {}
    for item in args.probs:
        label, sep, path = item.partition("=")
        if not sep:
            ap.error(f"--probs: expected LABEL=PATH, got {item!r}")
        saved = load_file(path)
        if saved["counts"].tolist() != counts:
            ap.error(f"{path}: the probabilities of other sentences than {args.train}")
        rows[label] = {"file": path, **fit(saved["probs"], gold)}
        r = rows[label]
        print(f"{label}: F0.5 {r['f05']:.4f} (P {r['precision']:.4f} R {r['recall']:.4f}), "
              f"mean |q - y| {r['mean_abs_q_minus_gold']:.4f}, entropy {r['mean_entropy']:.4f}")
    from mhmla_fast.provenance import provenance

    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python", *sys.argv]), "train": args.train,
                   "words": int(gold.size), "teachers": rows, "provenance": provenance()},
                  f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
