"""ONNX export of a GED tagger, validated against torch at export time, and its runner.

    export_onnx(tagger_dir, out_dir)   writes out_dir/
        model.onnx         inputs  input_ids, attention_mask  int64   [batch, sequence]
                           output  error_prob                 float32 [batch, sequence]
                                   (softmax over the two classes, class 1 = error, in the graph)
        model.int8.onnx    (int8=True) dynamic int8 weights, activations quantised per batch
        export.json        versions, opset, tolerances, measured differences, source model
        config.json, tokenizer files   so that out_dir is a self-contained engine directory

The layer-attention head is exported from its eager torch backend (``backend="torch"``),
folded with the classifier (:meth:`GedTagger.folded`), which traces to standard ONNX ops
(MatMul, Relu, Softmax, ...); the Triton kernels are never part of the graph. The encoder's
attention is traced in transformers' eager form (:func:`eager_attention`). Export
validates by default: ONNX Runtime and torch (the tagger as trained: head, then classifier,
unfolded) run on random ragged batches of several shapes (length 1 up to the encoder's
limit), and when the error probabilities differ by more than the tolerance at any real
(unpadded) position, :class:`ExportValidationError` is raised and nothing is written to
``out_dir``. The batches are
random ragged ones plus :data:`VALIDATION_SENTENCES` (English learner-style sentences) through
the tagger's tokenizer. For the fp32 graph the tagging decision must also be identical: at
every real position, ``p >= t`` must agree with torch for the model's threshold and for 0.5
(argmax), so the export tags exactly as torch fp32 on those batches.

Tolerances: ``atol`` (default 1e-4) for the fp32 graph, which measures about 1e-7
(1.5e-7 max on the MiniLM tagger, 6.6e-7 on a tiny random one). The int8 graph (7-bit
weights per output channel, activations quantised per batch, the head in fp32) is lossy by
design and held to :class:`Int8Tolerance`: its mean abs difference, its label agreement at
the model's threshold and a loose max abs bound, all recorded in ``export.json``.

:class:`OnnxRunner` maps ``input_ids, attention_mask`` int64 [B, T] to float32 error
probabilities [B, T] with ONNX Runtime (graph optimisation level ALL, intra-op threads =
physical cores by default).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..devices import default_threads, physical_cores
from ..encoder import max_input_length
from ..filelock import process_temp_dir
from .options import check_lanes, resolve_options
from .runners import Lanes, LaneRunner, check_pass

__all__ = [
    "ExportValidationError", "OnnxRunner", "export_onnx", "validate_onnx", "validation_batches",
    "error_probability_module", "load_tagger_for_export", "torch_to_onnx", "example_inputs",
    "physical_cores", "ONNX_FILE", "INT8_FILE", "EXPORT_META", "INPUT_NAMES", "OUTPUT_NAME",
    "check_export_target", "export_stage", "staging", "check_fresh", "EXPORT_FILES",
    "TENSORRT_FILES", "file_sha256",
    "DEFAULT_OPSET", "Int8Tolerance", "VALIDATION_SENTENCES", "sentence_batch",
    "eager_attention",
]

ONNX_FILE = "model.onnx"
INT8_FILE = "model.int8.onnx"
EXPORT_META = "export.json"
STAGE_PREFIX = ".onnx-export-"  # + "<pid>-<random>": an export's staging folder in its out_dir
# a TensorRT engine built on the export (tensorrt_engine.PLAN_FILE, its ".json",
# PLUGIN_ONNX_FILE): stale once the graph is replaced
TENSORRT_FILES = ("model.plan", "model.plan.json", "model.plugin.onnx")
# what an export writes beside a tagger's own files: not part of the model
EXPORT_FILES = frozenset({ONNX_FILE, INT8_FILE, EXPORT_META, *TENSORRT_FILES})
INPUT_NAMES = ("input_ids", "attention_mask")
OUTPUT_NAME = "error_prob"
DEFAULT_OPSET = 17
EXPORTERS = ("torchscript", "dynamo")
EXPORT_FORMAT = "mhmla-onnx-export/1"
# Natural sentences for the validation (written for it, in the style of learner English: FCE-like
# errors, punctuation, a number, a long clause, a one-word line), beside the random batches.
VALIDATION_SENTENCES = (
    "He go to school every days .",
    "I am writing to complain about the show which I saw last week .",
    "She don't like the food in this restaurant because it was very expensive .",
    "Dear Sir or Madam ,",
    "In my opinion , the best way to learn a language is to live in the country .",
    "We was very disappointed when we arrived at the theatre at 7.30 pm .",
    "Yesterday I have seen a film which was very interesting and exciting .",
    "The hotel were near the beach , so we could swim every morning before breakfast .",
    "I look forward to hearing from you .",
    "Thanks !",
    "There is many people who thinks that computers will replace teachers in the future , "
    "but I am not agree with them , because a teacher can understand the feelings of students .",
    "My friend and me went to the cinema on Saturday evening .",
    "If I would have more money , I would travel around the world .",
    "The informations you gave in the advertisement was wrong .",
    "Could you tell me when does the course start ?",
    "It was the most happiest day of my life .",
)
# Files besides the weights that make an export directory loadable by Engine.load.
_SIDE_FILES = (
    "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.txt", "vocab.json", "merges.txt", "spiece.model",
    "sentencepiece.bpe.model", "tokenizer.model",
)


class ExportValidationError(RuntimeError):
    """ONNX Runtime's output differs from torch's by more than the tolerance."""


@dataclass(frozen=True)
class Int8Tolerance:
    """What the int8 graph must meet against torch fp32 at the validation's real positions.

    Quantisation moves every probability a little and a few near a steep part of the
    softmax a lot, so the int8 graph is held to its average and to its labels rather than to
    its worst position: ``mean_abs`` bounds the mean abs probability difference,
    ``min_label_agreement`` the share of positions whose label at the model's threshold is
    torch's, and ``max_abs`` (loose) catches a broken graph. On the shipped MiniLM tagger
    (per-channel 7-bit weights): mean 0.015, agreement 0.990, max 0.32; the per-tensor graph
    it replaced measured 0.038, 0.977 and 0.87 and lost 6.4 F0.5 points on FCE dev, and fails.
    """

    max_abs: float = 0.5
    mean_abs: float = 0.02
    min_label_agreement: float = 0.985

    def __post_init__(self):
        if not (self.max_abs > 0 and self.mean_abs > 0 and 0 <= self.min_label_agreement <= 1):
            raise ValueError(f"Int8Tolerance: max_abs and mean_abs must be > 0 and "
                             f"min_label_agreement in [0, 1], got {self}")


# ------------------------------------------------------------------------- the graph


def error_probability_module(tagger, *, fold: bool = True):
    """A :class:`GedTagger` as the exported graph, an eval-mode ``nn.Module``:
    (input_ids, attention_mask) int64 [B, T] -> P(error) float32 [B, T] =
    softmax(logits)[..., 1], with the logits of the folded tagger (:meth:`GedTagger.folded`:
    head and classifier in one op; ``fold=False``: the tagger as trained, the validation's
    reference). (Defined in here so that importing this module, and running ONNX Runtime,
    needs no torch.)"""
    import torch
    from torch import nn

    class ErrorProbability(nn.Module):
        def __init__(self, tagger):
            super().__init__()
            self.tagger = tagger.folded() if fold else tagger

        def forward(self, input_ids, attention_mask):
            logits = self.tagger(input_ids, attention_mask)
            return torch.softmax(logits.float(), dim=-1)[..., 1]

    return ErrorProbability(tagger).eval()


def load_tagger_for_export(model_dir: str | os.PathLike):
    """The tagger in fp32 on CPU with the eager torch head (standard ops, no Triton)."""
    import torch

    from ..ged.model import GedTagger

    tagger = GedTagger.load(model_dir, device="cpu", dtype=torch.float32, backend="torch")
    if tagger.head.backend != "torch":  # pragma: no cover - guarded by GedTagger.load
        raise RuntimeError("the export needs the eager torch head (backend='torch')")
    return tagger.eval()


def example_inputs(vocab_size: int, pad_id: int) -> tuple:
    """A [2, 8] int64 batch whose second row is padded, so the exporter traces the
    padding-mask path of the encoder's attention (an all-ones mask may be elided)."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab_size, (2, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    ids[1, 5:] = pad_id
    return ids, mask


