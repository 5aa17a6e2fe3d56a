"""Ship a fine-tuned joint essay scorer in the package, if fold-0 dev says it beats the shipped one.

    python training/ship_aes_scorer.py \\
        runs/aes-ft/mhmla-joint-reg-finetuned-words-frozen/fold0-p1_2_3_4_5_6_7_8

The cell is one of ``mhmla-train aes --finetune --joint`` (finished: its ``test.json`` is
written), trained on fold 0 for every prompt the shipped scorer scores. The rule (issue 13):

    mean_p dev_QWK_p(candidate, fold 0) > mean_p dev_QWK_p(shipped, fold 0)

with the shipped scorer's dev QWKs read from its ``config.json`` training record (those of its
cut scores where it has cutpoints: ``training["cutpoints"]["dev_qwk_cut"]``, how it scores;
``mhmla-train aes --fit-cutpoints`` fits them for a frozen-encoder scorer only, whose
out-of-fold heads train on cached features). Only then is
the candidate written to ``--out`` (default: the shipped scorer's folder, replaced as a whole):
fp16 weights, the embedded MiniLM's word embeddings read from its package where they were
frozen (else a row delta, as for the GED tagger), at most 30 MB. The written model is read back and
scores fold 0's dev split again; its mean dev QWK must still beat the shipped one's (fp16 may
move it), else the old scorer is put back. The cell's test QWKs go into the training record,
as the final check: they play no part in the decision. Nothing is written with ``--dry-run``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

MAX_MB = 30
EMBEDDINGS = "encoder.embeddings.word_embeddings.weight"


def dev_qwks(scorer, splits: dict, prompts) -> dict[str, float]:
    """Dev QWK per prompt of ``scorer`` on ``splits`` (prompt -> train/dev/test essays)."""
    from mhmla_fast.aes.train import qwk

    out = {}
    for p in prompts:
        dev = splits[p]["dev"]
        pred = scorer.predict_scores([e.text for e in dev], p)
        out[str(p)] = float(qwk(np.array([e.score for e in dev]), np.asarray(pred), p))
    return out


def main(argv=None) -> int:
    from mhmla_fast.aes.data import read_asap, read_folds, split_essays
    from mhmla_fast.aes.model import EssayScorer
    from mhmla_fast.aes.scoring import default_model_path
    from mhmla_fast.aes.train import asap_files
    from mhmla_fast.durable import atomic_write_text
    from mhmla_fast.encoder import EMBEDDED_ENCODER

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cell", help="a finished joint fine-tuning cell (OUT/<model>/fold0-p1_2_...)")
    parser.add_argument("--out", default=str(default_model_path()))
    parser.add_argument("--shipped", default=str(default_model_path()),
                        help="the scorer to beat (default: the one in the package)")
    parser.add_argument("--data-dir", default=None,
                        help="the shared data folder or its asap_aes folder (default: "
                        "$MHMLA_SHARED_DATA or ../shared/data)")
    parser.add_argument("--dry-run", action="store_true", help="decide and report, write nothing")
    args = parser.parse_args(argv)

    cell, shipped_dir = Path(args.cell), Path(args.shipped)
    done = cell / "test.json"
    if not done.is_file():
        raise SystemExit(f"{cell}: not a finished cell (no test.json); finish its run first")
    record = json.loads(done.read_text(encoding="utf-8"))
    if "prompts" not in record:
        raise SystemExit(f"{cell}: a one-prompt cell; the shipped scorer scores every prompt, so "
                         "only a --joint cell can replace it")
    shipped = json.loads((shipped_dir / "config.json").read_text(encoding="utf-8"))
    shipped_dev = (shipped["training"]["cutpoints"]["dev_qwk_cut"]  # how it scores
                   if shipped.get("cutpoints") else shipped["training"]["dev_qwk"])
    fold = record["settings"]["fold"]
    prompts = sorted(int(p) for p in record["prompts"])
    if fold != shipped["training"]["fold"] or prompts != sorted(int(p) for p in shipped_dev):
        raise SystemExit(f"{cell}: fold {fold}, prompts {prompts}; the shipped scorer was chosen "
                         f"on fold {shipped['training']['fold']} for prompts "
                         f"{sorted(int(p) for p in shipped_dev)}")
    old = float(np.mean(list(shipped_dev.values())))
    new = float(record["dev_qwk"])
    print(f"fold {fold} dev mean QWK: candidate {100 * new:.2f}, shipped {100 * old:.2f}")
    if not new > old:
        print("not shipped: the candidate does not beat the shipped scorer on dev")
        return 1
    if args.dry_run:
        print("would ship (--dry-run: nothing written)")
        return 0

    model = EssayScorer.load(cell / "best")
    deltas: tuple[str, ...] = ()
    if model.config.encoder_spec.freeze != "word_embeddings" \
            and model.config.encoder_spec.name_or_path == EMBEDDED_ENCODER:
        deltas = (EMBEDDINGS,)  # trained: a row delta against the package's
    tsv, folds_dir = asap_files(args.data_dir)
    splits = {p: split_essays(read_asap(tsv), read_folds(folds_dir), fold, prompt=p)
              for p in prompts}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        backup = Path(tmp) / "previous"
        if out.exists():
            shutil.copytree(out, backup)
        model.config.training = {
            "protocol": "finetune", "data": "ASAP training_set_rel3, Taghipour & Ng folds",
            "fold": fold, "cell": str(cell), "weights_dtype": "float16",
            "settings": record["settings"], "selected_epoch": record["selected"]["epoch"],
            "dev_mean_qwk_selected": new, "replaced_dev_mean_qwk": old,
            "dev_qwk": {str(p): record["prompts"][str(p)]["dev_qwk"] for p in prompts},
            "test_qwk": {str(p): record["prompts"][str(p)]["qwk"] for p in prompts},
            "test_mean_qwk": float(np.mean([record["prompts"][str(p)]["qwk"] for p in prompts])),
            "test_exact": {str(p): record["prompts"][str(p)]["exact"] for p in prompts},
        }
        written = model.save(out, dtype=torch.float16, tokenizer=model.tokenizer,
                             row_deltas=deltas)
        size = sum(f.stat().st_size for f in Path(written).iterdir()) / 2**20
        back = EssayScorer.load(written)
        dev = dev_qwks(back, splits, prompts)
        again = float(np.mean(list(dev.values())))
        print(f"wrote {written} ({size:.1f} MB); read back in fp16, dev mean QWK {100 * again:.2f}")
        reason = (f"{size:.1f} MB, over the {MAX_MB} MB budget" if size > MAX_MB else
                  f"in fp16 its dev mean QWK {100 * again:.2f} no longer beats {100 * old:.2f}"
                  if not again > old else None)
        if reason is not None:
            shutil.rmtree(out)
            if backup.exists():
                shutil.copytree(backup, out)
            print(f"not shipped: {reason}; the previous scorer is back in {out}", file=sys.stderr)
            return 1
        config = json.loads((out / "config.json").read_text(encoding="utf-8"))
        config["training"]["dev_qwk_fp16"] = dev
        atomic_write_text(out / "config.json", json.dumps(config, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
