"""``mhmla-serve``: tag corpora with the GED tagger, score essays, serve both over HTTP, export.

    mhmla-serve tag [FILE ...|-] [--output FILE [--resume]] [--pretty] [model/engine options]
                    [--ray [ADDRESS] [--ray-workers N] [--shard-size N]]
    mhmla-serve score [FILE ...|-] [--output FILE [--resume]] [--model DIR] [--batch-essays N]
                      [--ray [ADDRESS] [--ray-workers N] [--shard-size N]]
    mhmla-serve http [--host 127.0.0.1] [--port 8000] [--workers N] [model/engine options]
                     [batching limits] [--scorer DIR | --no-scorer]
    mhmla-serve export (--onnx DIR [--int8] | --tensorrt DIR) [--model DIR]

``tag``
    Input: the files in order (``-`` or nothing = standard input), one record per line: plain
    text, or a JSON object with ``"text"`` or ``"tokens"`` (and optional ``"id"``); the rules are
    those of :mod:`mhmla_fast.serve.inputs`. Output: JSONL, one line per input line in input
    order, ``{"index", "id", "tokens", "offsets" (raw text only), "labels", "probs", "spans"}``,
    or ``{"index", "id", "error"}`` for a malformed line (tagging goes on). ``--output FILE`` is
    written append-only and fsync-ed as it goes; after a crash or ``kill -9`` rerun the same
    command with ``--resume`` to continue where it stopped (an existing output is never
    overwritten without it). ``--pretty`` prints a readable view to standard output instead:
    ``<index> [id] <text>`` with the flagged errors in red when standard output is a terminal
    (``NO_COLOR`` turns colour off) and in ``[[...]]`` otherwise. A progress bar with records/s
    goes to standard error (not with ``--no-progress``, nor with ``--pretty`` on a terminal),
    with the word pieces encoded so far (they move within one long record). ``--format
    auto|text|jsonl`` and ``--encoding`` say how lines are read; ``--max-chars N`` skips longer
    records, or with ``--over-long cap`` tags their first N characters (``"capped_from"``).
    ``FILE.meta.json`` records what ``--output FILE`` was made from (model fingerprint,
    options, input fingerprint; :mod:`mhmla_fast.serve.outputs`): ``--resume`` refuses other
    input, model or options, a file without it (never truncated), and a second writer.

``score``
    Essay scores with an :class:`~mhmla_fast.aes.model.EssayScorer` (``--model DIR``, by default
    the scorer shipped in the package). Input: the files in order (``-`` or nothing = standard
    input; ``--input FILE`` is the same as one positional FILE), JSONL, one essay per line:
    ``{"text": str, "prompt": int, "id": str|int (optional, default: the line's global 1-based
    index)}``; other fields are ignored. Output: JSONL, one line per input line in input order,
    ``{"index", "id", "prompt", "score"}`` with the integer score on that prompt's scale
    (``mhmla_fast.aes.data.SCORE_RANGES``) and ``"advisories"`` where the essay lies far outside
    the essays the scorer was fitted on (its score is an extrapolation;
    ``mhmla_fast.serve.score.with_advisories``), or ``{"index", "id", "error"}`` for a malformed line:
    not JSON, plain text, a missing/empty/blank ``"text"``, a ``"prompt"`` that is not an integer
    1..8 or has no output layer in the scorer, a bad ``"id"``, a ``"text"`` that gives no word
    pieces with the scorer's tokenizer (it would be scored as an empty essay); scoring goes on.
    Essays are scored in chunks of ``--batch-essays`` (64) valid records, each chunk ONE
    ``predict_scores`` call, so all windows of all its essays go through the encoder together
    (``--token-budget`` padded word pieces per forward pass). ``--output``, ``--resume``, the
    progress bar (essays/s) and the exit statuses are those of ``tag``. ``--backend`` auto
    (default) runs the scorer's cached ONNX export on the CPU
    (:mod:`mhmla_fast.serve.score_onnx`), torch elsewhere.

``tag --ray`` / ``score --ray``
    The same records, sidecar and exit statuses, computed on Ray Data
    (:mod:`mhmla_fast.serve.ray`, ``pip install 'mhmla-fast[ray]'``): ``--ray-workers`` actors
    (default 2), one engine each, ``--threads`` CPU cores each (or one GPU each on ``--device
    cuda``), on the cluster at ``--ray ADDRESS`` or on a local Ray started for the job. Input
    files only, readable by every worker (local paths, or URIs of pyarrow's filesystems:
    ``s3://...``), and ``--output FILE`` (a local path): shards of
    ``--shard-size`` records are committed atomically in ``FILE.shards/``, then concatenated
    into FILE. ``--resume`` skips committed shards: each record exactly once.

``http``
    Serves :func:`mhmla_fast.serve.http.create_app` with uvicorn (``POST /v1/tag``, ``POST
    /v1/score``, ``GET /healthz``, ``GET /metrics``, docs at ``/docs``); localhost only unless
    ``--host`` says otherwise. One process, one worker thread for the tagger and the scorer: the
    app batches concurrent requests itself. ``--workers N`` runs N such processes on the one
    port (:mod:`mhmla_fast.serve.http_workers`): each loads the models and batches its own
    requests, ``/metrics`` sums them all, ``/healthz`` says how many serve. The scorer is
    ``--scorer DIR``, else the shipped one when it is installed; ``--no-scorer`` (or no scorer
    installed) serves tagging only, and ``/v1/score`` then answers 404.

``export``
    ``--onnx DIR``: :func:`mhmla_fast.serve.onnx_export.export_onnx` (``--int8`` adds the int8
    graph). ``--tensorrt DIR``: exports the tagger to ONNX into DIR, then builds DIR/model.plan
    with :func:`mhmla_fast.serve.tensorrt_engine.build_engine_dir` (``--precision``,
    ``--layer-attention-plugin``); ``--model`` may instead be an ONNX export, built in place.

The model is ``--model DIR`` (a tagger directory, or an ONNX/TensorRT export for those
backends), by default the tagger shipped in the package. ``tag``, ``score`` and ``http`` load it
with the one serving contract of :mod:`mhmla_fast.serve.options`: ``--backend`` is the runtime
(auto, torch, onnx, tensorrt; the scorer: auto or torch; auto, the default, runs ONNX Runtime
on a cached export validated to give torch's labels or scores on the CPU in float32 and torch
otherwise, see :mod:`mhmla_fast.serve.export_cache`; ``--no-cache`` or ``MHMLA_NO_CACHE=1``
keeps it on torch), ``--device`` (default: cuda when the
backend can use a GPU, else cpu), ``--dtype`` (default: bfloat16 for torch on cuda, else
float32), ``--kernels`` the layer-attention head's implementation (auto, torch, triton) and
``--threads`` the runtime's CPU threads. An option the backend cannot honour (e.g. ``--device
cuda`` with an onnxruntime that has no CUDA provider, ``--kernels triton`` with onnx) is a usage
error (exit 2) naming it.

Exit status: 0 all went well; 1 ``tag``/``score`` found malformed input lines (each has its
error record) or an export failed; 2 usage error, missing or unloadable model, unusable input or
output file, an ``http`` worker that failed to start; 3 ``tag``/``score`` stopped on an
unexpected error (the output so far is kept; ``--resume`` continues);
130 interrupted (likewise resumable); 141 the reader of standard output went away.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..serve.pipeline import PrettyWriter, format_pretty, tag_records  # noqa: F401
from .argtypes import non_negative_float, non_negative_int, port, positive_int, probability

PROG = "mhmla-serve"
EXIT_OK, EXIT_BAD_LINES, EXIT_USAGE, EXIT_FAILED = 0, 1, 2, 3
EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 130, 141


class UsageError(Exception):
    """A problem with the arguments, the model or the files: message for the user, exit 2."""


# ------------------------------------------------------------------------------------ model


def resolve_model_dir(model: str | None) -> Path:
    """The model directory to load: ``model``, else the shipped tagger.

    Raises UsageError with what to do when it is missing or is not a model directory."""
    from ..ged import predict

    if model:
        path = Path(model)
        if not path.exists():
            raise UsageError(f"--model {model}: no such directory")
    else:
        path = predict.default_model_path()
        if not (path / "config.json").is_file():
            raise UsageError(
                f"the shipped GED model is not installed (expected at {path}; it may still be "
                "in training). Pass --model DIR with a trained tagger directory, e.g. the best/ "
                "folder of an `mhmla-train ged --out RUN` run.")
    if not path.is_dir():
        raise UsageError(f"{path}: not a directory")
    if not (path / "config.json").is_file():
        raise UsageError(f"{path}: not a tagger or export directory (it has no config.json)")
    return path


def check_options(args: argparse.Namespace, *, scorer: bool = False):
    """``--backend``/``--device``/``--dtype``/``--kernels`` (and ``--lanes``) checked by the one
    serving rule (:func:`mhmla_fast.serve.options.resolve_options`; for ``score`` through
    :func:`mhmla_fast.serve.score.scorer_options`) before anything is loaded; an option the
    backend cannot honour is a UsageError naming it. Returns the resolved
    :class:`~mhmla_fast.serve.options.ServeOptions`."""
    from ..serve.options import resolve_options
    from ..serve.runners import Lanes, check_margin_option
    from ..serve.score import scorer_options

    try:
        if scorer:
            opts = scorer_options(args.backend, args.device, args.dtype, args.kernels)
        else:
            lanes = getattr(args, "lanes", None) or 1
            opts = resolve_options(args.backend, args.device, args.dtype, args.kernels,
                                   cuda_graphs=getattr(args, "cuda_graphs", False), lanes=lanes)
            Lanes.split(getattr(args, "threads", None), lanes)  # enough threads for the lanes
        check_margin_option(getattr(args, "check_margin", None), opts)
        return opts
    except ValueError as err:  # "<option>: why", the option as the API spells it
        name, _, why = str(err).partition(":")
        raise UsageError(f"--{name.replace('_', '-')}:{why}") from err


def load_engine(args: argparse.Namespace):
    """The engine for ``args``: ``Engine.load`` with the model, the load contract (backend,
    device, dtype, kernels, threads), the threshold and the token budget."""
    from ..serve.engine import Engine
    from ..serve.options import throughput_lanes

    opts = check_options(args)
    path = resolve_model_dir(args.model)
    lanes = getattr(args, "lanes", 1)  # `tag` has --lanes (None: one per thread on the CPU)
    if lanes is None:
        lanes = throughput_lanes(opts.device, args.threads)
    try:
        engine = Engine.load(path, backend=args.backend, device=args.device, dtype=args.dtype,
                             kernels=args.kernels, threads=args.threads, lanes=lanes,
                             threshold=args.threshold, token_budget=args.token_budget,
                             host_workers=getattr(args, "host_workers", 0),
                             cuda_graphs=getattr(args, "cuda_graphs", False),
                             check_margin=getattr(args, "check_margin", None),
                             cache=False if getattr(args, "no_cache", False) else None)
    except Exception as err:  # any failure to load is a model problem for the user
        raise UsageError(f"cannot load the model from {path} ({args.backend}): "
                         f"{type(err).__name__}: {err}") from err
    return path, engine


def resolve_scorer_dir(model: str | None, option: str = "--model") -> Path:
    """The essay-scorer directory to load: ``model``, else the shipped scorer.

    Raises UsageError with what to do when it is missing or is not a scorer directory
    (``option`` names the command-line option in the messages)."""
    from ..serve.score import default_scorer_path

    if model:
        path = Path(model)
        if not path.exists():
            raise UsageError(f"{option} {model}: no such directory")
    else:
        path = default_scorer_path()
        if not (path / "config.json").is_file():
            raise UsageError(
                f"the shipped essay scorer is not installed (expected at {path}). Pass "
                f"{option} DIR with a scorer directory, e.g. one written by "
                "`mhmla-train aes --export-shipped DIR`.")
    if not path.is_dir():
        raise UsageError(f"{path}: not a directory")
    has_model = any((path / name).is_file() for name in ("model.safetensors", "model.onnx"))
    if not (path / "config.json").is_file() or not has_model:  # (an ONNX export runs as it is)
        raise UsageError(f"{path}: not an essay-scorer directory (it needs config.json and "
                         "model.safetensors, or an export's model.onnx)")
    return path


def load_scorer_dir(path: Path, args: argparse.Namespace, *, backend: str = "auto",
                    dtype: str | None = None, check_margin: float | None = None,
                    kernels: str | None = None):
    """``serve.score.load_scorer(path)`` with ``backend``, ``args``' device, kernels (or
    ``kernels``), threads and ``--no-cache`` (and ``dtype``, ``check_margin``); any failure
    becomes a UsageError naming ``path``."""
    from ..serve.score import load_scorer

    try:
        return load_scorer(path, backend=backend, device=args.device, dtype=dtype,
                           kernels=kernels or args.kernels, threads=args.threads,
                           cache=False if getattr(args, "no_cache", False) else None,
                           check_margin=check_margin)
    except Exception as err:  # any failure to load is a model problem for the user
        raise UsageError(f"cannot load the essay scorer from {path}: "
                         f"{type(err).__name__}: {err}") from err


def _add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", metavar="DIR", default=None,
                   help="tagger directory or export (default: the shipped model)")
    _add_backend_option(g)
    g.add_argument("--dtype", default=None, help="torch: float32/bfloat16/float16 (default "
                   "bfloat16 on cuda, float32 on cpu); onnx: float32 (default) or int8; "
                   "openvino: float32 or bfloat16 (labels checked in fp32, --check-margin); "
                   "auto on a CPU with AMX and OpenVINO: the checked bfloat16 pass unless "
                   "float32 is asked for; tensorrt: the precision the plan was built with")
    g.add_argument("--check-margin", type=float, default=None, metavar="M",
                   help="the checked bfloat16 pass (openvino, or auto on a CPU with AMX): rows "
                   "with a word whose bf16 probability lies within M of the threshold are "
                   "tagged again in fp32 (default 0.05; 0: bf16 alone)")
    g.add_argument("--threshold", type=probability, default=None,
                   help="error-probability threshold (default: the model's tuned one)")
    g.add_argument("--no-cache", action="store_true",
                   help="backend auto: neither read nor write the ONNX export cache (run torch); "
                   "also MHMLA_NO_CACHE=1. The cache is $MHMLA_CACHE_DIR, else "
                   "$XDG_CACHE_HOME/mhmla-fast or ~/.cache/mhmla-fast")
    _add_compute_options(g)


def _add_backend_option(g, help: str | None = None, default: str = "auto",
                        choices: Sequence[str] | None = None) -> None:
    from ..serve.options import BACKENDS

    g.add_argument("--backend", default=default, choices=choices or BACKENDS, help=help or (
        "the runtime: auto (default: on the CPU in float32, ONNX Runtime on a cached export "
        "validated to give torch's labels, made once on first use; torch on a GPU or where "
        "onnxruntime is missing; on a CPU with AMX and OpenVINO installed, the checked "
        "bfloat16 pass on that export), torch, onnx (ONNX Runtime on an export made by `export "
        "--onnx`), openvino (OpenVINO on such an export, CPU), tensorrt (a plan made by "
        "`export --tensorrt`)"))


def _add_compute_options(g) -> None:
    """``--device``, ``--kernels``, ``--token-budget`` and ``--threads``: where and how the
    forward passes of ``tag`` and ``score`` run."""
    from ..serve.options import KERNELS

    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when the "
                   "backend can use a GPU, else cpu)")
    g.add_argument("--kernels", default="auto", choices=KERNELS,
                   help="the layer-attention head's implementation: auto (default: what was "
                   "measured faster, the fused Triton forward for large batches on cuda, else "
                   "eager), torch (eager), triton (fused)")
    g.add_argument("--token-budget", type=positive_int, default=None,
                   help="padded word pieces per forward pass (default: 1024 on the CPU, 8192 "
                   "on a GPU, the faster measured)")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads of the runtime (torch or ONNX Runtime intra-op; default: "
                   "the runtime's choice; fewer on a shared machine)")


def _add_cuda_graphs_option(p: argparse.ArgumentParser) -> None:
    """``--cuda-graphs`` of ``tag`` and ``http`` (the tagger's torch backend on CUDA)."""
    p.add_argument("--cuda-graphs", action="store_true",
                   help="torch on cuda only: pad each forward pass to one of a few shapes and "
                   "replay it from a CUDA graph captured at its first use (less host time per "
                   "pass; default off)")


def _add_file_options(p: argparse.ArgumentParser, *, formats: Sequence[str]) -> None:
    """Input files, ``--format``, ``--encoding``, ``--output``, ``--resume`` and ``--max-chars``
    of ``tag`` and ``score``."""
    p.add_argument("inputs", nargs="*", metavar="FILE", help="input files; - or none: stdin")
    p.add_argument("--format", default="auto", choices=formats,
                   help="what an input line is: auto (default: a line starting with { is a JSON "
                   "object, any other line plain text" + ("; every line of a file named *.jsonl "
                                                          "or *.ndjson a JSON object)"
                                                          if "text" in formats else
                                                          ", an error record: an essay needs "
                                                          "its prompt)")
                   + (", text (every line is plain text)" if "text" in formats else "")
                   + ", jsonl (every line must be a JSON object)")
    p.add_argument("--encoding", default="utf-8",
                   help="input encoding (default utf-8; any ASCII-compatible codec, e.g. "
                   "latin-1, cp1252, shift_jis)")
    p.add_argument("-o", "--output", metavar="FILE", default=None,
                   help="JSONL output (default: standard output); FILE.meta.json records what "
                   "it was made from")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted --output made from the same input, model and "
                   "options (anything else is refused) instead of refusing to touch it")
    p.add_argument("--max-chars", type=positive_int, default=None, metavar="N",
                   help="records longer than N characters are skipped (an error record) or, with "
                   "--over-long cap, cut to their first N characters (default: no limit)")
    p.add_argument("--over-long", default=None, choices=("skip", "cap"),
                   help="with --max-chars: skip over-long records (default) or cap them")


