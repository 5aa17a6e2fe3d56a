"""Cut ASAP essays into word-tokenised sentences: a transfer set for distillation.

    python training/make_transfer_asap.py ../shared/data/asap_aes/training_set_rel3.nea_utf8.tsv \
        --max-sentences 14000 --out runs/transfer/asap_14k.txt

writes one sentence per line, tokens separated by spaces, for ``mhmla-train ged --transfer``
(the teacher's probabilities are their only targets; their gold errors are unknown). Each
essay is word-tokenised as ``mhmla-serve`` tokenises raw text
(:func:`mhmla_fast.serve.tokenize.word_tokenize_lists`, PTB-like, as FCE's RASP tokens) and
cut after every token made only of ``.``, ``!`` and ``?`` (and a closing quote after it). A
sentence is kept if it has ``--min-words`` to ``--max-words`` tokens and no ``@`` token (ASAP's anonymised names,
``@PERSON1``, ``@CAPS2``, tokenise as ``@`` + ``PERSON1``: no learner wrote them). Repeated
sentences are kept once; the rest are shuffled with ``--seed`` and the first
``--max-sentences`` written (atomically: a killed run leaves no half file), with a summary on
stderr.

ASAP (the Hewlett Foundation's AES competition data) has no open licence: research use, not
redistributable. Keep the file out of the repository (``runs/`` is ignored), and a tagger
trained on it is research-only, as one trained on FCE is already.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from mhmla_fast.aes.data import read_asap
from mhmla_fast.serve.essays import essay_sentences
from mhmla_fast.durable import atomic_write_text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("asap", help="the ASAP essay TSV (training_set_rel3)")
    parser.add_argument("--out", required=True, help="the sentence file to write")
    parser.add_argument("--max-sentences", type=int, default=None,
                        help="keep at most this many (default: all)")
    parser.add_argument("--min-words", type=int, default=5)
    parser.add_argument("--max-words", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.max_sentences is not None and args.max_sentences < 1:
        parser.error("--max-sentences: expected at least 1")
    if not 1 <= args.min_words <= args.max_words:
        parser.error("--min-words and --max-words: expected 1 <= min <= max")

    essays = read_asap(args.asap)
    seen, kept, cut = set(), [], 0
    for essay in essays:
        for sentence in essay_sentences(essay.text):
            cut += 1
            if "@" in sentence or not args.min_words <= len(sentence) <= args.max_words:
                continue
            line = " ".join(sentence)
            if line not in seen:
                seen.add(line)
                kept.append(line)
    random.Random(args.seed).shuffle(kept)
    chosen = kept[: args.max_sentences]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(f"{line}\n" for line in chosen))
    words = sum(line.count(" ") + 1 for line in chosen)
    print(f"{len(essays)} essays, {cut} sentences cut, {len(kept)} kept (distinct, "
          f"{args.min_words}-{args.max_words} words, no @ names); wrote {len(chosen)} "
          f"({words} words) to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
