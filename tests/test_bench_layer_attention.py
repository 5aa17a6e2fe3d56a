"""CPU tests of bench/benchmark_layer_attention.py: the no-GPU exit, the FLOP and byte counts,
argument parsing, the sweep's bookkeeping (rows, checks against eager, the cuBLAS line, the
determinism check, error rows) run on CPU with a stand-in op, a wall-clock timer and no memory
probe, and the summaries (speedups, targets, auto's evidence) on synthetic rows."""

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
    assert args.providers == ["eager", "compile", "compile-max", "fused", "auto", "cublas"]
    assert args.modes == ["forward", "backward", "full", "inference"]
    args = bench.parse_args([])
    assert args.shapes == ["bert-base", "minilm"] and args.dtypes == ["bf16", "fp16"]
    assert args.ns == [1024, 2048, 4096, 8192, 16384]
    assert bench.parse_args(["--quick", "--n", "8192"]).ns == [8192]
    with pytest.raises(SystemExit):
        bench.parse_args(["--dropout", "1.0"])
    assert bench.parse_args(["--providers", "compile-max", "cublas"]).providers == ["compile-max", "cublas"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--providers", "cudnn"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--n", "0"])


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


def test_projection_min_bytes_by_hand():
    # The cuBLAS line, L = 2, N = 3, H = 4, K = 5, 2-byte elements.
    weights = 2 * 4 * 4 + 2 * 4 * 5  # w_v, w_k
    fwd = (2 * 3 * 4 + weights + 2 * 3 * 4 + 2 * 3 * 5) * 2  # read hidden, weights; write v, z
    bwd = (2 * 3 * 4 + weights + 2 * 3 * (4 + 5) + 2 * 3 * 4 + weights) * 2  # + dv, dz; write dh, dW
    assert bench.projection_min_bytes(2, 3, 4, 5, 2, "forward") == fwd
    assert bench.projection_min_bytes(2, 3, 4, 5, 2, "backward") == bwd
    assert bench.projection_min_bytes(2, 3, 4, 5, 2, "full") == fwd + bwd
    with pytest.raises(ValueError):
        bench.projection_min_bytes(1, 1, 1, 1, 2, "sideways")


def test_projection_incoming_grads():
    dc = torch.arange(6.0).reshape(3, 2)  # N = 3, H = 2
    hidden, w_k = torch.zeros(4, 3, 2), torch.zeros(4, 2, 2)
    dv, dz = bench.projection_incoming_grads(dc, (hidden, None, None, w_k))
    assert dv.shape == (4, 3, 2) and dv.is_contiguous() and dz is dv
    assert all(torch.equal(dv[layer], dc) for layer in range(4))
    dv, dz = bench.projection_incoming_grads(dc, (hidden, None, None, torch.zeros(4, 2, 5)))  # K = 5
    assert dz.shape == (4, 3, 5) and dz.is_contiguous()
    assert torch.equal(dz[1], torch.tensor([[0.0, 1, 0, 1, 0], [2, 3, 2, 3, 2], [4, 5, 4, 5, 4]]))


def test_make_provider_names():
    def op(*args, backend="auto", **kw):
        return backend

    for name, backend in (("eager", "torch"), ("fused", "triton"), ("auto", "auto")):
        prov = bench.make_provider(name, op, 3, {})
        assert prov.fn() == backend and prov.compared and prov.wrt_names == bench.INPUT_NAMES
    cublas = bench.make_provider("cublas", op, 3, {})
    assert not cublas.compared and cublas.wrt_names == ("hidden", "w_v", "w_k")
    with pytest.raises(ValueError, match="provider"):
        bench.make_provider("cudnn", op, 3, {})


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
    # host time: measured wherever the call can be repeated alone, never for a rebuilt graph
    assert backward["fused"]["host_ms_p50"] is None
    assert all(r["host_ms_p50"] > 0 for r in rows if r is not backward["fused"])

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


