"""Runners: the network behind the engine, ``(input_ids, attention_mask) -> P(error)``.

Every runner takes int64 arrays [B, T] and returns float32 error probabilities [B, T]. All are
made by :func:`make_runner` with the one load contract of :mod:`.options` (backend, device,
dtype, kernels, threads); an option a runner cannot honour is a ValueError naming it.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..encoder import host_checked_mask
from .options import BACKENDS, resolve_options

__all__ = ["TorchRunner", "CapturedForward", "CheckedRunner", "Pending", "Lanes", "submit",
           "pinned", "upload", "download", "check_margin_option", "check_pass", "LaneRunner",
           "make_runner", "set_torch_threads", "graph_shape", "pad_to_shape", "BACKENDS"]

# The padded shapes of a forward pass replayed from a CUDA graph (TorchRunner(cuda_graphs=True)):
# rows up to the next of GRAPH_ROWS (past the last, a multiple of it), pieces up to a multiple of
# GRAPH_PIECES. The engine's passes on FCE-like text (max_batch 256, at most 128 pieces) then
# take at most 6 x 8 shapes, each captured once.
GRAPH_ROWS = (8, 16, 32, 64, 128, 256)
GRAPH_PIECES = 16


def set_torch_threads(threads: int | None) -> None:
    """``torch.set_num_threads(threads)`` when given (None: leave torch's choice)."""
    if threads:
        import torch

        torch.set_num_threads(int(threads))


class Lanes:
    """Forward passes ``n`` at a time on the CPU: each pass on one of ``n`` threads, the runtime
    given ``threads // n`` intra-op threads (:meth:`split`) instead of all of them for one pass.

    On 2 cores, two single-threaded passes at once tagged FCE dev + test 1.14x faster than one
    pass at a time on both (ONNX Runtime fp32, the same probabilities bit for bit; torch fp32
    1.13x): a pass's many small operators each synchronise the threads that share it. A lone
    pass then runs on fewer threads (1.7-1.85x slower alone), so lanes serve throughput (the
    batch command), not the latency of a single request. ``submit`` returns a :class:`Pending`;
    the runtime must allow concurrent calls (ONNX Runtime's ``run`` does; torch releases the
    GIL in its operators)."""

    def __init__(self, n: int):
        self.n = n
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @staticmethod
    def split(threads: int | None, lanes: int) -> int | None:
        """The intra-op threads of each lane for ``threads`` in all (None: the default,
        :func:`mhmla_fast.devices.default_threads`); a ValueError naming ``lanes`` when there
        are fewer threads than lanes. ``threads`` itself when ``lanes`` is 1."""
        if lanes == 1:
            return threads
        from ..devices import default_threads

        total = int(threads) if threads else default_threads()
        if lanes > total:
            raise ValueError(f"lanes: {lanes} passes at a time need at least as many threads, "
                             f"got threads {total}; use lanes <= threads")
        return total // lanes

    def submit(self, fn, *args) -> Pending:
        """``fn(*args)`` on a lane thread (started at the first call)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.n, thread_name_prefix="mhmla-lane")
            return Pending(self._pool.submit(fn, *args))

    def close(self) -> None:
        """Stop the lane threads once their passes are done (a later submit starts them again)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def graph_shape(rows: int, pieces: int) -> tuple[int, int]:
    """The padded [B, T] a pass of ``rows`` x ``pieces`` is replayed at: B the first of
    :data:`GRAPH_ROWS` that holds ``rows`` (past the last, ``rows`` rounded up to a multiple of
    it), T ``pieces`` rounded up to a multiple of :data:`GRAPH_PIECES`."""
    if rows < 1 or pieces < 1:
        raise ValueError(f"graph_shape: expected a non-empty pass, got {rows} x {pieces}")
    top = GRAPH_ROWS[-1]
    B = next((b for b in GRAPH_ROWS if b >= rows), -(-rows // top) * top)
    return B, -(-pieces // GRAPH_PIECES) * GRAPH_PIECES


def pad_to_shape(input_ids: np.ndarray, attention_mask: np.ndarray, shape: tuple[int, int]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``input_ids`` and ``attention_mask`` [B, T] padded to ``shape`` [B', T'] (int64): the new
    columns are masked out (id 0: masked keys change no real position's output), and each new
    row attends to its first position alone (so that its attention stays defined)."""
    B, T = input_ids.shape
    ids = np.zeros(shape, dtype=np.int64)
    mask = np.zeros(shape, dtype=np.int64)
    ids[:B, :T] = input_ids
    mask[:B, :T] = attention_mask
    mask[B:, 0] = 1
    return ids, mask


class CapturedForward:
    """``fn(input_ids, attention_mask) -> [B, T]`` on CUDA, replayed from CUDA graphs: one graph
    per padded shape (:func:`graph_shape`), captured at the first pass of that shape after an
    uncaptured warm-up pass (lazy initialisation, the Triton autotuner's timings) on a side
    stream; all graphs share one memory pool. A pass copies its padded batch into the graph's
    static inputs, replays it and queues the copy of its output's [B, T] corner to the host, all
    on the current stream and under a lock, so the next pass cannot overwrite an output before
    its copy (:func:`download`) is queued. ``captures`` counts the graphs made.

    Sharing the pool is safe in any replay order here: the static inputs live outside it; a
    graph's output is live from its capture on, so no later capture is given its memory; and
    a graph that reuses an earlier graph's freed intermediates for its own output can only
    overwrite that output on a later pass, after the output's copy to the host, which was
    queued before on the same stream."""

    def __init__(self, fn, device) -> None:
        import threading

        import torch

        self.torch, self.fn, self.device = torch, fn, torch.device(device)
        self._graphs: dict[tuple[int, int], tuple] = {}
        self._pool = None
        self._lock = threading.Lock()
        self.captures = 0

    def _capture(self, shape: tuple[int, int]) -> tuple:
        torch = self.torch
        ids = torch.zeros(shape, dtype=torch.long, device=self.device)
        mask = torch.ones(shape, dtype=torch.long, device=self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.fn(ids, mask)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.fn(ids, mask)
        except Exception as e:
            raise RuntimeError(f"cuda_graphs: the forward pass at shape {shape} could not be "
                               f"captured in a CUDA graph ({type(e).__name__}: {e}); run with "
                               "cuda_graphs off") from e
        self.captures += 1
        return graph, ids, mask, out

    def submit(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> Pending:
        B, T = input_ids.shape
        shape = graph_shape(B, T)
        ids_h, mask_h = pad_to_shape(input_ids, attention_mask, shape)
        with self._lock:
            entry = self._graphs.get(shape)
            if entry is None:
                entry = self._graphs[shape] = self._capture(shape)
            graph, ids, mask, out = entry
            ids.copy_(pinned(ids_h), non_blocking=True)  # straight into the static inputs
            mask.copy_(pinned(mask_h), non_blocking=True)
            graph.replay()
            return download(out[:B, :T])


class TorchRunner:
    """Eager PyTorch: CPU (fp32) or CUDA (bf16 by default, SDPA attention); ``kernels`` is the
    head's implementation ("auto": what ``mhmla_fast.dispatch`` measured faster, the fused
    Triton forward for large batches on CUDA, else eager; "torch"; "triton").
    Device and dtype defaults: :func:`.options.resolve_options`. ``cuda_graphs`` (CUDA only):
    each pass is padded to one of a few shapes and replayed from a CUDA graph
    (:class:`CapturedForward`), which takes the host's per-kernel cost off the pass; the
    probabilities of the real positions are the same function (other kernels may be picked at
    the padded size, so equal up to rounding).

    Where the head runs eager ("torch", or "auto" off CUDA) it runs folded with the classifier
    (:meth:`GedTagger.folded`: the same logits up to rounding, about half the head's work);
    ``fold=False`` runs the head and classifier as trained (for comparisons).
    ``lanes`` (CPU only): passes at a time, torch's threads split between them (:class:`Lanes`;
    torch's thread count is the process's)."""

    backend = "torch"

    def __init__(self, model_dir: str | os.PathLike, *, device: str | None = None,
                 dtype: str | None = None, kernels: str = "auto", threads: int | None = None,
                 fold: bool = True, cuda_graphs: bool = False, lanes: int = 1):
        opts = resolve_options("torch", device, dtype, kernels, cuda_graphs=cuda_graphs,
                               lanes=lanes)
        import torch

        from ..ged.model import GedTagger

        set_torch_threads(Lanes.split(threads, lanes))
        self.lanes = lanes
        self._lanes = Lanes(lanes) if lanes > 1 else None
        self.torch = torch
        self.device = torch.device(opts.device)
        self.dtype = getattr(torch, opts.dtype)
        self.kernels = opts.kernels
        self.model = GedTagger.load(model_dir, device=self.device, dtype=self.dtype,
                                    backend=opts.kernels)
        eager = opts.kernels == "torch" or (opts.kernels == "auto" and self.device.type != "cuda")
        self.folded = fold and eager
        self.net = self.model.folded() if self.folded else self.model
        self.captured = CapturedForward(self._probs, self.device) if cuda_graphs else None

    def _probs(self, ids, mask):
        """P(error) [B, T] of a batch on the device (float32)."""
        return self.torch.softmax(self.net(ids, mask).float(), -1)[..., 1]

    def _eager_probs(self, ids, mask, dense: bool):
        """:meth:`_probs` of a pass run as it comes (not replayed from a CUDA graph), whose
        padding (``dense``: none) was seen on the host, so that the encoder does not read the
        device to find out (:func:`~mhmla_fast.encoder.host_checked_mask`)."""
        return self._probs(ids, host_checked_mask(self.model.encoder, mask, dense))

    def _cpu_probs(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """P(error) of a batch on the CPU, in inference mode (it is per thread: a lane's
        thread enters it itself)."""
        torch = self.torch
        with torch.inference_mode():
            return self._eager_probs(torch.from_numpy(input_ids), torch.from_numpy(attention_mask),
                                     bool(attention_mask.all())).numpy()

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        return self.submit(input_ids, attention_mask).result()

    def close(self) -> None:
        """Stop the lane threads, if any (the runner still works)."""
        if self._lanes is not None:
            self._lanes.close()

    def submit(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> Pending:
        """Start a forward pass and return at once; ``.result()`` waits for the probabilities.

        On CUDA the batch goes up from pinned memory, the pass and the copy of the
        probabilities into a fresh pinned buffer are queued on the current stream, and an event
        marks their end, so the caller packs the next batch (or merges the last one) while the
        GPU works. On the CPU the pass runs on a lane (``lanes`` > 1), else here and the
        result is ready."""
        torch = self.torch
        if self._lanes is not None:
            return self._lanes.submit(self._cpu_probs, input_ids, attention_mask)
        with torch.inference_mode():
            if self.device.type != "cuda":
                return Pending(self._cpu_probs(input_ids, attention_mask))
            if self.captured is not None:
                return self.captured.submit(input_ids, attention_mask)
            ids, mask = (upload(a, self.device) for a in (input_ids, attention_mask))
            return download(self._eager_probs(ids, mask, bool(attention_mask.all())))


def check_pass(input_ids: np.ndarray, attention_mask: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """A pass's ``input_ids`` and ``attention_mask`` as contiguous int64 arrays; a ValueError
    unless they are two arrays of the same shape [B, T]."""
    ids = np.ascontiguousarray(input_ids, dtype=np.int64)
    mask = np.ascontiguousarray(attention_mask, dtype=np.int64)
    if ids.ndim != 2 or ids.shape != mask.shape:
        raise ValueError(f"input_ids {list(ids.shape)} and attention_mask "
                         f"{list(mask.shape)}: expected two arrays of the same shape [B, T]")
    return ids, mask


class LaneRunner:
    """``submit`` and ``close`` of a callable CPU runner whose passes may run ``lanes`` at a
    time: a subclass sets ``_lanes`` (a :class:`Lanes`, or None for one pass at a time)."""

    _lanes: Lanes | None = None

    def submit(self, input_ids: np.ndarray, attention_mask: np.ndarray, *more) -> Pending:
        """Start a pass: on a lane when ``lanes`` > 1 (``.result()`` waits for it), else run
        here (the :class:`Pending` is ready). ``more``: the call's further arguments, if the
        runner takes any (:class:`CheckedRunner`'s ``read``)."""
        if self._lanes is not None:
            return self._lanes.submit(self, input_ids, attention_mask, *more)
        return Pending(self(input_ids, attention_mask, *more))

    def close(self) -> None:
        """Stop the lane threads, if any (the runner still works)."""
        if self._lanes is not None:
            self._lanes.close()


class CheckedRunner(LaneRunner):
    """The labels of an exact runner at about the speed of a fast, approximate one.

        p = fast(input_ids, attention_mask)                                   [B, T]
        rows r with |p[r, j] - threshold| < margin at a read piece j:
            p[r, :T_r] = exact(input_ids[r, :T_r], attention_mask[r, :T_r])

    (T_r: the longest of those rows.) The read pieces are ``read`` [B, T] bool where the caller
    gives it (the engine marks each word's first piece, the only one a label is read from),
    else every piece but [CLS] and [SEP]. A label ``p >= threshold`` at a read piece is then
    exact's wherever the fast runner moved no probability by ``margin`` or more: rows near the
    threshold carry exact's probabilities, the others the fast runner's (within its error of
    exact's). ``exact`` None (or ``margin`` 0) runs the fast runner alone. The engine keeps
    ``threshold`` in step with its own (:meth:`set_threshold`). ``lanes`` > 1: passes that many
    at a time (:class:`Lanes`), each calling both runners on its own thread. ``rows`` and
    ``rechecked`` count the rows seen and run again."""

    takes_read = True  # __call__ and submit accept ``read``

    def __init__(self, fast, exact, *, threshold: float, margin: float, lanes: int = 1):
        if not 0 <= margin < 1:
            raise ValueError(f"margin: expected 0 <= margin < 1, got {margin!r}")
        self.fast, self.exact = fast, (exact if margin > 0 else None)
        self.threshold, self.margin = float(threshold), float(margin)
        self.backend = getattr(fast, "backend", "checked")
        self.device = getattr(fast, "device", "cpu")
        self.dtype = getattr(fast, "dtype", None)
        self.threads, self.lanes = getattr(fast, "threads", None), lanes
        self.rows = self.rechecked = 0
        self._count = threading.Lock()
        self._lanes = Lanes(lanes) if lanes > 1 else None

    def set_threshold(self, threshold: float) -> None:
        self.threshold = float(threshold)

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                 read: np.ndarray | None = None) -> np.ndarray:
        p = np.asarray(self.fast(input_ids, attention_mask), dtype=np.float32)
        if self.exact is None:
            return p
        mask = np.asarray(attention_mask) > 0
        lengths = mask.sum(1)
        near = np.abs(p - self.threshold) < self.margin
        if read is None:
            near &= mask
            near[:, 0] = False  # [CLS]
            near[np.arange(len(near)), np.maximum(lengths - 1, 0)] = False  # [SEP]
        else:
            if np.shape(read) != p.shape:
                raise ValueError(f"read {list(np.shape(read))}: expected the pass's shape "
                                 f"{list(p.shape)}")
            near &= read
        rows = np.flatnonzero(near.any(1))
        if len(rows):
            T = int(lengths[rows].max())
            p[rows, :T] = self.exact(np.ascontiguousarray(input_ids[rows, :T]),
                                     np.ascontiguousarray(attention_mask[rows, :T]))
        with self._count:
            self.rows += len(p)
            self.rechecked += len(rows)
        return p

    def close(self) -> None:
        """Stop the lane threads (the runners' too); the runner still works."""
        super().close()
        for r in (self.fast, self.exact):
            if r is not None and hasattr(r, "close"):
                r.close()

    def __repr__(self) -> str:
        return (f"CheckedRunner({self.fast!r}, exact={self.exact!r}, "
                f"threshold={self.threshold:.6g}, margin={self.margin:g})")


def pinned(array: np.ndarray):
    """``array`` as a CPU tensor in pinned memory (the source of a copy to the GPU that does
    not wait: torch keeps the buffer until the copy is done)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(array)).pin_memory()


def upload(array: np.ndarray, device, dtype=None):
    """``array`` on CUDA ``device`` (as ``dtype``, if given), copied from pinned memory without
    waiting: the copy is queued on the current stream."""
    out = pinned(array).to(device, non_blocking=True)
    return out if dtype is None else out.to(dtype)


def download(tensor) -> Pending:
    """A CUDA ``tensor``'s values as float32, copied into a fresh pinned buffer on the current
    stream; the :class:`Pending` waits for the event recorded after the copy."""
    import torch

    host = torch.empty(tensor.shape, dtype=torch.float32, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return Pending(host, done)


class Pending:
    """A forward pass started by a runner's ``submit``: ``result()`` waits for its end (a CUDA
    event, or a lane's future, if any) and returns the probabilities as a float32 array."""

    __slots__ = ("_out", "_done")

    def __init__(self, out, done=None):
        self._out, self._done = out, done

    def result(self) -> np.ndarray:
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        out = self._out
        if isinstance(out, Future):  # a pass on a lane (Lanes.submit)
            out = out.result()
        return np.asarray(out if isinstance(out, np.ndarray) else out.numpy(), dtype=np.float32)


def submit(runner, input_ids: np.ndarray, attention_mask: np.ndarray, *more) -> Pending:
    """``runner.submit(...)`` where the runner has one (it overlaps with the caller), else the
    runner called now, its result wrapped as ready (``more``: further arguments the runner
    takes, such as :class:`CheckedRunner`'s ``read``)."""
    start = getattr(runner, "submit", None)
    if start is not None:
        return start(input_ids, attention_mask, *more)
    return Pending(np.asarray(runner(input_ids, attention_mask, *more), dtype=np.float32))


def check_margin_option(check_margin: float | None, opts) -> float | None:
    """``check_margin`` (None: the default) checked against resolved options: it applies only
    to the checked bf16 pass (backend "openvino" or "auto" in bfloat16 on the CPU), and lies in
    [0, 1). A ValueError names it otherwise."""
    if check_margin is None:
        return None
    if not (opts.backend in ("openvino", "auto") and opts.dtype == "bfloat16"):
        raise ValueError(f"check_margin: only the checked bf16 pass (backend openvino, or auto "
                         f"on a CPU with AMX, in bfloat16) re-checks labels; backend "
                         f"{opts.backend!r} in {opts.dtype} has none")
    if not 0 <= float(check_margin) < 1:
        raise ValueError(f"check_margin: expected 0 <= margin < 1, got {check_margin!r}")
    return float(check_margin)


def check_auto_torch(model_dir: str | os.PathLike, *, dtype: str | None, device: str | None,
                     kernels: str) -> None:
    """ValueError naming the options when backend "auto" chose torch for them (a dtype, device
    or kernels ONNX Runtime's float32 CPU graph cannot honour) on an ONNX export, which torch
    cannot load (it said "not a tagger directory", naming none of them)."""
    export = Path(model_dir)
    if (export / "model.onnx").is_file() and not (export / "model.safetensors").is_file():
        named = ", ".join(f"{k}={v!r}" for k, v in (("dtype", dtype), ("device", device),
                                                     ("kernels", kernels))
                          if v not in (None, "auto"))
        raise ValueError(
            f"{export} is an ONNX export, which runs in float32 on the CPU: with {named}, "
            "backend 'auto' runs torch, which needs the tagger's own folder; give that, or "
            "leave the option out")


def make_runner(model_dir: str | os.PathLike, *, backend: str = "torch",
                device: str | None = None, dtype: str | None = None, kernels: str = "auto",
                threads: int | None = None, cache: bool | None = None,
                cuda_graphs: bool = False, lanes: int = 1, threshold: float = 0.5,
                check_margin: float | None = None):
    """The runner for ``backend`` on a tagger directory (or an export of one).

    ``device``/``dtype``/``kernels``/``cuda_graphs``/``lanes``: see :mod:`.options`;
    ``threads``: CPU threads in all (torch's intra-op threads; ONNX Runtime's and OpenVINO's,
    split between ``lanes``; TensorRT: torch's, for the host side); ``cache``: the export cache
    of ``backend="auto"`` (:mod:`.export_cache`); ``threshold`` and ``check_margin``: the
    checked bf16 pass's (:func:`.openvino_runner.checked_runner`; the engine keeps the
    threshold in step). Raises ValueError naming the option when ``backend`` cannot honour
    one."""
    opts = resolve_options(backend, device, dtype, kernels, cuda_graphs=cuda_graphs, lanes=lanes)
    margin = check_margin_option(check_margin, opts)
    if opts.backend == "auto":
        from .export_cache import auto_runner

        return auto_runner(model_dir, threads=threads, kernels=opts.kernels, cache=cache,
                           lanes=lanes, dtype=opts.dtype, threshold=threshold,
                           check_margin=margin)
    if opts.backend == "torch":
        if backend == "auto":
            check_auto_torch(model_dir, dtype=dtype, device=device, kernels=kernels)
        return TorchRunner(model_dir, device=opts.device, dtype=opts.dtype, kernels=opts.kernels,
                           threads=threads, cuda_graphs=cuda_graphs, lanes=lanes)
    if backend == "onnx":
        from .onnx_export import OnnxRunner

        return OnnxRunner.from_model_dir(Path(model_dir), device=opts.device, dtype=opts.dtype,
                                         kernels=opts.kernels, threads=threads, lanes=lanes)
    if backend == "openvino":
        from .openvino_runner import OpenVinoRunner, checked_runner

        if opts.dtype == "float32":
            return OpenVinoRunner.from_model_dir(Path(model_dir), "float32", threads=threads,
                                                 lanes=lanes)
        return checked_runner(Path(model_dir), threshold=threshold, threads=threads, lanes=lanes,
                              margin=margin)
    from .tensorrt_engine import TensorRTRunner

    set_torch_threads(threads)
    return TensorRTRunner.from_model_dir(Path(model_dir), device=opts.device, dtype=opts.dtype,
                                         kernels=opts.kernels)
