"""ONNX export of an essay scorer, validated to score exactly as torch fp32, and its runner.

    export_scorer(scorer_dir, out_dir)   writes out_dir/
        model.onnx       inputs  input_ids, attention_mask  int64   [batch, sequence]
                                 (windows ``[CLS] pieces [SEP]``, padded)
                         output  window_outputs             float32 [batch, K]
                                 every prompt's window output side by side: prompt p's in
                                 columns ``export.json["columns"][p]`` (classification: the
                                 softmax over its C_p labels; regression: its sigmoid output,
                                 one column)
        tokenizer.json   the scorer's word-piece tokenizer (no truncation, no padding)
        export.json      what the runner needs (prompts, columns, objective, decision, window,
                         special ids), versions, the validation report
        config.json      the scorer's, so that the directory says what it was made from
        bf16_check.json  the scorer's per-prompt margins of the checked bf16 scorer, when it has
                         them (:data:`CHECK_FILE`)

What is exported is the part that needs torch, per window: the encoder, the layer attention
(none in a ridge scorer, ``head_kind="ridge"``, whose output layers read layers 1..L at [CLS]
side by side), the pooling and every prompt's output layer (a few thousand multiply-adds per
prompt: computing them all costs nothing beside the encoder, and one graph serves any mix of
prompts). With "cls" pooling (the shipped scorer) the head reads every layer at [CLS] only,
so the exported last layer computes its query, attention output and feed-forward at [CLS]
only (:func:`window_outputs_module`, "cls-last-layer": 1/7 of MiniLM-L6's work skipped). What stays
in numpy, shared with the torch scorer (:mod:`mhmla_fast.aes.scoring`): word-piecing (the
``tokenizers`` library), cutting essays into 510-piece windows, packing windows into
token-budget batches, picking each window's prompt columns, averaging windows per essay and
rounding (or cutting) to the prompt's scale, and a ridge scorer's essay-level term from its
surface features (``surface_weights``, :func:`~mhmla_fast.aes.scoring.essay_offsets`: word and
character counts of the text, no model). A ridge scorer with "cls+mean" pooling reads every
token of the last layer, so it is exported whole ("whole-encoder").
The encoder's attention is
traced in transformers' "eager" form (explicit MatMul, Softmax): its default SDPA form exports
to a masked softmax with NaN guards. On ASAP essays (2 CPU cores, in process) ONNX Runtime ran
the SDPA form's graph 1.6x slower than torch, the eager form's 1.1-1.16x slower, and the eager
form with the [CLS]-only last layer at torch's speed. The validation compares with the torch
scorer as it runs (SDPA).

Validation is part of the export (:func:`validate_scorer`); it fails, and nothing is written,
unless ONNX Runtime matches torch fp32 on

* random ragged windows (:func:`~.onnx_export.validation_batches`, lengths 1 up to the
  encoder's limit) and the windows of :data:`VALIDATION_ESSAYS` (learner essays in the style of
  the 8 ASAP prompts, one of them long enough for two 510-piece windows), through the exported
  module in torch and in ONNX Runtime: every output within ``atol`` (default 1e-4), and under
  every prompt the integer score of every window (as a one-window essay) and of every essay
  identical;
* :data:`VALIDATION_ESSAYS` through both whole pipelines, the runner's ``predict_scores``
  against ``EssayScorer.predict_scores`` (each essay under one of the scorer's prompts in
  turn): the same word pieces, identical integer scores, averaged outputs within ``atol``.

:class:`OnnxScorer` is the runner: the scorer's interface (``config.prompts``,
``predict_scores``, ``plan_essay``/``score_windows``/``finish_essay`` for the HTTP batcher) on
ONNX Runtime, numpy and ``tokenizers``; it imports no torch and no transformers.
:class:`CheckedScorer` is the same on a fast, approximate runner (OpenVINO bf16) with the essays
near a rounding boundary scored again by an exact one (ONNX Runtime fp32).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..aes.scoring import (EssayPlan, combine_windows, empty_essay_error, essay_offset,
                           essay_offsets, essay_prompts, essay_scores, essay_texts,
                           near_boundary, piece_windows, refuse_empty_essays)
from ..aes.windows import split_windows
from ..packing import pack_by_token_budget
from .onnx_export import (DEFAULT_OPSET, EXPORT_META, INPUT_NAMES, ONNX_FILE,
                          ExportValidationError, OnnxRunner, eager_attention, staging)
from .options import default_token_budget

__all__ = ["CHECK_FILE", "EXPORT_FORMAT", "OUTPUT_NAME", "VALIDATION_ESSAYS", "CheckedScorer",
           "ExportedScorerConfig", "read_check_margins", "write_check_margins",
           "GRAPHS", "OnnxScorer", "export_graph", "export_scorer", "validate_scorer",
           "window_outputs_module"]

EXPORT_FORMAT = "mhmla-onnx-scorer/1"
# A scorer's margins for the checked bf16 scorer, per prompt, measured on its own bf16 error
# (bench/openvino_bf16_score_cpu.py --write-margins); copied into its export.
CHECK_FILE = "bf16_check.json"
CHECK_FORMAT = "mhmla-bf16-check/1"
OUTPUT_NAME = "window_outputs"
TOKENIZER_FILE = "tokenizer.json"
# Essays written for the validation in the style of ASAP's eight prompts (learner errors, a
# list, a quotation, numbers, a very short one); the last joins them all, so that it spans
# several 510-piece windows of the shipped scorer.
_ESSAYS = (
    "Dear local newspaper, I think that computers have a good effect on people. First of all "
    "computers let you talk to your family and friends who live far away, my cousin lives in "
    "Spain and we chat every weekend. Second, you can learn about almost anything, like the "
    "history of other countries or how to cook a new food. Some people say that kids spend too "
    "much time on the computer and dont go outside, but thats the parents job to set limits. "
    "In conclusion computers help us to learn, to communicate and to work, so they are good "
    "for our society.",
    "Should libraries remove books that some people find offensive? I do not think so. Every "
    "person have a different opinion about what is offensive. If we take away every book that "
    "someone dislike, there would be no books left on the shelves at all. Katherine Paterson "
    "said that if we all remove the books we hate, we have nothing left. Parents can choose "
    "what there own children read, but they should not choose for everybody else.",
    "The features of the setting affect the cyclist because the road is long and there is no "
    "water. He was very thirsty and the sun was hot, the buildings were abandoned so nobody "
    "could help him. When he saw the hills he got tired and he thought he was going to die.",
    "The author concludes the story with this paragraph to show that Saeng will try again. "
    "Like the hibiscus she will be strong in the spring, when the snows melt and the geese "
    "return. It shows hope.",
    "The mood created by the author in the memoir is grateful and loving. He describes the "
    "kitchen of his parents, the music and the smell of cooking, and he says that his home "
    "was a place where everybody was welcome. This makes the reader feel warm.",
    "The builders of the Empire State Building faced many obstacles in allowing dirigibles to "
    "dock there. The wind on the top of the building was too strong, and the mast could not "
    "hold a ship safely. Also it was illegal to fly a airship so low over the city.",
    "A time when I was patient was when I waited for my turn at the doctor. We waited for "
    "three hours and my little brother was crying, but I read him a story and stayed calm. I "
    "did not complain because the doctor had many sick people to see.",
    "Laughter is the shortest distance between two people. Last summer my friend and I got "
    "lost in the forest near our camp. At first we were scared, then my friend fell in the "
    "mud and we could not stop laughing. We laughed so much that we forgot to be afraid, and "
    "after an hour we found the path back. Since that day we are best friends, and every time "
    "we remember it we laugh again.",
    "Ok.",
)
VALIDATION_ESSAYS: tuple[str, ...] = (*_ESSAYS, " ".join(_ESSAYS))
VALIDATION_TOKEN_BUDGET = 1024  # the validation essays' batches: little padding


class _Unsupported(RuntimeError):
    """The scorer's graph cannot be exported (the exporter's error, with the scorer's setting)."""


