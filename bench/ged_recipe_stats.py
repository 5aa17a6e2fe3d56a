"""GED training recipes over seeds: a candidate recipe against baseline recipes of the same
system (encoder, head, J), from ``mhmla-eval ged-suite`` files, and issue 13's re-ship rule.

    python bench/ged_recipe_stats.py \\
        --candidate "lr 1e-4, warm-up + decay, 6 epochs, fp32=bench/results/ged_recipe_cpu/ged_minilm_mhmla_lin-lr1e-4_seed?.json" \\
        --baseline "paper's recipe, bf16=bench/results/ged_table2_cpu_bf16/ged_minilm_mhmla_seed?.json" \\
        --baseline "paper's recipe, fp32=bench/results/ged_minilm_mhmla_seed0.json" \\
        --out bench/results/ged_recipe_cpu/ged_minilm_recipe_stats.json

A group is ``LABEL=PATTERN[,PATTERN...]`` (paths or globs; the label may not hold ``=``). Its
files are one system trained identically apart from the seed (``training.config.seed``, one file
per seed; settings as in ``bench/ged_seed_stats.py``); all groups are one system on the same test
data. Per seed, in percent, for F0.5 at argmax (``f05``) and at the dev-tuned threshold
(``f05_threshold``): the training's ``dev`` score (selection set, optimistic), each test set, and
``others`` = the mean of CoNLL14-1, CoNLL14-2 and JFLEG (issue 13: "better on FCE dev and on
the mean of the other test sets"). Per group the spread (mean, sample std, min, max, every seed);
per baseline, the candidate minus the baseline paired on the seeds both have
(``ged_seed_stats.paired``: mean difference, 95% t-interval, paired t-test, exact sign flips;
no verdict below ``--min-seeds``; ``p_holm`` and ``verdict_holm`` after Holm's adjustment over
every paired test against that baseline, both metrics and every quantity) and the difference
of means with Welch's t-test over all seeds of each (unpaired; None where a group has one
seed). ``rule``: per baseline and metric, whether
the candidate's mean is above the baseline's on dev and on ``others``.

Groups that differ in more than the recipe (another precision, say) are compared all the same;
``recipe_differences`` lists every setting in which each baseline differs from the candidate
(settings of runs from before the configs were grouped read under the grouped names), and
``recorded_by_one_side`` the settings only one side records (a run that predates them), so a
reader sees what else changed. Written: ``--out`` (JSON) and Markdown on stdout.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ged_seed_stats as gs  # noqa: E402 - the sibling script, by file name

OTHERS = ("conll14_a1", "conll14_a2", "jfleg_test")
QUANTITIES = ("dev", *gs.SETS, "others")
QUANTITY_LABELS = {"dev": "FCE dev", **gs.SET_LABELS, "others": "mean of the other three"}


def parse_group(text: str) -> tuple[str, list[str]]:
    """``LABEL=PATTERN[,PATTERN...]`` -> (label, paths); ValueError for a bad form or a pattern
    that matches nothing."""
    label, sep, patterns = text.partition("=")
    if not sep or not label.strip() or not patterns.strip():
        raise ValueError(f"expected LABEL=PATTERN[,PATTERN...], got {text!r}")
    paths: list[str] = []
    for p in patterns.split(","):
        found = sorted(glob.glob(p)) if glob.has_magic(p) else [p]
        if not found:
            raise ValueError(f"{label}: no file matches {p}")
        paths += [x for x in found if x not in paths]
    return label.strip(), paths


def load_group(label: str, paths: Sequence[str]) -> list[gs.Run]:
    """The group's runs by seed; ValueError where they are not one system trained identically
    apart from the seed, or a seed repeats."""
    runs = []
    for path in paths:
        result = json.loads(Path(path).read_text())
        if not isinstance(result.get("sets"), dict) or "head" not in result:
            raise ValueError(f"{path}: not a result of mhmla-eval ged-suite (no 'sets' or 'head')")
        config = (result.get("training") or {}).get("config") or {}
        if "seed" not in config:
            raise ValueError(f"{path}: no training seed recorded (training.config.seed)")
        j = int(result["num_heads"]) if result["head"] == "mhmla" else None
        runs.append(gs.Run(str(path), str(result.get("encoder")), result["head"], j,
                           int(config["seed"]), result))
    runs.sort(key=lambda r: r.seed)
    for a, b in zip(runs, runs[1:]):
        if a.seed == b.seed:
            raise ValueError(f"{label}: seed {a.seed} twice ({a.path}, {b.path})")
    for r in runs[1:]:
        if r.system != runs[0].system:
            raise ValueError(f"{label}: {runs[0].path} is {gs.system_key(runs[0].system)}, "
                             f"{r.path} {gs.system_key(r.system)}")
        diff = gs._recipe_diff(runs[0], r, gs.RECIPE_FREE)
        if diff:
            raise ValueError(f"{label}: {runs[0].path} and {r.path} differ in more than the "
                             f"seed: {diff}")
    return runs


def per_seed(run: gs.Run, metric: str) -> dict[str, float]:
    """{quantity: value in percent} of one run (``metric``: f05 or f05_threshold)."""
    block, score = gs.METRICS[metric]
    training = run.result.get("training") or {}
    dev = training.get(gs.DEV_BLOCKS[block])
    if dev is None:
        raise ValueError(f"{run.path}: no training dev scores ({gs.DEV_BLOCKS[block]})")
    out = {"dev": 100.0 * float(dev[score])}
    for s in gs.SETS:
        out[s] = 100.0 * float(run.result["sets"][s][block][score])
    out["others"] = float(np.mean([out[s] for s in OTHERS]))
    return out


# settings of runs from before the configs were grouped, under their grouped names
FLAT_SETTINGS = {"encoder": "encoder_spec.name_or_path", "max_length": "encoder_spec.max_length",
                 "head": "layer_attention.mode", "num_heads": "layer_attention.num_heads",
                 "key_size": "layer_attention.key_size", "dropout": "layer_attention.dropout"}


def _settings(run: gs.Run) -> dict:
    """The run's training settings (seed and the like aside) under the grouped names."""
    out = {}
    for k, v in gs._recipe(run, gs.RECIPE_FREE).items():
        if k == "freeze_word_embeddings":
            k, v = "encoder_spec.freeze", "word_embeddings" if v else "none"
        out[FLAT_SETTINGS.get(k, k)] = v
    return out


