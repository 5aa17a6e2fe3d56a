"""The checked bf16 essay scorer: the rounding-boundary rule (``aes.scoring.near_boundary``)
against brute force for every objective and decision; :class:`CheckedScorer` on a fast runner
with a known error gives the exact runner's scores, re-scores only the essays near a boundary
(and a margin below the error is caught missing changes); the HTTP batcher's window path
agrees; backend auto picks it in bfloat16 and falls back to ONNX Runtime fp32 when OpenVINO
fails; a margin no path can honour is refused; OpenVINO bf16 itself on the tiny scorers' exports
(where the CPU has bf16)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mhmla_fast.aes.data import SCORE_RANGES
from mhmla_fast.aes.scoring import combine_windows, near_boundary

# ------------------------------------------------------------------------------ the rule


def _brute_changes(mean: np.ndarray, prompt: int, objective: str, decision: str,
                   margin: float, rng, tries: int = 200) -> bool:
    """Whether some move of every output by less than ``margin`` changes the score (random
    moves and, per output, the corners +-0.999 margin)."""
    want = combine_windows(mean[None], [0], prompt, objective, decision, n_essays=1)[0]
    shape = np.shape(mean)
    moves = [rng.uniform(-1, 1, size=shape) for _ in range(tries)]
    moves += [np.sign(rng.uniform(-1, 1, size=shape)) for _ in range(tries)]
    if shape:  # classification: also the move that lifts one class and lowers the others
        for k in range(shape[0]):
            lift = -np.ones(shape)
            lift[k] = 1
            moves.append(lift)
    else:
        moves += [np.array(1.0), np.array(-1.0)]
    for move in moves:
        moved = np.clip(mean + 0.999 * margin * move, 0.0, None)
        if objective == "classification" and moved.sum() <= 0:
            continue
        got = combine_windows(np.asarray(moved)[None], [0], prompt, objective, decision,
                              n_essays=1)[0]
        if got != want:
            return True
    return False


@pytest.mark.parametrize("objective,decision", [("regression", "argmax"),
                                                ("classification", "argmax"),
                                                ("classification", "expected")])
def test_a_score_not_near_a_boundary_cannot_change_within_the_margin(objective, decision):
    rng = np.random.default_rng(5)
    near_seen = 0
    for prompt in (1, 3, 7, 8):
        lo, hi = SCORE_RANGES[prompt]
        C = hi - lo + 1
        n = 60
        if objective == "regression":
            means = rng.uniform(0, 1, size=n)
        else:
            means = rng.dirichlet(np.full(C, 0.3), size=n)
        margin = 0.004 if prompt == 8 else 0.02
        near = near_boundary(means, prompt, objective, decision, margin=margin)
        assert near.shape == (n,) and near.dtype == bool
        for mean, flag in zip(means, near):
            if not flag:
                assert not _brute_changes(mean, prompt, objective, decision, margin, rng), (
                    prompt, mean)
        near_seen += int(near.sum())
        # a zero margin: nothing is near; every essay is near with a margin past the spacing
        assert not near_boundary(means, prompt, objective, decision, margin=0).any()
    assert near_seen > 0


def test_regression_essays_on_a_boundary_are_near_and_the_rule_is_tight():
    lo, hi = SCORE_RANGES[1]  # 2..12
    at = (np.arange(lo, hi) + 0.5 - lo) / (hi - lo)  # every rounding boundary
    margin = 0.01
    assert near_boundary(at, 1, "regression", margin=margin).all()
    inside = at + 0.98 * margin * np.where(np.arange(len(at)) % 2, 1, -1)
    outside = at + 1.02 * margin * np.where(np.arange(len(at)) % 2, 1, -1)
    assert near_boundary(inside, 1, "regression", margin=margin).all()
    assert not near_boundary(outside, 1, "regression", margin=margin).any()
    rng = np.random.default_rng(0)
    for v in inside:  # each near one does change with some move within the margin
        assert _brute_changes(np.asarray(v), 1, "regression", "argmax", margin, rng)


def test_argmax_nearness_is_the_gap_of_the_two_largest():
    probs = np.array([[0.5, 0.3, 0.2, 0.0], [0.41, 0.39, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    assert near_boundary(probs, 3, "classification", "argmax",
                         margin=0.02).tolist() == [False, True, True]


def test_the_rule_refuses_what_it_cannot_judge():
    with pytest.raises(ValueError, match="margin"):
        near_boundary(np.zeros(2), 1, "regression", margin=-0.1)
    with pytest.raises(ValueError, match=r"expected \[n, 4\] probabilities"):
        near_boundary(np.zeros((2, 3)), 3, "classification", margin=0.1)
    with pytest.raises(ValueError, match="objective"):
        near_boundary(np.zeros(2), 1, "ranking", margin=0.1)
    with pytest.raises(ValueError, match="decision"):
        near_boundary(np.full((2, 4), 0.25), 3, "classification", "vote", margin=0.1)


# ------------------------------------------------------------------- the scorer, on fakes

pytest.importorskip("onnx", reason="the ONNX export needs onnx")
pytest.importorskip("onnxruntime", reason="the exact runner is ONNX Runtime")

from mhmla_fast.serve import export_cache, openvino_runner  # noqa: E402
from mhmla_fast.serve.score import load_scorer  # noqa: E402
from mhmla_fast.serve.score_onnx import (CHECK_FILE, VALIDATION_ESSAYS,  # noqa: E402
                                         CheckedScorer, OnnxScorer, export_scorer,
                                         read_check_margins, write_check_margins)
from export_cache_fixtures import Lines  # noqa: E402
from test_serve_score_onnx import cls_regression_scorer_dir, essays  # noqa: E402, F401


@pytest.fixture(scope="module")
def stack_scorer_dir(tiny_scorer_dir, tmp_path_factory):
    """A tiny scorer like the shipped one since 2026-12-07 (a ridge head on [CLS] vectors and
    token means, surface weights, cutpoints; all 8 prompts) on the tiny scorer's encoder."""
    import torch

    from mhmla_fast.aes.model import EssayScorer, ScorerConfig

    encoder = json.loads((tiny_scorer_dir / "config.json").read_text())["encoder_spec"]
    rng = np.random.default_rng(7)
    cuts = {p: tuple(lo + 0.5 + k for k in range(hi - lo)) for p, (lo, hi) in SCORE_RANGES.items()}
    cfg = ScorerConfig(encoder=encoder["name_or_path"], head_kind="ridge", pooling="cls+mean",
                       objective="regression", cutpoints=cuts,
                       surface_weights={p: tuple(rng.normal(0, 0.02, 9)) for p in cuts})
    torch.manual_seed(7)
    scorer = EssayScorer(cfg, backend="torch")
    with torch.no_grad():
        for layer in scorer.head.outputs.values():
            layer.weight.normal_(0, 0.3 / layer.weight.shape[1] ** 0.5)
            layer.bias.fill_(0.5)
    return scorer.save(tmp_path_factory.mktemp("tiny-stack") / "scorer",
                       tokenizer=EssayScorer.load(tiny_scorer_dir, device="cpu").tokenizer)


