"""Training of the GED tagger (the paper's recipe by default) with exact resume.

Recipe (Kaneko & Komachi 2019): Adam, lr 5e-5, batch 32, 5 epochs, max length 128 word
pieces, dropout 0.3 in the layer attention, cross-entropy on each word's first piece,
the best epoch chosen by F0.5 on the dev set. Options beyond the paper: a linear warm-up and
decay of the learning rate, layer-wise learning rates (lower for lower encoder layers),
artificial errors (corrupted copies of the error-free training sentences,
:mod:`mhmla_fast.ged.synthetic`), knowledge distillation from a trained tagger (``teacher``;
cross-fitted teachers in :mod:`mhmla_fast.ged.crossfit`; ``transfer``: unlabelled sentences the
teacher alone labels), and the steps' precision (bf16 autocast on CUDA by default, opt-in on the
CPU). Batches are length-bucketed (sentences of similar length together, batch order shuffled). The run writes into ``out``:

* ``checkpoint.json`` + ``checkpoint-<step>.safetensors``: model, optimizer and RNG
  state every ``checkpoint_every`` steps, after each epoch's last step (before dev
  evaluation, so a crash there loses no training) and at each epoch end. The JSON is replaced
  atomically after the tensors are on disk, so a run killed at any moment (kill -9)
  resumes from the last checkpoint and ends with the same weights as an uninterrupted one.
  A resumed run may ask for fewer or more epochs: the batches of epoch e depend only on
  the seed and e, so a 3-epoch run is exactly the first 3 epochs of a 5-epoch one. The
  checkpoint records a digest of the train and dev sentences; a resume on other data is refused.
* ``log.json``: one record per epoch (loss, dev scores, speed).
* ``best/``: the best epoch's tagger (config.json + model.safetensors + tokenizer), with
  the decision threshold chosen on dev for F0.5 stored in its config.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..checkpoint import (CheckpointWriter, check_run_folder, check_same_inputs, checkpoint_meta,
                          load_checkpoint, precision_recorded, recover_run_dir, run_lock)
from ..durable import atomic_write_bytes, atomic_write_text
from ..configs import (EncoderSpec, LayerAttentionConfig, accepts_flat_keywords, check_counts,
                       check_positive, config_diff, same_file)
from ..devices import (COMPILE_PAD_TO, TRAIN_COMPILE_MODES, TRAIN_PRECISIONS, applied_compile,
                       applied_precision, check_same_compile, check_train_precision,
                       compiled_step, fused_optimizer, padded_length, training_autocast)
from ..dispatch import backend_unavailable
from ..distributed import check_resume_world, rank_from_env, shard, training_device, wrap
from ..encoder import max_input_length
from ..packing import cut_length_pools
from .crossfit import check_cross_fitted_teachers, hold_out_block, parse_hold_out, teacher_dirs
from .data import Sentence, read_ged, read_unlabelled, sentences_digest
from .metrics import best_threshold, ged_scores
from .synthetic import check_rate as check_synthetic_rate, with_synthetic_errors
from .model import (IGNORE, GedTagger, PackedSentences, TaggerConfig, _ged_encoder,
                    encode_sentences, load_tokenizer)

__all__ = [
    "TrainConfig", "train", "predict_word_probs", "length_bucketed_batches", "lr_factor",
    "layer_lr_groups", "LR_SCHEDULES", "word_loss", "teacher_targets", "word_windows",
]


def _help(text: str, **more) -> dict:
    return {"help": text, **more}


@accepts_flat_keywords
@dataclass
class TrainConfig:
    """Everything a run depends on (stored in the checkpoint and the model's config).

    ``encoder_spec`` and ``layer_attention`` are the tagger's (shared with its
    :class:`~mhmla_fast.ged.model.TaggerConfig`, not copied); the rest is training. The
    flags of ``mhmla-train ged`` are generated from these fields
    (:mod:`mhmla_fast.commands.config_flags`), so a new field gets its flag by being here.
    """

    train: str = field(metadata=_help("training file (FCE .tsv, .m2, JFLEG .src); default: "
                                      "FCE train from the shared data folder"))
    dev: str = field(metadata=_help("dev file for model selection (default FCE dev)"))
    out: str = field(metadata=_help("run directory (checkpoints, log.json, best/)"))
    encoder_spec: EncoderSpec = field(default_factory=_ged_encoder)
    layer_attention: LayerAttentionConfig = field(default_factory=LayerAttentionConfig)
    epochs: int = 5
    batch_size: int = 32
    lr: float = 5e-5
    weight_decay: float = 0.0
    seed: int = 0
    checkpoint_every: int = field(default=200, metadata=_help("steps between checkpoints"))
    eval_batch_size: int = 64
    max_train_sentences: int | None = field(default=None, metadata=_help("a prefix, for quick runs"))
    backend: str = field(default="auto", metadata=_help(
        "layer-attention implementation", choices=("auto", "torch", "triton")))
    progress: bool = field(default=True, metadata=_help("a progress bar per epoch"))
    # learning-rate schedule (the paper: constant): "linear" warms up over the first
    # warmup_ratio of all steps, then decays linearly to 0 at the last step
    lr_schedule: str = field(default="constant", metadata=_help(
        "constant (the paper) or linear warm-up then linear decay to 0",
        choices=("constant", "linear")))
    warmup_ratio: float = field(default=0.0, metadata=_help(
        "fraction of all steps spent warming up (with --lr-schedule linear)"))
    # layer-wise learning rates: encoder layer i of L gets lr * layer_lr_decay^(L - i), the
    # embeddings lr * layer_lr_decay^(L + 1); the head and classifier get lr (1.0: one lr)
    layer_lr_decay: float = field(default=1.0, metadata=_help(
        "encoder layer i of L trains at lr * decay^(L - i), embeddings at decay^(L + 1); the "
        "head at lr (default 1: one learning rate)"))
    # torch.compile of the training step's forward (and, through AOTAutograd, its backward)
    compile: str = field(default="auto", metadata=_help(
        "torch.compile the tagger for training steps: 'reduce-overhead' (CUDA) replays each "
        "step's forward and backward as CUDA graphs, so the host stops launching every kernel "
        f"one by one; batches are then padded to {COMPILE_PAD_TO}-piece multiples and to the "
        "batch size, so that a few shapes repeat (one process only, not under torchrun). "
        "auto (default): reduce-overhead on CUDA in one process, off on the CPU and under torchrun",
        choices=TRAIN_COMPILE_MODES))
    # bf16 autocast of the training steps (evaluation stays float32)
    precision: str = field(default="auto", metadata=_help(
        "training-step precision: auto (bf16 autocast on CUDA and on CPUs with bf16 "
        "instructions, AMX or AVX-512 bf16; float32 on other CPUs), fp32, or bf16",
        choices=TRAIN_PRECISIONS))
    # artificial errors (mhmla_fast.ged.synthetic): corrupted copies of the error-free
    # training sentences, trained on beside the real ones
    synthetic_errors: float = field(default=0.0, metadata=_help(
        "artificial errors: every error-free training sentence is also trained on as a copy "
        "with this many rule-made errors per word (at least one; see mhmla_fast.ged.synthetic); "
        "0 (the paper): none"))
    # knowledge distillation: a trained tagger's word error probabilities on the training set
    # (computed once, kept in the run folder) mixed into each labelled word's target
    teacher: str | None = field(default=None, metadata=_help(
        "a trained GED tagger (model folder, e.g. a larger encoder's runs/<run>/best) whose "
        "error probability q of every training word enters its target: (1 - w) * gold + w * q "
        "(knowledge distillation; w: --teacher-weight); default none (the paper). K folders "
        "separated by commas are cross-fitted teachers: teacher k, trained with --hold-out k/K, "
        "labels block k (mhmla_fast.ged.crossfit)"))
    teacher_weight: float = field(default=0.5, metadata=_help(
        "w, the teacher's share of each training word's target (with --teacher)"))
    # a transfer set: unlabelled sentences whose target is the teacher's q alone
    transfer: str | None = field(default=None, metadata=_help(
        "unlabelled sentences (one per line, tokens separated by spaces) trained on beside the "
        "training file with the teacher's q as their only target (needs --teacher, one folder); "
        "default none"))
    # cross-fitting (mhmla_fast.ged.crossfit): a teacher that never saw the block it labels
    hold_out: str | None = field(default=None, metadata=_help(
        "k/K: train without block k of K contiguous blocks of the training sentences, to make "
        "teacher k of K cross-fitted teachers (see --teacher); default none"))
    extra: dict = field(default_factory=dict, metadata={"cli": False})

    def __post_init__(self) -> None:
        check_train_precision(self.precision)
        check_counts(self, "epochs", "batch_size", "eval_batch_size", "checkpoint_every",
                     "max_train_sentences", optional=("max_train_sentences",))
        check_positive(self, "lr")
        check_positive(self, "weight_decay", or_zero=True)
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule: expected one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio: expected a fraction in [0, 1), got {self.warmup_ratio!r}")
        if self.warmup_ratio > 0 and self.lr_schedule == "constant":
            raise ValueError("warmup_ratio: needs lr_schedule='linear' (the constant schedule has no warm-up)")
        if not 0.0 < self.layer_lr_decay <= 1.0:
            raise ValueError(f"layer_lr_decay: expected a factor in (0, 1], got {self.layer_lr_decay!r}")
        check_synthetic_rate(self.synthetic_errors)
        self.layer_attention.check_backend(self.backend)
        self.layer_attention.check_training()
        if self.layer_lr_decay != 1.0 and self.encoder_spec.freeze == "all":
            raise ValueError("layer_lr_decay: the encoder is frozen (freeze 'all'), so no layer "
                             "of it trains; leave it out, or freeze less")
        if self.compile not in TRAIN_COMPILE_MODES:
            raise ValueError(f"compile: expected one of {TRAIN_COMPILE_MODES}, got {self.compile!r}")
        if isinstance(self.teacher_weight, bool) or not isinstance(self.teacher_weight, (int, float)) \
                or not 0.0 < self.teacher_weight <= 1.0:
            raise ValueError(f"teacher_weight: expected a share in (0, 1], got {self.teacher_weight!r}")
        if self.teacher is None and self.teacher_weight != 0.5:
            raise ValueError("teacher_weight: needs teacher (the tagger whose probabilities it weighs)")
        if self.hold_out is not None:
            parse_hold_out(self.hold_out)
        if self.transfer is not None:
            if self.teacher is None:
                raise ValueError("transfer: needs teacher (its probabilities are the transfer "
                                 "sentences' only targets)")
            if len(teacher_dirs(self.teacher)) > 1:
                raise ValueError("transfer: cross-fitted teachers label the training file's "
                                 "blocks; the transfer sentences belong to none (use one teacher)")
        if self.teacher is not None and len(teacher_dirs(self.teacher)) > 1:
            if self.synthetic_errors:
                raise ValueError("teacher: cross-fitted teachers label the training file's blocks; "
                                 "artificial copies (synthetic_errors) belong to no block")
            if self.hold_out is not None:
                raise ValueError("teacher: cross-fitted teachers label the whole training file; "
                                 "a run with hold_out trains on part of it")


LR_SCHEDULES = ("constant", "linear")
# fields naming files: on resume, two spellings of one path are the same run
PATH_FIELDS = ("train", "dev", "encoder_spec.name_or_path", "teacher", "transfer")


def _same_paths(key: str, a, b, base: str | None = None) -> bool:
    """Whether the values ``a`` (stored, relative to ``base`` when it is relative) and ``b``
    of path field ``key`` name the same files (teacher: each of its comma-separated
    folders)."""
    if key == "teacher" and isinstance(a, str) and isinstance(b, str):
        a, b = teacher_dirs(a), teacher_dirs(b)
        return len(a) == len(b) and all(same_file(x, y, base) for x, y in zip(a, b))
    return same_file(a, b, base)


LOSS_SYNC_STEPS = 50  # the host reads the running loss this often (progress bar and log)


def warmup_steps(cfg: TrainConfig, total_steps: int) -> int:
    """The linear schedule's warm-up, in optimizer steps: ``round(warmup_ratio * total_steps)``."""
    return round(cfg.warmup_ratio * total_steps)


