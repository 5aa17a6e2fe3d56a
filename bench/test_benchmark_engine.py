"""pytest-benchmark of the tagging engine: ``pytest bench/ --benchmark-only``.

``mhmla_fast.serve.engine.Engine.load(backend="torch")`` (the shipped default tagger, on the
device present: CUDA in bf16 if there is one, else CPU in fp32, as the engine itself chooses)
tags a fixed list of 200 generated English sentences with ``tag_texts`` (word tokenisation,
word-piecing, batching and the network: the whole call a user makes). Model loading and one
warm-up call are outside the timed rounds. ``extra_info`` adds the engine's device and dtype,
the sentence and word counts and ``sentences_per_s_median`` / ``words_per_s_median``.
"""

from __future__ import annotations

import random

import pytest

N_SENTENCES = 200
SEED = 0

_SUBJECTS = ("I", "My sister", "The teacher", "Our neighbours", "He", "They", "The students", "My best friend",
             "The manager of the hotel", "Everybody in my class", "She", "We")
_VERBS = ("like", "likes", "want to visit", "has visited", "have seen", "is going to buy", "enjoyed",
          "didn't understand", "will recommend", "was looking for", "recommend", "goes to")
_OBJECTS = ("the new museum", "a cheap restaurant near the station", "informations about the course",
            "an interesting book", "the concert last weekend", "a house with a big garden", "the city centre",
            "their old friends", "a informations", "the film that everyone talks about", "London",
            "the results of the exam")
_TAILS = ("", "", "yesterday", "every summer", "because it is very interesting", "in the evening",
          "since two years", "with my family", "as soon as possible", "although it was raining",
          "when I was child", "for a long time")
_JOINERS = (", and", ", but", "; however,", " because", ". Then")


def make_sentences(count: int = N_SENTENCES, seed: int = SEED) -> list[str]:
    """``count`` English sentences built from fixed templates with a seeded generator: the same
    list on every run and machine. One to three clauses each (about 5 to 40 words), some with
    typical learner errors (agreement, "informations", "since two years", a missing article)."""
    rng = random.Random(seed)

    def clause() -> str:
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS), rng.choice(_TAILS)]
        return " ".join(w for w in words if w)

    out = []
    for _ in range(count):
        text = clause()
        for _ in range(rng.choice((0, 0, 1, 2))):
            joiner, more = rng.choice(_JOINERS), clause()
            if not more.startswith("I "):
                more = more[0].lower() + more[1:]
            text += f"{joiner} {more}"
        out.append(text[0].upper() + text[1:] + rng.choice((".", ".", ".", "!", "?")))
    return out


@pytest.fixture(scope="module")
def engine():
    from mhmla_fast.serve.engine import Engine

    return Engine.load(backend="torch")


def test_engine_tag_texts(benchmark, engine) -> None:
    from mhmla_fast.serve.tokenize import word_tokenize

    sentences = make_sentences()
    words = sum(len(word_tokenize(s)) for s in sentences)
    engine.tag_texts(sentences[:16])  # warm-up: first-call allocations, kernel selection
    runner = engine.runner
    benchmark.group = "engine tag_texts"
    benchmark.extra_info.update(model="default (shipped)", backend="torch",
                                engine_device=str(getattr(runner, "device", "?")),
                                engine_dtype=str(getattr(runner, "dtype", "?")),
                                sentences=len(sentences), words=words, token_budget=engine.token_budget)
    results = benchmark(engine.tag_texts, sentences)
    assert len(results) == len(sentences)
    assert all(len(r.labels) == len(r.tokens) > 0 for r in results)
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # None under --benchmark-disable
        median = stats.stats.median
        benchmark.extra_info["sentences_per_s_median"] = len(sentences) / median
        benchmark.extra_info["words_per_s_median"] = words / median
