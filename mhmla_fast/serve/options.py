"""The one serving contract: which runtime, device, dtype and head kernels a model is loaded with.

Every loader of ``serve/`` (``Engine.load`` for tagging, ``score.load_scorer`` for scoring, and
through them the ``mhmla-serve`` commands and the HTTP app) takes the same four options and
resolves them here, once:

    backend   the runtime: "auto" (the default: see below), "torch" (eager PyTorch), "onnx"
              (ONNX Runtime on an export), "openvino" (OpenVINO on the same export, CPU only),
              "tensorrt" (a TensorRT plan built from the export)
    device    default: "cuda" when the backend can reach a CUDA GPU (torch: a usable
              ``torch.cuda`` device; ONNX Runtime: its CUDA execution provider is installed;
              TensorRT: always), else "cpu"
    dtype     default: "bfloat16" for torch on CUDA, "float32" otherwise (ONNX: "float32" or
              "int8", the two graphs of an export; OpenVINO: "float32" or "bfloat16", the
              latter with fp32-checked labels; TensorRT: the precision it was built with)
    kernels   the layer-attention head's implementation: "auto" (per device and direction the
              one measured faster, ``mhmla_fast.dispatch``), "torch" (eager), "triton" (fused)

and, for tagging with torch on CUDA only, ``cuda_graphs`` (default off): each forward pass is
padded to one of a few shapes and replayed from a CUDA graph (``runners.CapturedForward``); on
the CPU only, ``lanes`` (default 1): forward passes run that many at a time, each on its own
thread with ``threads / lanes`` of the runtime's threads (``runners.Lanes``).

Beside them, the token budget (padded word pieces per forward pass) of tagging and scoring
defaults per device (:func:`default_token_budget`): 1024 on the CPU, 8192 on a GPU.

"auto" picks the runtime from the other options: torch on CUDA, and wherever an option asks
for something only torch has (``kernels="triton"``, dtype float16, a device other than the
CPU); on the CPU in float32, ONNX Runtime on a cached export of the model that was validated to
give torch's labels (:mod:`.export_cache`), when onnxruntime and onnx are installed, else torch.
On a CPU with AMX bf16 units and OpenVINO installed, dtype left unset (or "bfloat16") runs the
checked bf16 pass on that export instead (:func:`.openvino_runner.checked_runner`: OpenVINO
bf16, the rows near the threshold again in ONNX Runtime fp32): the same labels as fp32, the
probabilities away from the threshold bf16's; ``dtype="float32"`` keeps every probability
fp32's. The essay scorer does the same with its export
(:func:`.openvino_runner.checked_scorer`: the essays whose output lies near a rounding boundary
scored again in fp32). The choice between these is made at load time (it needs the model):
:func:`resolve_options` returns backend "auto" for it (dtype "float32", or "bfloat16" for the
checked pass), and "torch" where torch is the only choice. dtype "int8" (an ONNX-only graph,
which auto never picks) is an error.

An option a backend cannot honour is a ValueError naming the option and the backend, never
dropped. The device rule itself lives in ``mhmla_fast.devices`` (training uses it too).
:func:`resolve_options` does the checks that need no model file; the TensorRT runner
checks dtype and kernels against the plan it loads. Importing this module imports neither torch
nor ONNX Runtime; each check imports only the runtime it asks about.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .. import devices
from ..devices import cuda_available, resolve_device  # noqa: F401 - re-exported

__all__ = ["BACKENDS", "KERNELS", "TORCH_DTYPES", "ONNX_DTYPES", "OPENVINO_DTYPES",
           "ServeOptions", "checked_bf16_available",
           "cuda_available", "onnx_importable", "resolve_device", "resolve_dtype",
           "resolve_options", "TOKEN_BUDGETS", "default_token_budget", "check_lanes",
           "throughput_lanes"]

BACKENDS = ("auto", "torch", "onnx", "openvino", "tensorrt")
KERNELS = ("auto", "torch", "triton")  # = mhmla_fast.functional.BACKENDS (not imported: torch)
TORCH_DTYPES = ("float32", "bfloat16", "float16")
ONNX_DTYPES = ("float32", "int8")
OPENVINO_DTYPES = ("float32", "bfloat16")
# Padded word pieces per forward pass by device type. On 2 CPU cores (AMD EPYC, AVX-512) small
# passes ran faster per piece: at 1024 against 8192, ONNX Runtime fp32 tagged FCE dev + test
# 1.21x faster (median of 5 paired, interleaved repeats), torch fp32 1.11x, torch bf16 1.04x,
# and the ONNX scorer scored ASAP essays 1.21x faster, with identical fp32 labels and scores
# (bench/results/token_budget_cpu_2026-11-24.json). GPU passes stay large (H100 figures).
TOKEN_BUDGETS = {"cpu": 1024, "cuda": 8192}
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
            "float": "float32"}


@dataclass(frozen=True)
class ServeOptions:
    """Resolved options: ``device`` and ``dtype`` are never None (TensorRT's dtype may be None:
    "whatever the plan was built with"). ``backend`` "auto" is left only for the CPU, in float32
    or (on a CPU with AMX and OpenVINO) bfloat16 for the checked pass, where the model's cached
    ONNX export or torch is chosen at load time."""

    backend: str
    device: str
    dtype: str | None
    kernels: str


def _device_type(device: str) -> str:
    return device.split(":", 1)[0]


def resolve_dtype(dtype: str | None, device: str, backend: str = "torch") -> str | None:
    """``dtype`` normalised ("fp32" -> "float32", ...), else the default: "bfloat16" for torch
    on CUDA, "float32" for torch elsewhere and for ONNX, None for TensorRT (the plan's)."""
    if dtype:
        return _ALIASES.get(str(dtype), str(dtype))
    if backend == "tensorrt":
        return None
    if backend == "torch" and _device_type(device) == "cuda":
        return "bfloat16"
    return "float32"


def default_token_budget(device) -> int:
    """The token budget for ``device`` ("cpu", "cuda", "cuda:N" or a ``torch.device``) when the
    caller gives none: :data:`TOKEN_BUDGETS` of its type (a GPU's for any other type)."""
    return TOKEN_BUDGETS.get(_device_type(str(device)), TOKEN_BUDGETS["cuda"])


def throughput_lanes(device: str, threads: int | None) -> int:
    """The lanes of a batch job (``mhmla-serve tag``), for throughput: on the CPU one pass per
    thread (``threads``, else :func:`mhmla_fast.devices.default_threads`), each single-threaded
    (on 2 cores 1.14x ONNX Runtime's throughput in process, see ``runners.Lanes``); 1 on a
    GPU."""
    if _device_type(device) != "cpu":
        return 1
    return int(threads) if threads else devices.default_threads()


def onnx_importable() -> bool:
    """Whether onnxruntime (to run an export) and onnx (to make one) are installed, found
    without importing them."""
    from importlib.util import find_spec

    try:
        return find_spec("onnxruntime") is not None and find_spec("onnx") is not None
    except (ImportError, ValueError):  # a broken or stubbed-out installation
        return False


def check_lanes(lanes: int, device: str) -> int:
    """``lanes`` (forward passes at a time) as an int: at least 1, and more than 1 only on the
    CPU (a GPU runs one pass at a time; its runners overlap the host's work instead)."""
    if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
        raise ValueError(f"lanes: expected a positive integer, got {lanes!r}")
    if lanes > 1 and _device_type(device) != "cpu":
        raise ValueError(f"lanes: concurrent forward passes run on the CPU, got device "
                         f"{device!r}; use lanes 1 there")
    return lanes


def resolve_options(backend: str = "auto", device: str | None = None,
                    dtype: str | None = None, kernels: str | None = "auto", *,
                    cuda_graphs: bool = False, lanes: int = 1) -> ServeOptions:
    """Check ``backend``/``device``/``dtype``/``kernels`` and fill in the defaults.

    ``backend="auto"`` resolves to "torch" where torch is the only runtime that honours the
    other options or the device is a GPU, and stays "auto" on the CPU in float32 with
    onnxruntime and onnx installed (see the module doc). Raises ValueError naming the option and
    the backend when the backend cannot honour it: an unknown backend, dtype or kernels name;
    dtype "int8" with auto; ONNX on CUDA without onnxruntime's CUDA provider (or on any other
    device); ONNX with ``kernels="triton"`` (the exported graph holds the eager head); TensorRT
    off CUDA; ``kernels="triton"`` on a CPU device (the Triton kernels need a GPU, or
    ``TRITON_INTERPRET=1``); ``cuda_graphs`` anywhere but the torch backend on a CUDA device;
    ``lanes`` other than 1 off the CPU (:func:`check_lanes`)."""
    opts = _resolve(backend, device, dtype, kernels)
    check_lanes(lanes, opts.device)
    if cuda_graphs and (opts.backend != "torch" or _device_type(opts.device) != "cuda"):
        raise ValueError(f"cuda_graphs: replaying passes from CUDA graphs needs the torch backend "
                         f"on a CUDA device, got backend {opts.backend!r} on {opts.device!r}")
    return opts


def _resolve(backend: str, device: str | None, dtype: str | None, kernels: str | None
             ) -> ServeOptions:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    kernels = kernels or "auto"
    if kernels not in KERNELS:
        raise ValueError(f"kernels: expected one of {KERNELS}, got {kernels!r}")
    if backend == "auto":
        return _resolve_auto(device, dtype, kernels)
    device = devices.resolve_device(device, backend)
    kind = _device_type(device)
    dtype = resolve_dtype(dtype, device, backend)
    if backend == "torch":
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype: the torch backend has {TORCH_DTYPES}, got {dtype!r}")
        if kind == "cuda" and not devices.cuda_available("torch"):  # before the load, not in it
            raise ValueError(f"device: {device!r}, but torch has no usable CUDA device here; "
                             "use device 'cpu' (or leave it out)")
        if kernels == "triton" and kind == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("kernels: 'triton' runs on a CUDA device (the torch backend got "
                             f"device {device!r}); use kernels 'auto' or 'torch' on the CPU")
    elif backend == "onnx":
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device: the onnx backend runs on 'cpu' or 'cuda', got {device!r}")
        if kind == "cuda" and not devices.cuda_available("onnx"):
            raise ValueError(f"device: {device!r} with the onnx backend needs onnxruntime's "
                             "CUDAExecutionProvider (pip install onnxruntime-gpu); the installed "
                             "onnxruntime runs on the CPU only: use device 'cpu'")
        if dtype not in ONNX_DTYPES:
            raise ValueError(f"dtype: the onnx backend has {ONNX_DTYPES} (the graphs of an "
                             f"export), got {dtype!r}")
        if kernels == "triton":
            raise ValueError("kernels: the onnx backend runs the exported graph, which holds the "
                             "eager ('torch') head; 'triton' is not available there (use the "
                             "torch backend, or tensorrt with --layer-attention-plugin)")
    elif backend == "openvino":
        if kind != "cpu":
            raise ValueError(f"device: the openvino backend runs on the CPU, got {device!r}")
        if dtype not in OPENVINO_DTYPES:
            raise ValueError(f"dtype: the openvino backend has {OPENVINO_DTYPES}, got {dtype!r}")
        if kernels == "triton":
            raise ValueError("kernels: the openvino backend runs the exported graph, which holds "
                             "the eager ('torch') head; 'triton' is not available there")
    else:  # tensorrt; dtype and kernels are checked against the plan by the runner
        if kind != "cuda":
            raise ValueError(f"device: the tensorrt backend runs on CUDA, got {device!r}")
        if dtype is not None and dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype: the tensorrt backend has {TORCH_DTYPES} (the precision "
                             f"its plan was built with), got {dtype!r}")
    return ServeOptions(backend, device, dtype, kernels)


def _resolve_auto(device: str | None, dtype: str | None, kernels: str) -> ServeOptions:
    """``resolve_options("auto", ...)``: "torch" where only torch can honour the options or the
    device is not the CPU, else "auto" (the cached ONNX export or torch, chosen at load), in
    "bfloat16" (the checked pass) where :func:`checked_bf16_available` and no other dtype was
    asked for, else "float32"."""
    if dtype and _ALIASES.get(str(dtype), str(dtype)) == "int8":
        raise ValueError("dtype: 'int8' is a graph of the onnx backend (an export made by "
                         "`mhmla-serve export --onnx DIR --int8`), which backend 'auto' never "
                         "picks because its labels differ from torch's; use backend 'onnx' on "
                         "such an export, or float32")
    device = devices.resolve_device(device, "torch")
    on_cpu = _device_type(device) == "cpu" and kernels != "triton" and onnx_importable()
    if on_cpu and dtype in (None, "bfloat16", "bf16") and checked_bf16_available():
        return ServeOptions("auto", device, "bfloat16", kernels)
    dtype = resolve_dtype(dtype, device, "torch")
    if not on_cpu or dtype != "float32":
        return resolve_options("torch", device, dtype, kernels)
    return ServeOptions("auto", device, dtype, kernels)


def checked_bf16_available() -> bool:
    """Whether backend auto's checked bf16 pass can run here: OpenVINO installed and a CPU with
    AMX bf16 units (:func:`.openvino_runner.openvino_bf16_native`), found without importing
    OpenVINO. ``$MHMLA_NO_OPENVINO`` set: never."""
    from .openvino_runner import openvino_bf16_native, openvino_importable

    if os.environ.get("MHMLA_NO_OPENVINO"):
        return False
    return openvino_importable() and openvino_bf16_native()