@pytest.fixture(scope="module")
def exports(tiny_scorer_dir, cls_regression_scorer_dir, stack_scorer_dir, tmp_path_factory):
    """The tiny classification scorer's export, the tiny [CLS] regression scorer's and the tiny
    ridge stack scorer's (its essays' surface term added before the check)."""
    root = tmp_path_factory.mktemp("checked-scorer")
    out = {}
    for name, model in (("classification", tiny_scorer_dir),
                        ("regression", cls_regression_scorer_dir), ("stack", stack_scorer_dir)):
        export_scorer(model, root / name, threads=1)
        out[name] = root / name
    return out


class Noisy:
    """A fast runner: the exact one's outputs moved by +-``error`` (a fixed pattern)."""

    def __init__(self, exact, error: float, seed: int = 0):
        self.exact, self.error, self.rng = exact, error, np.random.default_rng(seed)

    def __call__(self, ids, mask):
        out = self.exact(ids, mask)
        return (out + self.error * np.where(self.rng.uniform(size=out.shape) < 0.5, -1, 1)
                ).astype(np.float32)


class Recording:
    """A runner that keeps the rows it was given (their pieces, padding cut) and each batch's
    shape."""

    def __init__(self, runner):
        self.runner, self.rows, self.shapes = runner, [], []

    def __call__(self, ids, mask):
        self.rows += [tuple(int(t) for t in row[m > 0]) for row, m in zip(ids, mask)]
        self.shapes.append(tuple(ids.shape))
        return self.runner(ids, mask)


