"""The checked bf16 scorer on the CPU: how far OpenVINO bf16 moves the essay scorer's window
outputs, what a re-scoring margin costs and misses, the per-prompt margins, and its speed in
process. Measured, not assumed.

The checked scorer (``mhmla_fast.serve.openvino_runner.checked_scorer``) runs every window in
OpenVINO bf16 and scores again in ONNX Runtime fp32 every essay whose averaged output lies
within its prompt's margin of a rounding boundary (``mhmla_fast.aes.scoring.near_boundary``).
Its scores are fp32's wherever bf16 moved no window output by the margin or more. Over the ASAP
essays (every ``--every``-th of the TSV; 1: all of them), against ONNX Runtime fp32 on the same
export (the exact CPU path, validated against torch fp32), this script records per prompt and
in all:

* ``bf16_vs_fp32``: |out_bf16 - out_fp32| at the essay's prompt columns over its windows (max,
  quantiles, mean) and over essays' averaged outputs (max), and the scores bf16 alone changes;
* ``checked``: per uniform margin (``--margins``), the essays, windows and window tokens that
  would be scored again (shares) and the scores that would still differ from fp32's (the
  changes the margin missed); ``checked_per_prompt_margins``: the same at the per-prompt
  margins, ``--factor`` (1.35) times each prompt's largest error;
* ``split_half_check``: those margins fitted on half of each prompt's essays (even, odd) and
  applied to the other half: the changes they miss there (the rule out of sample);

``--write-margins DIR`` writes the per-prompt margins into the scorer directory DIR
(``bf16_check.json``; its export carries them to the checked scorer). Then on
``--speed-essays`` essays (stratified over the prompts, seeded) the seconds of
``predict_scores`` in process, ``--repeats`` alternating rounds, each scorer loaded fresh: ONNX
Runtime fp32 (backend auto's scorer elsewhere), OpenVINO bf16 alone, and the checked scorer at
the per-prompt margins (or ``--speed-margin``), whose scores must equal fp32's (exit 1 when not,
after writing).

    python bench/openvino_bf16_score_cpu.py --threads 2 \
        --write-margins mhmla_fast/models/aes-minilm-ridge-stack
    # -> bench/results/openvino_bf16_score_cpu_<date>.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_serve_score_cpu import stratified_sample  # noqa: E402 - the sibling script

from mhmla_fast.provenance import (  # noqa: E402
    cpu_info, dated_results_path, load_average, provenance)

RESULTS = Path(__file__).resolve().parent / "results"
MARGINS = (0.005, 0.01, 0.015, 0.02)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="scorer directory (default: the shipped one)")
    p.add_argument("--tsv", default=None, help="ASAP essay TSV (default: the shared data's)")
    p.add_argument("--every", type=int, default=1, help="every N-th essay of the TSV (1: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--token-budget", type=int, default=1024)
    p.add_argument("--margins", type=float, nargs="+", default=list(MARGINS))
    p.add_argument("--speed-essays", type=int, default=800)
    p.add_argument("--speed-margin", type=float, default=None,
                   help="one margin for the checked scorer in the timed rounds (default: the "
                   "per-prompt margins measured in this run)")
    p.add_argument("--factor", type=float, default=1.35,
                   help="per-prompt margin = factor x the prompt's largest bf16 error (1.35)")
    p.add_argument("--write-margins", metavar="DIR", default=None,
                   help="write the per-prompt margins into the scorer directory DIR "
                   "(bf16_check.json, read by the checked scorer through its export)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="a .json file or a folder (default bench/results)")
    args = p.parse_args(argv)
    if args.every < 1 or args.repeats < 1 or args.speed_essays < 0 or min(args.margins) <= 0 \
            or args.factor < 1:
        p.error("--every and --repeats must be >= 1, --speed-essays >= 0, --margins positive, "
                "--factor >= 1")
    return args


def prompt_columns(outputs: np.ndarray, prompts: Sequence[int], columns: dict,
                   regression: bool) -> list[np.ndarray]:
    """Each row's output at its prompt's columns (a value, or probabilities [C_p])."""
    res = []
    for row, p in zip(outputs, prompts):
        a, b = columns[int(p)]
        res.append(row[a] if regression else row[a:b])
    return res


def stats(values: np.ndarray) -> dict:
    return {"max_abs": float(values.max()), "q999_abs": float(np.quantile(values, 0.999)),
            "q99_abs": float(np.quantile(values, 0.99)), "mean_abs": float(values.mean())}


class Calibration:
    """Both runners' outputs over the essays, and what the tables are made of."""

    def __init__(self, fp32_scorer, bf16_runner, texts: list[str], prompts: list[int],
                 token_budget: int):
        from mhmla_fast.aes.scoring import essay_offsets, essay_scores, piece_windows

        cfg = self.cfg = fp32_scorer.config
        regression = cfg.objective == "regression"
        windows, essay_index = piece_windows(fp32_scorer.encode(texts), cfg.window,
                                             fp32_scorer.cls_id, fp32_scorer.sep_id)
        window_prompts = [prompts[e] for e in essay_index]
        t = time.perf_counter()
        out32 = fp32_scorer.window_outputs(windows, token_budget=token_budget)
        s32 = time.perf_counter() - t
        t = time.perf_counter()
        out16 = fp32_scorer.window_outputs(windows, token_budget=token_budget, runner=bf16_runner)
        s16 = time.perf_counter() - t
        self.seconds = {"onnxruntime float32": round(s32, 2), "openvino bfloat16": round(s16, 2)}
        w32 = prompt_columns(out32, window_prompts, fp32_scorer.columns, regression)
        w16 = prompt_columns(out16, window_prompts, fp32_scorer.columns, regression)
        offsets = essay_offsets(texts, prompts, cfg.surface_weights)  # the essays' own terms
        self.sc32, mean32 = essay_scores(w32, essay_index, prompts, cfg.objective, cfg.decision,
                                         cfg.cutpoints, offsets)
        self.sc16, mean16 = essay_scores(w16, essay_index, prompts, cfg.objective, cfg.decision,
                                         cfg.cutpoints, offsets)
        self.mean16 = mean16
        self.prompts = np.asarray(prompts)
        self.essay_index = np.asarray(essay_index)
        self.win_dev = np.array([np.abs(np.asarray(a, np.float64)
                                        - np.asarray(b, np.float64)).max()
                                 for a, b in zip(w32, w16)])
        self.essay_dev = np.array([np.abs(np.asarray(a) - np.asarray(b)).max()
                                   for a, b in zip(mean32, mean16)])
        tokens = np.array([len(w) for w in windows])
        self.n_windows = np.bincount(essay_index, minlength=len(texts))
        self.n_tokens = np.bincount(essay_index, weights=tokens, minlength=len(texts))
        self.window_count, self.token_count = len(windows), int(tokens.sum())

    def groups(self, essays: np.ndarray) -> dict[str, np.ndarray]:
        """``essays`` per prompt, and all of them."""
        out = {f"prompt {p}": essays[self.prompts[essays] == p]
               for p in sorted(set(self.prompts[essays].tolist()))}
        out["all"] = essays
        return out

    def max_error(self, essays: np.ndarray) -> dict[int, float]:
        """The largest window-output error of each prompt over ``essays``' windows."""
        keep = np.isin(self.essay_index, essays)
        return {int(p): float(self.win_dev[keep & (self.prompts[self.essay_index] == p)].max())
                for p in sorted(set(self.prompts[essays].tolist()))}

    def checked(self, essays: np.ndarray, margin: float | dict[int, float]) -> dict:
        """What the checked scorer at ``margin`` (one, or per prompt) would re-score of
        ``essays`` (shares of essays, windows and window tokens) and the score changes of bf16
        it would miss."""
        from mhmla_fast.aes.scoring import near_boundary

        cfg = self.cfg
        near = np.zeros(len(self.prompts), dtype=bool)
        for p in sorted(set(self.prompts[essays].tolist())):
            ep = essays[self.prompts[essays] == p]
            m = margin[p] if isinstance(margin, dict) else margin
            near[ep] = near_boundary(np.stack([self.mean16[e] for e in ep]), p, cfg.objective,
                                     cfg.decision, margin=m,
                                     cutpoints=cfg.cutpoints.get(p))
        changed = self.sc32[essays] != self.sc16[essays]
        return {"essays_rescored": int(near[essays].sum()),
                "share_essays": round(float(near[essays].mean()), 4),
                "share_windows": round(float(self.n_windows[essays][near[essays]].sum()
                                             / self.n_windows[essays].sum()), 4),
                "share_tokens": round(float(self.n_tokens[essays][near[essays]].sum()
                                            / self.n_tokens[essays].sum()), 4),
                "scores_missed": int((changed & ~near[essays]).sum())}

    def table(self, essays: np.ndarray, margins: Sequence[float],
              per_prompt: dict[int, float] | None = None) -> dict:
        """Per prompt and in all: the bf16 error, and :meth:`checked` at each uniform margin
        (and at ``per_prompt`` margins)."""
        out = {}
        for name, idx in self.groups(essays).items():
            wmask = np.isin(self.essay_index, idx)
            row = {"essays": len(idx), "windows": int(self.n_windows[idx].sum()),
                   "window_tokens": int(self.n_tokens[idx].sum()),
                   "bf16_vs_fp32": {"window": stats(self.win_dev[wmask]),
                                    "essay_max_abs": float(self.essay_dev[idx].max()),
                                    "scores_changed": int((self.sc32[idx]
                                                           != self.sc16[idx]).sum())},
                   "checked": [{"margin": m, **self.checked(idx, m)} for m in margins]}
            if per_prompt is not None:
                row["checked_per_prompt_margins"] = self.checked(idx, per_prompt)
            out[name] = row
        return out


