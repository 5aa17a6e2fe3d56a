"""Sentences/s of the tagging engine's host path alone: ``Engine.tag_texts`` and ``tag_tokens``
with a runner that costs nothing, so the figure is the ceiling the host sets on any device
(issue 11: on an H100 the engine tagged 9,255 sentences/s while the GPU idled).

    python bench/benchmark_host_path.py                  # FCE dev+test x 4, shipped tokenizer
    python bench/benchmark_host_path.py --repeat 1 --out /tmp/host.json

The runner returns a constant probability for every piece (no model runs), so what is timed is
word tokenisation (``tag_texts`` only), word-piecing, packing, merging windows and building the
results (``to_dict`` timed separately). Each row also records this process's CPU time per
sentence (not the host workers'; with them, the ceiling the engine's own process sets) and its
split by thread (Linux). The ``tag_command`` row times what ``mhmla-serve tag FILE --output
OUT`` does around the model: reading records, tagging, result dicts, JSON lines. A ``cProfile``
of one ``tag_texts`` call (top functions by own time) is kept in the result. The result (CPU,
versions, commit) goes to ``bench/results/host_path_<date>.json``.

    # A/B against another commit, alternating (its checkout as a git worktree):
    git worktree add /tmp/old <commit>
    python bench/benchmark_host_path.py --only tag_command --code /tmp/old --out /tmp/a.json
    python bench/benchmark_host_path.py --only tag_command --out /tmp/b.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
if "--code" in sys.argv[:-1]:  # another checkout's mhmla_fast (A/B runs), before it is imported
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--code") + 1]).resolve()))

from benchmark_serve_cpu import profile_text  # noqa: E402 - the sibling script, by file name

from mhmla_fast.provenance import (  # noqa: E402
    cpu_info, dated_results_path, git_commit, load_average)

SHARED = REPO.parent / "shared" / "data" / "fce"


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process, by thread name, from
    /proc (Linux; empty elsewhere): the engine's own process, not its host workers."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    try:
        tick, tids = os.sysconf("SC_CLK_TCK"), os.listdir("/proc/self/task")
    except (OSError, ValueError):
        return {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended since the listing
            continue
        name = names.get(int(tid), f"thread {tid}")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


class FreeRunner:
    """A runner that costs nothing: P(error) = 0.3 for every piece."""

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        return np.full(input_ids.shape, 0.3, dtype=np.float32)


def tag_command_row(engine, texts: Sequence[str], runs: int) -> dict:
    """The host path of ``mhmla-serve tag in.txt --output out.jsonl``, model aside: the texts
    as a file, read into records (``iter_input_records``), tagged in calls of 2048
    (``run_records`` and ``pipeline.tag_records``, which the command runs) and written
    (``ResumableJsonlWriter``: JSON lines, fsync-ed). This process's CPU per record, the best of
    ``runs`` after a warm-up run; ``output_sha256``: of the records' values (parsed, keys
    sorted), to compare code versions."""
    import hashlib
    import tempfile

    from mhmla_fast.serve.inputs import iter_input_records
    from mhmla_fast.serve.outputs import ResumableJsonlWriter
    from mhmla_fast.serve.pipeline import tag_records
    from mhmla_fast.serve.records import run_records

    best_cpu = best_wall = float("inf")
    with tempfile.TemporaryDirectory(prefix="host-path-") as tmp:
        src = Path(tmp) / "in.txt"
        src.write_text("\n".join(texts) + "\n", encoding="utf-8")
        for run in range(runs + 1):
            out = Path(tmp) / f"out{run}.jsonl"
            cpu0, t0 = time.process_time(), time.perf_counter()
            with ResumableJsonlWriter(str(out), resume=False) as writer:
                run_records(iter_input_records([str(src)]),
                            lambda batch: tag_records(engine, batch), writer, 2048,
                            progress=False)
            if run:  # the first run warms the word cache
                best_wall = min(best_wall, time.perf_counter() - t0)
                best_cpu = min(best_cpu, time.process_time() - cpu0)
        values = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    digest = hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()
    row = {"path": "tag_command", "host_workers": 0, "cache": "warm", "records": len(texts),
           "seconds": round(best_wall, 3), "records_per_s": round(len(texts) / best_wall, 1),
           "process_cpu_us_per_record": round(best_cpu / len(texts) * 1e6, 2),
           "output_sha256": digest}
    print(f"tag_command: {len(texts) / best_wall:,.0f} records/s host-only; this process's CPU "
          f"{best_cpu / len(texts) * 1e6:.1f} us/record; output {digest[:12]}", flush=True)
    return row


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", nargs="+", default=[str(SHARED / f"fce-public.{s}.original.tsv")
                                                 for s in ("dev", "test")],
                   help="GED files (default: FCE dev and test of the shared data)")
    p.add_argument("--repeat", type=int, default=4, help="the sentences this many times")
    p.add_argument("--runs", type=int, default=3, help="timed runs per path (the best is kept)")
    p.add_argument("--host-workers", type=int, nargs="+", default=[0],
                   help="Engine host_workers settings to run (0: tokenise in this thread)")
    p.add_argument("--out", default=None, help="output .json (default: bench/results/host_path_<date>.json)")
    p.add_argument("--code", default=None, metavar="DIR",
                   help="import mhmla_fast from this checkout instead (A/B runs against another "
                        "commit: a `git worktree`; the rows and paths it lacks are skipped)")
    p.add_argument("--only", nargs="+", choices=("engine", "cold", "tag_command", "profile"),
                   default=["engine", "cold", "tag_command", "profile"], help="the parts to run")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import mhmla_fast
    from mhmla_fast.ged.data import read_ged
    from mhmla_fast.serve.engine import Engine, default_tagger_path, gc_paused, load_tokenizer

    code = Path(mhmla_fast.__file__).resolve().parents[1]
    if args.code is not None and code != Path(args.code).resolve():
        raise SystemExit(f"--code {args.code}: mhmla_fast was already imported from {code}; "
                         "give --code on the command line (it is read before the import)")
    sentences = [s.tokens for f in args.data for s in read_ged(f)] * args.repeat
    texts = [" ".join(s) for s in sentences]
    tokenizer = load_tokenizer(default_tagger_path())
    rows = []
    for workers in args.host_workers if "engine" in args.only else ():
        engine = Engine(FreeRunner(), tokenizer, token_budget=65536, max_batch=256,
                        host_workers=workers)
        for name, fn, data in (("tag_tokens", engine.tag_tokens, sentences),
                               ("tag_texts", engine.tag_texts, texts)):
            best = best_dict = best_cpu = float("inf")
            fn(data[:2048])  # start the workers, if any, outside the timing
            for _ in range(args.runs):
                threads0, cpu0 = thread_cpu_s(), time.process_time()
                t0 = time.perf_counter()
                results = fn(data)
                t1 = time.perf_counter()
                cpu, threads1 = time.process_time() - cpu0, thread_cpu_s()
                if cpu < best_cpu:
                    best_cpu = cpu
                    by_thread = {k: round((v - threads0.get(k, 0.0)) / len(data) * 1e6, 2)
                                 for k, v in threads1.items() if v - threads0.get(k, 0.0) > 0}
                with gc_paused():  # as serve.pipeline.tag_records does
                    [r.to_dict() for r in results]
                best, best_dict = min(best, t1 - t0), min(best_dict, time.perf_counter() - t0)
            rows.append({"path": name, "host_workers": workers, "cache": "warm",
                         "sentences": len(data),
                         "seconds": round(best, 3), "sentences_per_s": round(len(data) / best, 1),
                         "sentences_per_s_with_to_dict": round(len(data) / best_dict, 1),
                         # this process's CPU per sentence (its threads; not the host workers'),
                         # the least of the runs, and that run's split by thread
                         "process_cpu_us_per_sentence": round(best_cpu / len(data) * 1e6, 2),
                         "process_cpu_us_per_sentence_by_thread": by_thread})
            print(f"{name} (host_workers={workers}): {len(data) / best:,.0f} sentences/s host-only "
                  f"({len(data) / best_dict:,.0f} with to_dict); this process's CPU "
                  f"{best_cpu / len(data) * 1e6:.1f} us/sentence {by_thread}", flush=True)
        engine.close()
    for name, data in (("tag_tokens", sentences), ("tag_texts", texts)) if "cold" in args.only else ():
        # a fresh engine: its word cache (serve.pieces.WordCache) starts empty, so every distinct
        # word goes through the tokenizer once in this one call
        engine = Engine(FreeRunner(), tokenizer, token_budget=65536, max_batch=256)
        t0 = time.perf_counter()
        getattr(engine, name)(data)
        cold = time.perf_counter() - t0
        rows.append({"path": name, "host_workers": 0, "cache": "cold", "sentences": len(data),
                     "seconds": round(cold, 3), "sentences_per_s": round(len(data) / cold, 1)})
        print(f"{name} (first call, empty word cache): {len(data) / cold:,.0f} sentences/s")
    if "tag_command" in args.only:
        rows.append(tag_command_row(Engine(FreeRunner(), tokenizer, token_budget=65536,
                                           max_batch=256), texts, args.runs))
    profile = []
    if "profile" in args.only:
        engine = Engine(FreeRunner(), tokenizer, token_budget=65536, max_batch=256)
        profile = profile_text(engine.tag_texts, texts, top=15).splitlines()
    result = {
        "benchmark": "host_path", "commit": git_commit(), "command": shlex.join(sys.argv),
        "code": str(code),
        "device": {**cpu_info(), "load_average_start": load_average()},
        "python": sys.version.split()[0], "data": [Path(f).name for f in args.data],
        "repeat": args.repeat, "rows": rows,
        "profile_tag_texts": [line for line in profile if line.strip()][:40],
        "note": "no model runs (a constant-probability runner): the host path's ceiling; "
                "best of --runs runs, one process, one thread of Python, after a warm-up call "
                "(the word cache then holds the data's words); rows with cache 'cold': one call "
                "of a fresh engine; to_dict timed with the GC paused, as tag_records does; "
                "tag_command: the host path of `mhmla-serve tag` on a file of the texts",
    }
    out = dated_results_path(args.out, "host_path", REPO / "bench" / "results")
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