def lr_factor(cfg: TrainConfig, step: int, total_steps: int) -> float:
    """The multiplier of every group's base lr at optimizer step ``step`` (0-based) of
    ``total_steps``: 1 for "constant"; for "linear", (step + 1) / warmup during the first
    ``warmup = round(warmup_ratio * total_steps)`` steps, then (total - step) / (total - warmup)."""
    if cfg.lr_schedule == "constant":
        return 1.0
    warmup = warmup_steps(cfg, total_steps)
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup))


def layer_lr_groups(model: GedTagger, cfg: TrainConfig) -> list[dict]:
    """Optimizer parameter groups with layer-wise learning rates (see ``layer_lr_decay``).

    Encoder layers are recognised by ``encoder.layer.<i>.`` in the parameter name (BERT,
    RoBERTa, ELECTRA, MPNet, ...), embeddings by ``embeddings.``; anything else in the
    encoder (e.g. MPNet's relative attention bias) and the head and classifier get ``lr``.
    """
    import re

    L = model.encoder.config.num_hidden_layers
    by_scale: dict[float, list] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        scale = 1.0
        if name.startswith("encoder."):
            m = re.search(r"(?:^|\.)layer\.(\d+)\.", name)
            if m:
                scale = cfg.layer_lr_decay ** (L - int(m.group(1)))
            elif ".embeddings." in name or name.startswith("encoder.embeddings"):
                scale = cfg.layer_lr_decay ** (L + 1)
        by_scale.setdefault(scale, []).append(param)
    return [{"params": ps, "lr": cfg.lr * scale, "base_lr": cfg.lr * scale}
            for scale, ps in sorted(by_scale.items(), reverse=True)]


