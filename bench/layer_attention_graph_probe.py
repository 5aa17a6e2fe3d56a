"""How much of one layer-attention forward + backward is host time: the call as users make it
against the same work replayed from a CUDA graph (GPU only).

    python bench/layer_attention_graph_probe.py --out DIR      # DIR/graph_probe.json + a table

For eager (``backend="torch"``) and fused (``backend="triton"``), at the shapes below, three
median figures per forward + backward (``torch.autograd.grad`` of c for every input, as the
benchmark's ``full`` mode):

    ms        the call timed with CUDA events, synchronised before each call
    host_ms   the CPU time of the call (the device idle before it): Python, autograd, launches
    graph_ms  the same forward + backward captured once in a CUDA graph and replayed: the GPU
              time of its kernels with no host in the way, the floor that fewer launches or
              a captured call could reach

``ms`` near ``host_ms`` and well above ``graph_ms`` says the call is bound by its host. A
cProfile of the fused call at the first shape comes first (top 25 by own time), and the JSON
is rewritten after every step, so a run cut by its time box keeps what it measured.

Fused rows come twice: as shipped (``launches: direct``, every launch after a key's first one
straight to the compiled kernel) and with every launch through Triton's JIT (``launches: jit``,
what the launchers did before 2026-11-27), the A/B of the direct launches on this host. At the
first shape the forward alone, without a gradient (``mode: forward``, the inference path),
follows for fused and eager.

``--compiled`` measures instead what training with ``--compile reduce-overhead`` (the default
on CUDA) runs: the head in training mode (dropout 0.3) through ``torch.compile(mode=
"reduce-overhead")``, eager (inductor-compiled) against fused (the custom op captured), at
MiniLM N = 2048 and 4096 and BERT-base N = 4096, into ``compiled_probe.json``: whether
``backend="auto"`` should take the fused pair inside a compiled training step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_layer_attention import SHAPES, git_commit, host_ms, make_inputs  # noqa: E402

CASES = (("bert-base", 4096), ("minilm", 1024), ("minilm", 4096))
REPS = 30


def _events_ms(fn, reps: int = REPS) -> float:
    import torch

    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return median(times)


def measure(shape_name: str, n: int, backend: str, dtype, mode: str = "full",
            launches: str = "direct") -> dict:
    """One row: ``mode`` "full" (forward + backward) or "forward" (no gradient); ``launches``
    "jit" sends the fused kernels' launches through Triton's JIT (as with launch hooks set)."""
    import torch

    import mhmla_fast.kernels.layer_attention as kernels
    from mhmla_fast import layer_attention

    inputs, dc = make_inputs(SHAPES[shape_name], n, dtype, "cuda", seed=0)
    J = SHAPES[shape_name].J

    def full():
        return torch.autograd.grad(layer_attention(*inputs, J, backend=backend), inputs, dc)

    def forward():
        with torch.no_grad():
            return layer_attention(*inputs, J, backend=backend)

    step = full if mode == "full" else forward
    hooks = kernels._launch_hooks
    if launches == "jit":
        kernels._launch_hooks = lambda: True
    try:
        return _timed(step, {"shape": shape_name, "n": n, "backend": backend,
                             "dtype": str(dtype).split(".")[-1], "mode": mode,
                             "launches": launches if backend == "triton" else None})
    finally:
        kernels._launch_hooks = hooks


def _timed(step, row: dict) -> dict:
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles, autotunes) off the default stream
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    row.update(ms=_events_ms(step), host_ms=host_ms(step, "cuda"))
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        row["graph_ms"] = _events_ms(graph.replay)
    except Exception as e:  # noqa: BLE001 - reported in the row, the others still run
        row["graph_ms"], row["graph_error"] = None, f"{type(e).__name__}: {e}"[:300]
    return row


COMPILED_CASES = (("minilm", 2048), ("minilm", 4096), ("bert-base", 4096))
TRAINING_DROPOUT = 0.3  # the GED tagger's head dropout (on h, k and p), as in training


def measure_compiled(shape_name: str, n: int, backend: str, dtype) -> dict:
    """One row of the head as ``mhmla-train --compile reduce-overhead`` runs it: forward +
    backward in training mode (dropout 0.3 on h, k and p) through
    ``torch.compile(mode="reduce-overhead")``, which captures it in CUDA graphs (eager: the
    reference's ops compiled by inductor; fused: the custom op's kernels captured)."""
    import torch

    from mhmla_fast import layer_attention

    inputs, dc = make_inputs(SHAPES[shape_name], n, dtype, "cuda", seed=0)
    J = SHAPES[shape_name].J

    def head(*ts):
        return layer_attention(*ts, J, dropout_h=TRAINING_DROPOUT, dropout_k=TRAINING_DROPOUT,
                               dropout_p=TRAINING_DROPOUT, training=True, backend=backend)

    compiled = torch.compile(head, mode="reduce-overhead", dynamic=False)

    def step():
        torch.compiler.cudagraph_mark_step_begin()
        return torch.autograd.grad(compiled(*inputs), inputs, dc)

    row = {"shape": shape_name, "n": n, "backend": backend, "dtype": str(dtype).split(".")[-1],
           "mode": "full, training, torch.compile reduce-overhead", "launches": None}
    t0 = time.perf_counter()
    for _ in range(5):  # compile, autotune, warm-up and capture
        step()
    torch.cuda.synchronize()
    row["warmup_s"] = round(time.perf_counter() - t0, 2)
    row.update(ms=_events_ms(step), host_ms=host_ms(step, "cuda"), graph_ms=None)
    return row


def profile_fused(shape_name: str, n: int, calls: int = 20) -> str:
    """cProfile of ``calls`` fused forward + backward calls (after a warm-up): top 25 by own time."""
    import torch

    from mhmla_fast import layer_attention

    inputs, dc = make_inputs(SHAPES[shape_name], n, torch.bfloat16, "cuda", seed=0)
    J = SHAPES[shape_name].J

    def step():
        return torch.autograd.grad(layer_attention(*inputs, J, backend="triton"), inputs, dc)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return (f"cProfile of {calls} fused forward + backward calls, {shape_name} bf16 N = {n}: "
            f"{host * 1e3 / calls:.3f} ms of host time per call under the profiler\n"
            + text.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for graph_probe.json")
    parser.add_argument("--compiled", action="store_true",
                        help="instead: the head in training mode under torch.compile "
                             "reduce-overhead, eager against fused (compiled_probe.json)")
    args = parser.parse_args()
    import torch
    import triton

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "commit": git_commit(),
            "command": "python bench/layer_attention_graph_probe.py --out DIR"}
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compiled:
        meta["command"] += " --compiled"
        compiled = {"header": meta, "rows": []}
        for shape_name, n in COMPILED_CASES:
            for backend in ("torch", "triton"):
                try:
                    r = measure_compiled(shape_name, n, backend, torch.bfloat16)
                except Exception as e:  # noqa: BLE001 - reported, the other rows still run
                    r = {"shape": shape_name, "n": n, "backend": backend,
                         "error": f"{type(e).__name__}: {e}"[:500]}
                compiled["rows"].append(r)
                (args.out / "compiled_probe.json").write_text(json.dumps(compiled, indent=1))
                print(f"{shape_name:9s} N={n:5d} {backend:6s} bf16 compiled fwd+bwd: "
                      + (f"{r['ms']:.3f} ms, host {r['host_ms']:.3f} ms (warm-up {r['warmup_s']} s)"
                         if "ms" in r else r["error"]), flush=True)
        return
    result = {"header": meta, "rows": [], "cprofile_fused": None}

    def save():  # after every step: a run cut by a time box keeps what it measured
        (args.out / "graph_probe.json").write_text(json.dumps(result, indent=1))

    # the profile first: the cheapest, and what says where the host time goes
    result["cprofile_fused"] = profile_fused(*CASES[0])
    print(result["cprofile_fused"], flush=True)
    save()
    runs = [(shape_name, n, backend, "full", launches) for shape_name, n in CASES
             for backend, launches in (("triton", "direct"), ("triton", "jit"), ("torch", None))]
    runs[3:3] = [(*CASES[0], "triton", "forward", "direct"), (*CASES[0], "torch", "forward", None)]
    for shape_name, n, backend, mode, launches in runs:
        r = measure(shape_name, n, backend, torch.bfloat16, mode, launches or "direct")
        result["rows"].append(r)
        save()
        graph = f"{r['graph_ms']:.3f}" if r["graph_ms"] is not None else r["graph_error"]
        name = backend + (f" ({launches})" if launches else "")
        what = "fwd+bwd" if mode == "full" else "fwd    "
        print(f"{shape_name:9s} N={n:5d} {name:15s} bf16 {what}: {r['ms']:.3f} ms, "
              f"host {r['host_ms']:.3f} ms, graph replay {graph}", flush=True)


if __name__ == "__main__":
    main()
