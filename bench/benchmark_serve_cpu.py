"""CPU throughput of the tagging engine against the Hugging Face pipeline, on FCE test.

    python bench/benchmark_serve_cpu.py --model mhmla_fast/models/ged-minilm-mhmla12
    python bench/benchmark_serve_cpu.py --model DIR --limit 64 --repeats 1 --out /tmp/x.json

One run, one model, the same sentences (FCE test by default, read with ``read_ged``), every
path in the same process with ``torch.set_num_threads(--threads)`` (ONNX Runtime gets the same
number of intra-op threads):

    hf_pipeline   ``transformers.pipeline("token-classification")`` on the tagger
                  (``mhmla_fast.serve.hf_pipeline``), pre-tokenised input, per-piece outputs
                  mapped to words; one row per ``--pipeline-batch-sizes`` (1 8 32 64)
    plain_torch   ``GedTagger`` fp32 on unsorted fixed batches of ``--plain-batch-size`` (32)
                  sentences padded to the batch's longest: what a user writes by hand. Its
                  word probabilities are the reference every other path is compared with.
    engine        ``Engine.load(backend="torch", dtype="float32")``, one row per
                  ``--budgets`` token budget (4096 8192 16384) and ``--chunks`` size: the
                  sentences go to ``Engine.tag_tokens`` in calls of 512 (what ``mhmla-serve tag``
                  does with its default ``--batch-size 512``: each call is packed on its own) and
                  all in one call (0); the two differ in padding, see
                  bench/results/onnx_cpu_discrepancy.md
    engine onnx   the engine on ONNX Runtime, fp32 and int8 (``model.onnx`` /
                  ``model.int8.onnx`` of ``--onnx-dir``, of ``--model`` when it is an export,
                  or exported into a temporary directory with ``export_onnx(int8=True)``);
                  any failure (no onnxruntime, export error) becomes an error row

Speed: sentences/s = sentences / wall time of one pass over all of them (tokenisation,
batching and the word mapping included, model loading and export excluded), the median of
``--repeats`` (3) passes after a warm-up pass over the first ``--warmup`` (256) sentences.
Each row also records the process CPU seconds of its passes (``cpu_s``) and ``cores_busy`` =
CPU / wall: on a shared machine a row that got fewer cores than ``--threads`` shows it there
(wall-clock speed then says more about the neighbours than about the path).
The labels of a path come from its first timed pass.

Quality: F0.5 of the error class (``ged_scores``) at the model's stored threshold
(``config.threshold``; 0.5 when it has none) and at 0.5, for every row; per row the words whose
label differs from plain_torch's (at both thresholds), the max |P(error) difference| and the
words the path gave no probability. The engine on torch fp32 must agree with plain_torch up to
float noise: max |prob diff| <= ``PROB_TOL`` (1e-4) and no word missing (padding differs, so
bit-identical probabilities are not expected; a label can only flip for a word within 1e-4 of
the threshold). The script exits 1 (after writing the results) when it does not.

JSON (``--out``, default ``bench/results/serve_cpu_<date>.json``, ``-2``, ``-3``... appended
rather than overwriting; ``--out DIR`` gets the default name in DIR): ``header`` (device: CPU
model, cores, load average before and after; versions; commit; command; data; model; protocol),
``rows`` (one per path and setting), ``summary`` (``engine_vs_best_pipeline``: the fastest
torch fp32 engine row over the fastest pipeline row, target ``TARGET_SPEEDUP`` = 1.6; the
other ratios; the reference F0.5 and the int8 F0.5 change). A readable table is printed.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mhmla_fast.provenance import cpu_info, dated_results_path, load_average

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT_DIR = REPO_ROOT / "bench" / "results"
TARGET_SPEEDUP = 1.6
PROB_TOL = 1e-4
PIPELINE_BATCH_SIZES = (1, 8, 32, 64)
TOKEN_BUDGETS = (4096, 8192, 16384)
ENGINE_CHUNKS = (512, 0)  # sentences per engine call: the CLI's default, and all at once

WordProbs = list  # per sentence, its words' P(error): an array, or (engine rows) a list of floats


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(
        description="CPU throughput of the GED engine against the Hugging Face pipeline.")
    p.add_argument("--model", required=True, help="a saved GedTagger directory")
    p.add_argument("--data", default=None,
                   help="GED evaluation file (default: FCE test in the shared data folder)")
    p.add_argument("--limit", type=int, default=None, help="only the first N sentences")
    p.add_argument("--threads", type=int, default=None,
                   help="torch and ONNX Runtime threads (default: os.cpu_count())")
    p.add_argument("--out", default=None, help="results .json file or folder")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per row (median)")
    p.add_argument("--warmup", type=int, default=256,
                   help="sentences in the untimed warm-up pass of every row (0: none)")
    p.add_argument("--pipeline-batch-sizes", type=int, nargs="+", default=list(PIPELINE_BATCH_SIZES))
    p.add_argument("--plain-batch-size", type=int, default=32)
    p.add_argument("--budgets", type=int, nargs="+", default=list(TOKEN_BUDGETS),
                   help="engine token budgets (padded pieces per batch)")
    p.add_argument("--max-batch", type=int, default=256, help="engine rows per batch")
    p.add_argument("--chunks", type=int, nargs="+", default=list(ENGINE_CHUNKS),
                   help="sentences per engine call (0: all in one call); 512 is what "
                   "`mhmla-serve tag` sends with its default --batch-size")
    p.add_argument("--onnx-dir", default=None,
                   help="an existing ONNX export directory (default: export to a temp dir)")
    p.add_argument("--no-onnx", action="store_true", help="skip the ONNX rows")
    args = p.parse_args(argv)
    for name in ("repeats", "plain_batch_size", "max_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be at least 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    if min(args.pipeline_batch_sizes) < 1 or min(args.budgets) < 1:
        p.error("batch sizes and budgets must be at least 1")
    if min(args.chunks) < 0:
        p.error("--chunks must be 0 (all in one call) or positive")
    return args


# ------------------------------------------------------------------------------- header


def versions() -> dict[str, str | None]:
    """Versions of the libraries on the measured paths (None: not installed)."""
    import numpy
    import tokenizers
    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
           "numpy": numpy.__version__, "onnxruntime": None}
    try:
        import onnxruntime

        out["onnxruntime"] = onnxruntime.__version__
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        pass
    return out


def resolve_out_path(out: str | None, today: datetime.date) -> Path:
    """``--out FILE.json`` as given; a folder (default ``bench/results/``) gets
    ``serve_cpu_<date>.json``, with ``-2``, ``-3``... when that file exists."""
    return dated_results_path(out, "serve_cpu", DEFAULT_OUT_DIR, today)


# ------------------------------------------------------------------------------ timing


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def time_passes(tag: Callable[[list[list[str]]], WordProbs], sentences: list[list[str]], *,
                repeats: int, warmup: int) -> tuple[list[float], WordProbs, list[float]]:
    """Warm up on the first ``warmup`` sentences, then time ``repeats`` full passes; the wall
    times in seconds, the first timed pass's word probabilities and the CPU seconds of each
    pass."""
    if warmup > 0:
        tag(sentences[:warmup])
    times, cpus, first = [], [], None
    for _ in range(repeats):
        gc.collect()
        c0, t0 = _cpu_seconds(), time.perf_counter()
        probs = tag(sentences)
        times.append(time.perf_counter() - t0)
        cpus.append(_cpu_seconds() - c0)
        if first is None:
            first = probs
    return times, first, cpus


# ------------------------------------------------------------------------------- paths


def plain_torch_tagger(model, tokenizer, batch_size: int, max_length: int, device: str = "cpu"
                       ) -> Callable[[list[list[str]]], WordProbs]:
    """The hand-written baseline: fixed batches in input order, padded to the batch's longest
    sentence, P(error) read at each word's first piece (NaN for words cut off). ``model`` is
    already on ``device``; each batch is copied there and its probabilities back."""
    import torch

    from mhmla_fast.ged.model import encode_words

    def tag(sentences: list[list[str]]) -> WordProbs:
        out = []
        with torch.inference_mode():
            for k in range(0, len(sentences), batch_size):
                chunk = sentences[k:k + batch_size]
                batch = encode_words(tokenizer, chunk, max_length)
                logits = model(batch["input_ids"].to(device), batch["attention_mask"].to(device))
                probs = torch.softmax(logits.float(), -1)[..., 1].cpu().numpy()
                index = batch["word_index"].numpy()
                for b, words in enumerate(chunk):
                    p = np.full(len(words), np.nan)
                    at = index[b] >= 0
                    p[index[b][at]] = probs[b][at]
                    out.append(p)
        return out

    return tag


def pipeline_tagger(pipe, batch_size: int) -> Callable[[list[list[str]]], WordProbs]:
    """The Hugging Face pipeline at one batch size, word probabilities from its outputs."""
    from mhmla_fast.serve.hf_pipeline import tag_words

    return lambda sentences: tag_words(pipe, sentences, batch_size=batch_size)


def engine_tagger(engine, chunk: int = 0) -> Callable[[list[list[str]]], WordProbs]:
    """``Engine.tag_tokens`` (the public call) on ``chunk`` sentences per call (0: all in one
    call), the probabilities of its results as they come (lists of floats: what is timed is
    the call, not a conversion of its results that the scoring here does later)."""
    def tag(sentences: list[list[str]]) -> WordProbs:
        step = chunk or max(1, len(sentences))
        return [r.probs for k in range(0, len(sentences), step)
                for r in engine.tag_tokens(sentences[k:k + step])]

    return tag


def with_budget(engine, token_budget: int, max_batch: int, host_workers: int = 0):
    """An engine sharing ``engine``'s runner and tokenizer with another batch budget (and
    ``host_workers``: close it after use)."""
    from mhmla_fast.serve.engine import Engine

    return Engine(engine.runner, engine.tokenizer, max_pieces=engine.max_pieces,
                  threshold=engine.threshold, token_budget=token_budget, max_batch=max_batch,
                  max_padding=engine.max_padding, host_workers=host_workers)


def prepare_onnx(model_dir: Path, onnx_dir: str | None, tmp: Path) -> tuple[Path | None, dict]:
    """The ONNX export to run: ``onnx_dir``, ``model_dir`` when it is an export, else a fresh
    ``export_onnx(int8=True)`` in ``tmp`` (fp32 only when the int8 export fails). Returns
    (directory or None, a report with the source, seconds and errors)."""
    from mhmla_fast.serve.onnx_export import ONNX_FILE

    report: dict[str, Any] = {"source": None, "export_s": None, "errors": {}}
    try:
        import onnxruntime  # noqa: F401
    except Exception as e:  # noqa: BLE001
        report["errors"]["import"] = f"import onnxruntime: {type(e).__name__}: {e}"
        return None, report
    if onnx_dir is not None:
        report["source"] = str(onnx_dir)
        return Path(onnx_dir), report
    if (model_dir / ONNX_FILE).is_file():
        report["source"] = str(model_dir)
        return model_dir, report
    from mhmla_fast.serve.onnx_export import EXPORT_META, export_onnx

    out = tmp / "onnx"
    for int8 in (True, False):
        t0 = time.perf_counter()
        try:
            export_onnx(model_dir, out, int8=int8)
        except Exception as e:  # noqa: BLE001 - recorded, the other rows go on
            report["errors"]["export_int8" if int8 else "export"] = f"{type(e).__name__}: {e}"
            continue
        report["export_s"] = round(time.perf_counter() - t0, 2)
        report["source"] = "exported to a temporary directory (export_onnx, int8=%s)" % int8
        try:
            meta = json.loads((out / EXPORT_META).read_text())
            report["validation_max_abs_diff"] = {
                "fp32": (meta.get("validation") or {}).get("max_abs_diff"),
                "int8": ((meta.get("int8") or {}).get("validation") or {}).get("max_abs_diff")}
        except (OSError, ValueError):
            pass
        return out, report
    return None, report


def onnx_engine(export_dir: Path, dtype: str, threads: int, threshold: float):
    """``Engine.load(export_dir, backend="onnx")`` on the CPU with ``threads`` intra-op
    threads."""
    from mhmla_fast.serve.engine import Engine

    return Engine.load(export_dir, backend="onnx", device="cpu", dtype=dtype, threads=threads,
                       threshold=threshold)


# ------------------------------------------------------------------------- comparisons


def thresholds_of(stored: float | None) -> dict[str, float]:
    """The two decision thresholds every row is scored at."""
    return {"stored": float(stored) if stored is not None else 0.5, "0.5": 0.5}


def labels_at(probs: WordProbs, threshold: float) -> list[np.ndarray]:
    """0/1 per word: P(error) >= threshold (NaN, no prediction, is 0)."""
    return [(np.nan_to_num(p, nan=-1.0) >= threshold).astype(np.int64) for p in probs]


def score(gold: list[list[int]], probs: WordProbs, thresholds: dict[str, float]) -> dict:
    """F0.5 (with precision, recall, counts) at each threshold."""
    from mhmla_fast.ged.metrics import ged_scores

    return {name: ged_scores(gold, labels_at(probs, t)).to_dict()
            for name, t in thresholds.items()}


def compare(reference: WordProbs, probs: WordProbs, thresholds: dict[str, float]) -> dict:
    """Words whose label differs from the reference's, max |P(error) difference| over words
    both predicted, and words without a prediction here."""
    ref, got = np.concatenate(reference), np.concatenate(probs)
    both = ~np.isnan(ref) & ~np.isnan(got)
    diff = float(np.abs(ref[both] - got[both]).max()) if both.any() else 0.0
    differing = {name: int((labels_at([ref], t)[0] != labels_at([got], t)[0]).sum())
                 for name, t in thresholds.items()}
    return {"differing_words": differing,
            "labels_identical": all(v == 0 for v in differing.values()),
            "max_abs_prob_diff": diff, "missing_words": int(np.isnan(got).sum())}


# ---------------------------------------------------------------------------------- rows


def measured_row(base: dict, tag: Callable[[list[list[str]]], WordProbs],
                 sentences: list[list[str]], n_words: int, args: argparse.Namespace,
                 warmup: int | None = None) -> tuple[dict, WordProbs | None]:
    """Time one path and fill in its speed (after a warm-up pass of ``warmup`` sentences,
    default ``args.warmup``); errors become ``row["error"]``."""
    warmup = args.warmup if warmup is None else warmup
    row = dict(base, error=None, warmup_sentences=min(warmup, len(sentences)))
    try:
        times, probs, cpus = time_passes(tag, sentences, repeats=args.repeats, warmup=warmup)
    except Exception as e:  # noqa: BLE001 - recorded, the other rows go on
        row["error"] = f"{type(e).__name__}: {e}"
        return row, None
    wall = statistics.median(times)
    row.update(times_s=[round(t, 4) for t in times], wall_s=round(wall, 4),
               cpu_s=[round(c, 3) for c in cpus],
               cores_busy=round(statistics.median(c / t for c, t in zip(cpus, times)), 2),
               sentences_per_s=len(sentences) / wall, words_per_s=n_words / wall)
    return row, probs


def profile_text(fn: Callable, *args, top: int = 25, sort: str = "tottime") -> str:
    """``fn(*args)`` run under ``cProfile``: its ``top`` functions by ``sort``, as pstats prints
    them (cProfile slows Python-heavy code more than the rest: shares, not times)."""
    return profile_texts(fn, *args, top=top, sorts=(sort,))[sort]


def profile_texts(fn: Callable, *args, top: int = 25,
                  sorts: tuple[str, ...] = ("tottime", "cumulative")) -> dict[str, str]:
    """:func:`profile_text` for each of ``sorts``, from one profiled call of ``fn(*args)``."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn, *args)
    texts = {}
    for sort in sorts:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(top)
        texts[sort] = buf.getvalue()
    return texts