def length_bucketed_batches(lengths: Sequence[int], batch_size: int, seed: int,
                            epoch: int, pool_batches: int = 50) -> list[list[int]]:
    """Shuffle, sort pools of ``pool_batches`` batches by length, cut, shuffle batch order.

    Deterministic in (seed, epoch): a resumed run sees the same batches.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(len(lengths), generator=g).numpy()
    batches = cut_length_pools(perm, lengths, batch_size, pool_batches)
    order = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i].tolist() for i in order]


def eval_max_length(model: GedTagger) -> int:
    """Word pieces per sentence when evaluating: as many as the encoder has positions, at most
    512."""
    return min(512, max_input_length(model.encoder.config))


@torch.no_grad()
def predict_word_probs(model: GedTagger, tokenizer, sentences: Sequence[Sequence[str]],
                       *, batch_size: int = 64, max_length: int | None = None,
                       device: str | torch.device = "cpu",
                       encoded: Sequence[tuple[list[int], list[int]]] | None = None,
                       progress: str | None = None) -> list[np.ndarray]:
    """Error probability of every word (at its first piece), batched by length.

    A sentence longer than ``max_length`` pieces (default: as many as the encoder has
    positions, at most 512) is scored in overlapping windows of whole words
    (:func:`word_windows`), each word from the window where it lies farthest from a cut
    (before 2026-12-07, words past the cut got probability 0: predicted correct, silently).
    ``encoded``: the sentences' :func:`encode_sentences` at that ``max_length``, when the
    caller keeps it (training evaluates the same dev set every epoch). ``progress``: a
    progress bar over the batches with that description (default none).
    """
    from ..progress import progress_bar

    model.eval()
    if max_length is None:
        max_length = eval_max_length(model)
    if encoded is None:
        encoded = encode_sentences(tokenizer, sentences, max_length)
    elif len(encoded) != len(sentences):
        raise ValueError(f"encoded: {len(encoded)} sentences, {len(sentences)} given")
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))
    out: list[np.ndarray | None] = [None] * len(encoded)
    packed = PackedSentences(encoded, tokenizer.pad_token_id)
    bar = progress_bar(total=-(-len(order) // batch_size), desc=progress, unit="batch",
                       disable=progress is None)
    cut = []  # sentences whose last words lie past max_length pieces
    for k in range(0, len(order), batch_size):
        idx = order[k:k + batch_size]
        batch = packed.collate(idx)
        logits = model(batch["input_ids"].to(device), batch["attention_mask"].to(device))
        probs = torch.softmax(logits.float(), -1)[..., 1].cpu()
        for row, i in enumerate(idx):
            p = np.zeros(len(sentences[i]), dtype=np.float32)
            wi = batch["word_index"][row]
            sel = wi >= 0
            p[wi[sel].numpy()] = probs[row][sel].numpy()
            out[i] = p
            if len(sentences[i]) and int(wi.max()) < len(sentences[i]) - 1:
                cut.append(i)
        bar.update()
    bar.close()
    if cut:  # again, in windows of whole words that fit
        spans = {i: word_windows(tokenizer, sentences[i], max_length - 2) for i in cut}
        parts = [list(sentences[i][a:b]) for i in cut for a, b in spans[i]]
        done = iter(predict_word_probs(model, tokenizer, parts, batch_size=batch_size,
                                       max_length=max_length, device=device))
        for i in cut:
            windows = spans[i]
            for w, ((a, b), probs_w) in enumerate(zip(windows, done)):
                lo = a if w == 0 else (windows[w - 1][1] + a) // 2  # the middle of an overlap
                hi = b if w == len(windows) - 1 else (b + windows[w + 1][0]) // 2
                out[i][lo:hi] = probs_w[lo - a:hi - a]
    return out  # type: ignore[return-value]


def word_windows(tokenizer, words: Sequence[str], budget: int) -> list[tuple[int, int]]:
    """Overlapping windows ``[(a, b)]`` of whole words covering ``words``, each of at most
    ``budget`` word pieces (a word longer than that alone is a window, cut at scoring), the
    next starting about a quarter of a window before the previous one ends (after its start,
    and early enough to take the next word): every word is scored, and each overlap's middle
    splits it between the two."""
    if budget < 1:
        raise ValueError(f"budget: expected >= 1 word piece, got {budget}")
    enc = tokenizer([list(words)], is_split_into_words=True, add_special_tokens=False,
                    truncation=False)
    pieces = np.zeros(len(words), dtype=np.int64)
    for w in enc.word_ids(0):
        if w is not None:
            pieces[w] += 1
    pieces = np.maximum(pieces, 1)  # a word of no pieces is encoded as the unknown token
    windows: list[tuple[int, int]] = []
    a = 0
    while True:
        b, used = a, 0
        while b < len(words) and (b == a or used + pieces[b] <= budget):
            used += pieces[b]
            b += 1
        windows.append((a, b))
        if b >= len(words):
            return windows
        # the next start: about budget / 4 pieces before b, leaving room for word b
        back, overlap, room = b, 0, min(budget // 4, budget - int(pieces[b]))
        while back - 1 > a and overlap + pieces[back - 1] <= room:
            back -= 1
            overlap += pieces[back]
        a = back


TEACHER_FILE = "teacher_probs.safetensors"  # in the run folder: a resume reads the same targets


def teacher_targets(teacher: str, weight: float, sentences: Sequence[Sentence], out: Path, *,
                    device: torch.device, batch_size: int = 64, compute: bool = True,
                    progress: bool = False, unlabelled: int = 0,
                    resuming: bool = False) -> tuple[list[np.ndarray], str]:
    """Each word's training target t = (1 - weight) * gold + weight * q, q the error
    probability the tagger in folder ``teacher`` gives it (its own word pieces, eval mode,
    float32), one float32 array per sentence, and the sha256 of the q's. ``teacher``: one
    folder, or K separated by commas, teacher k giving the q's of block k of K
    (:mod:`.crossfit`; the caller checks that it was trained without that block). The last
    ``unlabelled`` sentences have no gold labels (a transfer set): their target is q alone
    (one teacher only).

    The q's are computed once and kept in ``out / TEACHER_FILE`` (safetensors: ``probs`` [words],
    ``counts`` [sentences]; metadata: the teacher folders' paths, a fingerprint of their files
    and a digest of the sentences), so a resumed run trains on the same targets. ``resuming``
    (a checkpoint of this run exists): the file is read whatever became of the teacher's
    folder (moved with the project, or gone: a resume needs no teacher), and the checkpoint's
    record of the q's (``check_same_data``) tells whether it is the one trained on; a file for
    another number of words per sentence is refused. Otherwise the file is a cache that no
    checkpoint depends on (a run stopped before its first one): it is read only if it was
    made by the same teacher files for the same sentences, and else computed again, with a
    note. ``compute=False`` (ranks other than the first under torchrun, after the first has
    checked or written the file) only reads it. ``progress``: a progress bar over the
    teacher's pass (minutes for a BERT-base-sized teacher on a CPU)."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save

    path = out / TEACHER_FILE
    counts = np.fromiter((len(s.labels) for s in sentences), dtype=np.int64, count=len(sentences))
    dirs = teacher_dirs(teacher)
    if not 0 <= unlabelled <= len(sentences):
        raise ValueError(f"unlabelled: {unlabelled} of {len(sentences)} sentences")
    if unlabelled and len(dirs) > 1:
        raise ValueError("unlabelled sentences need one teacher: cross-fitted teachers label "
                         "the blocks of the labelled ones")
    source = ",".join(os.path.realpath(d) for d in dirs)
    teacher_files = functools.cache(lambda: _teacher_files(dirs))  # (hashed once, if at all)
    q = None
    if path.exists() or not compute:
        with safe_open(str(path), framework="numpy") as f:
            made = f.metadata() or {}
        saved = load_file(str(path))
        same_counts = np.array_equal(saved["counts"], counts)
        if (resuming or not compute) and not same_counts:
            raise ValueError(f"{path}: the teacher's probabilities of other training sentences; "
                             "restore the training data, or use another --out to train afresh")
        if resuming or not compute:
            q = saved["probs"]
        elif "sentences" not in made or "teacher_files" not in made:
            stale = "without a record of its sentences and teacher files (before 2026-12-07)"
        elif not same_counts or made.get("sentences") != sentences_digest(sentences):
            stale = "for other sentences"
        elif made.get("teacher_files") != teacher_files():
            stale = f"by other teacher files (of {made.get('teacher')})"
        else:
            q = saved["probs"]
        if q is None:
            print(f"{path}: made {stale}, and no checkpoint was trained on it: computing the "
                  "teacher's probabilities again", file=sys.stderr, flush=True)
    if q is None:
        probs = []
        for k, d in enumerate(dirs, 1):
            block = hold_out_block(len(sentences), k, len(dirs))
            model = GedTagger.load(d, device=device)
            name = "teacher" if len(dirs) == 1 else f"teacher {k}/{len(dirs)}"
            probs += predict_word_probs(model, load_tokenizer(d),
                                        [sentences[i].tokens for i in block],
                                        batch_size=batch_size, device=device,
                                        progress=name if progress else None)
            del model
        q = np.concatenate(probs).astype(np.float32) if probs else np.zeros(0, np.float32)
        made = {"teacher": source, "teacher_files": teacher_files(),
                "sentences": sentences_digest(sentences)}
        atomic_write_bytes(path, save({"probs": q, "counts": counts}, metadata=made))
    gold = np.fromiter((y for s in sentences for y in s.labels), dtype=np.float32, count=len(q))
    share = np.full(len(q), weight, np.float32)
    share[int(counts[:len(sentences) - unlabelled].sum()):] = 1.0  # no gold: q alone
    mixed = ((1.0 - share) * gold + share * q).astype(np.float32)
    return np.split(mixed, np.cumsum(counts)[:-1]), hashlib.sha256(q.tobytes()).hexdigest()


