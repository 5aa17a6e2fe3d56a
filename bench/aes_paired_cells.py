"""Paired comparison of two AES protocol models over their (fold, prompt) cells.

    python bench/aes_paired_cells.py bench/results/aes_cpu-frozen-encoder-ged-cuts.json \\
        --pair ridge-layers-both-surface-cuts:ridge-layers-both-surface \\
        --pair ridge-layers-both-surface-ged:ridge-layers-both-surface

    # two encoders' runs, and dev-chosen ensembles of bench/aes_ensemble.py --fold all
    python bench/aes_paired_cells.py minilm=bench/results/aes_cpu-frozen-encoder-ged-cuts.json \\
        mpnet=bench/results/aes_cpu-frozen-mpnet-bf16.json \\
        --pair mpnet/ridge-layers-both-surface-cuts:minilm/ridge-layers-both-surface-cuts

    # seeds averaged per cell first: LABEL=FILE+FILE+... (runs that differ only in the seed)
    python bench/aes_paired_cells.py \\
        seeds=bench/results/aes_cpu-frozen-mpnet-bf16.json+...-seed1.json+...-seed2.json \\
        --pair seeds/mhmla-reg:seeds/avgl-reg

For each ``A:B`` pair of models in one results file of ``mhmla-train aes`` (the same essays in
every cell: one run, or runs over the same folds), or in several (``LABEL=FILE``, models named
``LABEL/model``; the files must hold the same folds and prompts; a file of
``bench/aes_ensemble.py --fold all`` gives its rows, e.g. ``LABEL/greedy-frozen``), with
``d_c = QWK_A(c) - QWK_B(c)`` over the ``n`` cells ``c`` = (fold, prompt) both hold::

    mean_diff = mean_c d_c            (QWK points x 100 in the table; fractions in the JSON)
    wins, losses, ties = #{d_c > 0}, #{d_c < 0}, #{d_c = 0}
    p_wilcoxon = scipy.stats.wilcoxon(d).pvalue   (two-sided signed-rank test, zeros dropped)
    p_holm     = Holm's step-down adjustment over the pairs of the call

With ``LABEL=F1+F2+...+FS`` a model's QWK in a cell is its mean over the S files,
``QWK(c) = (1/S) sum_s QWK_s(c)``, for the models and cells every file holds (the files: runs
of one protocol that differ only in the seed, so the test sees the seeds' average, not one
seed's draw; a model whose settings differ in more than the seed is refused).

The cells are not independent draws (a prompt's five folds share essays' neighbours), so the
test is a guide, not a guarantee; the per-prompt means say where a difference comes from.

JSON (``--out``, default ``bench/results/aes_paired_cells.json``): ``input``, ``pairs`` (per
pair: ``n``, ``mean_diff``, ``wins``, ``losses``, ``ties``, ``p_wilcoxon``, ``p_holm``,
``per_prompt_diff``), ``provenance``. A table is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aes_seed_summary import without_seed  # noqa: E402 - what counts as one model's seeds
from ged_seed_stats import holm  # noqa: E402 - the sibling script's Holm adjustment

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "aes_paired_cells.json"


def _ensemble_file(result: dict) -> bool:
    """A file of ``bench/aes_ensemble.py --fold all`` (its folds hold cells of rows)."""
    return isinstance(result.get("folds"), dict)


def _names(result: dict) -> list[str]:
    """Every model and ensemble of a results file, or every row and member of an ensemble file."""
    if not _ensemble_file(result):
        return [*result["models"], *result.get("ensembles", {})]
    return sorted({n for f in result["folds"].values() for c in f["cells"].values()
                   for n in [*c["members"], *(k for k in c if k not in ("members", "unit_files"))]})


def cells(result: dict, model: str) -> dict[tuple[str, str], float]:
    """{(fold, prompt): test QWK} of ``model`` (a model or an ensemble of the results, or a row
    or member of a ``bench/aes_ensemble.py`` file of several folds)."""
    if _ensemble_file(result):
        out = {}
        for k, fold in result["folds"].items():
            for p, cell in fold["cells"].items():
                row = cell.get(model) or cell["members"].get(model)
                if row is not None:
                    out[(k, p)] = row["test_qwk"]
        if not out:
            raise ValueError(f"no row or member {model!r} in the ensemble results")
        return out
    entry = result["models"].get(model) or result.get("ensembles", {}).get(model)
    if entry is None:
        known = sorted([*result["models"], *result.get("ensembles", {})])
        raise ValueError(f"no model {model!r} in the results; known: {known}")
    return {(k, p): q for k, per in entry["qwk"].items() for p, q in per.items() if q is not None}


def compare(result: dict, a: str, b: str) -> dict:
    """One pair ``a`` against ``b`` (see the module doc), without the Holm adjustment."""
    from scipy import stats

    ca, cb = cells(result, a), cells(result, b)
    common = sorted(set(ca) & set(cb))
    if not common:
        raise ValueError(f"{a} and {b} share no (fold, prompt) cell")
    d = [ca[c] - cb[c] for c in common]
    nonzero = [x for x in d if x != 0]
    p = float(stats.wilcoxon(nonzero).pvalue) if nonzero else 1.0
    prompts = sorted({p for _, p in common}, key=int)
    per_prompt = {p: sum(x for c, x in zip(common, d) if c[1] == p)
                  / sum(1 for c in common if c[1] == p) for p in prompts}
    return {"a": a, "b": b, "n": len(d), "mean_diff": sum(d) / len(d),
            "wins": sum(x > 0 for x in d), "losses": sum(x < 0 for x in d),
            "ties": sum(x == 0 for x in d), "p_wilcoxon": p, "per_prompt_diff": per_prompt}


def _shape(result: dict) -> tuple[list[str], list[str]]:
    """(folds, prompts) of a results file or of an aes_ensemble.py file."""
    if _ensemble_file(result):
        return (sorted(result["folds"], key=int),
                sorted({p for f in result["folds"].values() for p in f["cells"]}, key=int))
    return [str(k) for k in result["folds"]], [str(p) for p in result["prompts"]]


def _seed_mean(paths: Sequence[str]) -> tuple[dict[str, dict], tuple[list[str], list[str]]]:
    """{name: {(fold, prompt): QWK averaged over ``paths``}} for the names and cells every file
    holds, and the files' (folds, prompts), which must agree."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    shape = _shape(results[0])
    for path, r in zip(paths[1:], results[1:]):
        if _shape(r) != shape:
            raise ValueError(f"{path}: folds and prompts {_shape(r)}, not those of {paths[0]}")
    others = [set(_names(r)) for r in results[1:]]
    names = [n for n in _names(results[0]) if all(n in o for o in others)]
    out = {}
    for n in names:
        settings = [without_seed(r["models"][n]["settings"]) for r in results
                    if "settings" in r.get("models", {}).get(n, {})]
        if any(x != settings[0] for x in settings[1:]):
            raise ValueError(f"{n}: settings differ in more than the seed across {list(paths)}")
        per_file = [cells(r, n) for r in results]
        common = set(per_file[0]).intersection(*per_file[1:])
        out[n] = {c: sum(f[c] for f in per_file) / len(per_file) for c in sorted(common)}
    return out, shape


