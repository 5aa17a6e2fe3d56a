"""A memory checker for Triton kernels run by the interpreter (TRITON_INTERPRET=1).

On a GPU an out-of-bounds access can fault, or read and write other tensors silently; two
programs of one launch storing to one address race. The interpreter runs the programs one after
another on host memory, so neither shows there by itself. :func:`interpreter_memcheck` watches
every load and store of every launch in its block:

* an access is *out of bounds* when an address its mask lets through lies outside every tensor
  argument of the launch (each tensor's extent: from its first element to its last, by its
  strides, not its whole storage);
* a *race* is an address stored by two different programs of one launch (program = grid index).

Masked-off lanes are not accesses, as on the GPU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Memcheck:
    """What the checked launches did: ``accesses`` counts checked loads and stores per kernel;
    ``out_of_bounds`` counts the out-of-bounds addresses per (kernel, "load" | "store");
    ``races`` counts per kernel the addresses stored by more than one program of a launch."""

    accesses: Counter = field(default_factory=Counter)
    out_of_bounds: Counter = field(default_factory=Counter)
    races: Counter = field(default_factory=Counter)

    @property
    def clean(self) -> bool:
        return not self.out_of_bounds and not self.races


def _extent(t) -> tuple[int, int]:
    """[first byte, one past the last byte] of the elements a strided tensor can reach."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


@contextmanager
def interpreter_memcheck() -> Iterator[Memcheck]:
    """Check the Triton interpreter's launches in the block (module docstring); yields the
    :class:`Memcheck` that fills in as they run."""
    import triton.runtime.interpreter as interp

    report = Memcheck()
    launch: dict = {"kernel": None, "extents": [], "program": None, "stores": {}}
    builder = interp.InterpreterBuilder
    saved = {name: getattr(cls, name) for cls, name in
             ((interp.GridExecutor, "_init_args_hst"), (interp.GridExecutor, "__call__"),
              (builder, "set_grid_idx"), (builder, "create_masked_load"),
              (builder, "create_masked_store"))}

    def init_args(self, args_dev, kwargs):
        args, kw = saved["_init_args_hst"](self, args_dev, kwargs)
        launch["kernel"] = self.fn.__name__
        launch["extents"] = [_extent(t) for t in [*args, *kw.values()]
                             if hasattr(t, "data_ptr") and t.numel()]
        launch["stores"] = {}
        return args, kw

    def call(self, *args, **kwargs):
        out = saved["__call__"](self, *args, **kwargs)
        stores = [np.unique(np.concatenate(a)) for a in launch["stores"].values()]
        if len(stores) > 1:
            _, counts = np.unique(np.concatenate(stores), return_counts=True)
            if (counts > 1).any():
                report.races[launch["kernel"]] += int((counts > 1).sum())
        launch["stores"] = {}
        return out

    def set_grid_idx(self, x, y, z):
        launch["program"] = (x, y, z)
        return saved["set_grid_idx"](self, x, y, z)

    def check(kind, ptrs, mask, itemsize) -> np.ndarray:
        addrs = ptrs.data[mask.data.astype(bool)]
        report.accesses[launch["kernel"]] += 1
        inside = np.zeros(addrs.shape, dtype=bool)
        for lo, hi in launch["extents"]:
            inside |= (addrs >= lo) & (addrs + itemsize <= hi)
        if not inside.all():
            report.out_of_bounds[(launch["kernel"], kind)] += int((~inside).sum())
        return addrs

    def load(self, ptrs, mask, other, *rest):
        elem = interp._get_np_dtype(ptrs.get_element_ty())
        check("load", ptrs, mask, np.dtype(elem).itemsize)
        return saved["create_masked_load"](self, ptrs, mask, other, *rest)

    def store(self, ptrs, value, mask, *rest):
        addrs = check("store", ptrs, mask, value.data.dtype.itemsize)
        launch["stores"].setdefault(launch["program"], []).append(addrs.astype(np.uint64))
        return saved["create_masked_store"](self, ptrs, value, mask, *rest)

    interp.GridExecutor._init_args_hst = init_args
    interp.GridExecutor.__call__ = call
    builder.set_grid_idx = set_grid_idx
    builder.create_masked_load = load
    builder.create_masked_store = store
    try:
        yield report
    finally:
        interp.GridExecutor._init_args_hst = saved["_init_args_hst"]
        interp.GridExecutor.__call__ = saved["__call__"]
        for name in ("set_grid_idx", "create_masked_load", "create_masked_store"):
            setattr(builder, name, saved[name])
