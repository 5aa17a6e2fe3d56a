"""The engine's host workers (``Engine(host_workers=N)``, :mod:`mhmla_fast.serve.hostpool`):
large calls are word-tokenised and word-pieced in spawned processes, with results identical
to the engine's own; small calls stay in the calling thread; ``--host-workers`` reaches the
engine from ``mhmla-serve tag`` and is refused with ``--ray``."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

from mhmla_fast.serve import hostpool
from mhmla_fast.serve.engine import Engine

WORDS = ("the a cat dog house school every day he she they go goes went because although "
         "café naïve don't John's well-known 3.14 我喜欢猫 👍 !? ... co\u00adoperate").split()


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 30))) for _ in range(n)]
    out[3] = " ".join(rng.choice(WORDS) for _ in range(3000))  # longer than ENCODE_CHUNK words
    out[5] = "\u200b"  # a token that gives no word pieces
    return out


def test_host_workers_give_the_engines_own_results(tiny_engine, monkeypatch):
    calls = []
    original = hostpool.HostPool.texts
    monkeypatch.setattr(hostpool.HostPool, "texts",
                        lambda self, t: calls.append(len(t)) or original(self, t))
    engine = Engine(tiny_engine.runner, tiny_engine.tokenizer, threshold=tiny_engine.threshold,
                    max_pieces=tiny_engine.max_pieces, host_workers=2)
    try:
        data = texts(3 * hostpool.CHUNK + 7)
        want = [r.to_dict() for r in tiny_engine.tag_texts(data)]
        assert [r.to_dict() for r in engine.tag_texts(data)] == want
        assert calls == [len(data)]  # through the workers
        sentences = [t.split() or ["x"] for t in data]
        assert ([r.to_dict() for r in engine.tag_tokens(sentences)]
                == [r.to_dict() for r in tiny_engine.tag_tokens(sentences)])
        small = data[:10]  # below 2 * CHUNK: the calling thread. Compared with the engine's
        # own call on the same texts: batched with other texts, a probability can move in its
        # 6th decimal (a different padding and batch shape on CPU; seen on an AMX Xeon)
        assert ([r.to_dict() for r in engine.tag_texts(small)]
                == [r.to_dict() for r in tiny_engine.tag_texts(small)])
        assert calls == [len(data)]
    finally:
        engine.close()
    assert engine._pool is None
    with pytest.raises(ValueError, match="host_workers"):
        Engine(tiny_engine.runner, tiny_engine.tokenizer, host_workers=-1)


def test_cli_passes_host_workers_and_refuses_them_with_ray(tiny_tagger_dir, tmp_path,
                                                           monkeypatch, capsys):
    from mhmla_fast.commands import serve

    seen = {}
    load = Engine.load

    def spy(*a, **kw):
        seen.update(kw)
        return load(*a, **kw)

    monkeypatch.setattr(Engine, "load", staticmethod(spy))
    src = tmp_path / "in.txt"
    src.write_text("He go to school .\n", encoding="utf-8")
    base = ["tag", str(src), "--model", str(tiny_tagger_dir), "--no-progress", "--threads", "1"]
    assert serve.main(base + ["--output", str(tmp_path / "o.jsonl"), "--host-workers", "2"]) == 0
    assert seen["host_workers"] == 2
    assert serve.main(base + ["--output", str(tmp_path / "r.jsonl"), "--host-workers", "2",
                              "--ray"]) == 2
    assert "--host-workers applies to one process" in capsys.readouterr().err


def test_a_pool_whose_workers_cannot_start_fails_instead_of_hanging(monkeypatch, tiny_engine):
    """HostPool returns once every worker has started (each reports when ready); workers that
    cannot build their tokenizer exit, and the pool says so at once, well before
    READY_TIMEOUT; workers that never report make it give up after READY_TIMEOUT."""
    monkeypatch.setattr(hostpool, "READY_TIMEOUT", 60.0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"host_workers: 2 worker processes did not start: "
                                           r"\d exited \(exit codes \[1\];"):
        hostpool.HostPool(2, "{not a tokenizer", "[UNK]")
    assert time.monotonic() - t0 < 30
    monkeypatch.setattr(hostpool, "READY_TIMEOUT", 0.01)  # alive, but not ready in time
    with pytest.raises(RuntimeError, match=r"did not start: not ready within 0.01 s"):
        hostpool.HostPool(1, tiny_engine.pieces.to_str(), tiny_engine._unk)


def test_a_script_without_the_main_guard_gets_an_error_not_a_hang(tmp_path):
    """Spawned workers re-run a script's main module; one that starts a pool at its top level
    makes them fail while they start. The pool raises, naming the guard, instead of blocking
    for good on the pipe of a child that died before it read its arguments (the tokenizer was
    among them: a megabyte, more than a pipe holds)."""
    import subprocess
    import sys

    from mhmla_fast.serve.engine import default_tagger_path

    tokenizer = default_tagger_path() / "tokenizer.json"
    assert tokenizer.stat().st_size > 1 << 16  # more than a pipe's buffer
    script = tmp_path / "no_guard.py"
    script.write_text("import sys\nfrom mhmla_fast.serve import hostpool\n"
                      f"hostpool.HostPool(2, open({str(tokenizer)!r}).read(), '[UNK]')\n"
                      "print('started')\n", encoding="utf-8")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=240, cwd=tmp_path)
    assert run.returncode != 0 and "started" not in run.stdout
    assert "worker processes did not start" in run.stderr
    assert "if __name__ == '__main__'" in run.stderr


def test_a_pool_starts_all_its_workers_before_it_returns(tiny_engine):
    pool = hostpool.HostPool(3, tiny_engine.pieces.to_str(), tiny_engine._unk)
    try:
        workers = pool._procs
        assert len(workers) == 3 and all(w.is_alive() for w in workers)
        sentences = [["a", "cat"], ["the", "well-known", "café"]] * 3
        for (ids, first), (want_ids, want_first) in zip(pool.tokens(sentences),
                                                        tiny_engine._encode(sentences), strict=True):
            assert ids.tolist() == want_ids.tolist() and first.tolist() == want_first.tolist()
    finally:
        pool.close()


def test_an_error_in_a_task_is_raised_and_the_pool_goes_on(tiny_engine):
    """A task that fails in a worker raises RuntimeError in the caller, naming the error; the
    pool then answers the next call, without the failed call's late results."""
    pool = hostpool.HostPool(2, tiny_engine.pieces.to_str(), tiny_engine._unk)
    try:
        with pytest.raises(RuntimeError, match=r"a worker failed on chunk 1 of 3: \w+Error"):
            pool.texts(["a cat"] * hostpool.CHUNK + [None] + ["the dog"] * hostpool.CHUNK)
        words, offsets, encoded = pool.texts(["a cat", "the well-known café"])
        assert words == [["a", "cat"], ["the", "well-known", "café"]]
        assert [o.tolist() for o in offsets] == [[[0, 1], [2, 5]], [[0, 3], [4, 14], [15, 19]]]
        assert len(encoded) == 2
    finally:
        pool.close()


