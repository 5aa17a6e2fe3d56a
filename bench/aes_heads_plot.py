"""The frozen-encoder essay-scoring heads over seeds, per encoder: a picture of issue 13's
head comparison (the paper's claim, MHMLA against the last layer and AvgL, for AES).

    python bench/aes_heads_plot.py MiniLM=bench/results/aes_cpu-frozen-encoder-seeds.json \\
        MPNet=bench/results/aes_cpu-frozen-mpnet-bf16-seeds.json \\
        --out bench/results/aes_heads_minilm_mpnet_seeds.png

Each input is a summary written by ``bench/aes_seed_summary.py``. Two panels, classification
and regression; in each, for the heads last layer, AvgL and MHMLA (the models ``last-cls``,
``avgl-cls``, ``mhmla-cls`` and their ``-reg`` twins), one bar per encoder at

    mean over seeds s of (mean over the 8 prompts of (mean over the 5 folds of test QWK))

with an error bar of the sample standard deviation over seeds, and a dot per seed (a thin line
joins one seed's three heads, as the paired tests pair them). A model missing from an input is
an error that names it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ged_seed_stats import save_png  # noqa: E402 - the sibling script's figure writer

HEADS = (("last", "last layer"), ("avgl", "AvgL"), ("mhmla", "MHMLA"))
OBJECTIVES = (("cls", "classification"), ("reg", "regression"))


def head_values(summaries: Mapping[str, dict]) -> dict[str, dict[str, dict]]:
    """{encoder: {model: {"mean", "std", "per_seed"}}} in QWK %, for the six head models;
    raises KeyError naming the first model an input lacks."""
    out: dict[str, dict[str, dict]] = {}
    for encoder, summary in summaries.items():
        out[encoder] = {}
        for obj, _ in OBJECTIVES:
            for head, _ in HEADS:
                name = f"{head}-{obj}"
                if name not in summary["models"]:
                    raise KeyError(f"{encoder}: no model {name!r} in its seed summary")
                m = summary["models"][name]
                out[encoder][name] = {"mean": 100 * m["mean"], "std": 100 * m["std"],
                                      "per_seed": {s: 100 * v for s, v in m["per_seed"].items()}}
    return out


def plot_heads(values: Mapping[str, dict[str, dict]], png: str | Path) -> Path:
    """Draw ``values`` (of :func:`head_values`; the module doc) to ``png``; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    encoders = list(values)
    width = 0.8 / len(encoders)
    fig, axes = plt.subplots(1, len(OBJECTIVES), figsize=(5.5 * len(OBJECTIVES), 4), sharey=True)
    for ax, (obj, title) in zip(axes, OBJECTIVES):
        for e, encoder in enumerate(encoders):
            xs = [h + (e - (len(encoders) - 1) / 2) * width for h in range(len(HEADS))]
            rows = [values[encoder][f"{head}-{obj}"] for head, _ in HEADS]
            seeds = sorted({s for r in rows for s in r["per_seed"]}, key=int)
            bars = ax.bar(xs, [r["mean"] for r in rows], width * 0.9, yerr=[r["std"] for r in rows],
                          capsize=3, alpha=0.55,
                          label=f"{encoder} ({len(seeds)} seed{'s' * (len(seeds) > 1)})")
            colour = bars.patches[0].get_facecolor()
            for s in seeds:
                ys = [r["per_seed"].get(s) for r in rows]
                ax.plot(xs, ys, "o-", color=colour, alpha=0.9, markersize=3, linewidth=0.6)
        ax.set_xticks(range(len(HEADS)), [label for _, label in HEADS])
        ax.set_title(f"frozen encoder, {title} head")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("mean test QWK % (5 folds x 8 prompts)")
    lows = [r["mean"] - r["std"] for v in values.values() for r in v.values()]
    axes[0].set_ylim(max(0.0, 5 * (min(lows) // 5) - 5), None)
    axes[0].legend(loc="upper left", fontsize=8)
    return save_png(fig, png)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Plot the frozen AES heads over seeds, per encoder.")
    p.add_argument("inputs", nargs="+", metavar="NAME=SEEDS_JSON",
                   help="an encoder's name and its bench/aes_seed_summary.py summary")
    p.add_argument("--out", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    summaries: dict[str, dict] = {}
    try:
        for item in args.inputs:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"{item!r}: expected NAME=SEEDS_JSON")
            if name in summaries:
                raise ValueError(f"{name!r} given twice")
            summaries[name] = json.loads(Path(path).read_text())
        values = head_values(summaries)
        png = plot_heads(values, args.out)
    except (OSError, ValueError, KeyError) as err:
        print(f"aes_heads_plot: {err}", file=sys.stderr)
        return 2
    for encoder, models in values.items():
        print(encoder + ": " + ", ".join(f"{m} {v['mean']:.2f} ± {v['std']:.2f}"
                                         for m, v in models.items()))
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