def _teacher_files(dirs: Sequence[str]) -> str:
    """Fingerprints of the teacher folders' files (config, tokenizer, weights), in order."""
    from ..aes.fingerprints import files_fingerprint

    return ",".join(files_fingerprint(Path(d)) for d in dirs)


def word_loss(logits: Tensor, labels: Tensor, targets: Tensor | None = None,
              reduction: str = "mean") -> Tensor:
    """Cross-entropy of the labelled pieces (``labels`` [B, T] != IGNORE) of ``logits``
    [B, T, 2], in float32: against the gold label, or, with ``targets`` [B, T] (the error
    probability t each piece aims at), -(t log p_error + (1 - t) log p_correct); the mean over
    labelled pieces (0 where there is none: a batch of empty sentences), or their ``"sum"``.
    With targets equal to the labels both forms agree."""
    logits = logits.float().flatten(0, 1)
    if targets is None:
        flat = labels.flatten()
        loss = F.cross_entropy(logits, flat, ignore_index=IGNORE, reduction=reduction)
        # (the mean of no piece is 0/0; its gradient is 0 either way)
        return loss if reduction == "sum" else torch.where(flat.ne(IGNORE).any(), loss,
                                                           loss.new_zeros(()))
    logp = F.log_softmax(logits, -1)
    t = targets.flatten().to(logp.dtype)
    counted = (labels.flatten() != IGNORE).to(logp.dtype)
    total = (-(t * logp[:, 1] + (1.0 - t) * logp[:, 0]) * counted).sum()
    return total if reduction == "sum" else total / counted.sum().clamp_min(1.0)


