"""Issue 11's serving benchmark, one script for the CPU and a CUDA GPU: tagging, scoring, the
commands as a user runs them, the HTTP service under load, and training throughput.

    python bench/benchmark_serve.py --device cpu --limit 500 --tasks tag --out /tmp/x.json
    python bench/benchmark_serve.py --device cuda --repeat-to 98840 --tasks tag
    python bench/benchmark_serve.py --device cuda --tasks score cli http train
    python bench/benchmark_serve.py --merge part1.json part2.json --out bench/results/
    bash bench/gpu_issue11.sh ...               # the same, split into 10-minute device calls

Tasks (``--tasks``, default all; each becomes rows with ``"task"`` set, and a task that fails
becomes one row with ``"error"`` while the others go on):

tag     in process, on the GED sentences (``--data``, default FCE dev + test from the shared data
        folder; ``--limit`` keeps the first N, ``--repeat-to`` repeats them up to N), one pass
        timed as in ``bench/benchmark_serve_cpu.py`` (its functions are used): ``plain_torch``
        (fp32 on the device, the label reference), ``hf_pipeline`` per ``--pipeline-dtypes`` x
        ``--pipeline-batch-sizes``, ``engine`` (``Engine.load(backend="torch")``) per
        ``--dtypes`` x ``--budgets`` x ``--max-batch`` x ``--chunks`` x ``--host-workers`` x
        ``--overlap`` (``off``: each pass waited for before the next is packed), and ``engine``
        on ONNX Runtime (fp32, int8) where it applies: on the CPU, or on CUDA when onnxruntime
        has its CUDA provider. On cuda every row also gets ``vs_cpu_fp32``: the share of words
        whose label (stored threshold) equals the CPU fp32 engine's on the first
        ``--agree-sentences`` sentences.
score   in process: ``load_scorer`` + ``predict_scores`` essays/s per ``--score-dtypes`` on a
        stratified ASAP sample (``--essays``; ``bench/benchmark_serve_score_cpu.py``'s sample).
cli     whole processes, wall clock from spawn to exit and the time until the output file holds
        its first line (``first_line_s``; records are flushed in blocks, so this is when a
        user watching the file sees a result): ``mhmla-serve tag IN --output OUT`` with the
        defaults (the headline: backend auto, on a warm export cache in the run's scratch
        folder, ``$MHMLA_CACHE_DIR``; one untimed first run fills it and is recorded as
        ``cold_cache``), per ``--cli-tag-backends`` also with ``--backend torch``, with
        ``--backend torch --dtype bfloat16`` (``torch-bf16``) and, on the CPU, ``--backend
        onnx`` on a fresh ``mhmla-serve export --onnx``, the Hugging Face pipeline
        as a whole process (``--hf-worker``: import, load, tag, write) per pipeline setting,
        and ``mhmla-serve score``. ``--cli-repeats`` runs alternate between the commands.
        The commands' labels and scores are checked against the engine / scorer in process.
http    ``mhmla-serve http`` started as a subprocess (``startup_s`` until ``/healthz`` answers),
        then ``--http-clients`` (64) keep-alive clients, in ``--http-procs`` load processes, each
        sending ``--http-per-request`` sentences per POST /v1/tag back to back for
        ``--http-duration`` seconds (or ``--http-requests`` in all) after ``--http-warmup``
        seconds; requests/s, latency p50/p95/p99, 503 and other failures; the labels of the
        first ``--http-check`` distinct requests are compared with the engine offline.
        ``--http-endpoints tag score`` loads POST /v1/score as well (the server then serves the
        ``--scorer``): ``--http-per-request`` essays of the score task's sample per request,
        the scores of the first ``--http-check`` distinct requests compared with the scorer
        offline in torch fp32 (what the served scorer promises, its checked bf16 pass included).
train   ``mhmla-train ged`` in a subprocess (``--train-sentences`` prefix of FCE train,
        ``--train-epochs``, batch 32, dev = the first ``--train-dev-sentences`` of FCE dev):
        per epoch seconds and sentences/s from its ``log.json`` (which include the small dev
        evaluation), and the estimated seconds of a whole 28,731-sentence FCE epoch; one run
        per ``--train-compile`` mode and ``--train-precision``.

Results (``--out``: a .json file, or a folder, default ``bench/results/``, that gets
``benchmark_serve_<cpu|cuda>_<date>.json``, ``-2``... rather than overwriting): ``header``
(device: CPU model and cores, load average, GPU name, capability, memory, CUDA; versions;
commit; command; data; models; settings; ``note`` from ``$MHMLA_BENCH_NOTE``), ``rows``,
``summary`` and ``targets``: issue 11's goals, each with its value and ``PASS``/``FAIL``/
``n/a``. The GPU goals are stated for an H100: on the CPU they are ``n/a``; on another GPU they
are judged but ``on_target_device`` is false. The CPU goal (``mhmla-serve tag`` >= 2.0x the
best Hugging Face pipeline setting, whole process, labels identical to torch fp32) is judged
on the CPU only. Exit status 1 when a task failed or the engine's fp32 check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

import benchmark_serve_cpu as tagbench  # noqa: E402 - the sibling scripts, by file name
import benchmark_serve_score_cpu as scorebench  # noqa: E402

from mhmla_fast.devices import TRAIN_PRECISIONS  # noqa: E402
from mhmla_fast.provenance import cpu_info, dated_results_path, load_average  # noqa: E402

DEFAULT_OUT_DIR = REPO_ROOT / "bench" / "results"
TASKS = ("tag", "score", "cli", "http", "train")
FCE_TRAIN_SENTENCES = 28_731  # one epoch of the issue's training goal
TAG_PATH = "/v1/tag"
# the load test's endpoints: (path, the result field kept for the check)
HTTP_ENDPOINTS = {"tag": (TAG_PATH, "labels"), "score": ("/v1/score", "score")}
CLI_COMMANDS = ("tag", "hf", "score")
# default: the command's own (auto); torch-bf16: --backend torch --dtype bfloat16
CLI_TAG_BACKENDS = ("default", "default-lanes1", "torch", "onnx", "torch-bf16")
TAG_PATHS = ("plain", "hf", "engine", "onnx")
# the plain-torch reference row's warm-up at most (it has no autotuner to keep out of its timed
# pass; a warm-up of every sentence, as the engine's rows take, only doubled its time)
PLAIN_WARMUP = 1024

# defaults that differ by device: (cpu, cuda)
DEVICE_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "dtypes": (["float32"], ["float32", "bfloat16"]),
    "budgets": ([4096, 8192, 16384], [16384, 65536]),
    "pipeline_dtypes": (["float32"], ["float32", "float16"]),
    "pipeline_batch_sizes": ([1, 8, 32, 64], [32, 64, 128, 256]),
    "score_dtypes": (["float32"], ["bfloat16", "float32"]),
    "essays": (400, 2000),
    "train_sentences": (128, 8192),
    "train_epochs": (1, 2),
    "http_procs": (1, 4),
}


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring); device-dependent defaults filled in."""
    p = argparse.ArgumentParser(description="Issue 11's serving benchmark (CPU or CUDA).")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--out", default=None, help="results .json file or folder")
    p.add_argument("--model", default=None, help="tagger directory (default: the shipped one)")
    p.add_argument("--scorer", default=None, help="scorer directory (default: the shipped one)")
    p.add_argument("--data", nargs="+", default=None,
                   help="GED files (default: FCE dev and test of the shared data folder)")
    p.add_argument("--limit", type=int, default=None, help="only the first N sentences")
    p.add_argument("--repeat-to", type=int, default=None,
                   help="repeat the sentences up to N for the in-process tag rows")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of torch / ONNX Runtime, in process and passed to the "
                   "commands (default: all cores in process, the commands' own choice)")
    p.add_argument("--kernels", default="auto", choices=("auto", "torch", "triton"),
                   help="the layer-attention head's implementation (engine, scorer, training)")
    g = p.add_argument_group("tag")
    g.add_argument("--tag-paths", nargs="+", default=list(TAG_PATHS), choices=TAG_PATHS,
                   help="which in-process rows (default all; plain_torch, the reference, always)")
    g.add_argument("--dtypes", nargs="+", default=None,
                   help="engine dtypes (cpu: float32; cuda: float32 bfloat16)")
    g.add_argument("--budgets", type=int, nargs="+", default=None,
                   help="engine token budgets (cpu: 4096 8192 16384; cuda: 16384 65536)")
    g.add_argument("--chunks", type=int, nargs="+", default=[512, 0],
                   help="sentences per engine call (0: all in one call)")
    g.add_argument("--max-batch", type=int, nargs="+", default=[256],
                   help="engine rows per batch (several: a row each; on a GPU a pass's host "
                        "cost is paid per batch, so larger batches amortise it)")
    g.add_argument("--host-workers", type=int, nargs="+", default=[0],
                   help="engine host_workers settings: processes that tokenise large calls "
                        "(0: the calling thread)")
    g.add_argument("--overlap", nargs="+", choices=["on", "off"], default=["on"],
                   help="engine rows with passes pipelined one deep (on: the engine's own "
                        "behaviour) and/or with the runner called synchronously (off: its "
                        "submit hidden), the A/B of the host-device overlap")
    g.add_argument("--profile", action="store_true",
                   help="after each engine row's timed passes, one more pass under cProfile: "
                        "its top functions by own and by cumulative time go into the row")
    g.add_argument("--cuda-graphs", nargs="+", choices=["on", "off"], default=["off"],
                   help="engine rows with the torch runner's passes replayed from CUDA graphs "
                        "(on; cuda only) and/or run eagerly (off, the default)")
    g.add_argument("--pipeline-dtypes", nargs="+", default=None,
                   help="HF pipeline dtypes (cpu: float32; cuda: float32 float16)")
    g.add_argument("--pipeline-batch-sizes", type=int, nargs="+", default=None,
                   help="HF pipeline batch sizes (cpu: 1 8 32 64; cuda: 32 64 128 256)")
    g.add_argument("--plain-batch-size", type=int, default=32)
    g.add_argument("--repeats", type=int, default=3, help="timed passes per row (median)")
    g.add_argument("--warmup", type=int, default=256, help="sentences of the warm-up pass")
    g.add_argument("--agree-sentences", type=int, default=None,
                   help="cuda: sentences compared with the CPU fp32 engine (default: all "
                   "distinct ones)")
    g.add_argument("--no-onnx", action="store_true", help="no ONNX rows")
    g.add_argument("--onnx-dir", default=None, help="an existing ONNX export")
    g = p.add_argument_group("score")
    g.add_argument("--tsv", default=None, help="ASAP TSV (default: the shared data folder's)")
    g.add_argument("--essays", type=int, default=None, help="essays (cpu 400, cuda 2000)")
    g.add_argument("--score-dtypes", nargs="+", default=None,
                   help="scorer dtypes (cpu: float32; cuda: bfloat16 float32)")
    g.add_argument("--batch-essays", type=int, default=64)
    g.add_argument("--token-budget", type=int, default=8192, help="scorer token budget")
    g = p.add_argument_group("cli")
    g.add_argument("--cli-repeats", type=int, default=1, help="whole-process runs (median)")
    g.add_argument("--cli-commands", nargs="+", default=list(CLI_COMMANDS), choices=CLI_COMMANDS,
                   help="the whole-process rows: mhmla-serve tag, the HF pipeline, mhmla-serve "
                   "score (default all)")
    g.add_argument("--cli-tag-backends", nargs="+", default=["default", "onnx"],
                   choices=CLI_TAG_BACKENDS,
                   help="the mhmla-serve tag rows: default (the command's defaults, backend "
                   "auto on a warm cache), torch (--backend torch), onnx (--backend onnx on an "
                   "export; CPU only, not with --no-onnx), torch-bf16 (--backend torch --dtype "
                   "bfloat16), default-lanes1 (the defaults but --lanes 1: one forward pass at "
                   "a time on all threads); default: default onnx")
    g.add_argument("--cli-hf-batch-sizes", type=int, nargs="+", default=None,
                   help="HF pipeline whole-process batch sizes (default: --pipeline-batch-sizes)")
    g = p.add_argument_group("http")
    g.add_argument("--http-clients", type=int, default=64)
    g.add_argument("--http-server-args", default="",
                   help="more options of the served `mhmla-serve http`, one string (e.g. "
                        "\"--cuda-graphs\" or \"--max-wait-ms 2\")")
    g.add_argument("--http-procs", type=int, default=None,
                   help="load-generating processes (cpu 1, cuda 4)")
    g.add_argument("--http-endpoints", nargs="+", choices=tuple(HTTP_ENDPOINTS),
                   default=["tag"],
                   help="the endpoints loaded, one after the other: tag (POST /v1/tag, FCE "
                        "sentences), score (POST /v1/score, the --essays sample; the server "
                        "then serves --scorer) (default tag)")
    g.add_argument("--http-per-request", type=int, nargs="+", default=[1],
                   help="sentences (essays) per request, one row each")
    g.add_argument("--http-duration", type=float, default=20.0, help="measured seconds")
    g.add_argument("--http-requests", type=int, default=None,
                   help="send this many requests in all instead of --http-duration")
    g.add_argument("--http-warmup", type=float, default=2.0,
                   help="seconds of requests before the measurement (not counted)")
    g.add_argument("--http-check", type=int, default=256,
                   help="distinct requests whose results are compared with offline")
    g.add_argument("--http-start-timeout", type=float, default=300.0)
    g.add_argument("--http-dtype", default=None, help="server --dtype (default: its own)")
    g = p.add_argument_group("train")
    g.add_argument("--train-sentences", type=int, default=None,
                   help="--max-train-sentences of the run (cpu 128, cuda 8192)")
    g.add_argument("--train-epochs", type=int, default=None, help="epochs (cpu 1, cuda 2)")
    g.add_argument("--train-dev-sentences", type=int, default=256)
    g.add_argument("--train-encoder", default=None, help="--encoder of mhmla-train ged")
    g.add_argument("--train-compile", nargs="+", default=["off"],
                   choices=("off", "default", "reduce-overhead", "max-autotune"),
                   help="--compile of mhmla-train ged: one run per mode (default: off)")
    g.add_argument("--train-precision", nargs="+", default=["auto"],
                   choices=TRAIN_PRECISIONS,
                   help="--precision of mhmla-train ged: one run per precision and compile "
                        "mode (default: auto)")
    args = p.parse_args(argv)

    if not (args.device == "cpu" or args.device == "cuda" or args.device.startswith("cuda:")):
        p.error(f"--device: expected cpu, cuda or cuda:N, got {args.device!r}")
    kind = 0 if args.device == "cpu" else 1
    for name, values in DEVICE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, values[kind])
    if args.cli_hf_batch_sizes is None:
        args.cli_hf_batch_sizes = list(args.pipeline_batch_sizes)
    args.tasks = [t for t in TASKS if t in args.tasks]  # a fixed order
    for name in ("limit", "repeat_to", "threads", "agree_sentences", "http_requests"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("repeats", "plain_batch_size", "essays", "batch_essays",
                 "token_budget", "cli_repeats", "http_clients", "http_procs",
                 "train_sentences", "train_epochs", "train_dev_sentences", "http_check"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("budgets", "max_batch", "pipeline_batch_sizes", "cli_hf_batch_sizes",
                 "http_per_request"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name.replace('_', '-')}: every value must be at least 1")
    if min(args.chunks) < 0:
        p.error("--chunks: 0 (all in one call) or positive")
    if args.http_duration <= 0 or args.http_warmup < 0:
        p.error("--http-duration must be positive and --http-warmup not negative")
    if args.http_procs > args.http_clients:
        p.error("--http-procs cannot exceed --http-clients")
    return args


# ------------------------------------------------------------------------------ statistics


def latency_summary(seconds: Sequence[float]) -> dict[str, Any]:
    """Count, mean, p50/p95/p99 (NumPy's linear interpolation between order statistics) and
    max of latencies in seconds; ``None`` figures when there are none."""
    if len(seconds) == 0:
        return {"count": 0, "mean_s": None, "p50_s": None, "p95_s": None, "p99_s": None,
                "max_s": None}
    a = np.asarray(seconds, dtype=np.float64)
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {"count": int(a.size), "mean_s": float(a.mean()), "p50_s": float(p50),
            "p95_s": float(p95), "p99_s": float(p99), "max_s": float(a.max())}


def load_summary(workers: Sequence[dict], window_start: float) -> dict[str, Any]:
    """Merge the load processes' reports: requests/s = measured requests / (last end -
    ``window_start``), latency percentiles over all of them, status counts."""
    lat = [x for w in workers for x in w["latencies"]]
    statuses: dict[str, int] = {}
    for w in workers:
        for code, n in w["statuses"].items():
            statuses[code] = statuses.get(code, 0) + n
    ends = [w["last_end"] for w in workers if w.get("last_end")]
    span = (max(ends) - window_start) if ends else 0.0
    ok = statuses.get("200", 0)
    return {"requests": len(lat), "ok": ok, "status_503": statuses.get("503", 0),
            "failed": len(lat) - ok, "statuses": statuses,
            "connection_errors": sum(w["connection_errors"] for w in workers),
            "seconds": span, "requests_per_s": len(lat) / span if span > 0 else None,
            "latency": latency_summary(lat)}


# ------------------------------------------------------------------------------ targets


@dataclass(frozen=True)
class Target:
    """One goal of issue 11: ``metric`` (a key of :func:`target_values`) ``op`` ``target``,
    judged on ``device`` ("cuda": stated for an H100; "cpu": 2 cores)."""

    name: str
    device: str
    metric: str
    op: str  # ">=", "<=", ">", "==", "is"
    target: Any
    text: str


TARGETS = (
    Target("tag_in_process", "cuda", "tag_engine_best_sentences_per_s", ">=", 50_000,
           "tagging in process through the public Engine >= 50,000 sentences/s"),
    Target("tag_vs_pipeline_in_process", "cuda", "tag_engine_vs_best_pipeline", ">=", 10.0,
           "engine >= 10x the best HF pipeline setting on the same GPU (in process)"),
    Target("tag_vs_pipeline_whole_process", "cuda", "cli_tag_vs_best_pipeline_process", ">=",
           10.0, "mhmla-serve tag >= 10x the best HF pipeline setting, whole process"),
    Target("tag_bf16_faster", "cuda", "tag_bf16_vs_fp32", ">", 1.0,
           "engine bf16 faster than fp32"),
    Target("tag_bf16_agrees_with_cpu", "cuda", "tag_bf16_agreement_with_cpu_fp32", ">=", 0.999,
           "bf16 labels agree with CPU fp32 on >= 99.9% of words"),
    Target("score_in_process", "cuda", "score_best_essays_per_s", ">=", 2000,
           "scoring >= 2,000 essays/s in process"),
    Target("tag_first_result", "cuda", "cli_tag_first_line_s", "<=", 3.0,
           "mhmla-serve tag: first result within 3 s of start"),
    Target("score_first_result", "cuda", "cli_score_first_line_s", "<=", 3.0,
           "mhmla-serve score: first result within 3 s of start"),
    Target("http_throughput", "cuda", "http_requests_per_s", ">=", 5000,
           "HTTP, 64 clients, one sentence per request: >= 5,000 requests/s"),
    Target("http_p99", "cuda", "http_p99_s", "<=", 0.100, "HTTP p99 <= 100 ms"),
    Target("http_no_503", "cuda", "http_status_503", "==", 0, "no 503 below capacity"),
    Target("http_equals_offline", "cuda", "http_equals_offline", "is", True,
           "HTTP results equal to offline"),
    Target("train_epoch", "cuda", "train_fce_epoch_s", "<=", 5.0,
           "a MiniLM FCE epoch (28,731 sentences, batch 32) in <= 5 s"),
    Target("cpu_tag_vs_pipeline_whole_process", "cpu", "cli_tag_vs_best_pipeline_process",
           ">=", 2.0, "CPU: mhmla-serve tag >= 2.0x the best HF pipeline setting, whole process"),
    Target("cpu_tag_labels_identical", "cpu", "cli_tag_labels_identical", "is", True,
           "CPU: mhmla-serve tag labels identical to the torch fp32 path"),
)


def _fastest(rows: Sequence[dict], key: str, **match: Any) -> dict | None:
    ok = [r for r in rows if r.get("error") is None and r.get(key)
          and all(r.get(k) == v for k, v in match.items())]
    return max(ok, key=lambda r: r[key], default=None)


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def target_values(rows: Sequence[dict]) -> dict[str, Any]:
    """The figures the targets read, from the rows (``None``: not measured)."""
    sps = "sentences_per_s"
    eng = _fastest(rows, sps, task="tag", path="engine", backend="torch")
    eng32 = _fastest(rows, sps, task="tag", path="engine", backend="torch", dtype="float32")
    eng16 = _fastest(rows, sps, task="tag", path="engine", backend="torch", dtype="bfloat16")
    pipe = _fastest(rows, sps, task="tag", path="hf_pipeline")
    cli = next((r for r in rows if r.get("task") == "cli" and r.get("path") == "mhmla-serve tag"
                and r.get("setting", {}).get("backend") == "default"
                and r.get("error") is None), None)
    hf = _fastest(rows, sps, task="cli", path="hf_pipeline_process")
    cli_score = next((r for r in rows if r.get("task") == "cli"
                      and r.get("path") == "mhmla-serve score" and r.get("error") is None), None)
    score = _fastest(rows, "essays_per_s", task="score")
    http = next((r for r in rows if r.get("task") == "http" and r.get("error") is None
                 and r.get("setting", {}).get("per_request") == 1
                 and r.get("setting", {}).get("endpoint", "tag") == "tag"), None)
    train = _fastest(rows, "sentences_per_s", task="train")  # of the --train-compile modes and precisions
    agree = (eng16 or {}).get("vs_cpu_fp32") or {}
    return {
        "tag_engine_best_sentences_per_s": (eng or {}).get(sps),
        "tag_engine_vs_best_pipeline": _div((eng or {}).get(sps), (pipe or {}).get(sps)),
        "tag_bf16_vs_fp32": _div((eng16 or {}).get(sps), (eng32 or {}).get(sps)),
        "tag_bf16_agreement_with_cpu_fp32": agree.get("agreeing_share"),
        "cli_tag_vs_best_pipeline_process": _div((cli or {}).get(sps), (hf or {}).get(sps)),
        "cli_tag_labels_identical": (cli or {}).get("check", {}).get("labels_identical"),
        "cli_tag_first_line_s": (cli or {}).get("first_line_s"),
        "cli_score_first_line_s": (cli_score or {}).get("first_line_s"),
        "score_best_essays_per_s": (score or {}).get("essays_per_s"),
        "http_requests_per_s": (http or {}).get("requests_per_s"),
        "http_p99_s": ((http or {}).get("latency") or {}).get("p99_s"),
        "http_status_503": (http or {}).get("status_503"),
        "http_equals_offline": ((http or {}).get("check") or {}).get("equal"),
        "train_fce_epoch_s": (train or {}).get("fce_epoch_s_estimate"),
    }


def _holds(value: Any, op: str, target: Any) -> bool:
    return {">=": lambda: value >= target, "<=": lambda: value <= target,
            ">": lambda: value > target, "==": lambda: value == target,
            "is": lambda: value is target}[op]()


def evaluate_targets(rows: Sequence[dict], device: str, gpu_name: str | None = None
                     ) -> dict[str, Any]:
    """Each target with its value and verdict: ``PASS``/``FAIL`` where it applies to this
    device kind and was measured, ``n/a`` otherwise (GPU targets on the CPU, the CPU target on
    a GPU, or no value). ``on_target_device``: an H100 for the GPU targets."""
    kind = "cpu" if device == "cpu" else "cuda"
    values = target_values(rows)
    checks = []
    for t in TARGETS:
        value = values[t.metric]
        applies = t.device == kind
        verdict = "n/a" if not applies or value is None else (
            "PASS" if _holds(value, t.op, t.target) else "FAIL")
        checks.append({"name": t.name, "device": t.device, "metric": t.metric, "value": value,
                       "op": t.op, "target": t.target, "verdict": verdict, "goal": t.text})
    return {"checks": checks, "device_kind": kind,
            "on_target_device": kind == "cpu" or "H100" in (gpu_name or ""),
            "note": "GPU goals are stated for an H100 and are n/a on the CPU; the CPU goal is "
                    "n/a on a GPU"}


# ------------------------------------------------------------------------------- header


def versions() -> dict[str, str | None]:
    """The CPU script's versions plus triton, fastapi, uvicorn, the HTTP parser and event loop
    uvicorn picks when installed (httptools, uvloop), orjson, which writes the output lines of
    ``mhmla-serve`` when installed, and openvino, which runs backend auto's checked bf16 pass on
    a CPU with AMX (None: not installed)."""
    out = tagbench.versions()
    for name in ("triton", "fastapi", "uvicorn", "httptools", "uvloop", "orjson", "openvino"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - any import failure means "not usable"
            out[name] = None
    return out


def device_info(device: str) -> dict[str, Any]:
    """CPU model and cores, load average; on CUDA the GPU's name, capability, memory, CUDA."""
    info: dict[str, Any] = {"requested": device, **cpu_info(),
                            "load_average_start": load_average()}
    if device != "cpu":
        import torch

        d = torch.device(device)
        props = torch.cuda.get_device_properties(d)
        info.update(gpu=torch.cuda.get_device_name(d), capability=[props.major, props.minor],
                    gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count, cuda=torch.version.cuda)
    return info


def resolve_out_path(out: str | None, device: str, today: datetime.date | None = None) -> Path:
    """``--out FILE.json`` as given; a folder (default ``bench/results/``) gets
    ``benchmark_serve_<cpu|cuda>_<date>.json`` (``-2``... rather than overwriting)."""
    kind = "cpu" if device == "cpu" else "cuda"
    return dated_results_path(out, f"benchmark_serve_{kind}", DEFAULT_OUT_DIR, today)


# --------------------------------------------------------------------------------- data


@dataclass
class Corpus:
    """The GED sentences of the run (distinct ones first, then repeats)."""

    files: list[Path]
    sentences: list[list[str]]
    gold: list[list[int]]
    distinct: int  # the first ``distinct`` sentences are the data itself

    @property
    def words(self) -> int:
        return sum(len(s) for s in self.sentences)


def read_corpus(files: Sequence[str] | None, limit: int | None, repeat_to: int | None
                ) -> Corpus:
    """``files`` (default FCE dev + test of the shared data folder) read with ``read_ged``,
    empty sentences dropped, the first ``limit`` kept, repeated up to ``repeat_to``."""
    from mhmla_fast.ged.data import read_ged
    from mhmla_fast.paths import shared_data_dir

    paths = [Path(f) for f in files] if files else [
        shared_data_dir() / "fce" / f"fce-public.{split}.original.tsv" for split in ("dev", "test")]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such data file (give --data, or set "
                                    "MHMLA_SHARED_DATA to the shared data folder)")
    corpus = [s for path in paths for s in read_ged(path) if s.tokens][:limit]
    sentences = [list(s.tokens) for s in corpus]
    gold = [list(s.labels) for s in corpus]
    distinct = len(sentences)
    if repeat_to and repeat_to > distinct:
        k = -(-repeat_to // distinct)
        sentences, gold = (sentences * k)[:repeat_to], (gold * k)[:repeat_to]
    return Corpus(paths, sentences, gold, distinct)


def write_fce(path: Path, sentences: Sequence[Sequence[str]], gold: Sequence[Sequence[int]]
              ) -> Path:
    """Sentences as an FCE TSV (``TOKEN<TAB>c|i``, blank line between)."""
    with open(path, "w", encoding="utf-8") as f:
        for words, labels in zip(sentences, gold):
            for w, lab in zip(words, labels):
                f.write(f"{w}\t{'i' if lab else 'c'}\n")
            f.write("\n")
    return path


# ----------------------------------------------------------------------------- the runs


@dataclass
class Run:
    """What every task reads: the arguments, the device, models, data and a scratch folder."""

    args: argparse.Namespace
    tmp: Path
    model_dir: Path
    threads: int
    corpus: Corpus | None = None
    threshold: float = 0.5
    max_pieces: int = 512
    onnx_dir: Path | None = None
    onnx_report: dict | None = None
    essays: dict | None = None  # the score sample (see essay_sample)
    score_reference: dict[str, list[int]] | None = None  # dtype -> in-process scores
    # <out>.partial.json: the header and every row so far, rewritten after each row (a run cut
    # by a time box keeps them); None: rows are only printed
    partial: Path | None = None
    header: dict | None = None
    measured: list[dict] = field(default_factory=list)

    @property
    def device(self) -> str:
        return self.args.device

    @property
    def on_cpu(self) -> bool:
        return self.args.device == "cpu"

    def progress(self, row: dict) -> None:
        """Print a one-line summary of ``row`` and keep it in the partial file."""
        if self.partial is not None:
            self.measured.append(row)
            self.partial.write_text(json.dumps(
                {"header": self.header, "rows": self.measured, "partial": True},
                indent=2, default=tagbench._json_default) + "\n")
        rate = next(((k, row[k]) for k in ("sentences_per_s", "essays_per_s", "requests_per_s")
                     if row.get(k)), None)
        what = f"{rate[1]:.1f} {rate[0].replace('_per_s', '')}/s" if rate else \
            f"ERROR {str(row.get('error'))[:200]}"
        print(f"  {row.get('task', ''):<6} {row.get('path', ''):<20} {row.get('backend', '')} "
              f"{row.get('dtype', '')} {row.get('setting', '')}: {what}", flush=True)


def _env() -> dict[str, str]:
    """The environment of the subprocesses: this repository first on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _threads_flag(args: argparse.Namespace) -> list[str]:
    return [] if args.threads is None else ["--threads", str(args.threads)]


def onnx_export(run: Run) -> tuple[Path | None, dict]:
    """The ONNX export for the ONNX rows (once per run), or None with the reasons."""
    if run.onnx_report is None:
        if run.args.no_onnx:
            run.onnx_dir, run.onnx_report = None, {"skipped": "--no-onnx"}
        elif not run.on_cpu and not _onnx_cuda():
            run.onnx_dir, run.onnx_report = None, {
                "skipped": "onnxruntime has no CUDAExecutionProvider here: ONNX rows run on "
                           "the CPU only (see the CPU results)"}
        else:
            run.onnx_dir, run.onnx_report = tagbench.prepare_onnx(
                run.model_dir, run.args.onnx_dir, run.tmp)
    return run.onnx_dir, run.onnx_report


def _onnx_cuda() -> bool:
    try:
        from mhmla_fast.devices import cuda_available

        return cuda_available("onnx")
    except Exception:  # noqa: BLE001 - no onnxruntime
        return False


# ---------------------------------------------------------------------------------- tag


def run_tag(run: Run) -> list[dict]:
    """The in-process tag rows (module docstring)."""
    import torch

    from mhmla_fast.ged.model import GedTagger, load_tokenizer
    from mhmla_fast.serve.engine import Engine
    from mhmla_fast.serve.hf_pipeline import load_pipeline

    args, corpus, device = run.args, run.corpus, run.device
    sentences, gold, n_words = corpus.sentences, corpus.gold, corpus.words
    thresholds = tagbench.thresholds_of(run.threshold)
    rows: list[dict] = []
    cpu_probs = None
    n_agree = min(args.agree_sentences or corpus.distinct, corpus.distinct)
    if not run.on_cpu:  # the CPU fp32 labels every GPU row is compared with
        cpu_engine = Engine.load(run.model_dir, backend="torch", device="cpu", dtype="float32",
                                 kernels="torch")
        cpu_probs = tagbench.engine_tagger(cpu_engine)(sentences[:n_agree])
        del cpu_engine
    reference = None

    def finish(row: dict, probs) -> None:
        row["task"], row["device"] = "tag", row.get("device", device)
        if probs is not None:
            row["f05"] = tagbench.score(gold, probs, thresholds)
            if reference is not None:
                row["vs_reference"] = tagbench.compare(reference, probs, thresholds)
            if cpu_probs is not None:
                row["vs_cpu_fp32"] = agreement(cpu_probs, probs[:n_agree], run.threshold)
        rows.append(row)
        run.progress(row)

    def measure(base: dict, tag: Callable) -> Any:
        row, probs = tagbench.measured_row(base, tag, sentences, n_words, args)
        finish(row, probs)
        return row, probs

    model = GedTagger.load(run.model_dir, device=device, dtype=torch.float32)
    row, reference = tagbench.measured_row(
        {"path": "plain_torch", "backend": "torch", "dtype": "float32",
         "setting": {"batch_size": args.plain_batch_size}},
        tagbench.plain_torch_tagger(model, load_tokenizer(run.model_dir), args.plain_batch_size,
                                    run.max_pieces, device), sentences, n_words, args,
        warmup=min(args.warmup, PLAIN_WARMUP))
    finish(row, reference)
    del model

    for dtype in args.pipeline_dtypes if "hf" in args.tag_paths else []:
        try:
            pipe, error = load_pipeline(run.model_dir, device=device,
                                        dtype=getattr(torch, dtype)), None
        except Exception as e:  # noqa: BLE001 - recorded, the other rows go on
            pipe, error = None, f"{type(e).__name__}: {e}"
        for bs in args.pipeline_batch_sizes:
            base = {"path": "hf_pipeline", "backend": "torch", "dtype": dtype,
                    "setting": {"batch_size": bs}}
            if pipe is None:
                finish(tagbench.error_row(base, error), None)
            else:
                measure(base, tagbench.pipeline_tagger(pipe, bs))
        del pipe

    settings = [(b, m, c, w, o) for b in args.budgets for m in args.max_batch for c in args.chunks
                for w in args.host_workers for o in args.overlap]
    engines = [(d, g) for d in args.dtypes for g in args.cuda_graphs]
    for dtype, graphs in engines if "engine" in args.tag_paths else []:
        try:
            engine, error = Engine.load(run.model_dir, backend="torch", device=device,
                                        dtype=dtype, kernels=args.kernels,
                                        cuda_graphs=graphs == "on"), None
        except Exception as e:  # noqa: BLE001
            engine, error = None, f"{type(e).__name__}: {e}"
        for budget, max_batch, chunk, workers, overlap in settings:
            base = {"path": "engine", "backend": "torch", "dtype": dtype, "kernels": args.kernels,
                    "setting": {"token_budget": budget, "max_batch": max_batch,
                                "chunk": chunk, "host_workers": workers, "overlap": overlap,
                                "cuda_graphs": graphs}}
            if engine is None:
                finish(tagbench.error_row(base, error), None)
                continue
            budgeted = tagbench.with_budget(engine, budget, max_batch, workers)
            if overlap == "off":
                budgeted.runner = Synchronous(engine.runner)
            tag = tagbench.engine_tagger(budgeted, chunk)
            row, _ = measure(base, tag)
            if args.profile and row.get("error") is None:  # (where the host's time goes; one
                # profiled pass, printed by both sorts)
                row["profile"] = {sort: text.splitlines() for sort, text in
                                  tagbench.profile_texts(tag, sentences, top=30).items()}
            captured = getattr(engine.runner, "captured", None)
            if captured is not None:
                row["graph_captures"] = captured.captures  # of this engine's rows so far
            budgeted.close()
            if dtype == "float32":
                vs = row.get("vs_reference")
                row["check_passed"] = bool(vs) and vs["max_abs_prob_diff"] <= tagbench.PROB_TOL \
                    and vs["missing_words"] == 0
        del engine

    export_dir, report = onnx_export(run) if "onnx" in args.tag_paths else (None, {})
    if export_dir is not None or report.get("errors"):
        for dtype in ("float32", "int8"):
            try:
                if export_dir is None:
                    raise RuntimeError("; ".join(report["errors"].values()))
                if dtype == "int8" and "export_int8" in report["errors"]:  # fp32 exported only
                    raise RuntimeError(f"the int8 export failed: {report['errors']['export_int8']}")
                engine = Engine.load(export_dir, backend="onnx", device=device, dtype=dtype,
                                     threads=run.threads, threshold=run.threshold)
                error = None
            except Exception as e:  # noqa: BLE001
                engine, error = None, f"{type(e).__name__}: {e}"
            for budget, max_batch, chunk in dict.fromkeys(  # (no host workers here)
                    (b, m, c) for b, m, c, *_ in settings):
                base = {"path": "engine", "backend": "onnx", "dtype": dtype,
                        "setting": {"token_budget": budget, "max_batch": max_batch,
                                    "chunk": chunk}}
                if engine is None:
                    finish(tagbench.error_row(base, error), None)
                else:
                    measure(base, tagbench.engine_tagger(
                        tagbench.with_budget(engine, budget, max_batch), chunk))
            del engine
    return rows


class Synchronous:
    """A runner with its ``submit`` hidden: the engine then calls it and waits for each pass
    before packing the next (``runners.submit``), the no-overlap side of ``--overlap``."""

    def __init__(self, runner) -> None:
        self._runner = runner

    def __call__(self, input_ids, attention_mask):
        return self._runner(input_ids, attention_mask)

    def __getattr__(self, name: str):
        if name == "submit":
            raise AttributeError(name)
        return getattr(self._runner, name)


def agreement(reference, probs, threshold: float) -> dict[str, Any]:
    """Words whose label at ``threshold`` equals the reference's: count and share."""
    ref = tagbench.labels_at([np.concatenate(reference)], threshold)[0]
    got = tagbench.labels_at([np.concatenate(probs)], threshold)[0]
    same = int((ref == got).sum())
    return {"words": int(ref.size), "agreeing_words": same,
            "agreeing_share": same / ref.size if ref.size else None}


# -------------------------------------------------------------------------------- score


def essay_sample(run: Run) -> dict:
    """The stratified ASAP sample of the score benchmark, once per run."""
    if run.essays is None:
        from mhmla_fast.aes.data import read_asap
        from mhmla_fast.aes.train import asap_files

        model = scorebench.resolve_model(run.args.scorer)
        tsv = Path(run.args.tsv) if run.args.tsv else asap_files()[0]
        if not tsv.is_file():
            raise FileNotFoundError(f"{tsv}: no ASAP TSV (give --tsv, or set MHMLA_SHARED_DATA)")
        sample = scorebench.stratified_sample(read_asap(tsv), run.args.essays, 0)
        pieces, windows = scorebench.count_windows(model, [e.text for e in sample])
        run.essays = {"model": model, "tsv": tsv, "sample": sample,
                      "texts": [e.text for e in sample], "prompts": [e.prompt for e in sample],
                      "pieces": sum(pieces), "windows": sum(windows)}
    return run.essays


def score_args(run: Run, dtype: str) -> argparse.Namespace:
    """The arguments ``benchmark_serve_score_cpu``'s functions read (the scorer in torch)."""
    return argparse.Namespace(backend="torch", threads=run.threads, device=run.device,
                              dtype=dtype, batch_essays=run.args.batch_essays,
                              token_budget=run.args.token_budget)


def run_score(run: Run) -> list[dict]:
    """essays/s of ``load_scorer`` + ``predict_scores`` in process, per dtype."""
    s = essay_sample(run)
    rows, run.score_reference = [], {}
    first = None
    for dtype in run.args.score_dtypes:
        row: dict[str, Any] = {
            "task": "score", "device": run.device, "path": "predict_scores", "backend": "torch",
            "dtype": dtype, "setting": {"batch_essays": run.args.batch_essays,
                                        "token_budget": run.args.token_budget},
            "essays": len(s["texts"]), "error": None}
        try:
            load_s, predict_s, scores, scorer = scorebench.time_in_process(
                s["model"], s["texts"], s["prompts"], score_args(run, dtype))
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
            run.progress(row)
            continue
        row.update(scorer=scorer, load_s=round(load_s, 3), predict_s=round(predict_s, 3),
                   **scorebench.rates(predict_s, len(scores), s["pieces"], s["windows"]))
        run.score_reference[dtype] = scores
        if first is None:
            first = (dtype, scores)
        else:
            row["vs_" + first[0]] = {"equal_scores": sum(a == b for a, b in zip(scores, first[1])),
                                     "essays": len(scores)}
        rows.append(row)
        run.progress(row)
    return rows


# ---------------------------------------------------------------------------------- cli


def time_process(cmd: Sequence[str], out: Path | None, *, env: dict | None = None,
                 poll_s: float = 0.005) -> dict[str, Any]:
    """Run ``cmd`` once into a fresh ``out``: wall seconds from spawn to exit, seconds until
    ``out`` first holds a complete line (``None``: never, or no ``out``), exit status and the
    tail of standard error."""
    if out is not None and out.exists():
        out.unlink()
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(list(cmd), stdout=subprocess.DEVNULL, stderr=err,
                                env=env or _env())
        first = None
        while proc.poll() is None:
            if first is None and out is not None and _has_line(out):
                first = time.perf_counter() - t0
                proc.wait()
                break
            time.sleep(poll_s)
        wall = time.perf_counter() - t0
        if first is None and out is not None and _has_line(out):
            first = wall  # it appeared between the last poll and the exit
        err.seek(0)
        tail = err.read()[-2000:].decode(errors="replace")
    return {"wall_s": wall, "first_line_s": first, "exit_status": proc.returncode,
            "stderr_tail": tail}


def _has_line(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return b"\n" in f.read(1 << 16)
    except OSError:
        return False


def tag_command(run: Run, src: Path, out: Path, backend: str) -> list[str]:
    """``mhmla-serve tag`` as a user runs it: defaults ("default"), ``--backend torch``,
    ``--backend onnx`` on an export, ``--backend torch --dtype bfloat16`` ("torch-bf16"), or
    the defaults with ``--lanes 1`` ("default-lanes1")."""
    cmd = [sys.executable, "-m", "mhmla_fast.commands.serve", "tag", str(src), "--output",
           str(out), "--no-progress", "--device", run.device, "--threshold", str(run.threshold),
           *_threads_flag(run.args)]
    if backend == "onnx":
        return [*cmd, "--model", str(run.onnx_dir), "--backend", "onnx"]
    if backend == "torch":
        return [*cmd, "--model", str(run.model_dir), "--backend", "torch"]
    if backend == "torch-bf16":
        return [*cmd, "--model", str(run.model_dir), "--backend", "torch", "--dtype", "bfloat16"]
    if backend == "default-lanes1":
        return [*cmd, "--model", str(run.model_dir), "--lanes", "1"]
    return [*cmd, "--model", str(run.model_dir)]


def cli_cache_env(run: Run) -> dict[str, str]:
    """The commands' environment with backend auto's export cache in the run's scratch folder
    (never the user's own cache; warmed by :func:`warm_export_cache`)."""
    return {**_env(), "MHMLA_CACHE_DIR": str(run.tmp / "export-cache")}


def warm_export_cache(run: Run, cmd: Sequence[str], out: Path) -> dict[str, Any]:
    """One untimed run of the default command on the empty cache (it exports the model once):
    its wall seconds, exit status and what it said on stderr (the export line)."""
    first = time_process(cmd, out, env=cli_cache_env(run))
    return {"wall_s": round(first["wall_s"], 3), "exit_status": first["exit_status"],
            "stderr": first["stderr_tail"].strip()[-600:]}


def hf_command(run: Run, src: Path, out: Path, batch_size: int, dtype: str) -> list[str]:
    """The Hugging Face pipeline as a whole process (this script's ``--hf-worker``)."""
    spec = run.tmp / f"hf_{batch_size}_{dtype}.json"
    spec.write_text(json.dumps({"model": str(run.model_dir), "input": str(src),
                                "output": str(out), "batch_size": batch_size,
                                "device": run.device, "dtype": dtype,
                                "threads": run.args.threads}))
    return [sys.executable, str(Path(__file__).resolve()), "--hf-worker", str(spec)]


def hf_worker(spec_path: str) -> int:
    """Whole-process HF pipeline: import, load, tag the whitespace-split lines, write JSONL."""
    spec = json.loads(Path(spec_path).read_text())
    import torch

    from mhmla_fast.serve.hf_pipeline import load_pipeline, tag_words

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    pipe = load_pipeline(spec["model"], device=spec["device"], dtype=getattr(torch, spec["dtype"]))
    lines = Path(spec["input"]).read_text(encoding="utf-8").splitlines()
    probs = tag_words(pipe, [line.split() for line in lines], batch_size=spec["batch_size"])
    with open(spec["output"], "w", encoding="utf-8") as f:
        for p in probs:
            f.write(json.dumps({"probs": [None if np.isnan(x) else float(x) for x in p]}) + "\n")
    return 0


def run_cli(run: Run) -> list[dict]:
    """The commands as whole processes, alternating over ``--cli-repeats`` runs."""
    args = run.args
    texts = [" ".join(s) for s in run.corpus.sentences[:run.corpus.distinct]]
    src = run.tmp / "cli_tag_input.txt"
    src.write_text("\n".join(texts) + "\n", encoding="utf-8")
    jobs: list[tuple[dict, list[str], Path]] = []
    backends = [b for b in CLI_TAG_BACKENDS
                if b in args.cli_tag_backends and "tag" in args.cli_commands]
    if "onnx" in backends and not (run.on_cpu and onnx_export(run)[0] is not None):
        backends.remove("onnx")
    for backend in backends:
        out = run.tmp / f"cli_tag_{backend}.jsonl"
        jobs.append(({"path": "mhmla-serve tag", "setting": {"backend": backend},
                      "items": len(texts)}, tag_command(run, src, out, backend), out))
    cold = None
    if "default" in backends:
        cold = warm_export_cache(run, jobs[0][1], jobs[0][2])
    for dtype in args.pipeline_dtypes if "hf" in args.cli_commands else []:
        for bs in args.cli_hf_batch_sizes:
            out = run.tmp / f"hf_{bs}_{dtype}.jsonl"
            jobs.append(({"path": "hf_pipeline_process", "dtype": dtype,
                          "setting": {"batch_size": bs}, "items": len(texts)},
                         hf_command(run, src, out, bs, dtype), out))
    if "score" in args.cli_commands:
        s = essay_sample(run)
        esrc, eout = run.tmp / "cli_essays.jsonl", run.tmp / "cli_scores.jsonl"
        scorebench.write_jsonl(esrc, s["sample"])
        dtype = "float32" if run.on_cpu else "bfloat16"  # the command's default
        ns = score_args(run, dtype)
        cmd = scorebench.score_command(s["model"], esrc, eout, ns)
        if args.threads is None:  # let the command choose, as a user would
            k = cmd.index("--threads")
            del cmd[k:k + 2]
        jobs.append(({"path": "mhmla-serve score", "dtype": dtype,
                      "setting": {"batch_essays": args.batch_essays,
                                  "token_budget": args.token_budget}, "items": len(s["texts"])},
                     cmd, eout))

    runs: list[list[dict]] = [[] for _ in jobs]
    for _ in range(args.cli_repeats):
        for k, (_, cmd, out) in enumerate(jobs):
            runs[k].append(time_process(cmd, out, env=cli_cache_env(run)))
    rows = []
    for (base, cmd, out), results in zip(jobs, runs):
        row = cli_row(base, cmd, results, run.device)
        if base.get("setting", {}).get("backend") == "default" and cold is not None:
            row["cold_cache"] = cold
        if row["error"] is None:
            row["check"] = check_cli(run, base, out, texts)
        rows.append(row)
        run.progress(row)
    return rows


def cli_row(base: dict, cmd: Sequence[str], results: Sequence[dict], device: str) -> dict:
    """One whole-process row: median wall and first-line seconds over the runs, items/s."""
    row = {"task": "cli", "device": device, **base, "command": shlex.join(cmd), "error": None,
           "runs": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                     if k != "stderr_tail"} for r in results]}
    failed = [r for r in results if r["exit_status"] != 0]
    if failed:
        row["error"] = f"exit {failed[0]['exit_status']}: {failed[0]['stderr_tail']}"
        return row
    wall = statistics.median(r["wall_s"] for r in results)
    firsts = [r["first_line_s"] for r in results if r["first_line_s"] is not None]
    unit = "essays_per_s" if base["path"] == "mhmla-serve score" else "sentences_per_s"
    row.update(wall_s=round(wall, 3), first_line_s=round(statistics.median(firsts), 3)
               if firsts else None)
    row[unit] = base["items"] / wall
    return row


def check_cli(run: Run, base: dict, out: Path, texts: list[str]) -> dict:
    """The command's output against the library in process: tag labels against the torch
    engine's ``tag_texts`` on this device in the command's default dtype (float32 on the CPU:
    the CPU goal's "identical to the torch fp32 path"; bfloat16 on CUDA; bfloat16 for the
    torch-bf16 command), scores against the
    score task's in-process scores."""
    records = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    if base["path"] == "mhmla-serve tag":
        dtype = "float32" if run.on_cpu else "bfloat16"
        if base["setting"]["backend"] == "torch-bf16":
            dtype = "bfloat16"
        ref = reference_tag_texts(run, texts, dtype)
        differing = sum(a != b for r, e in zip(records, ref)
                        for a, b in zip(r.get("labels", []), e))
        missing = sum(len(r.get("labels", [])) != len(e) for r, e in zip(records, ref)) + abs(
            len(records) - len(ref))
        return {"reference": f"Engine torch {dtype} tag_texts on {run.device}",
                "differing_words": differing, "mismatched_records": missing,
                "labels_identical": differing == 0 and missing == 0}
    if base["path"] == "mhmla-serve score":
        ref = (run.score_reference or {}).get(base["dtype"])
        if ref is None:
            return {"reference": None, "note": "run the score task too to check the scores"}
        got = [r.get("score") for r in records]
        mismatches = sum(a != b for a, b in zip(got, ref)) + abs(len(got) - len(ref))
        return {"reference": f"predict_scores {base['dtype']} in process",
                "mismatches": mismatches, "scores_equal": mismatches == 0}
    return {"reference": None,
            "note": "speed only: the pipeline tags whitespace words, the command its own tokens"}


_TAG_REFERENCE: dict[tuple, list[list[str]]] = {}


def reference_tag_texts(run: Run, texts: list[str], dtype: str) -> list[list[str]]:
    """Labels of ``Engine.load(torch, dtype).tag_texts`` on this device (cached)."""
    key = (str(run.model_dir), run.device, dtype, len(texts))
    if key not in _TAG_REFERENCE:
        from mhmla_fast.serve.engine import Engine

        engine = Engine.load(run.model_dir, backend="torch", device=run.device, dtype=dtype,
                             kernels=run.args.kernels, threshold=run.threshold)
        _TAG_REFERENCE[key] = [r.labels for r in engine.tag_texts(texts)]
    return _TAG_REFERENCE[key]


# --------------------------------------------------------------------------------- http


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_command(run: Run, port: int) -> list[str]:
    """``mhmla-serve http`` on a loopback port, no access log; tagging only unless
    ``--http-endpoints`` has score (then the ``--scorer``, else the shipped scorer)."""
    cmd = [sys.executable, "-m", "mhmla_fast.commands.serve", "http", "--host", "127.0.0.1",
           "--port", str(port), "--model", str(run.model_dir), "--device", run.device,
           "--no-access-log", "--log-level", "warning",
           "--threshold", str(run.threshold), *_threads_flag(run.args)]
    if "score" not in run.args.http_endpoints:
        cmd.append("--no-scorer")
    elif run.args.scorer:
        cmd += ["--scorer", str(run.args.scorer)]
    if run.args.http_dtype:
        cmd += ["--dtype", run.args.http_dtype]
    return cmd + shlex.split(run.args.http_server_args)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> float:
    """Seconds until ``url/healthz`` answers 200 (with ``--workers N``: from a server whose N
    workers all serve, so that the load's connections spread over them); RuntimeError when the
    server exits first or ``timeout`` passes."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2) as r:
                health = json.loads(r.read())
                if r.status == 200 and health.get("workers_ready", 1) >= health.get("workers", 1):
                    return time.perf_counter() - t0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"the server did not answer /healthz within {timeout} s")


def request_bodies(items: Sequence[Any], per_request: int, limit: int = 20_000
                   ) -> list[list[Any]]:
    """Consecutive groups of ``per_request`` items, sentences or essays (at most ``limit``
    groups, wrapping)."""
    n = max(1, min(limit, len(items) // per_request or 1))
    return [[items[(i * per_request + j) % len(items)] for j in range(per_request)]
            for i in range(n)]


def endpoint_bodies(run: Run, endpoint: str, per_request: int) -> tuple[list[list], list[str]]:
    """The request groups of ``endpoint`` and their JSON bodies: FCE sentences for tag; for
    score, indices into the score task's essay sample, sent as ``{"text", "prompt"}``."""
    if endpoint == "tag":
        groups = request_bodies(run.corpus.sentences[:run.corpus.distinct], per_request)
        return groups, [json.dumps({"sentences": g}) for g in groups]
    s = essay_sample(run)
    groups = request_bodies(range(len(s["texts"])), per_request)
    return groups, [json.dumps({"essays": [{"text": s["texts"][k], "prompt": s["prompts"][k]}
                                           for k in g]}) for g in groups]


def run_http(run: Run) -> list[dict]:
    """The service under ``--http-clients`` concurrent clients, one row per request size."""
    args = run.args
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = http_command(run, port)
    log = open(run.tmp / "http_server.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=cli_cache_env(run))
    rows, answers = [], []
    try:
        try:
            startup = wait_healthy(url, proc, args.http_start_timeout)
        except RuntimeError as e:
            log.flush()
            tail = (run.tmp / "http_server.log").read_bytes()[-2000:].decode(errors="replace")
            raise RuntimeError(f"{e}: {tail}") from None
        for endpoint in args.http_endpoints:
            for per_request in args.http_per_request:
                groups, bodies = endpoint_bodies(run, endpoint, per_request)
                summary, kept = load_test(run, port, endpoint, bodies)
                row = {"task": "http", "device": run.device, "path": "mhmla-serve http",
                       "command": shlex.join(cmd), "error": None,
                       "startup_s": round(startup, 3),
                       "setting": {"endpoint": endpoint, "per_request": per_request,
                                   "clients": args.http_clients, "procs": args.http_procs,
                                   "warmup_s": args.http_warmup,
                                   "duration_s": None if args.http_requests
                                   else args.http_duration,
                                   "requests": args.http_requests}, **summary}
                if row["requests_per_s"]:
                    unit = "sentences_per_s" if endpoint == "tag" else "essays_per_s"
                    row[unit] = row["requests_per_s"] * per_request
                rows.append(row)
                answers.append((endpoint, groups, kept))
    finally:
        stop_server(proc)
        log.close()
    for row, (endpoint, groups, kept) in zip(rows, answers):
        check = check_http if endpoint == "tag" else check_http_scores
        row["check"] = check(run, groups, kept)
        run.progress(row)
    return rows


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGINT (uvicorn's graceful stop), then kill after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def load_test(run: Run, port: int, endpoint: str, bodies: list[str]) -> tuple[dict, dict]:
    """Start ``--http-procs`` load processes at one moment, each POSTing the JSON ``bodies`` to
    ``endpoint``; merge their reports. Returns the summary and the kept answers (body index ->
    each result's labels or score) of the first ``--http-check`` bodies."""
    args = run.args
    payload = run.tmp / f"bodies_{endpoint}.json"
    payload.write_text(json.dumps(bodies))
    path, field_ = HTTP_ENDPOINTS[endpoint]
    start_at = time.time() + 1.0 + 0.2 * args.http_procs  # all connect before it
    per_proc = [args.http_clients // args.http_procs + (k < args.http_clients % args.http_procs)
                for k in range(args.http_procs)]
    procs = []
    for k in range(args.http_procs):
        spec = {"port": port, "path": path, "field": field_, "bodies": str(payload),
                "clients": per_proc[k],
                "first_client": sum(per_proc[:k]), "stride": args.http_clients,
                "requests": args.http_requests, "start_at": start_at,
                "warmup_s": args.http_warmup, "duration_s": args.http_duration,
                "keep": args.http_check}
        path = run.tmp / f"load_{k}.json"
        path.write_text(json.dumps(spec))
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()),
                                       "--http-worker", str(path)], stdout=subprocess.PIPE,
                                      env=_env()))
    reports = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"a load process failed (exit {p.returncode})")
        reports.append(json.loads(out))
    kept: dict[int, Any] = {}
    for r in reports:
        kept.update({int(i): v for i, v in r.pop("kept").items()})
    return load_summary(reports, start_at + args.http_warmup), kept


