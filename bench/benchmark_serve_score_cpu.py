"""Essays/s of ``mhmla-serve score`` on CPU (or a GPU), end to end, on a fixed sample of ASAP
essays.

    python bench/benchmark_serve_score_cpu.py                       # shipped scorer, 400 essays
    python bench/benchmark_serve_score_cpu.py --backend torch       # torch, not the export
    python bench/benchmark_serve_score_cpu.py --compare-torch       # auto's scores = torch's?
    python bench/benchmark_serve_score_cpu.py --device cuda --dtype bfloat16 --essays 4000
    python bench/benchmark_serve_score_cpu.py --model runs/aes-ridge/aes-minilm-ridge-stack
    python bench/benchmark_serve_score_cpu.py --essays 40 --out /tmp/   # a quick check

Sample: ``--essays`` (400) essays of the ASAP TSV (``--tsv``, default the shared data folder's,
found by ``mhmla_fast.aes.train.asap_files``), stratified over the 8 prompts (``essays // 8``
each, the remainder to the lowest prompts; all of a prompt's essays when it has fewer), drawn
with ``random.Random(--seed)`` from each prompt's essays in essay-id order and then shuffled
together, so prompts are mixed in the stream as real traffic would mix them. The sample is
written as JSONL ``{"id", "prompt", "text"}`` into a temporary folder. Its word pieces (scorer
tokenizer, no special tokens) and windows (``split_windows`` with the scorer's window) are
counted up front.

Timed:

end_to_end   the real command, ``python -m mhmla_fast.commands.serve score SAMPLE --output OUT
             --model MODEL --backend K --device D --dtype X --threads T --batch-essays B
             --token-budget N --no-progress``, in a subprocess: wall clock from spawn to exit,
             nothing excluded (interpreter start, imports, model load, reading, tokenising,
             scoring, fsync-ed writing). The median of ``--repeats`` (1) runs, each into a fresh
             output. Backend auto's export cache is a scratch folder (``$MHMLA_CACHE_DIR``):
             one untimed run first fills it (it exports the scorer: ``cold_cache``, with its
             wall seconds and the line it printed), so the timed runs start warm.
in_process   the same work without the command around it, in this process: ``load_scorer``
             with ``--backend`` on ``--device`` in ``--dtype`` with ``--threads`` T (the same
             scratch cache; ``load_s``) and then ``predict_scores`` over the same chunks of B
             essays (``predict_s``, a warm-up chunk first). ``end_to_end - predict_s`` is what
             starting the command costs.

The command's scores must equal the in-process ones (same chunks, budget and threads); the
script exits 1, after writing the results, when they do not or the command fails. QWK per
prompt against the gold scores is reported for orientation only (the sample is small).

``--device`` defaults to cpu and ``--dtype`` to the command's own default (float32 on the CPU,
or with backend auto on a CPU with AMX and OpenVINO the checked bfloat16 scorer, whose scores
are fp32's; the header records the dtype it resolved to); on a CUDA device the header names the
GPU and the results file is ``aes_serve_cuda_<date>.json``.

JSON (``--out``, default ``bench/results/aes_serve_cpu_<date>.json``, ``-2``, ``-3``... appended
rather than overwriting; ``--out DIR`` gets the default name in DIR): ``header`` (device: CPU
model, cores, load average before and after; torch/transformers versions, commit, command,
date; model and its settings; data and sample), ``sample`` (essays, pieces, windows, means),
``end_to_end``, ``in_process``, ``check`` (with ``--compare-torch`` also ``equals_torch``) and
``quality``. A summary is printed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mhmla_fast.provenance import cpu_info, dated_results_path, load_average

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT_DIR = REPO_ROOT / "bench" / "results"
PROMPTS = (1, 2, 3, 4, 5, 6, 7, 8)


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    from mhmla_fast.serve.score import DTYPES

    p = argparse.ArgumentParser(description="Essays/s of `mhmla-serve score` on CPU or a GPU.")
    p.add_argument("--model", default=None,
                   help="essay-scorer directory (default: the shipped scorer)")
    p.add_argument("--tsv", default=None,
                   help="ASAP essay TSV (default: the shared data folder's asap_aes TSV)")
    p.add_argument("--essays", type=int, default=400, help="essays in the sample (default 400)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--batch-essays", type=int, default=64,
                   help="essays per scorer call, as `score --batch-essays` (default 64)")
    p.add_argument("--token-budget", type=int, default=8192,
                   help="padded word pieces per forward pass (default 8192)")
    p.add_argument("--backend", default="auto", choices=("auto", "torch"),
                   help="the scorer's runtime, as `score --backend` (default auto: on the CPU, "
                   "ONNX Runtime on its cached export)")
    p.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda, cuda:1")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="scorer weights and compute, as `score --dtype` (default: the "
                   "command's, float32 on the CPU or, with auto on a CPU with AMX and OpenVINO, "
                   "the checked bfloat16 scorer; bfloat16 on a GPU)")
    p.add_argument("--repeats", type=int, default=1, help="end-to-end runs (median; default 1)")
    p.add_argument("--compare-torch", action="store_true",
                   help="with --backend auto: also score the sample in process with --backend "
                   "torch (untimed) and count the essays whose scores differ")
    p.add_argument("--out", default=None, help="results .json file or folder")
    args = p.parse_args(argv)
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        p.error(f"--device: expected cpu or cuda[:N], got {args.device!r}")
    for name in ("essays", "threads", "batch_essays", "token_budget", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def resolve_model(model: str | None) -> Path:
    """``--model`` or the shipped scorer; exits with a message when it is not a scorer dir."""
    from mhmla_fast.aes.model import default_model_path

    path = Path(model) if model else default_model_path()
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        hint = "" if model else (" (the shipped scorer is not installed; pass --model DIR, e.g. "
                                 "runs/aes-ridge/aes-minilm-ridge-stack)")
        sys.exit(f"{path}: not an essay-scorer directory{hint}")
    return path


# ------------------------------------------------------------------------------- header


def resolve_out_path(out: str | None, today: datetime.date, device: str = "cpu") -> Path:
    """``--out FILE.json`` as given; a folder (default ``bench/results/``) gets
    ``aes_serve_<cpu|cuda>_<date>.json``, with ``-2``, ``-3``... when that file exists."""
    kind = "cpu" if device == "cpu" else "cuda"
    return dated_results_path(out, f"aes_serve_{kind}", DEFAULT_OUT_DIR, today)


# ------------------------------------------------------------------------------- sample


def stratified_sample(essays: Sequence[Any], n: int, seed: int) -> list[Any]:
    """``n`` essays, ``n // 8`` per prompt (remainder to the lowest prompts; all of a prompt's
    essays when it has fewer), drawn with ``random.Random(seed)`` from each prompt's essays in
    essay-id order, then shuffled together. Deterministic for a given file and seed."""
    rng = random.Random(seed)
    by_prompt = {p: sorted((e for e in essays if e.prompt == p), key=lambda e: e.essay_id)
                 for p in PROMPTS}
    picked: list[Any] = []
    for k, p in enumerate(PROMPTS):
        want = n // len(PROMPTS) + (k < n % len(PROMPTS))
        pool = by_prompt[p]
        picked += rng.sample(pool, min(want, len(pool)))
    rng.shuffle(picked)
    return picked


def count_windows(model_dir: Path, texts: Sequence[str]) -> tuple[list[int], list[int]]:
    """Word pieces (no special tokens) and windows of each text, by the scorer's tokenizer and
    window (``ScorerConfig.window`` read from ``config.json`` by the library, whichever config
    format it has; 510 when unset)."""
    from mhmla_fast.aes.model import ScorerConfig, load_tokenizer
    from mhmla_fast.aes.windows import split_windows

    window = ScorerConfig.from_json((model_dir / "config.json").read_text()).window or 510
    tok = load_tokenizer(str(model_dir))
    pieces = [len(ids) for ids in tok(list(texts), add_special_tokens=False, truncation=False,
                                      verbose=False)["input_ids"]]
    return pieces, [len(split_windows(n, window)) for n in pieces]


def write_jsonl(path: Path, sample: Sequence[Any]) -> None:
    """The sample as ``score`` input: ``{"id", "prompt", "text"}`` per line."""
    with open(path, "w", encoding="utf-8") as f:
        for e in sample:
            f.write(json.dumps({"id": e.essay_id, "prompt": e.prompt, "text": e.text},
                               ensure_ascii=False) + "\n")


# ------------------------------------------------------------------------------ timing


def score_command(model: Path, src: Path, out: Path, args: argparse.Namespace) -> list[str]:
    """The ``mhmla-serve score`` command line that is timed."""
    return [sys.executable, "-m", "mhmla_fast.commands.serve", "score", str(src),
            "--output", str(out), "--model", str(model), "--backend", args.backend,
            "--device", args.device, *(["--dtype", args.dtype] if args.dtype else []),
            "--threads", str(args.threads), "--batch-essays", str(args.batch_essays),
            "--token-budget", str(args.token_budget), "--no-progress"]


def time_command(cmd: list[str], out: Path) -> tuple[float, int, str, list[dict]]:
    """Run ``cmd`` once into a fresh ``out`` (with this process's ``$MHMLA_CACHE_DIR``): (wall
    seconds, exit status, stderr tail, records)."""
    if out.exists():
        out.unlink()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seconds = time.perf_counter() - t0
    records = ([json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
               if out.exists() else [])
    return seconds, proc.returncode, proc.stderr.decode(errors="replace")[-2000:], records


def time_in_process(model: Path, texts: list[str], prompts: list[int],
                    args: argparse.Namespace) -> tuple[float, float, list[int], str]:
    """(load seconds, predict seconds, scores, the scorer's class name): ``load_scorer`` with
    ``--backend`` on ``--device`` in ``--dtype`` with ``--threads``, then ``predict_scores`` per
    chunk of ``--batch-essays`` after one untimed warm-up chunk (its integer scores come back to
    the host, so each chunk's GPU work is finished)."""
    from mhmla_fast.serve.score import load_scorer

    t0 = time.perf_counter()
    scorer = load_scorer(model, backend=args.backend, device=args.device, dtype=args.dtype,
                         threads=args.threads)
    load_s = time.perf_counter() - t0
    b = args.batch_essays
    scorer.predict_scores(texts[:b], prompts[:b], token_budget=args.token_budget)
    scores: list[int] = []
    t0 = time.perf_counter()
    for k in range(0, len(texts), b):
        scores += scorer.predict_scores(texts[k:k + b], prompts[k:k + b],
                                        token_budget=args.token_budget).tolist()
    return load_s, time.perf_counter() - t0, scores, type(scorer).__name__


def torch_scores(model: Path, texts: list[str], prompts: list[int],
                 args: argparse.Namespace) -> list[int]:
    """The sample's scores by ``load_scorer(--backend torch)`` in the same chunks (untimed)."""
    from mhmla_fast.serve.score import load_scorer

    scorer = load_scorer(model, backend="torch", device=args.device, dtype=args.dtype,
                         threads=args.threads)
    b = args.batch_essays
    return [int(s) for k in range(0, len(texts), b)
            for s in scorer.predict_scores(texts[k:k + b], prompts[k:k + b],
                                           token_budget=args.token_budget)]


def rates(seconds: float, essays: int, pieces: int, windows: int) -> dict[str, float | None]:
    """essays/s, pieces/s and windows/s over ``seconds``."""
    if seconds <= 0:
        return {"essays_per_s": None, "pieces_per_s": None, "windows_per_s": None}
    return {"essays_per_s": round(essays / seconds, 2), "pieces_per_s": round(pieces / seconds, 1),
            "windows_per_s": round(windows / seconds, 2)}


def quality(sample: Sequence[Any], scores: Sequence[int]) -> dict[str, Any]:
    """QWK against the gold scores per prompt and their mean, and exact agreement."""
    from mhmla_fast.aes.metrics import exact_agreement, quadratic_weighted_kappa

    per_prompt = {}
    for p in PROMPTS:
        idx = [k for k, e in enumerate(sample) if e.prompt == p]
        if idx:
            per_prompt[str(p)] = round(quadratic_weighted_kappa(
                [sample[k].score for k in idx], [scores[k] for k in idx]), 4)
    return {"qwk_per_prompt": per_prompt,
            "qwk_mean": round(statistics.fmean(per_prompt.values()), 4) if per_prompt else None,
            "exact_agreement": round(exact_agreement([e.score for e in sample], scores), 4),
            "note": "orientation only: a small sample, not the test folds"}


# -------------------------------------------------------------------------------- main


def header(args: argparse.Namespace, model: Path, tsv: Path) -> dict[str, Any]:
    """Where and what: device, versions, commit, command, model and data."""
    from mhmla_fast.provenance import provenance
    from mhmla_fast.serve.score import scorer_options

    prov = provenance()
    cfg = json.loads((model / "config.json").read_text())
    cfg = {**cfg, **{k: v for group in ("encoder_spec", "layer_attention")  # nested formats
                     for k, v in (cfg.get(group) or {}).items()}}
    device: dict[str, Any] = {**cpu_info(), "load_average_start": load_average()}
    if args.device != "cpu":
        import torch

        device["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
        device["cuda"] = torch.version.cuda
    return {
        "device": device,
        "torch": prov["torch"], "transformers": prov["transformers"], "python": prov["python"],
        "commit": prov["commit"], "date": prov["date"], "command": prov["command"],
        "model": str(model),
        "model_config": {k: cfg.get(k) for k in ("head_kind", "head", "mode", "num_heads",
                                                 "pooling", "objective", "prompts", "window",
                                                 "max_length", "freeze_encoder", "freeze")},
        "data": str(tsv),
        "settings": {"threads": args.threads, "batch_essays": args.batch_essays,
                     "token_budget": args.token_budget, "backend": args.backend,
                     "device": args.device, "dtype": args.dtype,
                     "resolved_dtype": scorer_options(args.backend, args.device,
                                                      args.dtype).dtype,
                     "repeats": args.repeats, "seed": args.seed},
    }


def summary_lines(result: dict[str, Any]) -> list[str]:
    """A readable summary of the result."""
    s, e, i = result["sample"], result["end_to_end"], result["in_process"]
    return [
        f"sample: {s['essays']} essays, {s['mean_pieces']:.0f} pieces and "
        f"{s['mean_windows']:.2f} windows per essay ({s['multi_window_essays']} with >1 window)",
        f"end to end (mhmla-serve score): {e['seconds']:.2f} s, {e['essays_per_s']} essays/s, "
        f"{e['pieces_per_s']} pieces/s  [exit {e['exit_status']}]",
        f"in process: load {i['load_s']:.2f} s; predict {i['predict_s']:.2f} s, "
        f"{i['essays_per_s']} essays/s, {i['pieces_per_s']} pieces/s",
        f"command overhead (start, imports, load, I/O): {result['command_overhead_s']:.2f} s",
        f"scores equal in process: {result['check']['cli_equals_in_process']} "
        f"({result['check']['mismatches']} differ)",
    ] + ([f"scores equal to --backend torch's: {t['essays'] - t['differing']} of {t['essays']}"]
         if (t := result["check"].get("equals_torch")) else [])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from mhmla_fast.aes.data import read_asap
    from mhmla_fast.aes.train import asap_files

    model = resolve_model(args.model)
    tsv = Path(args.tsv) if args.tsv else asap_files()[0]
    head = header(args, model, tsv)
    sample = stratified_sample(read_asap(tsv), args.essays, args.seed)
    texts, prompts = [e.text for e in sample], [e.prompt for e in sample]
    pieces, windows = count_windows(model, texts)
    n, n_pieces, n_windows = len(sample), sum(pieces), sum(windows)
    sample_info = {
        "essays": n, "per_prompt": {str(p): prompts.count(p) for p in PROMPTS},
        "pieces": n_pieces, "windows": n_windows, "mean_pieces": round(n_pieces / n, 1),
        "mean_windows": round(n_windows / n, 3), "max_pieces": max(pieces),
        "multi_window_essays": sum(w > 1 for w in windows)}

    cache_before = os.environ.get("MHMLA_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="aes-serve-bench-") as tmp:
        os.environ["MHMLA_CACHE_DIR"] = str(Path(tmp) / "export-cache")  # a scratch cache
        try:
            src, out = Path(tmp) / "essays.jsonl", Path(tmp) / "scores.jsonl"
            write_jsonl(src, sample)
            cmd = score_command(model, src, out, args)
            cold = time_command(cmd, out)  # fills the scratch cache (backend auto exports)
            runs = [time_command(cmd, out) for _ in range(args.repeats)]
            load_s, predict_s, scores, kind = time_in_process(model, texts, prompts, args)
        finally:
            if cache_before is None:
                os.environ.pop("MHMLA_CACHE_DIR", None)
            else:
                os.environ["MHMLA_CACHE_DIR"] = cache_before
    seconds = statistics.median(r[0] for r in runs)
    status, stderr, records = runs[0][1], runs[0][2], runs[0][3]
    end_to_end = {"command": " ".join(cmd), "seconds": round(seconds, 3),
                  "seconds_all": [round(r[0], 3) for r in runs], "exit_status": status,
                  **rates(seconds, n, n_pieces, n_windows),
                  "cold_cache": {"seconds": round(cold[0], 3), "exit_status": cold[1],
                                 "stderr_tail": cold[2][-600:]}}
    if status != 0:
        end_to_end["stderr_tail"] = stderr

    in_process = {"scorer": kind, "load_s": round(load_s, 3), "predict_s": round(predict_s, 3),
                  **rates(predict_s, n, n_pieces, n_windows)}
    cli_scores = [r.get("score") for r in records]
    mismatches = sum(a != b for a, b in zip(cli_scores, scores)) + abs(len(cli_scores) - n)
    head["device"]["load_average_end"] = load_average()
    result = {"header": head, "sample": sample_info, "end_to_end": end_to_end,
              "in_process": in_process, "command_overhead_s": round(seconds - predict_s, 3),
              "check": {"cli_equals_in_process": status == 0 and mismatches == 0,
                        "mismatches": mismatches},
              "quality": quality(sample, scores)}
    if args.compare_torch and args.backend != "torch":
        want = torch_scores(model, texts, prompts, args)
        result["check"]["equals_torch"] = {
            "essays": n, "differing": sum(a != b for a, b in zip(scores, want)),
            "note": "this backend's in-process scores against --backend torch's, same chunks"}

    path = resolve_out_path(args.out, datetime.datetime.now(datetime.timezone.utc).date(),
                            args.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(summary_lines(result)))
    print(f"wrote {path}")
    if not result["check"]["cli_equals_in_process"]:
        print("FAILED: the command failed or its scores differ from predict_scores "
              "(see end_to_end.stderr_tail / check)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
