"""What the essay scorer does around its network, in numpy: the shipped scorer's directory, an
essay's windows (:class:`EssayPlan`), an essay's own term from its surface features
(:func:`essay_offsets`, a ridge scorer's ``surface_weights``) and window outputs to integer
scores (:func:`combine_windows`). Shared by the torch scorer (:mod:`.model`) and the ONNX
Runtime one (:mod:`mhmla_fast.serve.score_onnx`); importing this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..texts import raise_if_surrogate, text_list
from .cutpoints import apply_cutpoints
from .data import SCORE_RANGES, denormalise_scores
from .windows import average_windows, split_windows

__all__ = ["FORMAT", "OBJECTIVES", "DECISIONS", "EssayPlan", "combine_windows", "essay_scores",
           "essay_offset", "essay_offsets", "surface_advisories", "surface_bounds_of",
           "empty_essay_error", "refuse_empty_essays",
           "essay_prompts", "essay_texts",
           "near_boundary",
           "piece_windows", "default_model_path", "num_labels", "read_scorer_config"]

FORMAT = "mhmla-aes-scorer/1"  # config.json "format" of a saved scorer
OBJECTIVES = ("classification", "regression")
DECISIONS = ("argmax", "expected")


def read_scorer_config(path: str | Path) -> dict:
    """``config.json`` of a scorer directory (or its export) as a dict; ValueError when it is
    not an essay scorer's. Read without the model classes (no torch)."""
    import json

    file = Path(path) / "config.json"
    data = json.loads(file.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        raise ValueError(f"{file}: not an mhmla essay scorer (format {found!r})")
    return data


def default_model_path() -> Path:
    """The scorer shipped inside the package (since 2026-12-07: frozen MiniLM + per prompt one
    linear map of its per-layer [CLS] vectors and token means and of the essay's surface
    features, a stack of four ridges, cut at fitted cutpoints, 8 prompts;
    :func:`.ridge_scorer.fit_ridge_stack_scorer`)."""
    return Path(__file__).resolve().parents[1] / "models" / "aes-minilm-ridge-stack"


def num_labels(prompt: int) -> int:
    """C_p = hi - lo + 1 score labels of ``prompt``."""
    lo, hi = SCORE_RANGES[int(prompt)]
    return hi - lo + 1


@dataclass
class EssayPlan:
    """One essay cut into windows (``plan_essay`` of a scorer): its prompt, word pieces,
    window spans ``[start, end)`` over the pieces (:func:`.windows.split_windows`), and the
    tokenizer's special ids; window ``w`` is ``[CLS] pieces[start:end] [SEP]``; ``offset``: the
    essay's own term added to its averaged window output (:func:`essay_offsets`; 0 for a
    scorer without one)."""

    prompt: int
    pieces: list[int]
    windows: list[tuple[int, int]]
    cls_id: int
    sep_id: int
    pad_id: int
    offset: float = 0.0

    def window_ids(self, w: int) -> list[int]:
        start, end = self.windows[w]
        return [self.cls_id, *self.pieces[start:end], self.sep_id]


def essay_texts(texts: Sequence[str]) -> list[str]:
    """``texts`` as a list (``texts.text_list``): ValueError for one str (it would be scored
    letter by letter), an element that is not a str, or one holding a lone surrogate (the
    tokenizer failed the whole call on it with a TypeError; about 1 us an essay to look)."""
    texts = text_list(texts, "essay")
    raise_if_surrogate(texts, "texts")
    return texts


def refuse_empty_essays(windows: Sequence[Sequence[int]], essay_index: Sequence[int]) -> None:
    """ValueError naming the first essay that gives no word pieces (its one window is
    ``[CLS] [SEP]``, :func:`piece_windows`): an empty or blank essay, or one of characters the
    tokenizer keeps none of, which a scorer would give a plausible score (prompt 8's 10 for
    "   "). ``mhmla-serve score`` and HTTP answer such an essay with an error record instead."""
    for window, e in zip(windows, essay_index):
        if len(window) == 2:
            raise empty_essay_error(f"texts[{e}]")


def empty_essay_error(name: str = "text") -> ValueError:
    """The error of an essay ``name`` that gives no word pieces (:func:`refuse_empty_essays`)."""
    return ValueError(f"{name}: gives no word pieces (an empty or blank essay, or characters "
                      "the tokenizer keeps none of); it cannot be scored")


def essay_prompts(n_texts: int, prompt: int | Sequence[int], known: Sequence[int]) -> list[int]:
    """Each of ``n_texts`` essays' prompt (one ``prompt`` for all, or one per essay); ValueError
    when the counts differ or a prompt is not among ``known`` (the scorer's heads; one
    ``prompt`` is checked even for no essays)."""
    if isinstance(prompt, np.ndarray) and prompt.ndim == 0:  # a numpy scalar's array form
        prompt = prompt.item()
    one = isinstance(prompt, (int, np.integer)) and not isinstance(prompt, bool)
    given = [prompt] if one or isinstance(prompt, (str, bytes)) or not isinstance(
        prompt, Iterable) else list(prompt)
    bad = [p for p in given if isinstance(p, bool) or not isinstance(p, (int, np.integer))]
    if bad:  # int(1.9) would score an essay on prompt 1's scale
        raise ValueError(f"prompts: expected integers, got {bad[0]!r}")
    prompts = [int(prompt)] * n_texts if one else [int(p) for p in given]
    if len(prompts) != n_texts:
        raise ValueError(f"{n_texts} texts but {len(prompts)} prompts")
    unknown = sorted({int(p) for p in given} - set(known))  # (one prompt: checked for no essays)
    if unknown:
        raise ValueError(f"prompts {unknown}: this scorer has heads for prompts "
                         f"{list(known)} only")
    return prompts


SurfaceBounds = dict[int, tuple[Sequence[float], Sequence[float]]]


def essay_offsets(texts: Sequence[str], prompts: Sequence[int],
                  surface_weights: dict[int, Sequence[float]],
                  surface_bounds: SurfaceBounds | None = None) -> np.ndarray | None:
    """Each essay's own term of a regression scorer with surface weights, in normalised score
    units: ``o_e = clip(s(text_e), lo_p, hi_p) . c_{prompt_e}`` [n_essays] float64, ``s`` the
    raw surface features (:func:`.surface.surface_features`), ``c_p`` ``surface_weights[p]``
    [len(SURFACE_FEATURES)] (0 for a prompt without weights) and ``(lo_p, hi_p)``
    ``surface_bounds[p]``, the features' range on the essays the weights were fitted on (none:
    not clipped). The linear term is never extrapolated past what it was fitted on: a single
    2,000-letter "word" made the mean word length 2,000 (at most 5.8 in ASAP) and the score
    the scale's top. None when ``surface_weights`` is empty (the scorer has no such term). It
    is added to the essay's averaged window outputs before the cut (:func:`combine_windows`'
    ``offsets``)."""
    if not surface_weights:
        return None
    from .surface import surface_features

    s = surface_features(list(texts))
    bounds = surface_bounds or {}
    out = np.zeros(len(texts), dtype=np.float64)
    for e, p in enumerate(prompts):
        c = surface_weights.get(int(p))
        if c is not None:
            x = s[e]
            if int(p) in bounds:
                lo, hi = bounds[int(p)]
                x = np.clip(x, np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64))
            out[e] = float(x @ np.asarray(c, dtype=np.float64))
    return out