def evaluate(model, tokenizer, sentences: Sequence[Sentence], **kw) -> tuple[dict, np.ndarray]:
    probs = predict_word_probs(model, tokenizer, [s.tokens for s in sentences], **kw)
    flat = np.concatenate(probs) if probs else np.zeros(0)
    gold = np.concatenate([np.asarray(s.labels) for s in sentences]) if sentences else flat
    return ged_scores(gold, (flat >= 0.5).astype(int)).to_dict(), flat


# ------------------------------------------------------------------------ train


def _make_optimizer(model, cfg: TrainConfig, device: torch.device):
    # AdamW; weight_decay 0 makes it the paper's Adam
    return fused_optimizer(torch.optim.AdamW, layer_lr_groups(model, cfg), lr=cfg.lr,
                           weight_decay=cfg.weight_decay)


def _check_data_files(cfg: TrainConfig) -> None:
    """FileNotFoundError naming the field (``--train``, ``--dev``, ``--transfer``) whose file is
    not there; a JFLEG split may be given as a folder or as the prefix of its ``.src`` file."""
    for name in ("train", "dev", "transfer"):
        value = getattr(cfg, name)
        if value is None:
            continue
        path = Path(value)
        jfleg_prefix = name != "transfer" and path.with_name(path.name + ".src").is_file()
        if not (path.exists() or jfleg_prefix):
            raise FileNotFoundError(f"--{name} {path}: no such file; give an existing {name} file")


def train(cfg: TrainConfig, *, stop_after_steps: int | None = None) -> Path:
    """Train (or resume) into ``cfg.out``; returns the best model's directory.

    ``stop_after_steps`` ends the run after that many optimizer steps in this call, right
    after a checkpoint (used to test resume). Checkpoints are written by a background thread
    (:class:`~mhmla_fast.checkpoint.CheckpointWriter`); every one is complete on return. The
    run holds :func:`~mhmla_fast.checkpoint.run_lock` on ``cfg.out``: a second process on the
    same folder raises :class:`~mhmla_fast.checkpoint.RunLockedError`.
    """
    _check_data_files(cfg)  # before the run lock: a missing file leaves no fresh cfg.out behind
    if rank_from_env() == 0:  # before any training: not after the first epoch
        check_run_folder(Path(cfg.out), ("best", "log.json"))
    with run_lock(Path(cfg.out), held=rank_from_env() == 0), \
            CheckpointWriter(Path(cfg.out)) as writer:
        if rank_from_env() == 0:
            recover_run_dir(Path(cfg.out))
        return _train(cfg, stop_after_steps, writer)