def test_a_dead_worker_raises_instead_of_hanging_and_the_engine_starts_a_new_pool(tiny_engine):
    """A worker killed (say by the OOM killer) makes the pool's next call raise, not wait
    forever for its task; the pool closes itself, and the engine's next large call starts a
    new one with the same results."""
    engine = Engine(tiny_engine.runner, tiny_engine.tokenizer, threshold=tiny_engine.threshold,
                    max_pieces=tiny_engine.max_pieces, host_workers=2)
    try:
        data = texts(2 * hostpool.CHUNK + 1, seed=4)
        want = [r.to_dict() for r in engine.tag_texts(data)]
        pool = engine._pool
        victim = pool._procs[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=30)
        with pytest.raises(RuntimeError, match=r"1 of 2 worker processes exited \(exit codes "
                                               r"\[-9\]\); the pool is closed"):
            engine.tag_texts(data)
        assert pool.closed and not any(p.is_alive() for p in pool._procs)
        assert [r.to_dict() for r in engine.tag_texts(data)] == want
        assert engine._pool is not pool
    finally:
        engine.close()


def test_calls_from_several_threads_each_get_their_own_results(tiny_engine):
    """The pool's results come back on one queue: calls from several threads take turns,
    and each gets the encoding of its own sentences."""
    pool = hostpool.HostPool(2, tiny_engine.pieces.to_str(), tiny_engine._unk)
    calls = [[[w] + s.split() for s in texts(2 * hostpool.CHUNK + 3, seed)]
             for seed, w in ((1, "a"), (2, "cat"), (3, "well-known"))]
    got: dict[int, list] = {}
    try:
        threads = [threading.Thread(target=lambda k=k, c=c: got.__setitem__(k, pool.tokens(c)))
                   for k, c in enumerate(calls)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        for k, sentences in enumerate(calls):
            want = tiny_engine._encode(sentences)
            assert [(i.tolist(), f.tolist()) for i, f in got[k]] == \
                [(i.tolist(), f.tolist()) for i, f in want]
    finally:
        pool.close()


def test_inputs_that_do_not_pickle_are_sent_plain_or_raise_instead_of_hanging(tiny_engine):
    """Texts of a str subclass defined in a function (which pickle cannot send) are sent as
    plain str and tagged as such; a task that still cannot be sent (such words) raises in the
    caller within a poll instead of leaving the call, and the pool's lock, waiting for ever;
    the pool then answers the next call."""
    class Local(str):
        pass

    pool = hostpool.HostPool(2, tiny_engine.pieces.to_str(), tiny_engine._unk)
    try:
        plain = ["a cat", "the well-known café"]
        got = pool.texts([Local(t) for t in plain])
        assert got[0] == pool.texts(plain)[0] and len(got[2]) == 2
        with pytest.raises(RuntimeError, match="a chunk could not be sent to the workers"):
            pool.tokens([[Local("a"), Local("cat")]])
        assert len(pool.tokens([["a", "cat"]])) == 1
    finally:
        pool.close()


def test_host_workers_exit_when_their_parent_is_killed(tmp_path):
    """A parent killed with kill -9 (or a plain kill: SIGTERM skips the atexit handlers that
    stop daemon children) left its host workers waiting for tasks for ever; they now follow it
    out."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from mhmla_fast.filelock import process_alive
    from mhmla_fast.serve.engine import default_tagger_path

    tokenizer = default_tagger_path() / "tokenizer.json"
    script = tmp_path / "pool.py"
    script.write_text(
        "import sys, time\nfrom mhmla_fast.serve import hostpool\n"
        "if __name__ == '__main__':\n"
        f"    pool = hostpool.HostPool(2, open({str(tokenizer)!r}).read(), '[UNK]')\n"
        "    print(*[p.pid for p in pool._procs], flush=True)\n"
        "    time.sleep(600)\n", encoding="utf-8")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    try:
        pids = proc.stdout.readline().split()
        assert len(pids) == 2 and all(process_alive(p) for p in pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(process_alive(p) for p in pids)
    finally:
        proc.kill()