def check_http(run: Run, bodies: list[list[list[str]]], kept: dict[int, Any]) -> dict:
    """The kept answers against ``Engine.tag_tokens`` offline with the server's settings."""
    from mhmla_fast.serve.engine import Engine

    if not kept:
        return {"requests": 0, "equal": None, "note": "no answer was kept"}
    engine = Engine.load(run.model_dir, backend="torch", device=run.device,
                         dtype=run.args.http_dtype, threshold=run.threshold)
    idx = sorted(kept)
    offline = engine.tag_tokens([s for i in idx for s in bodies[i]])
    want = [r.labels for r in offline]
    got = [labels for i in idx for labels in kept[i]]
    words = sum(len(x) for x in want)
    differing = sum(a != b for g, w in zip(got, want) for a, b in zip(g, w)) + sum(
        abs(len(g) - len(w)) for g, w in zip(got, want)) + abs(len(got) - len(want))
    return {"requests": len(idx), "words": words, "differing_words": differing,
            "equal": differing == 0,
            "reference": f"Engine.tag_tokens offline, {run.device}, the server's dtype"}


def check_http_scores(run: Run, groups: list[list[int]], kept: dict[int, Any]) -> dict:
    """The kept scores against ``load_scorer(backend="torch", dtype="float32")`` offline on
    the same essays (``groups``: indices into the sample; the score task's float32 scores
    when it ran, else scored here, untimed)."""
    if not kept:
        return {"requests": 0, "equal": None, "note": "no answer was kept"}
    idx = sorted(kept)
    reference = (run.score_reference or {}).get("float32")
    if reference is None:
        s = essay_sample(run)
        reference = scorebench.torch_scores(s["model"], s["texts"], s["prompts"],
                                            score_args(run, "float32"))
        run.score_reference = {**(run.score_reference or {}), "float32": reference}
    want = [reference[k] for i in idx for k in groups[i]]
    got = [score for i in idx for score in kept[i]]
    differing = sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))
    return {"requests": len(idx), "essays": len(want), "differing_scores": differing,
            "equal": differing == 0,
            "reference": f"load_scorer torch float32 offline, {run.device}"}


