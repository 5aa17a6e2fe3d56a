"""Could bf16 with an fp32 re-check make CPU tagging both exact and fast? Measured, not assumed.

On a CPU with AMX (bf16 matrix units) the Hugging Face pipeline's bf16 setting is fast, while
``mhmla-serve tag``'s exact default stays in fp32 (ONNX Runtime), so issue 11's CPU goal (2x the
pipeline's best setting, whole process, labels identical to torch fp32) was missed there. One
way out: tag in bf16, then re-tag in fp32 every sentence that has a word whose bf16 probability
lies within ``margin`` of the threshold. Labels then equal fp32's wherever bf16 moves no
probability by ``margin`` or more. This script measures what that costs on FCE dev + test:

* how far bf16 moves the word probabilities from torch fp32 (max, quantiles) and how many
  labels it flips;
* per margin, the share of sentences to re-check and the flips a re-check at that margin misses;
* the cascade's seconds in process on fresh engines (the first pass at each batch shape is part
  of a whole-process run): the bf16 pass over all sentences plus the fp32 pass over those near
  the threshold, beside fp32 alone (torch and ONNX Runtime, also fresh);
* the start-up a torch runner pays before its first batch, in fresh interpreters: ``import
  torch``, then the encoder's modelling code (transformers), against ``import onnxruntime``.

    python bench/bf16_label_check_cpu.py --threads 2
    # -> bench/results/bf16_label_check_cpu_<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mhmla_fast.provenance import cpu_info, dated_results_path, load_average, provenance

RESULTS = Path(__file__).resolve().parent / "results"
MARGINS = (0.01, 0.02, 0.03, 0.05, 0.1)
IMPORTS = {
    "python": "pass",
    "torch": "import torch",
    "torch + encoder code": "import torch; from transformers import BertModel",
    "onnxruntime": "import onnxruntime",
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="tagger directory (default: the shipped one)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--import-repeats", type=int, default=3)
    p.add_argument("--margins", type=float, nargs="+", default=list(MARGINS))
    p.add_argument("--data", nargs="+", default=None,
                   help="GED TSV files (default: FCE dev and test under $MHMLA_SHARED_DATA, "
                        "else ../shared/data)")
    p.add_argument("--out", default=None, help="a .json file or a folder (default bench/results)")
    args = p.parse_args(argv)
    if args.data is None:
        fce = Path(os.environ.get("MHMLA_SHARED_DATA", "../shared/data")) / "fce"
        args.data = [str(fce / f"fce-public.{s}.original.tsv") for s in ("dev", "test")]
    if args.import_repeats < 1 or min(args.margins) <= 0:
        p.error("--import-repeats and --margins must be positive")
    return args


def import_seconds(code: str, repeats: int) -> float:
    """Median wall seconds of a fresh interpreter running ``code`` (its start-up included)."""
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        runs.append(time.perf_counter() - t)
    return round(float(np.median(runs)), 3)


def timed_probs(engine, texts) -> tuple[float, list[np.ndarray]]:
    t = time.perf_counter()
    results = engine.tag_texts(texts)
    return time.perf_counter() - t, [np.asarray(r.probs, dtype=np.float32) for r in results]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from mhmla_fast.ged.data import read_ged
    from mhmla_fast.serve.engine import Engine

    texts = [" ".join(s.tokens) for f in args.data for s in read_ged(f)]
    model = args.model
    result = {"benchmark": "bf16_label_check_cpu", "provenance": provenance(), "cpu": cpu_info(),
              "load_average_start": load_average(), "threads": args.threads,
              "data": {"files": [Path(f).name for f in args.data], "sentences": len(texts),
                       "words": sum(len(t.split()) for t in texts)}}
    result["startup_s"] = {name: import_seconds(code, args.import_repeats)
                           for name, code in IMPORTS.items()}

    def fresh(backend: str, dtype: str):
        return Engine.load(model, backend=backend, dtype=dtype, device="cpu",
                           threads=args.threads)

    passes = {}
    eng32 = fresh("torch", "float32")
    passes["torch float32"], p32 = timed_probs(eng32, texts)
    thr = eng32.threshold
    passes["onnxruntime float32 (auto)"], _ = timed_probs(fresh("auto", "float32"), texts)
    passes["torch bfloat16"], p16 = timed_probs(fresh("torch", "bfloat16"), texts)
    dev = np.concatenate([np.abs(a - b) for a, b in zip(p32, p16)])
    flips = [np.flatnonzero((a >= thr) != (b >= thr)) for a, b in zip(p32, p16)]
    result["threshold"] = thr
    result["bf16_vs_fp32"] = {
        "max_abs": float(dev.max()), "q999_abs": float(np.quantile(dev, 0.999)),
        "q99_abs": float(np.quantile(dev, 0.99)), "mean_abs": float(dev.mean()),
        "label_flips": int(sum(len(f) for f in flips)),
        "largest_flipped_deviation": float(max((np.abs(p32[s] - p16[s])[f].max()
                                                for s, f in enumerate(flips) if len(f)),
                                               default=0.0)),
    }
    rows = []
    for margin in sorted(args.margins):
        near = [s for s, p in enumerate(p16) if (np.abs(p - thr) < margin).any()]
        checked = set(near)
        missed = sum(len(f) for s, f in enumerate(flips) if s not in checked)
        # the cascade on fresh engines: bf16 over all, fp32 over the sentences near the threshold
        t16, _ = timed_probs(fresh("torch", "bfloat16"), texts)
        t32, _ = timed_probs(fresh("torch", "float32"), [texts[s] for s in near])
        rows.append({"margin": margin, "sentences_rechecked": len(near),
                     "share_rechecked": round(len(near) / len(texts), 4),
                     "flips_missed": int(missed), "bf16_pass_s": round(t16, 3),
                     "fp32_recheck_s": round(t32, 3), "cascade_s": round(t16 + t32, 3),
                     "cascade_sentences_per_s": round(len(texts) / (t16 + t32), 1)})
        print(f"margin {margin}: {len(near)} re-checked, {missed} flips missed, "
              f"{t16 + t32:.2f} s", file=sys.stderr, flush=True)
    result["first_pass_s"] = {k: round(v, 3) for k, v in passes.items()}
    result["first_pass_sentences_per_s"] = {k: round(len(texts) / v, 1) for k, v in passes.items()}
    result["cascade"] = rows
    result["load_average_end"] = load_average()
    out = dated_results_path(args.out, "bf16_label_check_cpu", RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("startup_s", "first_pass_sentences_per_s",
                                             "bf16_vs_fp32")}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
