"""OpenVINO on a tagger's or an essay scorer's ONNX export, and the bf16 passes checked in fp32.

    OpenVinoRunner(onnx_path, dtype)   (input_ids, attention_mask) int64 [B, T]
                                       -> P(error) float32 [B, T], on the CPU
    checked_runner(export_dir, threshold=t, margin=m)
        p = OpenVINO bf16 pass; rows with a read piece (the engine marks each word's first)
        where |p - t| < m run again in ONNX Runtime fp32 (:class:`.runners.CheckedRunner`),
        so p >= t is the fp32 decision wherever bf16 moved no probability by m or more
    checked_scorer(export_dir, margin=m)
        the same for an essay scorer's export (:class:`.score_onnx.CheckedScorer`): window
        outputs in OpenVINO bf16, the essays whose averaged output lies within m of a rounding
        boundary scored again in ONNX Runtime fp32, so every score is fp32's wherever bf16
        moved no window output by m or more

OpenVINO reads the same ``model.onnx`` as ONNX Runtime (``mhmla-serve export --onnx``, or backend
auto's cached export). On a CPU with AMX (Sapphire Rapids and later) its bf16 precision hint runs
the encoder's matrix multiplies on the AMX units: on 2 cores of such a Xeon a bf16 pass tagged
FCE dev + test about 2.1x as fast as ONNX Runtime fp32. bf16 moves an error probability by up to
0.037 there (FCE dev + test; 0.023 on CoNLL-14 and JFLEG), flipping about 0.1% of labels; the
fp32 re-check within :data:`CHECK_MARGIN` of the threshold takes those back (README, *Backend auto*).

Importing this module imports neither OpenVINO nor ONNX Runtime.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np

from .options import OPENVINO_DTYPES, check_lanes, resolve_options
from .runners import CheckedRunner, Lanes, LaneRunner, check_pass

__all__ = ["OpenVinoRunner", "checked_runner", "checked_scorer", "openvino_importable",
           "openvino_bf16_native", "CHECK_MARGIN", "SCORE_CHECK_MARGIN", "OPENVINO_DTYPES"]

# Rows re-run in fp32 when a piece's bf16 probability lies within this much of the threshold:
# 1.35x the largest bf16 error measured on FCE dev + test (0.037; README, *Backend auto*).
CHECK_MARGIN = 0.05
# Essays re-scored in fp32 when their averaged bf16 output lies within this much (normalised
# score units) of a rounding boundary, for a scorer (or prompt) without margins of its own
# (score_onnx.CHECK_FILE): 1.35x the largest bf16 window-output error of the MHMLA scorer (shipped
# until 2026-12-06; the ridge scorer shipped since has margins of its own) over
# all 12,978 ASAP essays, 0.0111 at prompt 4 (README, *Scoring essays*).
SCORE_CHECK_MARGIN = 0.015
_PRECISION = {"float32": "f32", "bfloat16": "bf16"}


def openvino_importable() -> bool:
    """Whether the ``openvino`` package is installed, found without importing it."""
    from importlib.util import find_spec

    try:
        return find_spec("openvino") is not None
    except (ImportError, ValueError):
        return False


def openvino_bf16_native() -> bool:
    """Whether this CPU has AMX bf16 units (``amx_bf16`` in /proc/cpuinfo), where an OpenVINO
    bf16 pass was measured faster than fp32. AVX-512 bf16 alone (Zen 4) is not enough: bf16
    there was never measured faster through OpenVINO."""
    from ..devices import cpu_flags

    return "amx_bf16" in cpu_flags()


class OpenVinoRunner(LaneRunner):
    """OpenVINO on the CPU: ``(input_ids, attention_mask)`` int64 [B, T] -> P(error) float32
    [B, T] (the graph's first output).

    Args:
        onnx_path: an exported ``model.onnx``.
        dtype: "float32" or "bfloat16" (OpenVINO's inference precision hint; bf16 needs a CPU
            whose OpenVINO reports BF16 among its capabilities, else ValueError).
        threads: CPU threads in all (default: OpenVINO's choice).
        lanes: passes at a time through :meth:`submit`, each on its own OpenVINO stream with
            ``threads / lanes`` threads (:class:`.runners.Lanes`); one infer request per thread.
        cache_dir: where OpenVINO keeps the compiled model (its ``CACHE_DIR``; a start that
            finds it there loads in about 0.1 s instead of 0.35 s); None: compile every time.
    """

    backend = "openvino"
    device = "cpu"

    def __init__(self, onnx_path: str | os.PathLike, *, dtype: str = "float32",
                 threads: int | None = None, lanes: int = 1,
                 cache_dir: str | os.PathLike | None = None):
        import openvino as ov

        from .onnx_export import INPUT_NAMES

        if dtype not in OPENVINO_DTYPES:
            raise ValueError(f"dtype: the openvino backend has {OPENVINO_DTYPES}, got {dtype!r}")
        check_lanes(lanes, "cpu")
        self.path = Path(onnx_path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such ONNX file")
        core = ov.Core()
        if cache_dir is not None:
            core.set_property({"CACHE_DIR": str(cache_dir)})
        if dtype == "bfloat16" and "BF16" not in core.get_property(
                "CPU", "OPTIMIZATION_CAPABILITIES"):
            raise ValueError("dtype: 'bfloat16' with the openvino backend needs a CPU with bf16 "
                             "instructions (OpenVINO reports none here); use float32")
        Lanes.split(threads, lanes)  # enough threads for the lanes
        config = {"INFERENCE_PRECISION_HINT": _PRECISION[dtype], "NUM_STREAMS": lanes}
        if threads:
            config["INFERENCE_NUM_THREADS"] = int(threads)
        model = core.read_model(str(self.path))
        names = [p.get_any_name() for p in model.inputs]
        if sorted(names) != sorted(INPUT_NAMES):
            raise ValueError(f"{self.path}: inputs {names}, expected {list(INPUT_NAMES)}")
        self.compiled = core.compile_model(model, "CPU", config)
        self._output = self.compiled.outputs[0]
        self.dtype, self.lanes = dtype, lanes
        self.threads = int(self.compiled.get_property("INFERENCE_NUM_THREADS"))
        self._local = threading.local()
        self._tensor = ov.Tensor
        self._io = threading.Lock()  # held while a lane sets its inputs or reads its output
        self._lanes = Lanes(lanes) if lanes > 1 else None

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike, dtype: str | None = None, *,
                       device: str | None = None, kernels: str = "auto",
                       threads: int | None = None, lanes: int = 1,
                       cache_dir: str | os.PathLike | None = None) -> OpenVinoRunner:
        """The runner on an export directory's ``model.onnx`` (see :class:`OpenVinoRunner`).
        Raises ValueError for an option OpenVINO cannot honour here (:mod:`.options`),
        FileNotFoundError saying how to export when the graph is missing."""
        from .onnx_export import ONNX_FILE, check_fresh, export_hint

        opts = resolve_options("openvino", device, dtype, kernels, lanes=lanes)
        check_fresh(path)
        file = Path(path) / ONNX_FILE
        if not file.is_file():
            raise FileNotFoundError(f"{path}: no ONNX export ({ONNX_FILE} is missing). "
                                    f"{export_hint(path)}")
        return cls(file, dtype=opts.dtype, threads=threads, lanes=lanes, cache_dir=cache_dir)

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        ids, mask = check_pass(input_ids, attention_mask)
        request = getattr(self._local, "request", None)
        if request is None:  # one per thread: a request is not to be shared between threads
            request = self._local.request = self.compiled.create_infer_request()
        # The request reads ``ids`` and ``mask`` where they are (they outlive this synchronous
        # call), and only one lane at a time sets inputs or reads an output; the pass itself
        # runs unlocked. Two lanes writing their requests' own input tensors at once (what
        # ``infer(inputs)`` does) hung once in about twenty runs of
        # tests/test_bench_openvino_bf16_check.py on 2 cores, CI included (OpenVINO 2026.4.1:
        # both threads blocked in its copy, ``tensor.data[:] = inputs[:]``).
        with self._io:
            request.set_tensor("input_ids", self._tensor(ids, shared_memory=True))
            request.set_tensor("attention_mask", self._tensor(mask, shared_memory=True))
        request.infer()
        with self._io:  # a copy: the request reuses its buffer
            return np.array(request.get_tensor(self._output).data, dtype=np.float32)

    def __repr__(self) -> str:
        lanes = f", lanes={self.lanes}" if self.lanes > 1 else ""
        return (f"OpenVinoRunner({str(self.path)!r}, dtype={self.dtype!r}, "
                f"threads={self.threads}{lanes})")


def checked_runner(export_dir: str | os.PathLike, *, threshold: float,
                   margin: float | None = None, threads: int | None = None,
                   lanes: int = 1, cache_dir: str | os.PathLike | None = None) -> CheckedRunner:
    """An OpenVINO bf16 pass over ``export_dir``'s ``model.onnx``, its rows near ``threshold``
    run again by ONNX Runtime fp32 on the same graph (:class:`.runners.CheckedRunner`; the
    export's validation ties that graph's labels to torch fp32). ``margin`` None:
    :data:`CHECK_MARGIN`; 0 runs bf16 alone.
    ``lanes`` passes at a time, ``threads`` split between them; ``cache_dir``: OpenVINO's
    compiled-model cache. The ONNX Runtime session loads on a second thread while OpenVINO
    compiles (about 0.3 s each)."""
    from concurrent.futures import ThreadPoolExecutor

    from .onnx_export import OnnxRunner

    margin = CHECK_MARGIN if margin is None else margin
    with ThreadPoolExecutor(1) as loader:
        exact = (loader.submit(OnnxRunner.from_model_dir, export_dir, "float32", device="cpu",
                               threads=threads, lanes=lanes) if margin > 0 else None)
        fast = OpenVinoRunner.from_model_dir(export_dir, "bfloat16", threads=threads,
                                             lanes=lanes, cache_dir=cache_dir)
        exact = exact.result() if exact is not None else None
    return CheckedRunner(fast, exact, threshold=threshold, margin=margin, lanes=lanes)


def checked_scorer(export_dir: str | os.PathLike, *,
                   margin: float | dict[int, float] | None = None, threads: int | None = None,
                   cache_dir: str | os.PathLike | None = None):
    """A scorer export (:func:`.score_onnx.export_scorer`) run in OpenVINO bf16, its essays
    near a rounding boundary scored again by ONNX Runtime fp32 on the same graph
    (:class:`.score_onnx.CheckedScorer`; the export's validation ties that graph's scores to
    torch fp32). ``margin``: one for every prompt, or ``{prompt: margin}``; None: the
    export's own per-prompt margins (:func:`.score_onnx.read_check_margins`), and
    :data:`SCORE_CHECK_MARGIN` for a prompt without one; 0 runs bf16 alone. ``threads`` for
    each runtime (they run one after the other); ``cache_dir``: OpenVINO's compiled-model
    cache."""
    from concurrent.futures import ThreadPoolExecutor

    from .onnx_export import EXPORT_META, ONNX_FILE, OnnxRunner
    from .score_onnx import OUTPUT_NAME, CheckedScorer, read_check_margins

    if margin is None:
        own = read_check_margins(export_dir)
        prompts = json.loads((Path(export_dir) / EXPORT_META).read_text())["prompts"]
        margin = {int(p): own.get(int(p), SCORE_CHECK_MARGIN) for p in prompts}
    path = Path(export_dir) / ONNX_FILE
    exact_needed = any(margin.values()) if isinstance(margin, dict) else margin > 0
    with ThreadPoolExecutor(1) as loader:
        exact = (loader.submit(OnnxRunner, path, device="cpu", threads=threads,
                               output_name=OUTPUT_NAME) if exact_needed else None)
        fast = OpenVinoRunner(path, dtype="bfloat16", threads=threads, cache_dir=cache_dir)
        exact = exact.result() if exact is not None else None
    return CheckedScorer(export_dir, fast, exact, margin=margin)