def _train(cfg: TrainConfig, stop_after_steps: int | None, writer: CheckpointWriter) -> Path:
    from ..progress import progress_bar

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    device, dist_ctx = training_device()  # cuda when available; dist_ctx None: one process
    if (why := backend_unavailable(cfg.backend, device.type)) is not None:
        raise ValueError(f"--backend: {why}")
    main_rank = dist_ctx is None or dist_ctx.main
    torch.manual_seed(cfg.seed)

    train_set = read_ged(cfg.train)
    if cfg.max_train_sentences:
        train_set = train_set[: cfg.max_train_sentences]
    if cfg.hold_out is not None:
        block = hold_out_block(len(train_set), *parse_hold_out(cfg.hold_out))
        train_set = train_set[:block.start] + train_set[block.stop:]
    dev_set = read_ged(cfg.dev)
    for name, data in (("train", train_set), ("dev", dev_set)):
        if not data:
            raise ValueError(f"{getattr(cfg, name)}: no sentences to {name} on")
    # the sentences as read (after max_train_sentences), and the artificial ones made from them:
    # a resume on edited files, or with other artificial errors, is refused
    data = {"train": sentences_digest(train_set), "dev": sentences_digest(dev_set)}
    if cfg.synthetic_errors:
        n_real = len(train_set)
        train_set = with_synthetic_errors(train_set, cfg.synthetic_errors, cfg.seed)
        data["train_synthetic"] = sentences_digest(train_set[n_real:])
    n_transfer = 0
    if cfg.transfer is not None:
        # unlabelled: zeros stand in for the labels (they only mark the words that count); the
        # teacher's q is each word's whole target
        transfer = [Sentence(t, (0,) * len(t), cfg.transfer, i)
                    for i, t in enumerate(read_unlabelled(cfg.transfer), 1)]
        if not transfer:
            raise ValueError(f"{cfg.transfer}: no sentences to transfer")
        data["transfer"] = sentences_digest(transfer)
        train_set, n_transfer = train_set + transfer, len(transfer)
    if not any(1 in s.labels for s in dev_set):
        raise ValueError(f"{cfg.dev}: no word is labelled as an error (i), so F0.5 is 0 in "
                         "every epoch and cannot select a model or a threshold")
    # the tagger holds the run's own encoder spec and head config: one object each
    tagger_cfg = TaggerConfig(encoder_spec=cfg.encoder_spec, layer_attention=cfg.layer_attention)
    model = GedTagger(tagger_cfg, backend=cfg.backend)  # freezes what encoder_spec.freeze names
    model.to(device)
    tokenizer = load_tokenizer(cfg.encoder_spec)
    positions = max_input_length(model.encoder.config)
    max_length = cfg.encoder_spec.max_length or min(512, positions)
    if max_length > positions:
        raise ValueError(f"max_length: {max_length} word pieces, but the encoder has {positions} "
                         "positions")
    precision = applied_precision(cfg.precision, device)
    compile_mode = applied_compile(cfg.compile, device, distributed=dist_ctx is not None)

    def same_config(meta: dict) -> None:  # what a resume can check before any costly set-up
        if meta["config"] != json.loads(json.dumps(asdict(cfg))):
            # the number of epochs may change on resume (with the constant schedule): epoch
            # e's batches depend only on (seed, e), so a shorter run is a prefix of a longer
            # one; a field a checkpoint predates has its default, and a checkpoint in the
            # flat layout of before is read into the groups
            # nor do the run folder's name (a moved run), how often it checkpoints, or how a
            # path to the same file is spelled; --compile is compared as the mode it means,
            # below ("auto" on the CPU is "off")
            free = ("progress", "out", "checkpoint_every", "compile") + (
                ("epochs",) if cfg.lr_schedule == "constant" else ()) + (
                # compared as the arithmetic it means, below ("auto" on the CPU is "fp32")
                ("precision",) if precision_recorded(meta) else ())
            # a stored relative path is read from the folder the checkpoint was written in
            diff = {k: v for k, v in config_diff(cfg, meta["config"], free).items()
                    if not (k in PATH_FIELDS and _same_paths(k, *v, base=meta.get("cwd")))}
            if diff:
                raise ValueError(f"{out}: a checkpoint of a different run exists ({diff}); "
                                 "use another --out or remove it")
        check_resume_world(meta, dist_ctx, out)
        check_same_compile(meta, compile_mode, out)

    def same_run(meta: dict) -> None:  # before the checkpoint's tensors are loaded
        same_config(meta)
        check_same_inputs(meta, precision, data, out)

    targets = None
    if cfg.teacher is not None:
        # a checkpoint of another run, or teachers out of their blocks, are refused before
        # the teacher's pass (minutes) is paid
        if (early := checkpoint_meta(out)) is not None:
            same_config(early)
        resumable = early is not None and (out / TEACHER_FILE).exists()  # needs no teacher
        if len(teachers := teacher_dirs(cfg.teacher)) > 1 and not resumable:
            check_cross_fitted_teachers(teachers, cfg.train, cfg.max_train_sentences)
        for teacher in teachers if not resumable else ():
            # on every rank: all refuse alike, none waits at the barrier (a resume reads the
            # run folder's probabilities, and needs no teacher)
            try:
                TaggerConfig.from_json((Path(teacher) / "config.json").read_text())
            except (OSError, ValueError, TypeError) as err:
                raise ValueError(f"--teacher {teacher}: not a saved tagger ({err})") from None
        if dist_ctx is not None and not main_rank:
            torch.distributed.barrier()  # the first rank computes the teacher's file
        targets, data["teacher"] = teacher_targets(
            cfg.teacher, cfg.teacher_weight, train_set, out, device=device,
            batch_size=cfg.eval_batch_size, compute=main_rank, progress=cfg.progress,
            unlabelled=n_transfer, resuming=early is not None)
        if dist_ctx is not None and main_rank:
            torch.distributed.barrier()
    # the training set's pieces and labels, flat: a step's batch is a few array operations
    packed = PackedSentences(encode_sentences(tokenizer, [s.tokens for s in train_set], max_length),
                             tokenizer.pad_token_id, [s.labels for s in train_set], targets)
    lengths = packed.lengths.tolist()
    optimizer = _make_optimizer(model, cfg, device)
    # layers left out of the selection get no gradient
    net = wrap(model, device, dist_ctx, find_unused=cfg.layer_attention.layers is not None)

    meta = load_checkpoint(out, model, optimizer, check=same_run)
    if meta is not None:
        epoch, step_in_epoch, global_step = meta["epoch"], meta["step_in_epoch"], meta["global_step"]
        log, best = meta["log"], meta["best"]
        if main_rank and epoch < cfg.epochs:
            print(f"resuming {out} from its checkpoint: epoch {epoch + 1}, after step "
                  f"{step_in_epoch} of the epoch", flush=True)
    else:
        epoch, step_in_epoch, global_step, log, best = 0, 0, 0, [], {"f05": -1.0, "epoch": None}

    autocast = training_autocast(cfg.precision, device)

    def tagging_loss(input_ids: Tensor, attention_mask: Tensor, labels: Tensor,
                     targets: Tensor | None = None) -> Tensor:
        """Mean cross-entropy of the labelled pieces (:func:`word_loss`): the step's forward,
        compiled whole (loss included) under --compile."""
        return word_loss(model(input_ids, attention_mask), labels, targets)

    step_loss_fn, static = tagging_loss, {}
    if compile_mode != "off":  # (applied_compile refused a compiled mode under torchrun)
        # the same module and parameters; evaluation keeps the eager model (other shapes)
        step_loss_fn = compiled_step(tagging_loss, compile_mode, model, lambda: model(
            torch.full((1, 2), tokenizer.pad_token_id, device=device),
            torch.ones((1, 2), dtype=torch.long, device=device)))
        static = {"rows": cfg.batch_size}
    steps_this_call = 0

    def checkpoint():
        if not main_rank:  # rank 0 writes; every rank holds the same weights and optimizer state
            return
        writer.save(model, optimizer, {
            "epoch": epoch, "step_in_epoch": step_in_epoch, "global_step": global_step,
            "log": log, "best": best, "config": asdict(cfg),
            "world_size": dist_ctx.world_size if dist_ctx else 1, "data": data,
            "precision_applied": precision, "compile_applied": compile_mode,
            "cwd": os.getcwd(),  # what the config's relative paths are relative to
        }, global_step)

    if epoch > cfg.epochs:
        raise ValueError(f"{out}: the checkpoint is past epoch {cfg.epochs} already (epoch {epoch})")

    # the dev set's word pieces, made once for every epoch's evaluation (rank 0's alone)
    dev_encoded = encode_sentences(tokenizer, [s.tokens for s in dev_set],
                                   eval_max_length(model)) if main_rank else None
    # every epoch has the same number of batches (a function of the lengths and batch size)
    total_steps = cfg.epochs * len(length_bucketed_batches(lengths, cfg.batch_size, cfg.seed, 0))
    if cfg.warmup_ratio > 0 and main_rank and global_step == 0 and (
            warmup := warmup_steps(cfg, total_steps)) in (0, total_steps):
        print(f"warning: warmup_ratio {cfg.warmup_ratio} of {total_steps} steps rounds to "
              f"{warmup} warm-up steps: " + ("no warm-up" if warmup == 0 else
                                             "the whole run warms up and never decays"),
              file=sys.stderr, flush=True)
    while epoch < cfg.epochs:
        batches = length_bucketed_batches(lengths, cfg.batch_size, cfg.seed, epoch)
        model.train()
        t0, n_sent, first_step = time.perf_counter(), 0, step_in_epoch
        loss_sum = log[-1]["_loss_sum"] if log and log[-1].get("_open") else 0.0
        if not (log and log[-1].get("_open")):
            log.append({"epoch": epoch + 1, "_open": True, "_loss_sum": 0.0})
        bar = progress_bar(total=len(batches), initial=step_in_epoch,
                           desc=f"epoch {epoch + 1}/{cfg.epochs}",
                           disable=not (cfg.progress and main_rank), unit="batch")
        # step losses stay on the device and are read every LOSS_SYNC_STEPS steps (and before a
        # checkpoint or the epoch's record): a .item() per step would stall the host on the GPU
        pending = torch.zeros((), dtype=torch.float64, device=device)

        def sync_loss() -> None:
            nonlocal loss_sum
            loss_sum += float(pending.item())
            pending.zero_()
            log[-1]["_loss_sum"] = loss_sum
            bar.set_postfix(loss=f"{loss_sum / max(1, step_in_epoch):.4f}",
                            sent_s=f"{n_sent / (time.perf_counter() - t0):.1f}")

        while step_in_epoch < len(batches):
            idx = batches[step_in_epoch]
            optimizer.zero_grad(set_to_none=True)
            if dist_ctx is None:
                if static:
                    static["length"] = padded_length(int(packed.lengths[idx].max()), max_length)
                batch = _to_device(packed.collate(idx, **static), device)
                with autocast:  # (the loss takes float32 logits either way)
                    loss = step_loss_fn(batch["input_ids"], batch["attention_mask"],
                                        batch["labels"], batch.get("targets"))
                loss.backward()
                step_loss = loss.detach()
            else:
                # dropout masks from (seed, step, rank) alone, so a resumed run draws the same
                torch.manual_seed(cfg.seed * 1_000_003 + global_step * 64 + dist_ctx.rank)
                step_loss = _distributed_step(net, dist_ctx, idx, packed, lengths, device,
                                              autocast)
            factor = lr_factor(cfg, global_step, total_steps)
            for group in optimizer.param_groups:
                group["lr"] = group.setdefault("base_lr", cfg.lr) * factor
            optimizer.step()
            pending += step_loss
            step_in_epoch += 1
            global_step += 1
            steps_this_call += 1
            n_sent += len(idx)
            bar.update(1)
            stop = stop_after_steps is not None and steps_this_call >= stop_after_steps
            ckpt = global_step % cfg.checkpoint_every == 0 or stop
            if ckpt or step_in_epoch % LOSS_SYNC_STEPS == 0 or step_in_epoch == len(batches):
                sync_loss()
            if ckpt:
                checkpoint()
            if stop:
                bar.close()
                return out / "best"
        bar.close()
        steps_seconds = time.perf_counter() - t0  # (the last step's loss read waited for the GPU)
        if step_in_epoch > first_step and global_step % cfg.checkpoint_every:
            # the epoch's last steps are kept before dev evaluation: a crash there (or a kill)
            # loses no training (a resumed run goes straight to the evaluation)
            checkpoint()
        if not main_rank:  # rank 0 evaluates, logs and saves; the others wait for it
            torch.distributed.barrier()
            epoch += 1
            step_in_epoch = 0
            continue
        t_dev = time.perf_counter()
        dev_scores, _ = evaluate(model, tokenizer, dev_set, batch_size=cfg.eval_batch_size,
                                 device=device, encoded=dev_encoded)
        record = log[-1]
        record.update({
            "train_loss": loss_sum / max(1, len(batches)), "dev": dev_scores,
            # the epoch's whole time (steps, checkpoint hand-off, dev evaluation) and its parts
            "seconds": time.perf_counter() - t0,
            "train_seconds": steps_seconds, "dev_seconds": time.perf_counter() - t_dev,
            # of this process's steps (None when it resumed the epoch after its last step)
            "sentences_per_s": n_sent / max(1e-9, time.perf_counter() - t0) if n_sent else None,
            "train_sentences_per_s": n_sent / max(1e-9, steps_seconds) if n_sent else None,
        })
        if first_step:
            record["resumed_at_step"] = first_step  # seconds and speed cover the rest only
        record.pop("_open")
        record.pop("_loss_sum")
        if dev_scores["f05"] > best["f05"]:
            best = {"f05": dev_scores["f05"], "epoch": epoch + 1}
            # what reproduces the model: the config (its relative paths against cwd) and
            # digests of the data read (and of the teacher's probabilities, with a teacher)
            model.config.training = {"config": asdict(cfg), "epoch": epoch + 1, "dev": dev_scores,
                                     "cwd": os.getcwd(), "data": dict(data)}
            model.save(out / "best", tokenizer=tokenizer)
        epoch += 1
        step_in_epoch = 0
        atomic_write_text(out / "log.json", json.dumps(log, indent=1))
        checkpoint()
        if main_rank:  # (a summary line, not the bar: --no-progress keeps it)
            print(f"epoch {epoch}: loss {record['train_loss']:.4f}, dev P {dev_scores['precision']:.4f} "
                  f"R {dev_scores['recall']:.4f} F0.5 {dev_scores['f05']:.4f}", flush=True)
        if dist_ctx is not None:
            torch.distributed.barrier()

    best_dir = out / "best"
    if not main_rank:
        torch.distributed.barrier()  # rank 0 tunes the threshold
        return best_dir
    final = json.loads((best_dir / "config.json").read_text())
    if final.get("threshold") is None:
        # encoder_spec.freeze is in the saved config: the re-save again leaves them out
        best_model = GedTagger.load(best_dir, device=device, backend=cfg.backend)
        _, probs = evaluate(best_model, tokenizer, dev_set, batch_size=cfg.eval_batch_size,
                            device=device)
        gold = np.concatenate([np.asarray(s.labels) for s in dev_set])
        threshold, scores = best_threshold(gold, probs)
        best_model.config.threshold = float(threshold)
        best_model.config.training["dev_at_threshold"] = scores.to_dict()
        best_model.save(best_dir, tokenizer=tokenizer)
    if dist_ctx is not None:
        torch.distributed.barrier()
    return best_dir


