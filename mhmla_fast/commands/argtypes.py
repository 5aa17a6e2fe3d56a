"""``type=`` callables for the command-line tools' numeric flags, written once.

Each turns a flag's text into a value or raises :class:`argparse.ArgumentTypeError`, so that
argparse names the flag in its usage error (exit 2) before any model is loaded:

    positive_int("8") -> 8          n >= 1          (--threads, --batch-size, --token-budget)
    non_negative_int("0") -> 0      n >= 0          (--host-workers, --limit-concurrency)
    positive_float("5e-5") -> 5e-5  0 < x < inf     (--lr, --head-lr)
    non_negative_float("0") -> 0.0  0 <= x < inf    (--max-wait-ms, --request-timeout)
    probability("0.5") -> 0.5       0 <= x <= 1     (--threshold)
    rate("0.3") -> 0.3              0 <= x < 1      (a dropout rate)
    port("8000") -> 8000            0 <= n <= 65535 (--port; 0: any free port)

NaN and infinity fail every float check. Importing this module imports only argparse.
"""

from __future__ import annotations

import argparse

__all__ = ["positive_int", "non_negative_int", "positive_float", "non_negative_float",
           "probability", "rate", "port"]


def _number(text: str, kind: type, what: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1."""
    n = _number(text, int, "a positive integer")
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return n


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    n = _number(text, int, "an integer >= 0")
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return n


def positive_float(text: str) -> float:
    """A finite number > 0."""
    x = _number(text, float, "a finite number > 0")
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return x


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    x = _number(text, float, "a finite number >= 0")
    if not 0 <= x < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return x


def probability(text: str) -> float:
    """A number from 0 to 1, both included."""
    x = _number(text, float, "a probability from 0 to 1")
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a probability from 0 to 1, got {text}")
    return x


def rate(text: str) -> float:
    """A rate in [0, 1): 1 would drop everything."""
    x = _number(text, float, "a rate in [0, 1)")
    if not 0.0 <= x < 1.0:
        raise argparse.ArgumentTypeError(f"expected a rate in [0, 1), got {text}")
    return x


def port(text: str) -> int:
    """A TCP port, 0 to 65535 (0: the system picks a free one). uvicorn took 99999 and listened
    on 34463 (99999 - 65536) while its log said 99999."""
    n = _number(text, int, "a port from 0 to 65535")
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535, got {text}")
    return n