def recipe_differences(a: gs.Run, b: gs.Run) -> tuple[dict[str, list], dict[str, list]]:
    """({setting: [a's, b's]} for the settings both runs record and differ in, the same for the
    settings only one of them records (None on the other side: a run that predates them))."""
    ra, rb = _settings(a), _settings(b)
    both = {k: [ra[k], rb[k]] for k in sorted(ra.keys() & rb.keys()) if ra[k] != rb[k]}
    one = {k: [ra.get(k), rb.get(k)] for k in sorted(ra.keys() ^ rb.keys())
           if ra.get(k) is not None or rb.get(k) is not None}
    return both, one


def welch(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Difference of means and Welch's two-sided t-test (None where a side has one value)."""
    from scipy import stats

    out: dict[str, Any] = {"n": [len(a), len(b)], "mean_diff": float(np.mean(a) - np.mean(b)),
                           "p_welch": None}
    if len(a) > 1 and len(b) > 1 and (np.std(a) > 0 or np.std(b) > 0):
        out["p_welch"] = float(stats.ttest_ind(a, b, equal_var=False).pvalue)
    return out


def summarise(groups: Sequence[tuple[str, list[gs.Run]]], alpha: float = 0.05,
              min_seeds: int = 3) -> dict[str, Any]:
    """Everything of the output JSON but provenance (see the module doc); the first group is
    the candidate."""
    if len(groups) < 2:
        raise ValueError("need a candidate and at least one baseline")
    ref = groups[0][1][0]
    for label, runs in groups:
        for r in runs:
            if r.system != ref.system:
                raise ValueError(f"{label}: {r.path} is {gs.system_key(r.system)}, the candidate "
                                 f"{gs.system_key(ref.system)}")
            for s in gs.SETS:
                if s not in r.result["sets"]:
                    raise ValueError(f"{r.path}: test set {s} missing")
                if r.result["sets"][s].get("tokens") != ref.result["sets"][s].get("tokens"):
                    raise ValueError(f"{s}: {r.path} and {ref.path} are not the same data")
    values = {label: {m: [per_seed(r, m) for r in runs] for m in gs.TESTED}
              for label, runs in groups}
    seeds = {label: [r.seed for r in runs] for label, runs in groups}
    out_groups = {}
    for label, runs in groups:
        out_groups[label] = {
            "seeds": seeds[label], "files": [gs._shown(r.path) for r in runs],
            "devices": sorted({str(r.result.get("device")) for r in runs}),
            **{m: {q: gs.spread([v[q] for v in values[label][m]], seeds[label])
                   for q in QUANTITIES} for m in gs.TESTED}}
    candidate, c_runs = groups[0]
    comparisons, rule = [], []
    for label, runs in groups[1:]:
        common = sorted(set(seeds[candidate]) & set(seeds[label]))
        entry = {"baseline": label, "paired_seeds": common,
                 **dict(zip(("recipe_differences", "recorded_by_one_side"),
                            recipe_differences(c_runs[0], runs[0]))),
                 "paired": {}, "unpaired": {}}
        for m in gs.TESTED:
            ci = {s: i for i, s in enumerate(seeds[candidate])}
            bi = {s: i for i, s in enumerate(seeds[label])}
            entry["paired"][m], entry["unpaired"][m] = {}, {}
            for q in QUANTITIES:
                a = [values[candidate][m][ci[s]][q] for s in common]
                b = [values[label][m][bi[s]][q] for s in common]
                entry["paired"][m][q] = gs.paired(a, b, alpha, min_seeds, "candidate") \
                    if common else None
                entry["unpaired"][m][q] = welch([v[q] for v in values[candidate][m]],
                                                [v[q] for v in values[label][m]])
            dev = entry["unpaired"][m]["dev"]["mean_diff"]
            others = entry["unpaired"][m]["others"]["mean_diff"]
            rule.append({"baseline": label, "metric": m, "dev_diff": dev, "others_diff": others,
                         "met_on_means": dev > 0 and others > 0})
        # every paired test against this baseline (both metrics, every quantity): one family
        gs.adjust_family([x for per in entry["paired"].values() for x in per.values()
                          if x is not None], alpha, "candidate")
        comparisons.append(entry)
    return {"unit": "percent", "system": gs.system_key(ref.system), "candidate": candidate,
            "alpha": alpha, "min_seeds": min_seeds, "groups": out_groups,
            "comparisons": comparisons, "rule": rule,
            "notes": ["values in percent; std is the sample standard deviation (n - 1)",
                      "dev: the training's dev score of the selected epoch (selection set)",
                      "others: the mean of CoNLL14-1, CoNLL14-2 and JFLEG test, per seed",
                      f"paired verdicts: paired t-test at {alpha:g}, two-sided; verdict "
                      "uncorrected, verdict_holm after Holm's adjustment over every paired test "
                      "against the same baseline (both metrics, every quantity); "
                      "unpaired: Welch's t-test over all seeds of each group"]}


def _cell(x: dict) -> str:
    return f"{x['mean']:.2f} ± {x['std']:.2f}" if x["std"] is not None else f"{x['mean']:.2f}"


def markdown(summary: dict) -> str:
    parts = []
    for m in gs.TESTED:
        head = ["recipe", "seeds", *(QUANTITY_LABELS[q] for q in QUANTITIES)]
        lines = [f"{gs.METRIC_LABELS[m]}, mean ± sample std over seeds (%):", "",
                 "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for label, g in summary["groups"].items():
            lines.append(f"| {label} | {len(g['seeds'])} | "
                         + " | ".join(_cell(g[m][q]) for q in QUANTITIES) + " |")
        parts.append("\n".join(lines))
    head = ["baseline", "metric", "set", "paired seeds", "mean difference [95% CI]", "t-test p",
            "verdict", "Holm p", "verdict after Holm", "difference of means (Welch p)"]
    lines = [f"{summary['candidate']} minus each baseline (points):", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for c in summary["comparisons"]:
        for m in gs.TESTED:
            for q in QUANTITIES:
                x, u = c["paired"][m][q], c["unpaired"][m][q]
                if x is None:
                    paired_cells = ["0", "", "", "no common seed", "", ""]
                else:
                    ci = f" [{x['ci95'][0]:+.2f}, {x['ci95'][1]:+.2f}]" if x["ci95"] else ""
                    holm_p = gs._p(x["p_holm"]) if x["p_holm"] is not None else ""
                    paired_cells = [str(x["n"]), f"{x['mean_diff']:+.2f}{ci}",
                                    gs._p(x["p_ttest"]), x["verdict"], holm_p, x["verdict_holm"]]
                welch_p = f" ({gs._p(u['p_welch'])})" if u["p_welch"] is not None else ""
                lines.append(f"| {c['baseline']} | {m} | {QUANTITY_LABELS[q]} | "
                             + " | ".join(paired_cells) + f" | {u['mean_diff']:+.2f}{welch_p} |")
    parts.append("\n".join(lines))
    for c in summary["comparisons"]:
        if c["recipe_differences"]:
            diffs = "; ".join(f"{k}: {a!r} vs {b!r}" for k, (a, b) in c["recipe_differences"].items())
            parts.append(f"- settings of {summary['candidate']} vs {c['baseline']}: {diffs}")
        if c["recorded_by_one_side"]:
            diffs = "; ".join(f"{k}: {a!r} vs {b!r}" for k, (a, b) in c["recorded_by_one_side"].items())
            parts.append(f"- settings only one of {summary['candidate']} and {c['baseline']} "
                         f"records (None: not recorded): {diffs}")
    for r in summary["rule"]:
        parts.append(f"- re-ship rule against {r['baseline']} ({gs.METRIC_LABELS[r['metric']]}): "
                     f"dev {r['dev_diff']:+.2f}, other sets' mean {r['others_diff']:+.2f} -> "
                     + ("met on the means" if r["met_on_means"] else "not met"))
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="GED recipes compared over seeds.")
    p.add_argument("--candidate", required=True, help="LABEL=PATTERN[,PATTERN...]")
    p.add_argument("--baseline", action="append", required=True,
                   help="LABEL=PATTERN[,PATTERN...] (repeatable)")
    p.add_argument("--out", required=True, help="summary JSON")
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--min-seeds", type=int, default=3, help="fewer paired seeds: no verdict")
    args = p.parse_args(argv)
    loaded: list[tuple[str, list]] = []

    def compute() -> dict:
        groups = [parse_group(args.candidate), *map(parse_group, args.baseline)]
        labels = [label for label, _ in groups]
        if len(set(labels)) != len(labels):
            raise ValueError(f"labels must differ: {labels}")
        loaded.extend((label, load_group(label, paths)) for label, paths in groups)
        return summarise(loaded, args.alpha, args.min_seeds)

    summary = gs.summary_or_report("ged_recipe_stats", compute)
    if summary is None:
        return 2
    gs.write_summary(summary, args.out,
                     [gs.input_record(r, group=label) for label, runs in loaded for r in runs])
    print(markdown(summary))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
