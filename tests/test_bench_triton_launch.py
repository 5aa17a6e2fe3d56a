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
    assert set(result["rows"]) == {"jit", "fixed", "autotuner", "picks", "torch.empty",
                                   "fused_forward_backward", "eager_forward_backward",
                                   "fused_forward", "eager_forward"}
    assert all(v > 0 for v in result["rows"].values())
    assert "mocked" in result["header"]["device"] and result["header"]["commit"]
