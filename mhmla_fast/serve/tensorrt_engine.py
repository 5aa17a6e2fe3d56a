"""TensorRT engines for the GED tagger: built from the ONNX export, run on torch CUDA buffers.

    build_engine(model.onnx, model.plan, profiles=...)   -> model.plan + model.plan.json
    TensorRTRunner.from_model_dir(dir)                    (input_ids, attention_mask) int64
                                                          [B, T] -> P(error) float32 [B, T]

An engine directory is an ONNX export directory (``onnx_export.export_onnx``: model.onnx,
config.json, tokenizer files) plus

    model.plan          the serialized engine (specific to the GPU and the TensorRT version)
    model.plan.json     its metadata: optimisation profiles [(batch, sequence) min/opt/max],
                        precision flags, workspace, TensorRT version, GPU name and compute
                        capability, the ONNX file it was built from, whether the fused
                        layer-attention plugin is in it

Dynamic shapes: the engine holds several optimisation profiles, one per sequence-length
bucket (:func:`plan_profiles`: powers of two from 64 up to the encoder's limit), each
allowing as many rows as the serving engine's token budget lets a batch of that length
have. Per call the runner picks the tightest profile that fits the batch
(:func:`choose_profile`), splits the rows when none takes them all (:func:`plan_calls`),
sets the input shapes and runs ``execute_async_v3`` on the current torch CUDA stream with
torch-allocated input and output buffers; one execution context switches profiles with
``set_optimization_profile_async`` (the engine sorts batches by length, so switches are
rare and contexts do not multiply the activation memory).

Layer attention: by default the ONNX graph's standard ops (the eager head, MatMul/Softmax)
are compiled by TensorRT like the rest of the encoder. With ``layer_attention_plugin=True``
the head is instead exported as one custom node (op ``layer_attention``, attribute
``plugin_namespace="mhmla_fast"``, :func:`export_plugin_onnx`) that TensorRT's ONNX parser
maps to the Quickly Deployable Plugin registered by :func:`register_layer_attention_plugin`
(``tensorrt.plugin``: ``register`` for shapes, ``autotune`` for FP32/FP16/BF16 I/O,
``impl`` launching the fused Triton forward kernels of ``mhmla_fast.kernels.layer_attention``
on TensorRT's stream). That needs TensorRT >= 10.7 with ``tensorrt.plugin``; without it the
standard ops are used. No ``aot_impl`` is given: an AOT implementation is one compiled
kernel launch, while the fused forward is two kernels with a softmax over the [L, N, J]
scores between them, so engines with the plugin call back into Python (this package) at
run time, which :class:`TensorRTRunner` provides.

Precision: ``fp16``/``bf16`` set TensorRT 10's weak-typing builder flags. TensorRT 11
removed them (strong typing only); there a clear error says to build fp32 or to convert
the ONNX file to mixed precision first (NVIDIA ModelOpt AutoCast).

WHAT COULD NOT BE RUN HERE: TensorRT cannot be installed on the machines this was written
on (its wheels and libraries come only from NVIDIA's package index), so every line that
calls ``tensorrt`` (:func:`build_engine`, :class:`TensorRTRunner`,
:func:`register_layer_attention_plugin`) is written against the documented TensorRT 10
Python API (``Builder``, ``create_optimization_profile``/``set_shape``, ``OnnxParser``,
``build_serialized_network``, ``Runtime.deserialize_cuda_engine``,
``IExecutionContext.set_input_shape``/``set_tensor_address``/``execute_async_v3``, and
``tensorrt.plugin``) and has never been executed. What is tested without TensorRT: the
profile planning and choice, batch splitting, the directory layout and metadata, the
missing-TensorRT errors, the plugin ONNX graph (evaluated end to end with a reference
implementation of the custom node) and the plugin's forward body on the Triton kernels.
Tests that need TensorRT and a GPU are skipped with that reason.

All ``import tensorrt`` happen inside functions; importing this module has no side effects.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..encoder import max_input_length
from .onnx_export import INPUT_NAMES, ONNX_FILE, OUTPUT_NAME, check_fresh
from .options import resolve_options
from .runners import Pending, download, upload

__all__ = [
    "ShapeProfile", "plan_profiles", "choose_profile", "plan_calls", "build_engine",
    "build_engine_dir", "TensorRTRunner", "register_layer_attention_plugin",
    "export_plugin_onnx", "layer_attention_plugin_forward", "engine_meta", "read_engine_meta",
    "write_engine_meta", "meta_path", "check_engine_compatible", "check_plan_options",
    "plan_precisions", "has_plugin_api", "import_tensorrt",
    "PLAN_FILE", "PLUGIN_ONNX_FILE", "PLUGIN_ID",
]

PLAN_FILE = "model.plan"
PLUGIN_ONNX_FILE = "model.plugin.onnx"
ENGINE_FORMAT = "mhmla-tensorrt-engine/1"
PLUGIN_NAMESPACE = "mhmla_fast"
PLUGIN_NAME = "layer_attention"
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
PLUGIN_INPUTS = ("hidden", "w_v", "b_v", "w_k", "b_k", "w_a", "b_a")
DEFAULT_WORKSPACE = 4 << 30
INSTALL_HINT = (
    "install the TensorRT Python wheels for your CUDA version on a machine with an NVIDIA "
    "GPU and driver, e.g. `pip install tensorrt-cu12` (the wheels and their libraries are "
    "served by NVIDIA's index: add `--extra-index-url https://pypi.nvidia.com` if your "
    "index lacks them); TensorRT >= 10.7 for the layer-attention plugin"
)
_plugin_registered = False


# --------------------------------------------------------------- shapes and profiles


@dataclass(frozen=True)
class ShapeProfile:
    """One optimisation profile: (batch, sequence) shapes ``min`` <= ``opt`` <= ``max``,
    shared by ``input_ids`` and ``attention_mask``."""

    min: tuple[int, int]
    opt: tuple[int, int]
    max: tuple[int, int]

    def __post_init__(self) -> None:
        for name in ("min", "opt", "max"):
            v = tuple(int(x) for x in getattr(self, name))
            if len(v) != 2 or min(v) < 1:
                raise ValueError(f"ShapeProfile.{name}: expected (batch, sequence) >= 1, got {v}")
            object.__setattr__(self, name, v)
        if not all(a <= b <= c for a, b, c in zip(self.min, self.opt, self.max)):
            raise ValueError(f"ShapeProfile: need min <= opt <= max per axis, got "
                             f"{self.min}, {self.opt}, {self.max}")

    def fits(self, batch: int, sequence: int) -> bool:
        """Whether a [batch, sequence] input is inside this profile."""
        return (self.min[0] <= batch <= self.max[0]) and (self.min[1] <= sequence <= self.max[1])

    def to_json(self) -> dict:
        return {"min": list(self.min), "opt": list(self.opt), "max": list(self.max)}

    @classmethod
    def from_json(cls, d: dict) -> ShapeProfile:
        return cls(tuple(d["min"]), tuple(d["opt"]), tuple(d["max"]))


def plan_profiles(max_batch: int = 256, max_sequence: int = 512, *,
                  token_budget: int | None = 8192, min_bucket: int = 64) -> list[ShapeProfile]:
    """Profiles for sequence buckets (1..min_bucket], then doubling up to ``max_sequence``.

    A bucket (lo, hi] allows batches of up to min(max_batch, token_budget // lo) rows
    (the serving engine packs at most ``token_budget`` padded pieces per batch) and is
    optimised for ``hi`` pieces at min(that, token_budget // hi) rows; without a token
    budget every bucket takes ``max_batch`` rows and is optimised for the largest batch.
    The defaults match ``Engine``'s on a GPU (max_batch 256, token_budget 8192, 512 pieces).
    """
    if max_batch < 1 or max_sequence < 1 or min_bucket < 1:
        raise ValueError(f"max_batch, max_sequence, min_bucket must be >= 1, got "
                         f"{max_batch}, {max_sequence}, {min_bucket}")
    if token_budget is not None and token_budget < 1:
        raise ValueError(f"token_budget: expected >= 1 or None, got {token_budget}")
    bounds, hi = [], min(min_bucket, max_sequence)
    while True:
        bounds.append(hi)
        if hi >= max_sequence:
            break
        hi = min(hi * 2, max_sequence)
    profiles, lo = [], 1
    for hi in bounds:
        if token_budget is None:
            top = opt = max_batch
        else:
            top = max(1, min(max_batch, token_budget // lo))
            opt = max(1, min(top, token_budget // hi))
        profiles.append(ShapeProfile((1, lo), (opt, hi), (top, hi)))
        lo = hi + 1
    return profiles


def choose_profile(profiles: Sequence[ShapeProfile], batch: int, sequence: int) -> int | None:
    """Index of the tightest profile that fits [batch, sequence] (smallest max sequence,
    then smallest max batch), or None when none does."""
    fitting = [i for i, p in enumerate(profiles) if p.fits(batch, sequence)]
    if not fitting:
        return None
    return min(fitting, key=lambda i: (profiles[i].max[1], profiles[i].max[0], i))


def plan_calls(profiles: Sequence[ShapeProfile], batch: int,
               sequence: int) -> list[tuple[int, int, int]]:
    """How to run a [batch, sequence] input: [(row_start, row_end, profile)], one entry when
    a profile takes every row, else row chunks as large as the roomiest profile that holds
    the sequence length. Raises ValueError when no profile holds it."""
    if batch < 1 or sequence < 1:
        raise ValueError(f"empty input [{batch}, {sequence}]")
    best = choose_profile(profiles, batch, sequence)
    if best is not None:
        return [(0, batch, best)]
    holding = [i for i, p in enumerate(profiles) if p.min[1] <= sequence <= p.max[1]]
    if not holding:
        spans = ", ".join(f"{p.min[1]}..{p.max[1]}" for p in profiles)
        raise ValueError(f"sequence length {sequence} is outside every optimisation profile "
                         f"of the engine (sequence ranges {spans}); rebuild it with a larger "
                         "max_sequence")
    roomiest = max(holding, key=lambda i: (profiles[i].max[0], -profiles[i].max[1]))
    step = profiles[roomiest].max[0]
    calls = []
    for start in range(0, batch, step):
        end = min(batch, start + step)
        p = choose_profile(profiles, end - start, sequence)
        if p is None:
            raise ValueError(f"no optimisation profile takes {end - start} rows of length "
                             f"{sequence} (profiles {[q.to_json() for q in profiles]})")
        calls.append((start, end, p))
    return calls


# ------------------------------------------------------------------------ metadata


def meta_path(plan: str | os.PathLike) -> Path:
    """``model.plan`` -> ``model.plan.json``."""
    plan = Path(plan)
    return plan.with_name(plan.name + ".json")


def engine_meta(*, onnx_path: str | os.PathLike, profiles: Sequence[ShapeProfile],
                fp16: bool, bf16: bool, workspace: int, plugin: bool,
                tensorrt_version: str, device_name: str, capability: Sequence[int]) -> dict:
    """The JSON record of a built engine (see the module doc)."""
    return {
        "format": ENGINE_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "onnx": Path(onnx_path).name,
        "inputs": {n: {"shape": ["batch", "sequence"]} for n in INPUT_NAMES},
        "output": OUTPUT_NAME,
        "profiles": [p.to_json() for p in profiles],
        "precision": {"fp16": bool(fp16), "bf16": bool(bf16)},
        "workspace_bytes": int(workspace),
        "layer_attention_plugin": bool(plugin),
        "tensorrt": str(tensorrt_version),
        "device": {"name": str(device_name), "capability": [int(c) for c in capability]},
    }


def write_engine_meta(plan: str | os.PathLike, meta: dict) -> Path:
    """Write ``meta`` next to the plan file (``<plan>.json``)."""
    path = meta_path(plan)
    path.write_text(json.dumps(meta, indent=2) + "\n")
    return path


def read_engine_meta(plan: str | os.PathLike) -> dict:
    """The metadata of a plan file, with ``profiles`` as :class:`ShapeProfile` objects."""
    path = meta_path(plan)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; it is written by build_engine next to "
                                f"{Path(plan).name}; rebuild the engine")
    meta = json.loads(path.read_text())
    if meta.get("format") != ENGINE_FORMAT:
        raise ValueError(f"{path}: not an mhmla TensorRT engine record "
                         f"(format {meta.get('format')!r})")
    meta["profiles"] = [ShapeProfile.from_json(p) for p in meta["profiles"]]
    if not meta["profiles"]:
        raise ValueError(f"{path}: no optimisation profiles")
    return meta


def check_engine_compatible(meta: dict, *, tensorrt_version: str,
                            capability: Sequence[int]) -> None:
    """Raise RuntimeError when a plan was built by another TensorRT version or for a GPU of
    another compute capability (TensorRT plans are not portable across either)."""
    problems = []
    if meta.get("tensorrt") != str(tensorrt_version):
        problems.append(f"built with TensorRT {meta.get('tensorrt')}, running "
                        f"{tensorrt_version}")
    built = list(meta.get("device", {}).get("capability", []))
    if built != [int(c) for c in capability]:
        problems.append(f"built for compute capability {built} "
                        f"({meta.get('device', {}).get('name')}), running {list(capability)}")
    if problems:
        raise RuntimeError("the TensorRT engine cannot run here: " + "; ".join(problems)
                           + ". Rebuild it on this machine (build_engine_dir).")


def plan_precisions(meta: dict) -> tuple[str, ...]:
    """The dtypes a plan was built for: "float16"/"bfloat16" for its reduced-precision flags,
    else ("float32",)."""
    prec = meta.get("precision", {})
    built = tuple(name for flag, name in (("fp16", "float16"), ("bf16", "bfloat16"))
                  if prec.get(flag))
    return built or ("float32",)


def check_plan_options(meta: dict, *, dtype: str | None, kernels: str = "auto") -> None:
    """Raise ValueError naming the option when a plan cannot honour ``dtype`` (its precision is
    fixed when it is built: ``mhmla-serve export --tensorrt DIR --precision ...``) or
    ``kernels`` ("triton": the fused head needs a plan built with the layer-attention plugin;
    "torch": one built without it). None / "auto" accept any plan."""
    built = plan_precisions(meta)
    if dtype is not None and dtype not in built:
        flag = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(dtype, dtype)
        raise ValueError(f"dtype: this tensorrt plan was built for {' or '.join(built)}, not "
                         f"{dtype!r}; rebuild it with mhmla-serve export --tensorrt DIR "
                         f"--precision {flag}, or leave dtype unset")
    plugin = bool(meta.get("layer_attention_plugin"))
    if kernels == "triton" and not plugin:
        raise ValueError("kernels: 'triton' with the tensorrt backend needs a plan built with "
                         "the layer-attention plugin (mhmla-serve export --tensorrt DIR "
                         "--layer-attention-plugin); this one compiles the eager head")
    if kernels == "torch" and plugin:
        raise ValueError("kernels: 'torch' with the tensorrt backend needs a plan built without "
                         "the layer-attention plugin; this one holds the fused (Triton) head")


# ---------------------------------------------------------------- TensorRT imports


def import_tensorrt():
    """``tensorrt``, or RuntimeError saying how to install it."""
    try:
        import tensorrt as trt
    except ImportError as e:
        raise RuntimeError(f"TensorRT is not installed: {INSTALL_HINT} ({e})") from None
    return trt


def has_plugin_api() -> bool:
    """Whether the installed TensorRT has the Python plugin API ``tensorrt.plugin``."""
    import_tensorrt()
    try:
        import tensorrt.plugin  # noqa: F401
    except ImportError:
        return False
    return True


def _torch_dtype(trt_dtype_name: str):
    """torch dtype for a TensorRT ``DataType`` name (``str(dt).split('.')[-1]``)."""
    import torch

    table = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16,
             "INT32": torch.int32, "INT64": torch.int64, "INT8": torch.int8,
             "BOOL": torch.bool, "UINT8": torch.uint8}
    try:
        return table[trt_dtype_name]
    except KeyError:
        raise ValueError(f"unsupported TensorRT I/O dtype {trt_dtype_name}") from None


# ----------------------------------------------------------- layer-attention plugin


def layer_attention_plugin_forward(hidden, w_v, b_v, w_k, b_k, w_a, b_a, num_heads: int,
                                   out) -> None:
    """The plugin's computation on torch tensors: the fused Triton forward (eval: no
    dropout) of ``mhmla_fast.kernels.layer_attention``, written into ``out``.

    hidden [L, N, H]; w_v [L, H, H]; b_v [L, H]; w_k [L, H, K]; b_k [L, K]; w_a [L, K, J]
    (dense); b_a [L, J]; out [N, H], all of one dtype on one device.
    """
    from mhmla_fast.kernels.layer_attention import layer_attention_fwd

    c, _ = layer_attention_fwd(hidden, w_v, b_v, w_k, b_k, w_a, b_a, int(num_heads),
                               (0.0, 0.0, 0.0), 0)
    out.copy_(c)


def register_layer_attention_plugin() -> bool:
    """Register the fused layer-attention forward as the TensorRT plugin ``PLUGIN_ID``.

    Returns False (and registers nothing) when the installed TensorRT lacks
    ``tensorrt.plugin`` (TensorRT < 10.7): then build from the standard-op ONNX graph.
    Raises RuntimeError when TensorRT is not installed. Idempotent.

    The plugin: inputs ``hidden`` [L, N, H] (the selected hidden states, N = batch x
    sequence) and the head's weights (7 tensors), attribute ``num_heads`` (int); output
    c [N, H] in the input dtype. ``autotune`` offers FP32, FP16 or BF16 for all eight I/O
    together (linear layout); ``impl`` runs :func:`layer_attention_plugin_forward` on
    TensorRT's stream. ``tensorrt.plugin`` reads the ``register`` function's annotations
    to tell tensors from attributes, so they are set as objects here (this module uses
    postponed, string annotations).
    """
    global _plugin_registered
    if _plugin_registered:
        return True
    if not has_plugin_api():
        return False
    import tensorrt.plugin as trtp

    def describe(hidden, w_v, b_v, w_k, b_k, w_a, b_a, num_heads):
        return trtp.from_shape_expr((hidden.shape_expr[1], hidden.shape_expr[2]),
                                    dtype=hidden.dtype)

    describe.__annotations__ = {**dict.fromkeys(PLUGIN_INPUTS, trtp.TensorDesc),
                                "num_heads": int, "return": trtp.TensorDesc}

    def autotune(hidden, w_v, b_v, w_k, b_k, w_a, b_a, outputs):
        types = ", ".join(["FP32|FP16|BF16"] * (len(PLUGIN_INPUTS) + 1))
        return [trtp.AutoTuneCombination(types, "LINEAR")]

    def impl(hidden, w_v, b_v, w_k, b_k, w_a, b_a, num_heads, outputs, stream):
        import torch

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            args = [torch.as_tensor(t, device="cuda") for t in (hidden, w_v, b_v, w_k, b_k,
                                                                w_a, b_a)]
            out = torch.as_tensor(outputs[0], device="cuda")
            layer_attention_plugin_forward(*args, num_heads, out)

    trtp.register(PLUGIN_ID)(describe)
    trtp.autotune(PLUGIN_ID)(autotune)
    trtp.impl(PLUGIN_ID)(impl)
    _plugin_registered = True
    return True


def _plugin_head_module(tagger):
    """The tagger as ``(input_ids, attention_mask) -> P(error)`` with the head as one
    ``mhmla_fast::layer_attention`` node when exported (eager reference when run)."""
    import torch
    from torch import nn

    from ..functional import _block_diagonal_dense
    from ..reference import layer_attention_reference

    class LayerAttentionNode(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, w_v, b_v, w_k, b_k, w_a, b_a, num_heads):
            return layer_attention_reference(hidden, w_v, b_v, w_k, b_k, w_a, b_a, num_heads)[0]

        @staticmethod
        def symbolic(g, hidden, w_v, b_v, w_k, b_k, w_a, b_a, num_heads):
            out = g.op(f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}", hidden, w_v, b_v, w_k, b_k, w_a,
                       b_a, num_heads_i=int(num_heads), plugin_namespace_s=PLUGIN_NAMESPACE)
            out.setType(hidden.type().with_sizes([None, None]))
            return out

    class PluginHeadTagger(nn.Module):
        def __init__(self, tagger):
            super().__init__()
            self.tagger = tagger

        def forward(self, input_ids, attention_mask):
            tagger, head = self.tagger, self.tagger.head
            out = tagger.encoder(input_ids=input_ids, attention_mask=attention_mask,
                                 output_hidden_states=True)
            hs = torch.stack(head.select(out.hidden_states), 0)  # [L, B, T, H]
            L, B, T, H = hs.shape
            w_a = _block_diagonal_dense(head.w_a) if head.block_diagonal else head.w_a
            c = LayerAttentionNode.apply(hs.reshape(L, B * T, H), head.w_v, head.b_v,
                                         head.w_k, head.b_k, w_a, head.b_a, head.num_heads)
            logits = tagger.classifier(c.reshape(B, T, H))
            return torch.softmax(logits.float(), dim=-1)[..., 1]

    return PluginHeadTagger(tagger).eval()


def export_plugin_onnx(model_dir: str | os.PathLike, onnx_path: str | os.PathLike, *,
                       opset: int = 17) -> Path:
    """Export the tagger with its layer-attention head as one custom node for the plugin.

    The node: domain and ``plugin_namespace`` "mhmla_fast", op ``layer_attention``,
    inputs (hidden [L, B*T, H], w_v, b_v, w_k, b_k, w_a dense [L, K, J], b_a), attribute
    ``num_heads``, output [B*T, H]; everything else is the standard graph of
    ``export_onnx``. ONNX Runtime cannot run it (TensorRT with the plugin can). Needs the
    "mhmla" or "shmla" head.
    """
    from .onnx_export import example_inputs, load_tagger_for_export, torch_to_onnx

    tagger = load_tagger_for_export(model_dir)
    if tagger.head.mode not in ("mhmla", "shmla"):
        raise ValueError(f"{model_dir}: head {tagger.head.mode!r} has no layer attention to "
                         "fuse; use the standard ONNX export")
    hf = tagger.encoder.config
    example = example_inputs(int(hf.vocab_size), int(getattr(hf, "pad_token_id", 0) or 0))
    onnx_path = Path(onnx_path)
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    return torch_to_onnx(_plugin_head_module(tagger), example, onnx_path, opset=opset,
                         custom_opsets={PLUGIN_NAMESPACE: 1})


# --------------------------------------------------------------------------- build


def build_engine(onnx_path: str | os.PathLike, engine_path: str | os.PathLike, *,
                 profiles: Sequence[ShapeProfile] | None = None,
                 min_shape: tuple[int, int] | None = None,
                 opt_shape: tuple[int, int] | None = None,
                 max_shape: tuple[int, int] | None = None,
                 max_batch: int = 256, max_sequence: int = 512, token_budget: int | None = 8192,
                 fp16: bool = False, bf16: bool = False, workspace: int = DEFAULT_WORKSPACE,
                 layer_attention_plugin: bool | None = None, verbose: bool = False) -> Path:
    """Build a TensorRT engine from an exported ONNX file; write ``engine_path`` (the plan)
    and ``<engine_path>.json`` (its profiles and build settings).

    Profiles: ``profiles``, else the single profile ``min_shape``/``opt_shape``/
    ``max_shape`` [(batch, sequence)], else :func:`plan_profiles` (``max_batch``,
    ``max_sequence``, ``token_budget``). ``fp16``/``bf16``: allow reduced-precision
    kernels (TensorRT 10 builder flags). ``workspace``: the builder's scratch-memory limit
    in bytes. ``layer_attention_plugin``: whether the ONNX graph holds the custom
    ``layer_attention`` node (None: detected from the graph); the plugin is registered
    before parsing. Untested here: needs TensorRT and a GPU.
    """
    trt = import_tensorrt()
    import torch

    onnx_path, engine_path = Path(onnx_path), Path(engine_path)
    if profiles is None and max_shape is not None:
        profiles = [ShapeProfile(min_shape or (1, 1), opt_shape or max_shape, max_shape)]
    if profiles is None:
        profiles = plan_profiles(max_batch, max_sequence, token_budget=token_budget)
    profiles = list(profiles)
    if layer_attention_plugin is None:
        layer_attention_plugin = _has_plugin_node(onnx_path)
    if layer_attention_plugin and not register_layer_attention_plugin():
        raise RuntimeError(f"{onnx_path} holds the {PLUGIN_ID} node but TensorRT "
                           f"{trt.__version__} lacks tensorrt.plugin (needs >= 10.7); build "
                           f"from the standard-op {ONNX_FILE} instead")
    if not torch.cuda.is_available():
        raise RuntimeError("building a TensorRT engine needs a CUDA GPU")

    logger = trt.Logger(trt.Logger.VERBOSE if verbose else trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    names = [network.get_input(i).name for i in range(network.num_inputs)]
    if sorted(names) != sorted(INPUT_NAMES):
        raise RuntimeError(f"{onnx_path}: inputs {names}, expected {list(INPUT_NAMES)}")

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace))
    for flag_name, wanted in (("FP16", fp16), ("BF16", bf16)):
        if not wanted:
            continue
        flag = getattr(trt.BuilderFlag, flag_name, None)
        if flag is None:
            raise RuntimeError(
                f"TensorRT {trt.__version__} has no BuilderFlag.{flag_name} (TensorRT 11 "
                "removed weak typing): build in fp32, or convert the ONNX file to mixed "
                "precision first (NVIDIA ModelOpt AutoCast) and build that")
        config.set_flag(flag)
    for prof in profiles:
        p = builder.create_optimization_profile()
        for name in INPUT_NAMES:
            p.set_shape(name, prof.min, prof.opt, prof.max)
        config.add_optimization_profile(p)

    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT could not build an engine from {onnx_path} (see its log)")
    engine_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = engine_path.with_name(engine_path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(plan)  # IHostMemory exposes the buffer protocol
    os.replace(tmp, engine_path)
    write_engine_meta(engine_path, engine_meta(
        onnx_path=onnx_path, profiles=profiles, fp16=fp16, bf16=bf16, workspace=workspace,
        plugin=layer_attention_plugin, tensorrt_version=trt.__version__,
        device_name=torch.cuda.get_device_name(), capability=torch.cuda.get_device_capability()))
    return engine_path


def _has_plugin_node(onnx_path: Path) -> bool:
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    return any(n.op_type == PLUGIN_NAME and n.domain == PLUGIN_NAMESPACE
               for n in model.graph.node)


def build_engine_dir(model_dir: str | os.PathLike, *, layer_attention_plugin: bool = False,
                     tagger_dir: str | os.PathLike | None = None, **kw) -> Path:
    """Build ``model_dir/model.plan`` for an ONNX export directory (``export_onnx``).

    The encoder's limit (``encoder.max_input_length`` of config.json's encoder config) is the
    default ``max_sequence``. With ``layer_attention_plugin`` the plugin graph
    ``model.plugin.onnx`` is exported first from ``tagger_dir`` (default: the source
    tagger recorded in export.json). Other keywords go to :func:`build_engine`.
    """
    model_dir = Path(model_dir)
    onnx_path = model_dir / ONNX_FILE
    if not onnx_path.is_file():
        raise FileNotFoundError(f"{model_dir}: no {ONNX_FILE}; export the tagger first: "
                                f"mhmla-serve export --onnx {model_dir}")
    config = json.loads((model_dir / "config.json").read_text())
    kw.setdefault("max_sequence", max_input_length(config.get("encoder_config", {})))
    if layer_attention_plugin:
        if tagger_dir is None:
            tagger_dir = json.loads((model_dir / "export.json").read_text())["source"]["model_dir"]
        onnx_path = export_plugin_onnx(tagger_dir, model_dir / PLUGIN_ONNX_FILE)
    return build_engine(onnx_path, model_dir / PLAN_FILE,
                        layer_attention_plugin=layer_attention_plugin, **kw)


# -------------------------------------------------------------------------- runner


class TensorRTRunner:
    """TensorRT: ``(input_ids, attention_mask)`` int64 [B, T] -> P(error) float32 [B, T].

    Inputs are copied to torch CUDA tensors (cast to the engine's input dtype), the output
    is a torch CUDA tensor sized from the context's output shape, and the engine runs on
    ``torch.cuda.current_stream().cuda_stream``, so it orders with any torch work. Untested
    here: needs TensorRT and a GPU.
    """

    def __init__(self, plan_path: str | os.PathLike, *, device: str | None = None):
        trt = import_tensorrt()
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("the TensorRT runner needs a CUDA GPU")
        self.trt, self.torch = trt, torch
        self.path = Path(plan_path)
        self.meta = read_engine_meta(self.path)
        self.device = torch.device(device or "cuda")
        if self.device.type != "cuda":
            raise ValueError(f"device: the TensorRT runner runs on CUDA, got {self.device}")
        with torch.cuda.device(self.device):
            check_engine_compatible(self.meta, tensorrt_version=trt.__version__,
                                    capability=torch.cuda.get_device_capability(self.device))
            if self.meta.get("layer_attention_plugin") and not register_layer_attention_plugin():
                raise RuntimeError(f"{self.path} was built with the {PLUGIN_ID} plugin, which "
                                   f"TensorRT {trt.__version__} cannot load (no tensorrt.plugin)")
            self.logger = trt.Logger(trt.Logger.WARNING)
            self.runtime = trt.Runtime(self.logger)
            self.engine = self.runtime.deserialize_cuda_engine(self.path.read_bytes())
            if self.engine is None:
                raise RuntimeError(f"TensorRT could not deserialize {self.path}")
            self.context = self.engine.create_execution_context()
        self.profiles = self._engine_profiles()
        self._profile = 0
        self.dtypes = {name: _torch_dtype(str(self.engine.get_tensor_dtype(name)).split(".")[-1])
                       for name in (*INPUT_NAMES, OUTPUT_NAME)}

    def _engine_profiles(self) -> list[ShapeProfile]:
        """The profiles as the engine holds them (authoritative over the JSON record)."""
        out = []
        for i in range(self.engine.num_optimization_profiles):
            lo, opt, hi = self.engine.get_tensor_profile_shape(INPUT_NAMES[0], i)
            out.append(ShapeProfile(tuple(lo), tuple(opt), tuple(hi)))
        return out

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike, *, device: str | None = None,
                       dtype: str | None = None, kernels: str = "auto") -> TensorRTRunner:
        """The runner on an engine directory's ``model.plan``; FileNotFoundError saying how
        to build it when missing. ``dtype`` and ``kernels`` must be what the plan was built
        with (:func:`check_plan_options`; None / "auto": whatever it was). Both are checked
        before TensorRT is imported."""
        path = Path(path)
        opts = resolve_options("tensorrt", device, dtype, kernels)
        check_fresh(path)
        plan = path / PLAN_FILE
        if not plan.is_file():
            first = ("" if (path / ONNX_FILE).is_file()
                     else f"export the tagger to ONNX (mhmla-serve export --onnx {path} "
                          f"--model {path}), then ")
            raise FileNotFoundError(
                f"{path}: no TensorRT engine ({PLAN_FILE} is missing). On the GPU machine that "
                f"will serve, {first}build it: python -c \"from mhmla_fast.serve.tensorrt_engine "
                f"import build_engine_dir; build_engine_dir('{path}')\"")
        check_plan_options(read_engine_meta(plan), dtype=opts.dtype, kernels=opts.kernels)
        return cls(plan, device=opts.device)

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        return self.submit(input_ids, attention_mask).result()

    def submit(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> Pending:
        """Queue the engine on the current stream and return at once; ``.result()`` waits for
        the probabilities (as :meth:`TorchRunner.submit`: inputs go up from pinned memory, the
        output comes back into a fresh pinned buffer, an event marks the end), so the engine
        packs the next batch while the GPU works."""
        torch = self.torch
        ids, mask = np.asarray(input_ids), np.asarray(attention_mask)
        if ids.ndim != 2 or ids.shape != mask.shape:
            raise ValueError(f"input_ids {list(ids.shape)} and attention_mask "
                             f"{list(mask.shape)}: expected two arrays of the same shape [B, T]")
        B, T = ids.shape
        with torch.cuda.device(self.device), torch.inference_mode():
            stream = torch.cuda.current_stream(self.device)
            ids_t = upload(ids, self.device, self.dtypes[INPUT_NAMES[0]])
            mask_t = upload(mask, self.device, self.dtypes[INPUT_NAMES[1]])
            outs = []
            for start, end, profile in plan_calls(self.profiles, B, T):
                outs.append(self._run(ids_t[start:end].contiguous(),
                                      mask_t[start:end].contiguous(), profile, stream))
            return download(outs[0] if len(outs) == 1 else torch.cat(outs, 0))

    def _run(self, ids, mask, profile: int, stream):
        """One execute_async_v3 on [rows, T] device tensors with the given profile."""
        ctx, handle = self.context, stream.cuda_stream
        if profile != self._profile:
            ctx.set_optimization_profile_async(profile, handle)
            self._profile = profile
        for name, t in zip(INPUT_NAMES, (ids, mask)):
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise RuntimeError(f"TensorRT refused {name} shape {list(t.shape)} for "
                                   f"profile {self.profiles[profile].to_json()}")
            ctx.set_tensor_address(name, t.data_ptr())
        out = self.torch.empty(tuple(ctx.get_tensor_shape(OUTPUT_NAME)),
                               dtype=self.dtypes[OUTPUT_NAME], device=self.device)
        ctx.set_tensor_address(OUTPUT_NAME, out.data_ptr())
        if not ctx.execute_async_v3(handle):
            raise RuntimeError(f"TensorRT execution failed for input {list(ids.shape)}")
        return out

    def __repr__(self) -> str:
        return f"TensorRTRunner({str(self.path)!r}, profiles={len(self.profiles)})"
