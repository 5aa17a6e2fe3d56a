"""GED Table 2 (heads) and Table 3 (the J sweep) with statistics over seeds, from ged-suite files.

    python bench/ged_seed_stats.py                      # every bench/results/ged_*_seed*.json
    python bench/ged_seed_stats.py --inputs 'bench/results/ged_minilm_*_seed*.json' \\
        --out bench/results/ged_minilm_seed_stats.json --j-sweep-png bench/results/ged_minilm_j_sweep.png

Every input is the JSON of ``mhmla-eval ged-suite`` for one trained run, named
``ged_<encoder>_<head>[_J<j>]_seed<k>.json`` (``training/ged_table2.sh`` writes them; the
encoder tag has no underscore). A *system* is (encoder, head, J). For MHMLA, J is the file's
``num_heads`` (``_J<j>``, where present, must agree; Table 2's J = 12 files carry no ``_J``).
The baselines (last, avgl, shmla) have no J. A file whose name and content disagree (head,
J, seed), two files for one seed of a system, runs of one system whose recipes differ in more
than the seed, and files that do not hold the same test sets (or not the same sentences)
are all refused.

Per system, test set (fce_test, conll14_a1, conll14_a2, jfleg_test) and metric (F0.5, P, R at
argmax and at the dev-tuned threshold), in percent, over the S seeds::

    mean = (1/S) sum_s x_s,   std = sqrt(sum_s (x_s - mean)^2 / (S - 1))   (none for S = 1),   min, max

and the same for ``dev``: the training's dev scores of the selected epoch (the scores the
epoch and the threshold were chosen on, so optimistic; Table 3 reports them as the paper does).

MHMLA (J = ``--mhmla-j``, default 12) against each baseline of the same encoder, on the seeds
both have (different seed sets are an error unless ``--common-seeds``), per test set, for F0.5
at argmax and at the threshold, with ``d_s = MHMLA_s - baseline_s`` (points)::

    mean_d,  95% CI = mean_d -/+ t_{0.975, n-1} sd_d / sqrt(n)
    p_t     = scipy.stats.ttest_rel(MHMLA, baseline), two-sided, n - 1 degrees of freedom
    p_sign  = #{e in {-1, +1}^n : |sum_s e_s d_s| >= |sum_s d_s|} / 2^n     (exact sign flips)

The sign-flip test assumes only that each difference is symmetric about 0 under the null, so
it holds for any n; its smallest p is 2 / 2^n (0.25 at 3 seeds, 0.0625 at 5), so it cannot
reach 5% below 6 seeds. The verdict uses the t-test: ``too few seeds (need >= 3)`` for n < 3
(``one seed: no test`` where a lower minimum lets one seed through), else ``MHMLA higher,
p=...`` / ``MHMLA lower, p=...`` when p_t < 0.05, else ``no significant difference at 5%
(p=...)``. ``p_holm`` and ``verdict_holm``: the same after Holm's adjustment over each
family (per encoder and metric, every baseline and set; in the J sweep, every J against the
reference).
No best seed is ever reported: every seed's value is listed, and only their spread is summarised.

Written: ``--out`` (default ``bench/results/ged_seed_stats.json``): ``unit``, ``inputs``
(path, system, seed, commit, device, date and command of each), ``systems`` (per system:
``sets`` and ``dev`` {metric: {n, mean, std, min, max, per_seed}}), ``comparisons``,
``claim`` (per encoder, the paper's claim in words), ``j_sweep`` (per encoder with two or more
MHMLA J: J, seeds, dev and FCE test F0.5; J = 1 is SHMLA unless MHMLA J = 1 runs exist; each J
against J = ``--mhmla-j`` as above, paired on common seeds, on dev and FCE test F0.5 at argmax,
with Holm's adjustment over the J's of one encoder and score),
``notes``, ``provenance``; the J-sweep plot
(``--j-sweep-png``, when there is a sweep); every seed's Table 2 scores (``--table2-png``,
when asked for); and Markdown tables on stdout, beside the
paper's Table 2, ready for the README.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "bench" / "results"
DEFAULT_INPUTS = str(RESULTS / "ged_*_seed*.json")
DEFAULT_OUT = RESULTS / "ged_seed_stats.json"
DEFAULT_PNG = RESULTS / "ged_j_sweep.png"

NAME = re.compile(r"^ged_(?P<encoder>[A-Za-z0-9-]+)_(?P<head>last|avgl|shmla|mhmla)"
                  r"(?:_J(?P<j>\d+))?_seed(?P<seed>\d+)\.json$")
NAME_FORM = "ged_<encoder>_<head>[_J<j>]_seed<k>.json"
HEADS = ("last", "avgl", "shmla", "mhmla")
BASELINES = ("last", "avgl", "shmla")
HEAD_LABELS = {"last": "last layer", "avgl": "AvgL", "shmla": "SHMLA", "mhmla": "MHMLA"}
ENCODER_LABELS = {"minilm": "MiniLM", "mpnet": "MPNet"}
SETS = ("fce_test", "conll14_a1", "conll14_a2", "jfleg_test")
SET_LABELS = {"fce_test": "FCE", "conll14_a1": "CoNLL14-1", "conll14_a2": "CoNLL14-2",
              "jfleg_test": "JFLEG"}
METRICS = {  # name -> (block of a ged-suite set entry, score in it)
    "f05": ("argmax", "f05"), "precision": ("argmax", "precision"), "recall": ("argmax", "recall"),
    "f05_threshold": ("at_threshold", "f05"), "precision_threshold": ("at_threshold", "precision"),
    "recall_threshold": ("at_threshold", "recall"),
}
DEV_BLOCKS = {"argmax": "dev", "at_threshold": "dev_at_threshold"}  # in the model's "training"
TESTED = ("f05", "f05_threshold")
METRIC_LABELS = {"f05": "F0.5 at argmax", "f05_threshold": "F0.5 at the dev-tuned threshold"}
# training settings that may differ between seeds of one system (where and how, not what)
RECIPE_FREE = {"seed", "out", "progress", "backend", "checkpoint_every", "eval_batch_size"}
# and between MHMLA and a baseline it is compared with
# (flat keys of runs before the configs were grouped, and the grouped keys of runs after)
HEAD_FIELDS = {"head", "num_heads", "key_size",
               "layer_attention.mode", "layer_attention.num_heads", "layer_attention.key_size"}
PAPER_TABLE2 = (  # BERT-base, F0.5 at argmax: FCE, CoNLL14-1, CoNLL14-2, JFLEG (5 runs each)
    ("paper, BERT-base, last layer", (59.47, 33.97, 42.93, 63.45)),
    ("paper, BERT-base, AvgL", (60.20, 34.33, 42.88, 63.52)),
    ("paper, BERT-base, MHMLA J = 12", (61.65, 35.26, 43.74, 64.77)),
)
MAX_SIGN_FLIP_SEEDS = 20


# ---------------------------------------------------------------- inputs

@dataclass(frozen=True)
class Run:
    """One ged-suite result file and the system it belongs to."""

    path: str
    encoder: str
    head: str
    j: int | None
    seed: int
    result: dict

    @property
    def system(self) -> tuple[str, str, int | None]:
        return (self.encoder, self.head, self.j)


def system_key(system: tuple[str, str, int | None]) -> str:
    """("minilm", "mhmla", 12) -> "minilm/mhmla/J12"; ("minilm", "last", None) -> "minilm/last"."""
    encoder, head, j = system
    return f"{encoder}/{head}" + (f"/J{j}" if j is not None else "")


def system_label(system: tuple[str, str, int | None]) -> str:
    """("minilm", "mhmla", 12) -> "MHMLA J = 12 (MiniLM)"."""
    encoder, head, j = system
    name = HEAD_LABELS[head] + (f" J = {j}" if j is not None else "")
    return f"{name} ({ENCODER_LABELS.get(encoder, encoder)})"


def load_run(path: str | Path) -> Run:
    """Read one ged-suite file; ValueError when its name does not follow :data:`NAME_FORM` or
    disagrees with its content (head, J, seed)."""
    path = Path(path)
    m = NAME.match(path.name)
    if m is None:
        raise ValueError(f"{path}: the name does not follow {NAME_FORM}")
    result = json.loads(path.read_text())
    if not isinstance(result.get("sets"), dict) or "head" not in result:
        raise ValueError(f"{path}: not a result of mhmla-eval ged-suite (no 'sets' or 'head')")
    head, seed = m["head"], int(m["seed"])
    if result["head"] != head:
        raise ValueError(f"{path}: the name says head {head}, the file {result['head']}")
    j = None
    if head == "mhmla":
        j = int(result["num_heads"])
        if m["j"] is not None and int(m["j"]) != j:
            raise ValueError(f"{path}: the name says J = {m['j']}, the file {j}")
    elif m["j"] is not None:
        raise ValueError(f"{path}: _J<j> names MHMLA runs only (head {head})")
    config = (result.get("training") or {}).get("config") or {}
    if "seed" in config and int(config["seed"]) != seed:
        raise ValueError(f"{path}: the name says seed {seed}, the training seed {config['seed']}")
    return Run(str(path), m["encoder"], head, j, seed, result)


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """Paths and glob patterns -> sorted unique paths. A pattern keeps only the files named
    like :data:`NAME_FORM` (``ged_*_seed*.json`` also matches ``ged_minilm_seed_stats.json``);
    ValueError for a pattern that keeps nothing. A path given as such is kept (and checked by
    :func:`load_run`)."""
    paths: list[str] = []
    for p in patterns:
        if glob.has_magic(p):
            found = [x for x in sorted(glob.glob(p)) if NAME.match(Path(x).name)]
        else:
            found = [p]
        if not found:
            raise ValueError(f"no file named {NAME_FORM} matches {p}")
        paths += [x for x in found if x not in paths]
    return paths


def _recipe(run: Run, ignore: set[str]) -> dict:
    config = (run.result.get("training") or {}).get("config") or {}
    flat = {}
    for k, v in config.items():  # grouped settings ("layer_attention": {...}) compared per field
        if isinstance(v, dict) and k in ("layer_attention", "encoder_spec"):
            flat.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        else:
            flat[k] = v
    out = {k: v for k, v in flat.items() if k not in ignore}
    for k in ("train", "dev"):  # the data folder differs between machines; the file must not
        if isinstance(out.get(k), str):
            out[k] = Path(out[k]).name
    return out


def _recipe_diff(a: Run, b: Run, ignore: set[str]) -> dict:
    """Settings both runs record and disagree on (a field one of them predates is not compared)."""
    ra, rb = _recipe(a, ignore), _recipe(b, ignore)
    return {k: (ra[k], rb[k]) for k in ra.keys() & rb.keys() if ra[k] != rb[k]}


def group_runs(runs: Sequence[Run]) -> dict[tuple, list[Run]]:
    """Runs by system, sorted by seed; ValueError for inconsistent inputs (see the module doc)."""
    if not runs:
        raise ValueError("no inputs")
    ref = runs[0]
    for r in runs:
        missing = [s for s in ref.result["sets"] if s not in r.result["sets"]]
        extra = [s for s in r.result["sets"] if s not in ref.result["sets"]]
        if missing or extra:
            name = (missing or extra)[0]
            has, lacks = (ref, r) if missing else (r, ref)
            raise ValueError(f"test set {name} is in {has.path} but missing in {lacks.path}")
        for s, entry in r.result["sets"].items():
            if entry.get("tokens") != ref.result["sets"][s].get("tokens"):
                raise ValueError(f"{s}: {r.path} has {entry.get('tokens')} tokens, "
                                 f"{ref.path} {ref.result['sets'][s].get('tokens')}: not the same data")
    systems: dict[tuple, list[Run]] = {}
    for r in runs:
        systems.setdefault(r.system, []).append(r)
    for system, members in systems.items():
        members.sort(key=lambda r: r.seed)
        for a, b in zip(members, members[1:]):
            if a.seed == b.seed:
                raise ValueError(f"{system_key(system)}: seed {a.seed} twice ({a.path}, {b.path})")
        first = members[0]
        for r in members[1:]:
            if r.result.get("encoder") != first.result.get("encoder"):
                raise ValueError(f"{system_key(system)}: encoder {first.result.get('encoder')} in "
                                 f"{first.path}, {r.result.get('encoder')} in {r.path}")
            diff = _recipe_diff(first, r, RECIPE_FREE)
            if diff:
                raise ValueError(f"{system_key(system)}: {first.path} and {r.path} differ in more "
                                 f"than the seed: {diff}")
    return dict(sorted(systems.items(), key=lambda kv: _order(kv[0])))


def _order(system: tuple) -> tuple:
    encoder, head, j = system
    return (encoder, HEADS.index(head), j or 0)


# ---------------------------------------------------------------- statistics

def spread(values: Sequence[float], seeds: Sequence[int]) -> dict[str, Any]:
    """n, mean, sample std (None for one value), min, max and every seed's value."""
    x = np.asarray(values, dtype=float)
    return {"n": int(x.size), "mean": float(x.mean()),
            "std": float(x.std(ddof=1)) if x.size > 1 else None,
            "min": float(x.min()), "max": float(x.max()),
            "per_seed": {str(s): float(v) for s, v in zip(seeds, x)}}


