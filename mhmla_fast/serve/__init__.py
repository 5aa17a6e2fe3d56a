"""Model-independent building blocks of the ``mhmla-serve`` command line.

``.tokenize``: Unicode-aware word tokenisation with exact code-point offsets (FCE/PTB-style tokens
for the GED tagger). ``.records``: the input/output layer of ``tag`` / ``score``: tolerant
plain-text/JSONL readers that turn malformed lines into error records, an append-only JSONL writer
that survives ``kill -9`` and resumes, and the batching driver that connects them. ``.score``:
loading the essay scorer and scoring chunks of essays (one scorer call per chunk).
"""