# ------------------------------------------------------------------------------ the graph


GRAPHS = ("reference", "cls-last-layer", "attention-pooling", "whole-encoder")


def window_outputs_module(scorer, graph: str = "reference"):
    """An :class:`~mhmla_fast.aes.model.EssayScorer` as an eval-mode ``nn.Module``: windows
    (input_ids, attention_mask) int64 [B, T] -> float32 [B, K], every prompt's
    ``head.window_outputs(head.output(pooled, p))`` (as [B, C_p] or [B, 1]) side by side in
    ``scorer.config.prompts`` order, with ``pooled`` [B, H] computed as ``graph`` says:

    reference          ``scorer.pooled_windows``: the torch scorer's own computation (what the
                       validation compares with)
    cls-last-layer     "cls" pooling on a BERT-like encoder: the head reads each layer's output
                       at [CLS] only, so the last layer computes its keys and values at every
                       position but its query, attention output and feed-forward at [CLS]
                       only (10 of its 12 H x H-sized products per token skipped: 1/7 of the
                       encoder's work for MiniLM-L6); the other layers as the encoder runs them
    attention-pooling  "attention" pooling without boolean indexing (which the tracer cannot
                       follow): the layer attention at every position, padding included, padded
                       positions zeroed and masked out of the softmax, as the scorer does
    whole-encoder      as reference (the exported form of "cls" pooling on other encoders,
                       and of a ridge head's "cls+mean" pooling)

    Returns ``(module, columns)``, ``columns[p] = (start, end)``. (Defined in here so that
    importing this module needs no torch.)"""
    import torch
    from torch import nn

    from ..aes.scoring import num_labels

    if graph not in GRAPHS:
        raise ValueError(f"graph: expected one of {GRAPHS}, got {graph!r}")
    prompts = [int(p) for p in scorer.config.prompts]
    widths = [num_labels(p) if scorer.config.objective == "classification" else 1
              for p in prompts]
    starts = np.cumsum([0, *widths]).tolist()
    columns = {p: (int(starts[k]), int(starts[k + 1])) for k, p in enumerate(prompts)}

    class WindowOutputs(nn.Module):
        def __init__(self, scorer):
            super().__init__()
            self.scorer = scorer

        def forward(self, input_ids, attention_mask):
            head = self.scorer.head
            if graph == "cls-last-layer":
                pooled = self.cls_pooled(input_ids, attention_mask)
            elif graph == "attention-pooling":
                pooled = self.attention_pooled(input_ids, attention_mask)
            else:
                pooled = self.scorer.pooled_windows(input_ids, attention_mask)
            outs = [head.window_outputs(head.output(pooled, p)).reshape(pooled.shape[0], -1)
                    for p in prompts]
            return torch.cat(outs, dim=1)

        def cls_pooled(self, input_ids, attention_mask):
            """``pooled_windows`` for "cls" pooling: embeddings and layers 1..L-1 as the
            encoder runs them, layer L at [CLS] only; the layer attention over the L + 1
            states at [CLS]."""
            encoder = self.scorer.encoder
            h = encoder.embeddings(input_ids=input_ids)  # [B, T, H]
            # the eager attention's additive mask: 0 where attended, the lowest float elsewhere
            added = (1.0 - attention_mask[:, None, None, :].to(h.dtype)) * torch.finfo(h.dtype).min
            states = [h[:, 0]]
            layers = encoder.encoder.layer
            for layer in layers[:-1]:
                h = layer(h, added)
                h = h[0] if isinstance(h, tuple) else h
                states.append(h[:, 0])
            states.append(_cls_layer(layers[-1], h, added)[:, 0])
            return self.scorer.head.pooled_cls(torch.stack(states, 0))  # from [L+1, B, H]

        def attention_pooled(self, input_ids, attention_mask):
            head = self.scorer.head
            hidden = self.scorer.encoder(input_ids=input_ids, attention_mask=attention_mask,
                                         output_hidden_states=True).hidden_states
            hidden = torch.stack(list(hidden), 0)  # [L+1, B, T, H]
            n, B, T, H = hidden.shape
            c = head.layer_attention(hidden.reshape(n, B * T, H)).reshape(B, T, -1)
            keep = attention_mask.bool()
            c = c * keep.unsqueeze(-1).to(c.dtype)
            scores = head.pool(c).squeeze(-1).float().masked_fill(~keep, float("-inf"))
            alpha = torch.softmax(scores, dim=-1).to(c.dtype)  # [B, T]
            return torch.einsum("bt,bth->bh", alpha, c)

    return WindowOutputs(scorer).eval(), columns


