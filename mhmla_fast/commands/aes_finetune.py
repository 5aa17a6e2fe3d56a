"""``mhmla-train aes --finetune``: the fine-tuning protocol's cells and its results file.

Each (fold, prompt) cell, or with ``--joint`` each fold's cell of all the prompts, is one
:func:`mhmla_fast.aes.finetune.finetune` run in ``<out>/<model name>/fold<k>-p<p>``, finished
by a ``test.json`` (test and dev predictions, QWK) that a rerun of the same settings and essays
reuses; the models' entries go to one results file (``<out>/results-finetune.json``, or for
the whole protocol run in the project checkout ``bench/results/aes_gpu-finetune.json``:
:func:`mhmla_fast.commands.aes.default_results`). ``--collect`` trains nothing and writes
the file from finished cells alone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["run_finetune", "GPU_RESULTS", "RUN_ONLY"]

GPU_RESULTS = "bench/results/aes_gpu-finetune.json"
# fine-tuning settings of how a run goes, not of what it trains (not compared between cells)
RUN_ONLY = ("checkpoint_every",)


def run_finetune(args, prompts: list[int], folds: list[int], log=print) -> int:
    """Full fine-tuning, one scorer per (fold, prompt), or with ``--joint`` one per fold for all
    the prompts, scored on the test split (GPU). Cells live in ``<out>/<model
    name>/fold<k>-p<p>`` (joint: ``fold<k>-p3_4_...``); the results file gains (or replaces) the
    model's entry and keeps the other models' (another head, objective or seed). ``args``:
    ``mhmla-train aes``'s; ``log``: each epoch's line (None: quiet). Returns the exit status."""
    from dataclasses import asdict, replace

    from ..aes.data import split_essays
    from ..aes.finetune import model_name
    from ..aes.train import FinetuneConfig, _aggregate, read_asap_folds
    from ..aes.units import data_digest
    from ..configs import LayerAttentionConfig
    from ..distributed import rank_from_env
    from ..provenance import provenance

    head = LayerAttentionConfig(mode=args.mode or "mhmla",
                                num_heads=12 if args.num_heads is None else args.num_heads)
    groups = [tuple(prompts)] if args.joint else [(p,) for p in prompts]
    # the settings every cell shares; each cell's config differs in out, prompts and fold only
    base = FinetuneConfig(out=str(Path(args.out)), prompts=groups[0], fold=folds[0],
                          encoder=args.encoder, freeze=args.freeze or "none",
                          layer_attention=head,
                          objective=args.objective or "classification",
                          epochs=args.epochs or 10, batch_size=args.batch_size or 8,
                          lr=args.lr or 1e-5, head_lr=args.head_lr or 1e-3, seed=args.seed,
                          precision=args.precision or "auto", backend=args.backend,
                          batching=args.batching or "length", compile=args.compile or "off",
                          checkpoint_every=args.checkpoint_every or 200)
    name = model_name(base)
    settings = {key: v for key, v in json.loads(json.dumps(asdict(base))).items()
                if key not in ("out", "prompts", "fold", "compile", *RUN_ONLY)}
    from .aes import default_results

    path = Path(args.results) if args.results else default_results(
        GPU_RESULTS, Path(args.out) / "results-finetune.json",
        full=len(prompts) == 8 and len(folds) == 5)
    header = {"protocol": "gpu-finetune", "encoder": args.encoder, "folds": folds,
              "prompts": prompts}
    _read_results(path, header)  # refused before any training, not after it
    essays, fold_ids = read_asap_folds(args.data_dir)
    todo = []  # (fold, the cell's config, its prompts' splits)
    for k in folds:
        for group in groups:
            out = Path(args.out) / name / f"fold{k}-p{'_'.join(map(str, group))}"
            splits = {p: split_essays(essays, fold_ids, k, prompt=p) for p in group}
            empty = [f"prompt {p}'s {part}" for p in group for part in ("train", "dev", "test")
                     if not splits[p][part]]
            if empty:  # (else a joint cell would train to its end, then fail to score)
                raise ValueError(f"{args.data_dir or 'the data'}: fold {k} has no essays for "
                                 f"{', '.join(empty)}; leave those prompts out of --prompt")
            todo.append((k, replace(base, out=str(out), prompts=group, fold=k), splits))
    if args.collect:  # every missing cell named at once, before anything is written
        missing = [str(cfg.out) for _, cfg, splits in todo
                   if _stored_cell(cfg, data_digest(splits, list(cfg.prompts))) is None]
        if missing:
            raise ValueError(f"--collect: {len(missing)} of {len(todo)} cells are not finished "
                             f"with these settings, essays and encoder files: {', '.join(missing)}")
    cells: dict[int, dict[int, dict]] = {k: {} for k in folds}
    cell_dirs: dict[int, dict[int, Path]] = {k: {} for k in folds}
    main = rank_from_env() == 0  # under torchrun the others train, and write nothing
    for k, cfg, splits in todo:
        for p, cell in _finetune_cell(cfg, splits, log, main=main).items():
            cells[k][p], cell_dirs[k][p] = cell, Path(cfg.out)
    if not main:
        return 0
    runs = _cell_runs(cells, name)  # each cell's arithmetic, encoder files and machine
    entry = {**_aggregate(cells, folds, prompts), "settings": settings,
             # each cell's epochs: dev QWK and seconds (from its checkpoint), the curve behind
             # the selected epoch (a joint cell's mean dev QWK, for each of its prompts)
             "epochs": {str(k): {str(p): _epoch_log(cell_dirs[k][p], base.epochs)
                                 for p in prompts} for k in folds},
             "cells": runs, "written_by": provenance()}
    _add_results_entry(path, header, name, entry, provenance())
    print(f"wrote {path} ({name})")
    return 0


def _finetune_cell(cfg, splits: dict[int, dict], log, *, main: bool = True) -> dict[int, dict]:
    """Train (or reuse) the fine-tuning cell ``cfg`` on the essays of ``splits`` (prompt ->
    train/dev/test) and return each prompt's record: test ``qwk`` and ``exact``, ``dev_qwk`` of
    the selected epoch, ``selected``, ``settings``, ``data`` and the predictions
    (:func:`_cell_predictions`). They are stored in ``<cfg.out>/test.json``: a one-prompt cell
    is its prompt's record; a joint cell holds ``{"settings", "data", "dev_qwk" (the mean
    dev QWK it was selected on), "selected", "prompts": {p: record}}``. A stored cell of the
    same settings and essays is reused (where the folder lies is no setting: a moved one is
    reused); others train on: ``finetune`` resumes a longer run and refuses any other change
    of its config or of its train and dev essays; a changed test split is scored again.
    ``log``: :func:`~mhmla_fast.aes.finetune.finetune`'s. ``main`` False (ranks other than
    the first under torchrun): the cell is trained (data-parallel) but neither scored nor
    written, and ``{}`` returned."""
    from dataclasses import asdict

    import numpy as np

    from ..aes.fingerprints import local_encoder_fingerprint
    from ..aes.metrics import exact_agreement
    from ..aes.train import finetune, qwk
    from ..aes.units import data_digest
    from ..durable import atomic_write_text
    from ..provenance import provenance

    group = tuple(cfg.prompts)
    out = Path(cfg.out)
    cell_settings = json.loads(json.dumps(asdict(cfg)))
    data = data_digest(splits, list(group))  # the cell's train, dev and test essays
    done = out / "test.json"
    cell = _stored_cell(cfg, data)
    if cell is not None:
        if not main:
            return {}
        if len(group) > 1:
            return {int(p): c for p, c in cell["prompts"].items()}
        if "pred" not in cell or "dev_pred" not in cell:  # a cell made before them
            cell = _with_predictions(cell, out, splits[group[0]], group[0])
            atomic_write_text(done, json.dumps(cell))
        return {group[0]: cell}
    train = [e for p in group for e in splits[p]["train"]]
    dev = [e for p in group for e in splits[p]["dev"]]
    model, state = finetune(cfg, train, dev, log=log)
    if not main:
        return {}
    ran = {"encoder_sha256": local_encoder_fingerprint(cfg.encoder_spec.name_or_path),
           "precision_applied": state["precision_applied"],
           "compile_applied": state["compile_applied"], "provenance": provenance()}
    best = next((r for r in state["log"] if r["epoch"] == state["best_epoch"]), {})
    records = {}
    for p in group:
        preds = _cell_predictions(model, splits[p], p)
        gold = np.array(preds["gold"])
        dev_qwk = state["best"] if len(group) == 1 else _prompt_value(best.get("dev_qwk"), p)
        records[p] = {"qwk": qwk(gold, np.array(preds["pred"]), p),
                      "exact": exact_agreement(gold, np.array(preds["pred"])),
                      "dev_qwk": dev_qwk, "selected": {"epoch": state["best_epoch"]},
                      "settings": cell_settings, "data": data, **ran, **preds}
    if len(group) == 1:
        stored = records[group[0]]
    else:
        stored = {"settings": cell_settings, "data": data, "dev_qwk": state["best"],
                  "selected": {"epoch": state["best_epoch"]}, **ran,
                  "prompts": {str(p): r for p, r in records.items()}}
    atomic_write_text(done, json.dumps(stored))
    return records


def _stored_cell(cfg, data: dict) -> dict | None:
    """The finished cell ``<cfg.out>/test.json`` when it was made with ``cfg``'s settings
    (:func:`_without_out`) on the essays whose digest is ``data``
    (:func:`~mhmla_fast.aes.units.data_digest`) and from the encoder files that ``cfg``'s
    encoder names now (their sha256; a cell from before the record is taken on its settings);
    None otherwise. ValueError, naming the file, for a ``test.json`` that cannot be read."""
    from dataclasses import asdict

    from ..aes.fingerprints import local_encoder_fingerprint

    done = Path(cfg.out) / "test.json"
    if not done.is_file():
        return None
    try:
        cell = json.loads(done.read_text(encoding="utf-8"))
        settings = cell.get("settings")
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"{done}: not a readable finished cell ({err}); remove it, and the "
                         "same command scores the cell again from its checkpoint") from None
    same = _without_out(settings) == _without_out(json.loads(json.dumps(asdict(cfg))))
    if not same or cell.get("data") != data:
        return None
    made = cell.get("encoder_sha256")
    if made is not None and made != local_encoder_fingerprint(cfg.encoder_spec.name_or_path):
        return None
    return cell


def _cell_runs(cells: dict[int, dict[int, dict]], name: str) -> dict[str, dict[str, dict]]:
    """Each cell's run record (``encoder_sha256``, ``precision_applied``, ``compile_applied``,
    ``provenance``; None in a cell from before the record) by fold and prompt. ValueError when
    the cells of one model ran in different arithmetic or from different encoder files (cells
    trained over several sessions and machines, ``--collect``): they are not one model's."""
    keys = ("encoder_sha256", "precision_applied", "compile_applied", "provenance")
    runs = {str(k): {str(p): {key: cell.get(key) for key in keys} for p, cell in by_p.items()}
            for k, by_p in cells.items()}
    for key, what in (("precision_applied", "arithmetic"), ("encoder_sha256", "encoder files")):
        seen: dict = {}
        for k, by_p in runs.items():
            for p, run in by_p.items():
                if run[key] is not None:
                    seen.setdefault(run[key], []).append(f"fold {k} prompt {p}")
        if len(seen) > 1:
            said = "; ".join(f"{v[:12]}: {', '.join(where[:4])}"
                             + (f" and {len(where) - 4} more" if len(where) > 4 else "")
                             for v, where in seen.items())
            raise ValueError(f"{name}: its cells ran in different {what} ({said}); train "
                             "the odd ones again (remove their folders) so that one model's "
                             "cells share them")
    return runs


