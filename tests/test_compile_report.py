"""The compile gate: every config the kernels can launch compiles for sm_90 without spills and
with wgmma dots (``bench/compile_report.py``; no GPU needed, Triton compiles on the CPU).

The report runs in a subprocess: this test session imports Triton in interpreter mode
(TRITON_INTERPRET=1), where kernels cannot be compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "compile_report.py"


def _triton_nvidia_tools() -> bool:
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return False
    return (Path(nvidia.__file__).parent / "bin" / "cuobjdump").exists()


needs_tools = pytest.mark.skipif(not _triton_nvidia_tools(),
                                 reason="Triton's NVIDIA backend (ptxas, cuobjdump) is not installed")


def report(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(SCRIPT), "--no-json", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=1200)


@needs_tools
def test_every_launchable_config_compiles_for_sm90_without_spills_and_with_wgmma():
    res = report()
    assert res.returncode == 0, f"compile gate failed:\n{res.stdout[-6000:]}\n{res.stderr[-3000:]}"
    lines = [line.split() for line in res.stdout.splitlines() if line.startswith(("fwd_", "bwd_"))]
    kernels = {row[0] for row in lines}
    assert kernels == {"fwd_scores", "fwd_values", "bwd_values", "bwd_keys"}
    # a MiniLM config that compiles to the same binary as a BERT-base one is listed once
    assert "bert-base" in {row[1] for row in lines} <= {"bert-base", "minilm"}
    assert {row[2] for row in lines} == {"on", "off"}
    assert all(row[-1] == "ok" for row in lines)
    assert "0 failed the gate" in res.stdout
    minilm = report("--shapes", "minilm", "--dropout", "off")  # Triton's cache: seconds
    rows = [line.split() for line in minilm.stdout.splitlines() if line.startswith(("fwd_", "bwd_"))]
    assert minilm.returncode == 0 and rows and all(r[1] == "minilm" and r[-1] == "ok" for r in rows)


@needs_tools
def test_the_gate_fails_on_a_config_the_keep_rule_rejects():
    """bwd_keys at 64 x 256 on 4 warps spills: compiled anyway, the gate reports it and exits 1."""
    res = report("--candidates", "--kernels", "bwd_keys", "--shapes", "minilm", "--dropout", "off")
    assert res.returncode == 1, res.stdout[-3000:]
    failed = [line.split() for line in res.stdout.splitlines() if "FAIL: spills" in line]
    assert any(row[3] == "N=64,K=256,I=64" and row[4] == "4" for row in failed), res.stdout[-3000:]