def _texts(n: int, seed: int):
    texts = essays(n, seed=seed) + list(VALIDATION_ESSAYS)
    return texts, [1 + k % 7 for k in range(len(texts))]


@pytest.mark.parametrize("kind", ["classification", "regression", "stack"])
def test_the_checked_scorer_gives_the_exact_runners_scores(exports, kind):
    """A fast runner off by 0.8 margin: every score is the exact runner's, only essays near a
    boundary (by the fast outputs) went through the exact runner, all their windows; the HTTP
    batcher's path agrees. With a margin below the fast runner's error, scores differ (the test
    can fail)."""
    export = exports[kind]
    exact_scorer = OnnxScorer(export, threads=1)
    texts, prompts = _texts(40, seed=11)
    want = exact_scorer.predict_scores(texts, prompts, token_budget=256)
    assert len(set(want.tolist())) > 3
    margin = 0.05
    exact = Recording(exact_scorer.runner)
    checked = CheckedScorer(export, Noisy(exact_scorer.runner, 0.8 * margin), exact,
                            margin=margin)
    got, outs = checked.predict_scores(texts, prompts, token_budget=256, return_outputs=True)
    assert got.tolist() == want.tolist()
    assert checked.essays == len(texts) and 0 < checked.rescored < len(texts)
    # the exact runner saw the windows of exactly the essays near a boundary, each once
    fast_only = CheckedScorer(export, Noisy(exact_scorer.runner, 0.8 * margin), None, margin=0)
    _, fast_outs = fast_only.predict_scores(texts, prompts, token_budget=256,
                                            return_outputs=True)
    cfg = checked.config
    near = [bool(near_boundary(np.asarray(o)[None], p, cfg.objective, cfg.decision,
                               margin=margin, cutpoints=cfg.cutpoints.get(p))[0])
            for o, p in zip(fast_outs, prompts)]
    plans = [checked.plan_essay(t, p) for t, p in zip(texts, prompts)]
    windows = sorted(tuple(plan.window_ids(w)) for plan, n in zip(plans, near) if n
                     for w in range(len(plan.windows)))
    assert sorted(exact.rows) == windows and sum(near) == checked.rescored
    # the HTTP batcher: fast windows in any batches, each essay finished (and checked) alone,
    # its windows re-scored in batches of the token budget score_windows was given
    pairs = [(plan, w) for plan in reversed(plans) for w in range(len(plan.windows))]
    budget = 2 * checked.config.window
    outs = dict(zip(((id(p), w) for p, w in pairs), checked.score_windows(pairs,
                                                                           token_budget=budget)))
    exact.shapes.clear()
    rescored = checked.rescored
    finished = [checked.finish_essay(p, [outs[id(p), w] for w in range(len(p.windows))])
                for p in plans]
    assert finished == want.tolist()
    assert all(b * t <= budget for b, t in exact.shapes)
    assert len(exact.shapes) > checked.rescored - rescored > 0  # an essay's windows split
    # the negative control: the fast runner alone, and a margin below its error, change scores
    assert fast_only.exact is None
    assert fast_only.predict_scores(texts, prompts, token_budget=256).tolist() != want.tolist()
    loose = CheckedScorer(export, Noisy(exact_scorer.runner, 4 * margin), exact_scorer.runner,
                          margin=margin / 4)
    assert loose.predict_scores(texts, prompts, token_budget=256).tolist() != want.tolist()
    with pytest.raises(ValueError, match="margin"):
        CheckedScorer(export, exact_scorer.runner, exact_scorer.runner, margin=1.0)
    *some, last = checked.config.prompts
    with pytest.raises(ValueError, match=rf"^margin: none for prompts \[{last}\]"):
        CheckedScorer(export, exact_scorer.runner, exact_scorer.runner,
                      margin={p: 0.1 for p in some})


