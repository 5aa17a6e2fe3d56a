"""What carries the essay-scoring stack: its members' weights per prompt, as a heatmap.

    python bench/aes_stack_weights_plot.py \\
        bench/results/aes_ensemble_minilm_mpnet_stack_tfidf.json \\
        --out bench/results/aes_stack_weights.png

The input is a file of ``bench/aes_ensemble.py`` (one fold, or ``--fold all``) whose cells have
the ``stack-blend`` row. For member ``m`` and prompt ``p`` the cell drawn is

    W[m, p] = mean over the folds k of w_{k,p}(m)

where ``w_{k,p}`` are the stack's weights in fold ``k``, prompt ``p`` (non-negative, summing to
1; a member missing from a cell's weights got 0 there), so each column sums to 1. The rows are
the members with a weight in some cell, in the order of their mean weight over the prompts;
the right-most column is that mean.
A file without a ``stack-blend`` row in some cell is refused, naming the fold and prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ged_seed_stats import save_png  # noqa: E402 - the sibling script's figure writer


def stack_weights_table(result: dict) -> tuple[list[str], list[int], np.ndarray]:
    """``(members, prompts, W)`` of the module doc: W [members, prompts], members by decreasing
    mean weight over the prompts; raises ValueError naming a cell without a stack."""
    folds = result["folds"] if "folds" in result else {str(result["fold"]): result}
    prompts = sorted({int(p) for f in folds.values() for p in f["cells"]})
    members: list[str] = []
    for k, f in folds.items():
        for p, cell in f["cells"].items():
            if "stack-blend" not in cell:
                raise ValueError(f"fold {k} prompt {p}: no stack-blend row (its members keep no "
                                 "continuous predictions)")
            members += [m for m in cell["stack-blend"]["weights"] if m not in members]
    W = np.zeros((len(members), len(prompts)))
    for j, p in enumerate(prompts):
        cells = [f["cells"][str(p)] for f in folds.values() if str(p) in f["cells"]]
        for i, m in enumerate(members):
            W[i, j] = np.mean([c["stack-blend"]["weights"].get(m, 0.0) for c in cells])
    order = np.argsort(-W.mean(axis=1), kind="stable")
    return [members[i] for i in order], prompts, W[order]


def plot_stack_weights(members: Sequence[str], prompts: Sequence[int], W: np.ndarray,
                       png: str | Path, title: str) -> Path:
    """Draw ``W`` (members x prompts, and their mean) as an annotated heatmap to ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = np.hstack([W, W.mean(axis=1, keepdims=True)])
    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * table.shape[1], 0.9 + 0.42 * len(members)))
    image = ax.imshow(table, cmap="Blues", vmin=0.0, aspect="auto")
    for i in range(table.shape[0]):
        for j in range(table.shape[1]):
            ax.text(j, i, f"{table[i, j]:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if table[i, j] > 0.6 * table.max() else "black")
    ax.set_xticks(range(table.shape[1]), [str(p) for p in prompts] + ["mean"])
    ax.set_yticks(range(len(members)), list(members), fontsize=8)
    ax.set_xlabel("prompt")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.04, label="weight (mean over folds)")
    return save_png(fig, png)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Plot the AES stack's member weights per prompt.")
    p.add_argument("ensemble", help="a results file of bench/aes_ensemble.py with stack rows")
    p.add_argument("--out", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    try:
        result = json.loads(Path(args.ensemble).read_text())
        members, prompts, W = stack_weights_table(result)
        n_folds = len(result["folds"]) if "folds" in result else 1
        png = plot_stack_weights(members, prompts, W, args.out,
                                 f"stack weights by prompt, mean over {n_folds} fold"
                                 f"{'s' * (n_folds > 1)} ({Path(args.ensemble).name})")
    except (OSError, ValueError, KeyError) as err:
        print(f"aes_stack_weights_plot: {err}", file=sys.stderr)
        return 2
    for m, row in zip(members, W):
        print(f"{m:45s} " + " ".join(f"{v:.2f}" for v in row) + f"  mean {row.mean():.3f}")
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
