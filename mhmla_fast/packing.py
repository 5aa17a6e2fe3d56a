"""The one packer (tagging, scoring, training): rows of different lengths into padded batches under a token budget.

Tagging (``Engine.word_probs``, over sentence windows) and scoring (``EssayScorer.predict_scores``
through ``aes.model.token_budget_batches``, over essay windows) both cut their rows with
:func:`pack_by_token_budget`, so a token budget means the same thing in both: a batch of ``B``
rows padded to its longest row ``T`` holds ``B * T <= token_budget`` pieces (a single row longer
than the budget is a batch of its own), with at most ``max_batch`` rows.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["pack_by_token_budget"]


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
    ``max_padding=0.2`` (bench/results/onnx_cpu_discrepancy.md)."""
    if token_budget < 1:
        raise ValueError(f"token_budget: expected a positive integer, got {token_budget}")
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"max_batch: expected a positive integer or None, got {max_batch}")
    if max_padding is not None and max_padding < 0:
        raise ValueError(f"max_padding: expected a fraction >= 0 or None, got {max_padding}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i] if longest_first else lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    longest = real = 0
    for i in order:
        n = lengths[i]
        padded = (len(cur) + 1) * max(longest, n)
        if cur and (padded > token_budget
                    or (max_batch is not None and len(cur) >= max_batch)
                    or (max_padding is not None and len(cur) >= min_rows
                        and padded > (1 + max_padding) * (real + n))):
            batches.append(cur)
            cur, longest, real = [], 0, 0
        cur.append(i)
        longest, real = max(longest, n), real + n
    if cur:
        batches.append(cur)
    return batches