def error_row(base: dict, message: str) -> dict:
    """A row for a path that could not run."""
    return dict(base, error=message)


def _best(rows: list[dict], **match: Any) -> dict | None:
    """The fastest error-free row whose fields equal ``match``."""
    ok = [r for r in rows if r.get("error") is None and r.get("sentences_per_s")
          and all(r.get(k) == v for k, v in match.items())]
    return max(ok, key=lambda r: r["sentences_per_s"], default=None)


def _ratio(a: dict | None, b: dict | None) -> float | None:
    if a is None or b is None:
        return None
    return a["sentences_per_s"] / b["sentences_per_s"]


def _brief(row: dict | None) -> dict | None:
    if row is None:
        return None
    return {"setting": row["setting"], "sentences_per_s": row["sentences_per_s"]}


def summarize(rows: list[dict]) -> dict:
    """Speed ratios against the fastest pipeline row, the engine check, F0.5 figures."""
    pipe = _best(rows, path="hf_pipeline")
    plain = _best(rows, path="plain_torch")
    eng = _best(rows, path="engine", backend="torch", dtype="float32")
    onnx32 = _best(rows, path="engine", backend="onnx", dtype="float32")
    onnx8 = _best(rows, path="engine", backend="onnx", dtype="int8")
    ratio = _ratio(eng, pipe)
    engine_rows = [r for r in rows if r.get("path") == "engine" and r.get("backend") == "torch"
                   and r.get("dtype") == "float32"]
    checked = [r for r in engine_rows if r.get("error") is None]
    summary = {
        "engine_vs_best_pipeline": ratio,
        "target_engine_vs_best_pipeline": TARGET_SPEEDUP,
        "meets_target": None if ratio is None else ratio >= TARGET_SPEEDUP,
        "best_pipeline": _brief(pipe),
        "best_engine_torch_fp32": _brief(eng),
        "plain_torch": _brief(plain),
        "plain_torch_vs_best_pipeline": _ratio(plain, pipe),
        "engine_vs_plain_torch": _ratio(eng, plain),
        "best_engine_onnx_fp32": _brief(onnx32),
        "best_engine_onnx_int8": _brief(onnx8),
        "onnx_fp32_vs_best_pipeline": _ratio(onnx32, pipe),
        "onnx_int8_vs_best_pipeline": _ratio(onnx8, pipe),
        "onnx_int8_vs_engine_torch_fp32": _ratio(onnx8, eng),
        "engine_labels_identical": bool(checked) and all(
            r["vs_reference"]["labels_identical"] for r in checked),
        "engine_max_abs_prob_diff": max(
            (r["vs_reference"]["max_abs_prob_diff"] for r in checked), default=None),
        "engine_check_passed": bool(engine_rows) and all(r.get("check_passed") for r in engine_rows),
        "f05_reference": None if plain is None else
        {k: v["f05"] for k, v in plain["f05"].items()},
    }
    if onnx8 is not None and plain is not None:
        summary["int8_f05_change"] = {k: onnx8["f05"][k]["f05"] - plain["f05"][k]["f05"]
                                      for k in plain["f05"]}
        summary["int8_f05_change_by_budget"] = [
            {"setting": r["setting"],
             **{k: r["f05"][k]["f05"] - plain["f05"][k]["f05"] for k in plain["f05"]}}
            for r in rows if r.get("backend") == "onnx" and r.get("dtype") == "int8"
            and r.get("error") is None]
        if onnx32 is not None:
            summary["int8_f05_change_vs_onnx_fp32"] = {
                k: onnx8["f05"][k]["f05"] - onnx32["f05"][k]["f05"] for k in plain["f05"]}
    else:
        summary["int8_f05_change"] = None
    return summary


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(rows: list[dict], summary: dict) -> str:
    """A plain-text table of the rows and the headline ratio."""
    head = (f"{'path':<12} {'backend':<7} {'dtype':<7} {'setting':<40} {'sent/s':>8} "
            f"{'words/s':>9} {'wall s':>7} {'cores':>5} {'F0.5@t':>7} {'F0.5@.5':>7} {'diff':>5} "
            f"{'max|dp|':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        setting = ",".join(f"{k}={v}" for k, v in r["setting"].items())
        first = (f"{r['path']:<12} {r.get('backend', ''):<7} {r.get('dtype', ''):<7} "
                 f"{setting:<40} ")
        if r.get("error"):
            lines.append(first + f"ERROR {r['error'][:100]}")
            continue
        vs = r.get("vs_reference") or {}
        diff = vs.get("differing_words", {}).get("stored")
        lines.append(first + (
            f"{_fmt(r.get('sentences_per_s'), '8.1f')} {_fmt(r.get('words_per_s'), '9.0f')} "
            f"{_fmt(r.get('wall_s'), '7.2f')} {_fmt(r.get('cores_busy'), '5.2f')} "
            f"{_fmt(r['f05']['stored']['f05'], '7.4f')} "
            f"{_fmt(r['f05']['0.5']['f05'], '7.4f')} {_fmt(diff, '5d')} "
            f"{_fmt(vs.get('max_abs_prob_diff'), '8.1e')}"))
    ratio = summary.get("engine_vs_best_pipeline")
    lines.append("")
    lines.append(f"engine (torch fp32, best budget) vs best pipeline: {_fmt(ratio, '.2f')}x "
                 f"(target >= {TARGET_SPEEDUP}x: "
                 f"{'met' if summary.get('meets_target') else 'NOT met'}); engine labels "
                 f"{'identical to' if summary.get('engine_labels_identical') else 'DIFFER from'}"
                 f" plain torch, max |dp| {_fmt(summary.get('engine_max_abs_prob_diff'), '.1e')}")
    if summary.get("int8_f05_change") is not None:
        ch = summary["int8_f05_change"]
        lines.append(f"int8 F0.5 change vs fp32: {ch['stored']:+.4f} at the stored threshold, "
                     f"{ch['0.5']:+.4f} at 0.5")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Run every path, print the table, write the JSON; 1 when the engine check fails."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)

    import torch

    from mhmla_fast.ged.data import read_ged
    from mhmla_fast.ged.model import GedTagger, TaggerConfig, load_tokenizer
    from mhmla_fast.paths import shared_data_dir
    from mhmla_fast.provenance import provenance
    from mhmla_fast.serve.engine import Engine
    from mhmla_fast.serve.hf_pipeline import load_pipeline

    model_dir = Path(args.model)
    data = Path(args.data) if args.data else shared_data_dir() / "fce" / "fce-public.test.original.tsv"
    if not data.is_file():
        print(f"{data}: no such data file (give --data, or set MHMLA_SHARED_DATA)", file=sys.stderr)
        return 2
    corpus = [s for s in read_ged(data) if s.tokens]
    if args.limit is not None:
        corpus = corpus[: args.limit]
    sentences = [list(s.tokens) for s in corpus]
    gold = [list(s.labels) for s in corpus]
    n_words = sum(len(s) for s in sentences)

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    config = TaggerConfig.from_json((model_dir / "config.json").read_text())
    thresholds = thresholds_of(config.threshold)
    max_pieces = int(config.encoder_config.get("max_position_embeddings", 512))

    prov = provenance()
    header = {
        "benchmark": "serve_cpu",
        "device": {**cpu_info(), "load_average_start": load_average()},
        "threads": {"torch": torch.get_num_threads(), "requested": threads},
        "versions": versions(),
        "commit": prov["commit"],
        "date": prov["date"],
        "command": shlex.join(["python", "bench/benchmark_serve_cpu.py", *argv]),
        "data": {"path": str(data), "sentences": len(sentences), "words": n_words,
                 "error_words": int(sum(map(sum, gold))), "limit": args.limit},
        "model": {"dir": str(model_dir), "head": config.head, "num_heads": config.num_heads,
                  "encoder": config.encoder, "threshold_stored": config.threshold,
                  "max_pieces": max_pieces},
        "thresholds": thresholds,
        "protocol": {"repeats": args.repeats, "statistic": "median",
                     "warmup_sentences": min(args.warmup, len(sentences)),
                     "timed": "one pass over all sentences: tokenisation, batching, model, "
                              "word mapping; model loading and export excluded",
                     "chunks": "sentences per Engine.tag_tokens call (0: all in one call; "
                               "512: as mhmla-serve tag --batch-size 512)",
                     "prob_tol": PROB_TOL},
    }
    print(f"{len(sentences)} sentences, {n_words} words from {data}; {threads} threads; "
          f"load average {header['device']['load_average_start']}", flush=True)
    load = header["device"]["load_average_start"]
    if load and load[0] > 0.5 * (header["device"]["usable_cores"] or 1):
        print(f"warning: the machine is busy (1-minute load average {load[0]}): timings are "
              "not representative", file=sys.stderr, flush=True)

    rows: list[dict] = []
    reference: WordProbs | None = None

    def finish(row: dict, probs: WordProbs | None) -> None:
        if probs is not None:
            row["f05"] = score(gold, probs, thresholds)
            if reference is not None:
                row["vs_reference"] = compare(reference, probs, thresholds)
        rows.append(row)
        speed = row.get("sentences_per_s")
        print(f"  {row['path']:<12} {row.get('backend', '')} {row.get('dtype', '')} "
              f"{row['setting']}: " + (f"{speed:.1f} sentences/s" if speed else
                                       f"ERROR {row['error']}"), flush=True)

    # plain torch: the reference
    tokenizer = load_tokenizer(model_dir)
    model = GedTagger.load(model_dir, dtype=torch.float32)
    base = {"path": "plain_torch", "backend": "torch", "dtype": "float32",
            "setting": {"batch_size": args.plain_batch_size}, "threads": torch.get_num_threads()}
    row, reference = measured_row(
        base, plain_torch_tagger(model, tokenizer, args.plain_batch_size, max_pieces),
        sentences, n_words, args)
    if reference is None:
        raise RuntimeError(f"the plain torch reference failed: {row['error']}")
    finish(row, reference)
    del model

    # the Hugging Face pipeline
    try:
        pipe = load_pipeline(model_dir, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001
        pipe, pipe_error = None, f"{type(e).__name__}: {e}"
    for bs in args.pipeline_batch_sizes:
        base = {"path": "hf_pipeline", "backend": "torch", "dtype": "float32",
                "setting": {"batch_size": bs}, "threads": torch.get_num_threads(),
                "word_mapping": "is_split_into_words, aggregation_strategy='none', first piece"}
        if pipe is None:
            finish(error_row(base, pipe_error), None)
        else:
            finish(*measured_row(base, pipeline_tagger(pipe, bs), sentences, n_words, args))
    del pipe

    # the engine on torch fp32
    engine = Engine.load(model_dir, backend="torch", device="cpu", dtype="float32")
    for budget, chunk in [(b, c) for b in args.budgets for c in args.chunks]:
        base = {"path": "engine", "backend": "torch", "dtype": "float32",
                "setting": {"token_budget": budget, "max_batch": args.max_batch, "chunk": chunk},
                "threads": torch.get_num_threads()}
        row, probs = measured_row(
            base, engine_tagger(with_budget(engine, budget, args.max_batch), chunk),
            sentences, n_words, args)
        finish(row, probs)
        vs = row.get("vs_reference")
        row["check_passed"] = bool(vs) and vs["max_abs_prob_diff"] <= PROB_TOL \
            and vs["missing_words"] == 0
    del engine

    # the engine on ONNX Runtime
    onnx_report: dict[str, Any] = {"skipped": bool(args.no_onnx)}
    if not args.no_onnx:
        with tempfile.TemporaryDirectory(prefix="serve-bench-onnx-") as tmp:
            export_dir, onnx_report = prepare_onnx(model_dir, args.onnx_dir, Path(tmp))
            for dtype in ("float32", "int8"):
                base_kw = {"path": "engine", "backend": "onnx", "dtype": dtype}
                try:
                    if export_dir is None:
                        raise RuntimeError("; ".join(onnx_report["errors"].values())
                                           or "no ONNX export")
                    eng = onnx_engine(export_dir, dtype, threads, thresholds["stored"])
                except Exception as e:  # noqa: BLE001
                    for budget, chunk in [(b, c) for b in args.budgets for c in args.chunks]:
                        finish(error_row(dict(base_kw, setting={
                            "token_budget": budget, "max_batch": args.max_batch,
                            "chunk": chunk}), f"{type(e).__name__}: {e}"), None)
                    continue
                for budget, chunk in [(b, c) for b in args.budgets for c in args.chunks]:
                    base = dict(base_kw, setting={"token_budget": budget,
                                                  "max_batch": args.max_batch, "chunk": chunk},
                                threads=getattr(eng.runner, "threads", None))
                    finish(*measured_row(base, engine_tagger(with_budget(eng, budget,
                                                                           args.max_batch),
                                                             chunk),
                                         sentences, n_words, args))
                del eng
    header["onnx"] = onnx_report
    header["device"]["load_average_end"] = load_average()

    summary = summarize(rows)
    result = {"header": header, "rows": rows, "summary": summary}
    out = resolve_out_path(args.out, datetime.datetime.now(datetime.timezone.utc).date())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=_json_default) + "\n")
    print()
    print(format_table(rows, summary))
    print(f"\nwrote {out}")
    if not summary["engine_check_passed"]:
        print("FAILED: the engine (torch fp32) does not agree with plain torch within "
              f"{PROB_TOL} (see rows[].vs_reference)", file=sys.stderr)
        return 1
    return 0


def _json_default(x: Any) -> Any:
    """numpy scalars and arrays in the results."""
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


if __name__ == "__main__":
    sys.exit(main())