# -------------------------------------------------------------------------------------- tag


def _count_lines(paths: Sequence[str]) -> int | None:
    """Records in ``paths`` (one per line, a last line without newline included; a Parquet
    file's rows from its footer), or None when one of them is standard input or not a regular
    file."""
    from ..serve.inputs import is_parquet, open_parquet

    total = 0
    for p in paths:
        if p == "-" or not os.path.isfile(p):
            return None
        if is_parquet(p):
            try:
                total += open_parquet(p).metadata.num_rows
            except ValueError:  # not Parquet after all: the reader reports it
                return None
            continue
        try:
            with open(p, "rb") as f:
                last = b""
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    total += chunk.count(b"\n")
                    last = chunk
        except OSError:  # unreadable: no total; the reader reports it
            return None
        total += bool(last) and not last.endswith(b"\n")
    return total


def over_long(args: argparse.Namespace) -> str:
    """``--over-long`` ("skip" when not given); given without ``--max-chars`` it is a UsageError."""
    if args.over_long is not None and args.max_chars is None:
        raise UsageError(f"--over-long {args.over_long} goes with --max-chars N (the limit it "
                         "applies to)")
    return args.over_long or "skip"


def _close_quietly(writer: Any) -> None:
    try:
        writer.close()
    except Exception:  # already failing: the first error is the one to report
        pass