def _prompt_value(per_prompt: dict | None, prompt: int) -> float | None:
    """``per_prompt[prompt]`` of a log's per-prompt dict, whose keys are ints in memory and
    strings once read back from JSON."""
    if not per_prompt:
        return None
    return per_prompt.get(prompt, per_prompt.get(str(prompt)))


def _cell_predictions(model, split: dict, prompt: int) -> dict:
    """A fine-tuned cell's predictions in the layout of the CPU protocol's units
    (``aes.protocol``), so that ensembles can combine them with frozen-feature models chosen
    on dev: the test essays' ``ids``, ``gold`` and ``pred``, and the dev essays' ``dev_ids``
    and ``dev_pred`` (integer scores, in the split's order)."""
    test, dev = split["test"], split["dev"]
    return {"ids": [e.essay_id for e in test], "gold": [e.score for e in test],
            "pred": [int(x) for x in model.predict_scores([e.text for e in test], prompt)],
            "dev_ids": [e.essay_id for e in dev],
            "dev_pred": [int(x) for x in model.predict_scores([e.text for e in dev], prompt)]}


def _with_predictions(cell: dict, out: Path, split: dict, prompt: int) -> dict:
    """``cell`` (a finished cell from before predictions were stored) with
    :func:`_cell_predictions` of its selected model (``out/best``). Its test QWK must come out
    as stored, else ValueError: the folder's model is not the one that was scored."""
    import numpy as np

    from ..aes.model import EssayScorer
    from ..aes.train import qwk
    from ..devices import resolve_device

    best = out / "best"
    if not (best / "config.json").is_file():
        raise ValueError(f"{out}: a finished cell without its predictions or its selected "
                         f"model ({best}); remove {out / 'test.json'} to train it again")
    model = EssayScorer.load(best, device=resolve_device(None),
                             backend=cell["settings"].get("backend", "auto"))
    preds = _cell_predictions(model, split, prompt)
    again = qwk(np.array(preds["gold"]), np.array(preds["pred"]), prompt)
    if abs(again - cell["qwk"]) > 1e-9:
        raise ValueError(f"{out}: its selected model scores test QWK {again:.6f}, not the "
                         f"{cell['qwk']:.6f} the cell records; remove {out / 'test.json'} to "
                         f"train it again")
    return {**cell, **preds}


