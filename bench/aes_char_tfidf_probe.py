"""Probe: does TF-IDF of character n-grams (which see spelling) add to the AES stack?

``tfidf-char-ridge-cuts``: ``tfidf-ridge-cuts`` of the CPU protocol with scikit-learn's
``TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 5), min_df=2, sublinear_tf=True)`` in
place of word 1-2 grams (fitted on each training split, and on each inner fold's training
essays for the out-of-fold predictions its cutpoints are fitted on), by a rule written before
its units ran (``RULE``): it joins MiniLM's ten-member stack if the stack's mean dev QWK rises;
and (``SWAP_RULE``) it replaces the word TF-IDF member there if that stack's dev QWK is higher.

    python bench/aes_char_tfidf_probe.py units --run runs/char-run --cache-dir runs/aes-cache
    python bench/aes_char_tfidf_probe.py report --run runs/char-run --units runs/aes-cpu/units \\
        --ensembles runs/char-ens --out bench/results/aes_char_tfidf_probe_2026-12-07.json

A probe, not a model of the protocol (it is not in ``mhmla_fast.aes.registry``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aes_sentence_probe import TEN, paired, stack_cells, unit_cells  # noqa: E402

RULE = (
    "Rule written 2026-12-07 before any character n-gram unit was computed. Candidate C: "
    "tfidf-char-ridge-cuts: TF-IDF of character 2-5 grams within word boundaries (scikit-learn "
    "analyzer 'char_wb', sublinear tf, min_df 2, fitted on each training split and on each "
    "inner fold's training essays for the out-of-fold predictions), ridge on normalised "
    "scores, alpha by dev QWK of the cut scores from tfidf-ridge-cuts' grid, cut at cutpoints "
    "fitted on out-of-fold training predictions. Decision: C joins MiniLM's ten-member stack "
    "(79.73 test) if the stack's mean dev QWK over the 40 cells rises (> 0). Test QWK is "
    "reported whatever it is, with a paired test over the 40 cells. The shipped scorer is not "
    "changed by this probe.")
SWAP_RULE = (
    "Rule written 2026-12-07 after the stack with C added had been read and before the swapped "
    "stack was computed: the ten-member MiniLM stack with tfidf-char-ridge-cuts in place of "
    "tfidf-ridge-cuts replaces the ten as MiniLM's stack if its mean dev QWK over the 40 cells "
    "is above the ten's (79.735). Test is reported whatever it is.")
C = "tfidf-char-ridge-cuts"
CHAR_TFIDF = dict(analyzer="char_wb", ngram_range=(2, 5), min_df=2, sublinear_tf=True)


def units(run: Path, cache_dir: Path) -> None:
    """The candidate as units of the CPU protocol in ``run/units`` (the protocol's own
    ``tfidf-ridge-cuts`` code with the vectoriser's settings replaced)."""
    import sklearn.feature_extraction.text as text

    from mhmla_fast.aes import protocol
    from mhmla_fast.aes.registry import MODELS, ModelSpec

    words = text.TfidfVectorizer

    class CharTfidf(words):
        def __init__(self, **_word_settings):
            super().__init__(**CHAR_TFIDF)

    MODELS[C] = ModelSpec("tfidf", "probe: " + C, cuts=True)
    text.TfidfVectorizer = CharTfidf
    try:
        protocol.run_cpu_protocol(cache_dir=cache_dir, run_dir=run, models=[C],
                                  results=run / "results.json")
    finally:
        text.TfidfVectorizer = words


def report(run: Path, units_dir: Path, ens: Path, out: Path) -> None:
    """The stacks of the ten with and without the candidate, the decision, the figures."""
    from mhmla_fast.provenance import provenance

    ens.mkdir(parents=True, exist_ok=True)
    ten = ",".join(f"minilm/{m}" for m in TEN)
    stacks = {}
    swap = ten.replace("minilm/tfidf-ridge-cuts", f"char/{C}")
    for name, members in (("ten", ten), ("ten+C", f"{ten},char/{C}"), ("ten-word+C", swap)):
        path = ens / f"{name}.json"
        subprocess.run([sys.executable, str(Path(__file__).with_name("aes_ensemble.py")),
                        "--units", f"minilm={units_dir}", f"char={run / 'units'}", "--fold",
                        "all", "--members", members, "--out", str(path)], check=True,
                       stdout=subprocess.DEVNULL)
        stacks[name] = stack_cells(path)
    keys = sorted(stacks["ten"])
    arr = {n: np.array([s[k] for k in keys]) for n, s in stacks.items()}
    rise = float(arr["ten+C"][:, 0].mean() * 100 - arr["ten"][:, 0].mean() * 100)
    alone = unit_cells(run / "units", C)
    word = unit_cells(units_dir, "tfidf-ridge-cuts")
    k = sorted(alone)
    x, y = np.array([alone[c] for c in k]), np.array([word[c] for c in k])
    result = {
        "what": "TF-IDF of character 2-5 grams as an AES stack member (a probe)", "rule": RULE,
        "vectoriser": {**CHAR_TFIDF, "ngram_range": list(CHAR_TFIDF["ngram_range"])},
        "dev_rise_of_stack": rise, "decision": {"joins": rise > 0},
        "stacks": {n: {"mean_dev_qwk": float(a[:, 0].mean() * 100),
                       "mean_test_qwk": float(a[:, 1].mean() * 100)} for n, a in arr.items()},
        "test_vs_ten": paired(arr["ten+C"][:, 1], arr["ten"][:, 1]),
        "swap": {"rule": SWAP_RULE, "replaces": bool(arr["ten-word+C"][:, 0].mean()
                                                     > arr["ten"][:, 0].mean()),
                 "test_vs_ten": paired(arr["ten-word+C"][:, 1], arr["ten"][:, 1])},
        "alone": {"mean_dev_qwk": float(x[:, 0].mean() * 100),
                  "mean_test_qwk": float(x[:, 1].mean() * 100), "cells": len(k),
                  "word_tfidf_mean_test_qwk": float(y[:, 1].mean() * 100),
                  "test_vs_tfidf-ridge-cuts": paired(x[:, 1], y[:, 1])},
        "seconds_units": float(sum(json.loads(f.read_text())["seconds"]
                                   for f in (run / "units").glob(f"{C}-fold*.json"))),
        "commands": [f"python bench/aes_char_tfidf_probe.py {c}" for c in (
            f"units --run {run} --cache-dir runs/aes-cache",
            f"report --run {run} --units {units_dir} --ensembles {ens} --out {out}")],
        "provenance": provenance(),
    }
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("dev_rise_of_stack", "decision", "stacks", "swap")},
                     indent=1))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    u = sub.add_parser("units")
    u.add_argument("--run", type=Path, required=True)
    u.add_argument("--cache-dir", type=Path, required=True)
    r = sub.add_parser("report")
    r.add_argument("--run", type=Path, required=True)
    r.add_argument("--units", type=Path, required=True)
    r.add_argument("--ensembles", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    if a.step == "units":
        units(a.run, a.cache_dir)
    else:
        report(a.run, a.units, a.ensembles, a.out)
    print(f"{a.step}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