def _stdout_is_tty() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def read_inputs(args: argparse.Namespace, inputs: Sequence[str], kind: str):
    """The input records of ``tag``/``score`` (:func:`~mhmla_fast.serve.inputs.iter_input_records`
    with ``--format`` and ``--encoding``, then ``--max-chars``/``--over-long``); bad arguments and
    missing files become UsageError."""
    from ..serve.inputs import iter_input_records, limit_length

    try:
        records = iter_input_records(inputs, kind, format=args.format, encoding=args.encoding,
                                     max_chars=args.max_chars)
    except (OSError, ValueError) as err:
        raise UsageError(str(err).replace("format: ", "--format: ", 1)
                         .replace("encoding: ", "--encoding: ", 1)) from err
    return limit_length(records, args.max_chars, over_long(args))


def run_tag(args: argparse.Namespace) -> int:
    if args.pretty and (args.output or args.resume):
        raise UsageError("--pretty prints to standard output; it cannot be combined with "
                         "--output/--resume")
    if args.resume and not args.output:
        raise UsageError("--resume needs --output FILE")
    inputs = args.inputs or ["-"]
    check_output(args.output, inputs)
    _check_ray_options(args)
    if args.ray is not None:
        return run_ray(args, "tag", inputs)
    records = read_inputs(args, inputs, "tag")
    path, engine = load_engine(args)  # before the output is opened: a bad model leaves no file
    progress = not args.no_progress and not (args.pretty and _stdout_is_tty())
    total = _count_lines(inputs) if progress else None
    if args.pretty:
        colour = _stdout_is_tty() and not os.environ.get("NO_COLOR")
        writer: Any = PrettyWriter(sys.stdout, colour)

        def process(batch, report=None):
            results = tag_records(engine, batch, report)
            for rec, res in zip(batch, results):
                res["_text"] = rec.text
            return results
    else:
        dtype = check_options(args).dtype
        writer = open_output(args.output, args.resume, lambda: made_from(
            "tag", path, args, dtype=dtype, threshold=float(engine.threshold)))

        def process(batch, report=None):
            return tag_records(engine, batch, report)

    return drive_records(records, process, writer, args.batch_size, output=args.output,
                         progress=progress, total=total, desc=f"tagging ({path.name})",
                         verb="tagging", count_pieces=progress)


