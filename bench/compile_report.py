"""Compile report of the layer-attention kernels for an H100 (sm_90), on a machine without a GPU.

    python bench/compile_report.py                      # table + bench/results/compile_report_sm90.json
    python bench/compile_report.py --json OUT.json --shapes bert-base --dropout off

For every kernel of ``mhmla_fast.kernels.layer_attention`` and every config it can launch (the
autotuning candidates its ``keep`` rule admits, the fixed config of ``MHMLA_TRITON_CONFIGS=fixed``
and the autotuner's fallback; the softmax backward and the dropout kernels with their one
launch config), at BERT-base (L = 12, H = K = 768, J = 12) and MiniLM (L = 6, H = K = 384,
J = 12) shape, in bf16 and fp16 (the 16-bit dtypes the fused op takes on a GPU; fp16 since
2026-12-07, when three configs the rule then admitted spilled in fp16 with dropout), with
dropout off and on (training launches the dropout variants), this compiles the kernel with
``triton.compile`` (twice: with the sizes that follow from N unaligned, as at an odd N, and
aligned, as at N = 4096, since Triton's JIT compiles other code for each) for
``GPUTarget("cuda", 90, 32)``, with the argument alignment Triton's JIT would give a launch at
that shape (16-byte aligned pointers and 16-divisible sizes, so loads are vectorised and
pipelined as on the GPU; without it every load compiles scalar and unpipelined), and records:

    registers     per thread (cuobjdump --dump-resource-usage of the cubin)
    spill_bytes   the local-memory stack frame (STACK); > 0 means registers spilled
    shared_bytes  shared memory per block (Triton's metadata)
    dots          tl.dot sites in the kernel (TTGIR ``tt.dot`` plus ``ttng.warp_group_dot``)
    wgmma_dots    of those, lowered to Hopper's asynchronous warp-group MMA
    wgmma_ptx     ``wgmma.mma_async`` instructions in the PTX

A config fails the gate when it spills, when one of its dots is not a wgmma (an ``mma.sync``
or FMA dot is several times slower on Hopper), or when a GEMM kernel has no dot at all. The
exit status is 1 when any config fails, so ``tests/test_compile_report.py`` runs it as CI's
compile gate, and compares the rows with the committed ``bench/results/compile_report_sm90.json``
(regenerate it with this script after a kernel change). ``MHMLA_TRITON_CONFIGS`` is removed
from the environment too: it narrows the configs a launch can use.

Triton must not be in interpreter mode: this script removes ``TRITON_INTERPRET`` from its own
environment before importing Triton (under the interpreter ``@triton.jit`` functions cannot be
compiled), so it can be started from a test session that has it set. Compiles run in a pool of
processes and land in Triton's on-disk cache, so a second run takes seconds (a first, cold one
a few minutes on 2 cores: CI's).
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before Triton is imported: compile, do not interpret
os.environ.pop("MHMLA_TRITON_CONFIGS", None)  # every config a launch can use, not a choice of them

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = REPO_ROOT / "bench" / "results" / "compile_report_sm90.json"
SHAPES = {
    "bert-base": dict(L=12, H=768, K=768, J=12),
    "minilm": dict(L=6, H=384, K=384, J=12),
}
ARCH = 90
DTYPES = ("bf16", "fp16")
# the GEMM kernels: each must have dots, all of them wgmma
GEMM_KERNELS = ("fwd_scores", "fwd_values", "bwd_values", "bwd_keys")


def _kernels_module():
    try:
        import mhmla_fast.kernels.layer_attention as kernels
    except ImportError:
        sys.path.insert(0, str(REPO_ROOT))
        import mhmla_fast.kernels.layer_attention as kernels
    return kernels


def _cuobjdump() -> str:
    import triton.backends.nvidia as nvidia

    path = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    if not path.exists():
        raise FileNotFoundError(f"cuobjdump not found at {path} (it ships with Triton's NVIDIA backend)")
    return str(path)


def _case_key(case: dict) -> tuple:
    consts = tuple(sorted((k, str(v)) for k, v in case["constexprs"].items()))
    signature = tuple(sorted(case["signature"].items()))
    return (case["kernel"], consts, signature, tuple(case["aligned"]), case["num_warps"],
            case["num_stages"])


def _torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def compile_case(job: tuple[str, dict, str, bool, bool, bool, int]) -> dict:
    """Compile case ``index`` of ``layer_attention_compile_cases(dtype, shape, dropout,
    candidates, n_aligned)`` for sm_90."""
    shape_name, shape, dtype, dropout, candidates, n_aligned, index = job
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernels = _kernels_module()
    case = kernels.layer_attention_compile_cases(_torch_dtype(dtype), dropout=dropout,
                                                 candidates=candidates, n_aligned=n_aligned,
                                                 **shape)[index]
    fn = case["fn"]
    tiles = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in case["tiles"].items()}
    row = {"kernel": case["kernel"], "shape": shape_name, "dtype": dtype, "dropout": dropout,
           "n_aligned": n_aligned,
           "tiles": tiles, "num_warps": case["num_warps"], "num_stages": case["num_stages"]}
    try:
        src = ASTSource(fn=fn, signature=case["signature"],
                        constexprs={(fn.arg_names.index(k),): v for k, v in case["constexprs"].items()},
                        attrs={(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in case["aligned"]})
        compiled = triton.compile(src, target=GPUTarget("cuda", ARCH, 32),
                                  options=dict(num_warps=case["num_warps"], num_stages=case["num_stages"]))
    except Exception as e:  # noqa: BLE001 - a config that does not compile is a finding
        return {**row, "error": f"{type(e).__name__}: {str(e)[:300]}", "passed": False}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
        cubin = f.name
    try:
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", cubin], capture_output=True,
                               text=True, check=True).stdout
    finally:
        os.unlink(cubin)

    def field(name: str) -> int | None:
        m = re.search(rf"{name}:(\d+)", usage)
        return int(m.group(1)) if m else None

    ttgir = compiled.asm["ttgir"]
    plain = len(re.findall(r"= tt\.dot ", ttgir))
    wgmma = len(re.findall(r"= ttng\.warp_group_dot ", ttgir))
    row.update(registers=field("REG"), spill_bytes=field("STACK"), shared_bytes=compiled.metadata.shared,
               dots=plain + wgmma, wgmma_dots=wgmma, wgmma_ptx=compiled.asm["ptx"].count("wgmma.mma_async"),
               error=None)
    reasons = []
    if row["spill_bytes"] is None or row["spill_bytes"] > 0:
        reasons.append(f"spills {row['spill_bytes']} bytes")
    if plain:
        reasons.append(f"{plain} of {plain + wgmma} dots are not wgmma")
    if case["kernel"] in GEMM_KERNELS and not plain + wgmma:
        reasons.append("no dot in a GEMM kernel")
    row["passed"] = not reasons
    row["failure"] = "; ".join(reasons) or None
    return row


def run_report(shapes: list[str], dropouts: list[bool], workers: int | None = None,
               candidates: bool = False, only: list[str] | None = None,
               dtypes: tuple[str, ...] = DTYPES, n_aligned: tuple[bool, ...] = (False, True)
               ) -> list[dict]:
    """Compile every distinct (kernel, config) of the given dtypes, shapes, dropout settings
    and N alignments (``candidates``: every autotuning candidate, not only the kept ones;
    ``only``: these kernels)."""
    kernels = _kernels_module()
    jobs, seen = [], set()
    for aligned in n_aligned:
        for dtype in dtypes:
            for name in shapes:
                for dropout in dropouts:
                    for i, case in enumerate(kernels.layer_attention_compile_cases(
                            _torch_dtype(dtype), dropout=dropout, candidates=candidates,
                            n_aligned=aligned, **SHAPES[name])):
                        key = _case_key(case)
                        if only and case["kernel"] not in only:
                            continue
                        if key not in seen:  # the same constexprs, types, alignment: one binary
                            seen.add(key)
                            jobs.append((name, SHAPES[name], dtype, dropout, candidates, aligned, i))
    with ProcessPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(compile_case, jobs))


def format_rows(rows: list[dict]) -> str:
    head = (f"{'kernel':14s} {'shape':9s} {'dtype':5s} {'drop':4s} {'N%16':4s} {'tiles':34s} {'w':>2s} {'s':>2s} {'regs':>4s} "
            f"{'spill':>5s} {'smem KB':>7s} {'dots':>4s} {'wgmma':>5s}  verdict")
    lines = [head, "-" * len(head)]
    for r in rows:
        tiles = ",".join(f"{k.removeprefix('BLOCK_')}={v}" for k, v in r["tiles"].items())
        verdict = "ok" if r["passed"] else f"FAIL: {r.get('failure') or r.get('error')}"
        lines.append(
            f"{r['kernel']:14s} {r['shape']:9s} {r['dtype']:5s} {'on' if r['dropout'] else 'off':4s} "
            f"{'yes' if r['n_aligned'] else 'no':4s} {tiles:34s} "
            f"{r['num_warps']:2d} {r['num_stages']:2d} {r.get('registers') or '-':>4} "
            f"{r.get('spill_bytes') if r.get('spill_bytes') is not None else '-':>5} "
            f"{(r.get('shared_bytes') or 0) / 1024:7.1f} {r.get('dots', '-'):>4} {r.get('wgmma_dots', '-'):>5}  {verdict}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="compile_report.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    p.add_argument("--dropout", choices=("off", "on", "both"), default="both")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--n-aligned", choices=("no", "yes", "both"), default="both",
                   help="the sizes that follow from N as at an odd N (no), at N = 4096 (yes), or both")
    p.add_argument("--json", default=str(DEFAULT_JSON), help="where to write the rows (default: %(default)s)")
    p.add_argument("--no-json", action="store_true", help="print only")
    p.add_argument("--workers", type=int, default=None, help="compile processes (default: CPU count)")
    p.add_argument("--kernels", nargs="+", default=None,
                   help="only these kernels (fwd_scores fwd_values bwd_values bwd_keys bwd_softmax "
                        "dropout_layers dropout_masks)")
    p.add_argument("--candidates", action="store_true",
                   help="every autotuning candidate, also those the keep rule rejects (to calibrate it)")
    args = p.parse_args(argv)
    dropouts = {"off": [False], "on": [True], "both": [False, True]}[args.dropout]

    import torch
    import triton

    rows = run_report(args.shapes, dropouts, args.workers, args.candidates, args.kernels,
                      tuple(args.dtypes),
                      {"no": (False,), "yes": (True,), "both": (False, True)}[args.n_aligned])
    print(format_rows(rows))
    failed = [r for r in rows if not r["passed"]]
    print(f"\n{len(rows)} configs compiled for sm_{ARCH}; {len(failed)} failed the gate (spill or non-wgmma dot)")
    if not args.no_json:
        from mhmla_fast.provenance import git_commit  # noqa: PLC0415

        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        header = {"target": f"cuda sm_{ARCH} (H100), compiled on a CPU", "dtypes": args.dtypes,
                  "configs": "every autotuning candidate" if args.candidates else "the kept configs",
                  "torch": torch.__version__, "triton": triton.__version__, "commit": git_commit(),
                  "date": datetime.date.today().isoformat(), "shapes": {s: SHAPES[s] for s in args.shapes},
                  "specialisation": "as Triton's JIT specialises a launch at these shapes: every "
                                    "pointer 16-byte aligned, H, K, D = H / J, J, L and the slot "
                                    "stride divisible by 16 where they are; N and what follows "
                                    "from it (T, l0, element counts, N_BUCKET) not (n_aligned "
                                    "false: an odd N) or as at N = 4096 (n_aligned true)",
                  "gate": "fails on any spill_bytes > 0, any dot not lowered to wgmma, or a GEMM "
                          "kernel without a dot"}
        out.write_text(json.dumps({"report": "layer_attention_compile", "header": header, "rows": rows},
                                  indent=1) + "\n")
        print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
