"""Tests for mhmla_fast.aes.windows: 510-piece windows and per-essay averaging."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mhmla_fast.aes.windows import average_windows, split_windows, window_plan


def check_cover(n: int, spans: list[tuple[int, int]], window: int = 510) -> None:
    covered = np.zeros(n, dtype=bool)
    for s, e in spans:
        assert 0 <= s < e <= n or (n == 0 and (s, e) == (0, 0))
        assert e - s <= window
        assert e - s == window or len(spans) == 1  # full length unless the essay is short
        covered[s:e] = True
    assert covered.all()
    assert [s for s, _ in spans] == sorted(s for s, _ in spans)
    assert spans[-1][1] == n


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, [(0, 0)]),
        (1, [(0, 1)]),
        (509, [(0, 509)]),
        (510, [(0, 510)]),
        (511, [(0, 510), (1, 511)]),
        (1020, [(0, 510), (510, 1020)]),
        (1021, [(0, 510), (510, 1020), (511, 1021)]),
        (5000, [(0, 510), (510, 1020), (1020, 1530), (1530, 2040), (2040, 2550), (2550, 3060),
                (3060, 3570), (3570, 4080), (4080, 4590), (4490, 5000)]),
    ],
)
def test_split_windows_exact(n: int, expected: list[tuple[int, int]]) -> None:
    spans = split_windows(n)
    assert spans == expected
    check_cover(n, spans)
    if len(spans) > 1 and n % 510:
        assert spans[-1][0] < spans[-2][1]  # the last window overlaps the previous one


def test_split_windows_many_lengths_and_sizes() -> None:
    for window in (1, 2, 7, 128, 510):
        for n in list(range(0, 3 * window + 3)) + [10 * window + 1]:
            spans = split_windows(n, window)
            check_cover(n, spans, window)
            assert len(spans) == max(1, -(-n // window))  # ceil(n / window), at least one


def test_split_windows_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        split_windows(-1)
    with pytest.raises(ValueError):
        split_windows(10, 0)


def test_window_plan() -> None:
    spans, index = window_plan([3, 1021, 0, 510], window=510)
    assert spans == [(0, 3), (0, 510), (510, 1020), (511, 1021), (0, 0), (0, 510)]
    assert index == [0, 1, 1, 1, 2, 3]


def test_average_windows_numpy() -> None:
    preds = np.array([1.0, 2.0, 4.0, 3.0, 5.0])
    index = np.array([0, 1, 1, 2, 1])
    out = average_windows(preds, index)
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, [1.0, 11.0 / 3.0, 3.0])
    two_d = np.stack([preds, 10 * preds], axis=1)
    out2 = average_windows(two_d, index.tolist())
    assert out2.shape == (3, 2)
    np.testing.assert_allclose(out2, [[1.0, 10.0], [11 / 3, 110 / 3], [3.0, 30.0]])
    ints = average_windows(np.array([1, 2, 2]), [0, 0, 1])
    assert ints.dtype == np.float64 and ints.tolist() == [1.5, 2.0]
    f32 = average_windows(np.ones(3, dtype=np.float32), [0, 1, 1])
    assert f32.dtype == np.float32


def test_average_windows_torch() -> None:
    preds = torch.tensor([1.0, 2.0, 4.0, 3.0, 5.0], requires_grad=True)
    index = torch.tensor([0, 1, 1, 2, 1])
    out = average_windows(preds, index)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, torch.tensor([1.0, 11.0 / 3.0, 3.0]))
    out.sum().backward()
    torch.testing.assert_close(preds.grad, torch.tensor([1.0, 1 / 3, 1 / 3, 1.0, 1 / 3]))
    logits = torch.arange(10, dtype=torch.float64).reshape(5, 2)
    out2 = average_windows(logits, np.array([0, 1, 1, 2, 1]))
    assert out2.dtype == torch.float64 and out2.shape == (3, 2)
    torch.testing.assert_close(out2, torch.tensor([[0.0, 1.0], [14 / 3, 17 / 3], [6.0, 7.0]], dtype=torch.float64))
    # Same answer as numpy on random input.
    rng = np.random.default_rng(1)
    idx = rng.integers(0, 7, size=40)
    idx[:7] = np.arange(7)
    x = rng.normal(size=(40, 3))
    np.testing.assert_allclose(average_windows(torch.from_numpy(x), idx).numpy(), average_windows(x, idx))


def test_average_windows_errors() -> None:
    with pytest.raises(ValueError, match="no window"):
        average_windows(np.ones(2), [0, 2])
    with pytest.raises(ValueError, match="no window"):
        average_windows(np.ones(2), [0, 0], n_essays=2)
    with pytest.raises(ValueError, match="shape"):
        average_windows(np.ones(3), [0, 1])
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        average_windows(np.ones(2), [0, 1], n_essays=1)
    with pytest.raises(TypeError):
        average_windows([1.0, 2.0], [0, 1])  # type: ignore[type-var]
    with pytest.raises(ValueError):
        average_windows(np.ones((2, 2, 2)), [0, 1])
