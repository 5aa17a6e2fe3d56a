"""Batch tagging and scoring on Ray Data: ``mhmla-serve tag --ray`` / ``score --ray``.

Records identical to ``mhmla-serve tag`` / ``score`` (same fields, same per-record errors, input
order), computed by a pool of Ray actors, one engine per actor loaded once; restartable with
each record produced exactly once. Needs the optional extra ``mhmla-fast[ray]``; importing
``mhmla_fast`` or this module does not import Ray (:func:`run_job` does).

A job (:func:`run_job`) on inputs ``paths`` into ``output``:

1. **plan** (driver): read the inputs once with the CLI's parser
   (:mod:`mhmla_fast.serve.inputs`: ``--format``, ``--encoding``, ``--max-chars``/``--over-long``,
   for ``score`` the scorer's prompts), fingerprint every record as the CLI does, and cut the
   records into shards of ``shard_size``: each shard is the byte ranges of its lines, or the
   row ranges of its Parquet rows (no text is shipped through the driver), and the
   :class:`~.outputs.InputFingerprint` of its own records.
2. **process** (Ray Data): ``from_items`` over the shards not yet committed, ``map_batches``
   with :class:`ShardWorker` actors (``workers`` of them; ``num_gpus=1`` each on a CUDA device,
   else ``num_cpus=threads``). An actor reads its shard's byte ranges, parses them with the same
   parser, or reads its rows with pyarrow (only the row groups that hold them, only the
   columns a record uses; :func:`~.inputs.parquet_records`), the shard's fingerprint must
   equal the plan's, and produces the shard's JSONL with
   :func:`~.records.run_records`, exactly as the CLI assembles records. A dead actor is
   restarted and its shard retried by Ray.
3. **commit** (driver): each finished shard is written to ``<output>.shards/<k>-<sha>.jsonl``
   (temporary file, fsync, rename, directory fsync): a shard file exists complete or not at all,
   and its name carries its input fingerprint.
4. **concatenate** (driver): when every shard is committed, the shards are appended in order to
   ``output`` through the CLI's :class:`~.outputs.ResumableJsonlWriter` (its sidecar is the
   CLI's: a finished Ray output is a finished ``mhmla-serve`` output), then the shard folder is
   removed.

``resume=True`` skips committed shards (and the part of ``output`` already concatenated), so a
job killed at any point and run again produces each record exactly once. ``<output>.shards/
job.json`` records what the job is made from (the CLI's ``made_from``), the shard size and the
input's fingerprint; a resume with another input, model or option is refused naming the
difference, as in the CLI. The writer's lock on ``output`` is held for the whole job.

Inputs are files readable by every worker: local paths (a shared file system on a cluster) or
URIs that pyarrow's filesystems open (``s3://``, ``gs://``, ``hdfs://``, ``file://``; the error
records name them as given), not standard input. A name ending with ``.parquet`` is a Parquet
file whose rows are the records (the CLI's rule, :mod:`~.records`); other inputs are lines.
Ray Data's fault tolerance covers the actors; a dead driver is covered by ``resume``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import signal
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..durable import atomic_write_bytes
from .inputs import (
    InputRecord,
    OverLong,
    bounded_lines,
    check_not_wide,
    check_parquet,
    is_parquet,
    iter_input_records,
    limit_length,
    parse_line,
    parquet_records,
    read_bound,
    strip_line,
)
from .outputs import (
    REFUSALS,
    InputFingerprint,
    NotStartedError,
    OutputExistsError,
    OutputLockedError,
    OutputUnusableError,
    ResumableJsonlWriter,
    ResumeMismatchError,
    check_made_from,
    meta_path,
)
from .records import RunSummary, run_records

__all__ = ["RayJob", "ShardWorker", "check_regular_files", "check_uri", "is_uri", "plan_shards",
           "read_shard", "run_job", "shards_dir"]

JOB_FORMAT = "mhmla-serve-ray-job/1"
SHARDS_SUFFIX = ".shards"


@dataclass(frozen=True)
class RayJob:
    """What every actor needs: the command (``kind`` "tag" or "score"), the model directory and
    its load contract (backend, device, dtype, kernels, threads, the export ``cache`` of backend
    "auto"; ``threshold`` and ``token_budget``, None: the device's default), how input lines
    are read (``format``, ``encoding``, ``max_chars``,
    ``over_long``, ``prompts``: the scorer's prompts, for ``score``), and ``batch_size``
    records per engine call. ``crash_once`` = (marker file, record index) is a test hook: the
    first actor to reach that record creates the marker and exits the process."""

    kind: str
    model: str
    backend: str = "auto"
    device: str = "cpu"
    dtype: str | None = None
    kernels: str = "auto"
    threads: int | None = None
    threshold: float | None = None
    token_budget: int | None = None
    batch_size: int = 512
    format: str = "auto"
    encoding: str = "utf-8"
    max_chars: int | None = None
    over_long: str = "skip"
    prompts: tuple[int, ...] | None = None
    crash_once: tuple[str, int] | None = None
    cache: bool | None = None  # backend "auto"'s export cache (serve.export_cache)

    def __post_init__(self) -> None:
        if self.kind not in ("tag", "score"):
            raise ValueError(f"kind: expected 'tag' or 'score', got {self.kind!r}")
        if self.kind == "score" and not self.prompts:
            raise ValueError("prompts: a score job needs the scorer's prompts")

    @property
    def num_gpus(self) -> int:
        """GPUs per actor: one on a CUDA device, else none."""
        return 1 if self.device.split(":", 1)[0] == "cuda" else 0

    @property
    def num_cpus(self) -> int:
        """CPU cores per actor: ``threads`` (1 by default)."""
        return self.threads or 1


# ---------------------------------------------------------------------------------------- input


def is_uri(path: str) -> bool:
    """Whether ``path`` is a URI for pyarrow's filesystems (``s3://``, ``gs://``, ``hdfs://``,
    ``file://``...) rather than a local path."""
    return "://" in path


def check_uri(path: str) -> None:
    """FileNotFoundError / IsADirectoryError unless the URI ``path`` names a file; for a
    line-based one, ValueError when it starts with a UTF-16/32 byte-order mark (the check a
    local file gets when opened: :func:`~.inputs.check_not_wide`)."""
    import pyarrow.fs

    fs, inner = pyarrow.fs.FileSystem.from_uri(path)
    kind = fs.get_file_info(inner).type
    if kind == pyarrow.fs.FileType.NotFound:
        raise FileNotFoundError(f"{path}: no such input file")
    if kind != pyarrow.fs.FileType.File:
        raise IsADirectoryError(f"{path}: not an input file")
    if not is_parquet(path):
        with fs.open_input_stream(inner) as f:
            check_not_wide(f.read(4), path)


def _open_binary(path: str) -> IO[bytes]:
    """A seekable buffered binary file on a local path or a URI of pyarrow's filesystems."""
    if not is_uri(path):
        return open(path, "rb")
    import pyarrow.fs

    fs, inner = pyarrow.fs.FileSystem.from_uri(path)
    return io.BufferedReader(fs.open_input_file(inner))


def _range_lines(job: RayJob, path: str, start: int = 0,
                 end: int | None = None) -> Iterator[tuple[int, int, bytes | OverLong]]:
    """``(start byte, end byte, line)`` of the lines of ``path`` from byte ``start`` up to
    byte ``end`` (None: the end of the file), read by the CLI's bounded reader
    (:func:`~.inputs.bounded_lines` with ``--max-chars``' bound)."""
    with _open_binary(path) as f:
        f.seek(start)
        lines = bounded_lines(f, read_bound(job.max_chars))
        while end is None or start < end:
            raw = next(lines, None)
            if raw is None:
                return
            offset = start + (raw.read if isinstance(raw, OverLong) else len(raw))
            yield start, offset, raw
            start = offset


def _record(job: RayJob, raw: bytes | OverLong, index: int, source: str, line: int) -> InputRecord:
    """One line with its line break -> the record the CLI makes of it (parse, ``--max-chars``,
    prompts)."""
    if not isinstance(raw, OverLong):
        raw = strip_line(raw, line == 1)
    return _finish(job, parse_line(raw, job.kind, index, source, line, job.format,
                                   job.encoding, job.max_chars))


def _finish(job: RayJob, rec: InputRecord) -> InputRecord:
    """A parsed record (of a line or a Parquet row) -> the record the CLI makes of it: its
    ``--max-chars`` rule, then for ``score`` the scorer's prompts (the CLI's own functions)."""
    if job.max_chars is not None:
        rec = next(limit_length([rec], job.max_chars, job.over_long))
    if job.kind == "score" and rec.error is None:
        from .score import check_prompts

        rec = next(check_prompts([rec], job.prompts or ()))
    return rec


def _parquet_rows(job: RayJob, open_path: str, source: str, first_index: int, start: int = 0,
                  stop: int | None = None) -> Iterator[tuple[int, int, InputRecord]]:
    """``(row, row + 1, record)`` for rows ``start .. stop - 1`` (0-based) of a Parquet
    input, read with pyarrow from ``open_path`` (a local path or a URI)."""
    for rec in parquet_records(open_path, job.kind, source=source, start=start, stop=stop,
                               first_index=first_index, encoding=job.encoding):
        yield rec.line - 1, rec.line, _finish(job, rec)


def _line_rows(job: RayJob, path: str, first_index: int) -> Iterator[tuple[int, int, InputRecord]]:
    """``(start byte, end byte, record)`` of every line of a line-based input."""
    for line, (start, offset, raw) in enumerate(_range_lines(job, path), 1):
        yield start, offset, _record(job, raw, first_index + line - 1, path, line)


@dataclass
class Shard:
    """Records ``first .. first + count - 1``: ``segments`` [open path, source, start, end,
    first line] of their lines (start and end: byte offsets) or Parquet rows (start and end:
    0-based row numbers, end excluded; a source ending with ``.parquet``), ``sha256`` their
    fingerprint."""

    shard: int
    first: int
    count: int = 0
    sha256: str = ""
    segments: list[list[Any]] = field(default_factory=list)

    def to_row(self) -> dict[str, Any]:
        return {"spec": json.dumps(dataclasses.asdict(self))}

    @property
    def file_name(self) -> str:
        return f"{self.shard:08d}-{self.sha256[:16]}.jsonl"


@dataclass
class Plan:
    """The shards of an input, its record count and its :class:`InputFingerprint`;
    ``prefix_sha256`` that of its first ``prefix`` records (what a sidecar vouches for)."""

    shards: list[Shard]
    records: int
    sha256: str
    prefix: int = 0
    prefix_sha256: str | None = None


def check_regular_files(paths: Sequence[str]) -> None:
    """ValueError naming a local input that is not a regular file: a job reads each input
    twice (the plan, then the actors by byte range), which a pipe or a device cannot give
    (and a resume could not read it again). A missing file is left to the readers' own
    error."""
    for path in paths:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            continue
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path}: not a regular file (a pipe or a device?); a Ray job "
                             "reads its inputs twice, by byte range: save it to a file first")