class _DriftingGrad(torch.autograd.Function):
    """Identity whose backward adds a call-counted drift: run-to-run different gradients, as
    atomics in a weight-gradient reduction would give (reseeding the RNG cannot hide it)."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _DriftingGrad.calls += 1
        return g + 1e-3 * _DriftingGrad.calls


def test_cublas_auto_and_determinism_rows():
    def op(*args, backend="auto", **kw):
        return _reference_op(*args, backend="torch", **kw)

    rows, logs = _run(op, ["eager", "fused", "auto", "cublas"])
    assert [(r["provider"], r["mode"]) for r in rows] == [
        (p, m) for p in ("eager", "fused", "auto", "cublas") for m in ("forward", "backward", "full")]
    by = {(r["provider"], r["mode"]): r for r in rows}
    for r in rows:
        assert r["error"] is None, r["error"]
        # every provider is charged the same counted FLOPs
        assert r["flops"] == bench.layer_attention_flops(3, 37, 12, 8, r["mode"])
    for mode in ("forward", "backward", "full"):
        cub = by["cublas", mode]
        # a reference line: not compared with eager, and it says why
        for key in ("max_abs_diff", "max_abs_err_fp64", "grad_max_abs_diff", "grad_max_abs_err_fp64"):
            assert cub[key] is None
        assert "reference line" in cub["check_note"] and "not compared" in cub["check_note"]
        assert cub["min_bytes"] == bench.projection_min_bytes(3, 37, 12, 8, 2, mode)
        assert by["auto", mode]["max_abs_diff"] == 0.0
        assert set(by["auto", mode]["grad_max_abs_diff"]) == set(bench.INPUT_NAMES)
    assert by["cublas", "backward"]["backward_timing"] == "retain_graph"
    # determinism: recorded on fused rows only
    for mode in ("forward", "backward", "full"):
        assert by["fused", mode]["weight_grads_deterministic"] is True
        assert by["fused", mode]["weight_grads_max_abs_diff"] == {n: 0.0 for n in bench.WEIGHT_NAMES}
        for p in ("eager", "auto", "cublas"):
            assert by[p, mode]["weight_grads_deterministic"] is None
    assert any("bitwise equal" in line for line in logs)
    speedups = bench.summarize_speedups(rows)
    assert all(s["weight_grads_deterministic"] is True for s in speedups)
    assert all(s["fused_vs_cublas"] == pytest.approx(s["cublas_ms"] / s["fused_ms"]) for s in speedups)
    det = bench.summarize_determinism(rows)
    assert det["weight_grads_deterministic"] is True and len(det["entries"]) == 1


def test_nondeterministic_weight_grads_are_reported():
    def op(hidden, w_v, *rest, backend="auto", **kw):
        if backend == "triton":
            w_v = _DriftingGrad.apply(w_v)
        return _reference_op(hidden, w_v, *rest, backend="torch", **kw)

    rows, logs = _run(op, ["fused"], modes=["forward"])
    (fused,) = rows
    assert fused["weight_grads_deterministic"] is False
    diffs = fused["weight_grads_max_abs_diff"]
    assert 0.0 < diffs["w_v"] < 0.02  # a 1e-3 drift, rounded in bf16
    assert all(diffs[n] == 0.0 for n in bench.WEIGHT_NAMES if n != "w_v")
    assert any("DIFFER" in line for line in logs)
    det = bench.summarize_determinism(rows)
    assert det["weight_grads_deterministic"] is False
    assert "DIFFER" in bench.format_determinism(det) and "w_v" in bench.format_determinism(det)


def test_a_failing_determinism_check_does_not_stop_the_timing():
    calls = {"n": 0}

    def op(*args, backend="auto", **kw):
        c = _reference_op(*args, backend="torch", **kw)
        if backend == "triton":
            calls["n"] += 1
            if calls["n"] == 2:  # call 1 is check_provider's; call 2 the first determinism run
                raise RuntimeError("out of memory (pretend)")
        return c

    rows, _ = _run(op, ["fused"], modes=["forward"])
    (fused,) = rows
    assert fused["error"] is None and fused["ms_p50"] is not None
    assert fused["weight_grads_deterministic"] is None
    assert "pretend" in fused["determinism_note"]


# ----------------------------------------------------------------------------------------------
# Summaries on synthetic rows
# ----------------------------------------------------------------------------------------------


def _srow(provider, mode, ms, mem=None, *, shape="bert-base", dtype="bf16", n=4096, error=None, ratio=None,
          det=None):
    return {"shape": shape, "dtype": dtype, "N": n, "mode": mode, "provider": provider,
            "ms_p50": None if error else ms, "peak_extra_mem_mb": None if error else mem,
            "ratio_to_matmul_ceiling": ratio, "error": error,
            "weight_grads_deterministic": det if provider == "fused" else None}


def test_summary_ratios_for_fused_and_auto():
    rows = [_srow("eager", "full", 8.0, 900.0), _srow("compile", "full", 4.0, 600.0),
            _srow("compile-max", "full", 2.0, 500.0), _srow("fused", "full", 1.0, 300.0, ratio=0.5, det=True),
            _srow("auto", "full", 8.0, 900.0), _srow("cublas", "full", 0.5, 700.0),
            _srow("eager", "forward", 3.0, 100.0), _srow("fused", "forward", 1.5, 50.0, det=True),
            _srow("compile-max", "forward", None, error="compile failed"),
            _srow("auto", "forward", None, error="boom")]
    full, forward = bench.summarize_speedups(rows)
    assert (full["mode"], forward["mode"]) == ("full", "forward")
    assert full["eager_ms"] == 8.0 and full["compile_max_ms"] == 2.0 and full["cublas_ms"] == 0.5
    assert full["fused_vs_eager"] == 8.0 and full["fused_vs_compile"] == 4.0
    assert full["fused_vs_compile_max"] == 2.0 and full["fused_vs_cublas"] == 0.5
    assert full["fused_mem_over_eager"] == pytest.approx(1 / 3) and full["fused_mem_over_compile"] == 0.5
    assert full["auto_vs_eager"] == 1.0 and full["auto_vs_compile_max"] == 0.25
    assert full["auto_vs_cublas"] == 0.0625 and full["auto_mem_over_eager"] == 1.0
    assert full["fused_ratio_to_matmul_ceiling"] == 0.5 and full["weight_grads_deterministic"] is True
    # not run (compile, cublas) or failed (compile-max, auto): null
    assert forward["fused_vs_eager"] == 2.0 and forward["fused_mem_over_eager"] == 0.5
    for key in ("compile_ms", "compile_max_ms", "auto_ms", "cublas_ms", "fused_vs_compile", "fused_vs_compile_max",
                "fused_vs_cublas", "auto_vs_eager", "auto_vs_compile_max", "auto_mem_over_eager"):
        assert forward[key] is None, key
    text = bench.format_speedups([full, forward])
    assert "f/c-max" in text and "a/eager" in text


def _headline_rows(fwd_fused, full_fused, *, full_mem=(900.0, 300.0)):
    return [_srow("eager", "forward", 0.9, 100.0), _srow("compile-max", "forward", 0.33, 100.0),
            _srow("fused", "forward", fwd_fused, 20.0),
            _srow("eager", "full", 1.68, full_mem[0]), _srow("compile-max", "full", 1.05, 600.0),
            _srow("fused", "full", full_fused, full_mem[1])]


def test_headline_targets():
    # forward: 0.2 ms, 4.5x eager, 1.65x compile-max: all on the edge; full: 0.6 ms, 2.8x eager,
    # 1.75x compile-max, memory exactly 1/3 of eager's
    targets = bench.evaluate_targets(bench.summarize_speedups(_headline_rows(0.2, 0.6)), "NVIDIA H100 80GB HBM3")
    assert targets["on_target_device"] is True
    headline = {(c["mode"], c["metric"]): c for c in targets["checks"] if c["kind"] == "headline"}
    assert set(headline) == {
        ("forward", "fused_ms"), ("forward", "fused_vs_eager"), ("forward", "fused_vs_compile_max"),
        ("full", "fused_ms"), ("full", "fused_vs_eager"), ("full", "fused_vs_compile_max"),
        ("full", "fused_mem_over_eager")}
    assert all(c["passed"] is True and c["headline"] for c in headline.values()), headline
    assert headline["forward", "fused_ms"]["target"] == "<= 0.2"
    assert headline["full", "fused_vs_compile_max"]["value"] == pytest.approx(1.75)
    assert targets["headline_passed"] is True
    # a bit slower and a bit more memory: the ms, speedup and memory checks fail
    targets = bench.evaluate_targets(
        bench.summarize_speedups(_headline_rows(0.21, 0.61, full_mem=(900.0, 301.0))), "NVIDIA H200")
    assert targets["on_target_device"] is False and targets["headline_passed"] is False
    failed = {(c["mode"], c["metric"]) for c in targets["checks"] if c["kind"] == "headline" and c["passed"] is False}
    assert failed == {("forward", "fused_ms"), ("forward", "fused_vs_compile_max"), ("full", "fused_ms"),
                      ("full", "fused_vs_eager"), ("full", "fused_vs_compile_max"), ("full", "fused_mem_over_eager")}
    assert "FAIL" in bench.format_speedups(bench.summarize_speedups(_headline_rows(0.21, 0.61)), targets)


def test_headline_targets_not_measured_are_na():
    rows = [_srow("eager", "forward", 2.0, shape="minilm"), _srow("fused", "forward", 1.0, shape="minilm")]
    targets = bench.evaluate_targets(bench.summarize_speedups(rows), "NVIDIA H100 80GB HBM3")
    headline = [c for c in targets["checks"] if c["kind"] == "headline"]
    assert len(headline) == 7 and all(c["passed"] is None and c["value"] is None for c in headline)
    assert targets["headline_passed"] is None
    assert "n/a" in bench.format_speedups(bench.summarize_speedups(rows), targets)


def test_sweep_targets_at_every_measured_n():
    rows = []
    for shape in ("bert-base", "minilm"):
        for dtype in ("bf16", "fp16"):
            for n in (512, 1024, 16384, 32768):
                for mode in ("forward", "full", "backward"):
                    fused = 1.2 if (shape, dtype, n, mode) == ("minilm", "fp16", 16384, "full") else 0.5
                    rows += [_srow("eager", mode, 1.0, shape=shape, dtype=dtype, n=n),
                             _srow("fused", mode, fused, shape=shape, dtype=dtype, n=n)]
                    if (shape, n) != ("bert-base", 1024):
                        rows.append(_srow("compile-max", mode, 0.8, shape=shape, dtype=dtype, n=n))
    targets = bench.evaluate_targets(bench.summarize_speedups(rows), "NVIDIA H100 80GB HBM3")
    sweep = [c for c in targets["checks"] if c["kind"] == "sweep"]
    # N in [1024, 16384] only; modes forward and full; two metrics
    assert {c["N"] for c in sweep} == {1024, 16384} and {c["mode"] for c in sweep} == {"forward", "full"}
    assert len(sweep) == 2 * 2 * 2 * 2 * 2
    assert all(c["target"] == "> 1" and not c["headline"] for c in sweep)
    verdicts = {(c["shape"], c["dtype"], c["N"], c["mode"], c["metric"]): c["passed"] for c in sweep}
    assert verdicts["minilm", "fp16", 16384, "full", "fused_vs_eager"] is False  # 1.0 / 1.2
    assert verdicts["minilm", "fp16", 16384, "full", "fused_vs_compile_max"] is False
    assert verdicts["bert-base", "bf16", 1024, "forward", "fused_vs_compile_max"] is None  # compile-max not run
    assert verdicts["bert-base", "fp16", 16384, "forward", "fused_vs_compile_max"] is True  # 0.8 / 0.5
    assert sum(v is True for v in verdicts.values()) == 32 - 2 - 4
    assert targets["sweep_passed"] is False and targets["sweep_complete"] is False


def test_sweep_complete_and_passed():
    rows = []
    for shape in ("bert-base", "minilm"):
        for dtype in ("bf16", "fp16"):
            for n in bench.N_SWEEP:
                for mode in ("forward", "full"):
                    rows += [_srow(p, mode, ms, shape=shape, dtype=dtype, n=n)
                             for p, ms in (("eager", 1.0), ("compile-max", 0.7), ("fused", 0.6))]
    targets = bench.evaluate_targets(bench.summarize_speedups(rows), "NVIDIA H100 80GB HBM3")
    assert targets["sweep_complete"] is True and targets["sweep_passed"] is True
    assert targets["headline_passed"] is False  # 0.6 ms forward > 0.20, 1.67x eager < 3
    # a ratio of exactly 1 is not faster
    rows = [_srow("eager", "forward", 1.0, n=2048), _srow("compile-max", "forward", 1.0, n=2048),
            _srow("fused", "forward", 1.0, n=2048)]
    sweep = [c for c in bench.evaluate_targets(bench.summarize_speedups(rows), "x")["checks"] if c["kind"] == "sweep"]
    assert [c["passed"] for c in sweep] == [False, False, None, None]  # forward; full not measured


def test_auto_evidence_reads_the_inference_and_full_rows_against_the_shipped_rule():
    work = {n: 12 * n * 768 * (768 + 768) for n in (1024, 4096, 16384)}  # BERT-base's L N H (H + K)
    assert [bench.auto_work(bench.SHAPES["bert-base"], n) for n in work] == list(work.values())
    assert work[1024] < 1 << 34 <= work[4096] and work[4096] < 1 << 37 <= work[16384]
    rows = []
    for n in (1024, 4096):
        rows += [_srow("eager", "inference", 1.0, n=n), _srow("fused", "inference", 2.0 if n == 1024 else 0.5, n=n),
                 _srow("auto", "inference", 0.9, n=n), _srow("compile", "inference", 0.1, n=n),
                 # the forward and backward rows (with autograd) are not auto's evidence
                 _srow("eager", "forward", 1.0, n=n), _srow("fused", "forward", 9.0, n=n),
                 _srow("eager", "backward", 1.0, n=n), _srow("fused", "backward", 9.0, n=n),
                 _srow("eager", "full", 2.0, n=n), _srow("fused", "full", 1.0, n=n)]
    rows += [_srow("eager", "full", 4.0, dtype="fp16", n=16384), _srow("fused", "full", 2.0, dtype="fp16", n=16384)]
    ev = bench.auto_evidence(rows, "NVIDIA H100 80GB HBM3")
    assert ev["device"] == "NVIDIA H100 80GB HBM3"
    assert ev["rule"] == {"forward": "triton", "backward": "triton", "min_fused_work": 1 << 34,
                          "min_fused_backward_work": 1 << 37}
    entries = {(e["decision"], e["dtype"], e["N"]): e for e in ev["entries"]}
    assert set(entries) == {("inference", "bf16", 1024), ("inference", "bf16", 4096), ("training", "bf16", 1024),
                            ("training", "bf16", 4096), ("training", "fp16", 16384)}
    small, large = entries["inference", "bf16", 1024], entries["inference", "bf16", 4096]
    assert (small["winner"], small["ratio"], small["auto_picks"], small["auto_right"]) == ("eager", 2.0, "eager", True)
    assert (large["winner"], large["ratio"], large["auto_picks"], large["auto_right"]) == ("fused", 2.0, "fused", True)
    assert large["mode"] == "inference" and large["work"] == work[4096] and large["auto_ms"] == 0.9
    # training at BERT-base N = 4096: fused won, the rule runs eager there (below 2^37): wrong
    t = entries["training", "bf16", 4096]
    assert (t["mode"], t["winner"], t["fused_vs_eager"], t["auto_picks"], t["auto_right"]) == (
        "full", "fused", 2.0, "eager", False)
    assert entries["training", "fp16", 16384]["auto_picks"] == "fused"
    assert entries["training", "fp16", 16384]["auto_right"] is True
    th = ev["thresholds"]
    assert th["inference"]["bf16"] == {"entries": 2, "decided": 2, "fused_wins": 1, "eager_up_to_work": work[1024],
                                       "fused_from_work": work[4096], "separable": True,
                                       "rule_min_work": 1 << 34, "rule_right": True}
    assert th["training"]["bf16"]["fused_from_work"] == work[1024] and th["training"]["bf16"]["eager_up_to_work"] is None
    assert th["training"]["bf16"]["rule_right"] is False and th["training"]["bf16"]["rule_min_work"] == 1 << 37
    assert th["training"]["fp16"]["rule_right"] is True
    assert ev["rule_right"] is False
    text = bench.format_auto_evidence(ev)
    assert "training bf16: fused won from work 1.45e+10" in text and "rule's threshold 1.37e+11: FAIL" in text
    assert "inference bf16: fused won from work 5.8e+10, eager up to 1.45e+10" in text
    assert "everywhere measured: FAIL" in text

    # a failed fused measurement, a tie, and winners that interleave along the work axis
    rows = [_srow("eager", "inference", 1.0), _srow("fused", "inference", 1.0),
            _srow("eager", "inference", 1.0, n=8192), _srow("fused", "inference", None, n=8192, error="oom"),
            _srow("eager", "inference", 1.0, n=1024), _srow("fused", "inference", 0.5, n=1024)]
    ev = bench.auto_evidence(rows, "gpu")
    by_n = {e["N"]: e for e in ev["entries"]}
    assert by_n[4096]["winner"] == "tie" and by_n[4096]["auto_right"] is True
    assert by_n[8192]["winner"] is None and "fused not measured" in by_n[8192]["note"]
    assert by_n[8192]["ratio"] is None and by_n[8192]["auto_right"] is None
    assert by_n[1024]["auto_picks"] == "eager" and by_n[1024]["auto_right"] is False
    t = ev["thresholds"]["inference"]["bf16"]
    assert t["separable"] is False and (t["decided"], t["fused_wins"]) == (2, 1)
    assert "NOT separable" in bench.format_auto_evidence(ev)
    # fused measured alone: no evidence either way
    ev = bench.auto_evidence([_srow("fused", "full", 1.0)], "gpu")
    assert ev["entries"][0]["winner"] is None and ev["rule_right"] is None
    assert ev["thresholds"]["training"]["bf16"]["separable"] is False
    assert "training bf16: nothing decided" in bench.format_auto_evidence(ev)


def test_auto_evidence_from_result_files(tmp_path, capsys):
    """--evidence-from: no GPU needed; a run's partial file names N "n"; a file that is not a
    result is skipped with a message, and exit 2 if no file was one."""
    rows = [_srow("eager", "inference", 1.0), _srow("fused", "inference", 0.5),
            {**_srow("eager", "full", 1.0), "n": 4096}, _srow("fused", "full", 2.0)]
    del rows[2]["N"]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"header": {"device": "NVIDIA H100 80GB HBM3", "commit": "abc1234"}, "rows": rows}))
    assert bench.main(["--evidence-from", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"== {path} (commit abc1234, schema 1; timing: not recorded)" in out
    assert "within the timer's bias" in out  # (not timed by CudaTimer)
    assert "inference bf16: fused won from work 5.8e+10 (1 of 1 decided)" in out
    assert "training bf16: fused never won (0 of 1 decided)" in out and "everywhere measured: PASS" in out
    timed = tmp_path / "timed.json"
    timed.write_text(json.dumps({"header": {"device": "gpu", "timing": "CudaTimer: ..."}, "rows": rows}))
    assert bench.main(["--evidence-from", str(timed)]) == 0
    assert "timer's bias" not in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"header": {"device": "x"}, "rows": [{"mode": "full"}]}))
    assert bench.main(["--evidence-from", str(bad), str(path)]) == 0
    captured = capsys.readouterr()
    assert f"{bad}: skipped, not a layer-attention result file (KeyError" in captured.err
    assert "everywhere measured: PASS" in captured.out
    assert bench.main(["--evidence-from", str(bad)]) == 2


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
                       "auto", "cublas", "--out", str(tmp_path)]) == 0
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.startswith("layer_attention_nvidia-h100-80gb-hbm3_")
    data = json.loads(files[0].read_text())
    header = data["header"]
    for key in ("device", "torch", "triton", "cuda", "commit", "timestamp", "matmul_ceiling_bf16_tflops",
                "flop_convention"):
        assert key in header
    assert header["commit"] == "0123abc" and header["matmul_ceiling_bf16_tflops"] == 800.0
    assert data["schema_version"] == 3
    assert len(data["rows"]) == 4 * 4
    for r in data["rows"]:
        for key in ("device", "torch", "triton", "cuda", "commit", "shape", "dtype", "provider", "mode",
                    "ms_p50", "ms_p20", "ms_p80", "tflops", "ratio_to_matmul_ceiling", "peak_extra_mem_mb",
                    "max_abs_diff", "weight_grads_deterministic", "error"):
            assert key in r
        assert r["error"] is None and r["peak_extra_mem_mb"] == 3.0
        assert r["ratio_to_matmul_ceiling"] == pytest.approx(r["tflops"] / 800.0)
    assert {(s["mode"], s["N"]) for s in data["speedups"]} == {("forward", 8), ("backward", 8), ("full", 8),
                                                               ("inference", 8)}
    assert all(s["weight_grads_deterministic"] is True for s in data["speedups"])
    assert data["determinism"]["weight_grads_deterministic"] is True
    # N = 8 is outside the sweep's range and not the headline: every check n/a, none dropped
    assert data["targets"]["headline_passed"] is None and data["targets"]["sweep_passed"] is None
    assert len(data["targets"]["checks"]) == len(bench.HEADLINE_TARGETS)
    evidence = data["auto_evidence"]
    assert {(e["decision"], e["mode"], e["N"]) for e in evidence["entries"]} == {("inference", "inference", 8),
                                                                                ("training", "full", 8)}
    assert all(e["auto_picks"] == "eager" for e in evidence["entries"])  # N = 8 is far below the thresholds
    out = capsys.readouterr().out
    assert "wrote" in out and "auto's evidence on NVIDIA H100 80GB HBM3" in out and "the shipped rule picked" in out
    assert "fused weight gradients over two identical runs: bitwise equal" in out