# one export at a time in a process: torch.onnx.export keeps process-wide state (two threads
# exporting a tagger and a scorer at once failed "GLOBALS.in_onnx_export must be False", and
# the failure was recorded in the export cache as the model's), and the warning filters and
# root log level set below are process-wide too
_EXPORT_LOCK = threading.RLock()


def export_hint(path: str | os.PathLike, flag: str = "") -> str:
    """How to make the ONNX export that a runner found missing in tagger folder ``path``
    (``flag``: " --int8" for the int8 graph): the export command with ``--model`` (without it
    the command exports the shipped tagger, and refuses a folder holding another); for the
    shipped tagger, which lives in the installed package, ``--backend auto`` (its cached
    export) or an export into a folder of the user's."""
    from .engine import default_tagger_path

    path = Path(path)
    if path.resolve() == default_tagger_path().resolve():
        return ("The shipped tagger runs from its cached export with --backend auto; to serve "
                f"an export of your own: mhmla-serve export --onnx{flag} DIR, then --model DIR")
    return (f"Export the tagger first: mhmla-serve export --onnx{flag} {path} --model {path} "
            f"(or mhmla_fast.serve.onnx_export.export_onnx({str(path)!r}, {str(path)!r}"
            f"{', int8=True' if flag else ''}))")


