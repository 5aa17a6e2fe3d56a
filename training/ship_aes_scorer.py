"""Ship a fine-tuned joint essay scorer in the package, if fold-0 dev says it beats the shipped one.

    python training/ship_aes_scorer.py \\
        runs/aes-ft/mhmla-joint-reg-finetuned-words-frozen/fold0-p1_2_3_4_5_6_7_8

The cell is one of ``mhmla-train aes --finetune --joint`` (finished: its ``test.json`` is
written), trained on fold 0 for every prompt the shipped scorer scores. The rule (issue 13):

    mean_p dev_QWK_p(candidate, fold 0) > mean_p dev_QWK_p(shipped, fold 0)

with the shipped scorer's dev QWKs read from its ``config.json`` training record (those of its
cut scores where it has cutpoints: ``training["cutpoints"]["dev_qwk_cut"]``, how it scores,
where ``mhmla-train aes --fit-cutpoints`` fitted them for a frozen-encoder head, whose
out-of-fold heads train on cached features; ``training["dev_qwk"]`` for the ridge scorer
shipped since 2026-12-06, whose dev QWKs are of its cut scores, alpha chosen by them). The
candidate is judged as it would be shipped: with ``--cutpoints dev`` (the default, a regression cell) its continuous dev
predictions are cut at cutpoints fitted for QWK on the fold's dev essays (out-of-fold training
predictions would need five more fine-tuned models), and its dev QWK is that of
5-fold cross-fitted cut scores (each dev essay cut at cutpoints fitted on the other folds of
dev, ``cross_fitted_cut_scores``), never of cutpoints that saw the essay's own score; with
``--cutpoints none`` it rounds, judged by the cell's dev QWK. Only then is
the candidate written to ``--out`` (default: the shipped scorer's folder, replaced as a whole):
the embedded MiniLM's word embeddings read from its package where they were frozen, its other
trained matrices (and the word embeddings where trained) as int8 row deltas against the
package's (closer to the trained weights than fp16, in half the bytes: ``mhmla_fast.model_dir``),
fp16 elsewhere, at most 30 MB. The written model is read back and
scores fold 0's dev split again; its mean dev QWK (cross-fitted again where it cuts) must still
beat the shipped one's (fp16 may move it), else the old scorer is put back. The cell's test
QWKs (rounded) and, where it cuts, the written scorer's test QWKs go into the training record,
as the final check: they play no part in the decision. Nothing is written with ``--dry-run``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

MAX_MB = 30


def split_outputs(scorer, splits: dict, prompts, split: str = "dev"
                  ) -> dict[int, tuple[np.ndarray, np.ndarray | None, np.ndarray]]:
    """Per prompt, ``scorer``'s scores [E], its continuous predictions on the score scale [E]
    (None for a classification scorer, which has none) and the gold scores [E] of ``split``
    (``splits``: prompt -> train/dev/test)."""
    from mhmla_fast.aes.data import SCORE_RANGES

    out = {}
    for p in prompts:
        essays = splits[p][split]
        scores, means = scorer.predict_scores([e.text for e in essays], p, return_outputs=True)
        lo, hi = SCORE_RANGES[p]
        x = (lo + np.clip(np.asarray(means, dtype=np.float64), 0.0, 1.0) * (hi - lo)
             if scorer.config.objective == "regression" else None)
        out[p] = (np.asarray(scores), x, np.array([e.score for e in essays]))
    return out


def cut_dev(outputs: dict) -> tuple[dict[str, float], dict[int, np.ndarray], dict[str, float]]:
    """From :func:`split_outputs` of dev: per prompt the QWK of 5-fold cross-fitted cut scores,
    the cutpoints fitted on all of dev, and their in-sample dev QWK (for the record only)."""
    from mhmla_fast.aes.cutpoints import apply_cutpoints, cross_fitted_cut_scores, fit_cutpoints
    from mhmla_fast.aes.train import qwk

    crossfit, cuts, in_sample = {}, {}, {}
    for p, (_, x, gold) in outputs.items():
        if x is None:
            raise ValueError(f"prompt {p}: no continuous predictions to cut (a classification "
                             "scorer)")
        if gold.size < 2:
            raise SystemExit(f"prompt {p}: {gold.size} dev essay(s); cutpoints fitted on dev "
                             "need two at least (or --cutpoints none)")
        crossfit[str(p)] = float(qwk(gold, cross_fitted_cut_scores(
            x, gold, p, n_folds=min(5, gold.size)), p))
        cuts[p] = fit_cutpoints(x, gold, p)
        in_sample[str(p)] = float(qwk(gold, apply_cutpoints(x, cuts[p], p), p))
    return crossfit, cuts, in_sample


def asap_splits(data_dir: str | None, fold: int, prompts) -> dict:
    """Prompt -> train/dev/test essays of ``fold`` (:func:`split_essays`) for ``prompts``."""
    from mhmla_fast.aes.data import split_essays
    from mhmla_fast.aes.train import read_asap_folds

    essays, folds = read_asap_folds(data_dir)
    return {p: split_essays(essays, folds, fold, prompt=p) for p in prompts}


def dev_qwks(scorer, splits: dict, prompts, outputs: dict | None = None) -> dict[str, float]:
    """Dev QWK per prompt of ``scorer`` on ``splits`` (prompt -> train/dev/test essays): of its
    scores, or where it has cutpoints (fitted on these dev essays) of its cross-fitted cut
    scores (:func:`cut_dev`); ``outputs``: its :func:`split_outputs` of dev, if at hand."""
    from mhmla_fast.aes.train import qwk

    outputs = outputs or split_outputs(scorer, splits, prompts)
    if scorer.config.cutpoints:
        return cut_dev(outputs)[0]
    return {str(p): float(qwk(gold, scores, p)) for p, (scores, _, gold) in outputs.items()}


def main(argv=None) -> int:
    from mhmla_fast.aes.cutpoints import apply_cutpoints
    from mhmla_fast.aes.model import EssayScorer
    from mhmla_fast.aes.scoring import default_model_path
    from mhmla_fast.aes.train import qwk
    from mhmla_fast.durable import atomic_write_text
    from mhmla_fast.encoder import EMBEDDED_ENCODER
    from mhmla_fast.model_dir import candidate_dir, install_model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cell",
                        help="a finished joint fine-tuning cell (OUT/<model>/fold0-p1_2_...)")
    parser.add_argument("--out", default=str(default_model_path()))
    parser.add_argument("--shipped", default=str(default_model_path()),
                        help="the scorer to beat (default: the one in the package)")
    parser.add_argument("--data-dir", default=None,
                        help="the shared data folder or its asap_aes folder (default: "
                        "$MHMLA_SHARED_DATA or ../shared/data)")
    parser.add_argument("--cutpoints", choices=("dev", "none"), default="dev",
                        help="dev (default; a regression cell): cut the candidate's scores at "
                        "cutpoints fitted for QWK on the fold's dev essays, judged by their "
                        "5-fold cross-fitted dev QWK; none: round half up, judged by the "
                        "cell's dev QWK")
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
    # how it scores: a head's cutpoints fitted after its training have a record of their own;
    # a ridge scorer's dev QWKs are of its cut scores already (aes.ridge_scorer)
    fitted = shipped["training"].get("cutpoints")
    shipped_dev = (fitted["dev_qwk_cut"] if shipped.get("cutpoints") and fitted
                   else shipped["training"]["dev_qwk"])
    fold = record["settings"]["fold"]
    prompts = sorted(int(p) for p in record["prompts"])
    if fold != shipped["training"]["fold"] or prompts != sorted(int(p) for p in shipped_dev):
        raise SystemExit(f"{cell}: fold {fold}, prompts {prompts}; the shipped scorer was chosen "
                         f"on fold {shipped['training']['fold']} for prompts "
                         f"{sorted(int(p) for p in shipped_dev)}")
    old = float(np.mean(list(shipped_dev.values())))
    cut = None
    if args.cutpoints == "dev":  # the candidate's dev predictions decide: load it now
        model = EssayScorer.load(cell / "best")
        splits = asap_splits(args.data_dir, fold, prompts)
        if model.config.objective != "regression":
            raise SystemExit(f"{cell}: a {model.config.objective} cell has no cutpoints; "
                             "use --cutpoints none")
        print(f"scoring fold {fold}'s dev essays to fit cutpoints ...", flush=True)
        outputs = split_outputs(model, splits, prompts)
        crossfit, cuts, in_sample = cut_dev(outputs)
        rounded = {str(p): float(qwk(gold, scores, p)) for p, (scores, _, gold) in outputs.items()}
        cut = {"method": "fitted for QWK on the fold's dev essays (the scorer's continuous dev "
                         "predictions); dev_qwk_cut: each dev essay cut at cutpoints fitted on "
                         "the other folds of a 5-fold split of dev (cross-fitted)",
               "dev_qwk_rounded": rounded, "dev_qwk_cut": crossfit,
               "dev_qwk_cut_in_sample": in_sample,
               "dev_mean_qwk_rounded": float(np.mean(list(rounded.values()))),
               "dev_mean_qwk_cut": float(np.mean(list(crossfit.values())))}
        new = cut["dev_mean_qwk_cut"]
        print(f"fold {fold} dev mean QWK of the candidate: rounded "
              f"{100 * cut['dev_mean_qwk_rounded']:.2f}, cut (cross-fitted) {100 * new:.2f}")
    else:
        new = float(record["dev_qwk"])
    print(f"fold {fold} dev mean QWK: candidate {100 * new:.2f}, shipped {100 * old:.2f}")
    if not new > old:
        print("not shipped: the candidate does not beat the shipped scorer on dev")
        return 1
    if args.dry_run:
        print("would ship (--dry-run: nothing written)")
        return 0

    if cut is None:
        model = EssayScorer.load(cell / "best")
        splits = asap_splits(args.data_dir, fold, prompts)
    # the embedded encoder's trained matrices as int8 row deltas against the package's (closer
    # to the trained weights than fp16, half the bytes: mhmla_fast.model_dir); the rest fp16
    embedded = model.config.encoder_spec.name_or_path == EMBEDDED_ENCODER
    deltas = model.trained_encoder_matrices() if embedded else ()
    if cut is not None:
        model.config.cutpoints = {p: tuple(float(c) for c in c_p) for p, c_p in cuts.items()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # written and checked beside the shipped scorer first: it is replaced only by a candidate
    # that passed (one interrupted in its read-back check was left shipped, unchecked, and a
    # Ctrl-C there deleted the only copy of the old one)
    with candidate_dir(out) as staged:
        model.config.training = {
            "protocol": "finetune", "data": "ASAP training_set_rel3, Taghipour & Ng folds",
            "fold": fold, "cell": str(cell), "weights_dtype": "float16",
            **({"encoder_matrices": "int8 row deltas against the embedded encoder"}
               if deltas else {}),
            "settings": record["settings"], "selected_epoch": record["selected"]["epoch"],
            "dev_mean_qwk_selected": new, "replaced_dev_mean_qwk": old,
            "dev_qwk": {str(p): record["prompts"][str(p)]["dev_qwk"] for p in prompts},
            "test_qwk": {str(p): record["prompts"][str(p)]["qwk"] for p in prompts},
            "test_mean_qwk": float(np.mean([record["prompts"][str(p)]["qwk"] for p in prompts])),
            "test_exact": {str(p): record["prompts"][str(p)]["exact"] for p in prompts},
            **({"cutpoints": cut} if cut is not None else {}),
        }
        written = model.save(staged, dtype=torch.float16, tokenizer=model.tokenizer,
                             row_deltas=deltas)
        size = sum(f.stat().st_size for f in Path(written).iterdir()) / 2**20
        back = EssayScorer.load(written)
        back_dev = split_outputs(back, splits, prompts)
        dev = dev_qwks(back, splits, prompts, back_dev)
        again = float(np.mean(list(dev.values())))
        print(f"wrote the candidate ({size:.1f} MB); read back, dev mean QWK {100 * again:.2f}")
        reason = (f"{size:.1f} MB, over the {MAX_MB} MB budget" if size > MAX_MB else
                  f"in fp16 its dev mean QWK {100 * again:.2f} no longer beats {100 * old:.2f}"
                  if not again > old else None)
        if reason is not None:
            print(f"not shipped: {reason}; {out} is unchanged", file=sys.stderr)
            return 1
        config = json.loads((staged / "config.json").read_text(encoding="utf-8"))
        config["training"]["dev_qwk_fp16"] = dev
        if cut is not None:  # dev scores the stored weights change; then the final check on test
            same = [back_dev[p][0] == apply_cutpoints(outputs[p][1], cuts[p], p) for p in prompts]
            config["training"]["cutpoints"]["dev_scores_as_trained"] = float(
                np.concatenate(same).mean())
            print(f"{100 * np.concatenate(same).mean():.2f}% of dev essays scored as by the "
                  "trained fp32 weights with the same cutpoints")
            test = {str(p): float(qwk(gold, scores, p)) for p, (scores, _, gold)
                    in split_outputs(back, splits, prompts, "test").items()}
            config["training"]["cutpoints"]["test_qwk_cut"] = test
            config["training"]["cutpoints"]["test_mean_qwk_cut"] = float(
                np.mean(list(test.values())))
            print(f"final check, fold {fold} test mean QWK: cut "
                  f"{100 * np.mean(list(test.values())):.2f}, rounded (the cell) "
                  f"{100 * model.config.training['test_mean_qwk']:.2f}")
        atomic_write_text(staged / "config.json", json.dumps(config, indent=2))
        install_model_dir(staged, out)
        print(f"shipped in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
