"""Full fine-tuning of the essay scorer (encoder trained): the study's protocol, for a GPU.

Under ``torchrun`` (``WORLD_SIZE`` > 1) it trains with DistributedDataParallel like GED
training (see :mod:`mhmla_fast.distributed`): each batch of one prompt's windows is dealt out by
length, gradients equal one process's on the whole batch, rank 0 evaluates and writes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..checkpoint import (CheckpointWriter, check_run_folder, check_same_inputs, load_checkpoint,
                          precision_recorded, recover_run_dir, run_lock)
from ..configs import (EncoderSpec, LayerAttentionConfig, accepts_flat_keywords, check_counts,
                       check_positive, config_diff)
from ..devices import (TRAIN_COMPILE_MODES, applied_compile, applied_precision,
                       check_same_compile, check_train_precision, compiled_step, fused_optimizer,
                       padded_length, training_autocast)
from ..dispatch import backend_unavailable
from ..distributed import check_resume_world, rank_from_env, shard, training_device, wrap
from ..encoder import load_tokenizer
from ..progress import progress_bar
from .data import SCORE_RANGES, Essay, digest_essays
from .fingerprints import local_encoder_fingerprint
from .heads import _epoch_batches
from .model import EssayScorer, ScorerConfig
from .splits import PROMPTS, Log, qwk

__all__ = ["BATCHINGS", "FinetuneConfig", "finetune", "model_name"]

BATCHINGS = ("length", "random")


@accepts_flat_keywords
@dataclass
class FinetuneConfig:
    """Full fine-tuning of :class:`EssayScorer` (encoder trained), the study's protocol.

    Meant for a GPU. Adam (fused where torch has it); ``lr`` for the encoder (study: 1e-5 or
    5e-6), ``head_lr`` for the randomly initialised head; batches of ``batch_size``
    windows of one prompt (``batching``: of similar lengths, or shuffled only); best epoch by
    mean dev QWK; training steps compiled by ``compile`` (default "off"; ``devices.applied_compile``:
    "auto" is CUDA graphs on CUDA in one process, eager elsewhere); a checkpoint
    (:mod:`mhmla_fast.checkpoint`: safetensors + JSON in ``<out>``, written beside the
    training) every ``checkpoint_every`` optimizer steps and after each epoch's dev scoring,
    so a killed run resumes at the last of them, mid-epoch too, with the same batches, dropout
    masks, weights and epoch loss as an uninterrupted run (a larger ``epochs`` may extend a
    finished run, ``checkpoint_every`` may change, and the run folder may move; any other
    change of the config is refused).
    ``encoder_spec.max_length``: the window with ``[CLS]``/``[SEP]`` (None: min(512, encoder
    positions)).
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
    precision: str = "auto"  # devices.TRAIN_PRECISIONS (auto: devices.applied_precision)
    backend: str = "auto"
    # "length": each prompt's shuffled windows sorted by length in pools of 50 batches before
    # they are cut (1.005x the pieces padded on ASAP, against 1.34x); "random": shuffled only
    # (every fine-tuned cell before this option)
    batching: str = "length"
    # torch.compile of the steps' encoder and layer attention (devices.TRAIN_COMPILE_MODES):
    # "auto" is "reduce-overhead" (each step's forward and backward replayed as CUDA graphs) on
    # CUDA in one process and "off" on the CPU and under torchrun; a compiled run pads each
    # batch to batch_size windows of a multiple of devices.COMPILE_PAD_TO pieces. "off" by
    # default until a GPU has measured "auto" here (bench/gpu_issue11.sh aes-epoch)
    compile: str = "off"
    # optimizer steps between checkpoints (how often, not what is trained: free on resume)
    checkpoint_every: int = 200

    def __post_init__(self) -> None:
        check_train_precision(self.precision)
        check_counts(self, "epochs", "batch_size", "checkpoint_every")
        check_positive(self, "lr", "head_lr")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed: expected a non-negative integer, got {self.seed!r}")
        self.layer_attention.check_backend(self.backend)
        self.layer_attention.check_training()
        if self.compile not in TRAIN_COMPILE_MODES:
            raise ValueError(f"compile: expected one of {TRAIN_COMPILE_MODES}, got {self.compile!r}")
        if self.batching not in BATCHINGS:
            raise ValueError(f"batching: expected one of {BATCHINGS}, got {self.batching!r}")
        if self.encoder_spec.freeze == "all":
            raise ValueError("freeze: 'all' leaves nothing of the encoder to fine-tune (the "
                             "CPU protocol trains heads on a frozen encoder); use none or "
                             "word_embeddings")


