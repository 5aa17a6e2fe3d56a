"""Host time of one layer-attention call, eager against fused, with the kernels stubbed out.

    python bench/layer_attention_host_cpu.py            # table + bench/results/layer_attention_host_cpu.json

Where GPU work is small (MiniLM shape, N <= 4096 tokens) both implementations are bound by the
host: the Python and dispatcher work of launching, not the kernels. Without a GPU this measures
that host work: the fused path runs its launchers with every Triton launch replaced by a no-op
(the allocations, torch ops, autograd and custom-op plumbing remain), the eager path runs as is
on tiny CPU tensors (L = 6, N = 8, H = K = 32, J = 4), whose arithmetic is negligible. Each
figure is the minimum over rounds of the mean over calls, in microseconds per call, on one CPU
thread. A GPU launch adds its own cost per kernel (about 2 launches forward, 2 plus 2 per layer
group backward), which this does not count.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused launchers accept CPU tensors

REPO_ROOT = Path(__file__).resolve().parents[1]


class _NoLaunch:
    """Stands in for a @triton.jit kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def measure(calls: int, rounds: int) -> dict:
    import torch

    import mhmla_fast.kernels.layer_attention as kernels
    from mhmla_fast import layer_attention

    torch.set_num_threads(1)
    L, N, H, K, J = 6, 8, 32, 32, 4
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(*s, generator=g).requires_grad_() for s in
          ((L, N, H), (L, H, H), (L, H), (L, H, K), (L, K), (L, K, J), (L, J))]
    dc = torch.randn(N, H, generator=g)
    saved = {name: getattr(kernels, name) for name in
             ("_launch", "_layer_attention_bwd_softmax_kernel", "_layer_attention_dropout_layers_kernel")}
    kernels._launch = lambda *a, **k: None
    kernels._layer_attention_bwd_softmax_kernel = _NoLaunch()
    kernels._layer_attention_dropout_layers_kernel = _NoLaunch()

    def per_call(fn) -> float:
        for _ in range(20):
            fn()
        best = float("inf")
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - t) / calls)
        return best * 1e6

    rows = []
    try:
        for backend in ("torch", "triton"):
            with torch.no_grad():
                fwd = per_call(lambda: layer_attention(*ts, J, backend=backend))
            full = per_call(lambda: torch.autograd.grad(layer_attention(*ts, J, backend=backend), ts, dc))
            rows.append({"backend": backend, "forward_us": round(fwd, 1),
                         "forward_backward_us": round(full, 1)})
    finally:
        for name, value in saved.items():
            setattr(kernels, name, value)
    return {"shape": dict(L=L, N=N, H=H, K=K, J=J), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="layer_attention_host_cpu.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=str(REPO_ROOT / "bench" / "results" / "layer_attention_host_cpu.json"))
    args = p.parse_args(argv)
    import platform

    import torch

    from mhmla_fast.provenance import git_commit

    result = measure(args.calls, args.rounds)
    for row in result["rows"]:
        print(f"{row['backend']:>6}: forward {row['forward_us']:7.1f} us, "
              f"forward + backward {row['forward_backward_us']:7.1f} us (host only)")
    header = {"device": f"cpu ({platform.processor() or platform.machine()}, 1 thread), "
                        "kernel launches stubbed", "torch": torch.__version__,
              "commit": git_commit(), "load_1min": os.getloadavg()[0],
              "command": "python bench/layer_attention_host_cpu.py",
              "note": __doc__.split("\n\n")[2].replace("\n", " ")}
    Path(args.out).write_text(json.dumps({"benchmark": "layer_attention_host_cpu", "header": header,
                                          **result}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
