"""Time to the first result of ``mhmla-serve tag`` on one sentence, or of ``mhmla-serve score``
on one short essay (``--command score``), as a user types it:

    echo "He go to school every days ." | mhmla-serve tag
    echo '{"text": "Dear local newspaper, ...", "prompt": 1}' | mhmla-serve score

Per variant, ``--repeats`` whole processes (alternating between the variants, so that a busy
neighbour slows them alike), each timed from spawn to the first line on its standard output
(``first_result_s``) and to its exit (``wall_s``); the summary gives their medians:

default   the command's defaults (backend auto: on the CPU, ONNX Runtime on the model's cached
          export), on a warm cache in a scratch folder (``$MHMLA_CACHE_DIR``)
torch     ``--backend torch``
onnx      (tag only) ``--backend onnx`` on an explicit ``mhmla-serve export --onnx`` (``--onnx``)

Before the timed runs, the default command runs ``--cold`` times on an empty cache (each one
exports the model: ``cold`` in the results, with the line it printed), then once untimed to warm
the disk. The labels (tag) or the score (score) of every run are checked against the first torch
run's.

    python bench/benchmark_first_result.py --repeats 5 --threads 2
    python bench/benchmark_first_result.py --command score --profile  # and where start-up goes
    python bench/benchmark_first_result.py --out bench/results/   # default folder

Results: ``bench/results/first_result_cpu_<date>.json`` (tag) or
``first_result_score_cpu_<date>.json`` (score), ``-2``... rather than overwriting, with the
machine (CPU model, cores, load averages), versions and commit. Nothing runs at import.
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
# A short essay in the style of ASAP prompt 1 (written for the benchmarks; 116 word pieces).
ESSAY = ("Dear local newspaper, I think that computers have a good effect on people. First of all "
         "computers let you talk to your family and friends who live far away, my cousin lives "
         "in Spain and we chat every weekend. Second, you can learn about almost anything, like "
         "the history of other countries or how to cook a new food. Some people say that kids "
         "spend too much time on the computer and dont go outside, but thats the parents job to "
         "set limits. In conclusion computers help us to learn, to communicate and to work, so "
         "they are good for our society.")
VARIANTS = ("default", "torch", "onnx")
COMMANDS = ("tag", "score")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Time to the first result of mhmla-serve tag or "
                                "score.")
    p.add_argument("--command", default="tag", choices=COMMANDS,
                   help="tag (one sentence, default) or score (one essay)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per variant (median)")
    p.add_argument("--cold", type=int, default=1, help="runs on an empty cache (each exports)")
    p.add_argument("--variants", nargs="+", default=None, choices=VARIANTS,
                   help="default: default torch onnx for tag, default torch for score")
    p.add_argument("--threads", type=int, default=None, help="--threads of the commands")
    p.add_argument("--model", default=None, help="tagger or scorer directory (default: the "
                   "shipped one)")
    p.add_argument("--sentence", default=SENTENCE, help="tag's input")
    p.add_argument("--essay", default=ESSAY, help="score's input text")
    p.add_argument("--prompt", type=int, default=1, help="score's input prompt (default 1)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed runs, one more run per variant under python -X "
                   "importtime: where its start-up goes (imports by top-level module)")
    p.add_argument("--out", default=None, help="results .json file or folder")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.cold < 0:
        p.error("--repeats must be at least 1 and --cold not negative")
    if args.variants is None:
        args.variants = list(VARIANTS) if args.command == "tag" else ["default", "torch"]
    if args.command == "score" and "onnx" in args.variants:
        p.error("--variants onnx: the scorer has no explicit ONNX export (its default, backend "
                "auto, runs its cached one)")
    return args


def input_line(args: argparse.Namespace) -> str:
    """The one input line: the sentence (tag) or the essay as JSON with its prompt (score)."""
    if args.command == "tag":
        return args.sentence
    return json.dumps({"text": args.essay, "prompt": args.prompt}, ensure_ascii=False)


def command(args: argparse.Namespace, variant: str, onnx_dir: Path | None) -> list[str]:
    """``mhmla-serve tag`` (or ``score``) reading standard input, for ``variant``."""
    cmd = [sys.executable, "-m", "mhmla_fast.commands.serve", args.command]
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


def labels(result: dict, command: str = "tag") -> list[str] | int | None:
    """The result of the run's first line: its labels (tag) or its score (score)."""
    try:
        return json.loads(result["line"])["labels" if command == "tag" else "score"]
    except (ValueError, KeyError, TypeError):
        return None


def import_profile(cmd: Sequence[str], line: str, env: dict, top: int = 10) -> dict[str, Any]:
    """``cmd`` run once under ``python -X importtime`` (untimed otherwise): the seconds its
    imports took, all and per top-level module (the ``top`` largest), and whether torch,
    transformers and onnxruntime were imported."""
    proc = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], input=(line + "\n").encode(),
                          capture_output=True, env=env)
    per: dict[str, int] = {}
    every: set[str] = set()
    for raw in proc.stderr.decode(errors="replace").splitlines():
        if not raw.startswith("import time:") or raw.count("|") < 2:
            continue
        _, cumulative, name = raw.split("|", 2)
        every.add(name.strip())
        if cumulative.strip().isdigit() and not name.startswith("  "):  # a top-level import
            per[name.strip()] = per.get(name.strip(), 0) + int(cumulative)
    biggest = sorted(per.items(), key=lambda kv: -kv[1])[:top]
    return {"exit_status": proc.returncode, "imports_s": round(sum(per.values()) / 1e6, 3),
            "top_level_s": {k: round(v / 1e6, 3) for k, v in biggest},
            "imported": {m: m in every
                         for m in ("torch", "transformers", "onnxruntime", "tokenizers")}}


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
        "input": input_line(args), "settings": vars(args)}
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
            cold.append(time_first_result(command(args, "default", None), input_line(args), env))
            print(f"cold (export): {cold[-1]['wall_s']:.2f} s", flush=True)
        if cold:
            results["cold"] = {**summarize(cold), "stderr": cold[-1]["stderr"]}
        time_first_result(command(args, "default", None), input_line(args), env)  # warm it
        runs: dict[str, list[dict]] = {v: [] for v in args.variants}
        for _ in range(args.repeats):
            for v in args.variants:
                runs[v].append(time_first_result(command(args, v, onnx_dir), input_line(args),
                                                 env))
                print(f"{v}: first result {runs[v][-1]['first_result_s']}", flush=True)
        profiles = {v: import_profile(command(args, v, onnx_dir), input_line(args), env)
                    for v in (args.variants if args.profile else ())}
    reference = labels(runs["torch"][0], args.command) if "torch" in runs else None
    results["variants"] = {}
    for v, rs in runs.items():
        row = {"command": shlex.join(command(args, v, onnx_dir)).replace(str(REPO_ROOT), "."),
               **summarize(rs)}
        if reference is not None:
            row["labels_equal_torch" if args.command == "tag" else "score_equal_torch"] = all(
                labels(r, args.command) == reference for r in rs)
        row["failed"] = [r["stderr"] for r in rs if r["exit_status"] != 0]
        if v in profiles:
            row["import_profile"] = profiles[v]
        results["variants"][v] = row
    results["labels" if args.command == "tag" else "score"] = reference
    header["device"]["load_average_end"] = load_average()
    stem = "first_result_cpu" if args.command == "tag" else "first_result_score_cpu"
    out = dated_results_path(args.out, stem, DEFAULT_OUT_DIR,
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
