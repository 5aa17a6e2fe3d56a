"""pytest-benchmark view of ``mhmla_fast.layer_attention``: ``pytest bench/ --benchmark-only``.

On a CUDA GPU: providers eager (backend="torch"), fused ("triton") and auto ("auto"), modes
forward and full (forward + ``torch.autograd.grad`` of all seven inputs), at BERT-base
(L = 12, H = K = 768, J = 12) and MiniLM (L = 6, H = K = 384, J = 12), N = 4096, bf16.
Without one: a small fp32 shape (L = 3, N = 256, H = K = 64, J = 4) with backend torch only,
so that the command runs anywhere (a check of the harness, not a result).

Inputs as in ``benchmark_layer_attention.py`` (``make_inputs``); every call is warmed up three
times first (compilation and autotuning excluded) and synchronises CUDA before returning, so
pytest-benchmark's wall-clock rounds time the GPU work. Benchmarks are grouped per (shape,
dtype, N, mode), so each table compares the providers. ``extra_info`` adds the problem, the
counted model FLOPs and ``tflops_median`` (FLOPs / median time). The full study (percentiles
from CUDA events, memory, torch.compile, targets) is ``benchmark_layer_attention.py``.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent / "benchmark_layer_attention.py"
GPU_N, GPU_DTYPE, GPU_SHAPES = 4096, "bf16", ("bert-base", "minilm")
GPU_PROVIDERS = {"eager": "torch", "fused": "triton", "auto": "auto"}
CPU_N, CPU_DTYPE = 256, "fp32"
MODES = ("forward", "full")
WARMUP_CALLS = 3


@functools.cache
def _script() -> ModuleType:
    """``bench/benchmark_layer_attention.py`` (not a package) imported by file name, once."""
    name = "benchmark_layer_attention"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[name]


@dataclass(frozen=True)
class Case:
    shape: object  # benchmark_layer_attention.Shape
    n: int
    dtype: str
    provider: str
    backend: str
    mode: str
    device: str

    @property
    def id(self) -> str:
        return f"{self.shape.name}-{self.dtype}-N{self.n}-{self.provider}-{self.mode}"

    @property
    def group(self) -> str:
        return f"layer_attention {self.shape.name} {self.dtype} N={self.n} {self.mode}"


def cases() -> list[Case]:
    """The CUDA grid when a GPU is present, else the one small CPU case per mode."""
    import torch

    bench = _script()
    if torch.cuda.is_available():
        return [Case(bench.SHAPES[s], GPU_N, GPU_DTYPE, p, b, m, "cuda")
                for s in GPU_SHAPES for m in MODES for p, b in GPU_PROVIDERS.items()]
    small = bench.Shape("cpu-small", L=3, H=64, K=64, J=4)
    return [Case(small, CPU_N, CPU_DTYPE, "eager", "torch", m, "cpu") for m in MODES]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        grid = cases()
        metafunc.parametrize("case", grid, ids=[c.id for c in grid])


def test_layer_attention(benchmark, case: Case) -> None:
    import torch

    bench = _script()
    op = bench._import_layer_attention()
    shape = case.shape
    inputs, dc = bench.make_inputs(shape, case.n, bench._torch_dtype(case.dtype), case.device, seed=case.n)
    sync = torch.cuda.synchronize if case.device == "cuda" else (lambda: None)

    if case.mode == "forward":
        def call():
            out = op(*inputs, shape.J, backend=case.backend)
            sync()
            return out
    else:
        def call():
            grads = torch.autograd.grad(op(*inputs, shape.J, backend=case.backend), inputs, dc)
            sync()
            return grads

    for _ in range(WARMUP_CALLS):
        call()
    flops = bench.layer_attention_flops(shape.L, case.n, shape.H, shape.K, case.mode)
    benchmark.group = case.group
    benchmark.extra_info.update(shape=shape.name, L=shape.L, N=case.n, H=shape.H, K=shape.K, J=shape.J,
                                dtype=case.dtype, provider=case.provider, backend=case.backend, mode=case.mode,
                                flops=flops)
    result = benchmark(call)
    assert result is not None
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["tflops_median"] = flops / stats.stats.median / 1e12