def read_results(paths: Sequence[str]) -> dict:
    """One results file as it is; several (``LABEL=FILE``, or ``LABEL=FILE+FILE+...`` for the
    per-cell mean over seeds) as one file whose models (and ensembles, and aes_ensemble.py
    rows) are named ``LABEL/name``."""
    if len(paths) == 1 and "=" not in paths[0]:
        return json.loads(Path(paths[0]).read_text())
    merged: dict = {"models": {}}
    shape = None
    for spec in paths:
        label, sep, path = spec.partition("=")
        files = path.split("+")
        if not sep or not label or not all(files):
            raise ValueError(f"results: expected LABEL=FILE or LABEL=FILE+FILE+... with several "
                             f"files, got {spec!r}")
        if len(set(files)) != len(files):
            raise ValueError(f"{spec!r}: a file given twice")
        by_name, this = _seed_mean(files)
        if shape is not None and shape != this:
            raise ValueError(f"{path}: folds {this[0]} and prompts {this[1]}, not those of the "
                             f"first file {shape}")
        shape = this
        for n, per_cell in by_name.items():
            qwk: dict = {}
            for (k, p), q in per_cell.items():
                qwk.setdefault(k, {})[p] = q
            merged["models"][f"{label}/{n}"] = {"qwk": qwk}
    return merged


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+",
                    help="a results file of mhmla-train aes, or several as LABEL=FILE "
                         "(LABEL=FILE+FILE+...: each cell averaged over the files' seeds)")
    ap.add_argument("--pair", action="append", required=True, metavar="A:B",
                    help="model A against model B (repeatable)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    try:
        result = read_results(args.results)
        pairs = []
        for spec in args.pair:
            a, sep, b = spec.partition(":")
            if not sep or not a or not b:
                raise ValueError(f"--pair: expected A:B, got {spec!r}")
            pairs.append(compare(result, a, b))
    except (OSError, ValueError, KeyError) as err:
        print(f"aes_paired_cells: {err}", file=sys.stderr)
        return 2
    for pair, p in zip(pairs, holm([x["p_wilcoxon"] for x in pairs])):
        pair["p_holm"] = p
    sys.path.insert(0, str(REPO_ROOT))
    from mhmla_fast.provenance import provenance

    out = {"input": args.results, "pairs": pairs, "provenance": provenance()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for x in pairs:
        print(f"{x['a']} - {x['b']}: {100 * x['mean_diff']:+.2f} QWK points over {x['n']} cells "
              f"({x['wins']} won, {x['losses']} lost, {x['ties']} tied), Wilcoxon p "
              f"{x['p_wilcoxon']:.2g}, Holm {x['p_holm']:.2g}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
