"""``mhmla-train``: train a GED tagger (``ged``) or run essay scoring on ASAP (``aes``)."""

from __future__ import annotations

import argparse
import sys

from ..distributed import rank_from_env
from ..paths import shared_data_file
from .aes import add_train_parser as add_aes_parser
from .aes import run_train as run_aes
from .argtypes import positive_int
from .config_flags import add_config_flags, config_from_args


def _fce(split: str) -> str:
    """Return the FCE ``split`` file of the shared data folder (the default of ``--train`` and
    ``--dev``); FileNotFoundError naming it and that flag when it is not there."""
    return str(shared_data_file(f"fce/fce-public.{split}.original.tsv", f"--{split}"))


def add_ged_parser(sub) -> None:
    """``mhmla-train ged``: one flag per field of :class:`~mhmla_fast.ged.train.TrainConfig`
    (its encoder spec and layer-attention config included), generated from the dataclass."""
    from ..ged.train import TrainConfig

    p = sub.add_parser("ged", help="train a grammatical error detection tagger",
                       description="Train a GED tagger (defaults: the paper's recipe on FCE).")
    add_config_flags(p, TrainConfig, optional=("train", "dev"))
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")


def run_ged(args) -> int:
    import torch

    from ..checkpoint import RunLockedError
    from ..encoder import resolve_encoder
    from ..ged.train import TrainConfig, train

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        cfg = config_from_args(TrainConfig, args, train=args.train or _fce("train"),
                               dev=args.dev or _fce("dev"))
        resolve_encoder(cfg.encoder_spec, strict=True)  # a path that is no folder: say so
        best = train(cfg)
    except (OSError, ValueError, RunLockedError) as err:
        print(f"mhmla-train: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return interrupted()
    if rank_from_env() == 0:  # under torchrun, rank 0 reports
        print(f"best model: {best}")
    return 0


EXIT_INTERRUPTED = 130


def interrupted() -> int:
    """Ctrl-C: one line (from the first rank under torchrun, whose other ranks get the same
    signal) and exit 130; the same command resumes from what was saved (the last checkpoint,
    the finished cells and units)."""
    if rank_from_env() == 0:
        print("mhmla-train: interrupted; run the same command to resume from what was saved",
              file=sys.stderr)
    return EXIT_INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mhmla-train", description=__doc__)
    sub = parser.add_subparsers(dest="task", required=True)
    add_ged_parser(sub)
    add_aes_parser(sub)
    args = parser.parse_args(argv)
    return {"ged": run_ged, "aes": run_aes}[args.task](args)


if __name__ == "__main__":
    raise SystemExit(main())
