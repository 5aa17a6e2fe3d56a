"""Per-layer average weights of MHMLA taggers side by side (e.g. MiniLM and MPNet) in one PNG.

    python bench/ged_layer_plot.py bench/results/ged_layers_minilm_mhmla12_seed0_fce_test.json \\
        bench/results/ged_layers_mpnet_mhmla12_seed0_fce_test.json --labels MiniLM MPNet \\
        --out bench/results/ged_layers_minilm_mpnet.png

Each input is the ``--json`` of ``mhmla-eval ged-layers``: ``layers`` (the L encoder layers
the head mixes), ``weights_per_head`` [L, J] (the softmax weight p of layer l in head j,
averaged over the tokens of a data set: each column sums to 1 over the layers) and
``per_layer_mean`` [L] (its mean over the J heads). One panel per input, on a shared weight
axis: every head's curve (thin), the mean over heads (thick) and the uniform weight 1/L
(dashed). The per-layer means are printed. Inputs of different L (6 for MiniLM, 12 for
MPNet) sit side by side, each on its own layer axis.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ged_seed_stats as gs  # noqa: E402 - the sibling script, by file name


def load_layers(path: str | Path) -> dict:
    """One ged-layers JSON -> {"layers": [L], "weights": array [L, J], "model", "data"};
    ValueError naming the file when the shapes or values do not fit."""
    path = Path(path)
    result = json.loads(path.read_text())
    if "layers" not in result or "weights_per_head" not in result:
        raise ValueError(f"{path}: not a result of mhmla-eval ged-layers "
                         "(no 'layers' or 'weights_per_head')")
    layers = list(result["layers"])
    rows = result["weights_per_head"]
    if not layers or len(rows) != len(layers):
        raise ValueError(f"{path}: weights_per_head has {len(rows)} rows for {len(layers)} layers")
    widths = {len(r) for r in rows}
    if len(widths) != 1 or 0 in widths:
        raise ValueError(f"{path}: weights_per_head rows have different or zero lengths {sorted(widths)}")
    weights = np.asarray(rows, dtype=float)
    if not np.all(np.isfinite(weights)) or np.any(weights < 0):
        raise ValueError(f"{path}: layer weights must be finite and non-negative")
    return {"layers": layers, "weights": weights, "model": result.get("model"),
            "data": result.get("data")}


def plot_layers(panels: Sequence[dict], labels: Sequence[str], png: str | Path) -> Path:
    """One panel per loaded input (see :func:`load_layers`), side by side, into ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels) + 0.5, 3.8),
                             sharey=True, squeeze=False)
    for ax, panel, label in zip(axes[0], panels, labels):
        layers, w = panel["layers"], panel["weights"]
        L, J = w.shape
        for j in range(J):
            ax.plot(layers, w[:, j], color="C0", alpha=0.3, lw=0.8,
                    label="each head" if j == 0 else None)
        ax.plot(layers, w.mean(1), color="black", lw=2.2, marker="o", label=f"mean over {J} heads")
        ax.axhline(1.0 / L, color="grey", ls="--", lw=1, label=f"uniform 1/{L}")
        ax.set_xticks(layers, [str(x) for x in layers])
        ax.set_xlabel("encoder layer l")
        ax.set_title(f"{label} (L = {L}, J = {J})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("average layer weight")
    data = {Path(str(p["data"])).name for p in panels if p.get("data")}
    if len(data) == 1:
        fig.suptitle(f"MHMLA layer weights, averaged over the tokens of {data.pop()}", fontsize=10)
    return gs.save_png(fig, png)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Per-layer average MHMLA weights, side by side.")
    p.add_argument("inputs", nargs="+", help="JSON files of mhmla-eval ged-layers --json")
    p.add_argument("--labels", nargs="+", default=None,
                   help="one panel title per input (default: the model directory's name)")
    p.add_argument("--out", required=True, help="PNG to write")
    args = p.parse_args(argv)
    try:
        if args.labels is not None and len(args.labels) != len(args.inputs):
            raise ValueError(f"{len(args.labels)} labels for {len(args.inputs)} inputs")
        panels = [load_layers(x) for x in args.inputs]
    except (OSError, ValueError) as err:
        print(f"ged_layer_plot: {err}", file=sys.stderr)
        return 2
    labels = args.labels or [Path(str(x["model"] or path)).name
                             for x, path in zip(panels, args.inputs)]
    for label, panel in zip(labels, panels):
        print(f"{label}: per-layer mean weight " + ", ".join(
            f"l{layer}={w:.3f}" for layer, w in zip(panel["layers"], panel["weights"].mean(1))))
    print(f"wrote {plot_layers(panels, labels, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
