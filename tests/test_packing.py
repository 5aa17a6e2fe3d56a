"""``packing.cut_length_pools``: the training batches of GED and AES fine-tuning."""

from __future__ import annotations

import numpy as np
import pytest

from mhmla_fast.packing import cut_length_pools


def _cut_by_hand(order, lengths, batch_size, pool_batches):
    """The rule spelled out: pools of whole batches, each sorted by length (ties keep their
    order), then cut."""
    pool, out = batch_size * pool_batches, []
    for start in range(0, len(order), pool):
        chunk = sorted(order[start:start + pool], key=lambda i: lengths[i])
        out += [chunk[k:k + batch_size] for k in range(0, len(chunk), batch_size)]
    return out


@pytest.mark.parametrize("n, batch_size, pool_batches", [(0, 4, 2), (1, 4, 2), (37, 4, 2),
                                                         (40, 4, 5), (200, 8, 50)])
def test_cut_length_pools_sorts_within_pools_of_whole_batches(n, batch_size, pool_batches):
    rng = np.random.default_rng(n)
    order = rng.permutation(n).tolist()
    lengths = rng.integers(1, 6, n).tolist()  # many ties: the sort must be stable
    got = cut_length_pools(order, lengths, batch_size, pool_batches)
    assert [b.tolist() for b in got] == _cut_by_hand(order, lengths, batch_size, pool_batches)
    assert sorted(i for b in got for i in b.tolist()) == list(range(n))  # each row once
    pool = batch_size * pool_batches
    firsts = [0] + list(np.cumsum([len(b) for b in got])[:-1])
    assert all(f // pool == (f + len(b) - 1) // pool for f, b in zip(firsts, got))  # no mix


def test_cut_length_pools_takes_a_subset_of_rows_and_refuses_bad_sizes():
    lengths = np.array([9, 1, 5, 3, 7, 2])
    got = cut_length_pools([4, 0, 2], lengths, 2, 1)  # rows 4, 0, 2 only (one AES prompt)
    assert [b.tolist() for b in got] == [[4, 0], [2]]
    for bad in ((0, 1), (2, 0)):
        with pytest.raises(ValueError, match="batch_size and pool_batches"):
            cut_length_pools([0], lengths, *bad)
