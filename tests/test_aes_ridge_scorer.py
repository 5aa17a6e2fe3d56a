"""The ridge scorer (``head_kind="ridge"``, the shipped scorer's kind since 2026-12-06): its
config's rules, its head against a float64 computation from the encoder's hidden states, the
scorer fitted by ``fit_ridge_scorer`` against the protocol's ``ridge-layers-cuts`` unit, its
ONNX export, and ``mhmla-train aes --export-ridge``; save/load, window-by-window scoring and the
ONNX export also for pooling "cls+mean" with surface weights (the ridge stack scorer's kind,
shipped since 2026-12-07; the rest of it in ``test_aes_ridge_stack_scorer.py``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_aes_train import tiny_encoder, write_asap  # noqa: F401 - tiny_encoder: the fixture

from mhmla_fast.aes.cutpoints import apply_cutpoints
from mhmla_fast.aes.data import SCORE_RANGES
from mhmla_fast.aes.model import (EssayScorer, ScorerConfig, collate_windows, encode_essay_windows,
                                  load_tokenizer)

TEXTS = ["The dog went to school every day and saw a cat . " * k for k in (1, 3, 6, 9)]


def test_ridge_config_needs_cls_pooling_and_regression():
    cfg = ScorerConfig(encoder="x", head_kind="ridge", objective="regression")
    assert json.loads(cfg.to_json())["head_kind"] == "ridge"
    assert ScorerConfig.from_json(cfg.to_json()).head_kind == "ridge"
    assert "head_kind" not in json.loads(ScorerConfig(encoder="x").to_json())  # as before
    assert "cutpoints" not in json.loads(cfg.to_json())  # none fitted: none written
    cuts = {4: (0.5, 1.5, 2.5), 3: (0.4, 1.6, 2.5)}
    written = json.loads(ScorerConfig(encoder="x", objective="regression", prompts=(3, 4),
                                      cutpoints=cuts).to_json())
    assert list(written["cutpoints"]) == ["3", "4"] and "head_kind" not in written
    with pytest.raises(ValueError, match="head_kind 'ridge' reads"):
        ScorerConfig(head_kind="ridge", objective="classification")
    with pytest.raises(ValueError, match="head_kind 'ridge' reads"):
        ScorerConfig(head_kind="ridge", objective="regression", pooling="attention")
    with pytest.raises(ValueError, match="head_kind: expected one of"):
        ScorerConfig(head_kind="linear")


def _ridge_scorer(encoder: str, pooling: str = "cls") -> EssayScorer:
    """A ridge scorer of prompts 3 and 4 with random output layers large enough that the
    outputs leave [0, 1], and cutpoints outside the scale too (prompt 3: 0..3); with pooling
    "cls+mean" (the ridge stack scorer's kind) also surface weights large enough to move
    scores."""
    from mhmla_fast.aes.surface import SURFACE_FEATURES

    torch.manual_seed(3)
    rng = np.random.default_rng(5)
    surface = ({p: tuple(rng.normal(0, 0.3, len(SURFACE_FEATURES))) for p in (3, 4)}
               if pooling == "cls+mean" else {})
    cfg = ScorerConfig(encoder=encoder, head_kind="ridge", objective="regression",
                       pooling=pooling, prompts=(3, 4), surface_weights=surface,
                       cutpoints={3: (-0.4, 1.2, 3.3), 4: (0.5, 1.5, 2.5)})
    scorer = EssayScorer(cfg, backend="torch").eval()
    with torch.no_grad():
        for out in scorer.head.outputs.values():
            out.weight.normal_(0, 0.5)
            out.bias.fill_(0.3)
    scorer.tokenizer = load_tokenizer(encoder)
    return scorer


def test_ridge_head_is_a_linear_map_of_every_layers_cls(tiny_encoder):
    scorer = _ridge_scorer(tiny_encoder)
    tok = scorer.tokenizer
    windows, essay_index = encode_essay_windows(tok, TEXTS, scorer.config.window)
    assert len(windows) > len(TEXTS)  # the longer essays have two windows or more
    ids, mask = collate_windows(windows, tok.pad_token_id)
    with torch.no_grad():
        states = scorer.encoder(input_ids=ids, attention_mask=mask,
                                output_hidden_states=True).hidden_states
    x = torch.cat([h[:, 0] for h in states[1:]], dim=1).double()  # layers 1..L at [CLS]
    cls = torch.stack([h[:, 0] for h in states], 1)  # [B, L+1, H]: the feature cache's rows
    linear = {}
    for p in (3, 4):
        out = scorer.head.outputs[str(p)]
        linear[p] = (x @ out.weight.detach().double().T + out.bias.detach().double()).squeeze(1)
        got = scorer.predict_windows(ids, mask, p)
        np.testing.assert_allclose(got.numpy(), linear[p].numpy(), atol=1e-5)
        with torch.no_grad():
            np.testing.assert_allclose(scorer.head.forward_cls(cls, p).numpy(),
                                       linear[p].numpy(), atol=1e-5)
    assert not ((linear[3] > 0) & (linear[3] < 1)).all()  # unbounded: no sigmoid
    # scores: the windows averaged per essay and cut where they are, not clipped to [0, 1]
    scores, outs = scorer.predict_scores(TEXTS, 3, return_outputs=True)
    y = linear[3].numpy()
    mean = np.array([y[np.array(essay_index) == e].mean() for e in range(len(TEXTS))])
    np.testing.assert_allclose(np.array(outs, dtype=float), mean, atol=1e-5)
    lo, hi = SCORE_RANGES[3]
    cut = np.clip(apply_cutpoints(lo + mean * (hi - lo), scorer.config.cutpoints[3], 3), lo, hi)
    assert scores.tolist() == cut.tolist()


@pytest.mark.parametrize("pooling", ["cls", "cls+mean"])
def test_ridge_scorer_round_trips_and_scores_window_by_window(tiny_encoder, tmp_path, pooling):
    scorer = _ridge_scorer(tiny_encoder, pooling)
    path = scorer.save(tmp_path / "ridge", tokenizer=scorer.tokenizer)
    again = EssayScorer.load(path)
    assert again.config.head_kind == "ridge" and again.head.layer_attention is None
    assert again.config.pooling == pooling
    assert again.config.surface_weights == scorer.config.surface_weights
    want = scorer.predict_scores(TEXTS, [3, 4, 3, 4])
    assert again.predict_scores(TEXTS, [3, 4, 3, 4]).tolist() == want.tolist()
    plans = [again.plan_essay(t, p) for t, p in zip(TEXTS, [3, 4, 3, 4])]  # the HTTP batcher's way
    assert all((plan.offset != 0) == (pooling == "cls+mean") for plan in plans)
    pairs = [(plan, w) for plan in plans for w in range(len(plan.windows))]
    outputs = again.score_windows(pairs[::-1])[::-1]
    got, k = [], 0
    for plan in plans:
        got.append(again.finish_essay(plan, outputs[k: k + len(plan.windows)]))
        k += len(plan.windows)
    assert got == want.tolist()


def test_a_ridge_scorer_refuses_kernels_it_has_no_layer_attention_for(tiny_encoder, tmp_path,
                                                                      monkeypatch):
    """Kernels other than "auto" are refused for a ridge scorer. "triton" on the CPU is first
    refused as a CUDA-only choice unless TRITON_INTERPRET=1 (the options check reads it at
    call time), so both orders are pinned here, whatever the test run's environment."""
    from mhmla_fast.serve.score import load_scorer

    scorer = _ridge_scorer(tiny_encoder)
    path = scorer.save(tmp_path / "ridge", tokenizer=scorer.tokenizer)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="'triton' runs on a CUDA device"):
        load_scorer(path, backend="torch", device="cpu", kernels="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for kernels in ("torch", "triton"):
        with pytest.raises(ValueError, match="is a ridge scorer, with no layer attention"):
            load_scorer(path, backend="torch", device="cpu", kernels=kernels)
    assert load_scorer(path, backend="torch", device="cpu").config.head_kind == "ridge"


def test_fitted_ridge_scorer_is_the_protocols_ridge_layers_cuts(tiny_encoder, tmp_path):
    from mhmla_fast.aes.data import split_essays
    from mhmla_fast.aes.ridge_scorer import fit_ridge_scorer
    from mhmla_fast.aes.scoring import combine_windows
    from mhmla_fast.aes.splits import feature_split, load_prompt_caches, read_asap_folds
    from mhmla_fast.aes.train import run_cpu_protocol

    data, cache = write_asap(tmp_path / "data"), tmp_path / "cache"
    run_cpu_protocol(data_dir=data, cache_dir=cache, run_dir=tmp_path / "run", folds=[0],
                     prompts=[3, 4], models=["ridge-layers-cuts"], encoder=tiny_encoder, log=None)
    scorer = fit_ridge_scorer(data_dir=data, cache_dir=cache, fold=0, prompts=[3, 4],
                              encoder=tiny_encoder, log=None)
    training = scorer.config.training
    essays, folds = read_asap_folds(data)
    caches = load_prompt_caches(essays, [3, 4], cache, tiny_encoder, log=None)["cls"]
    for p in (3, 4):
        unit = json.loads((tmp_path / "run" / "units" / f"ridge-layers-cuts-fold0-p{p}.json")
                          .read_text())
        assert training["alpha"][str(p)] == unit["selected"]["alpha"]
        np.testing.assert_allclose(scorer.config.cutpoints[p], unit["selected"]["cutpoints"])
        assert training["dev_qwk"][str(p)] == pytest.approx(unit["dev_qwk"])
        assert training["test_qwk"][str(p)] == pytest.approx(unit["qwk"])
        # the scorer's own layers on the cached vectors: the unit's continuous predictions and
        # scores (the standardisation folded into the weights)
        test_essays = split_essays(essays, folds, 0, prompt=p)["test"]
        split = feature_split(caches[p], test_essays)
        with torch.no_grad():
            y = scorer.head.forward_cls(split.features.float(), p).double().numpy()
        scores, mean = combine_windows(y, split.essay_index, p, "regression",
                                       n_essays=len(split.ids), return_mean=True,
                                       cutpoints=scorer.config.cutpoints[p])
        lo, hi = SCORE_RANGES[p]
        # (fp32 layers against the protocol's float64: within 1e-4 on the score scale)
        np.testing.assert_allclose(lo + mean * (hi - lo), unit["continuous"]["test"], atol=1e-4)
        assert scores.tolist() == unit["pred"] and split.ids.tolist() == unit["ids"]


@pytest.mark.parametrize("pooling", ["cls", "cls+mean"])
def test_ridge_scorer_exports_to_onnx_with_torchs_scores(tiny_encoder, tmp_path, pooling):
    """ONNX Runtime scores as torch, whole essays and window by window (the HTTP batcher's
    way); a "cls+mean" scorer is exported whole (its token means need the last layer at every
    position) with its surface weights."""
    from mhmla_fast.serve.score_onnx import OnnxScorer, export_scorer

    scorer = _ridge_scorer(tiny_encoder, pooling)
    path = scorer.save(tmp_path / "ridge", tokenizer=scorer.tokenizer)
    export = tmp_path / "export"
    export_scorer(path, export)  # fails unless ONNX Runtime scores as torch fp32
    meta = json.loads((export / "export.json").read_text())
    assert meta["graph"] == ("whole-encoder" if pooling == "cls+mean" else "cls-last-layer")
    assert sorted(meta["surface_weights"]) == (["3", "4"] if pooling == "cls+mean" else [])
    onnx = OnnxScorer(export, threads=1)
    prompts = [3, 4, 4, 3]
    want, want_out = EssayScorer.load(path).predict_scores(TEXTS, prompts, return_outputs=True)
    got, got_out = onnx.predict_scores(TEXTS, prompts, return_outputs=True)
    assert got.tolist() == want.tolist()
    np.testing.assert_allclose(np.array(got_out, dtype=float), np.array(want_out, dtype=float),
                               atol=1e-4)
    plans = [onnx.plan_essay(t, p) for t, p in zip(TEXTS, prompts)]
    assert [onnx.finish_essay(plan, onnx.score_windows(
        [(plan, w) for w in range(len(plan.windows))])) for plan in plans] == want.tolist()


def test_export_ridge_command_saves_the_scorer_and_refuses_other_options(tiny_encoder, tmp_path,
                                                                        capsys):
    from safetensors import safe_open

    from mhmla_fast.commands.eval import main as mhmla_eval
    from mhmla_fast.commands.train import main as mhmla_train

    data = write_asap(tmp_path / "data")
    common = ["--prompt", "3,4", "--data-dir", str(data), "--cache-dir", str(tmp_path / "cache")]
    out = tmp_path / "ridge"
    assert mhmla_train(["aes", *common, "--fold", "0", "--encoder", tiny_encoder,
                        "--export-ridge", str(out), "--quiet"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["head_kind"] == "ridge" and cfg["objective"] == "regression"
    assert sorted(cfg["cutpoints"]) == ["3", "4"]
    assert cfg["training"]["model"] == "ridge-layers-cuts"
    assert (out / "tokenizer.json").is_file()
    with safe_open(str(out / "model.safetensors"), "pt") as f:  # the ridges, in fp32
        assert sorted(k for k in f.keys() if k.startswith("head.")) == [
            f"head.outputs.{p}.{n}" for p in (3, 4) for n in ("bias", "weight")]
        assert f.get_tensor("head.outputs.3.weight").dtype == torch.float32
    result = tmp_path / "eval.json"
    assert mhmla_eval(["aes", *common, "--model", str(out), "--json", str(result)]) == 0
    evaluated = json.loads(result.read_text())["prompts"]
    for p in ("3", "4"):  # through the feature cache, as the fit scored its test split
        assert evaluated[p]["qwk"] == pytest.approx(cfg["training"]["test_qwk"][p])
    capsys.readouterr()
    assert mhmla_train(["aes", *common, "--export-ridge", str(tmp_path / "x"), "--epochs",
                        "3"]) == 2
    assert "--epochs: not used by --export-ridge" in capsys.readouterr().err
    assert mhmla_train(["aes", *common, "--export-ridge", str(tmp_path / "x"), "--fold",
                        "0,1"]) == 2
    assert "--fold: --export-ridge fits one scorer on one fold" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
