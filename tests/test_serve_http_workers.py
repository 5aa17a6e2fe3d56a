"""``mhmla-serve http --workers N``: N processes on one port (mhmla_fast.serve.http_workers).

The server runs as a real command in a subprocess (workers are spawned processes, and
prometheus-client reads its multiprocess folder when it is imported)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
from prometheus_client import Gauge  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from mhmla_fast.commands import serve as cli  # noqa: E402
from mhmla_fast.serve import http as http_app  # noqa: E402
from mhmla_fast.serve import http_workers  # noqa: E402
from mhmla_fast.serve.http_workers import WorkerGroup  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model: Path, tmp: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """``mhmla-serve http --workers 2`` on ``model`` with its temporary files under ``tmp``."""
    port = _free_port()
    env = {**os.environ, "TMPDIR": str(tmp)}
    env.pop(http_workers.WORKERS_ENV, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mhmla_fast.commands.serve", "http", "--port", str(port),
         "--model", str(model), "--no-scorer", "--backend", "torch", "--threads", "1",
         "--workers", "2", "--log-level", "warning", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return proc, f"http://127.0.0.1:{port}"


def _health(url: str) -> dict | None:
    try:
        r = httpx.get(url + "/healthz", timeout=5)  # a new connection each time
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def _wait_ready(proc: subprocess.Popen, url: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        h = _health(url)
        if h and h["workers_ready"] == h["workers"] == 2:
            return h
        time.sleep(0.1)
    raise AssertionError("the workers did not all come up")


def _samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _stop(proc: subprocess.Popen) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the server did not stop on SIGINT: {err[-3000:]}")
    return proc.returncode, err


def test_two_workers_answer_on_one_port_and_sum_their_metrics(tiny_tagger_dir, tiny_engine,
                                                              tmp_path):
    proc, url = _start(tiny_tagger_dir, tmp_path)
    try:
        first = _wait_ready(proc, url)
        assert first["status"] == "ok" and first["queue_depth"] == 0
        (group_dir,) = tmp_path.glob("mhmla-http-*")
        pids = {first["pid"]}
        deadline = time.monotonic() + 30
        while len(pids) < 2:  # new connections are spread over both workers
            assert time.monotonic() < deadline, f"only worker {pids} answered"
            pids.add(_health(url)["pid"])

        # (a blank text is refused, 422, as `mhmla-serve tag` refuses it: test_serve_http)
        texts = [f"He go to school number {i} ." for i in range(40)] + [" x\u3000", "A  b\tc"]
        expected = [r.to_dict() for r in tiny_engine.tag_texts(texts)]
        for i in range(0, len(texts), 3):  # a new connection per request: both workers tag
            r = httpx.post(url + "/v1/tag", json={"texts": texts[i:i + 3]}, timeout=30)
            assert r.status_code == 200, r.text
            got = r.json()["results"]
            assert [g["labels"] for g in got] == [e["labels"] for e in expected[i:i + 3]]
            assert [g["offsets"] for g in got] == [list(map(list, e["offsets"]))
                                                   for e in expected[i:i + 3]]
        m = _samples(url)  # from whichever worker answers: the sums over both
        assert m[("mhmla_texts_tagged_total", ())] == len(texts)
        assert m[("mhmla_http_requests_total", (("path", "/v1/tag"), ("status", "200")))] == 14
        # a worker's queue gauge is a file it refreshes every GAUGE_REFRESH_S (0.5 s): one set
        # while the last request waited reads 3 until the next refresh, so the sum settles to 0
        deadline = time.monotonic() + 10
        while (depth := _samples(url)[("mhmla_queue_depth", ())]) != 0:
            assert time.monotonic() < deadline, f"queue depth {depth} long after the last answer"
            time.sleep(0.1)

        # a worker killed outright is replaced; its counts stay in the sums
        os.kill(first["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 90
        while True:
            assert time.monotonic() < deadline, "the killed worker was not replaced"
            h = _health(url)
            if h and h["workers_ready"] == 2 and not list(
                    p for p in (group_dir / "ready").iterdir() if p.name == str(first["pid"])):
                break
            time.sleep(0.2)
        r = httpx.post(url + "/v1/tag", json={"texts": texts[:2]}, timeout=30)
        assert [g["labels"] for g in r.json()["results"]] == [e["labels"] for e in expected[:2]]
        assert _samples(url)[("mhmla_texts_tagged_total", ())] == len(texts) + 2
    finally:
        code, err = _stop(proc)
    assert code == 0, err[-3000:]
    assert not list(tmp_path.glob("mhmla-http-*"))  # the group's folder is removed


def test_a_worker_that_cannot_load_stops_the_server(tiny_tagger_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny_tagger_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "model.safetensors").write_bytes(b"not safetensors")
    proc, _ = _start(bad, tmp_path)
    try:
        _, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"the server kept restarting a worker that cannot start: "
                             f"{proc.communicate()[1][-3000:]}")
    assert proc.returncode == cli.EXIT_USAGE, err[-3000:]
    assert "cannot load the model" in err and "a worker failed to start" in err
    assert not list(tmp_path.glob("mhmla-http-*"))


def test_workers_refuse_an_old_uvicorn(tiny_tagger_dir, monkeypatch, capsys):
    monkeypatch.setattr(http_workers, "_uvicorn_version", lambda: (0, 49))
    code = cli.main(["http", "--model", str(tiny_tagger_dir), "--workers", "2",
                     "--no-scorer", "--backend", "torch"])
    assert code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "--workers" in err and "uvicorn >= 0.50" in err and "0.49" in err


def test_the_worker_options_survive_the_trip_through_the_environment(tiny_tagger_dir,
                                                                      monkeypatch):
    """What the parent parsed is what each worker builds its app from."""
    seen = {}

    def fake_serve(app, workers, *, env, **server):
        seen.update(app=app, workers=workers, env=env, server=server)
        return True

    monkeypatch.setattr(http_workers, "serve_workers", fake_serve)
    argv = ["http", "--model", str(tiny_tagger_dir), "--workers", "3", "--no-scorer",
            "--backend", "torch", "--max-wait-ms", "2.5", "--dtype", "fp32", "--port", "9"]
    assert cli.main(argv) == cli.EXIT_OK
    assert seen["app"] == "mhmla_fast.commands.serve:http_worker_app" and seen["workers"] == 3
    assert seen["server"]["port"] == 9
    options = json.loads(seen["env"][cli.HTTP_ARGS_ENV])
    parsed = vars(cli.build_parser().parse_args(argv))
    parsed.pop("run")
    assert options.pop("threads") >= 1  # the cores shared out, as none was given
    parsed.pop("threads")
    assert options == parsed


def test_a_group_needs_its_metrics_folder_and_counts_live_workers(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="workers"):
        WorkerGroup.create(1)
    group = WorkerGroup(tmp_path, 3)
    (tmp_path / "ready").mkdir()
    monkeypatch.setenv(http_workers.WORKERS_ENV, group.env()[http_workers.WORKERS_ENV])
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "elsewhere"))
    with pytest.raises(RuntimeError, match="PROMETHEUS_MULTIPROC_DIR"):
        WorkerGroup.from_env()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(group.metrics_dir))
    assert WorkerGroup.from_env() == group

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    group.mark_ready()  # this process: alive
    (tmp_path / "ready" / str(dead.pid)).touch()
    assert group.ready() == 1
    assert not (tmp_path / "ready" / str(dead.pid)).exists()

    # a killed worker's live gauges leave the sums at the next scrape (they stayed for ever)
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    group.metrics_dir.mkdir(exist_ok=True)
    live = group.metrics_dir / f"gauge_livesum_{os.getpid()}.db"
    gone = group.metrics_dir / f"gauge_livesum_{dead.pid}.db"
    live.touch()
    gone.touch()
    group.forget_dead()
    assert live.exists() and not gone.exists()
    MultiProcessCollector(CollectorRegistry(), path=str(group.metrics_dir))


def test_a_group_worker_refreshes_its_queue_gauge():
    from prometheus_client import CollectorRegistry

    gauge = Gauge("depth", "d", registry=CollectorRegistry())
    depth = [3]

    async def run() -> list[float]:
        task = asyncio.ensure_future(http_app._refresh_gauge(gauge, lambda: depth[0]))
        await asyncio.sleep(0.05)
        seen = [gauge._value.get()]
        depth[0] = 7
        await asyncio.sleep(http_app.GAUGE_REFRESH_S + 0.2)
        seen.append(gauge._value.get())
        task.cancel()
        return seen

    assert asyncio.run(run()) == [3, 7]


def test_a_killed_parent_takes_its_workers_with_it_and_ttou_changes_nothing(tiny_tagger_dir,
                                                                            tmp_path,
                                                                            monkeypatch):
    """SIGTTOU (uvicorn's "one worker fewer") is ignored: the group's size is fixed, and
    /healthz's workers and workers_ready stay equal. A parent killed with kill -9 left its
    workers serving on the port unsupervised (a restart failed with "address already in use");
    they now stop within seconds, and the next group removes the dead parent's folder."""
    import tempfile

    proc, url = _start(tiny_tagger_dir, tmp_path)
    try:
        first = _wait_ready(proc, url)
        pids, deadline = {first["pid"]}, time.monotonic() + 30
        while len(pids) < 2:
            assert time.monotonic() < deadline, f"only worker {pids} answered"
            pids.add(_health(url)["pid"])
        os.kill(proc.pid, signal.SIGTTOU)
        time.sleep(2)
        h = _health(url)
        assert h["workers"] == h["workers_ready"] == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        deadline = time.monotonic() + 30
        while any(http_workers.process_alive(p) for p in pids):
            assert time.monotonic() < deadline, "the workers outlived their parent"
            time.sleep(0.2)
        port = int(url.rsplit(":", 1)[1])
        with socket.socket() as s:  # the port is free again
            s.bind(("127.0.0.1", port))
    finally:
        if proc.poll() is None:
            proc.kill()
    (stale,) = tmp_path.glob("mhmla-http-*")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    group = WorkerGroup.create(2)
    try:
        assert not stale.exists() and group.root.name.startswith(f"mhmla-http-{os.getpid()}-")
    finally:
        group.remove()


def test_the_supervisor_closes_its_socket_before_it_stops_the_workers():
    """At shutdown the parent's copy of the listening socket is closed first: with it open and
    nobody accepting, new clients connected, waited for the workers' last requests, then were
    reset (a single process refuses them at once)."""
    events = []

    class Base:
        def __init__(self, sockets):
            self.sockets = sockets

        def terminate_all(self):
            events.append([s.fileno() for s in self.sockets])

    sock = socket.socket()
    supervisor = http_workers._supervisor(Base)([sock])
    supervisor.terminate_all()
    assert events == [[-1]]  # closed when the workers were told to stop
    supervisor.handle_ttin()  # logged and ignored: no worker added
    supervisor.handle_ttou()


def test_workers_are_bounded_and_web_concurrency_is_not_ours(tiny_tagger_dir, monkeypatch,
                                                             capsys):
    """A count of workers beyond twice the logical CPUs is a usage error (each loads the
    models: a mistyped count spawned workers until memory ran out); one process passes
    workers=1 to uvicorn, which otherwise read $WEB_CONCURRENCY and failed."""
    import uvicorn

    too_many = http_workers.max_workers() + 1
    assert cli.main(["http", "--model", str(tiny_tagger_dir), "--no-scorer",
                     "--workers", str(too_many)]) == 2
    assert f"--workers: at most {too_many - 1} on this machine" in capsys.readouterr().err
    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    monkeypatch.setattr(cli, "build_http_app", lambda args: object())
    monkeypatch.setenv("WEB_CONCURRENCY", "4")
    assert cli.main(["http", "--model", str(tiny_tagger_dir), "--no-scorer"]) == 0
    assert seen["workers"] == 1
