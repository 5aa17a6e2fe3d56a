"""Tests of the serving word tokeniser (mhmla_fast.serve.tokenize): exact tokens and offsets per
script, and offset/coverage invariants over random strings of tricky code points."""

from __future__ import annotations

import random

import pytest

from mhmla_fast.serve.tokenize import Token, token_boundary, word_tokenize


def toks(text: str) -> list[tuple[str, int, int]]:
    return [(t.text, t.start, t.end) for t in word_tokenize(text)]


def words(text: str) -> list[str]:
    return [t.text for t in word_tokenize(text)]


def is_separator(ch: str) -> bool:
    """Rule 1 of the module docstring."""
    return ch.isspace() or ch == "\u200b"


# ---------------------------------------------------------------------------------------------------
# English


def test_plain_english_with_punctuation_and_clitics():
    text = "I don't like John's car, I'm sure... It costs $3.14 or 1,000 dollars!!"
    assert toks(text) == [
        ("I", 0, 1), ("do", 2, 4), ("n't", 4, 7), ("like", 8, 12), ("John", 13, 17),
        ("'s", 17, 19), ("car", 20, 23), (",", 23, 24), ("I", 25, 26), ("'m", 26, 28),
        ("sure", 29, 33), ("...", 33, 36), ("It", 37, 39), ("costs", 40, 45), ("$", 46, 47),
        ("3.14", 47, 51), ("or", 52, 54), ("1,000", 55, 60), ("dollars", 61, 68), ("!!", 68, 70),
    ]  # fmt: skip
    assert all(isinstance(t, Token) for t in word_tokenize(text))


def test_curly_apostrophe_clitics_and_hyphens():
    assert toks("Don’t you think it’s well-known?") == [
        ("Do", 0, 2), ("n’t", 2, 5), ("you", 6, 9), ("think", 10, 15), ("it", 16, 18),
        ("’s", 18, 20), ("well-known", 21, 31), ("?", 31, 32),
    ]  # fmt: skip


def test_all_ptb_clitics_case_insensitive():
    assert words("CAN'T they're we've you'll he'd I’M won't") == [
        "CA", "N'T", "they", "'re", "we", "'ve", "you", "'ll", "he", "'d", "I", "’M", "wo", "n't",
    ]  # fmt: skip
    assert words("shouldn't've") == ["should", "n't", "'ve"]
    assert words("90's") == ["90", "'s"]


def test_pretokenised_clitics_stay_whole():
    text = "do n't John 's I 'm"
    assert toks(text) == [
        ("do", 0, 2), ("n't", 3, 6), ("John", 7, 11), ("'s", 12, 14), ("I", 15, 16), ("'m", 17, 19),
    ]  # fmt: skip


def test_apostrophes_that_are_not_clitics():
    assert words("O'Brien rock'n'roll l'homme aujourd'hui") == [
        "O'Brien", "rock'n'roll", "l'homme", "aujourd'hui",
    ]  # fmt: skip
    # quotes and a trailing possessive apostrophe are punctuation
    assert toks("'Hello' dogs' toys") == [
        ("'", 0, 1), ("Hello", 1, 6), ("'", 6, 7), ("dogs", 8, 12), ("'", 12, 13), ("toys", 14, 18),
    ]  # fmt: skip
    assert words("''quoted''") == ["''", "quoted", "''"]