def plan_shards(job: RayJob, paths: Sequence[str], shard_size: int, prefix: int = 0) -> Plan:
    """Read ``paths`` once (the CLI's checks and parser) and cut their records into shards of
    ``shard_size``; also fingerprint the first ``prefix`` records. ValueError for standard
    input or bad arguments, OSError for a missing file."""
    if shard_size < 1:
        raise ValueError(f"shard_size: expected a positive integer, got {shard_size}")
    if "-" in paths or not paths:
        raise ValueError("a Ray job reads files, not standard input: give the input files")
    local = [p for p in paths if not is_uri(p)]  # the CLI's checks ([]: arguments only)
    check_regular_files(local)
    iter_input_records(local, job.kind, format=job.format, encoding=job.encoding)
    for path in paths:
        if is_uri(path):
            check_uri(path)
            if is_parquet(path):
                check_parquet(path, job.format)
    whole, shards, index = InputFingerprint(), [], 0
    part, prefix_sha = InputFingerprint(), (InputFingerprint().hexdigest() if prefix == 0 else None)
    for path in paths:
        open_path = path if is_uri(path) else os.path.abspath(path)
        rows = (_parquet_rows(job, open_path, path, index + 1) if is_parquet(path)
                else _line_rows(job, path, index + 1))
        for start, offset, rec in rows:  # bytes of a line, or rows of a Parquet file
            index += 1
            if not shards or shards[-1].count == shard_size:
                if shards:
                    shards[-1].sha256 = part.hexdigest()
                shards.append(Shard(len(shards), index))
                part = InputFingerprint()
            cur = shards[-1]
            seg = cur.segments[-1] if cur.segments else None
            if seg is not None and seg[0] == open_path and seg[3] == start:
                seg[3] = offset
            else:
                cur.segments.append([open_path, path, start, offset, rec.line])
            cur.count += 1
            part.update(rec)
            whole.update(rec)
            if whole.count == prefix:
                prefix_sha = whole.hexdigest()
    if shards:
        shards[-1].sha256 = part.hexdigest()
    return Plan(shards, whole.count, whole.hexdigest(), prefix, prefix_sha)


