"""Data-parallel training under ``torchrun``: the process group, each rank's share of a global
batch, and the loss normaliser that makes the ranks' gradients add up to the single-process one.

    torchrun --nproc-per-node N -m mhmla_fast.commands.train ged ...

With ``WORLD_SIZE`` > 1 in the environment (torchrun sets it, with ``RANK``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``), :func:`init_distributed` joins the process group: NCCL
when the device is a GPU (each rank on ``cuda:LOCAL_RANK``), gloo on the CPU. Every rank reads
the whole data set and builds the same length-bucketed global batches (they depend only on the
seed and the epoch); :func:`shard` deals each global batch out by length, so every rank gets as
many sentences (one more at most) of similar lengths, and equal work. The loss of a rank is its
token cross-entropy *sum* divided by the global batch's token count and multiplied by the world
size: DistributedDataParallel averages gradients over the ranks, so the result is exactly the
gradient of the global batch's mean loss, the single-process quantity (tested with 2 gloo
processes against one process).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DistContext", "init_distributed", "training_device", "wrap", "check_resume_world",
           "shard", "world_size_from_env"]


@dataclass(frozen=True)
class DistContext:
    """This process's place in the group: ``rank`` of ``world_size``, ``local_rank`` on its node."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def main(self) -> bool:
        """Rank 0 writes checkpoints, logs and the best model, and evaluates."""
        return self.rank == 0


def rank_from_env() -> int:
    """``RANK`` as torchrun sets it: 0 when absent, and 0 in a single process (``WORLD_SIZE``
    absent or 1) whatever ``RANK`` says: a launcher's or a job template's stray ``RANK`` turned
    off a lone run's lock on its folder and its start-up checks."""
    return int(os.environ.get("RANK", "0")) if world_size_from_env() > 1 else 0


def world_size_from_env() -> int:
    """``WORLD_SIZE`` as torchrun sets it (1 when absent)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device_type: str) -> DistContext | None:
    """Join the process group when ``WORLD_SIZE`` > 1 (None otherwise: a single process).

    ``device_type`` "cuda" uses NCCL and selects ``cuda:LOCAL_RANK``; anything else uses gloo.
    """
    if world_size_from_env() <= 1:
        return None
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank)


def training_device() -> tuple[torch.device, DistContext | None]:
    """Where a training process runs and its place in the group: the device rule of
    :func:`mhmla_fast.devices.resolve_device` (under torchrun on a GPU: ``cuda:LOCAL_RANK``) and
    the :class:`DistContext` (None for a single process)."""
    import torch

    from .devices import resolve_device

    device = torch.device(resolve_device())
    ctx = init_distributed(device.type)
    if ctx is not None and device.type == "cuda":
        device = torch.device("cuda", ctx.local_rank)
    return device, ctx


def wrap(model, device: "torch.device", ctx: DistContext | None, *, find_unused: bool = False):
    """``model`` itself for one process; under torchrun, ``DistributedDataParallel`` over it
    (``find_unused``: some trainable parameters may get no gradient in a step)."""
    if ctx is None:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   find_unused_parameters=find_unused)


def check_resume_world(saved: dict, ctx: DistContext | None, out: object) -> None:
    """ValueError when the checkpoint state ``saved`` was written by another number of processes
    than this run has: the global batches would be dealt out differently."""
    before, now = saved.get("world_size", 1), ctx.world_size if ctx else 1
    if before != now:
        raise ValueError(f"{out}: the checkpoint was written by {before} process(es), this run has "
                         f"{now}; resume with as many")


def shard(batch: Sequence[int], lengths: Sequence[int], rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s share of a global batch of sentence indices: the batch sorted by length
    (then index), every ``world_size``-th sentence from position ``rank``. May be empty when
    the batch has fewer sentences than ranks."""
    order = sorted(batch, key=lambda i: (lengths[i], i))
    return order[rank::world_size]
