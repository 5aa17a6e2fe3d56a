"""Where a fine-tuning cell of ``mhmla-train aes --finetune`` stands, from its checkpoint, as
a results file: a run that spans several sessions reports its dev QWK epoch by epoch before
it finishes (its test split stays unseen until then).

    python bench/aes_finetune_progress.py \\
        runs/aes-ft/mhmla-joint-reg-finetuned-words-frozen/fold0-p1_2_3_4_5_6_7_8 \\
        --run-command "mhmla-train aes --finetune --joint ..." \\
        --out bench/results/aes_finetune_cpu_bf16/joint_reg_words_frozen_fold0_progress.json

The file holds the cell's settings (its checkpoint's config), each finished epoch's loss,
seconds and dev QWK (per prompt and their mean, in %), the best epoch so far, where the run
stands (epochs done, steps done of the next), whether it has finished (``test.json``), the
command that trains it, and this snapshot's provenance (device, versions, commit, CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def progress(cell: Path) -> dict:
    """The record of ``cell``'s checkpoint (see the module docstring); ValueError when it
    has none or it cannot be read."""
    from mhmla_fast.checkpoint import checkpoint_meta

    meta = checkpoint_meta(cell)  # (an unreadable one: ValueError naming the folder)
    if meta is None:
        raise ValueError(f"{cell}: no readable fine-tuning checkpoint (no checkpoint.json)")
    try:
        log, config = meta["log"], meta["config"]
    except (KeyError, TypeError) as err:
        raise ValueError(f"{cell}: no readable fine-tuning checkpoint ({err!r})") from err
    epochs = [{"epoch": r["epoch"], "loss": r["loss"], "seconds": r["seconds"],
               "dev_mean_qwk": 100 * r["dev_mean_qwk"],
               "dev_qwk": {p: 100 * q for p, q in r["dev_qwk"].items()}} for r in log]
    best = max(epochs, key=lambda r: r["dev_mean_qwk"]) if epochs else None
    return {"cell": cell.name, "settings": {k: v for k, v in config.items() if k != "out"},
            "precision_applied": meta.get("precision_applied"),
            "epochs_done": meta["epoch"], "epochs": config.get("epochs"),
            "steps_done_of_next_epoch": meta.get("step_in_epoch", 0),
            "finished": _finished(cell, meta, config),
            "best_epoch": best and best["epoch"],
            "best_dev_mean_qwk": best and best["dev_mean_qwk"],
            "log": epochs}


def _finished(cell: Path, meta: dict, config: dict) -> bool:
    """Whether the cell is scored for the run its checkpoint is of: a ``test.json`` made for
    as many epochs as the checkpoint's config asks, all of them done (a cell extended to more
    epochs keeps its earlier ``test.json`` while it trains on)."""
    try:
        made = json.loads((cell / "test.json").read_text(encoding="utf-8"))["settings"]["epochs"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return made == config.get("epochs") and meta.get("epoch") == config.get("epochs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cell", type=Path, help="the cell's folder (holding checkpoint.json)")
    parser.add_argument("--run-command", required=True,
                        help="the command that trains the cell (recorded as given)")
    parser.add_argument("--out", type=Path, required=True, help="the results file to write")
    args = parser.parse_args(argv)
    from mhmla_fast.durable import atomic_write_text
    from mhmla_fast.provenance import cpu_info, provenance

    try:
        record = progress(args.cell)
    except ValueError as err:
        print(f"aes_finetune_progress: {err}", file=sys.stderr)
        return 2
    record.update(run_command=args.run_command, provenance={**provenance(), **cpu_info()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(record, indent=1))
    done = ", ".join(f"{r['epoch']}: {r['dev_mean_qwk']:.2f}" for r in record["log"])
    print(f"{args.out}: epochs {record['epochs_done']}/{record['epochs']} (dev mean QWK {done})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
