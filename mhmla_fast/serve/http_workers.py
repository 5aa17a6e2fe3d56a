"""Several HTTP worker processes on one socket: ``mhmla-serve http --workers N``.

One Python process answers a few thousand requests per second at most: parsing, validation and
JSON are Python and hold the interpreter lock (3,830 requests/s of one sentence each on a
2-core EPYC shared with the load generator, with a tagger that costs nothing; 4,730 with two
workers: ``bench/results/http_workers_cpu_2026-11-27/``, ``bench/http_ab_cpu.sh``). With
``--workers N`` the parent binds the socket and uvicorn's supervisor
(:class:`uvicorn.supervisors.Multiprocess`, uvicorn >= 0.50) starts N worker processes that
accept from it, restarts a worker that dies, and stops them all when one fails to start (exit
status 3, :data:`uvicorn.config.STARTUP_FAILURE`), instead of restarting it forever.

Each worker is a whole app (:func:`mhmla_fast.serve.http.create_app`): its own engine (its own
copy of the model; on a GPU its own CUDA context, and the workers' passes interleave on the
device), its own micro-batcher and its own limits, so every limit of ``mhmla-serve http``
(queue, buffered bytes, ``--limit-concurrency``) is per worker. A keep-alive connection stays
with the worker that accepted it.

What the workers share lives in a temporary folder the parent makes and removes
(:class:`WorkerGroup`):

- ``metrics/``: ``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's multiprocess mode; it is read
  when ``prometheus_client`` is imported, so the parent sets it before any worker starts).
  ``GET /metrics`` from any worker gives the sums over all workers, those that died included;
  ``mhmla_queue_depth`` sums the live workers.
- ``ready/<pid>``: a worker's file from the end of its start-up to its shutdown. ``GET
  /healthz`` adds ``pid`` (the worker that answered), ``workers`` (N) and ``workers_ready``
  (workers alive with the file), so a client can wait until all N serve before it opens its
  connections.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..filelock import process_alive, process_temp_dir

__all__ = ["MIN_UVICORN", "WORKERS_ENV", "WorkerGroup", "follow_parent", "max_workers",
           "serve_workers"]

WORKERS_ENV = "MHMLA_HTTP_WORKERS"
MIN_UVICORN = (0, 50)  # a worker that fails to start stops the supervisor (uvicorn #3001)
_METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"
_GROUP_PREFIX = "mhmla-http-"  # the group folder: mhmla-http-<parent pid>-<random>


def max_workers() -> int:
    """The most workers ``http --workers`` starts on this machine: twice its logical CPUs (each
    worker loads its own copy of the models; a mistyped count spawned workers until the
    machine ran out of memory)."""
    return 2 * (os.cpu_count() or 1)


def follow_parent() -> None:
    """In a worker: stop gracefully (SIGTERM to itself: uvicorn finishes the requests in
    flight) when the supervising parent is gone. A parent killed with ``kill -9`` (or by the
    OOM killer) left its workers serving on the port unsupervised, a restart then failing
    with "address already in use"."""
    import signal

    from .hostpool import exit_with_parent

    exit_with_parent(lambda: os.kill(os.getpid(), signal.SIGTERM))


@dataclass(frozen=True)
class WorkerGroup:
    """The ``size`` workers of one ``mhmla-serve http --workers`` server, sharing ``root``."""

    root: Path
    size: int

    @classmethod
    def create(cls, size: int) -> WorkerGroup:
        """A new group in a fresh temporary folder named after this (the parent) process
        (``remove`` deletes it); the folders of groups whose parent died without removing
        theirs (``kill -9``) go first."""
        if size < 2:
            raise ValueError(f"workers: expected >= 2 for a group, got {size}")
        root = process_temp_dir(_GROUP_PREFIX)
        (root / "metrics").mkdir()
        (root / "ready").mkdir()
        return cls(root, size)

    @classmethod
    def from_env(cls) -> WorkerGroup | None:
        """The group this process is a worker of, from ``MHMLA_HTTP_WORKERS``; None outside one.

        Raises RuntimeError when prometheus-client's multiprocess folder is not this group's
        (metrics would then count this worker only)."""
        spec = os.environ.get(WORKERS_ENV)
        if not spec:
            return None
        d = json.loads(spec)
        group = cls(Path(d["root"]), int(d["size"]))
        if os.environ.get(_METRICS_ENV) != str(group.metrics_dir):
            raise RuntimeError(f"{WORKERS_ENV} is set but {_METRICS_ENV} is not "
                               f"{group.metrics_dir}: start workers with serve_workers")
        return group

    @property
    def metrics_dir(self) -> Path:
        return self.root / "metrics"

    def env(self) -> dict[str, str]:
        """The environment variables that make a process one of this group's workers."""
        return {WORKERS_ENV: json.dumps({"root": str(self.root), "size": self.size}),
                _METRICS_ENV: str(self.metrics_dir)}

    def mark_ready(self) -> None:
        """Record that this process serves (end of its start-up)."""
        (self.root / "ready" / str(os.getpid())).touch()

    def mark_stopped(self) -> None:
        """Record that this process stopped serving; its live gauges leave the sums."""
        from prometheus_client import multiprocess

        (self.root / "ready" / str(os.getpid())).unlink(missing_ok=True)
        multiprocess.mark_process_dead(os.getpid(), str(self.metrics_dir))

    def ready(self) -> int:
        """Workers that finished start-up and are alive (files of dead ones are removed)."""
        n = 0
        for f in (self.root / "ready").iterdir():
            if not process_alive(f.name):
                f.unlink(missing_ok=True)
                continue
            n += 1
        return n

    def forget_dead(self) -> None:
        """Take the live gauges of workers that died without stopping (``kill -9``, the OOM
        killer) out of the sums, as :meth:`mark_stopped` does for a worker that stops: a
        killed worker's last queue depth stayed in ``mhmla_queue_depth`` for ever."""
        from prometheus_client import multiprocess

        pids = {m.group(1) for f in self.metrics_dir.glob("gauge_live*_*.db")
                if (m := re.fullmatch(r"gauge_live\w*?_(\d+)\.db", f.name))}
        for pid in pids:
            if not process_alive(pid):
                multiprocess.mark_process_dead(int(pid), str(self.metrics_dir))

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _uvicorn_version() -> tuple[int, ...]:
    from importlib.metadata import version

    return tuple(int(p) for p in version("uvicorn").split(".")[:2] if p.isdigit())


