"""The engine's host path, batched in numpy (issue 11): word-piecing a batch, packing rows,
merging each forward pass's probabilities and building results give, input by input, what a
plain per-sentence computation gives (independent code below), whatever the batch mixes:
short and long inputs, empty ones, words without pieces, runs of errors at input edges."""

from __future__ import annotations

import random

import numpy as np
import pytest

from mhmla_fast.serve.engine import Engine, default_tagger_path, encode_words, load_tokenizer
from mhmla_fast.serve.pieces import WordPieces

WORDS = ("the a cat dog house school every day he she go goes went because although happily "
         "café naïve don't John's well-known 3.14 !? … internationalisation , . ; :").split()
NO_PIECES = "\u00ad"  # a soft hyphen alone: the word-piece tokenizer gives nothing


class HashRunner:
    """P(error) from each piece's id and position only, so every row's result is its own."""

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        T = input_ids.shape[1]
        return (((input_ids * 2654435761 + np.arange(T)[None] * 97) % 1000) / 1000.0
                ).astype(np.float32) * attention_mask


@pytest.fixture(scope="module")
def hf_tokenizer():
    return load_tokenizer(default_tagger_path())


def sentences(n: int, seed: int = 0, max_words: int = 40) -> list[list[str]]:
    rng = random.Random(seed)
    pool = [*WORDS, NO_PIECES]
    return [[rng.choice(pool) for _ in range(rng.randint(1, max_words))] for _ in range(n)]


def reference_tags(hf_tokenizer, words: list[str], threshold: float) -> tuple[list, list, list]:
    """Labels, probabilities and token spans of one sentence that fits the encoder, tagged alone
    through the Hugging Face tokenizer: pieceless words become [UNK], each word's probability is
    its first piece's, spans are runs of "i" found by a plain loop."""
    unk = hf_tokenizer.unk_token
    fixed = [w if hf_tokenizer(w, add_special_tokens=False)["input_ids"] else unk for w in words]
    enc = hf_tokenizer(fixed, is_split_into_words=True, add_special_tokens=False)
    ids = [hf_tokenizer.cls_token_id, *enc["input_ids"], hf_tokenizer.sep_token_id]
    out = HashRunner()(np.asarray([ids]), np.ones((1, len(ids)), dtype=np.int64))[0]
    wids = enc.word_ids()
    probs = [float(out[q + 1]) for q, w in enumerate(wids) if q == 0 or wids[q - 1] != w]
    labels = ["i" if np.float32(p) >= np.float32(threshold) else "c" for p in probs]
    spans, k = [], 0
    while k < len(labels):
        if labels[k] == "i":
            e = k
            while e < len(labels) and labels[e] == "i":
                e += 1
            spans.append({"start": k, "end": e})
            k = e
        else:
            k += 1
    return labels, probs, spans


def test_batched_word_piecing_equals_one_sentence_at_a_time(hf_tokenizer):
    pieces = WordPieces.from_hf(hf_tokenizer)
    batch = sentences(300, seed=1)
    assert any(NO_PIECES in s for s in batch)
    together = encode_words(pieces.pieces, pieces.unk, batch)
    for words, (ids, first) in zip(batch, together):
        (ids1, first1), = encode_words(pieces.pieces, pieces.unk, [words])
        assert ids.dtype == np.int32 and first.dtype == np.int64
        np.testing.assert_array_equal(ids, ids1)
        np.testing.assert_array_equal(first, first1)
        assert sorted(first[first >= 0].tolist()) == list(range(len(words)))  # each word once
    assert encode_words(pieces.pieces, pieces.unk, []) == []


@pytest.mark.parametrize("threshold", [0.5, 0.376, 0.0])
def test_tag_tokens_equals_an_independent_per_sentence_reference(hf_tokenizer, threshold):
    batch = sentences(200, seed=2)
    engine = Engine(HashRunner(), hf_tokenizer, threshold=threshold, token_budget=2048,
                    max_batch=16)
    results = engine.tag_tokens(batch)
    assert len(results) == len(batch)
    for words, res in zip(batch, results):
        labels, probs, spans = reference_tags(hf_tokenizer, words, threshold)
        assert res.tokens == words and res.labels == labels and res.spans == spans
        assert res.probs == probs and res.offsets is None
    if threshold == 0.0:  # every word an error: one span per sentence, never across sentences
        assert all(r.spans == [{"start": 0, "end": len(r.tokens)}] for r in results)


@pytest.mark.parametrize("max_pieces, long_window", [(512, 254), (24, 8)])
def test_a_mixed_batch_tags_each_input_as_if_alone(hf_tokenizer, max_pieces, long_window):
    """Short and long inputs, empty ones, in one call, packed into many passes: the same
    result per input as a call with that input alone (so batching, the one-gather merge of
    whole rows and the window merge of long inputs never mix inputs)."""
    batch = sentences(60, seed=3, max_words=12) + sentences(6, seed=4, max_words=120)
    batch[5:5], batch[20:20] = [[]], [[], []]
    random.Random(5).shuffle(batch)
    texts = [" ".join(s) for s in batch]
    for threshold in (0.5, 0.0):
        engine = Engine(HashRunner(), hf_tokenizer, threshold=threshold, max_pieces=max_pieces,
                        long_window=long_window, token_budget=512, max_batch=8)
        pieces = []
        tokens = engine.tag_tokens(batch, on_pieces=pieces.append)
        assert sum(pieces) == sum(b - a for ids, _ in engine._encode(batch)  # windows'
                                  for a, b in engine.window_spans(len(ids)))
        for words, res in zip(batch, tokens):
            alone, = engine.tag_tokens([words])
            assert res.to_dict() == alone.to_dict() and res.probs == alone.probs
        for text, res in zip(texts, engine.tag_texts(texts)):
            alone, = engine.tag_texts([text])
            assert res.to_dict() == alone.to_dict()
            for span in res.spans:
                assert span["text"] == text[span["start"]:span["end"]]
        if threshold == 0.0:
            assert [r.spans for r in tokens] == [
                [{"start": 0, "end": len(w)}] if w else [] for w in batch]


