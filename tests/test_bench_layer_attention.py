"""CPU tests of bench/benchmark_layer_attention.py: the no-GPU exit, the FLOP count, and the
sweep's bookkeeping (rows, checks against eager, error rows, speedups) run on CPU with a
stand-in op, a wall-clock timer and no memory probe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench_scripts import load_bench_script

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "bench" / "benchmark_layer_attention.py"

bench = load_bench_script("benchmark_layer_attention")


# ----------------------------------------------------------------------------------------------
# No CUDA: message, exit 0, nothing written
# ----------------------------------------------------------------------------------------------


def test_main_without_cuda_exits_0_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    assert bench.main(["--out", str(out_dir)]) == 0
    captured = capsys.readouterr()
    assert bench.NO_CUDA_MESSAGE in captured.err
    assert "no CUDA GPU found" in captured.err
    assert list(out_dir.iterdir()) == []
    # an explicit .json file is not created either
    target = tmp_path / "x.json"
    assert bench.main(["--quick", "--out", str(target)]) == 0
    assert not target.exists()


def test_script_without_cuda_subprocess(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert bench.NO_CUDA_MESSAGE in res.stderr
    assert list(tmp_path.iterdir()) == []


def test_help_works():
    res = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0
    assert "--quick" in res.stdout and "FLOP convention" in res.stdout


def test_importing_the_script_does_no_work():
    res = subprocess.run(
        [sys.executable, "-c",
         "import importlib.util, sys\n"
         f"spec = importlib.util.spec_from_file_location('b', {str(SCRIPT)!r})\n"
         "m = importlib.util.module_from_spec(spec); sys.modules['b'] = m; spec.loader.exec_module(m)\n"
         "print('torch' in sys.modules, 'triton' in sys.modules, 'mhmla_fast' in sys.modules)"],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False", "False"]


def test_quick_and_default_arguments():
    args = bench.parse_args(["--quick"])
    assert (args.shapes, args.dtypes, args.ns) == (["bert-base"], ["bf16"], [4096])
    assert args.providers == ["eager", "compile", "fused"] and args.modes == ["forward", "backward", "full"]
    args = bench.parse_args([])
    assert args.shapes == ["bert-base", "minilm"] and args.dtypes == ["bf16", "fp16"]
    assert args.ns == [1024, 2048, 4096, 8192, 16384]
    assert bench.parse_args(["--quick", "--n", "8192"]).ns == [8192]
    with pytest.raises(SystemExit):
        bench.parse_args(["--dropout", "1.0"])


# ----------------------------------------------------------------------------------------------
# Counting
# ----------------------------------------------------------------------------------------------


def test_flops_bert_base_by_hand():
    # BERT-base, N = 4096: two GEMMs per layer, [4096 x 768] @ [768 x 768] and @ [768 x 768],
    # each 2 * 4096 * 768 * 768 = 4,831,838,208 FLOPs; 2 per layer, 12 layers.
    per_gemm = 2 * 4096 * 768 * 768
    assert per_gemm == 4_831_838_208
    forward = 12 * 2 * per_gemm
    assert forward == 115_964_116_992
    assert bench.layer_attention_flops(12, 4096, 768, 768, "forward") == 115_964_116_992
    assert bench.layer_attention_flops(12, 4096, 768, 768, "inference") == 115_964_116_992
    assert bench.layer_attention_flops(12, 4096, 768, 768, "backward") == 231_928_233_984
    assert bench.layer_attention_flops(12, 4096, 768, 768, "full") == 347_892_350_976
    # DESIGN.md: "about 28 MFLOP per token" at BERT-base
    assert bench.layer_attention_flops(12, 1, 768, 768) == 28_311_552
    # H != K: [N x H] @ [H x H] plus [N x H] @ [H x K]; L = 2, N = 3, H = 4, K = 5: 2*3*4*(4+5)*2
    assert bench.layer_attention_flops(2, 3, 4, 5) == 432
    with pytest.raises(ValueError):
        bench.layer_attention_flops(1, 1, 1, 1, "sideways")


def test_min_bytes_by_hand():
    # L = 1, N = 2, H = K = 2, J = 1, 2-byte elements.
    params = 4 + 2 + 4 + 2 + 2 + 1  # w_v, b_v, w_k, b_k, w_a, b_a
    fwd = (1 * 2 * 2 + params + 2 * 2) * 2  # read hidden, params; write c
    bwd = (2 * 4 + 2 * params + 2 * 4) * 2  # read hidden, params, dc, c; write dhidden, dparams
    assert bench.layer_attention_min_bytes(1, 2, 2, 2, 1, 2, "forward") == fwd
    assert bench.layer_attention_min_bytes(1, 2, 2, 2, 1, 2, "backward") == bwd
    assert bench.layer_attention_min_bytes(1, 2, 2, 2, 1, 2, "full") == fwd + bwd


def test_quantiles_match_linear_interpolation():
    times = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert bench.quantiles(times, (0.5, 0.2, 0.8)) == pytest.approx((3.0, 1.8, 4.2))


def test_out_path(tmp_path):
    import datetime

    day = datetime.date(2026, 11, 22)
    p = bench.resolve_out_path(str(tmp_path), "NVIDIA H100 80GB HBM3", day)
    assert p == tmp_path / "layer_attention_nvidia-h100-80gb-hbm3_2026-11-22.json"
    p.write_text("{}")
    assert bench.resolve_out_path(str(tmp_path), "NVIDIA H100 80GB HBM3", day).name.endswith("-2.json")
    assert bench.resolve_out_path(str(tmp_path / "r.json"), "x", day) == tmp_path / "r.json"


# ----------------------------------------------------------------------------------------------
# The sweep on CPU with a stand-in op
# ----------------------------------------------------------------------------------------------


def _reference_op(hidden, w_v, b_v, w_k, b_k, w_a, b_a, num_heads, *, dropout_h=0.0, dropout_k=0.0,
                  dropout_p=0.0, training=False, return_weights=False, backend="auto"):
    """The contract of mhmla_fast.layer_attention, eager, no dropout (a stand-in for the test)."""
    L, H = hidden.shape[0], hidden.shape[-1]
    h = hidden.reshape(L, -1, H)
    N = h.shape[1]
    v = torch.baddbmm(b_v.unsqueeze(1), h, w_v)
    k = torch.relu(torch.baddbmm(b_k.unsqueeze(1), h, w_k))
    p = torch.baddbmm(b_a.unsqueeze(1), k, w_a).softmax(dim=0)
    c = (p.unsqueeze(-1) * v.view(L, N, num_heads, H // num_heads)).sum(0).reshape(N, H)
    return c.reshape(*hidden.shape[1:-1], H)


class _OneShotGrad(torch.autograd.Function):
    """Identity whose backward refuses a second call on the same graph."""

    @staticmethod
    def forward(ctx, x):
        ctx.used = False
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.used:
            raise RuntimeError("graph already consumed")
        ctx.used = True
        return g


class _WallTimer:
    def bench(self, fn):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return bench.quantiles(times)

    def bench_with_setup(self, setup, fn):
        times = []
        for _ in range(3):
            state = setup()
            t0 = time.perf_counter()
            fn(state)
            times.append((time.perf_counter() - t0) * 1e3)
        return bench.quantiles(times)


def _run(op, providers, modes=("forward", "backward", "full")):
    cfg = bench.BenchConfig(shapes=[bench.Shape("tiny", L=3, H=12, K=8, J=3)], dtypes=["bf16"], ns=[37],
                            providers=list(providers), modes=list(modes))
    logs = []
    rows = bench.run_benchmark(cfg, op, device="cpu", timer=_WallTimer(), peak_probe=None,
                               ceiling_tflops=1.0, meta={"device": "cpu-test"}, log=logs.append)
    return rows, logs


def test_sweep_rows_checks_and_errors():
    def op(*args, backend="auto", **kw):
        if backend == "triton":  # "fused" stand-in: right forward, graph usable once
            return _OneShotGrad.apply(_reference_op(*args, backend="torch", **kw))
        return _reference_op(*args, backend=backend, **kw)

    rows, _ = _run(op, ["eager", "fused"])
    assert [(r["provider"], r["mode"]) for r in rows] == [
        (p, m) for p in ("eager", "fused") for m in ("forward", "backward", "full")]
    for r in rows:
        assert r["error"] is None, r["error"]
        assert r["device"] == "cpu-test" and r["shape"] == "tiny" and r["N"] == 37 and r["dtype"] == "bf16"
        assert r["ms_p20"] <= r["ms_p50"] <= r["ms_p80"]
        assert r["flops"] == bench.layer_attention_flops(3, 37, 12, 8, r["mode"])
        assert r["tflops"] == pytest.approx(r["flops"] / (r["ms_p50"] * 1e-3) / 1e12)
        assert r["ratio_to_matmul_ceiling"] == pytest.approx(r["tflops"])
        assert r["max_abs_diff"] == 0.0
        assert 0.0 < r["max_abs_err_fp64"] < 0.1  # bf16 against float64
        assert set(r["grad_max_abs_diff"]) == set(bench.INPUT_NAMES)
        assert r["peak_extra_mem_mb"] is None
    backward = {r["provider"]: r for r in rows if r["mode"] == "backward"}
    assert backward["eager"]["backward_timing"] == "retain_graph"
    assert backward["fused"]["backward_timing"] == "rebuild"
    assert "graph already consumed" in backward["fused"]["backward_timing_note"]

    speedups = bench.summarize_speedups(rows)
    assert len(speedups) == 3
    for s in speedups:
        assert s["fused_vs_eager"] == pytest.approx(s["eager_ms"] / s["fused_ms"])
        assert s["compile_ms"] is None and s["fused_vs_compile"] is None
    json.dumps(bench._json_safe({"rows": rows, "speedups": speedups}), allow_nan=False)


def test_a_failing_or_wrong_provider_is_recorded_and_the_run_goes_on():
    def op(*args, backend="auto", **kw):
        if backend == "triton":
            raise RuntimeError("boom: no kernel")
        return _reference_op(*args, backend=backend, **kw)

    rows, logs = _run(op, ["fused", "eager"], modes=["forward"])
    fused, eager = rows
    assert "boom: no kernel" in fused["error"] and fused["ms_p50"] is None
    assert eager["error"] is None and eager["ms_p50"] is not None
    assert any("boom" in line for line in logs)

    def wrong(*args, backend="auto", **kw):
        c = _reference_op(*args, backend="torch", **kw)
        return c + 1.0 if backend == "triton" else c

    rows, _ = _run(wrong, ["eager", "fused"], modes=["forward"])
    assert rows[1]["max_abs_diff"] == pytest.approx(1.0, abs=0.02)


def test_targets_are_evaluated_for_bert_base_bf16():
    def row(provider, mode, ms, mem, ratio=None):
        return {"shape": "bert-base", "dtype": "bf16", "N": 4096, "mode": mode, "provider": provider,
                "ms_p50": ms, "peak_extra_mem_mb": mem, "ratio_to_matmul_ceiling": ratio, "error": None}

    rows = [row("eager", "forward", 3.0, 900.0), row("compile", "forward", 1.5, 500.0),
            row("fused", "forward", 1.0, 100.0, ratio=0.65),
            row("eager", "full", 10.0, 3000.0), row("compile", "full", 6.0, 2000.0),
            row("fused", "full", 5.0, 1200.0)]
    targets = bench.evaluate_targets(bench.summarize_speedups(rows), "NVIDIA H100 80GB HBM3")
    assert targets["on_target_device"] is True
    got = {(c["mode"], c["metric"]): c["passed"] for c in targets["checks"]}
    assert got == {
        ("forward", "fused_vs_eager"): True,  # 3.0 >= 3
        ("forward", "fused_vs_compile"): True,  # 1.5 >= 1.5
        ("forward", "fused_ratio_to_matmul_ceiling"): True,  # 0.65 >= 0.60
        ("full", "fused_vs_eager"): False,  # 2.0 < 2.5
        ("full", "fused_mem_over_eager"): False,  # 0.4 > 1/3
    }
    assert "targets" in bench.format_speedups(bench.summarize_speedups(rows), targets)


def test_main_end_to_end_with_a_pretend_gpu(tmp_path, monkeypatch, capsys):
    """main()'s GPU path with CUDA faked on CPU: the file layout, header and row fields."""
    import types

    def op(*args, backend="auto", **kw):
        return _reference_op(*args, backend="torch", **kw)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: types.SimpleNamespace(multi_processor_count=132, total_memory=80 * 2**30))
    monkeypatch.setattr(bench, "CudaTimer", lambda **kw: _WallTimer())
    monkeypatch.setattr(bench, "measure_matmul_ceiling", lambda timer, dtype: {"tflops": 800.0})
    monkeypatch.setattr(bench, "measure_copy_ceiling", lambda timer: {"gbps": 3000.0})
    monkeypatch.setattr(bench, "cuda_peak_extra_bytes", lambda call: (call(), 3 * 2**20)[1])
    monkeypatch.setattr(bench, "git_commit", lambda: "0123abc")
    monkeypatch.setattr(bench, "_import_layer_attention", lambda: op)
    run = bench.run_benchmark
    monkeypatch.setattr(bench, "run_benchmark", lambda *a, **kw: run(*a, **{**kw, "device": "cpu"}))

    assert bench.main(["--shapes", "minilm", "--dtypes", "fp16", "--n", "8", "--providers", "eager", "fused",
                       "--out", str(tmp_path)]) == 0
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.startswith("layer_attention_nvidia-h100-80gb-hbm3_")
    data = json.loads(files[0].read_text())
    header = data["header"]
    for key in ("device", "torch", "triton", "cuda", "commit", "timestamp", "matmul_ceiling_bf16_tflops",
                "flop_convention"):
        assert key in header
    assert header["commit"] == "0123abc" and header["matmul_ceiling_bf16_tflops"] == 800.0
    assert len(data["rows"]) == 2 * 3
    for r in data["rows"]:
        for key in ("device", "torch", "triton", "cuda", "commit", "shape", "dtype", "provider", "mode",
                    "ms_p50", "ms_p20", "ms_p80", "tflops", "ratio_to_matmul_ceiling", "peak_extra_mem_mb",
                    "max_abs_diff", "error"):
            assert key in r
        assert r["error"] is None and r["peak_extra_mem_mb"] == 3.0
        assert r["ratio_to_matmul_ceiling"] == pytest.approx(r["tflops"] / 800.0)
    assert {(s["mode"], s["N"]) for s in data["speedups"]} == {("forward", 8), ("backward", 8), ("full", 8)}
    assert "wrote" in capsys.readouterr().out
