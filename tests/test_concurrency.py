"""The public API used from several threads at once, as a web app or a thread pool would:
loading, exporting and tagging at the same time give what one at a time gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from export_cache_fixtures import cache  # noqa: F401  (fixture)

TWO_LOADS = """
import json, sys, threading
from mhmla_fast.serve.engine import Engine
from mhmla_fast.serve.score import load_scorer
out = {}
def load(name, fn):
    try:
        out[name] = type(fn()).__name__
    except Exception as err:
        out[name] = repr(err)
jobs = [("tagger", lambda: Engine.load(sys.argv[1], backend=sys.argv[3]).runner),
        ("scorer", lambda: load_scorer(sys.argv[2], backend=sys.argv[3]))]
threads = [threading.Thread(target=load, args=job) for job in jobs]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(out))
"""


def _two_loads(tagger_dir, scorer_dir, backend, env):
    env = {**env, "CUDA_VISIBLE_DEVICES": ""}  # the CPU's paths (auto on a GPU is torch)
    done = subprocess.run([sys.executable, "-c", TWO_LOADS, str(tagger_dir), str(scorer_dir),
                           backend], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_tagger_and_a_scorer_load_together_in_a_fresh_process(tiny_tagger_dir, tiny_scorer_dir):
    """Two first loads at once in a fresh process: one failed "ImportError: cannot import name
    'AutoConfig' from 'transformers'" (its lazy module filled by two threads at once)."""
    got = _two_loads(tiny_tagger_dir, tiny_scorer_dir, "torch", dict(os.environ))
    assert got == {"tagger": "TorchRunner", "scorer": "EssayScorer"}, got


def test_two_exports_at_once_both_succeed_and_record_no_failure(tiny_tagger_dir, tiny_scorer_dir,
                                                                cache):  # noqa: F811
    """The tagger's and the scorer's first ONNX exports at once in one process: one failed
    "GLOBALS.in_onnx_export must be False" (torch.onnx.export is process-wide), and the cache
    recorded it as the model's failure, so every later process ran torch."""
    env = dict(os.environ, MHMLA_CACHE_DIR=str(cache))
    env.pop("MHMLA_NO_CACHE", None)
    got = _two_loads(tiny_tagger_dir, tiny_scorer_dir, "auto", env)
    assert got == {"tagger": "OnnxRunner", "scorer": "OnnxScorer"}, got
    assert not list(cache.rglob("*failed*")), list(cache.rglob("*"))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused kernels on the CPU need TRITON_INTERPRET=1")
def test_the_fused_head_from_several_threads_equals_eager():
    """Interpreted launches from several threads at once failed ("Did you forget to add
    @triton.jit": the interpreter patches triton.language per launch); they now take turns."""
    from mhmla_fast import FusedLayerAttention

    torch.manual_seed(0)
    fused = FusedLayerAttention(32, 3, 4, backend="triton").eval()
    eager = FusedLayerAttention(32, 3, 4, backend="torch").eval()
    eager.load_state_dict(fused.state_dict())
    inputs = [torch.randn(4, n, 32) for n in (1, 5, 17, 33, 3, 9, 20, 2)]
    with torch.no_grad():
        want = [eager(x) for x in inputs]

        def run(i):
            return fused(inputs[i])

        for _ in range(3):
            with ThreadPoolExecutor(4) as pool:
                for got, ref in zip(pool.map(run, range(len(inputs))), want):
                    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_calls_from_several_threads_start_one_host_pool(tiny_tagger_dir, monkeypatch):
    """Large first calls from four threads at once each started a host pool (three left running
    after close()); one pool serves them, and the results equal one call at a time."""
    from mhmla_fast.serve import hostpool
    from mhmla_fast.serve.engine import Engine

    started = []
    gate = threading.Barrier(4)

    class Counted(hostpool.HostPool):
        def __init__(self, *args, **kw):
            started.append(1)
            super().__init__(*args, **kw)

    monkeypatch.setattr(hostpool, "HostPool", Counted)
    engine = Engine.load(tiny_tagger_dir, backend="torch", device="cpu", host_workers=1)
    texts = [[f"Sentence {i} of call {c} has words ." for i in range(2 * hostpool.CHUNK + 5)]
             for c in range(4)]
    try:
        def call(c):
            gate.wait()
            return engine.tag_texts(texts[c])

        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(call, range(4)))
        assert len(started) == 1
        plain = Engine.load(tiny_tagger_dir, backend="torch", device="cpu")
        for c in range(4):
            alone = plain.tag_texts(texts[c])
            assert [r.labels for r in together[c]] == [r.labels for r in alone]
    finally:
        engine.close()
    assert engine._pool is None