def _metric_values(members: Sequence[Run], where, label: str) -> dict[str, list[float]]:
    """{metric: per-seed values in percent} of the metrics every member has at ``where``;
    ValueError when only some members have a block."""
    out: dict[str, list[float]] = {}
    for metric, (block, score) in METRICS.items():
        entries = [where(r).get(block) for r in members]
        have = [e is not None for e in entries]
        if not any(have):
            continue
        if not all(have):
            lacking = next(r.path for r, h in zip(members, have) if not h)
            raise ValueError(f"{label}: {block} missing in {lacking} (present in other seeds)")
        out[metric] = [100.0 * float(e[score]) for e in entries]
    return out


def system_stats(members: Sequence[Run]) -> dict[str, Any]:
    """Per test set and metric (and ``dev``) the spread over the system's seeds."""
    seeds = [r.seed for r in members]
    sets = {}
    for s in members[0].result["sets"]:
        values = _metric_values(members, lambda r, s=s: r.result["sets"][s], s)
        sets[s] = {m: spread(v, seeds) for m, v in values.items()}
    dev = None
    trainings = [r.result.get("training") or {} for r in members]
    if all(t.get("dev") for t in trainings):
        values = _metric_values(members, lambda r: {
            b: (r.result["training"].get(k)) for b, k in DEV_BLOCKS.items()}, "dev")
        dev = {m: spread(v, seeds) for m, v in values.items()}
    return {"encoder": members[0].encoder, "encoder_name": members[0].result.get("encoder"),
            "head": members[0].head, "J": members[0].j, "label": system_label(members[0].system),
            "seeds": seeds, "files": [_shown(r.path) for r in members], "sets": sets, "dev": dev}