def test_tag_tokens_still_refuses_bad_words(hf_tokenizer):
    engine = Engine(HashRunner(), hf_tokenizer)

    class Word(str):
        pass

    assert engine.tag_tokens([[Word("hello"), "there"]])[0].tokens == ["hello", "there"]
    for bad in (["a", ""], "abc", ["a", 3], [b"x"]):
        with pytest.raises(ValueError, match=r"sentences\[1\]"):
            engine.tag_tokens([["fine"], bad])


def test_tagging_pauses_the_cyclic_gc_and_restores_it(hf_tokenizer):
    import gc

    seen = []

    class Spy(HashRunner):
        def __call__(self, input_ids, attention_mask):
            seen.append(gc.isenabled())
            return super().__call__(input_ids, attention_mask)

    engine = Engine(Spy(), hf_tokenizer)
    was = gc.isenabled()
    try:
        gc.enable()
        engine.tag_texts(["He go to school ."])
        assert seen == [False] and gc.isenabled()
        with pytest.raises(ValueError):
            engine.tag_tokens([["fine"], [""]])
        assert gc.isenabled()
        gc.disable()
        engine.tag_tokens([["He", "go"]])
        assert seen == [False, False] and not gc.isenabled()  # left off, as the caller had it
    finally:
        (gc.enable if was else gc.disable)()


def test_passes_are_pipelined_one_deep_with_the_same_results(hf_tokenizer):
    """With a runner that has ``submit`` (torch on CUDA returns at once), pass k + 1 is packed
    and submitted before pass k's probabilities are taken and merged; the results are those of
    the plain runner."""
    log = []

    class Deferred(HashRunner):
        def submit(self, input_ids, attention_mask):
            k = sum(1 for e in log if e[0] == "submit")
            log.append(("submit", k))
            runner = self

            class Job:
                def result(self):
                    log.append(("result", k))
                    return HashRunner.__call__(runner, input_ids, attention_mask)

            return Job()

    batch = sentences(120, seed=6)
    kw = dict(token_budget=256, max_batch=8)
    got = Engine(Deferred(), hf_tokenizer, **kw).tag_tokens(batch)
    want = Engine(HashRunner(), hf_tokenizer, **kw).tag_tokens(batch)
    assert [r.to_dict() for r in got] == [r.to_dict() for r in want]
    passes = sum(1 for e in log if e[0] == "submit")
    assert passes > 5
    for k in range(passes - 1):  # pass k+1 went out before pass k came back
        assert log.index(("submit", k + 1)) < log.index(("result", k))
    assert log[-1] == ("result", passes - 1)


def test_torch_runner_submit_gives_its_call_result(tiny_tagger_dir):
    from mhmla_fast.serve.runners import TorchRunner

    runner = TorchRunner(tiny_tagger_dir, device="cpu")
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 2000, size=(3, 9)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, 6:] = 0
    job = runner.submit(ids, mask)
    out = job.result()
    assert out.dtype == np.float32 and out.shape == (3, 9)
    np.testing.assert_array_equal(out, runner(ids, mask))


def test_word_cache_equals_the_tokenizer_on_every_sentence(hf_tokenizer):
    """Word-piecing by distinct word gives encode_words' pieces (the tokenizer over whole
    sentences), with cold and warm caches, across a restart at max_words, for odd words too
    (no pieces, special tokens' texts, invisible and combining characters)."""
    from mhmla_fast.serve.pieces import WordCache

    pieces = WordPieces.from_hf(hf_tokenizer)
    rng = random.Random(8)
    odd = [NO_PIECES, "\u200d", "\ufeff", "[UNK]", "[CLS]", "[MASK]", "a\u0301", "ﬁ", "日本", "😀"]
    batch = sentences(300, seed=9) + [[rng.choice(odd + WORDS) for _ in range(rng.randint(1, 9))]
                                      for _ in range(300)] + [[], ["x"]]
    want = encode_words(pieces.pieces, pieces.unk, batch)
    cache = WordCache(pieces.pieces, pieces.unk, max_words=40)
    for rep in range(2):
        for a in range(0, len(batch), 25):  # small calls: the cache restarts past 40 words
            got = cache.encode(batch[a:a + 25])
            for (ids, first), (ids1, first1) in zip(got, want[a:a + 25]):
                assert ids.dtype == np.int32 and first.dtype == np.int64
                np.testing.assert_array_equal(ids, ids1)
                np.testing.assert_array_equal(first, first1)
    assert 0 < len(cache) <= 40 + 25 * 9
    whole = WordCache(pieces.pieces, pieces.unk).encode(batch)
    assert all(np.array_equal(g[0], w[0]) and np.array_equal(g[1], w[1])
               for g, w in zip(whole, want))