def _supervisor(base: type) -> type:
    """uvicorn's :class:`~uvicorn.supervisors.Multiprocess` (``base``) as this server runs it:

    - at shutdown the parent closes its copy of the listening socket before it stops the
      workers, so that new clients are refused at once (the port stayed open with nobody
      accepting: clients connected, waited for the workers' in-flight requests, then were
      reset);
    - SIGTTIN and SIGTTOU (add, remove a worker) are ignored: the group's size is fixed
      (``/healthz``'s ``workers`` and ``workers_ready``, which a client waits on to be equal).
    """
    from uvicorn.supervisors.multiprocess import logger

    class Supervisor(base):
        def terminate_all(self) -> None:
            for sock in self.sockets:
                sock.close()
            super().terminate_all()

        def handle_ttin(self) -> None:
            logger.info("Received SIGTTIN: ignored (the number of workers is fixed; restart "
                        "with another --workers)")

        def handle_ttou(self) -> None:
            logger.info("Received SIGTTOU: ignored (the number of workers is fixed; restart "
                        "with another --workers)")

    return Supervisor


def serve_workers(app: str, workers: int, *, env: Mapping[str, str] | None = None,
                  healthcheck_timeout_s: int = 20, **config: Any) -> bool:
    """Serve the ASGI app factory ``app`` ("module:function", called once in each worker) from
    ``workers`` processes until the server is stopped (SIGINT, SIGTERM). ``env``: variables
    set for the workers (for instance the options the factory reads); ``config``: keyword
    arguments of :class:`uvicorn.Config` (host, port, log_level, ...).
    ``healthcheck_timeout_s``: seconds a worker may take to answer the supervisor's ping
    (a worker loading a model is busy) before it counts as hung and is replaced.

    Returns True when the server ran and stopped, False when a worker failed to start (its
    error is in the log; the others were stopped). Raises RuntimeError for uvicorn < 0.50."""
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE
    from uvicorn.supervisors import Multiprocess

    if _uvicorn_version() < MIN_UVICORN:
        raise RuntimeError(f"workers need uvicorn >= {'.'.join(map(str, MIN_UVICORN))} "
                           f"(found {'.'.join(map(str, _uvicorn_version()))}): "
                           "pip install -U uvicorn")
    group = WorkerGroup.create(workers)
    added = {**group.env(), **(env or {})}
    saved = {k: os.environ.get(k) for k in added}
    os.environ.update(added)  # spawned workers inherit the environment
    try:
        cfg = uvicorn.Config(app, factory=True, workers=workers,
                             timeout_worker_healthcheck=healthcheck_timeout_s, **config)
        sock = cfg.bind_socket()
        supervisor = _supervisor(Multiprocess)(cfg, sockets=[sock])
        supervisor.run()
        sock.close()
        return not any(p.exitcode == STARTUP_FAILURE for p in supervisor.processes)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        group.remove()