@contextmanager
def _quiet_export() -> Iterator[None]:
    """Silence the exporters' expected warnings (tracer notes on Python-level shape
    checks, the legacy-exporter deprecation) and ONNX Runtime's quantiser advice, holding
    the process's export lock (:data:`_EXPORT_LOCK`)."""
    import torch

    with _EXPORT_LOCK:
        root = logging.getLogger()
        level = root.level
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export.*")
            warnings.filterwarnings("ignore", message=".*aten::index operator.*")
            warnings.filterwarnings("ignore", category=DeprecationWarning, module="torch.onnx")
            warnings.filterwarnings("ignore", message=".*axis name: .* will not be used.*")
            warnings.filterwarnings("ignore", message=".*LeafSpec.*is deprecated.*")
            root.setLevel(max(level, logging.ERROR))
            try:
                yield
            finally:
                root.setLevel(level)


def torch_to_onnx(module, example: tuple, path: Path, *, opset: int = DEFAULT_OPSET,
                  exporter: str = "torchscript", custom_opsets: dict | None = None,
                  output_name: str = OUTPUT_NAME, output_axes: dict | None = None) -> Path:
    """Export ``module(input_ids, attention_mask)`` to one self-contained ONNX file with
    dynamic ``batch`` and ``sequence`` axes on both inputs; its output ``output_name`` has the
    dynamic axes ``output_axes`` (default: ``batch`` and ``sequence``, the tagger's [B, T]).

    ``exporter``: "torchscript" (the tracing exporter: needs only ``onnx``, emits the
    requested opset natively) or "dynamo" (``torch.export``-based; needs ``onnxscript``).
    """
    import torch

    if exporter not in EXPORTERS:
        raise ValueError(f"exporter: expected one of {EXPORTERS}, got {exporter!r}")
    common = dict(input_names=list(INPUT_NAMES), output_names=[output_name],
                  opset_version=int(opset))
    with _quiet_export(), torch.no_grad():
        if exporter == "torchscript":
            dyn = {n: {0: "batch", 1: "sequence"} for n in INPUT_NAMES}
            dyn[output_name] = {0: "batch", 1: "sequence"} if output_axes is None else output_axes
            torch.onnx.export(module, example, str(path), dynamo=False, dynamic_axes=dyn,
                              do_constant_folding=True, custom_opsets=custom_opsets, **common)
        else:
            try:
                import onnxscript  # noqa: F401
            except ImportError:
                raise RuntimeError("exporter='dynamo' needs onnxscript: pip install onnxscript "
                                   "(or use exporter='torchscript')") from None
            batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
            shapes = {n: {0: batch, 1: seq} for n in INPUT_NAMES}
            torch.onnx.export(module, example, str(path), dynamo=True, dynamic_shapes=shapes,
                              external_data=False, verbose=False, **common)
    return path


