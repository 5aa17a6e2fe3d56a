"""AES fine-tuning steps with batches of similar lengths against shuffled ones, on a CPU.

    python bench/aes_batching_cpu.py              # bench/results/aes_batching_cpu_<date>.json
    python bench/aes_batching_cpu.py --prompt 3 --fold 0 --out /tmp/b.json

``mhmla-train aes --finetune`` cuts each prompt's windows into batches of 8: shuffled only
(``--batching random``, every fine-tuned cell before the option) or sorted by length in pools
of 50 batches (``--batching length``, the default). This reports the padded pieces over the
real ones of each for epoch 0 (seed 0) of fold ``--fold``'s training essays, all prompts and
``--prompt``'s alone, and times that prompt's whole epoch 0 of each, batch for batch
interleaved (both have the same batches' count and windows), through the training step itself
(``_window_loss``, backward, fused Adam; MiniLM, MHMLA J = 12, ``--precision``): seconds,
windows/s and the ratio. One prompt's epoch: all eight take 25-30 minutes an epoch on 2 CPU
cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--prompt", type=int, default=7, help="the prompt whose epoch is timed "
                   "(default 7: 966 windows of 93 to 420 pieces, 10th to 90th percentile)")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from mhmla_fast.aes.data import split_essays
    from mhmla_fast.aes.finetune import FinetuneConfig, _window_loss
    from mhmla_fast.aes.heads import _epoch_batches
    from mhmla_fast.aes.model import EssayScorer, ScorerConfig, encode_essay_windows
    from mhmla_fast.aes.train import read_asap_folds
    from mhmla_fast.devices import training_autocast
    from mhmla_fast.encoder import load_tokenizer
    from mhmla_fast.provenance import cpu_info, dated_results_path, load_average, provenance

    torch.set_num_threads(args.threads)
    essays, fold_ids = read_asap_folds(None)
    train = [e for p in range(1, 9) for e in split_essays(essays, fold_ids, args.fold, prompt=p)["train"]]
    cfg = FinetuneConfig(out="unused", precision=args.precision)
    tokenizer = load_tokenizer(cfg.encoder_spec)
    windows, index = encode_essay_windows(tokenizer, [e.text for e in train], 510)
    prompts = np.array([train[i].prompt for i in index], dtype=np.int64)
    scores = np.array([train[i].score for i in index], dtype=np.int64)
    lengths = np.array([len(w) for w in windows], dtype=np.int64)
    plans = {"random": _epoch_batches(prompts, cfg.batch_size, cfg.seed, 0),
             "length": _epoch_batches(prompts, cfg.batch_size, cfg.seed, 0, lengths=lengths)}
    def padded(batches) -> float:
        real = sum(int(lengths[b].sum()) for b in batches)
        return float(sum(len(b) * lengths[b].max() for b in batches) / real)

    mine = {k: [b for b in v if prompts[b[0]] == args.prompt] for k, v in plans.items()}
    padding = {k: {"all_prompts": padded(plans[k]), f"prompt_{args.prompt}": padded(mine[k])}
               for k in plans}

    torch.manual_seed(0)
    scfg = ScorerConfig(encoder_spec=cfg.encoder_spec, layer_attention=cfg.layer_attention,
                        pooling=cfg.pooling, objective=cfg.objective, prompts=tuple(cfg.prompts))
    model = EssayScorer(scfg, backend="torch").train()
    opt = torch.optim.Adam([{"params": [q for q in model.parameters() if q.requires_grad],
                             "lr": cfg.lr}], fused=True)
    autocast = training_autocast(args.precision, torch.device("cpu"))
    timing = {k: {"seconds": 0.0, "windows": 0, "pieces_padded": 0} for k in plans}

    def step(rows) -> None:
        opt.zero_grad(set_to_none=True)
        loss = _window_loss(model, cfg, rows, int(prompts[rows[0]]), windows, scores,
                            tokenizer.pad_token_id, torch.device("cpu"), autocast, "mean")
        loss.backward()
        opt.step()

    step(mine["random"][0])  # warm-up (allocations, oneDNN kernels)
    load_start = load_average()
    for i in range(len(mine["random"])):  # interleaved: drift hits both sides
        for k in plans:
            rows = mine[k][i]
            t = time.perf_counter()
            step(rows)
            timing[k]["seconds"] += time.perf_counter() - t
            timing[k]["windows"] += len(rows)
            timing[k]["pieces_padded"] += int(len(rows) * lengths[rows].max())
    rows = {k: {**v, "windows_per_s": v["windows"] / v["seconds"],
                "padded_over_real": padding[k], "batches": len(mine[k])}
            for k, v in timing.items()}
    result = {
        "benchmark": "aes_batching_cpu",
        "header": {**provenance(), "cpu": cpu_info(), "threads": args.threads,
                   "load_average_start": load_start, "load_average_end": load_average(),
                   "precision": args.precision, "fold": args.fold, "prompt": args.prompt,
                   "windows": len(windows), "note": __doc__.split("\n\n")[1]},
        "rows": rows,
        "length_over_random_windows_per_s": rows["length"]["windows_per_s"] / rows["random"]["windows_per_s"],
    }
    out = dated_results_path(args.out, "aes_batching_cpu", REPO / "bench" / "results")
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    for k, v in rows.items():
        print(f"{k:7s} padded/real {v['padded_over_real']}  {v['seconds']:.1f} s, "
              f"{v['windows_per_s']:.2f} windows/s")
    print(f"length / random: {result['length_over_random_windows_per_s']:.2f}x; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
