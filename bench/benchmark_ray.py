"""Sentences/s of ``mhmla-serve tag --ray`` with 1 and 2 local workers against the single-process
CLI, on FCE test (issue 12).

    python bench/benchmark_ray.py                       # shipped tagger, FCE test, CPU
    python bench/benchmark_ray.py --limit 300 --out /tmp/ray.json

Every row is one ``python -m mhmla_fast.commands.serve tag`` process on the same JSONL input
(FCE test sentences as ``{"tokens": [...]}``, read with ``read_ged``, written to a temporary
folder), timed end to end: Python and torch start, Ray start (``--ray``: a local Ray of
``workers * threads`` CPUs), model loads (one per actor), tagging, committing shards and
concatenating them. ``startup_s`` is the same command on a one-sentence input, so
``sentences_per_s_excl_startup`` = sentences / (wall - startup) is the steady rate. Rows:

    cli         single process, ``--threads`` 1 and ``workers`` (the same cores as the Ray rows)
    ray         ``--ray --ray-workers W --threads 1``, W in ``--workers`` (1 2)

Each Ray output is checked against the single-process one: same records, labels equal, max
|P(error) difference| recorded. The result (device, versions, commit, commands) goes to
``bench/results/ray_cpu_<date>.json``. On a shared machine the load average is recorded at the
start and end: neighbours' jobs show there.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mhmla_fast.provenance import (  # noqa: E402
    cpu_info, dated_results_path, git_commit, load_average)

DEFAULT_OUT_DIR = REPO / "bench" / "results"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="GED file (default: FCE test of the shared data)")
    p.add_argument("--model", default=None, help="tagger directory (default: the shipped one)")
    p.add_argument("--limit", type=int, default=None, help="first N sentences only")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--shard-size", type=int, default=256)
    p.add_argument("--out", default=None, help="results file or folder (default bench/results/)")
    return p.parse_args(argv)


def versions() -> dict[str, str | None]:
    import numpy
    import ray
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "numpy": numpy.__version__,
            "ray": ray.__version__}


def write_input(path: Path, data: str | None, limit: int | None) -> int:
    """FCE sentences as JSONL ``{"tokens": [...]}``; returns how many."""
    from mhmla_fast.ged.data import read_ged
    from mhmla_fast.paths import shared_data_dir

    src = Path(data) if data else shared_data_dir() / "fce" / "fce-public.test.original.tsv"
    sentences = [list(s.tokens) for s in read_ged(src) if s.tokens][:limit]
    with open(path, "w", encoding="utf-8") as f:
        for tokens in sentences:
            f.write(json.dumps({"tokens": tokens}, ensure_ascii=False) + "\n")
    return len(sentences)


def timed(cmd: list[str]) -> float:
    """Wall seconds of ``cmd`` (exit 0 required)."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return wall


def compare(got: Path, want: Path) -> dict[str, Any]:
    a = [json.loads(x) for x in got.read_text(encoding="utf-8").splitlines()]
    b = [json.loads(x) for x in want.read_text(encoding="utf-8").splitlines()]
    same = len(a) == len(b) and all(
        {k: v for k, v in x.items() if k != "probs"} == {k: v for k, v in y.items() if k != "probs"}
        for x, y in zip(a, b))
    diff = max((abs(p - q) for x, y in zip(a, b) for p, q in zip(x["probs"], y["probs"])),
               default=0.0)
    return {"records_equal_but_probs": same, "max_prob_diff": diff}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="mhmla-ray-bench-"))
    src, one = tmp / "in.jsonl", tmp / "one.jsonl"
    n = write_input(src, args.data, args.limit)
    one.write_text(src.read_text(encoding="utf-8").splitlines()[0] + "\n", encoding="utf-8")
    base = [sys.executable, "-m", "mhmla_fast.commands.serve", "tag", "--no-progress",
            "--device", "cpu", "--dtype", "float32"]
    if args.model:
        base += ["--model", args.model]
    configs = [("cli", 1, ["--threads", "1"])]
    configs += [("cli", w, ["--threads", str(w)]) for w in args.workers if w > 1]
    configs += [("ray", w, ["--threads", "1", "--ray", "--ray-workers", str(w),
                            "--shard-size", str(args.shard_size)]) for w in args.workers]
    result: dict[str, Any] = {
        "benchmark": "ray_cpu", "commit": git_commit(), "command": shlex.join(sys.argv),
        "device": {**cpu_info(), "load_average_start": load_average()},
        "versions": versions(), "data": str(args.data or "FCE test"), "sentences": n,
        "model": args.model or "shipped ged-minilm-mhmla12", "rows": []}
    reference = None
    for path, workers, extra in configs:
        out, out1 = tmp / f"{path}{workers}.jsonl", tmp / f"{path}{workers}-one.jsonl"
        startup = timed([*base, str(one), "--output", str(out1), *extra])
        cmd = [*base, str(src), "--output", str(out), *extra]
        wall = timed(cmd)
        row = {"path": path, "workers": workers if path == "ray" else 1,
               "threads": workers if path == "cli" else 1,
               "command": shlex.join(cmd).replace(str(tmp), "$TMP"), "wall_s": round(wall, 2),
               "startup_s": round(startup, 2), "sentences_per_s": round(n / wall, 1),
               "sentences_per_s_excl_startup": round(n / max(wall - startup, 1e-9), 1)}
        if reference is None:
            reference = out
        else:
            row.update(compare(out, reference))
        print(json.dumps(row), file=sys.stderr)
        result["rows"].append(row)
    result["device"]["load_average_end"] = load_average()
    path = dated_results_path(args.out, "ray_cpu", DEFAULT_OUT_DIR)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