@contextmanager
def eager_attention(encoder) -> Iterator[str]:
    """The encoder's attention traced as explicit ops (transformers' "eager" implementation)
    while in the block, then its own again; yields what is traced ("eager", or the encoder's own
    implementation when it has no other).

    transformers' default SDPA implementation exports to a masked softmax with NaN guards
    (IsNaN, Where). Measured ad hoc on 2 CPU cores (README, *Use*): ONNX Runtime ran that form
    1.6x slower than torch on ASAP essays, and the tagger's SDPA graph took 7.20 s on FCE
    dev + test against 7.03 s for its eager one. Both exports are validated against torch as
    it runs (SDPA)."""
    own = getattr(getattr(encoder, "config", None), "_attn_implementation", None)
    switch = getattr(encoder, "set_attn_implementation", None)
    if switch is None or own in (None, "eager"):
        yield own or "eager"
        return
    try:
        switch("eager")
    except (ValueError, ImportError):  # an encoder without an eager implementation
        yield own
        return
    try:
        yield "eager"
    finally:
        switch(own)


# -------------------------------------------------------------------- validation


def validation_batches(max_length: int, vocab_size: int, pad_id: int = 0, *, seed: int = 0,
                       shapes: Sequence[tuple[int, int]] | None = None,
                       ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random ragged (input_ids, attention_mask) int64 batches [B, T] for validation.

    Default shapes: (1, 1), (2, 7), (3, 33), (8, 16), (1, max_length), (2, max_length),
    lengths clipped to ``max_length``. Row 0 of each batch is full length, the other rows
    are padded to random lengths in [1, T] (pad id at masked positions).
    """
    if shapes is None:
        shapes = [(1, 1), (2, 7), (3, 33), (8, 16), (1, max_length), (2, max_length)]
    rng = np.random.default_rng(seed)
    out, seen = [], set()
    for B, T in shapes:
        T = max(1, min(int(T), int(max_length)))
        if (B, T) in seen:
            continue
        seen.add((B, T))
        ids = rng.integers(1, vocab_size, size=(B, T), dtype=np.int64)
        mask = np.zeros((B, T), dtype=np.int64)
        lengths = [T] + [int(rng.integers(1, T + 1)) for _ in range(B - 1)]
        for b, n in enumerate(lengths):
            mask[b, :n] = 1
            ids[b, n:] = pad_id
        out.append((ids, mask))
    return out


def sentence_batch(tokenizer, sentences: Sequence[str], max_length: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``sentences`` through ``tokenizer`` (with [CLS]/[SEP], padded to the longest, at most
    ``max_length`` pieces) as one (input_ids, attention_mask) int64 batch [B, T]."""
    enc = tokenizer(list(sentences), padding=True, truncation=True, max_length=max_length)
    return (np.asarray(enc["input_ids"], dtype=np.int64),
            np.asarray(enc["attention_mask"], dtype=np.int64))


def _torch_probs(module, batches) -> list[np.ndarray]:
    import torch

    with torch.inference_mode():
        return [module(torch.from_numpy(i), torch.from_numpy(m)).numpy() for i, m in batches]


def validate_onnx(onnx_path: str | os.PathLike, reference: Sequence[np.ndarray],
                  batches: Sequence[tuple[np.ndarray, np.ndarray]], *, atol: float,
                  threshold: float | None = None, threads: int | None = None,
                  what: str = "fp32", exact_labels: Sequence[float] = (),
                  mean_atol: float | None = None, min_agreement: float | None = None) -> dict:
    """Compare ONNX Runtime on ``onnx_path`` with ``reference`` probabilities on ``batches``.

    Differences are taken at real positions (attention_mask == 1; padded positions are
    never read by the engine). Returns a report {"atol", "max_abs_diff", "mean_abs_diff",
    "batches": [{"shape", "max_abs_diff"}], with ``threshold`` "threshold" and
    "label_agreement", and with ``exact_labels`` "labels": {"thresholds", "positions",
    "differing"}}; raises :class:`ExportValidationError` naming the max abs difference and the
    shapes when it exceeds ``atol`` (or is not finite), naming the threshold and the count
    when the decision ``p >= t`` differs from the reference's at any real position for a ``t``
    in ``exact_labels``, when the mean abs difference exceeds ``mean_atol`` and when the label
    agreement at ``threshold`` falls below ``min_agreement`` (each where given).
    """
    if min_agreement is not None and threshold is None:
        raise ValueError("validate_onnx: min_agreement needs the threshold")
    # on the CPU, where exports run (onnxruntime-gpu's CUDA provider would check other maths)
    runner = OnnxRunner(onnx_path, device="cpu", threads=threads)
    exact = sorted({float(t) for t in exact_labels})
    differing = [0] * len(exact)
    per_batch, total, count, agree = [], 0.0, 0, 0
    for (ids, mask), ref in zip(batches, reference):
        got = runner(ids, mask)
        if got.shape != ids.shape:
            raise ExportValidationError(
                f"{Path(onnx_path).name} ({what}): output shape {list(got.shape)} for input "
                f"{list(ids.shape)}; expected {list(ids.shape)}")
        real = mask.astype(bool)
        diff = np.abs(got[real].astype(np.float64) - ref[real].astype(np.float64))
        worst = float(diff.max()) if not np.isnan(diff).any() else float("nan")
        per_batch.append({"shape": list(ids.shape), "max_abs_diff": worst})
        total += float(diff.sum())
        count += int(real.sum())
        if threshold is not None:
            agree += int(((got[real] >= threshold) == (ref[real] >= threshold)).sum())
        for k, t in enumerate(exact):
            differing[k] += int(((got[real] >= t) != (ref[real] >= t)).sum())
    worst = max((b["max_abs_diff"] for b in per_batch), key=lambda d: (np.isnan(d), d))
    report = {"atol": float(atol), "max_abs_diff": worst, "mean_abs_diff": total / max(count, 1),
              "batches": per_batch, "positions": "attention_mask == 1"}
    if threshold is not None:
        report["threshold"] = float(threshold)
        report["label_agreement"] = agree / max(count, 1)
    if exact:
        report["labels"] = {"thresholds": exact, "positions": count, "differing": differing}
    if not worst <= atol:  # also catches NaN
        bad = next(b for b in per_batch if not b["max_abs_diff"] <= atol)
        shapes = ", ".join(f"{b['shape']}: {b['max_abs_diff']:.3g}" for b in per_batch)
        raise ExportValidationError(
            f"{Path(onnx_path).name} ({what}): ONNX Runtime and torch error probabilities "
            f"differ by max abs {worst:.3g} > atol {atol:g}, first at batch shape "
            f"{bad['shape']} [batch, sequence] (per shape: {shapes})")
    for t, n in zip(exact, differing):
        if n:
            raise ExportValidationError(
                f"{Path(onnx_path).name} ({what}): the label (p >= {t:g}) differs from torch's at "
                f"{n} of {count} positions (max abs probability difference {worst:.3g})")
    if mean_atol is not None:
        report["mean_atol"] = float(mean_atol)
        if not report["mean_abs_diff"] <= mean_atol:
            raise ExportValidationError(
                f"{Path(onnx_path).name} ({what}): ONNX Runtime and torch error probabilities "
                f"differ by {report['mean_abs_diff']:.3g} on average > {mean_atol:g}")
    if min_agreement is not None:
        report["min_label_agreement"] = float(min_agreement)
        if not report["label_agreement"] >= min_agreement:
            raise ExportValidationError(
                f"{Path(onnx_path).name} ({what}): the label (p >= {threshold:g}) is torch's at "
                f"{report['label_agreement']:.4f} of {count} positions < {min_agreement:g}")
    return report


# ------------------------------------------------------------------------- export


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's content."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _versions() -> dict:
    import onnx
    import onnxruntime
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__}