def model_name(cfg: FinetuneConfig) -> str:
    """The results' name of ``cfg``'s model: head (with J when not 12), "joint" when it scores
    several prompts, objective, "words-frozen" when the word embeddings are not trained, and
    "random-batches" with ``batching="random"``, and the seed when not 0, as in
    "mhmla-cls-finetuned", "avgl-reg-finetuned",
    "mhmla-J6-cls-finetuned-seed1", "mhmla-joint-reg-finetuned-words-frozen" (the CPU
    protocol's names, fine-tuned)."""
    la = cfg.layer_attention
    head = la.mode + (f"-J{la.num_heads}" if la.mode == "mhmla" and la.num_heads != 12 else "")
    head += "-joint" if len(cfg.prompts) > 1 else ""
    objective = "cls" if cfg.objective == "classification" else "reg"
    words = "-words-frozen" if cfg.encoder_spec.freeze == "word_embeddings" else ""
    batches = "-random-batches" if cfg.batching == "random" else ""
    return (f"{head}-{objective}-finetuned{words}{batches}"
            + (f"-seed{cfg.seed}" if cfg.seed else ""))


def finetune(cfg: FinetuneConfig, train_essays: Sequence[Essay], dev_essays: Sequence[Essay], *,
             log: Log | None = print) -> tuple[EssayScorer, dict]:
    """Fine-tune encoder + head on ``train_essays``; returns the best (by dev) scorer and its log.

    Each window carries its essay's score; loss as in :func:`train_head`. The best scorer
    is saved to ``<out>/best``. The run holds :func:`~mhmla_fast.checkpoint.run_lock` on
    ``cfg.out`` (a second process on the same folder raises ``RunLockedError``).
    """
    if not train_essays or not dev_essays:
        raise ValueError(f"fine-tuning needs essays to train on and dev essays to select by "
                         f"({len(train_essays)} train, {len(dev_essays)} dev)")
    if rank_from_env() == 0:  # before any training: not after the first epoch
        check_run_folder(Path(cfg.out), ("best",))
    with run_lock(Path(cfg.out), held=rank_from_env() == 0):
        if rank_from_env() == 0:
            recover_run_dir(Path(cfg.out))
        # every checkpoint is complete on return (the writer waits for its last write)
        with CheckpointWriter(Path(cfg.out)) as writer:
            return _finetune(cfg, train_essays, dev_essays, log=log, writer=writer)


