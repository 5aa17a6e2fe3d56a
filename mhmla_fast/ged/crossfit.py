"""Cross-fitted teachers for distillation (``mhmla-train ged --hold-out``, ``--teacher A,B``).

A teacher trained on the student's training sentences has seen their labels: on them its
error probabilities q are close to the gold labels (an MPNet AvgL tagger at its best epoch
reaches F0.5 0.89 on FCE train against 0.67 on dev), so they teach little beyond the labels.
Cross-fitting gives every training word a q from a teacher that never saw it: the training
sentences (as read, after ``max_train_sentences``) are cut into K contiguous blocks,

    block k of K (1-based) = sentences [(k - 1) n // K, k n // K)     (n sentences),

teacher k is trained without block k (``--hold-out k/K``), and teacher k labels block k.
Contiguous blocks keep an essay's sentences together in files ordered by essay (FCE's are),
so a teacher has not seen the rest of the essay it labels either.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..configs import same_file

__all__ = ["parse_hold_out", "hold_out_block", "teacher_dirs", "check_cross_fitted_teachers"]


def parse_hold_out(text: str) -> tuple[int, int]:
    """``"k/K"`` -> (k, K) with 1 <= k <= K and K >= 2; ValueError for anything else."""
    head, sep, tail = str(text).partition("/")
    try:
        k, K = int(head), int(tail)
    except ValueError:
        k = K = 0
    if not sep or not 1 <= k <= K or K < 2:
        raise ValueError(f"hold_out: expected k/K with 1 <= k <= K and K >= 2 (block k of K "
                         f"contiguous blocks of the training sentences), got {text!r}")
    return k, K


def hold_out_block(n: int, k: int, K: int) -> range:
    """The indices of block ``k`` (1-based) of ``K`` over ``n`` sentences (module doc); the K
    blocks partition range(n) in order."""
    return range((k - 1) * n // K, k * n // K)


def teacher_dirs(teacher: str) -> list[str]:
    """``--teacher``'s folders: one, or several separated by commas (cross-fitted teachers,
    teacher k labelling block k); ValueError for an empty name."""
    dirs = [d.strip() for d in teacher.split(",")]
    if not all(dirs):
        raise ValueError(f"teacher: expected a model folder or folders separated by commas, "
                         f"got {teacher!r}")
    return dirs


def _training_config(teacher: str) -> dict[str, Any]:
    """The training config a saved tagger records (its ``TaggerConfig.training``)."""
    from .model import TaggerConfig

    path = Path(teacher) / "config.json"
    try:
        config = TaggerConfig.from_json(path.read_text())
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: cannot read the teacher's config ({e})") from e
    training = (config.training or {}).get("config")
    if not isinstance(training, dict):
        raise ValueError(f"{teacher}: the teacher records no training config, so it is not "
                         "known which sentences it was trained on; a cross-fitted teacher "
                         "must come from mhmla-train ged --hold-out k/K")
    return training


def check_cross_fitted_teachers(teachers: Sequence[str], train: str,
                                max_train_sentences: int | None) -> None:
    """ValueError unless teacher k of K (K = len(teachers) >= 2) was trained by ``mhmla-train
    ged --hold-out k/K`` on the same training file and prefix: the teacher that labels block
    k must not have seen it. Reads only the teachers' config.json (seconds), so a wrong
    order or teacher is refused before any teacher's pass."""
    K = len(teachers)
    for k, teacher in enumerate(teachers, 1):
        config = _training_config(teacher)
        if config.get("hold_out") != f"{k}/{K}":
            raise ValueError(f"{teacher}: teacher {k} of {K} must be trained with --hold-out "
                             f"{k}/{K} (it labels block {k}), but its hold_out is "
                             f"{config.get('hold_out')!r}")
        theirs = config.get("train")
        if not (same_file(theirs, train) or theirs == train):
            raise ValueError(f"{teacher}: trained on {theirs}, not on this run's {train}; its "
                             "blocks are not this run's")
        if config.get("max_train_sentences") != max_train_sentences:
            raise ValueError(f"{teacher}: trained with max_train_sentences "
                             f"{config.get('max_train_sentences')!r}, this run "
                             f"{max_train_sentences!r}; its blocks are not this run's")