def read_shard(job: RayJob, shard: Shard) -> list[InputRecord]:
    """The records of ``shard``, read from its byte ranges or Parquet rows (pyarrow, on the
    actor); RuntimeError when they are not the ones planned (the input changed while the job
    ran)."""
    records, fp, index = [], InputFingerprint(), shard.first
    for open_path, source, start, end, first_line in shard.segments:
        if is_parquet(source):
            for _, _, rec in _parquet_rows(job, open_path, source, index, start, end):
                fp.update(rec)
                records.append(rec)
                index += 1
            continue
        for k, (_, _, raw) in enumerate(_range_lines(job, open_path, start, end)):
            rec = _record(job, raw, index, source, first_line + k)
            fp.update(rec)
            records.append(rec)
            index += 1
    if fp.count != shard.count or fp.hexdigest() != shard.sha256:
        raise RuntimeError(f"shard {shard.shard}: the input changed while the job ran (records "
                           f"{shard.first}..{shard.first + shard.count - 1} differ from the plan)")
    return records


# --------------------------------------------------------------------------------------- actors


class _Lines:
    """Stands in for the writer in ``run_records``: keeps the JSONL lines of one shard."""

    done, done_errors, last_id, path = 0, 0, None, "<shard>"

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.errors = 0

    def write(self, record: dict[str, Any]) -> None:
        self.lines.append(json.dumps(record, ensure_ascii=False, allow_nan=False))
        self.errors += "error" in record

    def sync(self) -> None:
        pass


