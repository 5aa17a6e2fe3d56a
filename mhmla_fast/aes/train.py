"""Essay-scoring experiments on ASAP: everything ``mhmla-train aes`` runs, by one import.

The pieces live in modules of their own, along the sections this file once had:

* :mod:`.splits`: the ASAP files, cached windows of essays (``FeatureSplit``), the feature
  caches per prompt, QWK per prompt;
* :mod:`.heads`: the head trained on cached ``[CLS]`` vectors (``HeadTrainConfig``,
  ``train_head``, ``predict_split``);
* :mod:`.baselines`: ridge on per-layer vectors and surface features, TF-IDF, human agreement;
* :mod:`.ensembles`: mean, majority vote, greedy selection;
* :mod:`.registry`: the protocol's models by name (``MODELS``);
* :mod:`.protocol`: ``run_cpu_protocol``, the CPU frozen-encoder protocol (its description is
  that module's docstring), with resumable units and the results table;
* :mod:`.protocol_ensembles`: the protocol's ensembles over its units (mean, vote, greedy,
  stack);
* :mod:`.shipped`: ``train_joint_scorer``, the MHMLA scorer (shipped until 2026-12-06);
* :mod:`.ridge_scorer`: ``fit_ridge_scorer``, the shipped scorer since then;
* :mod:`.finetune`: ``FinetuneConfig`` and ``finetune``, full fine-tuning (a GPU protocol).
"""

from __future__ import annotations

from .baselines import (RIDGE_ALPHAS, SURFACE_ALPHAS, TFIDF_ALPHAS, _ridge_path, human_agreement,
                        ridge_layers, ridge_select, surface_ridge, tfidf_select)
from .ensembles import greedy_ensemble, majority_vote, mean_ensemble
from .finetune import FinetuneConfig, finetune
from .heads import HeadResult, HeadTrainConfig, predict_split, train_head
from .protocol import run_cpu_protocol
from .registry import DEFAULT_MEMBERS, DEFAULT_MODELS, HEAD_LRS, MODELS, ModelSpec, poolings_of
from .results import _aggregate, summary_table
from .shipped import train_joint_scorer
from .splits import (PROMPTS, PROTOCOL, FeatureSplit, asap_files, feature_split, joined_features,
                     load_prompt_caches, qwk, read_asap_folds, split_qwk)

__all__ = [
    "PROTOCOL", "HeadTrainConfig", "FeatureSplit", "train_head", "predict_split",
    "ridge_select", "tfidf_select", "human_agreement", "mean_ensemble", "majority_vote",
    "run_cpu_protocol", "FinetuneConfig", "finetune", "MODELS", "asap_files", "read_asap_folds",
    "ridge_layers", "feature_split", "split_qwk", "train_joint_scorer", "summary_table",
    "DEFAULT_MODELS", "DEFAULT_MEMBERS", "load_prompt_caches", "greedy_ensemble", "surface_ridge",
    "poolings_of", "joined_features", "PROMPTS", "qwk", "HeadResult", "ModelSpec", "HEAD_LRS",
    "RIDGE_ALPHAS", "TFIDF_ALPHAS", "SURFACE_ALPHAS",
]

_PRIVATE = (_aggregate, _ridge_path)  # used by commands/aes.py and the tests