def _distributed_step(net, ctx, idx, packed: PackedSentences, lengths, device, autocast
                      ) -> Tensor:
    """Forward and backward of this rank's shard of the global batch ``idx`` under DDP; returns
    the global batch's mean loss (for the log; a 0-dim tensor on ``device``).

    The rank's loss is its cross-entropy sum times world size over the global token count, so
    DDP's average of the ranks' gradients is the gradient of the global mean loss (see
    ``mhmla_fast.distributed``). A rank whose shard is empty runs one sentence with weight 0:
    every rank must take part in the gradient all-reduce.
    """
    mine = shard(idx, lengths, ctx.rank, ctx.world_size)
    weight = 1.0 if mine else 0.0
    mine = mine or [idx[0]]
    batch = _to_device(packed.collate(mine), device)
    with autocast:
        logits = net(batch["input_ids"], batch["attention_mask"])
    ce = word_loss(logits, batch["labels"], batch.get("targets"), reduction="sum")
    totals = torch.stack([ce.detach(), (batch["labels"] != IGNORE).sum().to(ce.dtype)]) * weight
    torch.distributed.all_reduce(totals)  # global loss sum and token count
    (ce * weight * ctx.world_size / totals[1].clamp_min(1)).backward()
    return (totals[0] / totals[1].clamp_min(1)).detach()


STEP_INPUTS = ("input_ids", "attention_mask", "labels")  # what a training step reads of a batch


def _to_device(batch: dict[str, Tensor], device: torch.device,
               keys: tuple[str, ...] = STEP_INPUTS) -> dict[str, Tensor]:
    """The batch's [B, T] int64 tensors named by ``keys`` on ``device``: to CUDA in one copy (of
    their [len(keys), B, T] stack) from pinned memory, without blocking the host; the float
    ``"targets"`` too when the batch has them (a copy of their own)."""
    if device.type != "cuda":  # no copy to make
        moved = {k: batch[k].to(device) for k in keys}
        if "targets" in batch:
            moved["targets"] = batch["targets"].to(device)
        return moved
    stacked = torch.stack([batch[k] for k in keys]).pin_memory().to(device, non_blocking=True)
    moved = dict(zip(keys, stacked.unbind(0)))
    if "targets" in batch:
        moved["targets"] = batch["targets"].pin_memory().to(device, non_blocking=True)
    return moved