def essay_offset(text: str, prompt: int, surface_weights: dict[int, Sequence[float]],
                 surface_bounds: SurfaceBounds | None = None) -> float:
    """One essay's own term (:func:`essay_offsets`), 0.0 for a scorer without surface weights:
    an :class:`EssayPlan`'s ``offset``."""
    offset = essay_offsets([text], [int(prompt)], surface_weights, surface_bounds)
    return 0.0 if offset is None else float(offset[0])


# how far past a surface feature's training range (as a share of the range's width) an essay
# must lie for an advisory: of fold 0's 5,191 dev and test essays (the shipped scorer's bounds
# are its training split's), 1 at 0.25, 9 at 0.1 and 49 at 0; every one-word-repeated essay of
# the review at 0.25 (bench/aes_advisories.py -> bench/results/aes_advisories_fold0.json)
ADVISORY_MARGIN = 0.25


def surface_advisories(texts: Sequence[str], prompts: Sequence[int],
                       surface_bounds: SurfaceBounds | None,
                       margin: float = ADVISORY_MARGIN) -> list[list[dict]]:
    """Per essay, the surface features (:data:`.surface.SURFACE_FEATURES`) that lie far outside
    the range of the essays its prompt's scorer was fitted on: below ``lo - margin (hi - lo)``
    or above ``hi + margin (hi - lo)``, each ``{"feature", "value", "range": [lo, hi]}``
    (an empty list: none; every list empty for a scorer without ``surface_bounds``).

    The score of such an essay is an extrapolation and may mean nothing: the encoder's
    linear map is not clipped, so one word repeated 300 times (distinct / words 0.003, at
    least 0.335 in prompt 4's training essays) scored the top of prompts 4 and 5. An advisory
    says so beside the score, as scoring services flag repetitive, too short or too long
    essays for a human reader; the score itself is unchanged."""
    if not surface_bounds:
        return [[] for _ in texts]
    from .surface import SURFACE_FEATURES, surface_features

    feats = surface_features(list(texts))
    out: list[list[dict]] = []
    for x, p in zip(feats, prompts):
        if int(p) not in surface_bounds:
            out.append([])
            continue
        lo, hi = (np.asarray(v, dtype=np.float64) for v in surface_bounds[int(p)])
        slack = margin * (hi - lo)
        far = np.flatnonzero((x < lo - slack) | (x > hi + slack))
        out.append([{"feature": SURFACE_FEATURES[i], "value": round(float(x[i]), 4),
                     "range": [round(float(lo[i]), 4), round(float(hi[i]), 4)]} for i in far])
    return out