def test_numbers_abbreviations_and_symbol_runs():
    assert words("U.S. 3. 3rd 10km 1,000,000.50 12:30 -5 ?! --- well--known $5 \"Hi\"") == [
        "U", ".", "S", ".", "3", ".", "3rd", "10km", "1,000,000.50", "12", ":", "30", "-", "5",
        "?", "!", "---", "well", "--", "known", "$", "5", '"', "Hi", '"',
    ]  # fmt: skip
    assert words("a.b 3.x x.3 e-mail COVID-19 -x- …") == [
        "a", ".", "b", "3", ".", "x", "x", ".", "3", "e-mail", "COVID-19", "-", "x", "-", "…",
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# emoji, marks, invisible characters


def test_emoji_sequences_are_single_tokens():
    thumbs, family, flag, heart = "👍🏽", "👨\u200d👩\u200d👧", "🇯🇵", "❤\ufe0f"
    assert (len(thumbs), len(family), len(flag), len(heart)) == (2, 5, 2, 2)
    text = f"{thumbs} {family} {flag} {heart}"
    assert toks(text) == [(thumbs, 0, 2), (family, 3, 8), (flag, 9, 11), (heart, 12, 14)]


def test_emoji_adjacent_to_text_and_to_each_other():
    assert toks("Great👍🏽!") == [("Great", 0, 5), ("👍🏽", 5, 7), ("!", 7, 8)]
    assert toks("👍👍") == [("👍", 0, 1), ("👍", 1, 2)]
    assert toks("🇯🇵🇺🇸🇫") == [("🇯🇵", 0, 2), ("🇺🇸", 2, 4), ("🇫", 4, 5)]  # pairs from the left
    england = "🏴\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f"  # tag sequence
    assert toks(f"{england}!") == [(england, 0, 7), ("!", 7, 8)]
    woman_tech = "👩🏾\u200d💻"  # skin tone inside a ZWJ sequence
    assert toks(f"a {woman_tech}") == [("a", 0, 1), (woman_tech, 2, 6)]
    keycaps = "1\ufe0f\u20e3 #\ufe0f\u20e3 12"
    assert toks(keycaps) == [("1\ufe0f\u20e3", 0, 3), ("#\ufe0f\u20e3", 4, 7), ("12", 8, 10)]
    assert words("🫨") == ["🫨"]  # emoji newer than the interpreter's Unicode database


def test_combining_marks_stay_with_their_base():
    decomposed = "cafe\u0301 nai\u0308ve Zoe\u0308's"
    assert toks(decomposed) == [
        ("cafe\u0301", 0, 5), ("nai\u0308ve", 6, 12), ("Zoe\u0308", 13, 17), ("'s", 17, 19),
    ]  # fmt: skip
    assert toks("café") == [("café", 0, 4)]
    assert toks("x \u0301 y") == [("x", 0, 1), ("\u0301", 2, 3), ("y", 4, 5)]  # a mark with no base
    assert toks("!\u0301!") == [("!\u0301", 0, 2), ("!", 2, 3)]  # not the same cluster as "!"


def test_invisible_characters_never_split_and_never_get_lost():
    assert toks("co\u00adoperate") == [("co\u00adoperate", 0, 10)]
    assert toks("\u200fשלום\u200e.") == [("\u200fשלום\u200e", 0, 6), (".", 6, 7)]
    assert toks("a \u200e b") == [("a", 0, 1), ("\u200e", 2, 3), ("b", 4, 5)]
    assert toks("می\u200cخواهم") == [("می\u200cخواهم", 0, 8)]  # ZWNJ inside a Persian word
    assert toks("x\u200by") == [("x", 0, 1), ("y", 2, 3)]  # ZERO WIDTH SPACE separates


# ---------------------------------------------------------------------------------------------------
# CJK


def test_chinese_one_token_per_character():
    assert toks("我喜欢猫。") == [("我", 0, 1), ("喜", 1, 2), ("欢", 2, 3), ("猫", 3, 4), ("。", 4, 5)]


def test_japanese_mixed_scripts():
    assert toks("私はコーヒーが好きです。Tokyoに行った!") == [
        ("私", 0, 1), ("は", 1, 2), ("コ", 2, 3), ("ー", 3, 4), ("ヒ", 4, 5), ("ー", 5, 6),
        ("が", 6, 7), ("好", 7, 8), ("き", 8, 9), ("で", 9, 10), ("す", 10, 11), ("。", 11, 12),
        ("Tokyo", 12, 17), ("に", 17, 18), ("行", 18, 19), ("っ", 19, 20), ("た", 20, 21),
        ("!", 21, 22),
    ]  # fmt: skip
    assert toks("か\u3099") == [("か\u3099", 0, 2)]  # combining voiced mark stays with its kana
    assert toks("𠀋𠀋") == [("𠀋", 0, 1), ("𠀋", 1, 2)]  # astral (extension B) ideographs


def test_korean_syllables_and_conjoining_jamo():
    assert toks("한국어 \u1112\u1161\u11ab\u1100\u1173") == [
        ("한", 0, 1), ("국", 1, 2), ("어", 2, 3), ("\u1112\u1161\u11ab", 4, 7), ("\u1100\u1173", 7, 9),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# right-to-left scripts


def test_arabic_sentence():
    text = "مرحبا بالعالم! هل أنت بخير؟ نعم، شكرا."
    assert toks(text) == [
        ("مرحبا", 0, 5), ("بالعالم", 6, 13), ("!", 13, 14), ("هل", 15, 17), ("أنت", 18, 21),
        ("بخير", 22, 26), ("؟", 26, 27), ("نعم", 28, 31), ("،", 31, 32), ("شكرا", 33, 37),
        (".", 37, 38),
    ]  # fmt: skip
    # harakat (combining marks) stay in the word
    assert toks("كَتَبَ") == [("كَتَبَ", 0, 6)]


def test_hebrew_sentence():
    text = "שלום עולם, מה שלומך? צה״ל תל־אביב"
    assert toks(text) == [
        ("שלום", 0, 4), ("עולם", 5, 9), (",", 9, 10), ("מה", 11, 13), ("שלומך", 14, 19),
        ("?", 19, 20), ("צה״ל", 21, 25), ("תל־אביב", 26, 33),
    ]  # fmt: skip
    assert toks("שָׁלוֹם") == [("שָׁלוֹם", 0, 7)]  # niqqud


def test_mixed_rtl_and_digits():
    text = "اشتريت 3 كتب بسعر 1,250.50 دولار و٣٫١٤ (2024) ב-3.5 ₪"
    assert toks(text) == [
        ("اشتريت", 0, 6), ("3", 7, 8), ("كتب", 9, 12), ("بسعر", 13, 17), ("1,250.50", 18, 26),
        ("دولار", 27, 32), ("و٣٫١٤", 33, 38), ("(", 39, 40), ("2024", 40, 44), (")", 44, 45),
        ("ב-3.5", 46, 51), ("₪", 52, 53),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# whitespace


def test_unicode_whitespace_separates():
    text = "a\tb\nc\u00a0d\u3000e\r\nf\u2028g\u202fh\u0085i"
    assert toks(text) == [
        ("a", 0, 1), ("b", 2, 3), ("c", 4, 5), ("d", 6, 7), ("e", 8, 9), ("f", 11, 12),
        ("g", 13, 14), ("h", 15, 16), ("i", 17, 18),
    ]  # fmt: skip


@pytest.mark.parametrize("text", ["", " ", "\t\n\r", "\u00a0\u3000\u2028\u200b", "   \u2003  "])
def test_empty_and_whitespace_only(text):
    assert word_tokenize(text) == []


# ---------------------------------------------------------------------------------------------------
# invariants over random strings

_POOL = list(
    "aZé'’-.,!?$…\"()0123456789"  # ASCII-ish and joiners
    " \t\n\r\u00a0\u3000\u2028\u200b"  # separators
    "\u0301\u0308\u20e3\ufe0f\ufe0e\u3099"  # combining marks
    "\u200d\u200c\u00ad\u200e\u200f\ufeff\u2060\x00\x07"  # invisible format / control chars
    "👍🏽👨👩👧❤🏴💻\U0001f1ef\U0001f1f5\U000e0067\U000e007f©"  # emoji parts
    "我喜猫。ひカー한\u1100\u1161\u11a8ㅋ"  # CJK, kana, Hangul, jamo
    "مرحب٣٫٬،؟שלו״־ָ"  # Arabic, Hebrew
    "\U0001d400\U00010437\U0002000b\U0001f600\U000f0000\ue000\u0378₪★"  # astral, PUA, unassigned
)


# Multi-character pieces that make the interesting sequences frequent in random text.
_FRAGMENTS = [
    "👨\u200d", "\u200d👩", "👍🏽", "\U0001f1ef\U0001f1f5", "e\u0301", "\u1100\u1161\u11a8",
    "n't", "'s", "’ll", "3.1", "1,0", "a-b", "צה״ל", "٣٫١", "...", "!!", "\u200d\u200d",
]


def _random_texts(seed: int, count: int, max_len: int = 40) -> list[str]:
    """Random strings over single code points of ``_POOL`` and pieces of ``_FRAGMENTS`` (1 in 4)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(0, max_len)):
            parts.append(rng.choice(_FRAGMENTS) if rng.random() < 0.25 else rng.choice(_POOL))
        out.append("".join(parts))
    return out


def test_offsets_order_and_exact_coverage_on_random_strings():
    for text in _random_texts(seed=20240611, count=3000):
        tokens = word_tokenize(text)
        covered = [0] * len(text)
        prev_end = 0
        for t in tokens:
            assert text[t.start : t.end] == t.text, (text, t)
            assert t.start < t.end, (text, t)
            assert t.start >= prev_end, (text, tokens)  # in order, non-overlapping
            prev_end = t.end
            for k in range(t.start, t.end):
                covered[k] += 1
        for k, ch in enumerate(text):
            assert covered[k] == (0 if is_separator(ch) else 1), (text, k, tokens)
        assert word_tokenize(text) == tokens  # deterministic


def test_random_strings_from_all_of_unicode():
    """Surrogate-free code points from every plane: the invariants hold for any character."""
    rng = random.Random(7)
    cps = [cp for cp in (rng.randrange(0x110000) for _ in range(20000)) if not 0xD800 <= cp <= 0xDFFF]
    for k in range(0, len(cps), 25):
        text = "".join(map(chr, cps[k : k + 25]))
        tokens = word_tokenize(text)
        assert "".join(t.text for t in tokens) == "".join(ch for ch in text if not is_separator(ch))
        assert all(text[t.start : t.end] == t.text for t in tokens)


def test_no_token_boundary_inside_a_grapheme_cluster():
    """Cross-check of rule 2 against UAX #29 (the ``regex`` module's ``\\X``): a token never starts or
    ends inside an extended grapheme cluster, except right after a separator (a separator never
    carries the combining marks that follow it)."""
    regex = pytest.importorskip("regex")
    cluster = regex.compile(r"\X")
    # The pool holds no U+0600-style "prepend" characters, which UAX #29 attaches to the following
    # cluster. (UAX #29 also breaks around format characters where rule 2 does not; that direction
    # is not checked.)
    for text in _random_texts(seed=99, count=2000):
        inside = set()
        for m in cluster.finditer(text):
            inside.update(range(m.start() + 1, m.end()))
        for t in word_tokenize(text):
            for b in (t.start, t.end):
                assert b not in inside or is_separator(text[b - 1]), (text, t, b)


def test_ascii_fast_path_equals_the_cluster_rules():
    """Printable-ASCII text takes a regular-expression path; on random ASCII strings rich in
    joiners, clitics, digit separators, symbol runs and every ASCII separator it gives exactly
    the tokens of the general cluster-based rules. Text outside printable ASCII (a control
    character, a non-ASCII letter) takes the general path."""
    from mhmla_fast.serve import tokenize

    alphabet = ([chr(c) for c in range(0x20, 0x7F)] + list("\t\n\r\x0b\x0c\x1c\x1f")
                + ["'s", "n't", "'LL", "'Re", "'", "-", "3.1", "1,0", "...", "can't"] * 3)
    rng = random.Random(7)
    for _ in range(30_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        assert tokenize._ASCII_ONLY.match(text)
        assert word_tokenize(text) == tokenize._word_tokenize_clusters(text), repr(text)
    for text in ("caf\u00e9", "a\x7fb", "a\x00b", "x\u200by"):
        assert not tokenize._ASCII_ONLY.match(text)


def test_word_tokenize_lists_equals_the_cluster_rules():
    """The list form (texts and offsets, the engine's; word_tokenize's ASCII path is built from
    it) gives the general cluster-based rules' tokens on random printable ASCII with and
    without apostrophes (its one-pass path, with clitics split after it) and on non-ASCII text
    (the fallback)."""
    from mhmla_fast.serve import tokenize
    from mhmla_fast.serve.tokenize import word_tokenize_lists

    rng = random.Random(11)
    clitics = 0
    alphabets = ([chr(c) for c in range(0x20, 0x7F) if c != 0x27] + ["...", "3.1", "a-b"] * 3,
                 [chr(c) for c in range(0x20, 0x7F)] + ["'s", "n't", "can't"] * 3,
                 list("aé日 '👍\u0301\u200b-.") + ["don't"])
    fast = 0
    for alphabet in alphabets:
        for _ in range(5_000):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
            words, offsets = word_tokenize_lists(text)
            tokens = tokenize._word_tokenize_clusters(text)
            assert words == [t.text for t in tokens], repr(text)
            assert offsets == [(t.start, t.end) for t in tokens], repr(text)
            fast += text.isascii()
            clitics += text.isascii() and any(  # a clitic cut off the word before it
                offsets[k][0] == offsets[k - 1][1] and words[k - 1][-1].isalnum()
                and (words[k][0] == "'" or words[k].lower() == "n't") for k in range(1, len(words)))
    assert fast > 9_000  # the one-pass path ran
    assert clitics > 1_000  # and split words at apostrophes


def _split_at(text: str, i: int) -> list[Token]:
    """The tokens of ``text[:i]`` then those of ``text[i:]``, in ``text``'s offsets."""
    return word_tokenize(text[:i]) + [Token(t.text, t.start + i, t.end + i)
                                       for t in word_tokenize(text[i:])]


def test_token_boundary_means_the_text_can_be_cut_there():
    """At every position that token_boundary accepts, tokenizing the two halves apart gives the
    whole text's tokens: over random strings of the tricky pool (the definition of the function,
    checked exhaustively), with a count so that the check cannot pass by accepting nothing."""
    accepted = 0
    for text in _random_texts(seed=5, count=1500, max_len=30):
        whole = word_tokenize(text)
        for i in range(1, len(text)):
            if token_boundary(text, i):
                accepted += 1
                assert _split_at(text, i) == whole, (text, i)
    assert accepted > 5000


@pytest.mark.parametrize("text", [
    "我喜欢猫。她喜欢狗！" * 3,                  # Chinese: a cut between any two characters
    "これはペンです。カタカナとひらがな",
    "aGVsbG8gd29ybGQ+/aGVsbG8=+/Zm9vYmFy",   # base64
    "http://example.com/a/b?c=d&e=f#frag",
    "word/word/ab+cd=ef",
    "a,b,c,d,e,f,g,h,i,j,k,l",                # number separators between letters: no join
    "é.é.é.é.é.é.é.é.é.é.é.é",
    "我,你.他,她.它,们",
])
def test_texts_without_spaces_have_boundaries_inside(text):
    cuts = [i for i in range(1, len(text)) if token_boundary(text, i)]
    assert len(cuts) >= len(text) // 6
    assert all(_split_at(text, i) == word_tokenize(text) for i in cuts)


def test_a_long_list_without_spaces_is_tokenized_in_small_steps():
    """``a,a,a,...`` had no cut point: one step over the whole text (1.4 s and 257 MB for a
    million characters), where the step is meant to be a few thousand characters."""
    from mhmla_fast.serve.engine import iter_word_tokenize

    text = "é," * 50_000
    steps = list(iter_word_tokenize(text, 4096))
    assert len(steps) >= 20
    assert [t for part in steps for t in part] == word_tokenize(text)


@pytest.mark.parametrize("text,i", [
    ("1,000", 1), ("1,000", 2), ("a'b", 1),
    ("don't", 3), ("3.14", 1), ("3.14", 2), ("a-b", 1), ("a-b", 2), ("!!", 1), ("...", 2),
    ("\u1100\u1161", 1), ("👨\u200d👩", 2), ("\U0001f1ef\U0001f1f5", 1), ("e\u0301", 1),
    ("我\u0301", 1), ("John's", 4), ("a\u00adb", 1), ("#\u20e3", 1),
])
def test_no_boundary_where_a_token_may_continue(text, i):
    assert not token_boundary(text, i)