def sign_flip_p(d: Sequence[float]) -> float:
    """Exact two-sided sign-flip permutation p-value of the mean of ``d``:
    ``#{e in {-1,+1}^n : |sum e d| >= |sum d|} / 2^n``."""
    d = np.asarray(d, dtype=float)
    n = d.size
    if n == 0:
        raise ValueError("no differences")
    if n > MAX_SIGN_FLIP_SEEDS:
        raise ValueError(f"the exact sign-flip test enumerates 2^n flips: "
                         f"n = {n} > {MAX_SIGN_FLIP_SEEDS}")
    flips = 1 - 2 * ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1)  # [2^n, n] of +-1
    sums = np.abs(flips @ d)
    observed = abs(d.sum())
    return float(np.mean(sums >= observed - 1e-9 * max(1.0, observed)))


def verdict(n: int, mean_diff: float, p: float | None, alpha: float = 0.05,
            min_seeds: int = 3, name: str = "MHMLA") -> str:
    """The comparison in words (see the module doc); ``name``: the system compared."""
    if n < min_seeds:
        return f"too few seeds (need >= {min_seeds})"
    if n < 2:
        return "one seed: no test"
    if p is None:
        return f"no significant difference at {100 * alpha:g}% (identical scores)"
    if p < alpha:
        return f"{name} {'higher' if mean_diff > 0 else 'lower'}, p={p:.2g}"
    return f"no significant difference at {100 * alpha:g}% (p={p:.2g})"


