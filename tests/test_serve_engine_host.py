"""The engine's host path, batched in numpy (issue 11): word-piecing a batch, packing rows,
merging each forward pass's probabilities and building results give, input by input, what a
plain per-sentence computation gives (independent code below), whatever the batch mixes:
short and long inputs, empty ones, words without pieces, runs of errors at input edges."""

from __future__ import annotations

import random

import sys

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
    assert engine.tag_tokens([("a", "tuple"), []])[0].tokens == ["a", "tuple"]
    for bad in (["a", ""], "abc", ["a", 3], [b"x"], 3, None, [None], Word("ab")):
        with pytest.raises(ValueError, match=r"sentences\[1\]"):
            engine.tag_tokens([["fine"], bad])


def test_bad_arguments_are_value_errors_naming_them(hf_tokenizer):
    """A lone surrogate failed the whole call with the word-piece tokenizer's TypeError,
    naming no input; None, a number or an iterator of sentences were TypeErrors (an iterator
    was used up by the check, then failed); plan_text/plan_tokens checked nothing (a str was
    planned letter by letter, an empty word accepted)."""
    engine = Engine(HashRunner(), hf_tokenizer)
    cases = [
        (lambda: engine.tag_texts(["fine", "I has a cat \ud83d ."]),
         r"texts\[1\]: holds a lone surrogate U\+D83D"),
        (lambda: engine.tag_tokens([["ok"], ["I", "\udc80"]]),
         r"sentences\[1\]: holds a lone surrogate U\+DC80"),
        (lambda: engine.plan_text("x \udc80"), r"^text: holds a lone surrogate"),
        (lambda: engine.plan_tokens(["x", "\ud800"]), r"^words: holds a lone surrogate"),
        (lambda: engine.tag_texts(None), r"texts: expected a sequence of strings, got NoneType"),
        (lambda: engine.tag_texts(5), "got int"),
        (lambda: engine.tag_tokens(None), "sentences: expected a list of sentences"),
        (lambda: engine.tag_tokens([iter(["I", "has"])]), r"sentences\[0\]"),
        (lambda: engine.plan_tokens("hello"), "words: expected a list of non-empty strings"),
        (lambda: engine.plan_tokens(["a", ""]), "words: expected a list of non-empty strings"),
        (lambda: engine.plan_tokens([None]), "words: expected"),
        (lambda: engine.plan_text(None), "give text or words"),
        (lambda: engine.plan_text(b"hi"), "text: expected a string, got bytes"),
        (lambda: engine.plan_steps(text="a", words=["a"]), "not both or neither"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    # an iterator of sentences is read once, and tagged like the list
    want = engine.tag_tokens([["I", "has"], ["a", "cat"]])
    got = engine.tag_tokens(iter([["I", "has"], ["a", "cat"]]))
    assert [r.to_dict() for r in got] == [r.to_dict() for r in want]
    assert engine.plan_tokens(("a", "cat")).tokens == ["a", "cat"]


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


# ------------------------------------------------------------------ CUDA-graph passes


def test_graph_shapes_bucket_rows_and_pieces():
    from mhmla_fast.serve.runners import GRAPH_PIECES, GRAPH_ROWS, graph_shape

    assert graph_shape(1, 1) == (GRAPH_ROWS[0], GRAPH_PIECES)
    assert graph_shape(9, 17) == (16, 32)
    assert graph_shape(256, 128) == (256, 128)
    assert graph_shape(257, 129) == (512, 144)  # past the last row bucket: its multiples
    for rows in range(1, 600, 7):
        for pieces in range(1, 520, 11):
            B, T = graph_shape(rows, pieces)
            assert B >= rows and T >= pieces and T % GRAPH_PIECES == 0 and T - pieces < GRAPH_PIECES
            assert B in GRAPH_ROWS or B % GRAPH_ROWS[-1] == 0
    with pytest.raises(ValueError, match="non-empty"):
        graph_shape(0, 5)


def test_padding_to_a_graph_shape_leaves_the_real_positions_unchanged(tiny_tagger_dir):
    """The premise of CUDA-graph passes, on the CPU in float32: the padded pass's probabilities
    at the real positions are the unpadded pass's (masked columns and filler rows change
    nothing there)."""
    import torch

    from mhmla_fast.serve.runners import TorchRunner, graph_shape, pad_to_shape

    runner = TorchRunner(tiny_tagger_dir, device="cpu", kernels="torch", fold=False)
    rng = np.random.default_rng(3)
    ids = rng.integers(1000, 2000, size=(5, 11)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[2, 7:] = 0
    mask[4, 3:] = 0
    shape = graph_shape(*ids.shape)
    ids_p, mask_p = pad_to_shape(ids, mask, shape)
    assert ids_p.shape == mask_p.shape == shape == (8, 16)
    assert (mask_p[5:, 0] == 1).all() and mask_p[5:, 1:].sum() == 0 and mask_p[:5, 11:].sum() == 0
    with torch.inference_mode():
        want = runner._probs(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
        got = runner._probs(torch.from_numpy(ids_p), torch.from_numpy(mask_p)).numpy()
    real = mask.astype(bool)
    np.testing.assert_allclose(got[:5, :11][real], want[real], rtol=0, atol=2e-6)


def _fake_cuda(monkeypatch):
    """CUDA's graph API stood in for on the CPU: a "graph" records the function called while it
    captures and its replay calls it again on the static inputs, writing into the captured
    output (as a replay does); pinned buffers and downloads are plain copies."""
    import contextlib

    import torch

    from mhmla_fast.serve import runners

    capturing: list = []

    class Graph:
        def __init__(self):
            self.fn = self.args = self.out = None

        def replay(self):
            self.out.copy_(self.fn(*self.args))

    @contextlib.contextmanager
    def graph(g, pool=None):
        capturing.append(g)
        try:
            yield
        finally:
            capturing.pop()

    class Stream:
        def __init__(self, *a):
            pass

        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(runners, "pinned", lambda a: torch.from_numpy(a))
    monkeypatch.setattr(runners, "download",
                        lambda t: runners.Pending(t.detach().clone().numpy()))
    return capturing


def test_captured_passes_replay_one_graph_per_shape_with_the_eager_results(monkeypatch,
                                                                           tiny_tagger_dir):
    """CapturedForward with the CUDA graph API stood in for: one capture per padded shape, each
    preceded by one uncaptured warm-up call; every later pass of that shape replays it; the
    results are the eager pass's at the real positions, however passes of one shape follow
    each other (a replay overwrites the static output only after the earlier pass's copy)."""
    import torch

    from mhmla_fast.serve.runners import CapturedForward, TorchRunner

    capturing = _fake_cuda(monkeypatch)
    runner = TorchRunner(tiny_tagger_dir, device="cpu", kernels="torch", fold=False)
    calls = []

    def fn(ids, mask):
        calls.append(("captured" if capturing else "eager", tuple(ids.shape)))
        out = runner._probs(ids, mask)
        if capturing:
            capturing[-1].fn, capturing[-1].args, capturing[-1].out = runner._probs, (ids, mask), out
        return out

    captured = CapturedForward(fn, "cpu")
    rng = np.random.default_rng(5)
    shapes = [(3, 9), (5, 14), (3, 16), (12, 9), (2, 5), (16, 30)]
    with torch.inference_mode():
        jobs, wants = [], []
        for B, T in shapes:
            ids = rng.integers(1000, 2000, size=(B, T)).astype(np.int64)
            mask = (np.arange(T) < rng.integers(1, T + 1, size=B)[:, None]).astype(np.int64)
            jobs.append((captured.submit(ids, mask), mask))
            wants.append(runner._probs(torch.from_numpy(ids), torch.from_numpy(mask)).numpy())
    for (job, mask), want in zip(jobs, wants):
        got = job.result()
        assert got.shape == want.shape
        real = mask.astype(bool)
        np.testing.assert_allclose(got[real], want[real], rtol=0, atol=2e-6)
    # (3, 9), (5, 14), (3, 16) share (8, 16); (12, 9) and (16, 30) pad to (16, 16) and (16, 32)
    assert captured.captures == 3
    assert [c for c in calls if c[0] == "captured"] == [("captured", (8, 16)), ("captured", (16, 16)),
                                                         ("captured", (16, 32))]
    assert len([c for c in calls if c[0] == "eager"]) == 3  # one warm-up per capture


def test_a_failed_capture_names_the_option(monkeypatch):
    from mhmla_fast.serve.runners import CapturedForward

    capturing = _fake_cuda(monkeypatch)

    def fn(ids, mask):
        if capturing:
            raise RuntimeError("operation not permitted when stream is capturing")
        return ids.float()

    with pytest.raises(RuntimeError, match=r"cuda_graphs: .* could not be captured .* "
                                           r"operation not permitted"):
        CapturedForward(fn, "cpu").submit(np.ones((2, 3), np.int64), np.ones((2, 3), np.int64))


@pytest.mark.skipif(not __import__("torch").cuda.is_available(),
                    reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_cuda_graph_passes_tag_as_the_eager_passes_do(tiny_tagger_dir, kernels):
    """On a GPU: the engine with its passes replayed from CUDA graphs gives the eager engine's
    word probabilities (float32; other kernels may run at the padded shapes), over calls of
    many lengths, and captures each padded shape once."""
    from mhmla_fast.serve.engine import Engine

    rng = np.random.default_rng(11)
    words = ["the", "cat", "sat", "on", "a", "mat", "unbelievably", "xylophones", ","]
    sentences = [[words[k] for k in rng.integers(0, len(words), size=n)]
                 for n in rng.integers(1, 40, size=300)]
    eager = Engine.load(tiny_tagger_dir, backend="torch", device="cuda", dtype="float32",
                        kernels=kernels, token_budget=2048, max_batch=64)
    graphs = Engine.load(tiny_tagger_dir, backend="torch", device="cuda", dtype="float32",
                         kernels=kernels, token_budget=2048, max_batch=64, cuda_graphs=True)
    want = eager.word_probs(sentences)
    for _ in range(2):  # the second call replays only
        got = graphs.word_probs(sentences)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-4)
    first = graphs.runner.captured.captures
    assert 0 < first <= 4 * 4  # rows 8..64 x pieces 16..64 (the tiny encoder's 64 positions)
    graphs.word_probs(sentences)
    assert graphs.runner.captured.captures == first


@pytest.mark.skipif(sys.version_info < (3, 11), reason="instance dicts are built lazily from 3.11")
def test_a_tag_result_builds_no_instance_dict():
    """The offsets descriptor stores through an ordinary attribute: reading ``obj.__dict__``
    would make CPython build a dict object per result (64 bytes more of a 3-word result, and
    one more container for the garbage collector), at construction, at to_dict and at the
    first read of the offsets."""
    import gc

    from mhmla_fast.serve.engine import TagResult

    r = TagResult(["a", "b"], ["c", "i"], [0.1, 0.9], np.array([[0, 1], [2, 3]]), [])
    r.to_dict()
    assert r.offsets == [(0, 1), (2, 3)]
    assert not any(type(o) is dict for o in gc.get_referents(r))


def test_probabilities_round_as_pythons_round_and_in_bulk_as_one_by_one():
    """round_probs (numpy, vectorised) equals round(p, 6) on float32 probabilities, ties and
    tiny values included, and result_dicts (all results' probabilities rounded at once)
    equals to_dict result by result."""
    from mhmla_fast.serve.engine import TagResult, result_dicts, round_probs

    rng = np.random.default_rng(7)
    p32 = np.concatenate([rng.random(200_000, dtype=np.float32),
                          rng.random(1000, dtype=np.float32) ** 30,  # down to 1e-30
                          # values whose 7th decimal is a 5, exactly or nearly
                          (np.arange(1, 2000) / 1e6 + 5e-7).astype(np.float32),
                          np.array([0.0, 1.0, 0.5, 2.5e-7, 1.5e-6], dtype=np.float32)])
    values = p32.tolist()  # what the engine's results hold: float32 values as Python floats
    assert round_probs(values) == [round(v, 6) for v in values]
    results = [TagResult(["a"] * n, ["c"] * n, values[k:k + n], None, [])
               for k, n in zip(range(0, 60, 10), (3, 0, 7, 1, 10, 2))]
    assert result_dicts(results) == [r.to_dict() for r in results]
    assert result_dicts([]) == []


def test_tag_result_offsets_given_as_an_array_read_as_tuples():
    """The host workers hand offsets over as an int [n, 2] array: the result reads them as the
    list of (start, end) tuples a tuple-built result has, compares equal to it, and gives the
    same dict (plain ints, JSON-ready) without making the tuples."""
    import json

    from mhmla_fast.serve.engine import TagResult

    args = (["He", "go", "."], ["c", "i", "c"], [0.1, 0.9, 0.2])
    spans = [{"start": 3, "end": 5, "text": "go"}]
    listed = TagResult(*args, [(0, 2), (3, 5), (6, 7)], spans)
    arrayed = TagResult(*args, np.array([[0, 2], [3, 5], [6, 7]], dtype=np.int64), spans)
    assert arrayed.to_dict() == listed.to_dict()
    assert json.dumps(arrayed.to_dict()) == json.dumps(listed.to_dict())
    assert isinstance(arrayed._offsets, np.ndarray)  # to_dict read the array itself
    assert arrayed == listed and repr(arrayed) == repr(listed)
    assert arrayed.offsets == [(0, 2), (3, 5), (6, 7)]
    assert all(type(v) is int for o in arrayed.offsets for v in o)
    assert arrayed != TagResult(*args, [(0, 2), (3, 5), (6, 8)], spans)
    assert TagResult(*args, None, []).to_dict().keys() == {"tokens", "labels", "probs", "spans"}
    import copy
    import pickle

    fresh = TagResult(*args, np.array([[0, 2], [3, 5], [6, 7]]), spans)
    assert pickle.loads(pickle.dumps(fresh)) == listed == copy.deepcopy(fresh)
    import dataclasses  # still a dataclass: asdict, replace and fields work as before

    fresh = TagResult(*args, np.array([[0, 2], [3, 5], [6, 7]]), spans)
    assert dataclasses.asdict(fresh) == dataclasses.asdict(listed)
    assert dataclasses.asdict(fresh)["offsets"] == [(0, 2), (3, 5), (6, 7)]
    assert [f.name for f in dataclasses.fields(TagResult)] == [
        "tokens", "labels", "probs", "offsets", "spans"]
    assert dataclasses.replace(listed, spans=[]).spans == [] and listed.spans == spans
    with pytest.raises(TypeError):  # every field is still required
        TagResult(*args, None)


def test_host_worker_results_equal_the_engines_own_with_plain_int_spans(hf_tokenizer):
    """With host workers (offsets as arrays) the results, compared as objects, equal the
    engine's own, and character spans hold plain ints."""
    from mhmla_fast.serve import hostpool

    rng = random.Random(5)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
             for _ in range(2 * hostpool.CHUNK + 3)]
    runner = HashRunner()
    own = Engine(runner, hf_tokenizer, threshold=0.5)
    pooled = Engine(runner, hf_tokenizer, threshold=0.5, host_workers=1)
    try:
        got, want = pooled.tag_texts(texts), own.tag_texts(texts)
    finally:
        pooled.close()
    assert isinstance(got[0]._offsets, np.ndarray)  # the workers' form
    assert got == want and any(r.spans for r in got)
    assert all(type(v) is int for r in got for s in r.spans for v in (s["start"], s["end"]))