# ---- the load process (``--http-worker SPEC``): raw asyncio HTTP/1.1 keep-alive clients


async def _request(reader, writer, head: bytes, body: bytes) -> tuple[int, bytes]:
    writer.write(head + body)
    await writer.drain()
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:]
                                                             if x)}
    if "content-length" in headers:
        data = await reader.readexactly(int(headers["content-length"]))
    else:  # chunked
        data = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            data += await reader.readexactly(size + 2)
            if size == 0:
                break
    if headers.get("connection", "").lower() == "close":
        raise ConnectionResetError("the server closed the connection")
    return status, data


async def _client(spec: dict, g: int, bodies: list[bytes], stats: dict) -> None:
    """Client ``g``: requests g, g + stride, g + 2 stride... until the count or the deadline."""
    port, stride = spec["port"], spec["stride"]
    window = spec["start_at"] + spec["warmup_s"]
    deadline = None if spec["requests"] else window + spec["duration_s"]
    reader = writer = None
    while time.time() < spec["start_at"]:
        await asyncio.sleep(min(0.01, max(0.0, spec["start_at"] - time.time())))
    r = g
    while (spec["requests"] is None or r < spec["requests"]) and (
            deadline is None or time.time() < deadline):
        i = r % len(bodies)
        body = bodies[i]
        head = (f"POST {spec['path']} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                ).encode()
        started = time.time()
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            status, data = await _request(reader, writer, head, body)
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
            stats["connection_errors"] += 1
            if writer is not None:
                writer.close()
            reader = writer = None
            await asyncio.sleep(0.01)
            r += stride
            continue
        ended = time.time()
        if started >= window:
            stats["latencies"].append(ended - started)
            stats["statuses"][str(status)] = stats["statuses"].get(str(status), 0) + 1
            stats["last_end"] = max(stats["last_end"] or 0.0, ended)
        if status == 200 and i < spec["keep"] and str(i) not in stats["kept"]:
            stats["kept"][str(i)] = [x[spec["field"]] for x in json.loads(data)["results"]]
        r += stride
    if writer is not None:
        writer.close()


def http_worker(spec_path: str) -> int:
    """One load process: its clients, then its report as JSON on standard output."""
    spec = json.loads(Path(spec_path).read_text())
    bodies = [b.encode() for b in json.loads(Path(spec["bodies"]).read_text())]
    stats: dict[str, Any] = {"latencies": [], "statuses": {}, "connection_errors": 0,
                             "last_end": None, "kept": {}}

    async def main() -> None:
        await asyncio.gather(*(_client(spec, spec["first_client"] + c, bodies, stats)
                               for c in range(spec["clients"])))

    asyncio.run(main())
    json.dump(stats, sys.stdout)
    return 0


# -------------------------------------------------------------------------------- train


def train_command(run: Run, train: Path, dev: Path, out: Path, compile: str = "off",
                  precision: str = "auto") -> list[str]:
    """``mhmla-train ged`` on a prefix of FCE train, batch 32, the run's head kernels."""
    args = run.args
    cmd = [sys.executable, "-m", "mhmla_fast.commands.train", "ged", "--train", str(train),
           "--dev", str(dev), "--out", str(out), "--epochs", str(args.train_epochs),
           "--batch-size", "32", "--max-train-sentences", str(args.train_sentences),
           "--backend", args.kernels, "--compile", compile, "--precision", precision,
           "--no-progress", *_threads_flag(args)]
    if args.train_encoder:
        cmd += ["--encoder", args.train_encoder]
    return cmd


def run_train(run: Run) -> list[dict]:
    """Training throughput from ``log.json`` of short ``mhmla-train ged`` runs, one per
    ``--train-compile`` mode and ``--train-precision``."""
    from mhmla_fast.ged.data import read_ged
    from mhmla_fast.paths import shared_data_dir

    args = run.args
    fce = shared_data_dir() / "fce"
    train = fce / "fce-public.train.original.tsv"
    if not train.is_file():
        raise FileNotFoundError(f"{train}: no FCE train (set MHMLA_SHARED_DATA)")
    dev_sents = [s for s in read_ged(fce / "fce-public.dev.original.tsv") if s.tokens]
    dev_sents = dev_sents[:args.train_dev_sentences]
    dev = write_fce(run.tmp / "train_dev.tsv", [s.tokens for s in dev_sents],
                    [s.labels for s in dev_sents])
    env = _env()
    if run.on_cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # mhmla-train takes the GPU when it sees one
    rows = []
    for mode, precision in [(m, q) for m in args.train_compile for q in args.train_precision]:
        out = run.tmp / f"train_run_{mode}_{precision}"
        cmd = train_command(run, train, dev, out, mode, precision)
        result = time_process(cmd, None, env=env)
        row: dict[str, Any] = {
            "task": "train", "device": run.device, "path": "mhmla-train ged",
            "command": shlex.join(cmd), "error": None, "wall_s": round(result["wall_s"], 3),
            "setting": {"train_sentences": args.train_sentences, "epochs": args.train_epochs,
                        "batch_size": 32, "dev_sentences": len(dev_sents),
                        "kernels": args.kernels, "compile": mode, "precision": precision,
                        "encoder": args.train_encoder or "the embedded MiniLM"}}
        rows.append(row)
        if result["exit_status"] != 0:
            row["error"] = f"exit {result['exit_status']}: {result['stderr_tail']}"
            continue
        log = json.loads((out / "log.json").read_text())
        row["epochs"] = [{"epoch": e.get("epoch"), "seconds": e.get("seconds"),
                          "sentences_per_s": e.get("sentences_per_s"),
                          "train_seconds": e.get("train_seconds"),
                          "train_sentences_per_s": e.get("train_sentences_per_s"),
                          "train_loss": e.get("train_loss"),
                          "dev_f05": (e.get("dev") or {}).get("f05")} for e in log]
        row.update(train_epoch_summary(row["epochs"]))
        run.progress(row)
    return rows


def train_epoch_summary(epochs: Sequence[dict]) -> dict[str, Any]:
    """The last epoch's sentences/s (later epochs are warm: compilation and autotuning are in
    the first) and the seconds a whole FCE epoch would take at that speed, with the dev
    evaluation (the target's figure) and without it (the steps alone)."""
    if not epochs:
        return {"sentences_per_s": None, "fce_epoch_s_estimate": None,
                "fce_epoch_steps_s_estimate": None}
    sps = epochs[-1]["sentences_per_s"]
    steps_sps = epochs[-1].get("train_sentences_per_s")  # (logs from before 2026-11-27 lack it)
    return {"sentences_per_s": sps,
            "fce_epoch_s_estimate": FCE_TRAIN_SENTENCES / sps if sps else None,
            "fce_epoch_steps_s_estimate": FCE_TRAIN_SENTENCES / steps_sps if steps_sps else None,
            "note": "per epoch from log.json: sentences_per_s and fce_epoch_s_estimate count the "
                    "training steps and the evaluation of the short dev file, the steps_ "
                    "estimate the steps alone; start-up and loading are outside both"}


# --------------------------------------------------------------------------------- main


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_report(rows: Sequence[dict], targets: dict) -> str:
    """A plain-text table of the rows and the targets."""
    head = (f"{'task':<6} {'path':<20} {'backend':<7} {'dtype':<8} {'setting':<44} "
            f"{'rate':>10} {'unit':<10} {'p99/1st s':>9} {'check':<8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        setting = ",".join(f"{k}={v}" for k, v in (r.get("setting") or {}).items())
        first = (f"{r.get('task', ''):<6} {r.get('path', ''):<20} {r.get('backend', '') or '':<7} "
                 f"{r.get('dtype', '') or '':<8} {setting[:44]:<44} ")
        if r.get("error"):
            lines.append(first + f"ERROR {str(r['error'])[:90]}")
            continue
        unit, rate = next(((k, r[k]) for k in ("sentences_per_s", "essays_per_s",
                                               "requests_per_s") if r.get(k)), ("", None))
        extra = ((r.get("latency") or {}).get("p99_s") if r.get("task") == "http"
                 else r.get("first_line_s"))
        check = r.get("check") or r.get("vs_reference") or {}
        ok = next((check[k] for k in ("labels_identical", "equal", "scores_equal") if k in check),
                  None)
        lines.append(first + f"{_fmt(rate, '10.1f')} {unit.replace('_per_s', '/s'):<10} "
                             f"{_fmt(extra, '9.3f')} {'-' if ok is None else str(ok):<8}")
    lines += ["", f"targets ({'on' if targets['on_target_device'] else 'NOT on'} the target "
                  f"device; GPU goals are for an H100):"]
    for c in targets["checks"]:
        value = c["value"]
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"  {c['verdict']:<4} {c['name']:<34} {shown:>10} {c['op']} "
                     f"{c['target']}  ({c['goal']})")
    return "\n".join(lines)


def merge_results(results: Sequence[dict]) -> dict:
    """One result from several runs of one device (the GPU stages): every row, tagged with
    the index of its part in ``source``; the first header with the others under ``parts``;
    the summary and targets recomputed over all rows. ValueError when the devices differ."""
    if not results:
        raise ValueError("nothing to merge")
    devices = {json.dumps([r["header"]["device"].get(k) for k in ("requested", "gpu", "cpu")])
               for r in results}
    if len(devices) > 1:
        raise ValueError(f"the parts come from different devices: {sorted(devices)}")
    rows = [dict(row, source=k) for k, r in enumerate(results) for row in r["rows"]]
    header = dict(results[0]["header"], parts=[
        {k: r["header"].get(k) for k in ("command", "commit", "date", "tasks", "data", "note")}
        for r in results])
    tag_rows = [r for r in rows if r.get("task") == "tag"]
    device = header["device"]["requested"]
    return {"header": header, "rows": rows,
            "summary": {"tag": tagbench.summarize(tag_rows) if tag_rows else None,
                        "values": target_values(rows)},
            "targets": evaluate_targets(rows, device, header["device"].get("gpu"))}


def merge_main(argv: Sequence[str]) -> int:
    """``--merge PART.json ... --out FILE``: write the merged result and print its report."""
    p = argparse.ArgumentParser(prog="benchmark_serve.py --merge")
    p.add_argument("parts", nargs="+")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    merged = merge_results([json.loads(Path(f).read_text()) for f in a.parts])
    out = resolve_out_path(a.out, merged["header"]["device"]["requested"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=2) + "\n")
    print(format_report(merged["rows"], merged["targets"]))
    print(f"\nwrote {out}")
    return 0


TASK_FUNCTIONS = {"tag": run_tag, "score": run_score, "cli": run_cli, "http": run_http,
                  "train": run_train}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the tasks, print the report, write the JSON; 1 when a task or a check failed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--http-worker"]:
        return http_worker(argv[1])
    if argv[:1] == ["--hf-worker"]:
        return hf_worker(argv[1])
    if argv[:1] == ["--merge"]:
        return merge_main(argv[1:])
    args = parse_args(argv)

    import torch

    from mhmla_fast.provenance import provenance
    from mhmla_fast.serve.engine import default_tagger_path, read_tagger_config

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    model_dir = Path(args.model) if args.model else default_tagger_path()
    config = read_tagger_config(model_dir)
    corpus = None
    if {"tag", "cli", "http"} & set(args.tasks):
        try:
            corpus = read_corpus(args.data, args.limit, args.repeat_to)
        except FileNotFoundError as e:
            print(e, file=sys.stderr)
            return 2
    prov = provenance()
    threshold = config.get("threshold")
    header: dict[str, Any] = {
        "benchmark": "benchmark_serve", "device": device_info(args.device),
        "threads": {"torch": torch.get_num_threads(), "requested": args.threads},
        "versions": versions(), "commit": prov["commit"], "date": prov["date"],
        "command": shlex.join(["python", "bench/benchmark_serve.py", *argv]),
        "note": os.environ.get("MHMLA_BENCH_NOTE"),
        "model": {"dir": str(model_dir), "head": config.get("head"),
                  "num_heads": config.get("num_heads"), "encoder": config.get("encoder"),
                  "threshold": threshold},
        "data": None if corpus is None else {
            "files": [str(f) for f in corpus.files], "distinct_sentences": corpus.distinct,
            "sentences": len(corpus.sentences), "words": corpus.words, "limit": args.limit,
            "repeat_to": args.repeat_to},
        "tasks": args.tasks,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "tasks")},
    }
    where = header["device"].get("gpu") or header["device"]["cpu"]
    print(f"benchmark_serve on {args.device} ({where}), tasks {' '.join(args.tasks)}", flush=True)

    rows: list[dict] = []
    out = resolve_out_path(args.out, args.device,
                           datetime.datetime.now(datetime.timezone.utc).date())
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.stem + ".partial.json")
    with tempfile.TemporaryDirectory(prefix="benchmark-serve-") as tmp:
        run = Run(args, Path(tmp), model_dir, threads, corpus,
                  0.5 if threshold is None else float(threshold),
                  int(config.get("encoder_config", {}).get("max_position_embeddings", 512)),
                  partial=partial, header=header)
        for task in args.tasks:
            t0 = time.perf_counter()
            try:
                rows += TASK_FUNCTIONS[task](run)
            except Exception as e:  # noqa: BLE001 - recorded, the other tasks go on
                traceback.print_exc()
                rows.append({"task": task, "device": args.device, "path": task,
                             "error": f"{type(e).__name__}: {e}"})
            print(f"{task}: {time.perf_counter() - t0:.1f} s", flush=True)
        header["onnx"] = run.onnx_report
        if run.essays is not None:
            header["essays"] = {"model": str(run.essays["model"]), "tsv": str(run.essays["tsv"]),
                                "essays": len(run.essays["texts"]),
                                "pieces": run.essays["pieces"], "windows": run.essays["windows"]}
    header["device"]["load_average_end"] = load_average()
    tag_rows = [r for r in rows if r.get("task") == "tag"]
    summary = {"tag": tagbench.summarize(tag_rows) if tag_rows else None,
               "values": target_values(rows)}
    targets = evaluate_targets(rows, args.device, header["device"].get("gpu"))
    result = {"header": header, "rows": rows, "summary": summary, "targets": targets}
    out.write_text(json.dumps(result, indent=2, default=tagbench._json_default) + "\n")
    partial.unlink(missing_ok=True)
    print()
    print(format_report(rows, targets))
    print(f"\nwrote {out}")
    failed = [r for r in rows if r.get("error") and r.get("path") == r.get("task")]
    fp32 = [r for r in tag_rows if "check_passed" in r]
    if failed or (fp32 and not all(r["check_passed"] for r in fp32)):
        print("FAILED: " + ("; ".join(f"{r['task']}: {r['error'][:200]}" for r in failed)
                            or "the engine (torch fp32) differs from plain torch"),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
