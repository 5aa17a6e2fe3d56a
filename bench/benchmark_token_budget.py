"""Seconds per call against the token budget (padded word pieces per forward pass), in process:
the tagging ``Engine`` on FCE dev + test and the essay scorer on ASAP essays, for each runtime
and dtype asked, every budget repeated in turn (interleaved, so that a slow spell of a shared
machine hits every budget alike).

    python bench/benchmark_token_budget.py --budgets 512 1024 2048 8192 --repeats 7
    # -> bench/results/token_budget_<device>_<date>.json

For each (path, budget): the seconds of every repeat, their median and minimum, items/s at the
median, and the speed-up of each budget's median over the reference budget (``--reference``,
default 8192) computed repeat by repeat (the median of the paired ratios). The outputs of every
budget are checked against the reference budget's: tags must be identical word by word, scores
identical essay by essay; the file records the counts that differ. The defaults of
``options.TOKEN_BUDGETS`` come from these figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mhmla_fast.provenance import cpu_info, dated_results_path, load_average

RESULTS = Path(__file__).resolve().parent / "results"
TAG_PATHS = ("auto-float32", "torch-float32", "torch-bfloat16")  # auto on the CPU: ONNX Runtime
SCORE_PATHS = ("auto-float32",)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048, 8192])
    p.add_argument("--reference", type=int, default=8192, help="the budget ratios are against")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--tag-paths", nargs="*", default=list(TAG_PATHS), choices=TAG_PATHS)
    p.add_argument("--score-paths", nargs="*", default=list(SCORE_PATHS), choices=SCORE_PATHS)
    p.add_argument("--essays", type=int, default=300, help="ASAP essays sampled (seed 0)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data", default=os.environ.get("MHMLA_SHARED_DATA", "../shared/data"))
    p.add_argument("--out", default=None, help="a .json file or a folder (default bench/results)")
    args = p.parse_args(argv)
    if args.reference not in args.budgets:
        p.error(f"--reference {args.reference} must be one of --budgets")
    if args.repeats < 1 or min(args.budgets) < 1:
        p.error("--repeats and --budgets must be positive")
    return args


def fce_texts(data: Path) -> list[str]:
    """FCE dev + test sentences, tokens joined by spaces (what ``mhmla-serve tag`` reads)."""
    from mhmla_fast.ged.data import read_ged

    out = []
    for name in ("fce-public.dev.original.tsv", "fce-public.test.original.tsv"):
        out += [" ".join(s.tokens) for s in read_ged(data / "fce" / name)]
    return out


def asap_sample(data: Path, n: int) -> tuple[list[str], list[int]]:
    from mhmla_fast.aes.data import read_asap

    essays = read_asap(data / "asap_aes" / "training_set_rel3.nea_utf8.tsv")
    sample = random.Random(0).sample(list(essays), min(n, len(essays)))
    return [e.text for e in sample], [int(e.prompt) for e in sample]


def tag_runs(path: str, args, texts):
    """``{budget: (call, outputs)}``: an Engine per budget on one runtime and dtype."""
    from mhmla_fast.serve.engine import Engine

    backend, dtype = path.split("-")
    calls, runners = {}, set()
    for b in args.budgets:
        engine = Engine.load(None, backend=backend, device=args.device, dtype=dtype,
                             threads=args.threads, token_budget=b)
        runners.add(type(engine.runner).__name__)
        calls[b] = lambda e=engine: [r.labels for r in e.tag_texts(texts)]
    return calls, sorted(runners)


def score_runs(path: str, args, texts, prompts):
    from mhmla_fast.serve.score import default_scorer_path, load_scorer

    backend, dtype = path.split("-")
    scorer = load_scorer(default_scorer_path(), backend=backend, device=args.device,
                         dtype=dtype, threads=args.threads)
    return {b: (lambda b=b: [int(s) for s in scorer.predict_scores(texts, prompts,
                                                                    token_budget=b)])
            for b in args.budgets}, [type(scorer).__name__]


def measure(made: tuple[dict, list], repeats: int, reference: int, items: int, differ) -> dict:
    """Interleaved repeats of every budget's call (``made``: the calls by budget, and the
    runtime classes behind them); rows per budget (see the module doc)."""
    calls, runtime = made
    outputs = {b: call() for b, call in calls.items()}  # warm-up, and the outputs compared
    seconds = {b: [] for b in calls}
    for _ in range(repeats):
        for b, call in calls.items():
            t = time.perf_counter()
            call()
            seconds[b].append(time.perf_counter() - t)
    rows = []
    for b, s in seconds.items():
        paired = [r / x for r, x in zip(seconds[reference], s)]
        rows.append({"token_budget": b, "seconds": [round(x, 4) for x in s],
                     "median_s": round(statistics.median(s), 4), "min_s": round(min(s), 4),
                     "items_per_s": round(items / statistics.median(s), 1),
                     "speedup_vs_reference": round(statistics.median(paired), 3),
                     "differ_from_reference": differ(outputs[reference], outputs[b])})
    return {"runtime": runtime, "rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from mhmla_fast.provenance import provenance

    data = Path(args.data)
    result = {"benchmark": "token_budget", "provenance": provenance(),
              "cpu": cpu_info(), "load_average_start": load_average(),
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, "paths": {}}
    texts = fce_texts(data)
    words = sum(len(t.split()) for t in texts)
    result["data"] = {"tag": {"sentences": len(texts), "words": words}}

    def word_diff(a, b):
        return sum(x != y for r, s in zip(a, b) for x, y in zip(r, s))

    for path in args.tag_paths:
        print(f"tag {path} ...", file=sys.stderr, flush=True)
        result["paths"][f"tag {path}"] = measure(tag_runs(path, args, texts), args.repeats,
                                                 args.reference, len(texts), word_diff)
    if args.score_paths:
        essays, prompts = asap_sample(data, args.essays)
        result["data"]["score"] = {"essays": len(essays), "prompts": sorted(set(prompts))}
        for path in args.score_paths:
            print(f"score {path} ...", file=sys.stderr, flush=True)
            result["paths"][f"score {path}"] = measure(
                score_runs(path, args, essays, prompts), args.repeats, args.reference,
                len(essays), lambda a, b: sum(x != y for x, y in zip(a, b)))
    result["load_average_end"] = load_average()
    out = dated_results_path(args.out, f"token_budget_{args.device}", RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for name, r in result["paths"].items():
        for row in r["rows"]:
            print(f"{name:22s} budget {row['token_budget']:6d}: median {row['median_s']:.3f} s, "
                  f"{row['speedup_vs_reference']:.3f}x vs {args.reference}, "
                  f"{row['differ_from_reference']} differ")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
