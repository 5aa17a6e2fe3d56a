"""bench/triton_launch_host_cpu.py: the Python cost of a fused-kernel launch with the CUDA driver
mocked, run as users run it (a subprocess: the mock replaces Triton's driver process-wide)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench_scripts import BENCH


def test_launch_cost_script_times_the_launch_paths_and_the_op(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "launch.json"
    subprocess.run([sys.executable, str(BENCH / "triton_launch_host_cpu.py"), "--out", str(out)],
                   check=True, env=env, timeout=300, capture_output=True)
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {"fixed", "autotuner", "picks", "torch.empty",
                                   "fused_forward_backward", "eager_forward_backward"}
    assert all(v > 0 for v in result["rows"].values())
    assert "mocked" in result["header"]["device"] and result["header"]["commit"]


_SAME_LAUNCHES = r'''
import os, sys
sys.path.insert(0, sys.argv[1])
from triton_launch_host_cpu import _mock_driver
_mock_driver()
import torch
from triton.compiler.compiler import CompiledKernel
import mhmla_fast.kernels.layer_attention as K

launches = []


def record(kernel):
    def run(g0, g1, g2, stream, function, packed, metadata, enter, exit_, *args):
        launches.append((id(kernel), (g0, g1, g2), tuple(
            (tuple(a.shape), a.dtype, a.stride()) if isinstance(a, torch.Tensor) else a
            for a in args)))
    return run


CompiledKernel.run = property(record)
K._check_launchable = lambda t: None
L, N, H, Kd, J = 3, 40, 64, 48, 4
g = torch.Generator().manual_seed(0)
ts = [torch.randn(s, generator=g).half() for s in
      [(L, N, H), (L, H, H), (L, H), (L, H, Kd), (L, Kd), (L, Kd, J), (L, J)]]
dc = torch.randn(N, H, generator=g).half()


def step():
    c, p = K.layer_attention_fwd(*ts, J, (0.1, 0.1, 0.1), 5)
    K.layer_attention_bwd(dc, None, *ts, p, J, (0.1, 0.1, 0.1), 5)


step()
through_autotuner = list(launches)
launches.clear()
step()
assert len(K._PICKS) == 4, K._PICKS
assert launches == through_autotuner, (launches, through_autotuner)
print("same", len(launches))
'''


def test_picks_launch_what_the_autotuner_launched():
    """With the CUDA driver mocked and the launcher recording its calls, a fused forward +
    backward whose autotuned kernels go through the autotuner (first call of each key) and
    one that reuses its picks (second call) launch the same compiled kernels with the same
    grids and arguments (tensors compared by shape, dtype and strides)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "MHMLA_TRITON_CONFIGS")}
    res = subprocess.run([sys.executable, "-c", _SAME_LAUNCHES, str(BENCH)], env=env,
                         timeout=600, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["same", "8"]
