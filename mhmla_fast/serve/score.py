"""Essay scoring for ``mhmla-serve score`` and ``POST /v1/score``: loading, checks, results.

Both front ends load the scorer with :func:`load_scorer` (the serving contract of
:mod:`.options`; by default on the CPU, ONNX Runtime on a cached export validated against torch,
:mod:`.score_onnx`, or on a CPU with AMX the checked bf16 scorer on it) and hand a chunk of
essays (texts with their ASAP prompts) to :func:`score_essays`, which makes ONE
``predict_scores`` call for the whole chunk, so that all windows of all its essays go through
the encoder together in token-budget batches. A result is
``{"prompt": p, "score": s}`` with ``s`` an integer on prompt ``p``'s scale
(``SCORE_RANGES[p]``, e.g. 2..12 for prompt 1), and ``"advisories"`` where the essay lies far
outside the essays the scorer was fitted on (:func:`with_advisories`: its score is an
extrapolation, e.g. one word repeated).

A scorer has output layers for some prompts only (``scorer.config.prompts``; the shipped one for
all eight); :func:`check_prompts` turns input records of the other prompts into error records,
with the same ``"<source>: line <n>: <reason>"`` message form as every other malformed line.

An essay whose text gives no word pieces with the scorer's own tokenizer (no special tokens)
would be scored as an empty essay: :func:`essay_pieces_check` is that rule for a scorer, exact
(it asks the tokenizer) and cheap (only texts without an ASCII letter or digit are tokenized: a
word-piece tokenizer keeps every one of those). :func:`score_records` (``mhmla-serve score``,
also on Ray's workers) makes such a record an error record, ``"<source>: line <n>: "`` followed
by :data:`NO_PIECES`, and ``POST /v1/score`` answers 422 with :data:`NO_PIECES` at the essay's
``text``. The check runs after the input is fingerprinted (:mod:`.records`), on the scorer's
side, so a Ray job and the CLI make the same records and the same sidecar.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .options import (TORCH_DTYPES, ServeOptions, default_token_budget, resolve_dtype,
                      resolve_options)
from .inputs import location

__all__ = ["DTYPES", "NO_PIECES", "check_prompts", "default_scorer_path", "essay_pieces_check",
           "head_kind", "scorer_token_budget",
           "load_scorer", "piece_encoder", "score_essays", "score_records", "scorer_options",
           "unsupported_prompt", "with_advisories"]

DTYPES = TORCH_DTYPES
NO_PIECES = ('field "text" gives no word pieces: the scorer\'s tokenizer keeps none of its '
             "characters (such as spaces, control, format, private-use or combining characters, "
             "U+FFFD); it would be scored as an empty essay")
_ASCII_ALNUM = re.compile(r"[0-9A-Za-z]")  # a text with one always gives word pieces


def default_scorer_path() -> Path:
    """The directory of the scorer shipped in the package (it may not be installed)."""
    from ..aes.scoring import default_model_path

    return default_model_path()


def scorer_options(backend: str = "auto", device: str | None = None, dtype: str | None = None,
                   kernels: str = "auto") -> ServeOptions:
    """The scorer's options resolved by the serving rule (:func:`.options.resolve_options`):
    backend "auto" (on the CPU the scorer's cached export: ONNX Runtime in float32, the checked
    scorer in bfloat16; else torch) or "torch". ValueError naming the option for one the scorer
    cannot honour: backend "onnx" or "tensorrt" (no explicit export of a scorer is offered:
    auto makes and keeps its own), a dtype not in :data:`DTYPES` (int8), an unknown kernels
    name."""
    if backend not in ("torch", "auto"):
        raise ValueError(f"backend: the essay scorer runs on 'auto' or 'torch' (it has no "
                         f"explicit ONNX or TensorRT export: auto makes and keeps its own), got "
                         f"{backend!r}")
    if dtype and resolve_dtype(dtype, "cpu") not in DTYPES:
        raise ValueError(f"dtype: the essay scorer has {DTYPES} (auto's export is float32), "
                         f"got {dtype!r}")
    return resolve_options(backend, device, dtype, kernels)


def load_scorer(path: str | Path | None = None, *, backend: str = "auto", device: str | None = None,
                dtype: str | None = None, kernels: str = "auto", threads: int | None = None,
                cache: bool | None = None, check_margin: float | None = None):
    """An essay scorer on ``path`` (default: the shipped scorer, :func:`default_scorer_path`)
    with the load contract of tagging (:mod:`.options`).

    ``backend="auto"`` (default) on the CPU: the scorer's cached ONNX export, validated to give
    torch fp32's scores (:mod:`.export_cache`; made on first use; ``cache`` False or
    ``$MHMLA_NO_CACHE`` turns it off), run by ONNX Runtime fp32
    (:class:`~.score_onnx.OnnxScorer`), or, on a CPU with AMX and OpenVINO installed unless
    ``dtype`` asks for float32, by the checked bf16 scorer
    (:func:`~.openvino_runner.checked_scorer`: OpenVINO bf16, the essays whose output lies
    within ``check_margin`` of a rounding boundary scored again in ONNX Runtime fp32; fp32's
    scores either way); torch when onnxruntime is missing, the cache is off or no export can
    be had (one stderr line says why). Elsewhere, and with ``backend="torch"``:
    ``EssayScorer.load(path)`` on ``device`` (default: CUDA when available), in ``dtype`` (one
    of :data:`DTYPES`; default bfloat16 on CUDA, float32 on the CPU), with the head's
    ``kernels`` ("auto", "torch", "triton") and ``threads`` torch CPU threads
    (``torch.set_num_threads``: for every torch model of the process); in eval mode with
    its tokenizer attached. All have ``config.prompts`` and ``predict_scores``.

    ``backend`` "onnx" or "tensorrt" is a ValueError, as is an unknown dtype or kernels name
    (or kernels other than "auto" for a ridge scorer, which has no layer attention),
    ``threads`` that is not a positive integer or None, or a ``check_margin`` where no checked
    scorer runs. Load errors (not a scorer directory,
    bad weights) propagate."""
    from .runners import check_margin_option

    if path is not None and not str(path):  # ("$UNSET": not the shipped scorer)
        raise ValueError("path: empty path; None means the shipped scorer")
    path = default_scorer_path() if path is None else path
    opts = scorer_options(backend, device, dtype, kernels)
    margin = check_margin_option(check_margin, opts)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ValueError(f"threads: expected a positive integer or None, got {threads!r}")
    if opts.kernels != "auto" and head_kind(path) == "ridge":  # whichever backend runs it
        raise ValueError(f"kernels: {path} is a ridge scorer, with no layer attention to run "
                         f"on {opts.kernels!r} kernels; leave kernels at 'auto'")
    if opts.backend == "auto":
        from .export_cache import auto_scorer

        fp32 = dataclasses.replace(opts, dtype="float32")  # auto's torch: fp32's scores too
        return auto_scorer(path, torch=lambda: _torch_scorer(path, fp32, threads),
                           threads=threads, cache=cache, dtype=opts.dtype, check_margin=margin)
    return _torch_scorer(path, opts, threads)


def _torch_scorer(path: str | Path, opts: ServeOptions, threads: int | None):
    import torch

    from ..aes.model import EssayScorer
    from .runners import set_torch_threads

    set_torch_threads(threads)
    return EssayScorer.load(path, device=opts.device, dtype=getattr(torch, opts.dtype),
                            backend=opts.kernels)


def head_kind(path: str | Path) -> str | None:
    """The ``head_kind`` a scorer directory's ``config.json`` names (the default
    "layer-attention" when it names none); None when the file cannot be read (the load then
    says why)."""
    from ..aes.scoring import read_scorer_config

    try:
        return read_scorer_config(path).get("head_kind", "layer-attention")
    except (OSError, ValueError):
        return None


def unsupported_prompt(prompt: int, prompts: Sequence[int]) -> str | None:
    """Why ``prompt`` cannot be scored by a scorer with heads for ``prompts`` (None if it can)."""
    if prompt in prompts:
        return None
    have = ", ".join(str(p) for p in sorted(prompts))
    return (f'field "prompt": this scorer has no output layer for prompt {prompt} '
            f"(it scores prompts {have})")


def check_prompts(records: Iterable[Any], prompts: Sequence[int]) -> Iterator[Any]:
    """``records`` (:class:`~mhmla_fast.serve.inputs.InputRecord`, kind ``"score"``) with every
    valid record whose prompt is not in ``prompts`` replaced by an error record (same index,
    source, line and id; ``error`` = ``"<source>: line <n>: <reason>"``). Lazy, order kept."""
    allowed = frozenset(int(p) for p in prompts)
    for rec in records:
        if rec.error is None:
            reason = unsupported_prompt(rec.prompt, allowed)
            if reason is not None:
                rec = dataclasses.replace(rec, text=None, prompt=None,
                                          error=f"{location(rec.source, rec.line)}: {reason}")
        yield rec


def piece_encoder(scorer: Any) -> Callable[[list[str]], list[list[int]]] | None:
    """The word pieces ``scorer`` scores texts with (no special tokens, no truncation, no
    padding), as a function of a list of texts: an :class:`~.score_onnx.OnnxScorer`'s
    ``encode``; else its tokenizer (``scorer.tokenizer``, else
    ``load_tokenizer(scorer.config.encoder_spec)``, as ``EssayScorer.predict_scores`` picks
    it); None for a scorer with neither (a stand-in)."""
    encode = getattr(scorer, "encode", None)
    if callable(encode):
        return encode
    tokenizer = getattr(scorer, "tokenizer", None)
    if tokenizer is None:
        spec = getattr(getattr(scorer, "config", None), "encoder_spec", None)
        if spec is None:
            return None
        from ..encoder import load_tokenizer

        tokenizer = load_tokenizer(spec)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # a Rust tokenizer of its own: the HTTP service runs this check off its event loop while
        # the worker thread calls the scorer's tokenizer, whose calls may change its truncation
        from tokenizers import Tokenizer

        pieces = Tokenizer.from_str(backend.to_str())
        pieces.no_truncation()
        pieces.no_padding()
        return lambda texts: [e.ids for e in pieces.encode_batch(list(texts),
                                                                 add_special_tokens=False)]
    return lambda texts: tokenizer(texts, add_special_tokens=False, truncation=False,
                                   padding=False, verbose=False)["input_ids"]


def essay_pieces_check(scorer: Any) -> Callable[[Sequence[str]], list[str | None]]:
    """The empty-essay rule of ``scorer``: a function of texts giving, for each one,
    :data:`NO_PIECES` when the scorer's tokenizer (:func:`piece_encoder`) gives it no word
    pieces, else None. Only texts without an ASCII letter or digit are tokenized (one call for
    all of them); the tokenizer is looked up at the first such text and kept. A scorer without
    a tokenizer (a stand-in) has no such rule: None for every text."""

    @functools.cache
    def encoder() -> Callable[[list[str]], list[list[int]]] | None:
        return piece_encoder(scorer)

    def check(texts: Sequence[str]) -> list[str | None]:
        out: list[str | None] = [None] * len(texts)
        todo = [k for k, text in enumerate(texts) if not _ASCII_ALNUM.search(text)]
        if todo and encoder() is not None:
            for k, ids in zip(todo, encoder()([texts[k] for k in todo])):
                if len(ids) == 0:
                    out[k] = NO_PIECES
        return out

    return check


def scorer_token_budget(scorer: Any, token_budget: int | None = None) -> int:
    """``token_budget``, else the default of the device ``scorer`` runs on
    (``options.default_token_budget``: 1024 on the CPU, 8192 on a GPU). The device is its
    runner's (an ONNX scorer) or its parameters' (a torch scorer); "cpu" when it has neither."""
    if token_budget is not None:
        return int(token_budget)
    device = getattr(getattr(scorer, "runner", None), "device", None)
    if device is None:
        try:
            device = next(scorer.parameters()).device
        except (AttributeError, StopIteration):
            device = "cpu"
    return default_token_budget(device)


def score_essays(scorer: Any, texts: Sequence[str], prompts: Sequence[int],
                 token_budget: int | None = None, *, advisories: bool = True
                 ) -> list[dict[str, Any]]:
    """``[{"prompt": p_i, "score": s_i}]`` for essays ``texts`` [n] of ``prompts`` [n], in order,
    with ``"advisories"`` where :func:`with_advisories` finds some (``advisories=False``: never;
    the HTTP service adds them per request, its windowed essays included).

    One ``scorer.predict_scores(texts, prompts, token_budget=...)`` call for all of them (an empty
    list makes no call; ``token_budget``: :func:`scorer_token_budget`). Scores are plain ``int``
    (JSON-ready). Raises ValueError when the lengths differ or the scorer returns the wrong
    number of scores."""
    if len(texts) != len(prompts):
        raise ValueError(f"{len(texts)} texts but {len(prompts)} prompts")
    if not texts:
        return []
    from ..aes.scoring import essay_prompts

    prompts = essay_prompts(len(texts), list(prompts), scorer.config.prompts)  # (int(1.9) is 1)
    scores = scorer.predict_scores(list(texts), prompts,
                                   token_budget=scorer_token_budget(scorer, token_budget))
    if len(scores) != len(texts):
        raise ValueError(f"the scorer returned {len(scores)} scores for {len(texts)} essays")
    results = [{"prompt": p, "score": int(s)} for p, s in zip(prompts, scores)]
    return with_advisories(scorer, texts, prompts, results) if advisories else results


def with_advisories(scorer: Any, texts: Sequence[str], prompts: Sequence[int],
                    results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``results`` (one per essay), each given ``"advisories"`` where its essay lies far
    outside the essays the scorer was fitted on (:func:`~mhmla_fast.aes.scoring.surface_advisories`
    of the scorer's ``surface_bounds``; none for a scorer without them)."""
    from ..aes.scoring import surface_advisories

    bounds = getattr(getattr(scorer, "config", None), "surface_bounds", None)
    if bounds:
        for res, advisories in zip(results, surface_advisories(texts, prompts, bounds)):
            if advisories:
                res["advisories"] = advisories
    return results


