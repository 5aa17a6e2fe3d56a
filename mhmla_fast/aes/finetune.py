"""Full fine-tuning of the essay scorer (encoder trained): the study's protocol, for a GPU."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..checkpoint import load_checkpoint, save_checkpoint
from ..configs import EncoderSpec, LayerAttentionConfig, accepts_flat_keywords, config_diff
from ..devices import resolve_device
from ..encoder import load_tokenizer
from .data import SCORE_RANGES, Essay
from .heads import _epoch_batches
from .model import EssayScorer, ScorerConfig
from .splits import PROMPTS, Log, qwk

__all__ = ["FinetuneConfig", "finetune"]


@accepts_flat_keywords
@dataclass
class FinetuneConfig:
    """Full fine-tuning of :class:`EssayScorer` (encoder trained), the study's protocol.

    Meant for a GPU (not run on ASAP here). Adam; ``lr`` for the encoder (study: 1e-5 or
    5e-6), ``head_lr`` for the randomly initialised head; batches of ``batch_size``
    windows of one prompt; best epoch by mean dev QWK; a checkpoint after every epoch
    (:mod:`mhmla_fast.checkpoint`: safetensors + JSON in ``<out>``) so a killed run resumes at
    the last finished epoch, with the same batches, dropout masks and weights as an
    uninterrupted run (a larger ``epochs`` may extend a finished run; any other change of the
    config is refused). ``encoder_spec.max_length``: the window with ``[CLS]``/``[SEP]``
    (None: min(512, encoder positions)).
    """

    out: str
    prompts: tuple[int, ...] = PROMPTS
    fold: int = 0
    encoder_spec: EncoderSpec = field(default_factory=EncoderSpec)
    layer_attention: LayerAttentionConfig = field(default_factory=LayerAttentionConfig)
    pooling: str = "cls"
    objective: str = "classification"
    epochs: int = 10
    batch_size: int = 8
    lr: float = 1e-5
    head_lr: float = 1e-3
    seed: int = 0
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
    # the run's head config itself; a copy of the encoder spec (the scorer fills in its length)
    scfg = ScorerConfig(encoder_spec=dataclasses.replace(cfg.encoder_spec),
                        layer_attention=cfg.layer_attention, pooling=cfg.pooling,
                        objective=cfg.objective, prompts=tuple(cfg.prompts))
    model = EssayScorer(scfg, backend=cfg.backend).to(device)
    tokenizer = load_tokenizer(cfg.encoder_spec)
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
        diff = config_diff(cfg, saved["config"], free=("epochs",))  # old layouts read too
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