def test_per_prompt_margins_rescore_each_prompt_at_its_own(exports):
    """A prompt with margin 0 is never re-scored (its essays keep the fast runner's scores);
    the others are checked at theirs."""
    export = exports["regression"]
    exact_scorer = OnnxScorer(export, threads=1)
    texts, prompts = _texts(40, seed=11)
    want = exact_scorer.predict_scores(texts, prompts, token_budget=256)
    margins = {p: 0.05 for p in range(1, 9)}
    margins[3] = 0.0
    exact = Recording(exact_scorer.runner)
    checked = CheckedScorer(export, Noisy(exact_scorer.runner, 0.04), exact, margin=margins)
    got = checked.predict_scores(texts, prompts, token_budget=256)
    other = [k for k, p in enumerate(prompts) if p != 3]
    assert got[other].tolist() == want[other].tolist() and checked.rescored > 0
    threes = {tuple(plan.window_ids(w)) for plan in (checked.plan_essay(t, p) for t, p in
                                                     zip(texts, prompts) if p == 3)
              for w in range(len(plan.windows))}
    assert threes and exact.rows and not threes & set(exact.rows)  # none went to exact


def test_the_margins_file_travels_with_the_export_and_sets_the_default(
        cls_regression_scorer_dir, tmp_path, monkeypatch):
    import shutil

    model = tmp_path / "scorer"
    shutil.copytree(cls_regression_scorer_dir, model)
    assert read_check_margins(model) == {}
    file = write_check_margins(model, {1: 0.004, 8: 0.002}, rule="test")
    assert file.name == CHECK_FILE and json.loads(file.read_text())["rule"] == "test"
    assert read_check_margins(model) == {1: 0.004, 8: 0.002}
    export_scorer(model, tmp_path / "export", threads=1)
    assert read_check_margins(tmp_path / "export") == {1: 0.004, 8: 0.002}
    # checked_scorer without a margin: the export's own, the default for the other prompts
    monkeypatch.setattr(openvino_runner, "OpenVinoRunner",
                        lambda path, **kw: OnnxScorer(tmp_path / "export", threads=1).runner)
    checked = openvino_runner.checked_scorer(tmp_path / "export", threads=1)
    assert checked.margins == {1: 0.004, **{p: openvino_runner.SCORE_CHECK_MARGIN
                                            for p in range(2, 8)}, 8: 0.002}
    assert openvino_runner.checked_scorer(tmp_path / "export", margin=0.03,
                                          threads=1).margins == dict.fromkeys(range(1, 9), 0.03)
    # a damaged file is refused by name, at export time too
    (model / CHECK_FILE).write_text('{"format": "something else", "margins": {}}')
    with pytest.raises(ValueError, match=f"{CHECK_FILE}: not a bf16 check file"):
        read_check_margins(model)
    with pytest.raises(ValueError, match=f"{CHECK_FILE}: not a bf16 check file"):
        export_scorer(model, tmp_path / "export2", threads=1)
    write_check_margins(model, {2: 1.5})
    with pytest.raises(ValueError, match=r"margins must lie in \[0, 1\)"):
        read_check_margins(model)


def test_auto_runs_the_checked_scorer_and_falls_back_to_onnx_runtime(exports, monkeypatch):
    """backend auto in bfloat16 on a scorer export: the checked scorer, at the margin asked
    for; when OpenVINO fails, ONNX Runtime fp32 with one line saying why; float32: ONNX
    Runtime."""
    export = exports["regression"]
    lines = Lines()
    made = []
    monkeypatch.setattr(openvino_runner, "checked_scorer",
                        lambda path, **kw: made.append((path, kw)) or "checked")
    got = export_cache.auto_scorer(export, torch=lambda: "torch", dtype="bfloat16", threads=1,
                                   check_margin=0.02, log=lines)
    assert got == "checked" and lines.lines == []
    assert made == [(export, dict(margin=0.02, threads=1, cache_dir=None))]  # a user's export

    def broken(path, **kw):
        raise RuntimeError("no AMX today")

    monkeypatch.setattr(openvino_runner, "checked_scorer", broken)
    got = export_cache.auto_scorer(export, torch=lambda: "torch", dtype="bfloat16", threads=1,
                                   log=lines)
    assert type(got) is OnnxScorer
    assert lines.lines == ["mhmla-fast: backend auto runs ONNX Runtime fp32: OpenVINO's "
                           "checked bf16 pass failed (RuntimeError: no AMX today)"]
    assert type(export_cache.auto_scorer(export, torch=lambda: "torch", threads=1)) is OnnxScorer