def _cls_layer(layer, hidden, added):
    """A BERT layer's output at [CLS] only: ``layer(hidden)[:, :1]``, with keys and values from
    every position. hidden [B, T, H], added [B, 1, 1, T] (the additive mask) -> [B, 1, H]."""
    import torch

    attn = layer.attention.self
    B, T, _ = hidden.shape
    J, D = attn.num_attention_heads, attn.attention_head_size
    scaling = getattr(attn, "scaling", D ** -0.5)
    q = attn.query(hidden[:, :1]).view(B, 1, J, D).transpose(1, 2)  # [B, J, 1, D]
    k = attn.key(hidden).view(B, T, J, D).transpose(1, 2)  # [B, J, T, D]
    v = attn.value(hidden).view(B, T, J, D).transpose(1, 2)
    p = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * scaling + added, dim=-1)
    context = torch.matmul(p, v).transpose(1, 2).reshape(B, 1, J * D)
    a = layer.attention.output(context, hidden[:, :1])  # dense, LayerNorm(+ residual)
    return layer.output(layer.intermediate(a), a)


def export_graph(scorer) -> str:
    """The form :func:`export_scorer` traces (see :func:`window_outputs_module`):
    "attention-pooling" for attention pooling; "whole-encoder" for "cls+mean" pooling (token
    means of the last layer); "cls-last-layer" for "cls" pooling on an encoder
    whose layers have BERT's parts (``encoder.layer[i].attention.self.query/key/value``,
    ``attention.output``, ``intermediate``, ``output``; absolute positions, not a decoder);
    else "whole-encoder"."""
    if scorer.config.pooling == "attention":
        return "attention-pooling"
    if scorer.config.pooling != "cls":
        return "whole-encoder"
    encoder = scorer.encoder
    config = getattr(encoder, "config", None)
    layers = getattr(getattr(encoder, "encoder", None), "layer", None)
    if (not hasattr(encoder, "embeddings") or not layers or getattr(config, "is_decoder", False)
            or getattr(config, "position_embedding_type", "absolute") != "absolute"):
        return "whole-encoder"
    last = layers[-1]
    attn = getattr(getattr(last, "attention", None), "self", None)
    parts = [getattr(attn, n, None) for n in ("query", "key", "value", "num_attention_heads",
                                               "attention_head_size")]
    parts += [getattr(getattr(last, "attention", None), "output", None),
              getattr(last, "intermediate", None), getattr(last, "output", None)]
    return "cls-last-layer" if all(x is not None for x in parts) else "whole-encoder"


def _load_for_export(model_dir: Path):
    """The scorer in fp32 on the CPU with the eager torch head, and its tokenizer."""
    import torch

    from ..aes.model import EssayScorer, load_tokenizer

    scorer = EssayScorer.load(model_dir, device="cpu", dtype=torch.float32, backend="torch")
    scorer.eval()
    tokenizer = scorer.tokenizer or load_tokenizer(scorer.config.encoder_spec)
    return scorer, tokenizer


