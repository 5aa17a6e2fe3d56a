"""``mhmla-serve score`` on one very long essay against the same words as ordinary essays.

    python bench/benchmark_long_essay.py                  # 100 essays of 300 words; one of 30,000; one of 150,000
    python bench/benchmark_long_essay.py --out /tmp/x.json

Issue 14: a 5 MB essay used to make ``score`` crawl with a growing peak and a false "indexing
errors" warning. Each row runs the whole command (``/usr/bin/time -v`` for the peak resident
set), on JSONL written to a temporary folder: 100 essays of 300 words drawn from FCE test's
vocabulary, the same words as one essay, and one essay five times longer. Reports wall time,
peak RSS, whether the warning appeared, and the exit status. The shipped scorer, CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_score(jsonl: Path, threads: int) -> dict:
    out = jsonl.with_suffix(".out.jsonl")
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", "mhmla-serve", "score", str(jsonl), "--output", str(out),
                           "--no-progress", "--threads", str(threads)], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    return {"seconds": round(seconds, 2), "peak_rss_mib": round(int(rss.group(1)) / 1024, 1) if rss else None,
            "indexing_warning": "indexing errors" in proc.stderr, "exit_status": proc.returncode,
            "records_out": sum(1 for _ in out.open()) if out.exists() else 0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmark_long_essay.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="results .json file or folder (default bench/results/)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    from mhmla_fast.paths import shared_data_dir
    from mhmla_fast.provenance import dated_results_path, provenance

    rng = random.Random(0)
    data = shared_data_dir() / "fce" / "fce-public.test.original.tsv"
    vocab = [line.split("\t")[0] for line in data.read_text().splitlines() if "\t" in line]
    short = [" ".join(rng.choice(vocab) for _ in range(300)) for _ in range(100)]
    cases = {"100 essays x 300 words": [{"id": i, "prompt": 1, "text": t} for i, t in enumerate(short)],
             "1 essay x 30,000 words": [{"id": 0, "prompt": 1, "text": " ".join(short)}],
             "1 essay x 150,000 words": [{"id": 0, "prompt": 1,
                                          "text": " ".join(rng.choice(vocab) for _ in range(150_000))}]}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, records in cases.items():
            path = Path(tmp) / (re.sub(r"\W+", "_", name) + ".jsonl")
            path.write_text("".join(json.dumps(r) + "\n" for r in records))
            row = {"input": name, "chars": sum(len(r["text"]) for r in records), **run_score(path, args.threads)}
            rows.append(row)
            print(f"{name:26s} {row['chars']:9d} chars  {row['seconds']:7.1f} s  peak {row['peak_rss_mib']} MiB  "
                  f"warning {row['indexing_warning']}  exit {row['exit_status']}", flush=True)
    out = dated_results_path(args.out, "long_essay_cpu", REPO_ROOT / "bench" / "results", datetime.date.today())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "long_essay", "header": {**provenance(), "threads": args.threads,
                                                                     "vocabulary": str(data)},
                               "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if all(r["exit_status"] == 0 and not r["indexing_warning"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