def test_load_scorer_picks_it_on_amx_and_refuses_a_margin_it_cannot_honour(
        exports, cls_regression_scorer_dir, monkeypatch):
    from mhmla_fast.serve import options

    monkeypatch.setattr(options.devices, "cuda_available", lambda backend="torch": False)
    monkeypatch.setattr(openvino_runner, "openvino_importable", lambda: True)
    monkeypatch.setattr(openvino_runner, "openvino_bf16_native", lambda: True)
    monkeypatch.delenv("MHMLA_NO_OPENVINO", raising=False)
    made = []
    monkeypatch.setattr(openvino_runner, "checked_scorer",
                        lambda path, **kw: made.append(kw) or "checked")
    assert load_scorer(exports["regression"], threads=1, check_margin=0.03) == "checked"
    assert made[-1]["margin"] == 0.03
    assert load_scorer(exports["regression"], threads=1) == "checked"
    assert made[-1]["margin"] is None  # the default, SCORE_CHECK_MARGIN
    assert type(load_scorer(exports["regression"], dtype="float32", threads=1)) is OnnxScorer
    with pytest.raises(ValueError, match=r"^check_margin: only the checked bf16 pass"):
        load_scorer(exports["regression"], dtype="float32", check_margin=0.03)
    with pytest.raises(ValueError, match=r"^check_margin: only the checked bf16 pass"):
        load_scorer(cls_regression_scorer_dir, backend="torch", check_margin=0.03)
    with pytest.raises(ValueError, match=r"^check_margin: expected 0 <= margin < 1"):
        load_scorer(exports["regression"], check_margin=1.5)
    # auto's torch (no cache): fp32's scores, never torch bf16 on the CPU
    torch_scorer = load_scorer(cls_regression_scorer_dir, cache=False)
    import torch

    assert next(torch_scorer.parameters()).dtype == torch.float32


def test_the_score_command_refuses_a_check_margin_it_cannot_honour(tmp_path, capsys):
    from mhmla_fast.commands import serve as cli

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "A short essay.", "prompt": 1}) + "\n")
    for extra in (["--dtype", "float32"], ["--backend", "torch"]):
        code = cli.main(["score", str(src), "-o", str(tmp_path / "s.jsonl"), "--check-margin",
                         "0.01", "--no-progress", *extra])
        assert code == 2
        assert "--check-margin: only the checked bf16 pass" in capsys.readouterr().err
    code = cli.main(["score", str(src), "-o", str(tmp_path / "r.jsonl"), "--check-margin",
                     "0.01", "--ray", "--no-progress"])
    assert code == 2
    assert "--check-margin applies to one process" in capsys.readouterr().err


# ------------------------------------------------------------------------ OpenVINO itself


@pytest.mark.parametrize("kind", ["classification", "regression"])
def test_openvino_bf16_checked_scores_are_onnx_runtimes(exports, kind):
    """The real fast runner: OpenVINO bf16 on the tiny scorers' exports, with a margin wide
    enough for their bf16 error (their output layers are scaled up), gives ONNX Runtime fp32's
    scores. Without a CPU with bf16, asking for it is refused by name."""
    ov = pytest.importorskip("openvino", reason="the fast runner is OpenVINO")
    from mhmla_fast.serve.openvino_runner import OpenVinoRunner, checked_scorer

    export = exports[kind]
    if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        with pytest.raises(ValueError, match=r"^dtype: 'bfloat16' with the openvino backend"):
            OpenVinoRunner(export / "model.onnx", dtype="bfloat16")
        pytest.skip("this CPU has no bf16 instructions for OpenVINO")
    texts, prompts = _texts(24, seed=3)
    want = OnnxScorer(export, threads=1).predict_scores(texts, prompts, token_budget=256)
    checked = checked_scorer(export, margin=0.2, threads=1)
    assert isinstance(checked, CheckedScorer) and checked.dtype == "bfloat16"
    got = checked.predict_scores(texts, prompts, token_budget=256)
    assert got.tolist() == want.tolist() and checked.rescored > 0
    assert checked_scorer(export, margin=0, threads=1).exact is None
