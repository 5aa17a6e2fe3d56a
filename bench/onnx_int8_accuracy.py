"""The int8 ONNX graph against the fp32 one on GED data: F0.5 change, label agreement,
probability differences and speed.

    python bench/onnx_int8_accuracy.py [--model DIR] [--data FILE ...] [--threads N] [--out JSON]

The model (default: the shipped tagger) is exported with ``export_onnx(int8=True)`` into a
scratch folder, validated as ``mhmla-serve export --onnx DIR --int8`` validates it
(``Int8Tolerance``); a failed validation is recorded, and the graph is then exported again
without validation so that what it costs can still be measured. Per data file (default FCE
dev and test), both graphs tag every sentence through ``Engine.load(backend="onnx")``; the
script records F0.5 at the model's threshold and at 0.5, the share of words whose label
at the threshold agrees, the max, mean and 99.9th percentile of the word probability
differences, and sentences/s (best of ``--repeats`` timed passes after a warm-up, on
``--threads`` threads). Run it with nothing else on the CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO_ROOT / "mhmla_fast" / "models" / "ged-minilm-mhmla12"


def _default_data() -> list[str]:
    from mhmla_fast.paths import shared_data_dir

    fce = shared_data_dir() / "fce"
    return [str(fce / "fce-public.dev.original.tsv"), str(fce / "fce-public.test.original.tsv")]


def export(model: Path, out: Path) -> dict:
    """Export both graphs into ``out``; the int8 validation's report or its error."""
    from mhmla_fast.serve.onnx_export import EXPORT_META, ExportValidationError, export_onnx

    try:
        export_onnx(model, out, int8=True)
    except ExportValidationError as err:
        export_onnx(model, out, int8=True, validate=False)
        return {"passed": False, "error": str(err)}
    meta = json.loads((out / EXPORT_META).read_text())["int8"]
    report = {k: v for k, v in meta["validation"].items() if k != "batches"}
    return {"passed": True, "quantisation": {k: meta[k] for k in meta if k not in
                                             ("validation", "fp32_nodes")}, **report}


def measure(engine, sentences: Sequence[Sequence[str]], repeats: int) -> tuple[np.ndarray, float]:
    """Word probabilities (one flat array) and the best sentences/s over ``repeats`` passes."""
    engine.word_probs(sentences[:128])  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        probs = engine.word_probs(sentences)
        best = min(best, time.perf_counter() - t)
    return np.concatenate(probs), len(sentences) / best


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="int8 against fp32 ONNX on GED data.")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="tagger directory")
    p.add_argument("--data", nargs="+", default=None, help="GED files (default FCE dev, test)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None,
                   help="JSON (default bench/results/serve_cpu_onnx_int8_<date>.json)")
    args = p.parse_args(argv)

    from mhmla_fast.ged.data import read_ged
    from mhmla_fast.ged.metrics import ged_scores
    from mhmla_fast.provenance import provenance
    from mhmla_fast.serve.engine import Engine

    out = Path(args.out or REPO_ROOT / "bench" / "results" /
               f"serve_cpu_onnx_int8_{datetime.date.today().isoformat()}.json")
    result = {**provenance(), "model": str(Path(args.model)), "threads": args.threads,
              "repeats": args.repeats, "sets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        result["int8_validation"] = export(Path(args.model), Path(tmp))
        print("int8 validation:", "passed" if result["int8_validation"]["passed"] else
              result["int8_validation"]["error"], flush=True)
        engines = {dtype: Engine.load(tmp, backend="onnx", dtype=dtype, threads=args.threads)
                   for dtype in ("float32", "int8")}
        threshold = engines["float32"].threshold
        result["threshold"] = threshold
        for path in args.data or _default_data():
            sentences = read_ged(path)
            gold = np.concatenate([np.asarray(s.labels) for s in sentences])
            words = [s.tokens for s in sentences]
            rows, probs = {}, {}
            for dtype, engine in engines.items():
                probs[dtype], speed = measure(engine, words, args.repeats)
                f05 = {t: 100 * ged_scores(gold, (probs[dtype] >= t).astype(int)).f05
                       for t in (threshold, 0.5)}
                rows[dtype] = {"sentences_per_s": speed, "f05_at_threshold": f05[threshold],
                               "f05_at_0.5": f05[0.5]}
            d = np.abs(probs["int8"].astype(np.float64) - probs["float32"])
            entry = {"sentences": len(sentences), "words": int(gold.size), **rows,
                     "int8_speedup": rows["int8"]["sentences_per_s"]
                     / rows["float32"]["sentences_per_s"],
                     "f05_change_at_threshold": rows["int8"]["f05_at_threshold"]
                     - rows["float32"]["f05_at_threshold"],
                     "f05_change_at_0.5": rows["int8"]["f05_at_0.5"] - rows["float32"]["f05_at_0.5"],
                     "label_agreement_at_threshold": float(
                         ((probs["int8"] >= threshold) == (probs["float32"] >= threshold)).mean()),
                     "prob_diff": {"max": float(d.max()), "mean": float(d.mean()),
                                   "p99.9": float(np.quantile(d, 0.999))}}
            name = Path(path).name
            result["sets"][name] = entry
            print(f"{name}: int8 {entry['int8_speedup']:.2f}x fp32 "
                  f"({rows['int8']['sentences_per_s']:.0f} vs {rows['float32']['sentences_per_s']:.0f}"
                  f" sentences/s), F0.5 at threshold {rows['float32']['f05_at_threshold']:.2f} -> "
                  f"{rows['int8']['f05_at_threshold']:.2f}, labels agree "
                  f"{100 * entry['label_agreement_at_threshold']:.2f}%", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