def paired(mhmla: Sequence[float], baseline: Sequence[float], alpha: float = 0.05,
           min_seeds: int = 3, name: str = "MHMLA") -> dict[str, Any]:
    """Paired comparison of per-seed scores (same seed order): mean difference, its 95% t-interval,
    the paired t-test and the exact sign-flip test, and the verdict. Tests need n >= 2; with all
    differences equal the t statistic is undefined (identical scores: p None; a constant nonzero
    shift: p 0)."""
    from scipy import stats

    a, b = np.asarray(mhmla, dtype=float), np.asarray(baseline, dtype=float)
    d = a - b
    n = int(d.size)
    out: dict[str, Any] = {"n": n, "differences": d.tolist(), "mean_diff": float(d.mean()),
                           "ci95": None, "t": None, "p_ttest": None, "p_signflip": None,
                           "p_signflip_floor": 2.0 / 2 ** n if n else None}
    if n >= 2:
        sd = float(d.std(ddof=1))
        out["p_signflip"] = sign_flip_p(d)
        if sd <= 1e-12 * max(1.0, abs(out["mean_diff"])):
            half = 0.0
            if abs(out["mean_diff"]) > 1e-12:
                out["t"], out["p_ttest"] = math.copysign(math.inf, out["mean_diff"]), 0.0
        else:
            res = stats.ttest_rel(a, b)
            out["t"], out["p_ttest"] = float(res.statistic), float(res.pvalue)
            half = float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
        out["ci95"] = [out["mean_diff"] - half, out["mean_diff"] + half]
    out["verdict"] = verdict(n, out["mean_diff"], out["p_ttest"], alpha, min_seeds, name)
    return out


def holm(p_values: Sequence[float | None]) -> list[float | None]:
    """Holm-Bonferroni adjusted p-values of one family of tests (None stays None and is not
    counted): the k-th smallest of m p-values becomes max over i <= k of min(1, (m - i + 1) p_(i)),
    so that "adjusted p < alpha" controls the chance of any false finding in the family."""
    order = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    m, out, running = len(order), [None] * len(p_values), 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


def _adjust_families(comparisons: list[dict], alpha: float) -> None:
    """Per encoder and metric, every (baseline, set) test of MHMLA is one family: each paired
    result gains ``p_holm`` and ``verdict_holm`` (the verdict at ``alpha`` after the adjustment)."""
    families: dict[tuple, list[dict]] = {}
    for c in comparisons:
        for entry in c["sets"].values():
            for metric, x in entry.items():
                families.setdefault((c["encoder"], metric), []).append(x)
    for members in families.values():
        adjust_family(members, alpha)


def adjust_family(members: list[dict], alpha: float, name: str = "MHMLA") -> None:
    """Holm's adjustment over one family of :func:`paired` results: each gains ``p_holm``,
    ``family_size`` and ``verdict_holm`` (the verdict at ``alpha`` after the adjustment, of
    system ``name``). A comparison with too few seeds (or one seed) is no test: not in the
    family, and it keeps its verdict; one whose differences are all zero counts with p = 1
    (:func:`family_tests`)."""
    tests = family_tests(members)
    for x in members:
        x["p_holm"], x["family_size"], x["verdict_holm"] = None, len(tests), x["verdict"]
    for (x, _), p in zip(tests, holm([p for _, p in tests])):
        x["p_holm"], x["verdict_holm"] = p, verdict(x["n"], x["mean_diff"], p, alpha, 0, name)


def family_tests(members: Sequence[dict]) -> list[tuple[dict, float]]:
    """The members of a family that are tests, each with the p-value Holm's adjustment takes:
    its t-test's; 1 for one whose differences are all zero (t is undefined; left out, it made
    the family smaller and every other adjusted p smaller with it)."""
    tests = []
    for x in members:
        if x["verdict"].startswith("too few") or x["n"] < 2:
            continue
        if x["p_ttest"] is not None:
            tests.append((x, x["p_ttest"]))
        elif all(d == 0 for d in x.get("differences") or ()):
            tests.append((x, 1.0))
    return tests


def compare(systems: dict[tuple, list[Run]], stats: dict[str, Any], mhmla_j: int,
            common_seeds: bool, alpha: float, min_seeds: int) -> list[dict]:
    """MHMLA J = ``mhmla_j`` against every baseline of its encoder, per test set and tested metric."""
    out = []
    for (encoder, head, j), members in systems.items():
        if head != "mhmla" or j != mhmla_j:
            continue
        for base in BASELINES:
            other = systems.get((encoder, base, None))
            if other is None:
                continue
            mine = {r.seed: r for r in members}
            theirs = {r.seed: r for r in other}
            if mine.keys() != theirs.keys() and not common_seeds:
                raise ValueError(
                    f"{system_key((encoder, head, j))} and {system_key((encoder, base, None))} have "
                    f"unmatched seeds (only MHMLA: {sorted(mine.keys() - theirs.keys())}, only "
                    f"{base}: {sorted(theirs.keys() - mine.keys())}); run the missing seeds or "
                    "pass --common-seeds")
            seeds = sorted(mine.keys() & theirs.keys())
            if seeds:
                diff = _recipe_diff(mine[seeds[0]], theirs[seeds[0]], RECIPE_FREE | HEAD_FIELDS)
                if diff:
                    raise ValueError(f"{mine[seeds[0]].path} and {theirs[seeds[0]].path} were not "
                                     f"trained identically apart from the head: {diff}")
            a_key, b_key = system_key((encoder, head, j)), system_key((encoder, base, None))
            entry = {"encoder": encoder, "mhmla": a_key, "baseline": b_key, "seeds": seeds,
                     "dropped_seeds": sorted(mine.keys() ^ theirs.keys()), "sets": {}}
            for s in stats[a_key]["sets"]:
                entry["sets"][s] = {}
                for metric in TESTED:
                    if metric not in stats[a_key]["sets"][s] or metric not in stats[b_key]["sets"][s]:
                        continue
                    x = [stats[a_key]["sets"][s][metric]["per_seed"][str(k)] for k in seeds]
                    y = [stats[b_key]["sets"][s][metric]["per_seed"][str(k)] for k in seeds]
                    entry["sets"][s][metric] = paired(x, y, alpha, min_seeds)
            out.append(entry)
    _adjust_families(out, alpha)
    return out


