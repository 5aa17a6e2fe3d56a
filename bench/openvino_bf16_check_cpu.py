"""The checked bf16 pass on the CPU: how far OpenVINO bf16 moves the tagger's probabilities, what
a re-check margin costs and misses, and its speed in process. Measured, not assumed.

Backend auto's default on a CPU with AMX (``mhmla_fast.serve.openvino_runner.checked_runner``)
runs each pass in OpenVINO bf16 and tags again in ONNX Runtime fp32 every row with a word piece
whose bf16 probability lies within a margin of the threshold. Its labels are fp32's wherever
bf16 moved no probability by the margin or more. Per data set this script records, against
ONNX Runtime fp32 on the same export (the exact CPU path, validated against torch fp32):

* ``bf16_vs_fp32``: bf16 alone (margin 0): max, quantiles and mean of |p_bf16 - p_fp32| over
  the words, and the labels it flips at the model's threshold;
* ``checked``: per margin, the rows re-run in fp32 (share) and the labels that still differ from
  fp32 (the flips the margin missed);

and on the first data set the seconds in process, ``--repeats`` alternating rounds, every
engine with ``--lanes`` passes at a time (what ``mhmla-serve tag`` uses): ONNX Runtime fp32,
OpenVINO bf16 alone, and the checked pass at ``--speed-margin`` (``checked_split``: per round,
the lane-seconds, rows and padded tokens of its fast and exact runners).

    python bench/openvino_bf16_check_cpu.py --threads 2
    # -> bench/results/openvino_bf16_check_cpu_<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mhmla_fast.provenance import cpu_info, dated_results_path, load_average, provenance

RESULTS = Path(__file__).resolve().parent / "results"
MARGINS = (0.03, 0.05)


def shared_data() -> Path:
    return Path(os.environ.get("MHMLA_SHARED_DATA", "../shared/data"))


def default_sets() -> list[str]:
    """FCE dev + test (the speed set), CoNLL-14 (both annotators' union), JFLEG dev and test,
    and the first 10,000 FCE training sentences, as ``name=path[,path]`` specs."""
    d = shared_data()
    return [f"fce_dev_test={d}/fce/fce-public.dev.original.tsv,"
            f"{d}/fce/fce-public.test.original.tsv",
            f"conll14={d}/conll2014/official-2014.combined.m2",
            f"jfleg_dev={d}/jfleg/dev", f"jfleg_test={d}/jfleg/test",
            f"fce_train_10k={d}/fce/fce-public.train.original.tsv:10000"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="tagger directory (default: the shipped one)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lanes", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--margins", type=float, nargs="+", default=list(MARGINS))
    p.add_argument("--speed-margin", type=float, default=0.05)
    p.add_argument("--sets", nargs="+", default=None,
                   help="name=FILE[,FILE...][:N] (GED files read by read_ged; a JFLEG split "
                        "folder; :N keeps the first N sentences); the first is timed "
                        "(default: FCE dev + test, CoNLL-14, JFLEG dev and test, 10,000 FCE "
                        "training sentences, from $MHMLA_SHARED_DATA or ../shared/data)")
    p.add_argument("--out", default=None, help="a .json file or a folder (default bench/results)")
    args = p.parse_args(argv)
    args.sets = args.sets or default_sets()
    if args.repeats < 1 or min(args.margins) <= 0 or not 0 < args.speed_margin < 1:
        p.error("--repeats and --margins must be positive, --speed-margin in (0, 1)")
    return args


def read_set(spec: str) -> tuple[str, list[list[str]], list[str]]:
    """``name=FILE[,FILE...][:N]`` -> (name, token lists, file names)."""
    from mhmla_fast.ged.data import read_ged, read_jfleg_split

    name, _, rest = spec.partition("=")
    files, _, limit = rest.rpartition(":") if rest.rpartition(":")[2].isdigit() else (rest, "", "")
    sentences = []
    for f in files.split(","):
        path = Path(f)
        got = read_jfleg_split(path) if path.is_dir() else read_ged(path)
        sentences += [list(s.tokens) for s in got]
    if limit:
        sentences = sentences[:int(limit)]
    return name, sentences, [Path(f).name for f in files.split(",")]


class Timed:
    """A runner wrapped to add up, over all threads, the seconds spent in it, its calls, rows
    and padded tokens (a checked engine's fast and exact runners: where its time goes)."""

    def __init__(self, runner):
        self.runner, self.lock = runner, threading.Lock()
        self.seconds, self.calls, self.rows, self.tokens = 0.0, 0, 0, 0

    def __call__(self, input_ids, attention_mask):
        t = time.perf_counter()
        out = self.runner(input_ids, attention_mask)
        dt = time.perf_counter() - t
        with self.lock:
            self.seconds += dt
            self.calls += 1
            self.rows += len(input_ids)
            self.tokens += int(np.size(input_ids))
        return out

    def close(self) -> None:
        if hasattr(self.runner, "close"):
            self.runner.close()

    def summary(self) -> dict:
        return {"lane_seconds": round(self.seconds, 3), "calls": self.calls, "rows": self.rows,
                "padded_tokens": self.tokens,
                "us_per_padded_token": round(1e6 * self.seconds / max(self.tokens, 1), 2)}


def word_probs(engine, sentences) -> list[np.ndarray]:
    return [np.asarray(r.probs, dtype=np.float32) for r in engine.tag_tokens(sentences)]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import openvino

    from mhmla_fast.serve.engine import Engine, default_tagger_path
    from mhmla_fast.serve.export_cache import ensure_export

    model = Path(args.model) if args.model else default_tagger_path()
    export = ensure_export(model, threads=args.threads).path
    result = {"benchmark": "openvino_bf16_check_cpu", "provenance": provenance(),
              "cpu": cpu_info(), "load_average_start": load_average(),
              "openvino": openvino.__version__, "model": model.name, "threads": args.threads,
              "lanes": args.lanes, "sets": {}}

    def engine(backend: str, dtype: str, margin: float | None = None):
        kw = {} if margin is None else {"check_margin": margin}
        return Engine.load(export, backend=backend, dtype=dtype, threads=args.threads,
                           lanes=args.lanes, **kw)

    exact = engine("onnx", "float32")
    thr = exact.threshold
    result["threshold"] = thr
    sets = [read_set(spec) for spec in args.sets]
    for name, sentences, files in sets:
        p32 = word_probs(exact, sentences)
        words = int(sum(len(p) for p in p32))
        alone = engine("openvino", "bfloat16", 0.0)
        p16 = word_probs(alone, sentences)
        dev = np.concatenate([np.abs(a - b) for a, b in zip(p32, p16)])
        flips = int(sum(((a >= thr) != (b >= thr)).sum() for a, b in zip(p32, p16)))
        row = {"files": files, "sentences": len(sentences), "words": words,
               "bf16_vs_fp32": {"max_abs": float(dev.max()),
                                "q999_abs": float(np.quantile(dev, 0.999)),
                                "q99_abs": float(np.quantile(dev, 0.99)),
                                "mean_abs": float(dev.mean()), "label_flips": flips},
               "checked": []}
        for margin in sorted(args.margins):
            checked = engine("openvino", "bfloat16", margin)
            got = word_probs(checked, sentences)
            missed = int(sum(((a >= thr) != (b >= thr)).sum() for a, b in zip(p32, got)))
            runner = checked.runner
            row["checked"].append({"margin": margin, "rows": runner.rows,
                                   "rows_rechecked": runner.rechecked,
                                   "share_rechecked": round(runner.rechecked / runner.rows, 4),
                                   "label_flips_missed": missed})
            checked.close()
        result["sets"][name] = row
        print(f"{name}: max |dp| {dev.max():.4f}, {flips} flips alone; "
              + ", ".join(f"margin {c['margin']}: {c['share_rechecked']:.1%} re-checked, "
                          f"{c['label_flips_missed']} missed" for c in row["checked"]),
              file=sys.stderr, flush=True)
    # speed in process on the first set, fresh engines, alternating rounds
    name, sentences, _ = sets[0]
    texts = [" ".join(s) for s in sentences]
    paths = {"onnxruntime float32": ("onnx", "float32", None),
             "openvino bfloat16 alone": ("openvino", "bfloat16", 0.0),
             f"checked bfloat16 (margin {args.speed_margin})": ("openvino", "bfloat16",
                                                               args.speed_margin)}
    seconds: dict[str, list[float]] = {k: [] for k in paths}
    split: list[dict] = []  # per round: the checked engine's time in each runner
    for _ in range(args.repeats):
        for key, (backend, dtype, margin) in paths.items():
            e = engine(backend, dtype, margin)
            timed = margin is not None and margin > 0
            if timed:
                e.runner.fast, e.runner.exact = Timed(e.runner.fast), Timed(e.runner.exact)
            t = time.perf_counter()
            e.tag_texts(texts)
            seconds[key].append(time.perf_counter() - t)
            if timed:
                split.append({"fast": e.runner.fast.summary(),
                              "exact": e.runner.exact.summary()})
            e.close()
    result["speed"] = {"set": name, "sentences": len(texts), "repeats": args.repeats,
                       "note": "fresh engines, so each includes its first passes at new shapes",
                       "seconds": {k: [round(x, 3) for x in v] for k, v in seconds.items()},
                       "sentences_per_s": {k: round(len(texts) / float(np.median(v)), 1)
                                           for k, v in seconds.items()},
                       "checked_split": split}
    result["load_average_end"] = load_average()
    out = dated_results_path(args.out, "openvino_bf16_check_cpu", RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["speed"]["sentences_per_s"], indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
