"""Time to the first result of ``mhmla-serve tag`` on one sentence, as a user types it:

    echo "He go to school every days ." | mhmla-serve tag

Per variant, ``--repeats`` whole processes (alternating between the variants, so that a busy
neighbour slows them alike), each timed from spawn to the first line on its standard output
(``first_result_s``) and to its exit (``wall_s``); the summary gives their medians:

default   the command's defaults (backend auto: on the CPU, ONNX Runtime on the model's cached
          export), on a warm cache in a scratch folder (``$MHMLA_CACHE_DIR``)
torch     ``--backend torch``
onnx      ``--backend onnx`` on an explicit ``mhmla-serve export --onnx`` (``--onnx``)

Before the timed runs, the default command runs ``--cold`` times on an empty cache (each one
exports the model: ``cold`` in the results, with the line it printed), then once untimed to warm
the disk. The labels of every run are checked against the first torch run's.

    python bench/benchmark_first_result.py --repeats 5 --threads 2
    python bench/benchmark_first_result.py --out bench/results/   # default folder

Results: ``bench/results/first_result_cpu_<date>.json`` (``-2``... rather than overwriting) with
the machine (CPU model, cores, load averages), versions and commit. Nothing runs at import.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT_DIR = REPO_ROOT / "bench" / "results"
SENTENCE = "He go to school every days ."
VARIANTS = ("default", "torch", "onnx")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Time to the first result of mhmla-serve tag.")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per variant (median)")
    p.add_argument("--cold", type=int, default=1, help="runs on an empty cache (each exports)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--threads", type=int, default=None, help="--threads of the commands")
    p.add_argument("--model", default=None, help="tagger directory (default: the shipped one)")
    p.add_argument("--sentence", default=SENTENCE)
    p.add_argument("--out", default=None, help="results .json file or folder")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.cold < 0:
        p.error("--repeats must be at least 1 and --cold not negative")
    return args


def command(args: argparse.Namespace, variant: str, onnx_dir: Path | None) -> list[str]:
    """``mhmla-serve tag`` reading standard input, for ``variant``."""
    cmd = [sys.executable, "-m", "mhmla_fast.commands.serve", "tag"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if variant == "onnx":
        return [*cmd, "--backend", "onnx", "--model", str(onnx_dir)]
    if args.model:
        cmd += ["--model", args.model]
    return [*cmd, "--backend", "torch"] if variant == "torch" else cmd


def time_first_result(cmd: Sequence[str], sentence: str, env: dict) -> dict[str, Any]:
    """Run ``cmd`` with ``sentence`` on standard input: seconds from spawn to the first complete
    line on standard output and to exit, the exit status, that line, and standard error."""
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(list(cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, env=env)
        proc.stdin.write((sentence + "\n").encode())
        proc.stdin.close()
        line = proc.stdout.readline()
        first = time.perf_counter() - t0 if line.endswith(b"\n") else None
        proc.stdout.read()
        proc.wait()
        wall = time.perf_counter() - t0
        proc.stdout.close()
        err.seek(0)
        tail = err.read().decode(errors="replace").strip()[-600:]
    return {"first_result_s": first, "wall_s": wall, "exit_status": proc.returncode,
            "line": line.decode(errors="replace").strip(), "stderr": tail}


def labels(result: dict) -> list[str] | None:
    try:
        return json.loads(result["line"])["labels"]
    except (ValueError, KeyError, TypeError):
        return None


def summarize(runs: Sequence[dict]) -> dict[str, Any]:
    firsts = [r["first_result_s"] for r in runs if r["first_result_s"] is not None]
    return {"first_result_s_median": round(statistics.median(firsts), 3) if firsts else None,
            "first_result_s_min": round(min(firsts), 3) if firsts else None,
            "first_result_s_max": round(max(firsts), 3) if firsts else None,
            "wall_s_median": round(statistics.median(r["wall_s"] for r in runs), 3),
            "runs": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                      if k not in ("line", "stderr")} for r in runs]}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    from mhmla_fast.devices import physical_cores
    from mhmla_fast.provenance import (cpu_info, dated_results_path, load_average, provenance)
    from mhmla_fast.serve.export_cache import runtime_versions

    prov = provenance()  # imports torch here, in the driver, not in the timed commands
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    header: dict[str, Any] = {
        "benchmark": "benchmark_first_result", "device": {**cpu_info(),
                                                          "load_average_start": load_average()},
        "physical_cores": physical_cores(), "versions": runtime_versions(),
        "python": sys.version.split()[0], "commit": prov["commit"], "date": prov["date"],
        "command": shlex.join(["python", "bench/benchmark_first_result.py", *argv]),
        "sentence": args.sentence, "settings": vars(args)}
    results: dict[str, Any] = {"header": header}
    with tempfile.TemporaryDirectory(prefix="first-result-") as tmp:
        tmp = Path(tmp)
        cache = tmp / "cache"
        env["MHMLA_CACHE_DIR"] = str(cache)
        onnx_dir = None
        if "onnx" in args.variants:
            onnx_dir = tmp / "export"
            cmd = [sys.executable, "-m", "mhmla_fast.commands.serve", "export", "--onnx",
                   str(onnx_dir), *(["--model", args.model] if args.model else [])]
            subprocess.run(cmd, check=True, env=env, capture_output=True)
        cold = []
        for _ in range(args.cold):
            shutil.rmtree(cache, ignore_errors=True)
            cold.append(time_first_result(command(args, "default", None), args.sentence, env))
            print(f"cold (export): {cold[-1]['wall_s']:.2f} s", flush=True)
        if cold:
            results["cold"] = {**summarize(cold), "stderr": cold[-1]["stderr"]}
        time_first_result(command(args, "default", None), args.sentence, env)  # warm the cache
        runs: dict[str, list[dict]] = {v: [] for v in args.variants}
        for _ in range(args.repeats):
            for v in args.variants:
                runs[v].append(time_first_result(command(args, v, onnx_dir), args.sentence, env))
                print(f"{v}: first result {runs[v][-1]['first_result_s']}", flush=True)
    reference = labels(runs["torch"][0]) if "torch" in runs else None
    results["variants"] = {}
    for v, rs in runs.items():
        row = {"command": shlex.join(command(args, v, onnx_dir)).replace(str(REPO_ROOT), "."),
               **summarize(rs)}
        if reference is not None:
            row["labels_equal_torch"] = all(labels(r) == reference for r in rs)
        row["failed"] = [r["stderr"] for r in rs if r["exit_status"] != 0]
        results["variants"][v] = row
    results["labels"] = reference
    header["device"]["load_average_end"] = load_average()
    out = dated_results_path(args.out, "first_result_cpu", DEFAULT_OUT_DIR,
                             datetime.datetime.now(datetime.timezone.utc).date())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    for v, row in results["variants"].items():
        print(f"{v:8s} first result median {row['first_result_s_median']} s, "
              f"wall median {row['wall_s_median']} s")
    print(f"wrote {out}")
    return 0 if all(not r["failed"] for r in results["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
