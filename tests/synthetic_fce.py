"""Synthetic FCE-format data for the tests (TOKEN<TAB>c|i lines, a blank line between
sentences)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path


def write_random_fce(path: Path, n: int, vocab: Sequence[str], seed: int) -> Path:
    """n sentences of 2-12 words drawn from ``vocab``, each labelled "i" with probability 0.2."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        for _ in range(rng.randint(2, 12)):
            lines.append(f"{rng.choice(vocab)}\t{'i' if rng.random() < 0.2 else 'c'}")
        lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return path


def write_agreement_fce(path: Path, n: int, seed: int, words: Sequence[str],
                        max_rest: int) -> Path:
    """n learnable sentences: subject, verb, 1..``max_rest`` filler ``words``, "."; "goes" after
    "they"/"we" and "go" after "he"/"she" are the errors."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        subj = rng.choice(["he", "she", "they", "we"])
        verb = rng.choice(["go", "goes"])
        err = (subj in ("he", "she")) == (verb == "go")
        rest = [rng.choice(words) for _ in range(rng.randint(1, max_rest))]
        toks = [(subj, 0), (verb, int(err))] + [(w, 0) for w in rest] + [(".", 0)]
        lines += [f"{w}\t{'i' if e else 'c'}" for w, e in toks] + [""]
    path.write_text("\n".join(lines) + "\n")
    return path
