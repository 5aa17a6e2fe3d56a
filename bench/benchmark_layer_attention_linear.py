"""The layer-attention head and the classifier after it, folded (``LayerAttentionLinear``) against
the two run in turn: the op alone and the tagging engine on real sentences.

    python bench/benchmark_layer_attention_linear.py                    # op + engine, this device
    python bench/benchmark_layer_attention_linear.py --no-engine --n 4096
    python bench/benchmark_layer_attention_linear.py --engine-only --repeats 3

Op rows: random hidden states [L + 1, N, H] and a random head (non-zero biases) with a 2-class
linear map, at MiniLM (L = 6, H = K = 384, J = 12) and BERT-base (L = 12, H = K = 768, J = 12)
shape; median ms of ``--op-repeats`` calls after a warm-up, per (shape, dtype, N), for
``head+linear`` (``FusedLayerAttention`` with ``backend="torch"`` then ``nn.Linear``), ``folded``
and, on CUDA, ``fused+linear`` (``backend="triton"``); the max abs difference of each from a
float64 computation of the same weights.

Engine rows: ``Engine.tag_texts`` on FCE dev + test (the shipped tagger), sentences/s (median of
``--repeats`` alternating runs) for torch with the folded head (the default) and unfolded, in
fp32 and bf16 (CPU) or bf16 and fp16 (CUDA), and on the CPU ONNX Runtime on a folded and an
unfolded export made for the run; and the words whose label differs from torch fp32 unfolded.
The result (device, versions, commit, command) goes to
``bench/results/layer_attention_linear_<device>_<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mhmla_fast.provenance import (  # noqa: E402
    cpu_info, dated_results_path, load_average, provenance)

SHAPES = {"minilm": (6, 384, 384, 12), "bert-base": (12, 768, 768, 12)}  # L, H, K, J
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
FCE = REPO.parent / "shared" / "data" / "fce"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--dtypes", nargs="+", default=None, choices=list(DTYPES),
                   help="default: fp32 bf16 on the CPU, bf16 fp16 on CUDA")
    p.add_argument("--n", nargs="+", type=int, default=[1024, 4096, 16384], help="tokens N")
    p.add_argument("--op-repeats", type=int, default=20, help="timed calls per op row")
    p.add_argument("--no-engine", action="store_true", help="op rows only")
    p.add_argument("--engine-only", action="store_true", help="engine rows only")
    p.add_argument("--data", nargs="+", default=[str(FCE / f"fce-public.{s}.original.tsv")
                                                 for s in ("dev", "test")],
                   help="GED files whose sentences the engine tags (default FCE dev and test)")
    p.add_argument("--repeats", type=int, default=3, help="alternating engine runs per row")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--out", default=None,
                   help="a .json file or a directory (default bench/results)")
    args = p.parse_args(argv)
    if args.no_engine and args.engine_only:
        p.error("--no-engine and --engine-only exclude each other")
    return args


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device, repeats: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def op_rows(args, device) -> list[dict]:
    import torch
    from torch import nn

    from mhmla_fast import FusedLayerAttention
    from mhmla_fast.modules.layer_attention_linear import LayerAttentionLinear

    rows = []
    for shape in args.shapes:
        L, H, K, J = SHAPES[shape]
        torch.manual_seed(0)
        head64 = FusedLayerAttention(H, L, num_heads=J, key_size=K, backend="torch")
        head64 = head64.double().eval()
        with torch.no_grad():
            for name, p in head64.named_parameters():
                if name.startswith("b_"):
                    p.normal_(0.0, 0.1)
        linear64 = nn.Linear(H, 2).double().eval()
        for dtype_name in args.dtypes:
            dtype = getattr(torch, DTYPES[dtype_name])
            head = FusedLayerAttention(H, L, num_heads=J, key_size=K, backend="torch")
            head.load_state_dict(head64.state_dict())
            head = head.to(device=device, dtype=dtype).eval()
            linear = nn.Linear(H, 2)
            linear.load_state_dict(linear64.state_dict())
            linear = linear.to(device=device, dtype=dtype).eval()
            folded = LayerAttentionLinear(head, linear)
            for n in args.n:
                g = torch.Generator().manual_seed(n)
                hs64 = torch.randn(L + 1, n, H, generator=g, dtype=torch.float64)
                hs = hs64.to(device=device, dtype=dtype)
                with torch.inference_mode():
                    exact = linear64(head64(hs64))
                    providers = {"head+linear": lambda: linear(head(hs)),
                                 "folded": lambda: folded(hs)}
                    if device.type == "cuda":
                        fused = FusedLayerAttention(H, L, num_heads=J, key_size=K, backend="triton")
                        fused.load_state_dict(head.state_dict())
                        fused = fused.to(device=device, dtype=dtype).eval()
                        providers["fused+linear"] = lambda fused=fused: linear(fused(hs))
                    row = {"shape": shape, "dtype": dtype_name, "n": n, "ms": {}, "max_abs_err": {}}
                    for name, fn in providers.items():
                        row["ms"][name] = round(_median_ms(fn, device, args.op_repeats), 4)
                        err = (fn().double().cpu() - exact).abs().max().item()
                        row["max_abs_err"][name] = float(f"{err:.3g}")
                speedup = row["ms"]["head+linear"] / row["ms"]["folded"]
                row["speedup_folded_vs_head+linear"] = round(speedup, 3)
                rows.append(row)
                print(f"{shape} {dtype_name} N={n}: " + ", ".join(
                    f"{k} {v:.3f} ms" for k, v in row["ms"].items())
                    + f"  (folded {row['speedup_folded_vs_head+linear']:.2f}x)", flush=True)
    return rows


def engine_rows(args, device) -> dict:
    import numpy as np

    from mhmla_fast.ged.data import read_ged
    from mhmla_fast.serve.engine import Engine, default_tagger_path
    from mhmla_fast.serve.runners import TorchRunner

    texts = [" ".join(s.tokens) for f in args.data for s in read_ged(f)]
    model = default_tagger_path()
    engines = {}
    dtypes = ["float32", "bfloat16"] if device.type == "cpu" else ["bfloat16", "float16"]
    for dtype in dtypes:
        for fold in (True, False):
            engine = Engine.load(model, backend="torch", device=str(device), dtype=dtype,
                                 threads=args.threads)
            engine.runner = TorchRunner(model, device=str(device), dtype=dtype,
                                        threads=args.threads, fold=fold)
            engines[f"torch {dtype}{'' if fold else ' unfolded'}"] = engine
    tmp = None
    if device.type == "cpu":
        from mhmla_fast.serve.onnx_export import export_onnx

        tmp = tempfile.TemporaryDirectory(prefix="fold-bench-")
        for fold in (True, False):
            out = Path(tmp.name) / ("folded" if fold else "unfolded")
            export_onnx(model, out, fold=fold)
            engines[f"onnx float32{'' if fold else ' unfolded'}"] = Engine.load(
                out, backend="onnx", device="cpu", threads=args.threads)
    times = {name: [] for name in engines}
    labels = {}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            results = engine.tag_texts(texts)
            times[name].append(time.perf_counter() - t0)
            labels[name] = np.array([label for r in results for label in r.labels])
    reference = labels[f"torch {dtypes[0]} unfolded"]
    rows = []
    for name in engines:
        sec = statistics.median(times[name])
        rows.append({"engine": name, "sentences_per_s": round(len(texts) / sec, 1),
                     "seconds_all": [round(t, 3) for t in times[name]],
                     "labels_differing": int((labels[name] != reference).sum())})
        print(f"{name}: {len(texts) / sec:.1f} sentences/s, labels differing from "
              f"{dtypes[0]} unfolded: {rows[-1]['labels_differing']}", flush=True)
    if tmp is not None:
        tmp.cleanup()
    return {"sentences": len(texts), "words": int(len(reference)),
            "data": [Path(f).name for f in args.data], "reference": f"torch {dtypes[0]} unfolded",
            "rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.dtypes is None:
        args.dtypes = ["fp32", "bf16"] if device.type == "cpu" else ["bf16", "fp16"]
    header = {**provenance(), "command": shlex.join(["python", *sys.argv]),
              "cpu": {**cpu_info(), "load_average_start": load_average()},
              "threads": torch.get_num_threads()}
    result = {"benchmark": "layer_attention_linear", "header": header}
    if not args.engine_only:
        result["op"] = op_rows(args, device)
    if not args.no_engine:
        result["engine"] = engine_rows(args, device)
    header["cpu"]["load_average_end"] = load_average()
    slug = ("cpu" if device.type == "cpu"
            else torch.cuda.get_device_name(device).lower().replace(" ", "-"))
    out = dated_results_path(args.out, f"layer_attention_linear_{slug}", REPO / "bench" / "results")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