def _tally(verdicts: Sequence[str]) -> str:
    """"higher on 1, lower on 0, no significant difference on 3 of 4 sets"."""
    def count(prefix: str) -> int:
        return sum(v.startswith(prefix) for v in verdicts)

    text = (f"higher on {count('MHMLA higher')}, lower on {count('MHMLA lower')}, no significant "
            f"difference on {count('no significant')} of {len(verdicts)} sets")
    return text + (" (too few seeds to test)" if count("too few") else "")


def claim(comparisons: Sequence[dict], metric: str = "f05") -> dict[str, str]:
    """Per encoder, the paper's claim (MHMLA above the last layer and AvgL) in plain words,
    then the tally of verdicts against each baseline (after Holm's adjustment)."""
    out = {}
    for encoder in dict.fromkeys(c["encoder"] for c in comparisons):
        lines, verdicts = [], []
        for c in comparisons:
            if c["encoder"] != encoder:
                continue
            # judged after Holm's adjustment over the family (the plain verdict without one)
            v = [x[metric].get("verdict_holm", x[metric]["verdict"]) for x in c["sets"].values()
                 if metric in x]
            base = c["baseline"].split("/")[1]
            if base in ("last", "avgl"):
                verdicts += v
            n = len(c["seeds"])
            lines.append(f"against {HEAD_LABELS[base]} ({METRIC_LABELS[metric]}, {n} paired "
                         f"seed{'s' if n != 1 else ''}): {_tally(v)}")
        if not verdicts:
            held = "untested: no last-layer or AvgL runs"
        elif any(x.startswith("too few") for x in verdicts):
            held = "untested: too few seeds"
        elif all(x.startswith("MHMLA higher") for x in verdicts):
            held = "holds: MHMLA is significantly above the last layer and AvgL on every set"
        elif any(x.startswith("MHMLA lower") for x in verdicts):
            held = "does not hold: MHMLA is significantly below a baseline on some set"
        else:
            held = "not confirmed: MHMLA is not significantly above both baselines on every set"
        name = ENCODER_LABELS.get(encoder, encoder)
        out[encoder] = f"{name}: the paper's claim {held}. " + "; ".join(lines) + "."
    return out


SWEEP_TESTED = {"dev_f05": ("dev", "f05"), "fce_test_f05": ("fce_test", "f05")}


def j_sweep(stats: dict[str, Any], systems: dict[tuple, list[Run]] | None = None,
            mhmla_j: int = 12, alpha: float = 0.05, min_seeds: int = 3,
            common_seeds: bool = False) -> dict[str, list[dict]]:
    """Per encoder with MHMLA at two or more J: one row per J (ascending) with its head, seeds
    and the dev and FCE-test F0.5 spreads (argmax and threshold; None where absent). Without
    MHMLA J = 1 runs, J = 1 is the SHMLA system (the same model: one head over the layers).

    With ``systems`` (:func:`group_runs`), each row but J = ``mhmla_j``'s also has ``vs_j``: per
    :data:`SWEEP_TESTED` score, the paired comparison (:func:`paired`, d_s = J's score - J =
    ``mhmla_j``'s, on the seeds both have, the others in ``dropped_seeds``) and, over the
    encoder's rows, Holm's adjustment (``p_holm``, ``verdict_holm``). As for Table 2, runs
    trained otherwise than in the head are refused, and so are unmatched seeds unless
    ``common_seeds``."""
    by_encoder: dict[str, list[dict]] = {}
    shmla: dict[str, dict] = {}
    for s in stats.values():
        if s["head"] == "mhmla":
            by_encoder.setdefault(s["encoder"], []).append(s)
        elif s["head"] == "shmla":
            shmla[s["encoder"]] = s
    out = {}
    for encoder, members in by_encoder.items():
        if len(members) < 2:
            continue
        if encoder in shmla and all(s["J"] != 1 for s in members):
            members = [{**shmla[encoder], "J": 1}, *members]
        ref = next((s for s in members if s["J"] == mhmla_j and s["head"] == "mhmla"), None)
        rows = []
        for s in sorted(members, key=lambda x: x["J"]):
            test = s["sets"].get("fce_test", {})
            dev = s["dev"] or {}
            row = {"J": s["J"], "head": s["head"], "seeds": s["seeds"],
                   **{f"dev_{m}": _brief(dev.get(m)) for m in TESTED},
                   **{f"fce_test_{m}": _brief(test.get(m)) for m in TESTED}}
            if ref is not None and s is not ref and systems is not None:
                row["vs_j"] = {"J": mhmla_j, **_versus(s, ref, systems, alpha, min_seeds,
                                                       common_seeds)}
            rows.append(row)
        for key in SWEEP_TESTED:  # one family per encoder and score: every J against the reference
            judged = [(r["J"], r["vs_j"][key]) for r in rows if key in r.get("vs_j", {})]
            j_of = {id(x): j for j, x in judged}
            tests = family_tests([x for _, x in judged])
            for _, x in judged:
                x["p_holm"], x["family_size"], x["verdict_holm"] = None, len(tests), x["verdict"]
            for (x, _), p in zip(tests, holm([p for _, p in tests])):
                x["p_holm"] = p
                x["verdict_holm"] = verdict(x["n"], x["mean_diff"], p, alpha, 0,
                                            f"J = {j_of[id(x)]}")
        out[encoder] = rows
    return out


