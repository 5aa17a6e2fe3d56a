"""The one packer (tagging, scoring, training): rows of different lengths into padded batches.

Tagging (``Engine.word_probs``, over sentence windows) and scoring (``EssayScorer.predict_scores``
through ``aes.model.token_budget_batches``, over essay windows) both cut their rows with
:func:`pack_by_token_budget`, so a token budget means the same thing in both: a batch of ``B``
rows padded to its longest row ``T`` holds ``B * T <= token_budget`` pieces (a single row longer
than the budget is a batch of its own), with at most ``max_batch`` rows.

Training (GED's sentences, AES fine-tuning's essay windows) cuts its shuffled rows into
batches of a fixed size with :func:`cut_length_pools`: sorted by length within pools of
batches, so that a batch pads little while the epoch stays shuffled.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["cut_length_pools", "pack_by_token_budget"]


def pack_by_token_budget(lengths: Sequence[int], token_budget: int, max_batch: int | None = None,
                         *, longest_first: bool = False, max_padding: float | None = None,
                         min_rows: int = 8) -> list[list[int]]:
    """Indices of ``lengths`` [n] sorted by length (stable; shortest first, or longest first
    with ``longest_first``) and cut greedily into batches with ``len(batch) * longest <=
    token_budget`` and ``len(batch) <= max_batch`` (None: no limit). Every index is in exactly
    one batch; sorting keeps the padding small.

    ``max_padding``: also close a batch of at least ``min_rows`` rows when the next row would
    make its padded size ``len(batch) * longest`` exceed ``(1 + max_padding)`` times its real
    pieces. Without it, a call with few rows of spread-out lengths (a 512-sentence chunk of the
    CLI, an HTTP micro-batch) packs them into a few wide batches padded to their longest row:
    1.64x the real pieces on FCE dev+test in chunks of 512 at the default budget, 1.16x with
    ``max_padding=0.2`` (bench/results/onnx_cpu_discrepancy.md).

    Each batch is cut in one vectorised step over its candidate rows rather than row by row in
    Python (the engine's own process bounds a GPU engine): 5.4 against 26.8 ms for 40,000
    FCE-like lengths at budget 65,536 on a 2-core EPYC; the same batches as the greedy loop
    (tested)."""
    if token_budget < 1:
        raise ValueError(f"token_budget: expected a positive integer, got {token_budget}")
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"max_batch: expected a positive integer or None, got {max_batch}")
    if max_padding is not None and max_padding < 0:
        raise ValueError(f"max_padding: expected a fraction >= 0 or None, got {max_padding}")
    n_rows = len(lengths)
    if n_rows == 0:
        return []
    lens = np.asarray(lengths, dtype=np.int64)
    # stable: equal lengths keep their input order, shortest or longest first
    order = np.argsort(-lens if longest_first else lens, kind="stable")
    lens = lens[order]
    cap = n_rows if max_batch is None else max_batch
    slack = None if max_padding is None else 1 + max_padding
    batches: list[list[int]] = []
    start = 0
    while start < n_rows:
        # the candidate rows of the batch opening at `start`: no more than max_batch, and no
        # more than the budget holds at this row's length (+1, to see the row that closes it)
        first = int(lens[start])
        width = min(n_rows - start, cap, token_budget // first + 1 if first > 0 else n_rows)
        window = lens[start:start + width]
        rows = np.arange(1, width + 1)  # the batch's rows once window[j] joins it
        padded = rows * np.maximum.accumulate(window)
        closes = padded > token_budget
        if slack is not None:
            closes |= (rows > min_rows) & (padded > slack * np.cumsum(window))
        closes[0] = False  # a batch takes its first row whatever it costs
        stop = start + (int(closes.argmax()) if closes.any() else width)
        batches.append(order[start:stop].tolist())
        start = stop
    return batches


def cut_length_pools(order: Sequence[int], lengths: Sequence[int] | np.ndarray, batch_size: int,
                     pool_batches: int = 50) -> list[np.ndarray]:
    """``order`` (row indices, shuffled by the caller) in consecutive pools of ``batch_size *
    pool_batches`` rows, each pool sorted by ``lengths[row]`` (stable) and cut into batches
    of ``batch_size`` (the last of a pool may be short): int64 index arrays, in pool order.

    A pool is whole batches, so no batch mixes two pools; sorting within pools keeps a batch's
    rows of similar length (GED's FCE sentences, AES windows) and the epoch shuffled."""
    if batch_size < 1 or pool_batches < 1:
        raise ValueError(f"batch_size and pool_batches: expected positive integers, got "
                         f"{batch_size} and {pool_batches}")
    order = np.asarray(order, dtype=np.int64)
    lens = np.asarray(lengths, dtype=np.int64)
    pool = batch_size * pool_batches
    batches: list[np.ndarray] = []
    for start in range(0, len(order), pool):
        chunk = order[start:start + pool]
        chunk = chunk[np.argsort(lens[chunk], kind="stable")]
        batches += [chunk[k:k + batch_size] for k in range(0, len(chunk), batch_size)]
    return batches
