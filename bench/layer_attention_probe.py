"""Probe the fused layer attention at one shape on a GPU: its forward's max error against a
float64 computation beside eager's, or the CUDA error it raises. One shape per process (a
kernel fault leaves the CUDA context unusable), so loop in the shell:

    for s in "13 70 120 72 3" "2 64 120 64 3" "2 64 96 72 3"; do
      CUDA_LAUNCH_BLOCKING=1 MHMLA_TRITON_CONFIGS=fixed python bench/layer_attention_probe.py $s float16
    done

Issue 10: at L, N, H, K, J = 13, 70, 120, 72, 3 an H100 run faulted in fp16 and gave wrong
values in bf16 (``mhmla_fast.dispatch.fused_unsupported`` refuses such shapes; this script
calls the kernels directly, past that guard). ``MHMLA_TRITON_CONFIGS=fixed`` runs the fixed
configs (no autotuning); without it, the autotuned ones. ``--stages`` / ``--warps`` replace
the fixed configs' pipeline stages / warps (with ``MHMLA_TRITON_CONFIGS=fixed``): a fault that
goes away with one stage points at the compiler's software pipelining, not at the kernels'
indices (``tests/test_layer_attention_memcheck.py`` checks those in the interpreter).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("L", "N", "H", "K", "J"):
        p.add_argument(name, type=int)
    p.add_argument("dtype", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cuda",
                   help="cuda (default), or cpu under TRITON_INTERPRET=1 (float32 only there)")
    p.add_argument("--stages", type=int, help="pipeline stages of every fixed config")
    p.add_argument("--warps", type=int, help="warps of every fixed config")
    args = p.parse_args(argv)
    import os

    import torch

    if args.stages or args.warps:
        if os.environ.get("MHMLA_TRITON_CONFIGS") != "fixed":
            p.error("--stages/--warps change the fixed configs: set MHMLA_TRITON_CONFIGS=fixed")
        from mhmla_fast.kernels import layer_attention as kernels

        for name, (tiles, warps, stages) in list(kernels._FIXED.items()):
            kernels._FIXED[name] = (tiles, args.warps or warps, args.stages or stages)

    from mhmla_fast.kernels.layer_attention import layer_attention_fwd
    from mhmla_fast.reference import layer_attention_reference

    L, N, H, K, J = args.L, args.N, args.H, args.K, args.J
    g = torch.Generator().manual_seed(args.seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(args.device)

    base = [r(L, N, H), r(L, H, H, scale=H ** -0.5), r(L, H, scale=0.1), r(L, H, K, scale=H ** -0.5),
            r(L, K, scale=0.1), r(L, K, J, scale=K ** -0.5), r(L, J, scale=0.1)]
    dtype = getattr(torch, args.dtype)
    ts = [t.to(dtype).contiguous() for t in base]
    shape = f"L={L} N={N} H={H} K={K} J={J} {args.dtype}"
    if args.stages or args.warps:
        shape += f" stages={args.stages or 'fixed'} warps={args.warps or 'fixed'}"
    with torch.no_grad():
        c64, p64 = layer_attention_reference(*base, J)
        ce, pe = layer_attention_reference(*ts, J)
        try:
            cf, pf = layer_attention_fwd(*ts, J, (0.0, 0.0, 0.0), 0)
            if args.device != "cpu":
                torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 - the finding
            print(f"{shape}: FUSED FAILED: {type(err).__name__}: {str(err)[:200]}")
            return 1
        err = {name: (a.double() - b).abs().max().item()
               for name, a, b in (("c eager", ce, c64), ("c fused", cf, c64),
                                  ("p eager", pe, p64), ("p fused", pf, p64))}
    bad = err["c fused"] > 3 * err["c eager"] + 1e-3 or err["p fused"] > 3 * err["p eager"] + 1e-4
    print(f"{shape}: " + "  ".join(f"{k} {v:.1e}" for k, v in err.items())
          + ("  WRONG" if bad else "  ok"))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