def check_output(output: str | None, inputs: Sequence[str]) -> None:
    """UsageError for an ``--output`` that is empty (an unset variable in a script: not
    standard output) or is one of the input files."""
    if output == "":
        raise UsageError("--output: empty file name; give a file, or leave -o out (or give "
                         "-o -) for standard output")
    if output in (None, "-") or not os.path.exists(output):
        return
    for path in inputs:
        try:
            same = path != "-" and os.path.samefile(output, path)
        except OSError:  # a URI or a missing input: not this file
            same = False
        if same:
            raise UsageError(f"--output {output} is the input file {path}; write the results "
                             "to another file")


def open_output(output: str | None, resume: bool, made_from: Any = None):
    """The :class:`~mhmla_fast.serve.outputs.ResumableJsonlWriter` of ``--output`` (None or
    ``-``: standard output); ``made_from`` (a dict, or a function making it, called only for a
    file) goes to its sidecar. Refusals (existing output, other input or settings on resume, a
    file that is not ours, another writer holding the lock) become UsageError."""
    from ..serve.outputs import ResumableJsonlWriter

    if callable(made_from):
        made_from = made_from() if output not in (None, "-") else None
    try:
        return ResumableJsonlWriter(output or "-", resume=resume, made_from=made_from)
    except (OSError, ValueError) as err:
        raise UsageError(str(err)) from err


def made_from(command: str, model: Path, args: argparse.Namespace, **settings: Any) -> dict:
    """What an output of ``command`` is made from, for its sidecar: the model directory's
    fingerprint and every option that changes records (``--format``, ``--encoding``,
    ``--max-chars``, ``--over-long``, ``--backend``, ``--check-margin`` when given, and
    ``settings``, e.g. the resolved dtype and threshold), and the fingerprint of the encoder
    files the model reads from the encoder's package (the shipped models' word embeddings and
    tokenizer: an upgraded package changes them). Batch sizes, token budgets, threads,
    device and kernels are left out: they change probabilities only within float rounding (a
    resumed run may use other ones)."""
    from ..aes.fingerprints import files_fingerprint
    from ..serve.export_cache import encoder_source_dir
    from ..serve.inputs import check_encoding
    from ..serve.outputs import directory_fingerprint

    # --check-margin 0 is bf16 alone, whose labels and scores may differ (recorded only when
    # given: the sidecars of outputs made without it stay as they were)
    margin = getattr(args, "check_margin", None)
    encoder = encoder_source_dir(model)
    return {"command": command, "model_sha256": directory_fingerprint(model),
            **({"encoder_sha256": files_fingerprint(encoder)} if encoder else {}),
            "backend": args.backend, "format": args.format,
            "encoding": check_encoding(args.encoding), "max_chars": args.max_chars,
            "over_long": over_long(args) if args.max_chars else None,
            **({"check_margin": margin} if margin is not None else {}), **settings}


FIRST_BATCH = 32  # records in the first batch of tag/score; the next ones double


def drive_records(records: Any, process: Any, writer: Any, batch_size: int, *,
                  output: str | None, progress: bool, total: int | None, desc: str,
                  verb: str, unit: str = "rec", count_pieces: bool = False) -> int:
    """Run :func:`~mhmla_fast.serve.records.run_records` and turn its outcome into the exit
    status of ``tag``/``score`` (:func:`exit_status`). The writer is closed. Batches start at
    ``FIRST_BATCH`` records and double up to ``batch_size``, so the first results are written
    soon after start."""
    from ..serve.records import run_records

    def run():
        summary = run_records(records, process, writer, batch_size, progress=progress,
                              total=total, desc=desc, unit=unit, count_pieces=count_pieces,
                              first_batch=FIRST_BATCH)
        if output not in (None, "-"):  # a Ray job's shards, now in the finished output
            from ..serve.ray import shards_dir

            if shards_dir(output).is_dir():
                shutil.rmtree(shards_dir(output), ignore_errors=True)  # (the lock is held)
        writer.close()
        return summary

    return exit_status(run, lambda: _close_quietly(writer), output=output, verb=verb)


