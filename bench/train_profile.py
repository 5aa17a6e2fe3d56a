"""``mhmla-train ged`` under cProfile from epoch ``--from-epoch`` on: where a warm training step's
host time goes, with ``torch.compile``'s tracing, compiling and CUDA-graph capture (all in the
first epoch) left out.

Profiling the whole process (``python -m cProfile -m mhmla_fast.commands.train ...``) measured
mostly Dynamo and Inductor: on an H100 the first epoch of 8,192 sentences took 55.5 s with its
compile and capture, the second 1.8 s (``results/gpu_2026-11-27/run2_train_ro.json``). Here the
profiler starts when the training loop opens the progress bar of epoch ``--from-epoch`` (its
``desc`` is ``"epoch E/N"``; the bar exists with ``--no-progress`` too, disabled) and runs to
the end (that epoch's steps, then its dev evaluation and saves). The top functions by own and
by cumulative time go to ``--stats`` also when the run is cut short (Ctrl-C, or ``timeout -s
INT``)::

    python bench/train_profile.py --from-epoch 2 --stats OUT/train_profile.txt -- \\
        --out /tmp/run --epochs 2 --max-train-sentences 8192 ...   # mhmla-train ged's flags
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from-epoch", type=int, default=2,
                   help="the first profiled epoch (1-based; default 2: after the compiles)")
    p.add_argument("--stats", type=Path, required=True,
                   help="where the profile's top functions go (text)")
    p.add_argument("--top", type=int, default=50, help="functions listed per sort order")
    p.add_argument("train_args", nargs=argparse.REMAINDER,
                   help="after --: the flags of mhmla-train ged")
    args = p.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if args.from_epoch < 1:
        p.error("--from-epoch must be 1 or more")
    if not train_args:
        p.error("give mhmla-train ged's flags after --")
    return args, train_args


def stats_text(prof: cProfile.Profile, top: int, note: str) -> str:
    """The profile's ``top`` functions by own time, then by cumulative time, under ``note``."""
    buf = io.StringIO()
    buf.write(note + "\n")
    stats = pstats.Stats(prof, stream=buf)
    for sort in ("tottime", "cumulative"):
        stats.sort_stats(sort).print_stats(top)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    args, train_args = parse_args(argv)
    import mhmla_fast.progress as progress
    from mhmla_fast.commands.train import main as mhmla_train

    prof = cProfile.Profile()
    started = []
    open_bar = progress.progress_bar
    mark = f"epoch {args.from_epoch}/"

    def progress_bar(*a, **kw):  # the training loop's bars: the profiler starts at the mark
        if not started and str(kw.get("desc", "")).startswith(mark):
            started.append(True)
            prof.enable()
        return open_bar(*a, **kw)

    progress.progress_bar = progress_bar  # (_train imports it from the module when it runs)
    try:
        rc = mhmla_train(["ged", *train_args])
    except KeyboardInterrupt:
        rc = 130
    finally:
        prof.disable()
        progress.progress_bar = open_bar
    if started:
        note = (f"mhmla-train ged {' '.join(train_args)}: profiled from epoch "
                f"{args.from_epoch} (exit {rc})")
        text = stats_text(prof, args.top, note)
    else:
        text = f"epoch {args.from_epoch} never started (exit {rc}): nothing profiled\n"
    args.stats.parent.mkdir(parents=True, exist_ok=True)
    args.stats.write_text(text)
    print(text[:2500])
    return rc if started else (rc or 1)


if __name__ == "__main__":
    sys.exit(main())
