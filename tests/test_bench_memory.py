"""bench/memory_layer_attention_cpu.py: the tensor-level peak accounting behind the CPU memory
figures (inputs excluded, freed storages released, views not counted twice, the largest tensors
alive at the peak)."""

from __future__ import annotations

import os

import pytest
import torch

from bench_scripts import load_bench_script


def test_peak_counts_live_storages_once_and_lists_the_largest_at_the_peak():
    mem = load_bench_script("memory_layer_attention_cpu")
    x = torch.ones(10)  # an input: never counted, nor its views

    def fn():
        a = torch.empty(1000)  # 4,000 bytes
        b = a.view(10, 100)  # a view: no new storage
        c = torch.empty((20, 10), dtype=torch.bfloat16)  # 400 bytes; peak 4,400 here
        del a, b, c
        d = torch.empty(500)  # 2,000 bytes after the others are freed: not a new peak
        e = x.view(2, 5) * 1  # 40 bytes
        del d, e
        x.view(5, 2)

    peak, at_peak = mem.peak_extra_bytes(fn, [x], top=2)
    assert peak == 4400
    assert at_peak == [([1000], "float32", 4000), ([20, 10], "bfloat16", 400)]
    assert mem.peak_extra_bytes(fn, [x]) == 4400


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused launchers take CPU tensors under TRITON_INTERPRET=1")
def test_fused_peak_holds_at_least_the_returned_gradients():
    mem = load_bench_script("memory_layer_attention_cpu")
    shape = dict(L=2, H=32, K=32, J=4)
    n = 48
    fused, at_peak = mem.measure(shape, n, "triton", None, "float32", top=3)
    eager = mem.measure(shape, n, "torch", None, "float32")
    L, H, K, J = 2, 32, 32, 4
    grads = 4 * (L * n * H + L * H * H + L * H + L * H * K + L * K + L * K * J + L * J)
    assert grads <= fused and grads <= eager
    assert at_peak[0][2] >= at_peak[1][2] >= at_peak[2][2] > 0
