"""The compile gate: every config the kernels can launch compiles for sm_90 without spills and
with wgmma dots (``bench/compile_report.py``; no GPU needed, Triton compiles on the CPU).

The report runs in a subprocess: this test session imports Triton in interpreter mode
(TRITON_INTERPRET=1), where kernels cannot be compiled.
"""

from __future__ import annotations

import json
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


COMMITTED = REPO / "bench" / "results" / "compile_report_sm90.json"
KERNELS = ("fwd_scores", "fwd_values", "bwd_values", "bwd_keys", "bwd_softmax", "dropout_layers",
           "dropout_masks")
# what a row's compile gives, and what identifies the row
MEASURED = ("registers", "spill_bytes", "shared_bytes", "dots", "wgmma_dots", "passed")


def report(*args: str, json_out: Path | None = None) -> subprocess.CompletedProcess:
    # (MHMLA_TRITON_CONFIGS narrows the configs a launch can use: the script removes it too)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MHMLA_TRITON_CONFIGS")}
    out = ["--json", str(json_out)] if json_out else ["--no-json"]
    return subprocess.run([sys.executable, str(SCRIPT), *out, *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=1800)


def _row_key(r: dict) -> tuple:
    return (r["kernel"], r["shape"], r["dtype"], r["dropout"], r["n_aligned"],
            tuple(sorted(r["tiles"].items())), r["num_warps"], r["num_stages"])


@needs_tools
def test_every_launchable_config_compiles_for_sm90_without_spills_and_with_wgmma(tmp_path):
    """Every kernel, bf16 and fp16, dropout off and on, N unaligned and as at N = 4096: no
    spill, every dot a wgmma; and the committed report is this code's (a kernel change without
    a new report fails here)."""
    res = report(json_out=tmp_path / "report.json")
    assert res.returncode == 0, f"compile gate failed:\n{res.stdout[-6000:]}\n{res.stderr[-3000:]}"
    lines = [line.split() for line in res.stdout.splitlines() if line.startswith(KERNELS)]
    assert {row[0] for row in lines} == set(KERNELS)
    # a MiniLM config that compiles to the same binary as a BERT-base one is listed once
    assert "bert-base" in {row[1] for row in lines} <= {"bert-base", "minilm"}
    assert {row[2] for row in lines} == {"bf16", "fp16"} and {row[3] for row in lines} == {"on", "off"}
    assert {row[4] for row in lines} == {"no", "yes"}  # N unaligned (an odd N) and as at N = 4096
    assert all(row[-1] == "ok" for row in lines)
    assert "0 failed the gate" in res.stdout
    fresh_report, committed_report = (json.loads(f.read_text()) for f in (tmp_path / "report.json", COMMITTED))
    # register counts are ptxas's: another Triton (with its own ptxas) compiles other code
    assert fresh_report["header"]["triton"] == committed_report["header"]["triton"], (
        "the committed report was made with another Triton: run python bench/compile_report.py")
    fresh, committed = fresh_report["rows"], committed_report["rows"]
    assert {_row_key(r) for r in fresh} == {_row_key(r) for r in committed}, (
        "bench/results/compile_report_sm90.json is not this code's: run python bench/compile_report.py")
    stale = [(k, {m: (a[m], b[m]) for m in MEASURED if a[m] != b[m]})
             for k, a, b in ((_row_key(r), r, {_row_key(c): c for c in committed}[_row_key(r)]) for r in fresh)
             if any(a[m] != b[m] for m in MEASURED)]
    assert not stale, f"the committed report differs (run python bench/compile_report.py): {stale[:5]}"
    minilm = report("--shapes", "minilm", "--dropout", "off", "--dtypes", "bf16",
                    "--n-aligned", "no")  # Triton's cache: seconds
    rows = [line.split() for line in minilm.stdout.splitlines() if line.startswith(KERNELS)]
    assert minilm.returncode == 0 and rows and all(r[1] == "minilm" and r[-1] == "ok" for r in rows)


@needs_tools
def test_the_gate_fails_on_a_config_the_keep_rule_rejects():
    """bwd_keys at 64 x 256 on 4 warps spills: compiled anyway, the gate reports it and exits 1."""
    res = report("--candidates", "--kernels", "bwd_keys", "--shapes", "minilm", "--dropout", "off",
                 "--dtypes", "bf16")
    assert res.returncode == 1, res.stdout[-3000:]
    failed = [line.split() for line in res.stdout.splitlines() if "FAIL: spills" in line]
    assert any(row[5] == "N=64,K=256,I=64" and row[6] == "4" for row in failed), res.stdout[-3000:]


def test_fp16_with_layer_weight_dropout_leaves_out_the_configs_that_spill(monkeypatch):
    """The keep rule knows the dtype and the layer-weight dropout: in fp16 with DROP_P,
    bwd_values 128 x 128 on 8 warps and fwd_values' flat 128 x 128 on 8 warps with 4 stages
    spilled (24 and 8 bytes) and are left out; bf16 keeps them, and without dropout fp16 keeps
    what bf16 does. At a launch the dtype comes from the input tensor and DROP_P from the
    keyword arguments."""
    import torch

    import mhmla_fast.kernels.layer_attention as K

    monkeypatch.setattr(K, "_interpreting", lambda: False)  # (the interpreter: the fixed one)
    monkeypatch.delenv("MHMLA_TRITON_CONFIGS", raising=False)

    def big(configs):
        return {s for t, w, s in configs if w == 8 and t["BLOCK_N"] == t["BLOCK_O"] == 128
                and not t["ROWSCALE"]}

    for name, spilled in (("bwd_values", {3, 4}), ("fwd_values", {4})):
        bf16 = K.layer_attention_configs(name, 768, 12, dropout_p=True)
        fp16 = K.layer_attention_configs(name, 768, 12, dropout_p=True, fp16=True)
        assert big(bf16) >= spilled and not big(fp16) & spilled, name
        assert K.layer_attention_configs(name, 768, 12, fp16=True) == K.layer_attention_configs(name, 768, 12)
        named = {"H_ptr": torch.empty(1, dtype=torch.float16), "H": 768, "J": 12}
        assert K._kept(name, named, {"DROP_P": True}) == fp16
        assert K._kept(name, {**named, "H_ptr": torch.empty(1, dtype=torch.bfloat16)}, {"DROP_P": True}) == bf16