def _finetune(cfg: FinetuneConfig, train_essays: Sequence[Essay], dev_essays: Sequence[Essay], *,
              log: Log | None, writer: CheckpointWriter) -> tuple[EssayScorer, dict]:
    from .model import encode_essay_windows

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    device, dist_ctx = training_device()  # cuda when available; dist_ctx None: one process
    if (why := backend_unavailable(cfg.backend, device.type)) is not None:
        raise ValueError(f"--backend: {why}")
    main_rank = dist_ctx is None or dist_ctx.main
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
    groups = [
        {"params": [p for p in model.encoder.parameters() if p.requires_grad], "lr": cfg.lr},
        {"params": list(model.head.parameters()), "lr": cfg.head_lr},
    ]
    opt = fused_optimizer(torch.optim.Adam, groups)
    config = json.loads(json.dumps(asdict(cfg)))
    # (the encoder's files too, when they are in a local folder: a resume after they changed
    # under the same name is refused)
    data = {"train": _essays_digest(train_essays), "dev": _essays_digest(dev_essays)}
    if (encoder_sha := local_encoder_fingerprint(cfg.encoder_spec.name_or_path)) is not None:
        data["encoder"] = encoder_sha
    precision = applied_precision(cfg.precision, device)
    compile_mode = applied_compile(cfg.compile, device, distributed=dist_ctx is not None)
    # step_in_epoch: the optimizer steps done of epoch + 1; open_epoch: their loss sum, windows
    # and seconds (None between epochs)
    state = {"epoch": 0, "step_in_epoch": 0, "open_epoch": None, "best": -math.inf,
             "best_epoch": 0, "log": [], "config": config, "data": data,
             "precision_applied": precision, "compile_applied": compile_mode}

    def same_run(saved: dict) -> None:  # before the checkpoint's tensors are loaded
        stored = dict(saved["config"])
        if "bf16" in stored:  # a checkpoint from before `precision`: bf16 applied on CUDA only
            stored["precision"] = "auto" if stored.pop("bf16") else "fp32"
        # a checkpoint from before `batching` shuffled its batches only: resumed only as such
        stored.setdefault("batching", "random")
        # precision and compile are compared as what they mean, below ("auto" on the CPU is
        # "fp32" and "off"); the run folder may have moved (as for GED)
        free = ("epochs", "out", "compile", "checkpoint_every") + (
            ("precision",) if precision_recorded(saved) else ())
        diff = config_diff(cfg, stored, free=free)  # old layouts read too
        if diff:
            raise ValueError(f"{out}: a checkpoint of a different run exists ({diff}); "
                             "use another output folder or remove it")
        check_resume_world(saved, dist_ctx, out)
        check_same_compile(saved, compile_mode, out)
        check_same_inputs(saved, precision, data, out)

    saved = load_checkpoint(out, model, opt, check=same_run)
    if saved is not None:
        state = {k: saved[k] for k in ("epoch", "best", "best_epoch", "log")}
        # (a checkpoint from before mid-epoch checkpoints is an epoch's end)
        state.update(step_in_epoch=saved.get("step_in_epoch", 0),
                     open_epoch=saved.get("open_epoch"), config=config, data=data,
                     precision_applied=precision, compile_applied=compile_mode)
        if state["epoch"] > cfg.epochs:
            raise ValueError(f"{out}: the checkpoint is past epoch {cfg.epochs} already "
                             f"(epoch {state['epoch']})")
        if log and main_rank and state["epoch"] < cfg.epochs:
            log(f"resuming {out} from its checkpoint: epoch {state['epoch'] + 1}, after step "
                f"{state['step_in_epoch']} of the epoch")
    state["world_size"] = dist_ctx.world_size if dist_ctx else 1
    autocast = training_autocast(cfg.precision, device)
    # a batch is one prompt's: the other prompts' output layers get no gradient
    net = wrap(model, device, dist_ctx, find_unused=True)
    pad_id, window_limit = tokenizer.pad_token_id, model.config.encoder_spec.max_length
    # one process: the encoder and layer attention (compiled under --compile; the same for
    # every prompt), then the batch's prompt's output layer, eager
    pool, static = model.pooled_windows, {}
    if compile_mode != "off":  # (applied_compile refused a compiled mode under torchrun)
        pool = compiled_step(model.pooled_windows, compile_mode, model, lambda: model.pooled_windows(
            torch.full((1, 2), pad_id, device=device),
            torch.ones((1, 2), dtype=torch.long, device=device)))
        static = {"rows": cfg.batch_size}

    def forward(ids: torch.Tensor, mask: torch.Tensor, prompt: int) -> torch.Tensor:
        return model.head.output(pool(ids, mask), prompt)

    win_len = [len(w) for w in windows]
    win_lengths = np.asarray(win_len, dtype=np.int64)
    lengths = win_lengths if cfg.batching == "length" else None
    steps_per_epoch = len(_epoch_batches(win_prompt, cfg.batch_size, cfg.seed, 0, lengths=lengths))

    def checkpoint() -> None:  # rank 0 writes; every rank holds the same weights and optimizer
        if main_rank:
            writer.save(model, opt, state, state["epoch"] * steps_per_epoch
                        + state["step_in_epoch"])

    while state["epoch"] < cfg.epochs:
        model.train()
        batches = _epoch_batches(win_prompt, cfg.batch_size, cfg.seed, state["epoch"],
                                 lengths=lengths)  # as many in every epoch
        opened = state["open_epoch"] or {"loss_sum": 0.0, "windows": 0, "seconds": 0.0}
        first = state["step_in_epoch"]
        t0, n = time.perf_counter() - opened["seconds"], opened["windows"]
        # the epoch's loss, read at checkpoints and once at its end; the steps done before a
        # resume count once (on rank 0: an all-reduce over the ranks sums it once)
        total_t = torch.full((), opened["loss_sum"] if main_rank else 0.0, dtype=torch.float64,
                             device=device)

        def open_epoch() -> dict:
            loss_sum = total_t.clone()
            if dist_ctx is not None:  # (every rank reaches it at the same step)
                torch.distributed.all_reduce(loss_sum)
            return {"loss_sum": float(loss_sum.item()), "windows": n,
                    "seconds": time.perf_counter() - t0}

        # a bar per epoch where there is a log (not under --quiet), on the main rank only
        bar = progress_bar(total=len(batches), initial=first,
                           desc=f"epoch {state['epoch'] + 1}/{cfg.epochs}",
                           disable=log is None or not main_rank, unit="batch")
        for step in range(first, len(batches)):
            rows = batches[step]
            p = int(win_prompt[rows[0]])
            opt.zero_grad(set_to_none=True)
            if dist_ctx is None:
                if static:
                    static["length"] = padded_length(int(win_lengths[rows].max()), window_limit)
                loss = _window_loss(forward, cfg, rows, p, windows, win_score, pad_id, device,
                                    autocast, reduction="mean", static=static)
                loss.backward()
                total_t += loss.detach().double() * len(rows)
            else:
                # dropout masks from (seed, epoch, step, rank) alone: resume draws the same
                torch.manual_seed(cfg.seed * 1_000_003 + (state["epoch"] * 100_000 + step) * 64
                                  + dist_ctx.rank)
                mine = shard(list(rows), win_len, dist_ctx.rank, dist_ctx.world_size)
                weight = 1.0 if mine else 0.0  # an empty share still joins the all-reduce
                loss_sum = _window_loss(net, cfg, mine or [rows[0]], p, windows, win_score,
                                        pad_id, device, autocast, reduction="sum")
                # DDP averages over ranks: sum * world / global count is the global mean's gradient
                (loss_sum * weight * dist_ctx.world_size / len(rows)).backward()
                total_t += loss_sum.detach().double() * weight
            opt.step()
            n += len(rows)
            bar.update(1)
            bar.set_postfix(windows_s=f"{n / (time.perf_counter() - t0):.1f}", refresh=False)
            state["step_in_epoch"] = step + 1
            # (none before the dev scoring as well, but for the run's first: a GPU epoch is
            # short, and each checkpoint copies the weights and the optimizer's state out of the
            # device)
            if (state["epoch"] * steps_per_epoch + step + 1) % cfg.checkpoint_every == 0:
                state["open_epoch"] = open_epoch()
                checkpoint()
        bar.close()
        opened = state["open_epoch"] = open_epoch()  # (an all-reduce on every rank)
        if dist_ctx is not None and not main_rank:  # rank 0 evaluates and saves; the others wait
            torch.distributed.barrier()
            state.update(epoch=state["epoch"] + 1, step_in_epoch=0, open_epoch=None)
            continue
        if not (out / "checkpoint.json").is_file():
            # the run's first checkpoint, of the epoch's steps (a resume goes on to its dev
            # scoring), complete before best/ can be saved: a best/ without a checkpoint beside
            # it would stop the next run in this folder (check_run_folder)
            checkpoint()
            writer.wait()
        dev_q = {}
        for p in sorted({e.prompt for e in dev_essays}):
            es = [e for e in dev_essays if e.prompt == p]
            pred = model.predict_scores([e.text for e in es], p, tokenizer=tokenizer)
            dev_q[p] = qwk(np.array([e.score for e in es]), pred, p)
        score = float(np.mean(list(dev_q.values())))
        loss_mean = opened["loss_sum"] / max(1, opened["windows"])
        state.update(epoch=state["epoch"] + 1, step_in_epoch=0, open_epoch=None)
        state["log"].append({"epoch": state["epoch"], "loss": loss_mean,
                             "dev_qwk": {str(k): v for k, v in dev_q.items()},
                             "dev_mean_qwk": score, "seconds": time.perf_counter() - t0})
        if log:
            log(f"epoch {state['epoch']}: loss {loss_mean:.4f} dev QWK {score:.4f}")
        if score > state["best"]:
            state["best"], state["best_epoch"] = score, state["epoch"]
            model.config.training = {"protocol": "finetune", "config": asdict(cfg),
                                     "epoch": state["epoch"], "dev_qwk": {str(k): v for k, v in dev_q.items()}}
            model.save(out / "best", tokenizer=tokenizer)
        checkpoint()
        if dist_ctx is not None:
            torch.distributed.barrier()
    best = EssayScorer.load(out / "best", device=device, backend=cfg.backend)
    return best, state