def exit_status(run: Any, close: Any, *, output: str | None, verb: str) -> int:
    """Call ``run()`` (it returns a :class:`~mhmla_fast.serve.records.RunSummary`) and turn its
    outcome into the exit status of ``tag``/``score`` (``verb`` is "tagging" or "scoring" in the
    messages): 0, 1 when some input lines were malformed, 3 when it stopped on an error, 130
    interrupted, 141 broken pipe; a refused resume (other input or settings, an output that is
    not ours or is locked) raises UsageError. ``close()`` runs when ``run`` fails."""
    from ..serve.outputs import REFUSALS, NotStartedError

    to_file = output not in (None, "-")
    resume_hint = f"; rerun with --resume to continue {output}" if to_file else ""
    try:
        summary = run()
    except REFUSALS as err:  # (a resume would not help these)
        close()
        raise UsageError(str(err)) from err
    except NotStartedError as err:
        close()
        print(f"{PROG}: {verb} could not start: {err}; nothing was written (the same command "
              "tries again)", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        close()  # synced: every complete line counts on --resume
        print(f"{PROG}: interrupted{resume_hint}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader of standard output went away (e.g. `| head`)
        try:  # no second error when Python flushes standard output at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return EXIT_BROKEN_PIPE
    except Exception as err:
        close()
        print(f"{PROG}: {verb} stopped: {type(err).__name__}: {err}{resume_hint}",
              file=sys.stderr)
        return EXIT_FAILED
    if summary.n_errors:
        print(f"{PROG}: {summary.n_errors} of {summary.n_total} input lines were malformed "
              "(see their \"error\" records)", file=sys.stderr)
        return EXIT_BAD_LINES
    return EXIT_OK


# ------------------------------------------------------------------------------------- ray


def _ray_address(value: str) -> str | None:
    """``--ray [ADDRESS]``: None (start a local Ray) for no address or "local", else the
    address; UsageError for a value that is no address (an input file after ``--ray``)."""
    import re

    if value in ("", "local"):
        return None
    if value == "auto" or "://" in value or re.fullmatch(r"[\w.\-]+:\d+|\[[0-9a-fA-F:]+\]:\d+",
                                                           value):
        return value
    raise UsageError(f"--ray {value}: not a Ray address (auto, local, HOST:PORT or "
                     "ray://HOST:PORT); give the input files before --ray, or --ray=ADDRESS")


def run_ray(args: argparse.Namespace, kind: str, inputs: Sequence[str]) -> int:
    """``tag --ray`` / ``score --ray``: the same records, sidecar and exit statuses as the
    single-process command, computed by :func:`mhmla_fast.serve.ray.run_job` on a Ray
    cluster (``--ray ADDRESS``) or a local Ray (``--ray`` alone) with ``--ray-workers``
    actors, in shards of ``--shard-size`` records."""
    if getattr(args, "cuda_graphs", False):
        raise UsageError("--cuda-graphs is not available with --ray (the Ray workers load the "
                         "model without it); run without --ray, or without --cuda-graphs")
    if getattr(args, "host_workers", 0):
        raise UsageError("--host-workers applies to one process; with --ray, --ray-workers "
                         "sets the parallelism")
    if getattr(args, "lanes", None) is not None:
        raise UsageError("--lanes applies to one process; with --ray, --ray-workers and "
                         "--threads set the parallelism")
    if getattr(args, "check_margin", None) is not None:
        raise UsageError("--check-margin applies to one process; with --ray each worker "
                         "runs the checked pass at its default margin")
    try:
        import ray  # noqa: F401  (the optional extra)

        from ..serve.ray import RayJob, check_regular_files, check_uri, is_uri, run_job
    except ImportError as err:
        raise UsageError(f"--ray needs Ray Data (pip install 'mhmla-fast[ray]'): {err}") from err
    from ..serve.engine import read_tagger_config
    from ..serve.export_cache import cache_enabled

    if getattr(args, "pretty", False):
        raise UsageError("--pretty prints to standard output; it cannot be combined with --ray")
    if args.output in (None, "-"):
        raise UsageError("--ray writes its shards next to --output FILE; give --output FILE")
    address = _ray_address(args.ray)  # first: an input given right after --ray is named
    if "-" in inputs:
        raise UsageError("--ray reads files, not standard input: give the input files")
    local = [p for p in inputs if not is_uri(p)]
    read_inputs(args, local, kind)  # the CLI's checks
    try:
        check_regular_files(local)
    except ValueError as err:
        raise UsageError(str(err)) from err
    for uri in filter(is_uri, inputs):
        try:
            check_uri(uri)
        except (OSError, ValueError) as err:  # pyarrow: ArrowInvalid is a ValueError
            raise UsageError(str(err)) from err
    if kind == "tag":
        opts = check_options(args)
        path = resolve_model_dir(args.model)
        try:  # the workers load the model; the driver checks its kind first
            config = read_tagger_config(path)
        except (OSError, ValueError) as err:
            raise UsageError(f"cannot load the model from {path}: {err}") from err
        threshold = args.threshold
        if threshold is None:
            threshold = config.get("threshold")
            threshold = 0.5 if threshold is None else threshold
        settings: dict[str, Any] = {"dtype": opts.dtype, "threshold": float(threshold)}
        prompts, batch_size = None, args.batch_size
    else:
        from ..aes.data import SCORE_RANGES
        from ..aes.scoring import read_scorer_config

        opts = check_options(args, scorer=True)
        path = resolve_scorer_dir(args.model)
        try:
            config = read_scorer_config(path)
        except (OSError, ValueError) as err:
            raise UsageError(f"cannot load the model from {path}: {err}") from err
        prompts = tuple(int(p) for p in config.get("prompts", sorted(SCORE_RANGES)))
        settings, threshold, batch_size = {"dtype": opts.dtype}, None, args.batch_essays
    # auto's checked bf16 pass is this CPU's choice: with no --dtype each worker makes its own
    # (the checked pass on AMX, ONNX Runtime fp32 elsewhere: fp32's labels and scores either way)
    dtype = opts.dtype
    if opts.backend == "auto" and args.dtype is None:
        dtype = None
    job = RayJob(kind, str(path), backend=opts.backend, device=opts.device, dtype=dtype,
                 kernels=opts.kernels, threads=args.threads, threshold=threshold,
                 cache=False if getattr(args, "no_cache", False) or not cache_enabled() else None,
                 token_budget=args.token_budget, batch_size=batch_size, format=args.format,
                 encoding=args.encoding, max_chars=args.max_chars, over_long=over_long(args),
                 prompts=prompts)
    made = made_from(kind, path, args, **settings)
    return exit_status(lambda: run_job(job, inputs, args.output, made_from=made,
                                       resume=args.resume, address=address,
                                       workers=args.ray_workers, shard_size=args.shard_size,
                                       progress=not args.no_progress),
                       lambda: None, output=args.output,
                       verb="tagging" if kind == "tag" else "scoring")


def _add_ray_options(p: argparse.ArgumentParser, what: str) -> None:
    g = p.add_argument_group("Ray (pip install 'mhmla-fast[ray]')")
    g.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help=f"{what} on Ray Data: a cluster at ADDRESS (auto, HOST:PORT, "
                   "ray://HOST:PORT), or a local Ray without one; needs --output FILE, writes "
                   "FILE.shards/ and resumes by shard")
    g.add_argument("--ray-workers", type=positive_int, default=None, metavar="N",
                   help="with --ray: actors, one engine each (default 2; each takes --threads "
                   "CPU cores, or one GPU on --device cuda)")
    g.add_argument("--shard-size", type=positive_int, default=None, metavar="N",
                   help="with --ray: records per committed shard (default 8192 for tag, 512 "
                   "for score; a resumed job keeps its own)")


def _check_ray_options(args: argparse.Namespace) -> None:
    """``--ray-workers``/``--shard-size`` without ``--ray`` are errors, never dropped."""
    if args.ray is None:
        for name in ("ray_workers", "shard_size"):
            if getattr(args, name) is not None:
                raise UsageError(f"--{name.replace('_', '-')} goes with --ray")
    elif args.ray_workers is None:
        args.ray_workers = 2


# ------------------------------------------------------------------------------------ score


def run_score(args: argparse.Namespace) -> int:
    """``mhmla-serve score``: essays (JSONL) -> ``{"index", "id", "prompt", "score"}`` records
    (with ``"advisories"`` where there are some; or error records) in input order; returns the
    exit status (see :func:`drive_records`)."""
    from ..serve.score import check_prompts, essay_pieces_check, score_records

    if args.resume and not args.output:
        raise UsageError("--resume needs --output FILE")
    if args.input and args.inputs:
        raise UsageError("give the input files either as arguments or with --input, not both")
    inputs = args.inputs or ([args.input] if args.input else ["-"])
    check_output(args.output, inputs)
    _check_ray_options(args)
    if args.ray is not None:
        return run_ray(args, "score", inputs)
    records = read_inputs(args, inputs, "score")
    opts = check_options(args, scorer=True)
    path = resolve_scorer_dir(args.model)
    scorer = load_scorer_dir(path, args, backend=opts.backend, dtype=args.dtype,  # before output
                             check_margin=args.check_margin)
    writer = open_output(args.output, args.resume, lambda: made_from(
        "score", path, args, dtype=opts.dtype))
    progress = not args.no_progress
    total = _count_lines(inputs) if progress else None

    check = essay_pieces_check(scorer)  # essays with no word pieces: error records

    def process(batch):
        return score_records(scorer, batch, args.token_budget, check=check)

    return drive_records(check_prompts(records, scorer.config.prompts), process, writer,
                         args.batch_essays, output=args.output, progress=progress, total=total,
                         desc=f"scoring ({path.name})", verb="scoring", unit="essay")


# ------------------------------------------------------------------------------------- http


HTTP_ARGS_ENV = "MHMLA_HTTP_ARGS"  # the parsed options, for the workers of ``http --workers``


def run_http(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ..serve.http import create_app  # noqa: F401 - the dependencies, checked
    except ImportError as err:
        raise UsageError(f"the HTTP server needs fastapi, uvicorn and prometheus-client "
                         f"(pip install 'mhmla-fast[serve]'): {err}") from err
    server = dict(host=args.host, port=args.port, log_level=args.log_level,
                  access_log=not args.no_access_log,
                  timeout_graceful_shutdown=args.graceful_timeout,
                  limit_concurrency=args.limit_concurrency or None)
    if args.workers == 1:  # (workers=1: $WEB_CONCURRENCY, which uvicorn reads, is not for us)
        uvicorn.run(build_http_app(args), workers=1, **server)
        return EXIT_OK
    return run_http_workers(args, server)


def run_http_workers(args: argparse.Namespace, server: dict[str, Any]) -> int:
    """``http --workers N``: the options checked here, then N worker processes that each load
    the models and serve (:mod:`mhmla_fast.serve.http_workers`); ``--threads`` defaults to the
    physical cores shared out among the workers."""
    import json

    from ..devices import physical_cores
    from ..serve.http_workers import max_workers, serve_workers

    if args.workers > max_workers():
        raise UsageError(f"--workers: at most {max_workers()} on this machine (twice its "
                         f"{os.cpu_count()} logical CPUs; each worker loads its own copy of the "
                         f"models), got {args.workers}")
    check_options(args)
    resolve_model_dir(args.model)
    scorer = http_scorer_dir(args)  # decided (and a missing scorer said) once, not per worker
    args.scorer, args.no_scorer = (str(scorer), False) if scorer else (None, True)
    check_http_limits(args, scoring=scorer is not None)
    if args.threads is None:
        args.threads = max(1, physical_cores() // args.workers)
    options = {k: v for k, v in vars(args).items() if k != "run"}
    try:
        started = serve_workers(f"{__name__}:http_worker_app", args.workers,
                                env={HTTP_ARGS_ENV: json.dumps(options)}, **server)
    except RuntimeError as err:  # an uvicorn too old for workers
        raise UsageError(f"--workers: {err}") from err
    if not started:
        print(f"{PROG} http: a worker failed to start (its error is above); stopped",
              file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def http_worker_app():
    """The app of one worker of ``http --workers N``, built from the options the parent parsed
    (``MHMLA_HTTP_ARGS``); uvicorn calls it once in each worker process. A worker that cannot
    build it exits with uvicorn's start-up failure status (3), which stops the server."""
    import json
    import traceback

    from uvicorn.config import STARTUP_FAILURE

    from ..serve.http_workers import WorkerGroup, follow_parent

    follow_parent()  # a parent killed with kill -9 takes its workers with it
    try:
        args = argparse.Namespace(**json.loads(os.environ[HTTP_ARGS_ENV]))
        return build_http_app(args, group=WorkerGroup.from_env())
    except UsageError as err:
        print(f"{PROG} http: worker {os.getpid()}: {err}", file=sys.stderr)
    except Exception:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    # at once: the supervisor notices a dead worker within half a second, but it waits out its
    # health-check timeout for one still tearing down its interpreter
    os._exit(STARTUP_FAILURE)


def build_http_app(args: argparse.Namespace, group: Any = None):
    """The HTTP app for ``args``: the tagger (:func:`load_engine`), the scorer
    (:func:`load_http_scorer`) and the batching limits, the limits checked before either model
    loads (:func:`check_http_limits`); ``group``: the worker group of ``--workers``
    (:func:`mhmla_fast.serve.http.create_app`)."""
    from ..serve.http import create_app

    scorer_dir = http_scorer_dir(args)
    limits = check_http_limits(args, scoring=scorer_dir is not None)  # before the models load
    path, engine = load_engine(args)
    scorer_path, scorer = load_http_scorer_from(scorer_dir, args)
    try:
        return create_app(engine, max_batch_tokens=args.max_batch_tokens,
                          max_wait_ms=args.max_wait_ms, model_name=path.name, scorer=scorer,
                          scorer_name=scorer_path.name if scorer_path else None,
                          score_token_budget=args.token_budget,
                          max_queue_pieces=args.max_queue_pieces, group=group, **limits)
    except ValueError as err:
        raise UsageError(str(err)) from err


def check_http_limits(args: argparse.Namespace, *, scoring: bool) -> dict[str, Any]:
    """The request limits of ``args`` as :func:`~mhmla_fast.serve.http.create_app` takes them
    (an option's 0 as None, no cap), checked with
    :func:`~mhmla_fast.serve.http.check_limits` (``scoring``: an essay scorer is served): a
    conflict is a UsageError before any model loads, not after."""
    from ..serve.http import check_limits

    limits = dict(max_queue=args.max_queue, max_request_bytes=args.max_request_bytes,
                  max_texts_per_request=args.max_texts_per_request,
                  max_essays_per_request=args.max_essays_per_request,
                  max_text_chars=args.max_text_chars or None,
                  request_timeout_s=args.request_timeout or None,
                  max_buffered_bytes=args.max_buffered_bytes or None)
    try:
        check_limits(**limits, scoring=scoring)
    except ValueError as err:
        raise UsageError(str(err)) from err
    return limits


def load_http_scorer(args: argparse.Namespace) -> tuple[Path | None, Any]:
    """(directory, scorer) for ``http``: ``--scorer DIR``; nothing with ``--no-scorer``; else the
    shipped scorer when it is installed (a note on stderr when it is not). The scorer follows
    the tagger's rule: backend torch with ``--backend torch``, else auto (on the CPU, ONNX
    Runtime on its cached export; ``--no-cache`` turns that off), on ``--device`` with
    ``--kernels``, in ``--dtype`` when it is one of the scorer's (float32, bfloat16, float16;
    for another, such as the ONNX tagger's int8, the scorer keeps its default and stderr says
    so, as it does for ``--kernels`` with a ridge scorer); see
    :mod:`mhmla_fast.serve.options`."""
    return load_http_scorer_from(http_scorer_dir(args), args)


def load_http_scorer_from(path: Path | None, args: argparse.Namespace) -> tuple[Path | None, Any]:
    """(``path``, the scorer there loaded as :func:`load_http_scorer` says), or (None, None)
    for no ``path`` (``--no-scorer``, or none installed)."""
    from ..serve.options import resolve_dtype
    from ..serve.score import DTYPES, head_kind

    if path is None:
        return None, None
    dtype = args.dtype
    if dtype and resolve_dtype(dtype, "cpu") not in DTYPES:
        print(f"{PROG} http: --dtype {dtype} is the tagger's; the essay scorer has no such "
              f"dtype ({', '.join(DTYPES)}) and runs in its default", file=sys.stderr)
        dtype = None
    kernels = args.kernels
    if kernels != "auto" and head_kind(path) == "ridge":
        print(f"{PROG} http: --kernels {kernels} is the tagger's; the essay scorer is a ridge "
              "scorer, with no layer attention, and runs as it is", file=sys.stderr)
        kernels = "auto"
    return path, load_scorer_dir(path, args, dtype=dtype, kernels=kernels,
                                 backend="torch" if args.backend == "torch" else "auto")


def http_scorer_dir(args: argparse.Namespace) -> Path | None:
    """The essay scorer ``http`` serves: ``--scorer DIR``, None with ``--no-scorer``, else the
    shipped scorer, or None (and a note on stderr) when it is not installed."""
    from ..serve.score import default_scorer_path

    if args.no_scorer:
        return None
    if not args.scorer and not (default_scorer_path() / "config.json").is_file():
        print(f"{PROG} http: no essay scorer installed at {default_scorer_path()}; serving "
              "tagging only (POST /v1/score answers 404). Pass --scorer DIR to score essays.",
              file=sys.stderr)
        return None
    return resolve_scorer_dir(args.scorer, "--scorer")


# ----------------------------------------------------------------------------------- export


def run_export(args: argparse.Namespace) -> int:
    from ..serve.engine import read_tagger_config

    model = resolve_model_dir(args.model)
    if args.int8 and not args.onnx:
        raise UsageError("--int8 goes with --onnx")
    if (args.precision != "fp32" or args.layer_attention_plugin) and not args.tensorrt:
        raise UsageError("--precision and --layer-attention-plugin go with --tensorrt")
    try:
        from ..serve.onnx_export import ONNX_FILE, check_export_target, export_onnx
    except ImportError as err:
        raise UsageError(f"ONNX export needs onnx and onnxruntime: {err}") from err
    try:  # before minutes of export, not after them
        read_tagger_config(model)  # a tagger's, or its export's
        if args.onnx and not (model / "model.safetensors").is_file():
            raise ValueError(f"{model}: not a tagger directory (no model.safetensors): the "
                             "ONNX export is made from a tagger's weights")
        check_export_target(model, args.onnx or args.tensorrt)
    except (OSError, ValueError) as err:
        raise UsageError(str(err)) from err
    if args.tensorrt:
        try:  # installed? (before the ONNX export it builds on writes ~100 MB into the folder)
            from ..serve import tensorrt_engine

            tensorrt_engine.import_tensorrt()
        except (ImportError, RuntimeError) as err:
            raise UsageError(f"TensorRT support is not available: {err}") from err
    try:
        if args.onnx:
            out = export_onnx(model, args.onnx, int8=args.int8)
            print(f"{PROG}: wrote {out}", file=sys.stderr)
            return EXIT_OK
        out_dir = Path(args.tensorrt)
        if not (model / "model.safetensors").is_file():  # an ONNX export, not a tagger
            if not (model / ONNX_FILE).is_file():
                raise UsageError(f"{model}: neither a tagger (model.safetensors) nor an ONNX "
                                 f"export ({ONNX_FILE})")
            if out_dir.resolve() != model.resolve():
                raise UsageError(f"--model {model} is an ONNX export: build its engine in place "
                                 f"(--tensorrt {model}) or give the tagger directory")
        else:
            export_onnx(model, out_dir)
        plan = tensorrt_engine.build_engine_dir(
            out_dir, layer_attention_plugin=args.layer_attention_plugin,
            fp16=args.precision == "fp16", bf16=args.precision == "bf16")
        print(f"{PROG}: wrote {plan}", file=sys.stderr)
        return EXIT_OK
    except UsageError:
        raise
    except Exception as err:
        print(f"{PROG}: export failed: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_BAD_LINES


# ------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    from ..serve.options import resolve_dtype
    from ..serve.score import DTYPES as SCORER_DTYPES

    parser = argparse.ArgumentParser(prog=PROG, description="Grammatical error detection and "
                                     "essay scoring: tag files, score essays, serve both over "
                                     "HTTP, export the tagger for ONNX Runtime/TensorRT.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("tag", help="tag plain-text or JSONL files into JSONL",
                       description="Tag one text per line (plain text, or JSON objects with "
                       "\"text\" or \"tokens\" and an optional \"id\") into JSONL in input order.")
    _add_file_options(p, formats=("auto", "text", "jsonl"))
    p.add_argument("--pretty", action="store_true",
                   help="print a readable view to standard output instead of JSONL")
    p.add_argument("--batch-size", type=positive_int, default=2048,
                   help="records per engine call, packed together and written together "
                   "(default 2048; the first calls are smaller, so the first results come "
                   "soon)")
    p.add_argument("--host-workers", type=non_negative_int, default=0,
                   help="processes that word-tokenise and word-piece each engine call in "
                   "parallel (default 0: this process; for a GPU that outruns one CPU core; "
                   "not with --ray)")
    _add_cuda_graphs_option(p)
    p.add_argument("--lanes", type=positive_int, default=None,
                   help="CPU only: forward passes at a time, --threads split between them "
                   "(default: one per thread, each pass single-threaded: on 2 cores 1.14x the "
                   "runtime's throughput in process, 1.02-1.07x of the whole command; not with "
                   "--ray)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    _add_model_options(p)
    _add_ray_options(p, "tag")
    p.set_defaults(run=run_tag)

    p = sub.add_parser("score", help="score essays (JSONL) into JSONL",
                       description="Score one essay per line (JSON objects with \"text\", "
                       "\"prompt\" 1-8 and an optional \"id\") into JSONL records "
                       "{\"index\", \"id\", \"prompt\", \"score\"} in input order.")
    _add_file_options(p, formats=("auto", "jsonl"))
    p.add_argument("-i", "--input", metavar="FILE", default=None,
                   help="the input file (the same as one FILE argument; - is stdin)")
    p.add_argument("--batch-essays", type=positive_int, default=64,
                   help="essays per scorer call; all their windows are encoded together "
                   "(default 64)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    g = p.add_argument_group("scorer")
    g.add_argument("--model", metavar="DIR", default=None,
                   help="essay-scorer directory (default: the shipped scorer)")
    _add_backend_option(g, help="the runtime: auto (default: on the CPU in float32, ONNX "
                        "Runtime on a cached export of the scorer validated to give torch's "
                        "scores, made once on first use; on a CPU with AMX and OpenVINO "
                        "installed, the checked bfloat16 scorer on that export where the "
                        "scorer has measured bf16 margins (the shipped ridge scorer has none: "
                        "ONNX Runtime float32); torch on a GPU or where onnxruntime is missing) "
                        "or torch (the scorer has no onnx, openvino or tensorrt backend of its "
                        "own)", choices=("auto", "torch"))
    g.add_argument("--dtype", default=None, choices=SCORER_DTYPES,
                   type=lambda text: resolve_dtype(text, "cpu"),  # bf16, fp32 ... as for tag
                   help="scorer weights and compute: float32/bfloat16/float16, or bf16/fp32/fp16 "
                   "(default bfloat16 on cuda, float32 on cpu; auto on a CPU with AMX and "
                   "OpenVINO: the checked bfloat16 scorer, where the scorer has margins, unless "
                   "float32 is asked for)")
    g.add_argument("--check-margin", type=float, default=None, metavar="M",
                   help="the checked bfloat16 scorer (auto on a CPU with AMX): essays whose "
                   "averaged bf16 output lies within M (normalised score units; probability "
                   "for a classifier) of a rounding boundary are scored again in fp32 "
                   "(default: the scorer's per-prompt margins in its bf16_check.json; 0.015 "
                   "for a layer-attention scorer without it, while a ridge scorer without it "
                   "runs ONNX Runtime float32 unless M is given; 0: bf16 alone)")
    g.add_argument("--no-cache", action="store_true",
                   help="backend auto: neither read nor write the ONNX export cache (run torch); "
                   "also MHMLA_NO_CACHE=1")
    _add_compute_options(g)
    _add_ray_options(p, "score")
    p.set_defaults(run=run_score)

    p = sub.add_parser("http", help="serve the tagger and the essay scorer over HTTP",
                       description="Serve POST /v1/tag, POST /v1/score, GET /healthz, GET "
                       "/metrics with dynamic micro-batching across concurrent requests.")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--workers", type=positive_int, default=1,
                   help="server processes on the one port, each with its own copy of the models "
                   "and its own batching and limits (default 1; more when one process's HTTP "
                   "handling is the bound; needs uvicorn >= 0.50; --threads defaults to the "
                   "physical cores shared out among them)")
    p.add_argument("--max-batch-tokens", type=positive_int, default=None,
                   help="estimated word pieces per engine batch (default: the tagger's "
                   "--token-budget, one forward pass: 1024 on the CPU, 8192 on a GPU)")
    _add_cuda_graphs_option(p)
    p.add_argument("--max-wait-ms", type=non_negative_float, default=5.0,
                   help="how long a batch waits for more requests (default 5)")
    p.add_argument("--max-queue", type=positive_int, default=1024,
                   help="texts waiting at most; beyond it requests get 503 (default 1024)")
    p.add_argument("--max-request-bytes", type=positive_int, default=1_000_000,
                   help="largest request body (default 1000000); larger: 413")
    p.add_argument("--max-texts-per-request", type=positive_int, default=256,
                   help="texts or sentences per request (default 256); more: 413")
    p.add_argument("--max-essays-per-request", type=positive_int, default=64,
                   help="essays per /v1/score request (default 64); more: 413")
    p.add_argument("--max-text-chars", type=non_negative_int, default=500_000,
                   help="characters per text, sentence or essay (default 500000; 0: no cap); "
                   "longer: 413")
    p.add_argument("--max-queue-pieces", type=positive_int, default=1_000_000,
                   help="estimated word pieces admitted and not yet answered (default "
                   "1000000); beyond it 503, a request alone over it 413")
    p.add_argument("--request-timeout", type=non_negative_float, default=60.0,
                   help="seconds from admission to answer (default 60; 0: none); later: 504, "
                   "and the request's remaining work is dropped")
    p.add_argument("--limit-concurrency", type=non_negative_int, default=512,
                   help="open connections and requests at most, beyond which uvicorn answers "
                   "503 (default 512; 0: no limit)")
    p.add_argument("--max-buffered-bytes", type=non_negative_int, default=64_000_000,
                   help="request-body bytes held in memory by all requests together (default "
                   "64000000; 0: no cap); beyond it 503")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--scorer", metavar="DIR", default=None,
                   help="essay scorer for /v1/score (default: the shipped one, if installed)")
    g.add_argument("--no-scorer", action="store_true",
                   help="serve tagging only (/v1/score answers 404)")
    p.add_argument("--graceful-timeout", type=non_negative_int, default=None,
                   help="seconds to wait for open requests on shutdown (default: no limit)")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--no-access-log", action="store_true",
                   help="do not log every request (saves CPU at high request rates)")
    _add_model_options(p)
    p.set_defaults(run=run_http)

    p = sub.add_parser("export", help="export the tagger for ONNX Runtime or TensorRT")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--onnx", metavar="DIR", help="write an ONNX engine directory")
    g.add_argument("--tensorrt", metavar="DIR", help="write a TensorRT engine directory")
    p.add_argument("--int8", action="store_true", help="with --onnx: add the int8 graph")
    p.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "bf16"),
                   help="with --tensorrt: kernels TensorRT may use (default fp32)")
    p.add_argument("--layer-attention-plugin", action="store_true",
                   help="with --tensorrt: the fused layer-attention plugin instead of "
                   "standard ops (TensorRT >= 10.7)")
    p.add_argument("--model", metavar="DIR", default=None,
                   help="tagger directory (default: the shipped model)")
    p.set_defaults(run=run_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mhmla-serve`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    # SIGTERM (a plain kill, a supervisor's stop) as Ctrl-C: Python's default ends the process
    # without its cleanup, which left host workers running and outputs unsynced (the HTTP
    # server has uvicorn's own handling)
    before = _terminate_as_interrupt() if args.command != "http" else None
    try:
        return args.run(args)
    except UsageError as err:
        print(f"{PROG} {args.command}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # before the records run (imports, model load, export)
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if before is not None:
            import signal

            signal.signal(signal.SIGTERM, before)


def _terminate_as_interrupt():
    """Make SIGTERM raise KeyboardInterrupt (in the main thread; elsewhere nothing changes), so
    that a terminated command stops as an interrupted one does: outputs synced for
    ``--resume``, host workers and Ray stopped, exit 130. Returns the handler it replaced, or
    None when it replaced none."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    before = signal.getsignal(signal.SIGTERM)
    if before is signal.SIG_IGN:  # a parent's choice: left alone
        return None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    return signal.SIG_DFL if before is None else before


if __name__ == "__main__":
    sys.exit(main())