def _tokenizer(model_dir: Path, tagger):
    """The tokenizer that tags with ``model_dir`` (its own, else its encoder's)."""
    from .engine import load_tokenizer

    if any((model_dir / n).is_file() for n in ("tokenizer.json", "vocab.txt", "vocab.json")):
        return load_tokenizer(model_dir)
    from ..ged.model import load_tokenizer as load_encoder_tokenizer

    return load_encoder_tokenizer(tagger.config.encoder)


def _copy_side_files(model_dir: Path, dest: Path, encoder: str) -> list[str]:
    """config.json and the tokenizer files (the encoder's tokenizer when the tagger
    directory has none) into ``dest``; returns the names written."""
    before = {p.name for p in dest.iterdir()}
    for name in _SIDE_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, dest / name)
    if not any((dest / n).is_file() for n in ("tokenizer.json", "vocab.txt", "vocab.json",
                                              "spiece.model", "tokenizer.model")):
        from ..ged.model import load_tokenizer

        load_tokenizer(encoder).save_pretrained(dest)
    return sorted({p.name for p in dest.iterdir()} - before)


def check_export_target(model_dir: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """ValueError unless an export of ``model_dir`` may write into ``out_dir``: absent, empty,
    ``model_dir`` itself (an export in place, beside the weights), or an earlier export
    (``export.json``, no ``model.safetensors``), whose files it replaces. An export writes a
    config and tokenizer files: into another model's folder it would change that model."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir}: is a file; an export is written into a folder")
    if not out_dir.is_dir() or out_dir.resolve() == model_dir.resolve():
        return
    names = sorted(p.name for p in out_dir.iterdir() if not p.name.startswith(STAGE_PREFIX))
    if names and ((out_dir / "model.safetensors").exists()
                  or not (out_dir / EXPORT_META).is_file()):
        raise ValueError(f"{out_dir}: holds files that are not an earlier export "
                         f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}); an "
                         "export writes its config and tokenizer files there: give a new or "
                         "empty folder, or an earlier export's")


def check_fresh(export_dir: str | os.PathLike) -> None:
    """ValueError when ``export_dir`` is an export in place, beside a tagger's weights, whose
    ``model.safetensors`` changed since (``export.json``'s ``source.model_sha256``): its graph
    would still give the old weights' probabilities, under the new config's threshold.
    Nothing to check (and nothing hashed) for an export folder of its own."""
    export_dir = Path(export_dir)
    weights = export_dir / "model.safetensors"
    if not weights.is_file() or not (export_dir / EXPORT_META).is_file():
        return
    try:
        source = json.loads((export_dir / EXPORT_META).read_text()).get("source") or {}
    except (OSError, ValueError):
        return
    made = source.get("model_sha256")
    if made is not None and made != file_sha256(weights):
        raise ValueError(f"{export_dir}: its ONNX export is stale (model.safetensors changed "
                         f"since it was exported); export it again: mhmla-serve export --onnx "
                         f"{export_dir} --model {export_dir}")


@contextmanager
def staging(model_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Iterator[Path]:
    """:func:`export_stage` for the ``with`` block, removed after it; a block that fails also
    removes the folders the stage's making created (``out_dir`` and its parents), so that a
    failed export leaves ``out_dir`` as it was."""
    out_dir = Path(out_dir)
    made = [p for p in (out_dir, *out_dir.parents) if not p.exists()]
    stage = export_stage(model_dir, out_dir)
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        for folder in made:  # the deepest first; one that holds something stops it
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def export_stage(model_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """A new staging folder in ``out_dir`` (made) for an export of ``model_dir``, after
    :func:`check_export_target`; the staging folders of exports killed part-way (their
    process gone) are removed first (each held a whole model's graph)."""
    check_export_target(model_dir, out_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return process_temp_dir(STAGE_PREFIX, out_dir)


def export_onnx(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                opset: int = DEFAULT_OPSET, int8: bool = False, atol: float = 1e-4,
                int8_tolerance: Int8Tolerance = Int8Tolerance(), validate: bool = True,
                exporter: str = "torchscript", seed: int = 0, fold: bool = True,
                threads: int | None = None) -> Path:
    """Export the tagger in ``model_dir`` to ``out_dir/model.onnx`` (see the module doc).

    Args:
        model_dir: a saved tagger directory (``GedTagger.save``).
        out_dir: the engine directory to write (created; may be ``model_dir`` itself).
        opset: ONNX opset (17: LayerNormalization is a single op).
        int8: also write ``model.int8.onnx`` (dynamic int8 weights via
            ``onnxruntime.quantization.quantize_dynamic``: 7-bit weights per output channel,
            activations per batch; the head's MatMuls stay fp32), validated against
            ``int8_tolerance`` (:class:`Int8Tolerance`).
        atol: max abs difference of fp32 error probabilities, ONNX Runtime vs torch; the fp32
            labels at the model's threshold and at 0.5 must also be identical.
        validate: run the validation (strongly recommended; False only for debugging).
        exporter: "torchscript" (default) or "dynamo" (needs onnxscript).
        seed: seed of the random validation batches.
        fold: the head and classifier folded into one op (default; False: the graph of the
            tagger as trained, for comparisons). Either way the validation's reference is
            the tagger as trained.
        threads: ONNX Runtime's threads in validation (default: ``devices.default_threads``).

    Returns:
        the path of ``model.onnx``. Files are staged and moved into ``out_dir`` only after
        validation passed, so a failed export leaves ``out_dir`` as it was.

    Raises:
        ExportValidationError: a validated graph differs from torch beyond its tolerance.
    """
    import onnx

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    tagger = load_tagger_for_export(model_dir)
    module = error_probability_module(tagger, fold=fold)
    hf = tagger.encoder.config
    vocab, pad_id = int(hf.vocab_size), int(getattr(hf, "pad_token_id", 0) or 0)
    max_length = max_input_length(hf)
    threshold = tagger.config.threshold if tagger.config.threshold is not None else 0.5

    with staging(model_dir, out_dir) as stage:
        t0 = time.perf_counter()
        with eager_attention(tagger.encoder) as attention:
            onnx_path = torch_to_onnx(module, example_inputs(vocab, pad_id), stage / ONNX_FILE,
                                      opset=opset, exporter=exporter)
        onnx.checker.check_model(str(onnx_path))
        export_s = time.perf_counter() - t0
        meta = {
            "format": EXPORT_FORMAT,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "source": {"model_dir": str(model_dir.resolve()),
                       "model_sha256": file_sha256(model_dir / "model.safetensors")},
            "exporter": exporter, "opset": int(opset), "folded": bool(fold),
            "attention": attention,
            "versions": _versions(),
            "inputs": {n: {"dtype": "int64", "shape": ["batch", "sequence"]} for n in INPUT_NAMES},
            "output": {OUTPUT_NAME: {"dtype": "float32", "shape": ["batch", "sequence"],
                                     "meaning": "softmax(logits)[..., 1], P(error)"}},
            "max_length": max_length, "threshold": threshold, "export_seconds": round(export_s, 2),
            "files": {"fp32": ONNX_FILE, "int8": INT8_FILE if int8 else None},
            "validation": None, "int8": None,
        }
        batches = []
        if validate:
            batches = validation_batches(max_length, vocab, pad_id, seed=seed)
            batches.append(sentence_batch(_tokenizer(model_dir, tagger), VALIDATION_SENTENCES,
                                          max_length))
        reference = _torch_probs(error_probability_module(tagger, fold=False),
                                 batches) if validate else []
        if validate:
            meta["validation"] = validate_onnx(onnx_path, reference, batches, atol=atol,
                                               exact_labels=(threshold, 0.5), threads=threads)
        if int8:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            # the encoder's matrix multiplies only (nearly all the work): the head's two, which
            # carry the classifier folded in, stay fp32
            graph = onnx.load(str(onnx_path), load_external_data=False).graph
            head = [n.name for n in graph.node if n.op_type in ("MatMul", "Gemm")
                    and not n.name.startswith("/tagger/encoder/")]
            with _quiet_export():
                # 7-bit weights: without VNNI (AVX2 only) ONNX Runtime's u8 x s8 products
                # saturate in 16-bit sums, which flipped labels (max abs 0.47 on an EPYC)
                quantize_dynamic(str(onnx_path), str(stage / INT8_FILE),
                                 weight_type=QuantType.QInt8, reduce_range=True,
                                 per_channel=True, nodes_to_exclude=head)
            meta["int8"] = {"method": "onnxruntime.quantization.quantize_dynamic",
                            "weight_type": "QInt8", "reduce_range": True, "per_channel": True,
                            "fp32_nodes": head, "activations": "uint8, dynamic per batch"}
            if validate:
                meta["int8"]["tolerance"] = asdict(int8_tolerance)
                meta["int8"]["validation"] = validate_onnx(
                    stage / INT8_FILE, reference, batches, atol=int8_tolerance.max_abs,
                    mean_atol=int8_tolerance.mean_abs,
                    min_agreement=int8_tolerance.min_label_agreement, threshold=threshold,
                    what="int8", threads=threads)
        written = _copy_side_files(model_dir, stage, tagger.config.encoder)
        meta["files"]["side"] = written
        (stage / EXPORT_META).write_text(json.dumps(meta, indent=2) + "\n")
        for p in stage.iterdir():
            os.replace(p, out_dir / p.name)
        stale = [] if int8 else [INT8_FILE]  # export.json no longer describes it
        stale += TENSORRT_FILES  # the engine of the graph replaced
        for name in stale:
            (out_dir / name).unlink(missing_ok=True)
    return out_dir / ONNX_FILE


# ------------------------------------------------------------------------- runner


class OnnxRunner(LaneRunner):
    """ONNX Runtime: ``(input_ids, attention_mask)`` int64 [B, T] -> P(error) float32 [B, T]
    (or, for another graph, its output ``output_name`` as float32: the scorer's [B, K]).

    Args:
        onnx_path: an exported ``model.onnx`` / ``model.int8.onnx``.
        threads: intra-op threads (default: physical cores); inter-op 1, sequential.
        lanes: CPU only: passes at a time through :meth:`submit`, the threads split between
            them (:class:`.runners.Lanes`; one session, whose ``run`` may be called
            concurrently).
        device: "cpu" or "cuda[:N]" (default: :func:`.options.resolve_device`, i.e. CUDA when
            the installed onnxruntime has its CUDA provider); ValueError when onnxruntime
            cannot run there.
        providers: ONNX Runtime execution providers, instead of ``device`` (for tests and
            special set-ups).
        output_name: the graph's output that a call returns (default the tagger's).
    """

    backend = "onnx"

    def __init__(self, onnx_path: str | os.PathLike, *, threads: int | None = None,
                 device: str | None = None, providers: Sequence | None = None,
                 output_name: str = OUTPUT_NAME, lanes: int = 1):
        import onnxruntime as ort

        self.output_name = output_name
        self.path = Path(onnx_path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such ONNX file")
        if providers is None:
            self.device = resolve_options("onnx", device, "float32", lanes=lanes).device
            providers = _providers(self.device)
        else:
            self.device = "cuda" if any("CUDA" in str(p) for p in providers) else "cpu"
            check_lanes(lanes, self.device)
        per_lane = Lanes.split(threads, lanes)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = int(per_lane) if per_lane else default_threads()
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.session = ort.InferenceSession(str(self.path), opts, providers=list(providers))
        names = [i.name for i in self.session.get_inputs()]
        if names != list(INPUT_NAMES):
            raise ValueError(f"{self.path}: inputs {names}, expected {list(INPUT_NAMES)}")
        self.threads = opts.intra_op_num_threads * lanes  # in all
        self.lanes = lanes
        self._lanes = Lanes(lanes) if lanes > 1 else None

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike, dtype: str | None = None, *,
                       device: str | None = None, kernels: str = "auto",
                       threads: int | None = None, **kw) -> OnnxRunner:
        """The runner on an export directory: ``model.onnx``, or ``model.int8.onnx`` for
        ``dtype="int8"``, on ``device`` (see :class:`OnnxRunner`). ``kernels`` may only be
        "auto" or "torch" (the graph holds the eager head). Raises ValueError for an option
        ONNX Runtime cannot honour, FileNotFoundError saying how to export when the graph is
        missing."""
        path = Path(path)
        if dtype not in (None, "float32", "fp32", "int8"):
            raise ValueError(f"dtype: the onnx backend has 'float32' (default) and 'int8', "
                             f"got {dtype!r}")
        opts = resolve_options("onnx", device, dtype, kernels)
        if opts.dtype == "float32":
            name, flag = ONNX_FILE, ""
        else:
            name, flag = INT8_FILE, " --int8"
        file = path / name
        check_fresh(path)
        if not file.is_file():
            raise FileNotFoundError(f"{path}: no ONNX export ({name} is missing). "
                                    f"{export_hint(path, flag)}")
        return cls(file, device=opts.device, threads=threads, **kw)

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        ids, mask = check_pass(input_ids, attention_mask)
        out = self.session.run([self.output_name], {INPUT_NAMES[0]: ids, INPUT_NAMES[1]: mask})[0]
        return np.asarray(out, dtype=np.float32)

    def __repr__(self) -> str:
        lanes = f", lanes={self.lanes}" if self.lanes > 1 else ""
        return (f"OnnxRunner({str(self.path)!r}, device={self.device!r}, "
                f"threads={self.threads}{lanes})")


def _providers(device: str) -> list:
    """ONNX Runtime execution providers for a resolved ``device`` ("cpu", "cuda", "cuda:N")."""
    if device.startswith("cuda"):
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        return [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]