def _essays_digest(essays: Sequence[Essay]) -> str:
    """sha256 of the essays prompt by prompt (each prompt has its own output layer)."""
    h = hashlib.sha256()
    for p in sorted({e.prompt for e in essays}):
        h.update(f"\0prompt {p}".encode())
        digest_essays(h, [e for e in essays if e.prompt == p])
    return h.hexdigest()


def _window_loss(forward, cfg: FinetuneConfig, rows, prompt: int, windows, win_score,
                 pad_id: int, device: torch.device, autocast, reduction: str,
                 static: dict | None = None) -> torch.Tensor:
    """The loss of windows ``rows`` (all of ``prompt``): cross-entropy over the score classes,
    or the squared error of the score scaled to [0, 1], by ``reduction`` ("mean" or "sum").
    ``forward(ids, mask, prompt)`` gives the raw outputs of a batch (the scorer itself, or its
    DDP wrapper); ``static``: ``collate_windows``' ``rows`` and ``length``, whose filler rows
    are left out of the loss."""
    from .model import collate_windows

    ids, mask = collate_windows([windows[j] for j in rows], pad_id, **(static or {}))
    lo, hi = SCORE_RANGES[prompt]
    with autocast:
        raw = forward(ids.to(device), mask.to(device), prompt)[: len(rows)]
    gold = win_score[rows]
    if cfg.objective == "classification":
        return F.cross_entropy(raw.float(), torch.as_tensor(gold - lo, device=device),
                               reduction=reduction)
    target = torch.as_tensor((gold - lo) / (hi - lo), dtype=torch.float32, device=device)
    return F.mse_loss(raw.float(), target, reduction=reduction)
