"""``mhmla-eval``: score a GED tagger on a data set, plot its layer weights; QWK of an essay
scorer on an ASAP fold (``aes``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .aes import add_eval_parser as add_aes_parser
from .aes import run_eval as run_aes
from .argtypes import non_negative_int, positive_int


def _check_outputs(*paths: str | None) -> None:
    """ValueError, before any evaluation, for an output path that is a folder."""
    for path in paths:
        if path and Path(path).is_dir():
            raise ValueError(f"{path}: is a folder; give a file name to write to")


def _read_sentences(path, annotator: int):
    """The labelled sentences of ``path``; ValueError when it holds none."""
    from ..ged.data import read_ged

    sentences = read_ged(path, annotator=annotator)
    if not sentences:
        raise ValueError(f"{path}: no sentences to evaluate on")
    return sentences


def _load(model_dir: str | None):
    from ..ged.model import GedTagger, load_tokenizer
    from ..ged.predict import default_model_path

    path = Path(model_dir) if model_dir else default_model_path()
    model = GedTagger.load(path)
    tokenizer = load_tokenizer(path)
    return path, model, tokenizer


def run_ged(args) -> int:
    import numpy as np

    from ..ged.metrics import ged_scores
    from ..ged.train import predict_word_probs

    try:
        _check_outputs(args.json)
        sentences = _read_sentences(args.data, args.annotator)
        path, model, tokenizer = _load(args.model)
    except (OSError, ValueError, ImportError) as err:  # (ImportError: JFLEG needs rapidfuzz)
        print(f"mhmla-eval: {err}", file=sys.stderr)
        return 2
    probs = predict_word_probs(model, tokenizer, [s.tokens for s in sentences],
                               batch_size=args.batch_size)
    flat = np.concatenate(probs)
    gold = np.concatenate([np.asarray(s.labels) for s in sentences])
    threshold = model.config.threshold
    result = {
        "model": str(path), "data": str(args.data), "annotator": args.annotator,
        "sentences": len(sentences), "tokens": int(gold.size),
        "argmax": ged_scores(gold, (flat >= 0.5).astype(int)).to_dict(),
        "threshold": threshold,
        "at_threshold": (ged_scores(gold, (flat >= threshold).astype(int)).to_dict()
                         if threshold is not None else None),
    }
    for name in ("argmax", "at_threshold"):
        s = result[name]
        if s is not None:
            label = "argmax" if name == "argmax" else f"threshold {threshold:.3f}"
            print(f"{label:>16}: P {100 * s['precision']:.2f}  R {100 * s['recall']:.2f}  "
                  f"F0.5 {100 * s['f05']:.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def run_layers(args) -> int:
    """The average layer weight per head on ``args.data``: JSON (``--json``) first, then the
    heatmap (``--png``, needs matplotlib), so a machine without matplotlib still gets the
    numbers."""
    from ..ged.predict import layer_weight_stats

    if not (args.png or args.json):
        print("mhmla-eval ged-layers: give --png, --json or both", file=sys.stderr)
        return 2
    try:
        _check_outputs(args.json, args.png)
        sentences = _read_sentences(args.data, args.annotator)
        path, model, tokenizer = _load(args.model)
        weights = layer_weight_stats(model, tokenizer, [s.tokens for s in sentences],
                                     batch_size=args.batch_size)
    except (OSError, ValueError, ImportError) as err:  # (ImportError: JFLEG needs rapidfuzz)
        print(f"mhmla-eval: {err}", file=sys.stderr)
        return 2
    L, J = weights.shape
    layers = [i for i in model.head.layers]
    result = {"model": str(path), "data": str(args.data), "layers": layers,
              "weights_per_head": weights.tolist(), "per_layer_mean": weights.mean(1).tolist()}
    print("per-layer average weight: " + ", ".join(
        f"l{i}={w:.3f}" for i, w in zip(layers, weights.mean(1))))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    if not args.png:
        return 0
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        wrote = f" (the weights are in {args.json})" if args.json else ""
        print(f"mhmla-eval: the heatmap needs matplotlib (pip install 'mhmla-fast[data]'){wrote}",
              file=sys.stderr)
        return 2
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(2 + 0.5 * J + 3, 1.5 + 0.45 * L),
                                  gridspec_kw={"width_ratios": [J, 3]})
    im = ax.imshow(weights, cmap="viridis", aspect="auto", vmin=0)
    ax.set_xticks(range(J), [str(j + 1) for j in range(J)])
    ax.set_yticks(range(L), [str(i) for i in layers])
    ax.set_xlabel("head j")
    ax.set_ylabel("layer l")
    ax.set_title("average layer weight per head")
    for l in range(L):
        for j in range(J):
            ax.text(j, l, f"{weights[l, j]:.2f}", ha="center", va="center", fontsize=6,
                    color="white" if weights[l, j] < weights.max() * 0.6 else "black")
    fig.colorbar(im, ax=ax, fraction=0.05)
    ax2.barh(range(L), weights.mean(1))
    ax2.set_yticks(range(L), [str(i) for i in layers])
    ax2.invert_yaxis()
    ax2.set_title("mean over heads")
    fig.suptitle(f"{path.name} on {Path(args.data).name}")
    fig.tight_layout()
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=120)
    return 0


GED_SUITE = {  # name -> (path under the shared data folder, M2 annotator)
    "fce_test": ("fce/fce-public.test.original.tsv", 0),
    "conll14_a1": ("conll2014/official-2014.0.m2", 0),
    "conll14_a2": ("conll2014/official-2014.1.m2", 0),
    "jfleg_test": ("jfleg/test", 0),
}


def run_suite(args) -> int:
    """The model on FCE test, CoNLL-2014 annotators 1 and 2 and JFLEG test -> one JSON.

    What would fail only after the other sets were evaluated (no data, JFLEG without
    rapidfuzz, an output path that is a folder) is checked first: exit 2, nothing evaluated."""
    import numpy as np

    from ..ged.data import require_rapidfuzz
    from ..ged.metrics import ged_scores
    from ..ged.train import predict_word_probs
    from ..paths import ENV_VAR, missing_data, shared_data_dir
    from ..provenance import provenance

    root = Path(args.data_dir) if args.data_dir else shared_data_dir()
    found = {name: root / rel for name, (rel, _) in GED_SUITE.items() if (root / rel).exists()}
    try:
        _check_outputs(args.out)
        if not found and not args.data_dir and not root.is_dir():
            raise missing_data(root, "--data-dir (the folder holding fce/, conll2014/ and jfleg/)")
        if not found:
            raise ValueError(f"{root}: none of the suite's data sets is there ("
                             f"{', '.join(rel for rel, _ in GED_SUITE.values())}); give the "
                             "shared data folder with --data-dir"
                             + ("" if args.data_dir else f", or set {ENV_VAR} to it"))
        if "jfleg_test" in found:
            require_rapidfuzz()
        path, model, tokenizer = _load(args.model)
    except (OSError, ValueError, ImportError) as err:
        print(f"mhmla-eval: {err}", file=sys.stderr)
        return 2
    config = model.config  # the results file keeps its keys: head, num_heads, encoder
    result = {**provenance(), "model": str(path), "head": config.layer_attention.mode,
              "num_heads": config.layer_attention.num_heads,
              "encoder": config.encoder_spec.name_or_path, "threshold": config.threshold,
              "training": config.training, "sets": {}}
    for name, (rel, annotator) in GED_SUITE.items():
        data = root / rel
        if name not in found:
            print(f"mhmla-eval: {data} not found: {name} skipped", file=sys.stderr)
            continue
        try:
            sentences = _read_sentences(data, annotator)
        except (OSError, ValueError) as err:
            print(f"mhmla-eval: {err}", file=sys.stderr)
            return 2
        probs = np.concatenate(predict_word_probs(model, tokenizer, [s.tokens for s in sentences],
                                                  batch_size=args.batch_size))
        gold = np.concatenate([np.asarray(s.labels) for s in sentences])
        entry = {"data": rel, "sentences": len(sentences), "tokens": int(gold.size),
                 "argmax": ged_scores(gold, (probs >= 0.5).astype(int)).to_dict()}
        if config.threshold is not None:
            entry["at_threshold"] = ged_scores(gold, (probs >= config.threshold).astype(int)).to_dict()
        result["sets"][name] = entry
        s = entry["argmax"]
        t = entry.get("at_threshold") or {}
        print(f"{name:>11}: argmax P {100 * s['precision']:.2f} R {100 * s['recall']:.2f} "
              f"F0.5 {100 * s['f05']:.2f}" + (f" | threshold F0.5 {100 * t['f05']:.2f}" if t else ""))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mhmla-eval", description=__doc__)
    sub = parser.add_subparsers(dest="task", required=True)
    for name, help_ in (("ged", "token-level P, R, F0.5 of the error class"),
                        ("ged-layers", "heatmap of the average layer weight per head (Fig. 2)")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--model", default=None, help="tagger directory (default: the shipped one)")
        p.add_argument("--data", required=True,
                       help="FCE .tsv, M2 (.m2) or JFLEG (.src file, split folder or prefix)")
        p.add_argument("--annotator", type=non_negative_int, default=0,
                       help="M2 annotator id (the CoNLL-14 per-annotator files both use 0)")
        p.add_argument("--batch-size", type=positive_int, default=64)
        p.add_argument("--json", default=None, help="also write the result as JSON here")
        if name == "ged-layers":
            p.add_argument("--png", default=None,
                           help="where to write the heatmap (needs matplotlib; --json alone "
                                "writes only the numbers)")
    p = sub.add_parser("ged-suite", help="FCE test, CoNLL-14 (both annotators), JFLEG test "
                       "-> one results JSON")
    p.add_argument("--model", default=None, help="tagger directory (default: the shipped one)")
    p.add_argument("--out", required=True, help="results JSON (e.g. bench/results/ged_<name>.json)")
    p.add_argument("--data-dir", default=None, help="the shared data folder (default "
                   "$MHMLA_SHARED_DATA, else ../shared/data beside a repository checkout)")
    p.add_argument("--batch-size", type=positive_int, default=64)
    add_aes_parser(sub)
    args = parser.parse_args(argv)
    return {"ged": run_ged, "ged-layers": run_layers, "ged-suite": run_suite,
            "aes": run_aes}[args.task](args)


if __name__ == "__main__":
    raise SystemExit(main())