def _versus(s: dict, ref: dict, systems: dict[tuple, list[Run]], alpha: float, min_seeds: int,
            common_seeds: bool) -> dict[str, Any]:
    """System ``s`` against ``ref`` on each :data:`SWEEP_TESTED` score, paired on common seeds
    (none in common: no comparison)."""
    def runs_of(x: dict) -> dict[int, Run]:
        j = x["J"] if x["head"] == "mhmla" else None
        return {r.seed: r for r in systems[(x["encoder"], x["head"], j)]}

    mine_runs, ref_runs = runs_of(s), runs_of(ref)
    if mine_runs.keys() != ref_runs.keys() and not common_seeds:
        raise ValueError(f"J sweep: J = {s['J']} and J = {ref['J']} of {s['encoder']} have "
                         f"unmatched seeds ({sorted(mine_runs)} and {sorted(ref_runs)}); run the "
                         "missing seeds or pass --common-seeds")
    common = sorted(mine_runs.keys() & ref_runs.keys())
    if not common:
        return {"seeds": [], "dropped_seeds": sorted(mine_runs.keys() | ref_runs.keys())}
    diff = _recipe_diff(mine_runs[common[0]], ref_runs[common[0]], RECIPE_FREE | HEAD_FIELDS)
    if diff:
        raise ValueError(f"J sweep: {mine_runs[common[0]].path} and {ref_runs[common[0]].path} "
                         f"were not trained identically apart from the head: {diff}")
    out: dict[str, Any] = {"seeds": common,
                           "dropped_seeds": sorted(mine_runs.keys() ^ ref_runs.keys())}
    for key, (block, metric) in SWEEP_TESTED.items():
        mine = ((s["dev"] if block == "dev" else s["sets"].get(block)) or {}).get(metric)
        theirs = ((ref["dev"] if block == "dev" else ref["sets"].get(block)) or {}).get(metric)
        if mine is None or theirs is None:
            continue
        out[key] = paired([mine["per_seed"][str(k)] for k in common],
                          [theirs["per_seed"][str(k)] for k in common], alpha, min_seeds,
                          name=f"J = {s['J']}")
    return out


def _brief(x: dict | None) -> dict | None:
    return None if x is None else {k: x[k] for k in ("n", "mean", "std", "min", "max")}


def summarise(runs: Sequence[Run], *, mhmla_j: int = 12, common_seeds: bool = False,
              alpha: float = 0.05, min_seeds: int = 3) -> dict[str, Any]:
    """Everything of the output JSON but inputs and provenance (see the module doc)."""
    systems = group_runs(runs)
    stats = {system_key(k): system_stats(v) for k, v in systems.items()}
    comparisons = compare(systems, stats, mhmla_j, common_seeds, alpha, min_seeds)
    notes = [
        "values in percent; std is the sample standard deviation (n - 1); per_seed lists every "
        "seed: no seed is singled out",
        "dev: the training's dev scores of the selected epoch (selection set, optimistic)",
        f"verdicts: paired t-test at {alpha:g}, two-sided, uncorrected for multiple comparisons; "
        "p_holm / verdict_holm: Holm-Bonferroni over the family of every baseline x set of one "
        "encoder and metric (family_size tests); the exact sign-flip test cannot go below 2 / 2^n "
        "(0.0625 at 5 seeds)",
    ]
    devices = sorted({str(r.result.get("device")) for r in runs})
    if len(devices) > 1:
        notes.append(f"the inputs come from different devices: {devices} (each run's precision "
                     "is in its training config)")
    return {"unit": "percent", "mhmla_j": mhmla_j, "alpha": alpha, "min_seeds": min_seeds,
            "systems": stats, "comparisons": comparisons, "claim": claim(comparisons),
            "j_sweep": j_sweep(stats, systems, mhmla_j, alpha, min_seeds, common_seeds),
            "notes": notes}


# ---------------------------------------------------------------- Markdown and plot

def _cell(x: dict | None) -> str:
    if x is None:
        return ""
    return f"{x['mean']:.2f} ± {x['std']:.2f}" if x["std"] is not None else f"{x['mean']:.2f}"


def _p(p: float | None) -> str:
    return "" if p is None else f"{p:.3g}"