def per_prompt_margins(cal: Calibration, essays: np.ndarray, factor: float) -> dict[int, float]:
    """``factor`` times each prompt's largest window-output error over ``essays``, rounded up
    in the fourth decimal."""
    return {p: float(np.ceil(factor * e * 1e4) / 1e4) for p, e in cal.max_error(essays).items()}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import openvino

    from mhmla_fast.aes.data import read_asap
    from mhmla_fast.aes.splits import asap_files
    from mhmla_fast.serve.export_cache import SCORER, ensure_export
    from mhmla_fast.serve.openvino_runner import (SCORE_CHECK_MARGIN, OpenVinoRunner,
                                                  checked_scorer)
    from mhmla_fast.serve.score import default_scorer_path
    from mhmla_fast.serve.score_onnx import OnnxScorer, write_check_margins

    model = Path(args.model) if args.model else default_scorer_path()
    tsv = Path(args.tsv) if args.tsv else asap_files()[0]
    export = ensure_export(model, kind=SCORER, threads=args.threads).path
    essays = read_asap(tsv)
    result = {"benchmark": "openvino_bf16_score_cpu", "provenance": provenance(),
              "cpu": cpu_info(), "load_average_start": load_average(),
              "openvino": openvino.__version__, "model": model.name, "data": str(tsv),
              "every": args.every, "threads": args.threads, "token_budget": args.token_budget,
              "default_margin": SCORE_CHECK_MARGIN, "factor": args.factor}
    picked = essays[::args.every]
    fp32 = OnnxScorer(export, threads=args.threads)
    bf16 = OpenVinoRunner(Path(export) / "model.onnx", dtype="bfloat16", threads=args.threads)
    cal = Calibration(fp32, bf16, [e.text for e in picked], [e.prompt for e in picked],
                      args.token_budget)
    everyone = np.arange(len(picked))
    margins = per_prompt_margins(cal, everyone, args.factor)
    # the margins' rule checked out of sample: margins from the even essays of each prompt,
    # applied to the odd ones (and the other way round)
    halves = {}
    for name, fit, test in (("even -> odd", everyone[0::2], everyone[1::2]),
                            ("odd -> even", everyone[1::2], everyone[0::2])):
        fitted = per_prompt_margins(cal, fit, args.factor)
        halves[name] = {"margins": {str(p): m for p, m in fitted.items()},
                        **{k: v for k, v in cal.checked(test, fitted).items()}}
    result["calibration"] = {
        "essays": len(picked), "windows": cal.window_count, "window_tokens": cal.token_count,
        "seconds": cal.seconds,
        "per_prompt_margins": {str(p): m for p, m in margins.items()},
        "per_prompt_margins_rule": f"{args.factor} x the prompt's largest |bf16 - fp32| window "
                                   "output, rounded up in the fourth decimal",
        "split_half_check": halves,
        "prompts": cal.table(everyone, sorted(args.margins), margins)}
    for name, row in result["calibration"]["prompts"].items():
        own = row["checked_per_prompt_margins"]
        print(f"{name}: max |dout| window {row['bf16_vs_fp32']['window']['max_abs']:.4f} essay "
              f"{row['bf16_vs_fp32']['essay_max_abs']:.4f}, "
              f"{row['bf16_vs_fp32']['scores_changed']} scores changed alone; per-prompt "
              f"margins: {own['share_tokens']:.1%} tokens, {own['scores_missed']} missed; "
              + ", ".join(f"margin {c['margin']}: {c['share_tokens']:.1%} tokens, "
                          f"{c['scores_missed']} missed" for c in row["checked"]),
              file=sys.stderr, flush=True)
    for name, half in halves.items():
        print(f"split halves {name}: {half['share_tokens']:.1%} tokens, "
              f"{half['scores_missed']} missed", file=sys.stderr)
    if args.write_margins:
        file = write_check_margins(
            args.write_margins, margins, rule=result["calibration"]["per_prompt_margins_rule"],
            essays=len(picked), data=Path(tsv).name,
            measured=f"bench/openvino_bf16_score_cpu.py on {cpu_info()['cpu']}, "
                     f"OpenVINO {openvino.__version__}, {result['provenance']['date']}")
        result["wrote_margins"] = str(file)
        print(f"wrote {file}", file=sys.stderr)
    del fp32, bf16, cal
    ok = True
    if args.speed_essays:
        sample = stratified_sample(essays, args.speed_essays, args.seed)
        texts, prompts = [e.text for e in sample], [e.prompt for e in sample]
        margin = margins if args.speed_margin is None else args.speed_margin
        label = ("per-prompt margins" if args.speed_margin is None
                 else f"margin {args.speed_margin}")
        paths = {"onnxruntime float32": lambda: OnnxScorer(export, threads=args.threads),
                 "openvino bfloat16 alone": lambda: checked_scorer(export, margin=0.0,
                                                                   threads=args.threads),
                 f"checked bfloat16 ({label})": lambda: checked_scorer(
                     export, margin=margin, threads=args.threads)}
        seconds: dict[str, list[float]] = {k: [] for k in paths}
        scores: dict[str, np.ndarray] = {}
        rescored = []
        for _ in range(args.repeats):
            for key, make in paths.items():
                scorer = make()
                t = time.perf_counter()
                got = scorer.predict_scores(texts, prompts, token_budget=args.token_budget)
                seconds[key].append(time.perf_counter() - t)
                scores[key] = np.asarray(got)
                if getattr(scorer, "exact", None) is not None:
                    rescored.append(scorer.rescored)
        exact = scores["onnxruntime float32"]
        checked = scores[list(paths)[-1]]
        ok = bool((checked == exact).all())
        result["speed"] = {
            "essays": len(texts), "repeats": args.repeats,
            "margin": ({str(p): m for p, m in margin.items()} if isinstance(margin, dict)
                       else margin),
            "note": "scorers loaded fresh for each round; in process, predict_scores only",
            "seconds": {k: [round(x, 3) for x in v] for k, v in seconds.items()},
            "essays_per_s": {k: round(len(texts) / float(np.median(v)), 1)
                             for k, v in seconds.items()},
            "rescored_per_round": rescored,
            "scores_differing_from_fp32": {k: int((v != exact).sum())
                                           for k, v in scores.items()},
            "checked_equals_fp32": ok}
        print(json.dumps(result["speed"]["essays_per_s"], indent=1))
    result["load_average_end"] = load_average()
    out = dated_results_path(args.out, "openvino_bf16_score_cpu", RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    if not ok:
        print("the checked scorer's scores differ from ONNX Runtime fp32's", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