def score_records(scorer: Any, records: Sequence[Any], token_budget: int | None = None, *,
                  check: Callable[[Sequence[str]], list[str | None]] | None = None
                  ) -> list[dict[str, Any]]:
    """:func:`score_essays` over valid ``"score"`` input records (``.text``, ``.prompt``); a
    record cut by ``--max-chars N --over-long cap`` gets ``"capped_from"`` (its original
    length in characters), as ``tag`` records do. A record whose text gives no word pieces
    (``check``, default :func:`essay_pieces_check` of ``scorer``; pass one made once to keep
    its tokenizer across calls) is not scored: its result is ``{"error": "<source>: line <n>:
    NO_PIECES"}``."""
    reasons = (check or essay_pieces_check(scorer))([r.text for r in records])
    ok = [rec for rec, why in zip(records, reasons) if why is None]
    scored = iter(score_essays(scorer, [r.text for r in ok], [r.prompt for r in ok],
                               token_budget))
    out: list[dict[str, Any]] = []
    for rec, why in zip(records, reasons):
        if why is not None:
            out.append({"error": f"{location(rec.source, rec.line)}: {why}"})
            continue
        res = next(scored)
        if rec.capped_from is not None:
            res["capped_from"] = rec.capped_from
        out.append(res)
    return out