def surface_bounds_of(features: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(lo, hi)``: each surface feature's least and greatest value over the essays of
    ``features`` [n_essays, S] (a prompt's training split): what :func:`essay_offsets` clips
    to."""
    features = np.asarray(features, dtype=np.float64)
    return (tuple(float(v) for v in features.min(0)), tuple(float(v) for v in features.max(0)))


def piece_windows(pieces: Sequence[Sequence[int]], window: int, cls_id: int, sep_id: int
                  ) -> tuple[list[list[int]], list[int]]:
    """Essays' word pieces (no special tokens) -> windows ``[CLS] pieces[s:e] [SEP]`` cut by
    :func:`.windows.split_windows` (an empty essay gives one window ``[CLS] [SEP]``) and the
    essay of each window: ``(windows, essay_index)``."""
    windows: list[list[int]] = []
    index: list[int] = []
    for e, ids in enumerate(pieces):
        ids = list(ids)
        for s, t in split_windows(len(ids), window):
            windows.append([cls_id, *ids[s:t], sep_id])
            index.append(e)
    return windows, index


def essay_scores(window_outputs: Sequence[np.ndarray], essay_index: Sequence[int],
                 prompts: Sequence[int], objective: str = "classification",
                 decision: str = "argmax", cutpoints: dict[int, Sequence[float]] | None = None,
                 offsets: np.ndarray | None = None,
                 ) -> tuple[np.ndarray, list[np.ndarray]]:
    """Integer scores [n_essays] and averaged window outputs of essays of ``prompts`` [n_essays]
    from the outputs of their windows (``window_outputs[j]``: window j's output for its essay's
    prompt, probabilities [C_p] or a value; ``essay_index[j]``: its essay), by
    :func:`combine_windows` per prompt (in float64), with ``cutpoints[p]`` and the essays'
    ``offsets`` [n_essays] (:func:`essay_offsets`) where given; the averaged outputs include
    the offsets."""
    scores = np.zeros(len(prompts), dtype=np.int64)
    outputs: list[np.ndarray] = [np.zeros(0)] * len(prompts)
    for p in sorted(set(prompts)):
        idx = [i for i, q in enumerate(prompts) if q == p]
        local = {e: k for k, e in enumerate(idx)}
        ws = [j for j, e in enumerate(essay_index) if prompts[e] == p]
        window_out = np.stack([np.asarray(window_outputs[j]) for j in ws]).astype(np.float64)
        got, mean = combine_windows(window_out, [local[essay_index[j]] for j in ws], p,
                                    objective, decision, n_essays=len(idx), return_mean=True,
                                    cutpoints=(cutpoints or {}).get(p),
                                    offsets=None if offsets is None else np.asarray(offsets)[idx])
        scores[idx] = got
        for k, i in enumerate(idx):
            outputs[i] = mean[k]
    return scores, outputs


def combine_windows(
    window_outputs: np.ndarray, essay_index: Sequence[int] | np.ndarray, prompt: int,
    objective: str = "classification", decision: str = "argmax", *,
    n_essays: int | None = None, return_mean: bool = False,
    cutpoints: Sequence[float] | None = None, offsets: Sequence[float] | np.ndarray | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Window outputs -> integer essay scores in ``SCORE_RANGES[prompt]``.

    ``mean_e = average_windows(window_outputs, essay_index) (+ offsets_e)``, ``offsets``
    [n_essays] each essay's own term (regression only; :func:`essay_offsets`); classification
    (``window_outputs`` [W, C_p] probabilities): ``lo + argmax(mean_e)`` (ties to the
    lower score), or with ``decision="expected"`` ``round_half_up(sum_k mean_e[k] (lo + k))``;
    regression (``[W]`` values in [0, 1]; a ridge head's are unbounded):
    ``denormalise(mean_e)`` (clip, scale, round half up), or with ``cutpoints`` (regression
    only; [hi - lo] on the score scale) ``lo + #{i : lo + mean_e (hi - lo) >= cutpoints_i}``
    (:mod:`.cutpoints`; unclipped, as the cutpoints were fitted, and the score then clipped
    to the scale). With ``return_mean`` also ``mean_e``.
    """
    lo, hi = SCORE_RANGES[int(prompt)]
    if cutpoints is not None and objective != "regression":
        raise ValueError(f"cutpoints: only a regression scorer has them, not {objective!r}")
    mean = average_windows(np.asarray(window_outputs, dtype=np.float64), essay_index, n_essays)
    if offsets is not None:
        if objective != "regression":
            raise ValueError(f"offsets: only a regression scorer has them, not {objective!r}")
        offsets = np.asarray(offsets, dtype=np.float64)
        if offsets.shape != mean.shape:
            raise ValueError(f"offsets: expected one per essay, shape {list(mean.shape)}, got "
                             f"{list(offsets.shape)}")
        mean = mean + offsets
    if objective == "classification":
        if mean.ndim != 2 or mean.shape[1] != hi - lo + 1:
            raise ValueError(f"prompt {prompt}: expected [W, {hi - lo + 1}] probabilities, "
                             f"got {list(np.shape(window_outputs))}")
        if decision == "argmax":
            scores = lo + mean.argmax(axis=1)
        elif decision == "expected":
            expected = mean @ np.arange(lo, hi + 1, dtype=np.float64) / mean.sum(axis=1)
            scores = denormalise_scores((expected - lo) / (hi - lo), prompt)
        else:
            raise ValueError(f"decision: expected one of {DECISIONS}, got {decision!r}")
    elif objective == "regression":
        if mean.ndim != 1:
            raise ValueError(f"regression window outputs must be [W], got "
                             f"{list(np.shape(window_outputs))}")
        scores = (denormalise_scores(mean, prompt) if cutpoints is None else
                  apply_cutpoints(lo + mean * (hi - lo), cutpoints, prompt))
    else:
        raise ValueError(f"objective: expected one of {OBJECTIVES}, got {objective!r}")
    scores = np.clip(np.asarray(scores, dtype=np.int64), lo, hi)
    return (scores, mean) if return_mean else scores


def near_boundary(mean: np.ndarray, prompt: int, objective: str = "classification",
                  decision: str = "argmax", *, margin: float,
                  cutpoints: Sequence[float] | None = None) -> np.ndarray:
    """Whether each essay's integer score (:func:`combine_windows` on ``mean``, its averaged
    window outputs) could change if every window output moved by less than ``margin``: bool [n].

    An average moves by no more than the largest move of its windows, so with
    ``d = margin``, [lo, hi] = ``SCORE_RANGES[prompt]``:

    regression (``mean`` [n])            |lo + mean (hi - lo) - (k + 1/2)| <= d (hi - lo)
                                         for the nearest k (the rounding boundary; mean
                                         clipped to [0, 1] first), or with ``cutpoints``
                                         for the nearest cutpoint (unclipped, as
                                         :func:`combine_windows` cuts)
    argmax (``mean`` [n, C_p])           p_(1) - p_(2) <= 2 d (the two largest)
    expected (``mean`` [n, C_p])         |E - (k + 1/2)| <= d sum_k |s_k - E| / (P - C_p d),
                                         E = sum_k p_k s_k / P, P = sum_k p_k, s_k = lo + k
                                         (the most E can move; every essay when P - C_p d
                                         is not positive)

    Each test errs toward True (a boundary at the scale's ends, where the score is clipped,
    still counts). ``margin`` 0: nothing is near."""
    if margin < 0:
        raise ValueError(f"margin: expected >= 0, got {margin!r}")
    lo, hi = SCORE_RANGES[int(prompt)]
    mean = np.asarray(mean, dtype=np.float64)
    if margin == 0:
        return np.zeros(len(mean), dtype=bool)
    if objective == "regression":
        if cutpoints is not None:
            x = lo + mean * (hi - lo)
            cuts = np.asarray(cutpoints, dtype=np.float64)
            return np.abs(x[:, None] - cuts[None, :]).min(axis=1) <= margin * (hi - lo)
        x = lo + np.clip(mean, 0.0, 1.0) * (hi - lo)
        return np.abs(x - np.floor(x) - 0.5) <= margin * (hi - lo)
    if cutpoints is not None:
        raise ValueError(f"cutpoints: only a regression scorer has them, not {objective!r}")
    if objective != "classification":
        raise ValueError(f"objective: expected one of {OBJECTIVES}, got {objective!r}")
    if mean.ndim != 2 or mean.shape[1] != hi - lo + 1:
        raise ValueError(f"prompt {prompt}: expected [n, {hi - lo + 1}] probabilities, got "
                         f"{list(mean.shape)}")
    if decision == "argmax":
        if mean.shape[1] < 2:
            return np.zeros(len(mean), dtype=bool)
        top = np.sort(mean, axis=1)
        return top[:, -1] - top[:, -2] <= 2 * margin
    if decision != "expected":
        raise ValueError(f"decision: expected one of {DECISIONS}, got {decision!r}")
    s = np.arange(lo, hi + 1, dtype=np.float64)
    total = mean.sum(axis=1)
    expected = mean @ s / total
    room = total - mean.shape[1] * margin
    reach = margin * np.abs(s[None, :] - expected[:, None]).sum(axis=1) / np.where(
        room > 0, room, 1.0)
    return (room <= 0) | (np.abs(expected - np.floor(expected) - 0.5) <= reach)