def load_processor(job: RayJob) -> Callable[[list[InputRecord]], list[dict]]:
    """The ``process_batch`` of ``mhmla-serve tag``/``score`` for ``job``: the engine (or
    scorer) loaded once, with the serving load contract."""
    if job.kind == "tag":
        from .pipeline import tag_records
        from .engine import Engine

        engine = Engine.load(job.model, backend=job.backend, device=job.device, dtype=job.dtype,
                             kernels=job.kernels, threads=job.num_cpus, threshold=job.threshold,
                             token_budget=job.token_budget, cache=job.cache)
        return lambda batch: tag_records(engine, batch)
    from .score import essay_pieces_check, load_scorer, score_records

    scorer = load_scorer(job.model, backend=job.backend, device=job.device, dtype=job.dtype,
                         kernels=job.kernels, threads=job.num_cpus, cache=job.cache)
    check = essay_pieces_check(scorer)  # essays with no word pieces: the CLI's error records
    return lambda batch: score_records(scorer, batch, job.token_budget, check=check)


class ShardWorker:
    """A Ray Data actor: one engine, loaded in the constructor; each call turns a batch of
    shard specs into ``{"shard", "text", "errors"}``: the shard's JSONL and its error count."""

    def __init__(self, job: RayJob) -> None:
        self.job = job
        self.process = load_processor(job)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        out: dict[str, list] = {"shard": [], "text": [], "errors": []}
        for spec in batch["spec"]:
            shard = Shard(**json.loads(spec))
            self._maybe_crash(shard)
            lines = _Lines()
            run_records(read_shard(self.job, shard), self.process, lines, self.job.batch_size,
                        progress=False)
            out["shard"].append(shard.shard)
            out["text"].append("".join(line + "\n" for line in lines.lines))
            out["errors"].append(lines.errors)
        return out

    def _maybe_crash(self, shard: Shard) -> None:
        if self.job.crash_once is None:
            return
        marker, index = self.job.crash_once
        if shard.first <= index < shard.first + shard.count:
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return
            os.close(fd)
            os._exit(1)  # a worker dying mid-job, as a lost node or an OOM kill does


