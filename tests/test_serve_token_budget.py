"""The token budget's default per device (``options.default_token_budget``): the tagging
engine and the scorer take it from the device they run on, an explicit budget wins, and a
budget below 1 is refused."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mhmla_fast.serve import options
from mhmla_fast.serve.engine import Engine, default_tagger_path, load_tokenizer
from mhmla_fast.serve.score import score_essays, scorer_token_budget


class Runner:
    """P(error) 0.9 everywhere, on a named device."""

    def __init__(self, device):
        self.device = device
        self.shapes = []

    def __call__(self, input_ids, attention_mask):
        self.shapes.append(input_ids.shape)
        return np.full(input_ids.shape, 0.9, dtype=np.float32)


@pytest.fixture(scope="module")
def hf_tokenizer():
    return load_tokenizer(default_tagger_path())


@pytest.mark.parametrize("device, budget", [("cpu", 1024), ("cuda", 8192), ("cuda:1", 8192),
                                            (torch.device("cpu"), 1024),
                                            (torch.device("cuda", 0), 8192)])
def test_default_token_budget_by_device_type(device, budget):
    assert options.default_token_budget(device) == budget
    assert options.TOKEN_BUDGETS == {"cpu": 1024, "cuda": 8192}


@pytest.mark.parametrize("device, budget", [("cpu", 1024), ("cuda", 8192),
                                            (torch.device("cpu"), 1024)])
def test_engine_takes_its_runners_device_default(hf_tokenizer, device, budget):
    assert Engine(Runner(device), hf_tokenizer).token_budget == budget
    assert Engine(Runner(device), hf_tokenizer, token_budget=300).token_budget == 300
    with pytest.raises(ValueError, match="token_budget"):
        Engine(Runner(device), hf_tokenizer, token_budget=0)


def test_the_cpu_default_packs_passes_of_at_most_1024_pieces(hf_tokenizer):
    runner = Runner("cpu")
    sentences = [["word"] * n for n in range(1, 200)]
    tags = Engine(runner, hf_tokenizer).tag_tokens(sentences)
    assert [len(t.labels) for t in tags] == list(range(1, 200))
    assert len(runner.shapes) > 1 and all(b * t <= 1024 for b, t in runner.shapes)
    assert max(b * t for b, t in runner.shapes) > 512, "passes are filled up to the budget"


class FakeScorer:
    config = SimpleNamespace(prompts=(1, 2))  # (score_essays checks the prompts against it)

    def __init__(self, runner=None):
        if runner is not None:
            self.runner = runner
        self.budgets = []

    def predict_scores(self, texts, prompts, token_budget):
        self.budgets.append(token_budget)
        return [2] * len(texts)


def test_scorer_budget_follows_the_scorers_device():
    assert scorer_token_budget(FakeScorer(Runner("cpu"))) == 1024
    assert scorer_token_budget(FakeScorer(Runner("cuda:0"))) == 8192
    assert scorer_token_budget(FakeScorer()) == 1024, "no device: the CPU's"
    assert scorer_token_budget(torch.nn.Linear(2, 2)) == 1024, "a torch scorer's parameters"
    assert scorer_token_budget(FakeScorer(Runner("cuda")), 77) == 77
    scorer = FakeScorer(Runner("cpu"))
    assert score_essays(scorer, ["a b", "c"], [1, 2]) == [{"prompt": 1, "score": 2},
                                                         {"prompt": 2, "score": 2}]
    score_essays(scorer, ["a"], [1], token_budget=4096)
    assert scorer.budgets == [1024, 4096]