def _epoch_log(cell: Path, epochs: int) -> list[dict] | None:
    """A fine-tuning cell's per-epoch record (epoch, loss, mean dev QWK, seconds) from its
    checkpoint, up to ``epochs`` (the run's; a longer run stopped early may have gone further);
    None when it has none (a cell copied without it)."""
    try:
        log = json.loads((cell / "checkpoint.json").read_text(encoding="utf-8"))["log"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return [{k: r.get(k) for k in ("epoch", "loss", "dev_mean_qwk", "seconds")} for r in log
            if r.get("epoch", 0) <= epochs]


def _without_out(settings: dict | None) -> dict | None:
    """A cell's settings for comparison: without its folder, its compile mode (how its
    steps ran, as the device: a finished cell is reused under any; one that trains on is
    checked by ``finetune``, which resumes only under the mode it began with) and
    :data:`RUN_ONLY` (how often it saved), and with the
    batching of a cell made before the option (shuffled only: "random")."""
    if settings is None:
        return None
    return {"batching": "random",
            **{k: v for k, v in settings.items() if k not in ("out", "compile", *RUN_ONLY)}}


def _read_results(path: Path, header: dict) -> dict:
    """The fine-tuning results file ``path`` (an empty one with ``header`` when it does not
    exist). A file of another protocol, encoder, folds or prompts (``header``), or one that
    cannot be read, is a ValueError and is left as it is."""
    if not path.exists():
        return {**header, "models": {}}
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable results file ({err}); move it, or pass "
                         "--results") from err
    if not isinstance(old, dict) or {k: old.get(k) for k in header} != header \
            or not isinstance(old.get("models"), dict):
        raise ValueError(f"{path}: holds results of another run ("
                         f"{ {k: old.get(k) for k in header} if isinstance(old, dict) else old}"
                         f", not {header}); pass --results to write elsewhere")
    return old


def _add_results_entry(path: Path, header: dict, name: str, entry: dict, prov: dict) -> None:
    """Add (or replace, said on stderr when its settings differ) ``name``'s entry in the results
    file ``path``, keeping the other models' (:func:`_read_results`). The update holds a lock on
    the file's folder, so two runs (two heads on two GPUs) both land."""
    import os

    from .. import filelock
    from ..durable import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        filelock.lock(fd)
        result = _read_results(path, header)
        before = (result["models"].get(name) or {}).get("settings")
        if before is not None and before != entry["settings"]:  # said, not silently replaced
            changed = sorted(k for k in entry["settings"] if before.get(k) != entry["settings"][k])
            print(f"{path}: {name}'s entry, made with other settings ({', '.join(changed)}), is "
                  "replaced", file=sys.stderr)
        result["models"][name] = entry
        result["provenance"] = prov
        atomic_write_text(path, json.dumps(result, indent=1))
    finally:
        os.close(fd)