# ---------------------------------------------------------------------------------------- shards


def shards_dir(output: str) -> Path:
    """The folder of a job's committed shards: ``<output>.shards``."""
    return Path(output + SHARDS_SUFFIX)


def _new_job_dir(folder: Path, made_from: dict, size: int, plan: Plan) -> None:
    """Create ``folder`` and its ``job.json`` (atomically, before any shard)."""
    folder.mkdir(exist_ok=True)
    atomic_write_bytes(folder / "job.json", json.dumps(
        {"format": JOB_FORMAT, "made_from": made_from, "shard_size": size,
         "records": plan.records, "sha256": plan.sha256}, indent=1, sort_keys=True).encode())


def _open_job_dir(folder: Path, made_from: dict, shard_size: int | None, default_size: int,
                  plan_of: Callable[[int], Plan]) -> tuple[Plan, dict[int, Path]]:
    """Create or check ``folder``'s ``job.json``; return the plan and the committed shards.

    A resumed job keeps its shard size (another ``shard_size`` is refused), and must have
    the same settings and input (ResumeMismatchError); a committed shard that is not in the
    plan is a ResumeMismatchError too."""
    job_file = folder / "job.json"
    if job_file.is_file():
        data = json.loads(job_file.read_text(encoding="utf-8"))
        if data.get("format") != JOB_FORMAT:
            raise ResumeMismatchError(f"{job_file}: not a {JOB_FORMAT} file; remove {folder}")
        check_made_from(str(folder), data["made_from"], made_from)
        if shard_size is not None and shard_size != data["shard_size"]:
            raise ResumeMismatchError(f"{folder} was made with shards of {data['shard_size']} "
                                      f"records, not {shard_size}; resume without --shard-size")
        plan = plan_of(data["shard_size"])
        if (plan.records, plan.sha256) != (data["records"], data["sha256"]):
            raise ResumeMismatchError(
                f"{folder} was made from other input ({data['records']} records then, "
                f"{plan.records} now, or other content); refusing to mix outputs")
    else:
        plan = plan_of(shard_size or default_size)
        _new_job_dir(folder, made_from, shard_size or default_size, plan)
    committed: dict[int, Path] = {}
    for p in folder.iterdir():
        if p.name.endswith(".tmp"):
            p.unlink()  # an uncommitted shard of a killed run
        elif p.suffix == ".jsonl":
            k = int(p.name.split("-", 1)[0])
            if k >= len(plan.shards) or plan.shards[k].file_name != p.name:
                raise ResumeMismatchError(f"{p}: a committed shard that is not part of this "
                                          "input; refusing to mix outputs")
            committed[k] = p
    return plan, committed


