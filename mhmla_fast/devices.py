"""Where work runs: the one rule for "cuda if available, else cpu", and the CPU's physical cores.

Training (``ged/``, ``aes/``) and serving (``serve/options.py``) both ask :func:`resolve_device`,
so the rule is written once and nothing below ``serve/`` has to import from it; likewise
:func:`physical_cores` (ONNX Runtime's default thread count, and what results files record).
Importing this module imports neither torch nor ONNX Runtime; each check imports only the
runtime it asks about.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator

__all__ = [
    "cuda_available", "gpu_device_possible", "resolve_device", "physical_cores", "default_threads",
    "TRAIN_PRECISIONS", "applied_precision", "check_train_precision", "training_autocast",
    "cpu_bf16_native", "cpu_flags", "cpuinfo_fields",
    "TRAIN_COMPILE_MODES", "COMPILE_PAD_TO", "applied_compile", "check_same_compile",
    "compiled_step", "padded_length", "cuda_compilable", "usable_cpus",
]

# Device nodes without which no GPU driver that torch.cuda uses can be reached on Linux: NVIDIA
# (/dev/nvidiactl, /proc/driver/nvidia), ROCm (/dev/kfd), WSL 2 (/dev/dxg).
_GPU_NODES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def gpu_device_possible() -> bool:
    """False when this machine certainly has no GPU that ``torch.cuda`` could use (Linux without
    any GPU driver's device node, or macOS), True otherwise; costs a few ``stat`` calls, so that
    the CPU path need not import torch (1.3 s) to learn that there is no GPU."""
    if sys.platform == "darwin":
        return False
    if not sys.platform.startswith("linux"):
        return True  # no cheap test: ask torch
    return any(os.path.exists(node) for node in _GPU_NODES) or any(
        name.startswith("nvidia") for name in _listdir("/dev"))


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def cuda_available(backend: str = "torch") -> bool:
    """Whether ``backend`` ("torch", "onnx" or "tensorrt") can run on a CUDA GPU here:
    torch: a usable ``torch.cuda`` device (False without importing torch when
    :func:`gpu_device_possible` says there is none); ONNX Runtime: its CUDA execution provider
    is installed; TensorRT: a usable ``torch.cuda`` device (it runs on nothing else)."""
    if backend == "onnx":
        import onnxruntime as ort

        return "CUDAExecutionProvider" in ort.get_available_providers()
    if not gpu_device_possible():
        return False
    import torch

    return torch.cuda.is_available()


def resolve_device(device: str | None = None, backend: str = "torch") -> str:
    """``device`` as given, else "cuda" when ``backend`` can use a CUDA GPU, else "cpu"
    (TensorRT: always "cuda")."""
    if device:
        return str(device)
    if backend == "tensorrt":
        return "cuda"
    return "cuda" if cuda_available(backend) else "cpu"


# How training steps compute: "auto" is bf16 autocast on CUDA and on a CPU that multiplies bf16
# natively (cpu_bf16_native), float32 on other CPUs (where bf16 autocast is several times
# slower than float32)
TRAIN_PRECISIONS = ("auto", "fp32", "bf16")

# /proc/cpuinfo flags of x86 bf16 matrix instructions: AMX (Sapphire Rapids and later) and
# AVX-512 bf16 (Cooper Lake, Zen 4 and later)
_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpuinfo_fields(cpuinfo: str = "/proc/cpuinfo") -> Iterator[tuple[str, str]]:
    """``(key, value)`` of every line of ``cpuinfo`` (Linux), stripped; none where there is no
    file to read."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                yield key.strip(), value.strip()
    except OSError:
        return


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags from the first ``flags`` line of ``cpuinfo`` (Linux, x86);
    empty where there is none."""
    return next((frozenset(v.split()) for k, v in cpuinfo_fields(cpuinfo) if k == "flags"),
                frozenset())


@functools.cache
def cpu_bf16_native() -> bool:
    """Whether this CPU has bf16 matrix instructions (x86 AMX or AVX-512 bf16,
    :func:`cpu_flags`). There, bf16 autocast trained the tagger 1.38x (AMX Xeon) and
    1.49-1.67x (Zen 4) as fast as float32, with the same F0.5 in seed noise (README,
    *Training*)."""
    return not _BF16_FLAGS.isdisjoint(cpu_flags())


def check_train_precision(precision: str) -> str:
    """``precision`` if it is one of :data:`TRAIN_PRECISIONS`, else a ValueError naming them."""
    if precision not in TRAIN_PRECISIONS:
        raise ValueError(f"precision: expected one of {TRAIN_PRECISIONS}, got {precision!r}")
    return precision


def applied_precision(precision: str, device) -> str:
    """What a training ``precision`` means on ``device`` (a ``torch.device``): "bf16" under
    "bf16", and under "auto" on CUDA and on a CPU with :func:`cpu_bf16_native`; "fp32"
    otherwise."""
    check_train_precision(precision)
    if precision == "auto":
        native = device.type == "cuda" or (device.type == "cpu" and cpu_bf16_native())
        return "bf16" if native else "fp32"
    return precision


def training_autocast(precision: str, device):
    """The ``torch.autocast`` context of a training step on ``device`` (a ``torch.device``):
    bfloat16 matmuls where :func:`applied_precision` is "bf16" (CUDA or CPU), disabled where it
    is "fp32". Losses are taken in float32 either way."""
    import torch

    bf16 = applied_precision(precision, device) == "bf16"
    if bf16 and device.type not in ("cuda", "cpu"):
        raise ValueError(f"precision: bf16 autocast is supported on cuda and cpu, not {device.type}")
    return torch.autocast(device.type if bf16 else "cpu", dtype=torch.bfloat16, enabled=bf16)


# How training steps run their forward and backward: "auto" is "reduce-overhead" (torch.compile
# with CUDA graphs) on CUDA in one process, where it measured 3.3x eager (issue 11), and "off"
# elsewhere (inductor is slower than eager on a 2-core CPU; CUDA graphs are one process only)
TRAIN_COMPILE_MODES = ("auto", "off", "default", "reduce-overhead", "max-autotune")


def applied_compile(mode: str, device, distributed: bool = False,
                    compilable: bool | None = None) -> str:
    """What a training ``--compile`` mode means on ``device`` (a ``torch.device``): under "auto",
    "reduce-overhead" on CUDA in one process where torch.compile can generate GPU code
    (``compilable``, default :func:`cuda_compilable`), and "off" otherwise; any other mode as
    given, except that a compiled mode under torchrun (``distributed``) is refused."""
    if mode not in TRAIN_COMPILE_MODES:
        raise ValueError(f"compile: expected one of {TRAIN_COMPILE_MODES}, got {mode!r}")
    if mode == "auto":
        if device.type != "cuda" or distributed:
            return "off"
        return "reduce-overhead" if (cuda_compilable(device) if compilable is None
                                     else compilable) else "off"
    if mode != "off" and distributed:
        raise ValueError(f"compile: {mode!r} is not supported under torchrun (one process only); "
                         "pass --compile off")
    return mode


# With a compiled mode, a training batch's piece count is padded up to a multiple of this (and
# its rows to the batch size): a few shapes repeat, each compiled and captured once (GED: at most
# 4 at 128 pieces; AES windows: at most 16 at 512)
COMPILE_PAD_TO = 32


def padded_length(longest: int, limit: int) -> int:
    """A compiled step's piece count for a batch whose longest row has ``longest`` pieces: the
    next multiple of :data:`COMPILE_PAD_TO`, at most ``limit`` (the encoder's window)."""
    return min(limit, -(-longest // COMPILE_PAD_TO) * COMPILE_PAD_TO)


def check_same_compile(meta: dict, applied: str, out) -> None:
    """Refuse to go on under another ``--compile`` mode: ``applied`` is what this run's steps
    would run under (:func:`applied_compile`), and the checkpoint's is its record
    ``compile_applied``, else its config's mode as spelled ("off" before the option existed). A
    compiled run pads its batches to fixed shapes, which draws other dropout masks, so a resume
    under another mode would match neither uninterrupted run."""
    saved = meta.get("compile_applied") or meta["config"].get("compile", "off")
    if saved != applied:
        raise ValueError(f"{out}: a checkpoint of a different run exists (its steps ran with "
                         f"--compile {saved}, this run's would run with {applied}; --compile auto "
                         f"means reduce-overhead on CUDA and off on the CPU); pass --compile "
                         f"{saved} to go on as the run started, or use another --out")


def compiled_step(fn, mode: str, model, warm_up):
    """``torch.compile(fn)`` in a training ``mode`` other than "off" ("default" is
    torch.compile's own default), after one eager call ``warm_up()`` of ``model`` in eval mode
    without gradients: a model's lazy set-up on its first call (transformers installs output
    hooks under a lock, which dynamo cannot trace) stays out of the graph, and the call draws no
    dropout masks from the run's random stream. The caller puts ``model`` back in train mode."""
    import torch

    model.eval()
    with torch.no_grad():
        warm_up()
    return torch.compile(fn, mode=None if mode == "default" else mode)


def cuda_compilable(device) -> bool:
    """Whether torch.compile's inductor can generate code for CUDA ``device``: Triton is
    installed and the GPU has compute capability 7.0 or more (what inductor's Triton backend
    needs); "auto" modes stay eager elsewhere."""
    import importlib.util

    import torch

    if importlib.util.find_spec("triton") is None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (7, 0)


def fused_optimizer(optimizer_class, groups, **kwargs):
    """``optimizer_class(groups, fused=True, **kwargs)`` (torch's Adam, AdamW: one fused kernel
    for every parameter, on the CPU and CUDA in recent torch), or the unfused form where this
    torch or device has no fused one."""
    try:
        return optimizer_class(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return optimizer_class(groups, **kwargs)


def default_threads() -> int:
    """CPU threads for a runtime given none: ``$OMP_NUM_THREADS`` when it is a positive
    integer (as torch honours it), else :func:`physical_cores`."""
    try:
        n = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        n = 0
    return n if n > 0 else physical_cores()


def usable_cpus() -> int:
    """Logical CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def physical_cores() -> int:
    """Physical CPU cores usable by this process (hyper-threads not counted)."""
    usable = usable_cpus()
    cores = set()
    phys = None
    for key, value in cpuinfo_fields():
        if key == "physical id":
            phys = value
        elif key == "core id":
            cores.add((phys, value))
    if not cores:
        try:
            import psutil

            n = psutil.cpu_count(logical=False)
            if n:
                cores = set(range(n))
        except ImportError:
            pass
    return max(1, min(usable, len(cores))) if cores else max(1, usable)