def markdown_table2(summary: dict, metric: str = "f05", paper: bool = True) -> str:
    sets = [s for s in SETS if any(s in x["sets"] for x in summary["systems"].values())]
    head = ["system", "seeds", *(SET_LABELS.get(s, s) for s in sets)]
    lines = [f"{METRIC_LABELS[metric]}, mean ± sample std over seeds (%):", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for s in summary["systems"].values():
        if not any(metric in s["sets"].get(x, {}) for x in sets):
            continue
        lines.append(f"| {s['label']} | {len(s['seeds'])} | "
                     + " | ".join(_cell(s["sets"].get(x, {}).get(metric)) for x in sets) + " |")
    if paper and metric == "f05" and sets == list(SETS):
        for label, values in PAPER_TABLE2:
            lines.append(f"| {label} | 5 | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    return "\n".join(lines)


def markdown_comparisons(summary: dict, metric: str = "f05") -> str:
    head = ["MHMLA against", "set", "seeds", "mean difference [95% CI]", "t-test p", "sign-flip p",
            "verdict", "Holm p", "verdict after Holm"]
    lines = [f"MHMLA J = {summary['mhmla_j']} minus each baseline, paired over seeds "
             f"({METRIC_LABELS[metric]}, points):", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for c in summary["comparisons"]:
        base = summary["systems"][c["baseline"]]["label"]
        for s, entry in c["sets"].items():
            x = entry.get(metric)
            if x is None:
                continue
            ci = f" [{x['ci95'][0]:+.2f}, {x['ci95'][1]:+.2f}]" if x["ci95"] else ""
            lines.append(f"| {base} | {SET_LABELS.get(s, s)} | {x['n']} | {x['mean_diff']:+.2f}{ci} | "
                         f"{_p(x['p_ttest'])} | {_p(x['p_signflip'])} | {x['verdict']} | "
                         f"{_p(x.get('p_holm'))} | {x.get('verdict_holm', '')} |")
    return "\n".join(lines)


def markdown_j_sweep(summary: dict) -> str:
    out = []
    for encoder, rows in summary["j_sweep"].items():
        ref = next((r["vs_j"]["J"] for r in rows if "vs_j" in r), None)
        head = ["J", "seeds", "dev F0.5", "FCE test F0.5", "FCE test F0.5, threshold"]
        if ref is not None:
            head += [f"dev: J - J{ref} (p, Holm p)", f"FCE test: J - J{ref} (p, Holm p)"]
        lines = [f"J sweep, MHMLA on {ENCODER_LABELS.get(encoder, encoder)} (mean ± sample std, %"
                 + (f"; paired differences against J = {ref} in points" if ref else "") + "):",
                 "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for r in rows:
            j = f"{r['J']} (SHMLA)" if r["head"] == "shmla" else str(r["J"])
            cells = [j, str(len(r["seeds"])), _cell(r["dev_f05"]), _cell(r["fce_test_f05"]),
                     _cell(r["fce_test_f05_threshold"])]
            if ref is not None:
                cells += [_versus_cell(r.get("vs_j", {}).get(k)) for k in SWEEP_TESTED]
            lines.append("| " + " | ".join(cells) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def _versus_cell(x: dict | None) -> str:
    if x is None:
        return ""
    if x["verdict"].startswith("too few"):  # a p of 2 seeds is shown nowhere: untested
        return f"{x['mean_diff']:+.2f} ({x['n']} seed{'s' if x['n'] != 1 else ''}: untested)"
    if x["p_ttest"] is None:
        return f"{x['mean_diff']:+.2f} ({x['verdict']})"
    return f"{x['mean_diff']:+.2f} ({_p(x['p_ttest'])}, {_p(x.get('p_holm'))})"


def markdown(summary: dict) -> str:
    parts = [markdown_table2(summary, "f05"), markdown_table2(summary, "f05_threshold", paper=False)]
    for metric in TESTED:
        if any(metric in e for c in summary["comparisons"] for e in c["sets"].values()):
            parts.append(markdown_comparisons(summary, metric))
    if summary["j_sweep"]:
        parts.append(markdown_j_sweep(summary))
    parts += [f"- {line}" for line in summary["claim"].values()]
    return "\n\n".join(parts)


def save_png(fig, png: str | Path) -> Path:
    """Lay out ``fig``, write it to ``png`` (120 dpi, folders made) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def plot_j_sweep(sweep: dict[str, list[dict]], png: str | Path) -> Path:
    """F0.5 against J (log axis, error bars: sample std over seeds), dev and FCE test, one panel
    per encoder."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweep), figsize=(5.5 * len(sweep), 4), squeeze=False)
    for ax, (encoder, rows) in zip(axes[0], sweep.items()):
        js = [r["J"] for r in rows]
        for key, label, style in (("dev_f05", "FCE dev (selection)", "s--"),
                                  ("fce_test_f05", "FCE test", "o-"),
                                  ("fce_test_f05_threshold", "FCE test, dev-tuned threshold", "^:")):
            pts = [(r["J"], r[key]) for r in rows if r[key] is not None]
            if not pts:
                continue
            ax.errorbar([j for j, _ in pts], [x["mean"] for _, x in pts],
                        yerr=[x["std"] or 0.0 for _, x in pts], fmt=style, capsize=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(js, [str(j) for j in js])
        ax.minorticks_off()
        ax.set_xlabel("J (MHMLA heads)")
        ax.set_ylabel("F0.5 (%)")
        n = sorted({len(r["seeds"]) for r in rows})
        ax.set_title(f"{ENCODER_LABELS.get(encoder, encoder)}: mean ± std over "
                     f"{'/'.join(map(str, n))} seeds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_png(fig, png)


def table2_systems(summary: dict) -> dict[str, list[dict]]:
    """{encoder: its Table 2 systems in head order}: the baselines and MHMLA at J = ``mhmla_j``
    (the J sweep's other J left out)."""
    out: dict[str, list[dict]] = {}
    for s in summary["systems"].values():
        if s["head"] != "mhmla" or s["J"] == summary["mhmla_j"]:
            out.setdefault(s["encoder"], []).append(s)
    return out


def plot_table2(summary: dict, png: str | Path, metric: str = "f05") -> Path:
    """Every seed's test F0.5 per Table 2 system (dots; a thin line joins one seed across the
    heads, so the pairing of the tests shows), the mean over seeds (a bar) and, where the
    paper has the head, its BERT-base value (a cross): one row of panels per encoder, one
    panel per test set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = table2_systems(summary)
    paper = dict(zip(("last", "avgl", "mhmla"), (v for _, v in PAPER_TABLE2)))
    fig, axes = plt.subplots(len(rows), len(SETS), figsize=(3.4 * len(SETS), 3.2 * len(rows)),
                             squeeze=False)
    for ax_row, (encoder, systems) in zip(axes, rows.items()):
        names = [HEAD_LABELS[s["head"]] + (f" J={s['J']}" if s["J"] else "") for s in systems]
        seeds = sorted({k for s in systems for k in s["sets"]["fce_test"][metric]["per_seed"]})
        for col, (ax, test_set) in enumerate(zip(ax_row, SETS)):
            per_seed = [s["sets"][test_set][metric]["per_seed"] for s in systems]
            for k, seed in enumerate(seeds):
                pts = [(i, v[str(seed)]) for i, v in enumerate(per_seed) if str(seed) in v]
                ax.plot([i for i, _ in pts], [y for _, y in pts], "o-", lw=0.6, ms=4, alpha=0.8,
                        color=f"C{k % 10}", label=f"seed {seed}")
            crossed = False
            for i, s in enumerate(systems):
                ax.hlines(s["sets"][test_set][metric]["mean"], i - 0.25, i + 0.25, color="k", lw=2,
                          label="mean" if i == 0 else None)
                if metric == "f05" and s["head"] in paper and s["J"] in (None, 12):  # paper: J 12
                    ax.plot(i + 0.3, paper[s["head"]][col], "x", color="0.4", ms=7,
                            label=None if crossed else "paper, BERT-base")
                    crossed = True
            ax.set_xticks(range(len(systems)), names, fontsize=8)
            ax.set_xlim(-0.5, len(systems) - 0.3)
            ax.set_title(f"{ENCODER_LABELS.get(encoder, encoder)}, {SET_LABELS[test_set]}",
                         fontsize=9)
            ax.grid(axis="y", alpha=0.3)
            if col == 0:
                ax.set_ylabel(f"{METRIC_LABELS[metric]} (%)", fontsize=8)
        ax_row[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    return save_png(fig, png)


# ---------------------------------------------------------------- CLI

def _shown(path: str) -> str:
    """A path relative to the repository when it lies inside it (results files name no home)."""
    p = Path(path).resolve()
    return str(p.relative_to(REPO_ROOT)) if p.is_relative_to(REPO_ROOT) else path


def summary_or_report(prog: str, compute: Callable[[], dict]) -> dict | None:
    """``compute()``, or None after printing ``prog: reason`` when an input is missing, unreadable
    or malformed (OSError, ValueError, a missing field), so that a CLI exits 2 with one line."""
    try:
        return compute()
    except (OSError, ValueError) as err:
        print(f"{prog}: {err}", file=sys.stderr)
    except KeyError as err:
        print(f"{prog}: a field is missing in an input: {err}", file=sys.stderr)
    return None


def write_summary(summary: dict, out: str | Path, inputs: list[dict]) -> None:
    """Add ``inputs`` (one record per file) and the provenance to ``summary``; write it as JSON."""
    from mhmla_fast.provenance import provenance

    summary["inputs"] = inputs
    summary["provenance"] = provenance()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(summary, indent=1) + "\n")


def input_record(r: Run, **fields) -> dict:
    """One run's entry in ``inputs``: its path, ``fields``, seed and where it was made."""
    return {"path": _shown(r.path), **fields, "seed": r.seed,
            **{k: r.result.get(k) for k in ("commit", "device", "date", "command")}}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="GED Table 2 / Table 3 statistics over seeds.")
    p.add_argument("--inputs", nargs="+", default=[DEFAULT_INPUTS],
                   help=f"ged-suite files or glob patterns named {NAME_FORM} "
                        "(default bench/results/ged_*_seed*.json)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="summary JSON")
    p.add_argument("--j-sweep-png", default=str(DEFAULT_PNG),
                   help="plot of F0.5 against J (written when some encoder has two or more J)")
    p.add_argument("--table2-png", default=None,
                   help="plot of every seed's test F0.5 per Table 2 system (off by default)")
    p.add_argument("--mhmla-j", type=int, default=12, help="the MHMLA J compared with the baselines")
    p.add_argument("--common-seeds", action="store_true",
                   help="pair on the seeds both systems have (default: unmatched seeds are an error)")
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--min-seeds", type=int, default=3, help="fewer paired seeds: no verdict")
    args = p.parse_args(argv)
    runs: list[Run] = []

    def compute() -> dict:
        runs.extend(load_run(x) for x in expand_inputs(args.inputs))
        return summarise(runs, mhmla_j=args.mhmla_j, common_seeds=args.common_seeds,
                         alpha=args.alpha, min_seeds=args.min_seeds)

    summary = summary_or_report("ged_seed_stats", compute)
    if summary is None:
        return 2
    if summary["j_sweep"] and args.j_sweep_png:
        summary["j_sweep_png"] = str(plot_j_sweep(summary["j_sweep"], args.j_sweep_png))
    if args.table2_png:
        summary["table2_png"] = str(plot_table2(summary, args.table2_png))
    write_summary(summary, args.out, [input_record(r, system=system_key(r.system)) for r in runs])
    print(markdown(summary))
    pngs = [summary[k] for k in ("j_sweep_png", "table2_png") if k in summary]
    print(f"\nwrote {args.out}" + "".join(f" and {x}" for x in pngs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