def _collate(windows: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows padded to ``input_ids``, ``attention_mask`` int64 [B, T_max]."""
    T = max(len(w) for w in windows)
    ids = np.full((len(windows), T), pad_id, dtype=np.int64)
    mask = np.zeros((len(windows), T), dtype=np.int64)
    for b, w in enumerate(windows):
        ids[b, : len(w)] = w
        mask[b, : len(w)] = 1
    return ids, mask


def _batches(windows: Sequence[Sequence[int]], token_budget: int) -> list[list[int]]:
    """Window indices in the torch scorer's batches (``aes.model.token_budget_batches``)."""
    return pack_by_token_budget([len(w) for w in windows], token_budget, None, longest_first=True)


# ------------------------------------------------------------------------------ the runner


@dataclass(frozen=True)
class ExportedScorerConfig:
    """What the HTTP app and the CLI read of a scorer's config: its prompts and how windows
    become scores (``window``: word pieces per window without [CLS]/[SEP]; ``surface_weights``
    and ``surface_bounds``: a ridge scorer's essay-level term,
    :func:`~mhmla_fast.aes.scoring.essay_offsets`)."""

    prompts: tuple[int, ...]
    objective: str
    decision: str
    window: int
    cutpoints: dict[int, tuple[float, ...]] = field(default_factory=dict)
    surface_weights: dict[int, tuple[float, ...]] = field(default_factory=dict)
    surface_bounds: dict[int, tuple[tuple[float, ...], tuple[float, ...]]] = field(
        default_factory=dict)


class OnnxScorer:
    """An exported scorer on ONNX Runtime (CPU): the interface of
    :class:`~mhmla_fast.aes.model.EssayScorer` that serving uses, with the same windows,
    batches, averaging and rounding (:mod:`mhmla_fast.aes.scoring`).

    Args:
        export_dir: a directory written by :func:`export_scorer`.
        threads: ONNX Runtime intra-op threads (default: physical cores).
        runner: what runs the graph instead of ONNX Runtime: ``(input_ids, attention_mask)``
            int64 [B, T] -> float32 [B, K] on the export's ``model.onnx`` (an
            :class:`~.openvino_runner.OpenVinoRunner`; ``threads`` then unused).
    """

    backend = "onnx"

    def __init__(self, export_dir: str | os.PathLike, *, threads: int | None = None,
                 runner=None):
        from tokenizers import Tokenizer

        self.path = Path(export_dir)
        meta = json.loads((self.path / EXPORT_META).read_text(encoding="utf-8"))
        if meta.get("format") != EXPORT_FORMAT:
            raise ValueError(f"{self.path / EXPORT_META}: not a scorer export (format "
                             f"{meta.get('format')!r}, expected {EXPORT_FORMAT!r})")
        self.meta = meta
        self.config = ExportedScorerConfig(
            tuple(int(p) for p in meta["prompts"]), meta["objective"], meta["decision"],
            int(meta["window"]),
            {int(p): tuple(c) for p, c in meta.get("cutpoints", {}).items()},
            {int(p): tuple(c) for p, c in meta.get("surface_weights", {}).items()},
            {int(p): (tuple(lo), tuple(hi))
             for p, (lo, hi) in meta.get("surface_bounds", {}).items()})
        self.columns = {int(p): tuple(c) for p, c in meta["columns"].items()}
        self.width = max(end for _, end in self.columns.values())  # K
        self.cls_id, self.sep_id, self.pad_id = (int(meta["special_ids"][k])
                                                 for k in ("cls", "sep", "pad"))
        self.pieces = Tokenizer.from_file(str(self.path / TOKENIZER_FILE))
        self.pieces.no_truncation()  # saved so; kept off whatever the file says
        self.pieces.no_padding()
        self.runner = runner if runner is not None else OnnxRunner(
            self.path / ONNX_FILE, device="cpu", threads=threads, output_name=OUTPUT_NAME)
        self.threads = getattr(self.runner, "threads", threads)

    def __repr__(self) -> str:
        return f"OnnxScorer({str(self.path)!r}, threads={self.threads})"

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Word pieces of ``texts`` (no special tokens, no truncation)."""
        return [e.ids for e in self.pieces.encode_batch(list(texts), add_special_tokens=False)]

    def window_outputs(self, windows: Sequence[Sequence[int]], *, token_budget: int = 8192,
                       runner=None) -> np.ndarray:
        """All prompts' outputs of ``windows`` (piece ids with [CLS]/[SEP]): float32 [W, K],
        in token-budget batches sorted by length (the torch scorer's), by ``runner`` (default
        this scorer's)."""
        runner = self.runner if runner is None else runner
        out = np.zeros((len(windows), self.width), dtype=np.float32)
        for batch in _batches(windows, token_budget):
            ids, mask = _collate([windows[j] for j in batch], self.pad_id)
            out[batch] = runner(ids, mask)
        return out

    def _outputs(self, windows: Sequence[Sequence[int]], prompts: Sequence[int],
                 token_budget: int, runner=None) -> list[np.ndarray]:
        """Each window's output for its prompt: probabilities [C_p] or a value."""
        both = self.window_outputs(windows, token_budget=token_budget, runner=runner)
        regression = self.config.objective == "regression"
        res = []
        for row, p in zip(both, prompts):
            a, b = self.columns[int(p)]
            res.append(row[a] if regression else row[a:b])
        return res

    def predict_scores(self, texts: Sequence[str], prompt: int | Sequence[int], *,
                       token_budget: int = 8192, return_outputs: bool = False
                       ) -> np.ndarray | tuple[np.ndarray, list[np.ndarray]]:
        """Integer scores [n_essays] on each essay's prompt scale: as
        ``EssayScorer.predict_scores`` (windows of all essays in token-budget batches, window
        outputs averaged per essay, rounded); with ``return_outputs`` also the averaged
        outputs."""
        texts = essay_texts(texts)
        prompts = essay_prompts(len(texts), prompt, self.config.prompts)
        if not texts:
            scores, outputs = np.zeros(0, dtype=np.int64), []
            return (scores, outputs) if return_outputs else scores
        windows, essay_index = piece_windows(self.encode(texts), self.config.window,
                                             self.cls_id, self.sep_id)
        refuse_empty_essays(windows, essay_index)
        offsets = essay_offsets(texts, prompts, self.config.surface_weights,
                                self.config.surface_bounds)
        scores, outputs = self._essay_scores(windows, essay_index, prompts, token_budget, offsets)
        return (scores, outputs) if return_outputs else scores

    def _essay_scores(self, windows: list[list[int]], essay_index: list[int],
                      prompts: list[int], token_budget: int, offsets: np.ndarray | None = None,
                      ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Essays' integer scores and averaged outputs from their ``windows`` (and the essays'
        own ``offsets``, :func:`~mhmla_fast.aes.scoring.essay_offsets`)."""
        preds = self._outputs(windows, [prompts[e] for e in essay_index], token_budget)
        return essay_scores(preds, essay_index, prompts, self.config.objective,
                            self.config.decision, self.config.cutpoints, offsets)

    # ------------------------------------------------ window by window (the HTTP batcher)

    def plan_essay(self, text: str, prompt: int) -> EssayPlan:
        """One essay word-pieced and cut into the windows :meth:`predict_scores` would use."""
        (text,) = essay_texts([text])
        (prompt,) = essay_prompts(1, prompt, self.config.prompts)
        pieces = self.encode([text])[0]
        if not len(pieces):
            raise empty_essay_error()
        return EssayPlan(int(prompt), list(pieces), split_windows(len(pieces), self.config.window),
                         self.cls_id, self.sep_id, self.pad_id,
                         essay_offset(text, prompt, self.config.surface_weights,
                                      self.config.surface_bounds))

    def score_windows(self, pairs: Sequence[tuple[EssayPlan, int]], *, token_budget: int = 8192
                      ) -> list[np.ndarray]:
        """The outputs of windows ``(plan, index)`` (of any essays and prompts), in order."""
        if not pairs:
            return []
        return self._outputs([plan.window_ids(w) for plan, w in pairs],
                             [plan.prompt for plan, _ in pairs], token_budget)

    def finish_essay(self, plan: EssayPlan, outputs: Sequence[np.ndarray]) -> int:
        """The essay's integer score from the outputs of all its windows (in window order)."""
        return self._plan_score(plan, outputs)[0]

    def _plan_score(self, plan: EssayPlan, outputs: Sequence[np.ndarray]
                    ) -> tuple[int, np.ndarray]:
        """(integer score, averaged output) of one planned essay from its windows' outputs."""
        if len(outputs) != len(plan.windows):
            raise ValueError(f"{len(outputs)} window outputs for {len(plan.windows)} windows")
        window_out = np.stack([np.asarray(o) for o in outputs]).astype(np.float64)
        score, mean = combine_windows(window_out, [0] * len(outputs), plan.prompt,
                                      self.config.objective, self.config.decision, n_essays=1,
                                      return_mean=True,
                                      cutpoints=self.config.cutpoints.get(plan.prompt),
                                      offsets=[plan.offset] if self.config.surface_weights
                                      else None)
        return int(score[0]), mean


def read_check_margins(path: str | os.PathLike) -> dict[int, float]:
    """The per-prompt margins ``{prompt: margin}`` of :data:`CHECK_FILE` in the scorer or export
    directory ``path`` ({} when it has none). ValueError naming the file when it is not one."""
    file = Path(path) / CHECK_FILE
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        if data.get("format") != CHECK_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {CHECK_FORMAT!r}")
        margins = {int(p): float(m) for p, m in data["margins"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{file}: not a bf16 check file ({err})") from err
    bad = {p: m for p, m in margins.items() if not 0 <= m < 1}
    if bad:
        raise ValueError(f"{file}: margins must lie in [0, 1), got {bad}")
    return margins


def write_check_margins(path: str | os.PathLike, margins: dict[int, float], **about) -> Path:
    """Write :data:`CHECK_FILE` into the scorer directory ``path``: ``margins`` per prompt and
    ``about`` (how they were measured). Returns its path."""
    file = Path(path) / CHECK_FILE
    data = {"format": CHECK_FORMAT, "margins": {str(p): float(m) for p, m in
                                                sorted(margins.items())}, **about}
    file.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return file


class CheckedScorer(OnnxScorer):
    """An exported scorer whose scores are an exact runner's at about a fast runner's speed:

        out = fast window outputs (OpenVINO bf16)                 [W, K]
        mean_e = essay e's average at its prompt's columns
        essays with near_boundary(mean_e, margin[prompt_e]): every window again through exact
                                                   (ONNX Runtime fp32), the essay re-combined

    (:func:`mhmla_fast.aes.scoring.near_boundary`.) An essay's integer score is then exact's
    wherever the fast runner moved no window output of its prompt by that prompt's margin or
    more; the averaged outputs of essays not re-scored are the fast runner's. Margins 0 run the
    fast runner alone. ``essays`` and ``rescored`` count the essays scored and scored again.

    Args:
        export_dir: a directory written by :func:`export_scorer`.
        fast, exact: runners on its ``model.onnx`` (``(input_ids, attention_mask)`` int64
            [B, T] -> float32 [B, K]).
        margin: one margin for every prompt, or ``{prompt: margin}`` (every prompt of the
            scorer), in window-output units (a regression scorer's normalised score, a
            classifier's probability), each 0 <= margin < 1.
    """

    backend = "checked"

    def __init__(self, export_dir: str | os.PathLike, fast, exact, *,
                 margin: float | dict[int, float]):
        super().__init__(export_dir, runner=fast)
        margins = ({int(p): float(m) for p, m in margin.items()} if isinstance(margin, dict)
                   else dict.fromkeys(self.config.prompts, float(margin)))
        missing = sorted(set(self.config.prompts) - set(margins))
        if missing:
            raise ValueError(f"margin: none for prompts {missing} of this scorer")
        bad = {p: m for p, m in margins.items() if not 0 <= m < 1}
        if bad:
            raise ValueError(f"margin: expected 0 <= margin < 1, got {bad}")
        self.margins = margins
        self.exact = exact if any(margins.values()) else None
        self.dtype = getattr(fast, "dtype", None)
        self.essays = self.rescored = 0
        self._count = threading.Lock()
        # finish_essay's re-scoring budget: the one score_windows was last given (the HTTP
        # batcher's score_token_budget), else the exact runner's device default
        self._budget = default_token_budget(getattr(exact, "device", None) or "cpu")

    def __repr__(self) -> str:
        margins = set(self.margins.values())
        margin = f"{margins.pop():g}" if len(margins) == 1 else repr(self.margins)
        return (f"CheckedScorer({str(self.path)!r}, fast={self.runner!r}, "
                f"exact={self.exact!r}, margin={margin})")

    def score_windows(self, pairs: Sequence[tuple[EssayPlan, int]], *, token_budget: int = 8192
                      ) -> list[np.ndarray]:
        """As :meth:`OnnxScorer.score_windows`; ``token_budget`` is also the one
        :meth:`finish_essay` re-scores an essay's windows with."""
        self._budget = int(token_budget)
        return super().score_windows(pairs, token_budget=token_budget)

    def _near(self, mean: np.ndarray, prompt: int) -> np.ndarray:
        cfg = self.config
        return near_boundary(mean, prompt, cfg.objective, cfg.decision,
                             margin=self.margins[int(prompt)],
                             cutpoints=cfg.cutpoints.get(int(prompt)))

    def _counted(self, essays: int, rescored: int) -> None:
        with self._count:
            self.essays += essays
            self.rescored += rescored

    def _essay_scores(self, windows: list[list[int]], essay_index: list[int],
                      prompts: list[int], token_budget: int, offsets: np.ndarray | None = None,
                      ) -> tuple[np.ndarray, list[np.ndarray]]:
        """As :meth:`OnnxScorer._essay_scores` (so :meth:`predict_scores`), the essays near a
        rounding boundary scored again by the exact runner (all of them in token-budget
        batches)."""
        window_prompts = [prompts[e] for e in essay_index]
        preds = self._outputs(windows, window_prompts, token_budget)
        cfg = self.config
        scores, outputs = essay_scores(preds, essay_index, prompts, cfg.objective, cfg.decision,
                                       cfg.cutpoints, offsets)
        again = np.zeros(len(prompts), dtype=bool)
        if self.exact is not None:
            for p in sorted(set(prompts)):
                idx = [e for e, q in enumerate(prompts) if q == p]
                again[idx] = self._near(np.stack([outputs[e] for e in idx]), p)
        if again.any():
            redo = [j for j, e in enumerate(essay_index) if again[e]]
            exact = self._outputs([windows[j] for j in redo], [window_prompts[j] for j in redo],
                                  token_budget, runner=self.exact)
            for j, out in zip(redo, exact):
                preds[j] = out
            scores, outputs = essay_scores(preds, essay_index, prompts, cfg.objective,
                                           cfg.decision, cfg.cutpoints, offsets)
        self._counted(len(prompts), int(again.sum()))
        return scores, outputs

    def finish_essay(self, plan: EssayPlan, outputs: Sequence[np.ndarray]) -> int:
        """As :meth:`OnnxScorer.finish_essay`; an essay near a rounding boundary has its
        windows scored again by the exact runner first."""
        score, mean = self._plan_score(plan, outputs)
        again = self.exact is not None and bool(self._near(mean, plan.prompt)[0])
        self._counted(1, int(again))
        if not again:
            return score
        exact = self._outputs([plan.window_ids(w) for w in range(len(plan.windows))],
                              [plan.prompt] * len(plan.windows), self._budget, runner=self.exact)
        return self._plan_score(plan, exact)[0]


# ----------------------------------------------------------------------------- validation


def _per_prompt_scores(outputs: np.ndarray, essay_index: Sequence[int], n_essays: int,
                       columns: dict, objective: str, decision: str,
                       cutpoints: dict | None = None) -> dict[int, np.ndarray]:
    """Integer scores of ``n_essays`` essays under every prompt, from all prompts' window
    outputs [W, K] (cut at ``cutpoints[p]`` where the scorer has them)."""
    out = {}
    for p, (a, b) in columns.items():
        cols = outputs[:, a] if objective == "regression" else outputs[:, a:b]
        out[p] = combine_windows(cols.astype(np.float64), essay_index, p, objective, decision,
                                 n_essays=n_essays, cutpoints=(cutpoints or {}).get(p))
    return out


def _compare(got: np.ndarray, want: np.ndarray, essay_index: Sequence[int], n_essays: int,
             columns: dict, objective: str, decision: str, cutpoints: dict | None = None,
             ) -> tuple[float, int, int]:
    """(max abs difference, (essay, prompt) scores compared, how many differ)."""
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    worst = float(diff.max()) if diff.size and not np.isnan(diff).any() else (
        0.0 if not diff.size else float("nan"))
    a = _per_prompt_scores(got, essay_index, n_essays, columns, objective, decision, cutpoints)
    b = _per_prompt_scores(want, essay_index, n_essays, columns, objective, decision, cutpoints)
    differ = sum(int((a[p] != b[p]).sum()) for p in columns)
    return worst, n_essays * len(columns), differ


def _torch_outputs(module, batches) -> list[np.ndarray]:
    import torch

    with torch.inference_mode():
        return [module(torch.from_numpy(i), torch.from_numpy(m)).numpy() for i, m in batches]


def validate_scorer(export_dir: Path, scorer, tokenizer, reference, columns: dict, *,
                    atol: float = 1e-4, seed: int = 0, threads: int | None = None,
                    token_budget: int = VALIDATION_TOKEN_BUDGET) -> dict:
    """Check the export in ``export_dir`` against the torch ``scorer`` (see the module doc; the
    windows through ``reference``, :func:`window_outputs_module`'s "reference" form of it);
    returns the report, raises :class:`~.onnx_export.ExportValidationError` naming what differs.
    ``token_budget`` packs the validation essays' windows (small: little padding)."""
    from .onnx_export import validation_batches

    cfg = scorer.config
    objective, decision = cfg.objective, cfg.decision
    onnx_scorer = OnnxScorer(export_dir, threads=threads)
    max_length = int(cfg.encoder_spec.max_length)
    vocab, pad_id = int(scorer.encoder.config.vocab_size), onnx_scorer.pad_id
    shapes = [(1, 1), (2, 7), (3, 33), (8, 16), (2, max_length)]
    report: dict = {"atol": float(atol)}

    # 1. random ragged windows, and the validation essays' windows: every output close, every
    #    prompt's score identical for each window (as a one-window essay) and each essay
    texts = list(VALIDATION_ESSAYS)
    windows, essay_index = piece_windows(onnx_scorer.encode(texts), cfg.window, onnx_scorer.cls_id,
                                         onnx_scorer.sep_id)
    essay_batches = _batches(windows, token_budget)
    batches = validation_batches(max_length, vocab, pad_id, seed=seed, shapes=shapes)
    batches += [_collate([windows[j] for j in batch], pad_id) for batch in essay_batches]
    got_all, want_all, rows = [], [], []
    for (ids, mask), ref in zip(batches, _torch_outputs(reference, batches)):
        got = onnx_scorer.runner(ids, mask)
        if got.shape != ref.shape:
            raise ExportValidationError(f"{ONNX_FILE}: output shape {list(got.shape)} for "
                                        f"input {list(ids.shape)}; torch gives {list(ref.shape)}")
        got_all.append(got)
        want_all.append(ref)
        rows.append({"shape": list(ids.shape)})
    got, want = np.concatenate(got_all), np.concatenate(want_all)
    for row, g, w in zip(rows, got_all, want_all):
        row["max_abs_diff"] = float(np.abs(g.astype(np.float64) - w).max())
    n_random = sum(len(ids) for ids, _ in batches[: len(batches) - len(essay_batches)])
    order = [j for batch in essay_batches for j in batch]  # the essay windows' rows, in order
    essay_rows = np.empty(len(windows), dtype=np.int64)
    essay_rows[order] = n_random + np.arange(len(windows))
    worst, n_w, d_w = _compare(got, want, range(len(got)), len(got), columns, objective, decision,
                               cfg.cutpoints)
    _, n_e, d_e = _compare(got[essay_rows], want[essay_rows], essay_index, len(texts), columns,
                           objective, decision, cfg.cutpoints)
    report["windows"] = {"batches": rows, "random": n_random, "essay_windows": len(windows),
                         "max_abs_diff": worst,
                         "window_scores": {"compared": n_w, "differing": d_w},
                         "essay_scores": {"compared": n_e, "differing": d_e}}
    _check(worst, atol, "validation windows", rows)
    if d_w or d_e:
        raise ExportValidationError(
            f"{ONNX_FILE}: the integer score differs from torch's for {d_w} of {n_w} (window, "
            f"prompt) and {d_e} of {n_e} (validation essay, prompt) pairs (max abs output "
            f"difference {worst:.3g})")

    # 2. the validation essays through both whole pipelines, each under one prompt in turn:
    #    the same word pieces, the same integer scores, close averaged outputs
    prompts = [cfg.prompts[k % len(cfg.prompts)] for k in range(len(texts))]
    pieces_equal = onnx_scorer.encode(texts) == [list(x) for x in tokenizer(
        texts, add_special_tokens=False, truncation=False, verbose=False)["input_ids"]]
    if not pieces_equal:
        raise ExportValidationError("the exported tokenizer's word pieces differ from the "
                                    "scorer's tokenizer on the validation essays")
    want_s, want_out = scorer.predict_scores(texts, prompts, tokenizer=tokenizer,
                                             token_budget=token_budget, return_outputs=True)
    got_s, got_out = onnx_scorer.predict_scores(texts, prompts, token_budget=token_budget,
                                                return_outputs=True)
    out_diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                   for a, b in zip(got_out, want_out))
    n_differ = int((np.asarray(got_s) != np.asarray(want_s)).sum())
    report["essays"] = {"essays": len(texts), "windows": len(windows), "prompts": prompts,
                        "scores": [int(s) for s in want_s], "differing": n_differ,
                        "max_abs_diff": out_diff, "pieces_equal": pieces_equal}
    _check(out_diff, atol, "validation essays (averaged outputs)", [])
    if n_differ:
        raise ExportValidationError(
            f"{ONNX_FILE}: the integer score differs from torch's predict_scores for {n_differ} "
            f"of {len(texts)} validation essays (torch {list(map(int, want_s))}, ONNX Runtime "
            f"{list(map(int, got_s))})")
    report["max_abs_diff"] = max(worst, out_diff)
    return report


def _check(worst: float, atol: float, what: str, per_batch: list) -> None:
    if not worst <= atol:  # also catches NaN
        shapes = ", ".join(f"{b['shape']}: {b['max_abs_diff']:.3g}" for b in per_batch)
        raise ExportValidationError(
            f"{ONNX_FILE}: ONNX Runtime and torch window outputs differ by max abs {worst:.3g} "
            f"> atol {atol:g} on the {what}" + (f" (per shape: {shapes})" if shapes else ""))


# ------------------------------------------------------------------------------ the export


def export_scorer(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                  opset: int = DEFAULT_OPSET, exporter: str = "torchscript", atol: float = 1e-4,
                  seed: int = 0, validate: bool = True, threads: int | None = None) -> Path:
    """Export the essay scorer in ``model_dir`` to ``out_dir`` (see the module doc).

    Args:
        model_dir: a saved scorer directory (``EssayScorer.save``).
        out_dir: the export directory to write (created).
        opset, exporter: as :func:`~.onnx_export.torch_to_onnx`.
        atol: max abs difference of window outputs (probabilities or normalised scores), ONNX
            Runtime vs torch fp32; integer scores must also be identical (see
            :func:`validate_scorer`).
        seed: seed of the random validation windows.
        validate: run the validation (strongly recommended; False only for debugging).
        threads: ONNX Runtime threads of the validation (default: physical cores).

    Returns:
        the path of ``model.onnx``. Files are staged and moved into ``out_dir`` only after the
        validation passed, so a failed export leaves ``out_dir`` as it was.

    Raises:
        ExportValidationError: ONNX Runtime's outputs or scores differ from torch's.
    """
    import onnx

    from .engine import piece_tokenizer
    from .onnx_export import _quiet_export, _versions, example_inputs, torch_to_onnx

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    scorer, tokenizer = _load_for_export(model_dir)
    reference, columns = window_outputs_module(scorer)
    graph = export_graph(scorer)
    module, _ = window_outputs_module(scorer, graph)
    hf = scorer.encoder.config
    cfg = scorer.config
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    with staging(model_dir, out_dir) as stage:
        t0 = time.perf_counter()
        path = stage / ONNX_FILE
        try:
            with eager_attention(scorer.encoder) as attention:
                torch_to_onnx(module, example_inputs(int(hf.vocab_size), pad_id), path,
                              opset=opset, exporter=exporter, output_name=OUTPUT_NAME,
                              output_axes={0: "batch"})
        except Exception as err:  # name what was being exported: the error alone may not
            raise _Unsupported(f"the {cfg.pooling} pooling / {cfg.objective} scorer could not "
                               f"be exported as {graph} ({type(err).__name__}: {err})") from err
        onnx.checker.check_model(str(path))
        export_s = time.perf_counter() - t0
        with _quiet_export():
            pieces = piece_tokenizer(tokenizer)
        pieces.save(str(stage / TOKENIZER_FILE))
        shutil.copy2(model_dir / "config.json", stage / "config.json")
        if (model_dir / CHECK_FILE).is_file():
            read_check_margins(model_dir)  # a damaged file is the export's error, not later
            shutil.copy2(model_dir / CHECK_FILE, stage / CHECK_FILE)
        meta = {
            "format": EXPORT_FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "source": {"model_dir": str(model_dir.resolve())},
            "exporter": exporter, "opset": int(opset), "versions": _versions(),
            "inputs": {n: {"dtype": "int64", "shape": ["batch", "sequence"]} for n in INPUT_NAMES},
            "output": {OUTPUT_NAME: {"dtype": "float32", "shape": ["batch", "K"],
                                     "meaning": "every prompt's window output side by side"}},
            "prompts": [int(p) for p in cfg.prompts],
            "columns": {str(p): list(c) for p, c in columns.items()},
            "graph": graph, "attention": attention,
            "objective": cfg.objective, "decision": cfg.decision, "pooling": cfg.pooling,
            "cutpoints": {str(p): list(c) for p, c in sorted(cfg.cutpoints.items())},
            "surface_weights": {str(p): list(w) for p, w in sorted(cfg.surface_weights.items())},
            "surface_bounds": {str(p): [list(lo), list(hi)]
                               for p, (lo, hi) in sorted(cfg.surface_bounds.items())},
            "window": int(cfg.window), "max_length": int(cfg.encoder_spec.max_length),
            "special_ids": {"cls": int(tokenizer.cls_token_id),
                            "sep": int(tokenizer.sep_token_id), "pad": pad_id},
            "export_seconds": round(export_s, 2), "validation": None,
        }
        (stage / EXPORT_META).write_text(json.dumps(meta, indent=2) + "\n")
        if validate:
            t0 = time.perf_counter()
            meta["validation"] = validate_scorer(stage, scorer, tokenizer, reference, columns,
                                                 atol=atol, seed=seed, threads=threads)
            meta["validation_seconds"] = round(time.perf_counter() - t0, 2)
            (stage / EXPORT_META).write_text(json.dumps(meta, indent=2) + "\n")
        for p in stage.iterdir():
            os.replace(p, out_dir / p.name)
    return out_dir / ONNX_FILE
