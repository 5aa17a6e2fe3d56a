"""Shared by the essay-scoring tests (CLI, HTTP, ONNX, Ray): essays that the scorer's tokenizer
(MiniLM's BERT word pieces, the tiny and the shipped scorer's) turns into no word pieces, which
are refused, and essays of characters it keeps only as [UNK], which are scored."""

# U+FFFD (the one "So" character it drops), zero-width, format, control, combining and
# private-use characters, spaces
NO_PIECES_TEXTS = ["\ufffd \ufffd", "\u200b\u00ad \u0001\u2060\ufeff \u0301\U0010fffd"]
# noncharacters and unassigned code points (Cn), an enclosing mark (Me), a spacing mark (Mc):
# refused by the old approximate rule, yet the tokenizer keeps each one as [UNK]
UNK_TEXTS = ["\ufdd0\U000e0080 \U0003fffe", "\u0488\u0903"]
