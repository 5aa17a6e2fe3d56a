"""Word pieces/s of the tagging engine on one long text against the same text as short sentences.

    python bench/benchmark_long_text.py            # FCE test sentences 0..1499, 2 threads, CPU
    python bench/benchmark_long_text.py --sentences 500 --threads 1 --out /tmp/x.json

Issue 14's check: a long record (here all sentences joined into one line of ~110,000
characters) must tag within 1.5x of the pieces/s of short sentences. Both inputs carry the
same words, so the same word pieces; rows alternate short, long, short, long (``--rounds``) so
that a busy neighbour slows both alike, and the summary compares the medians. The shipped
tagger, ``Engine.load(backend="torch", device="cpu", dtype="float32")``, ``tag_texts``. FCE is read from
``$MHMLA_SHARED_DATA`` or ``../shared/data`` and never copied.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 1.5  # long-text pieces/s may be at most this much slower


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmark_long_text.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--sentences", type=int, default=1500)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="results .json file or folder (default bench/results/)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    import datetime

    import torch

    from mhmla_fast.ged.data import read_ged
    from mhmla_fast.paths import shared_data_dir
    from mhmla_fast.provenance import dated_results_path, provenance
    from mhmla_fast.serve.engine import Engine

    torch.set_num_threads(args.threads)
    data = shared_data_dir() / "fce" / "fce-public.test.original.tsv"
    sents = [" ".join(s.tokens) for s in read_ged(data)][: args.sentences]
    long_text = " ".join(sents)
    engine = Engine.load(backend="torch", device="cpu", dtype="float32")
    pieces = sum(len(engine.pieces.encode(t, add_special_tokens=False).ids) for t in sents)
    engine.tag_texts(sents[:50])  # warm-up
    rows = []
    for r in range(args.rounds):
        for name, texts in (("short", sents), ("long", [long_text])):
            t0 = time.perf_counter()
            result = engine.tag_texts(texts)
            dt = time.perf_counter() - t0
            words = sum(len(x.tokens) for x in result)
            rows.append({"round": r, "input": name, "records": len(texts), "words": words,
                         "pieces": pieces, "seconds": round(dt, 3), "pieces_per_s": round(pieces / dt, 1)})
            print(f"{name:5s} round {r}: {dt:6.2f} s  {pieces / dt:8.0f} pieces/s", flush=True)
    med = {k: statistics.median(x["pieces_per_s"] for x in rows if x["input"] == k) for k in ("short", "long")}
    ratio = med["short"] / med["long"]
    summary = {"median_pieces_per_s": med, "short_over_long": round(ratio, 3),
               "target": f"short / long <= {TARGET_RATIO}", "passed": ratio <= TARGET_RATIO,
               "long_text_chars": len(long_text)}
    print(f"median pieces/s: short {med['short']:.0f}, long {med['long']:.0f}; short/long {ratio:.2f} "
          f"(target <= {TARGET_RATIO}: {'PASS' if summary['passed'] else 'FAIL'})")
    out = dated_results_path(args.out, "long_text_cpu", REPO_ROOT / "bench" / "results", datetime.date.today())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "long_text", "header": {**provenance(), "threads": args.threads,
                                                                    "data": str(data), "sentences": len(sents)},
                               "rows": rows, "summary": summary}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