def _init_ray(address: str | None, num_cpus: int) -> bool:
    """Connect to ``address`` (a running cluster, or "auto"), or start a local Ray with
    ``num_cpus`` CPUs; nothing when Ray is already initialised. True when it started Ray here."""
    import ray

    if ray.is_initialized():
        return False
    # ray.init replaces the SIGTERM handler (with one that exits at once): the command's, which
    # stops a terminated job as an interrupted one (synced for --resume, exit 130), is put back
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    if address in (None, "", "local"):
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
    else:  # a cluster's workers do not inherit this shell: give them the cache's settings
        from .export_cache import CACHE_ENV, NO_CACHE_ENV

        env = {k: os.environ[k] for k in (CACHE_ENV, NO_CACHE_ENV) if k in os.environ}
        ray.init(address=address, **({"runtime_env": {"env_vars": env}} if env else {}))
    if before is not None:
        signal.signal(signal.SIGTERM, before)
    return True


def _process(job: RayJob, todo: list[Shard], workers: int) -> Iterator[dict[str, Any]]:
    """Finished shards (``{"shard", "text", "errors"}``) in the order they finish."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ds = ray.data.from_items([s.to_row() for s in todo], override_num_blocks=len(todo))
    # Ray Data restarts a dead actor and retries its batch (max_restarts and max_task_retries
    # default to -1 for actor pools)
    ds = ds.map_batches(ShardWorker, fn_constructor_kwargs={"job": job}, batch_size=1,
                        compute=ray.data.ActorPoolStrategy(size=workers),
                        num_cpus=job.num_cpus, num_gpus=job.num_gpus)
    yield from ds.iter_rows()


def run_job(job: RayJob, paths: Sequence[str], output: str, *, made_from: dict[str, Any],
            resume: bool = False, address: str | None = None, workers: int = 2,
            shard_size: int | None = None, progress: bool = True,
            on_commit: Callable[[int], None] | None = None) -> RunSummary:
    """Run ``job`` on ``paths`` into ``output`` (steps, files and resume rules: module
    docstring); returns the CLI's :class:`~.records.RunSummary` of the whole output.

    ``made_from`` goes to the sidecar and ``job.json`` (the CLI's ``made_from``). ``address``:
    a Ray cluster ("auto", "HOST:PORT", "ray://HOST:PORT"); None or "local" starts a local Ray
    with ``workers * job.num_cpus`` CPUs (and stops it at the end), unless Ray is already
    initialised. ``shard_size``: records per shard (default 8192 for tag, 512 for score; a
    resumed job keeps its own). ``on_commit(k)`` is called after shard ``k`` is committed.
    Refusals are the CLI's: :class:`~.outputs.OutputExistsError`, ``ResumeMismatchError``,
    ``OutputLockedError``, ``OutputCorruptError``."""
    from ..progress import progress_bar

    if workers < 1:
        raise ValueError(f"workers: expected a positive integer, got {workers}")
    folder = shards_dir(output)
    if folder.exists() and not resume:
        raise OutputExistsError(f"{folder} exists (an unfinished Ray job); pass --resume to "
                                "continue or remove it")
    # a new job (nothing of it on disk yet): one that fails before its first shard removes what
    # it created, rather than leaving files that only a --resume (which could not help) takes
    fresh = not folder.exists() and not os.path.exists(meta_path(output)) and (
        not os.path.exists(output) or os.path.getsize(output) == 0)
    try:
        writer = ResumableJsonlWriter(output, resume=resume, made_from=made_from)  # the lock
    except (OutputExistsError, OutputLockedError):
        raise
    except OSError as err:  # no such folder, a directory, ...: the CLI's usage error
        raise OutputUnusableError(f"{output}: {err.strerror or err}") from err
    try:
        default_size = 8192 if job.kind == "tag" else 512
        if writer.vouched and not folder.exists():  # finished, or a single-process output
            size = shard_size or default_size
            plan = plan_shards(job, paths, size, writer.vouched)
            _check_vouched(writer, plan)
            committed: dict[int, Path] = {}
            if writer.done < plan.records:
                _new_job_dir(folder, writer.made_from, size, plan)
        else:
            plan, committed = _open_job_dir(
                folder, writer.made_from, shard_size, default_size,
                lambda size: plan_shards(job, paths, size, writer.vouched))
            _check_vouched(writer, plan)
        if writer.done < plan.records:
            _run_shards(job, plan, committed, writer.done, folder, address, workers, progress,
                        on_commit, progress_bar)
        summary = _concatenate(writer, plan, folder)
        if folder.exists():
            shutil.rmtree(folder)  # while the lock is held
    except Exception as err:
        if not fresh or any(folder.glob("*.jsonl")) or writer.done + writer.written:
            raise
        shutil.rmtree(folder, ignore_errors=True)  # while the lock is held
        for path in (meta_path(output), output):
            with contextlib.suppress(OSError):
                os.unlink(path)
        if isinstance(err, REFUSALS):  # the CLI's refusals stay what they are (usage errors)
            raise
        raise NotStartedError(f"{type(err).__name__}: {err}") from err
    finally:
        writer.close()
    return summary


def _check_vouched(writer: ResumableJsonlWriter, plan: Plan) -> None:
    """The CLI's rule: the input records the output's sidecar vouches for are this input's
    first ones (ResumeMismatchError otherwise)."""
    if plan.prefix != writer.vouched or plan.prefix_sha256 != writer.vouched_sha256:
        raise ResumeMismatchError(
            f"{writer.path} was made from other input: the first {writer.vouched} input records "
            "differ from the ones it was made from (or the input has fewer); refusing to mix "
            "outputs. Resume with the same input, or write to another output")


def _run_shards(job: RayJob, plan: Plan, committed: dict[int, Path], done: int, folder: Path,
                address: str | None, workers: int, progress: bool,
                on_commit: Callable[[int], None] | None, progress_bar: Any) -> None:
    """Process and commit every shard of ``plan`` that is neither in ``committed`` nor within
    the first ``done`` records (already in the output)."""
    todo = [s for s in plan.shards if s.shard not in committed and s.first + s.count - 1 > done]
    if not todo:
        return
    started = _init_ray(address, workers * job.num_cpus)
    bar = progress_bar(total=plan.records, initial=plan.records - sum(s.count for s in todo),
                       desc=f"{job.kind} on Ray ({workers} workers)", unit="rec",
                       unit_scale=True, disable=not progress)
    try:
        for row in _process(job, todo, workers):
            shard = plan.shards[int(row["shard"])]
            atomic_write_bytes(folder / shard.file_name, row["text"].encode("utf-8"))
            committed[shard.shard] = folder / shard.file_name
            bar.update(shard.count)
            if on_commit is not None:
                on_commit(shard.shard)
    finally:
        bar.close()
        if started:
            import ray

            ray.shutdown()
    missing = [s.shard for s in todo if s.shard not in committed]
    if missing:
        raise RuntimeError(f"the Ray job ended without shards {missing[:5]}")


def _concatenate(writer: ResumableJsonlWriter, plan: Plan, folder: Path) -> RunSummary:
    """Append the committed shards to ``writer`` in order, after the records it holds."""
    n_resumed = writer.done
    n_errors = writer.done_errors
    if writer.vouched < plan.records:
        writer.vouch(plan.records, plan.sha256)  # before any line it does not cover
    for shard in plan.shards:
        if shard.first + shard.count - 1 <= writer.done:
            continue
        with open(folder / shard.file_name, "rb") as f:
            for raw in f:
                rec = json.loads(raw)
                if rec["index"] < writer.next_index:
                    continue
                writer.write(rec)
                n_errors += "error" in rec
    writer.sync()
    total = writer.done + writer.written
    return RunSummary(n_ok=total - n_errors, n_errors=n_errors, n_resumed=n_resumed)
