"""Word tokenisation of raw text into FCE/PTB-style tokens with exact code-point offsets.

:func:`word_tokenize` returns :class:`Token` ``(text, start, end)`` with offsets in Python ``str``
indices (code points, not bytes or UTF-16 units) such that ``text[start:end] == token.text``, tokens
in text order and non-overlapping. Every character that is not a separator (rule 1) lies in exactly
one token; separators lie in none. The empty string and separator-only strings give ``[]``. There is
no length limit and no normalisation: offsets always refer to the text as given.

The GED models were trained on the FCE corpus tokenised by RASP (PTB-like), so English follows PTB
conventions; other scripts get the simplest rule that keeps offsets exact.

Rules
-----

1. **Separators** are the characters for which ``str.isspace()`` is true (ASCII whitespace, U+0085,
   NO-BREAK SPACE U+00A0, U+1680, U+2000-U+200A, U+2028, U+2029, U+202F, U+205F, IDEOGRAPHIC SPACE
   U+3000, U+001C-U+001F) plus ZERO WIDTH SPACE U+200B. They end a token and belong to none.

2. **Clusters.** Each separator-free stretch is cut into clusters, a simplified form of Unicode
   extended grapheme clusters (UAX #29); a token is always made of whole clusters, except for the
   clitic split of rule 4c. A cluster is one *base* character followed by its *extenders*:

   * extenders are combining marks (categories ``M*``, which include the variation selectors
     U+FE0E/U+FE0F and U+20E3 COMBINING ENCLOSING KEYCAP), invisible characters (category ``Cf`` and
     non-separator ``Cc``: ZWJ U+200D, ZWNJ U+200C, soft hyphen, bidi marks such as U+200E/U+200F,
     word joiner, U+FEFF, emoji tag characters U+E0020-U+E007F, ...) and the emoji skin-tone
     modifiers U+1F3FB-U+1F3FF. So "e" + U+0301 stays one unit, and an invisible character never
     splits a word (``"co\\u00adoperate"`` is one token);
   * invisible characters at the start of a stretch are prepended to the cluster that follows them;
     a stretch made only of invisible characters is one token;
   * emoji ZWJ sequences: a cluster whose base is Extended_Pictographic and that ends with ZWJ also
     takes the next Extended_Pictographic character and its extenders (👨‍👩‍👧 is one cluster);
   * regional indicators (U+1F1E6-U+1F1FF) pair up from the left: a flag such as 🇯🇵 is one cluster;
   * conjoining Hangul jamo combine into syllables as in UAX #29 rules GB6-GB8.

3. **Cluster kinds**, decided by the base character, in this order:

   * *emoji*: Extended_Pictographic (table below, from the Unicode 17 emoji data), a regional
     indicator, a skin-tone modifier, or a keycap (base ``0-9 # *`` with U+20E3 among its extenders);
   * *CJK*: a letter or number (``L*``/``N*``) in Han (CJK unified and compatibility ideographs,
     all extensions, U+3005-U+3007, U+3021-U+3029, U+3038-U+303C), Hiragana, Katakana (including
     the phonetic extensions, halfwidth forms and the kana supplements), Hangul syllables or
     conjoining Hangul jamo;
   * *word*: any other ``L*``, ``N*`` or ``M*`` base (a combining mark with no base, e.g. after a
     space, is a word of its own). Arabic, Hebrew and all other scripts are words by this rule;
     right-to-left text keeps logical (storage) order offsets;
   * *symbol*: everything else (``P*``, ``S*``, private use, unassigned, lone surrogates).

4. **Tokens.**

   a. Every emoji cluster is one token (``"👍👍"`` gives two tokens).
   b. Every CJK cluster is one token: no segmenter is used, so ``"我喜欢猫"`` gives four tokens.
   c. A *word* is a maximal run of adjacent word clusters, continued through one joiner cluster
      that has an adjacent word cluster on each side:

      * an apostrophe ``'`` (U+0027) or ``’`` (U+2019): ``O'Brien``, ``rock'n'roll``;
      * a hyphen ``-``, U+2010, U+2011 or Hebrew maqaf U+05BE: ``well-known``, ``COVID-19``;
      * ``.``, ``,``, U+066B or U+066C when the bases on both sides are decimal digits (``Nd``):
        ``3.14``, ``1,000,000``, ``٣٫١٤`` (but ``U.S.`` and ``3.`` split);
      * Hebrew geresh U+05F3 or gershayim U+05F4 between two letters: ``צה״ל``.

      Then English clitics are split off PTB-style, repeatedly from the end of the word:
      ``n't`` and ``'s 'm 'd 're 've 'll`` (case-insensitive, with ``'`` or ``’``) become tokens
      of their own when what precedes them is a non-empty stem ending in a letter, digit or mark:
      ``don't`` -> ``do n't``, ``can't`` -> ``ca n't``, ``John's`` -> ``John 's``, ``I’m`` ->
      ``I ’m``, ``shouldn't've`` -> ``should n't 've``; a lone ``n't`` stays whole.
      Letters and digits do not split (``3rd``, ``10km``); scripts written without spaces (Thai,
      Khmer, ...) therefore give one token per space-delimited run.
   d. An apostrophe (``'`` or ``’`` alone in its cluster) directly followed by a word (rule c) that
      is exactly a clitic (``s m d re ve ll``, any case) makes one token with it, so already
      tokenised text keeps its tokens (``John 's`` -> ``John 's``). Otherwise a maximal run of
      adjacent identical symbol clusters is one token (``...``, ``!!``, ``--``, ``**``) and every
      other symbol cluster is a token of its own (``?!`` -> ``? !``, ``$5`` -> ``$ 5``,
      ``"Hi"`` -> ``" Hi "``).

Tokens of invisible characters only (rule 2) or of a lone combining mark are possible; a sub-word
tokeniser may turn them into nothing, so callers must map such tokens to an unknown-token id.
"""

from __future__ import annotations

import re
import unicodedata
from bisect import bisect_right
from typing import NamedTuple

__all__ = ["Token", "token_boundary", "word_tokenize", "word_tokenize_lists"]


class Token(NamedTuple):
    """One token: ``text == source[start:end]``, offsets in code points (``str`` indices)."""

    text: str
    start: int
    end: int


# ---------------------------------------------------------------------------------------------------
# character classes

# Character classes (small ints, looked up once per distinct character and cached).
_SEP = 0  # separator (rule 1)
_INVIS = 1  # Cf / non-separator Cc: extender, or prepended at the start of a stretch
_MARK = 2  # M*: extender, or a word base when nothing precedes it
_MOD = 3  # emoji skin-tone modifier: extender, or an emoji base
_WORD = 4  # L* / N* (not CJK, not decimal digit)
_DIGIT = 5  # Nd (not CJK)
_CJK = 6  # CJK letter/number other than Hangul
_EMOJI = 7  # Extended_Pictographic
_RI = 8  # regional indicator
_SYM = 9  # everything else
_H_L, _H_V, _H_T, _H_LV, _H_LVT = 10, 11, 12, 13, 14  # Hangul jamo / syllable types (all CJK)

_EXTENDERS = frozenset({_INVIS, _MARK, _MOD})
_HANGUL = frozenset({_H_L, _H_V, _H_T, _H_LV, _H_LVT})

# Extended_Pictographic code point ranges (inclusive), derived from the Unicode 17 emoji data.
_EXT_PICT = (
    (0x00A9, 0x00A9), (0x00AE, 0x00AE), (0x203C, 0x203C), (0x2049, 0x2049), (0x2122, 0x2122),
    (0x2139, 0x2139), (0x2194, 0x2199), (0x21A9, 0x21AA), (0x231A, 0x231B), (0x2328, 0x2328),
    (0x23CF, 0x23CF), (0x23E9, 0x23F3), (0x23F8, 0x23FA), (0x24C2, 0x24C2), (0x25AA, 0x25AB),
    (0x25B6, 0x25B6), (0x25C0, 0x25C0), (0x25FB, 0x25FE), (0x2600, 0x2604), (0x260E, 0x260E),
    (0x2611, 0x2611), (0x2614, 0x2615), (0x2618, 0x2618), (0x261D, 0x261D), (0x2620, 0x2620),
    (0x2622, 0x2623), (0x2626, 0x2626), (0x262A, 0x262A), (0x262E, 0x262F), (0x2638, 0x263A),
    (0x2640, 0x2640), (0x2642, 0x2642), (0x2648, 0x2653), (0x265F, 0x2660), (0x2663, 0x2663),
    (0x2665, 0x2666), (0x2668, 0x2668), (0x267B, 0x267B), (0x267E, 0x267F), (0x2692, 0x2697),
    (0x2699, 0x2699), (0x269B, 0x269C), (0x26A0, 0x26A1), (0x26A7, 0x26A7), (0x26AA, 0x26AB),
    (0x26B0, 0x26B1), (0x26BD, 0x26BE), (0x26C4, 0x26C5), (0x26C8, 0x26C8), (0x26CE, 0x26CF),
    (0x26D1, 0x26D1), (0x26D3, 0x26D4), (0x26E9, 0x26EA), (0x26F0, 0x26F5), (0x26F7, 0x26FA),
    (0x26FD, 0x26FD), (0x2702, 0x2702), (0x2705, 0x2705), (0x2708, 0x270D), (0x270F, 0x270F),
    (0x2712, 0x2712), (0x2714, 0x2714), (0x2716, 0x2716), (0x271D, 0x271D), (0x2721, 0x2721),
    (0x2728, 0x2728), (0x2733, 0x2734), (0x2744, 0x2744), (0x2747, 0x2747), (0x274C, 0x274C),
    (0x274E, 0x274E), (0x2753, 0x2755), (0x2757, 0x2757), (0x2763, 0x2764), (0x2795, 0x2797),
    (0x27A1, 0x27A1), (0x27B0, 0x27B0), (0x27BF, 0x27BF), (0x2934, 0x2935), (0x2B05, 0x2B07),
    (0x2B1B, 0x2B1C), (0x2B50, 0x2B50), (0x2B55, 0x2B55), (0x3030, 0x3030), (0x303D, 0x303D),
    (0x3297, 0x3297), (0x3299, 0x3299), (0x1F004, 0x1F004), (0x1F02C, 0x1F02F),
    (0x1F094, 0x1F09F), (0x1F0AF, 0x1F0B0), (0x1F0C0, 0x1F0C0), (0x1F0CF, 0x1F0D0),
    (0x1F0F6, 0x1F0FF), (0x1F170, 0x1F171), (0x1F17E, 0x1F17F), (0x1F18E, 0x1F18E),
    (0x1F191, 0x1F19A), (0x1F1AF, 0x1F1E5), (0x1F201, 0x1F20F), (0x1F21A, 0x1F21A),
    (0x1F22F, 0x1F22F), (0x1F232, 0x1F23A), (0x1F23C, 0x1F23F), (0x1F249, 0x1F25F),
    (0x1F266, 0x1F321), (0x1F324, 0x1F393), (0x1F396, 0x1F397), (0x1F399, 0x1F39B),
    (0x1F39E, 0x1F3F0), (0x1F3F3, 0x1F3F5), (0x1F3F7, 0x1F3FA), (0x1F400, 0x1F4FD),
    (0x1F4FF, 0x1F53D), (0x1F549, 0x1F54E), (0x1F550, 0x1F567), (0x1F56F, 0x1F570),
    (0x1F573, 0x1F57A), (0x1F587, 0x1F587), (0x1F58A, 0x1F58D), (0x1F590, 0x1F590),
    (0x1F595, 0x1F596), (0x1F5A4, 0x1F5A5), (0x1F5A8, 0x1F5A8), (0x1F5B1, 0x1F5B2),
    (0x1F5BC, 0x1F5BC), (0x1F5C2, 0x1F5C4), (0x1F5D1, 0x1F5D3), (0x1F5DC, 0x1F5DE),
    (0x1F5E1, 0x1F5E1), (0x1F5E3, 0x1F5E3), (0x1F5E8, 0x1F5E8), (0x1F5EF, 0x1F5EF),
    (0x1F5F3, 0x1F5F3), (0x1F5FA, 0x1F64F), (0x1F680, 0x1F6C5), (0x1F6CB, 0x1F6D2),
    (0x1F6D5, 0x1F6E5), (0x1F6E9, 0x1F6E9), (0x1F6EB, 0x1F6F0), (0x1F6F3, 0x1F6FF),
    (0x1F7DC, 0x1F7F0), (0x1F80C, 0x1F80F), (0x1F848, 0x1F84F), (0x1F85A, 0x1F85F),
    (0x1F888, 0x1F88F), (0x1F8AE, 0x1F8AF), (0x1F8BC, 0x1F8BF), (0x1F8C2, 0x1F8CF),
    (0x1F8D9, 0x1F8FF), (0x1F90C, 0x1F93A), (0x1F93C, 0x1F945), (0x1F947, 0x1F9FF),
    (0x1FA58, 0x1FA5F), (0x1FA6E, 0x1FAFF), (0x1FC00, 0x1FFFD),
)  # fmt: skip
_EXT_PICT_STARTS = tuple(a for a, _ in _EXT_PICT)

# Ranges whose letters/numbers are tokenised one per character (Hangul is handled separately).
_CJK_RANGES = (
    (0x3005, 0x3007),  # iteration mark, closing mark, ideographic zero
    (0x3021, 0x3029),  # Hangzhou numerals
    (0x3038, 0x303C),  # Hangzhou numerals, iteration marks
    (0x3040, 0x30FF),  # Hiragana, Katakana
    (0x31F0, 0x31FF),  # Katakana phonetic extensions
    (0x3400, 0x4DBF),  # CJK extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0xFF66, 0xFF9F),  # halfwidth Katakana
    (0x1AFF0, 0x1B16F),  # Kana extended-B, supplement, extended-A, small kana extension
    (0x20000, 0x3FFFF),  # CJK extensions B.., compatibility supplement (SIP, TIP)
)
_CJK_STARTS = tuple(a for a, _ in _CJK_RANGES)


def _in_ranges(cp: int, starts: tuple[int, ...], ranges: tuple[tuple[int, int], ...]) -> bool:
    k = bisect_right(starts, cp) - 1
    return k >= 0 and cp <= ranges[k][1]


def _hangul_class(cp: int) -> int | None:
    """UAX #29 Hangul_Syllable_Type of ``cp`` as one of the ``_H_*`` classes, or None."""
    if 0xAC00 <= cp <= 0xD7A3:
        return _H_LV if (cp - 0xAC00) % 28 == 0 else _H_LVT
    if 0x1100 <= cp <= 0x115F or 0xA960 <= cp <= 0xA97C:
        return _H_L
    if 0x1160 <= cp <= 0x11A7 or 0xD7B0 <= cp <= 0xD7C6:
        return _H_V
    if 0x11A8 <= cp <= 0x11FF or 0xD7CB <= cp <= 0xD7FB:
        return _H_T
    return None


def _classify(ch: str) -> int:
    """Class of one character (see the ``_SEP`` .. ``_H_LVT`` constants)."""
    if ch.isspace() or ch == "\u200b":
        return _SEP
    cp = ord(ch)
    if 0x1F3FB <= cp <= 0x1F3FF:
        return _MOD
    if 0x1F1E6 <= cp <= 0x1F1FF:
        return _RI
    if _in_ranges(cp, _EXT_PICT_STARTS, _EXT_PICT):
        return _EMOJI
    cat = unicodedata.category(ch)
    major = cat[0]
    if major == "M":
        return _MARK
    if cat in ("Cf", "Cc"):
        return _INVIS
    if major in "LN":
        hangul = _hangul_class(cp)
        if hangul is not None:
            return hangul
        if _in_ranges(cp, _CJK_STARTS, _CJK_RANGES):
            return _CJK
        return _DIGIT if cat == "Nd" else _WORD
    return _SYM


class _ClassCache(dict):
    """``char -> class`` memo: computed on first sight, bounded by the number of distinct chars."""

    def __missing__(self, ch: str) -> int:
        value = self[ch] = _classify(ch)
        return value


_CLASS = _ClassCache()

# ---------------------------------------------------------------------------------------------------
# clusters

# Cluster kinds.
_K_WORD, _K_CJK, _K_EMOJI, _K_SYM = 0, 1, 2, 3

_KIND_OF_BASE = {
    _MARK: _K_WORD, _WORD: _K_WORD, _DIGIT: _K_WORD,
    _CJK: _K_CJK, _H_L: _K_CJK, _H_V: _K_CJK, _H_T: _K_CJK, _H_LV: _K_CJK, _H_LVT: _K_CJK,
    _EMOJI: _K_EMOJI, _RI: _K_EMOJI, _MOD: _K_EMOJI,
    _SYM: _K_SYM, _INVIS: _K_SYM,
}  # fmt: skip

_ZWJ = "\u200d"
_KEYCAP = "\u20e3"
_KEYCAP_BASES = frozenset("0123456789#*")

# Hangul GB6-GB8: which jamo/syllable class may follow which.
_HANGUL_NEXT = {
    _H_L: frozenset({_H_L, _H_V, _H_LV, _H_LVT}),
    _H_LV: frozenset({_H_V, _H_T}),
    _H_V: frozenset({_H_V, _H_T}),
    _H_LVT: frozenset({_H_T}),
    _H_T: frozenset({_H_T}),
}


class _Cluster(NamedTuple):
    start: int
    end: int
    kind: int
    base: str  # the base character (the first character of an invisible-only run)
    base_class: int


def _skip_extenders(text: str, i: int, n: int) -> int:
    cls = _CLASS
    while i < n and cls[text[i]] in _EXTENDERS:
        i += 1
    return i


def _clusters(text: str) -> list[_Cluster]:
    """Rule 2: the clusters of ``text`` in order; separators belong to none."""
    cls = _CLASS
    out: list[_Cluster] = []
    n = len(text)
    i = 0
    while i < n:
        c = cls[text[i]]
        if c == _SEP:
            i += 1
            continue
        start = i
        while c == _INVIS:  # prepended invisible characters
            i += 1
            if i == n:
                break
            c = cls[text[i]]
        if i == n or c == _SEP:  # a stretch of invisible characters only
            out.append(_Cluster(start, i, _K_SYM, text[start], _INVIS))
            continue
        base = text[i]
        base_pos = i
        i += 1
        if c in _HANGUL:
            state = c
            while i < n:
                nxt = cls[text[i]]
                if nxt not in _HANGUL_NEXT[state]:
                    break
                state = nxt
                i += 1
        elif c == _RI and i < n and cls[text[i]] == _RI:
            i += 1
        i = _skip_extenders(text, i, n)
        kind = _KIND_OF_BASE[c]
        if c == _EMOJI:
            while text[i - 1] == _ZWJ and i < n and cls[text[i]] == _EMOJI:
                i = _skip_extenders(text, i + 1, n)
        elif base in _KEYCAP_BASES and _KEYCAP in text[base_pos + 1 : i]:
            kind = _K_EMOJI
        out.append(_Cluster(start, i, kind, base, c))
    return out


# ---------------------------------------------------------------------------------------------------
# tokens

_APOSTROPHES = frozenset("'\u2019")
_HYPHENS = frozenset("-\u2010\u2011\u05be")
_NUMBER_SEPARATORS = frozenset(".,\u066b\u066c")
_GERESH = frozenset("\u05f3\u05f4")
_JOINERS = _APOSTROPHES | _HYPHENS | _NUMBER_SEPARATORS | _GERESH
_CLITICS = frozenset({"s", "m", "d", "re", "ve", "ll"})
_CLITIC_SUFFIX = re.compile(r"(?:n['\u2019]t|['\u2019](?:s|m|d|re|ve|ll))\Z", re.IGNORECASE)


def _joins(joiner: str, left: _Cluster, right: _Cluster) -> bool:
    """Rule 4c: does ``joiner`` between the word clusters ``left`` and ``right`` continue a word?"""
    if joiner in _APOSTROPHES or joiner in _HYPHENS:
        return True
    if joiner in _NUMBER_SEPARATORS:
        return left.base_class == _DIGIT and right.base_class == _DIGIT
    # geresh / gershayim: between letters
    return (
        left.base_class == _WORD
        and right.base_class == _WORD
        and left.base.isalpha()
        and right.base.isalpha()
    )


def _word_end(clusters: list[_Cluster], p: int) -> int:
    """Index of the last cluster of the word (rule 4c) that starts at word cluster ``p``."""
    m = len(clusters)
    q = p
    while q + 1 < m:
        nxt = clusters[q + 1]
        if nxt.start != clusters[q].end:
            break
        if nxt.kind == _K_WORD:
            q += 1
            continue
        if (
            nxt.kind == _K_SYM
            and nxt.base in _JOINERS
            and q + 2 < m
            and clusters[q + 2].kind == _K_WORD
            and clusters[q + 2].start == nxt.end
            and _joins(nxt.base, clusters[q], clusters[q + 2])
        ):
            q += 2
            continue
        break
    return q


def _is_stem_end(ch: str) -> bool:
    return unicodedata.category(ch)[0] in "LNM"


def _split_clitics(text: str, start: int, end: int, out: list[Token]) -> None:
    """Rule 4c, second part: append the word ``text[start:end]`` minus clitics, then the clitics."""
    tail: list[Token] = []
    while True:
        m = _CLITIC_SUFFIX.search(text, start, end)
        if m is None or m.start() == start or not _is_stem_end(text[m.start() - 1]):
            break
        tail.append(Token(m.group(), m.start(), end))
        end = m.start()
    out.append(Token(text[start:end], start, end))
    out.extend(reversed(tail))


# Printable ASCII and ASCII whitespace only: every cluster is one character, letters and digits
# are word clusters, everything else but whitespace a symbol cluster. The rules then reduce to
# one regular expression (tested against the general path on random text).
_ASCII_ONLY = re.compile(r"[\t\n\x0b\x0c\r\x1c-\x7e]*\Z")
_ASCII_TOKEN = re.compile(r"""
    (?P<word>[A-Za-z0-9]+(?:['\-][A-Za-z0-9]+|(?<=[0-9])[.,][0-9][A-Za-z0-9]*)*)  # rule 4c
  | '(?:[sSmMdD]|[rR][eE]|[vV][eE]|[lL][lL])(?![A-Za-z0-9])(?!['\-][A-Za-z0-9])  # rule 4d
  | (?P<sym>[^\sA-Za-z0-9])(?P=sym)*  # rule 4d: a run of one symbol
""", re.VERBOSE)


def _word_tokenize_ascii(text: str) -> tuple[list[str], list[tuple[int, int]]]:
    """:func:`word_tokenize_lists` of text that ``_ASCII_ONLY`` matches: one pass of
    ``_ASCII_TOKEN`` whose matches are read in C; only its words that hold an apostrophe (rule
    4c: clitics to split) are then split one by one."""
    matches = list(_ASCII_TOKEN.finditer(text))
    words = list(map(re.Match.group, matches))
    spans = list(map(re.Match.span, matches))
    if "'" not in text:
        return words, spans
    # Words (they start with a letter or digit; a rule-4d token or a symbol run starts with a
    # symbol) with an apostrophe, from the last, so that splicing keeps earlier indices.
    split = [i for i, w in enumerate(words) if "'" in w and w[0] != "'"]
    for i in reversed(split):
        parts: list[Token] = []
        _split_clitics(text, *spans[i], parts)
        if len(parts) > 1:
            words[i:i + 1] = [t.text for t in parts]
            spans[i:i + 1] = [(t.start, t.end) for t in parts]
    return words, spans


def word_tokenize_lists(text: str) -> tuple[list[str], list[tuple[int, int]]]:
    """:func:`word_tokenize` as two lists, the tokens' texts and their ``(start, end)`` offsets,
    without a :class:`Token` per token (the fast form for printable-ASCII text)."""
    if _ASCII_ONLY.match(text):
        return _word_tokenize_ascii(text)
    tokens = _word_tokenize_clusters(text)
    return [t.text for t in tokens], [(t.start, t.end) for t in tokens]


_CUT_AFTER = frozenset({_WORD, _DIGIT, _CJK, _SYM})  # bases that never extend past themselves


def token_boundary(text: str, i: int) -> bool:
    """Whether no token of :func:`word_tokenize` can span position ``i`` of ``text`` (0 < i <
    len(text)), whatever the text holds before ``i - 1`` and after ``i``: so the tokens of
    ``text`` are those of ``text[:i]`` followed by those of ``text[i:]`` (shifted by ``i``).

    True at a separator on either side (rule 1), and between two base characters whose tokens
    cannot continue into each other: a word, digit or CJK base (rules 4b, 4c) or a symbol that
    is not a joiner, followed by a CJK base, a symbol that is not a joiner (and not the same
    symbol: rule 4d runs), or, after a CJK base or a symbol, by a word or digit base; and
    between a number separator (``.``, ``,``, U+066B, U+066C) and a word (not digit) or CJK
    base on either side of it, since it joins only digit to digit (rule 4c; without this, a
    text such as ``a,b,c,...`` had no cut at all and was tokenized in one step). Hangul,
    emoji, regional indicators, marks and invisible characters never make a boundary (they can
    combine with their neighbours). This lets a long text without spaces (Chinese, Japanese, a
    URL, base64) be tokenized piece by piece."""
    cls = _CLASS
    a, b = text[i - 1], text[i]
    ca, cb = cls[a], cls[b]
    if ca == _SEP or cb == _SEP:
        return True
    if ca not in _CUT_AFTER:
        return False
    if ca == _SYM and a in _JOINERS:
        return a in _NUMBER_SEPARATORS and cb in (_WORD, _CJK)
    if cb == _CJK:
        return True
    if cb == _SYM:
        if b in _NUMBER_SEPARATORS and ca in (_WORD, _CJK):
            return True
        return b not in _JOINERS and b != a
    if cb in (_WORD, _DIGIT):
        return ca in (_CJK, _SYM)
    return False


def word_tokenize(text: str) -> list[Token]:
    """Split ``text`` into tokens by the rules in the module docstring; offsets are ``str`` indices.

    ``[t.text for t in word_tokenize("I don't like it...")]`` is
    ``["I", "do", "n't", "like", "it", "..."]``.
    """
    if _ASCII_ONLY.match(text):
        words, spans = _word_tokenize_ascii(text)
        return [Token(w, a, b) for w, (a, b) in zip(words, spans)]
    return _word_tokenize_clusters(text)


def _word_tokenize_clusters(text: str) -> list[Token]:
    """:func:`word_tokenize` by clusters (rules 2-4): any text."""
    clusters = _clusters(text)
    out: list[Token] = []
    m = len(clusters)
    p = 0
    while p < m:
        cl = clusters[p]
        if cl.kind == _K_WORD:
            q = _word_end(clusters, p)
            end = clusters[q].end
            if any(text[k] in _APOSTROPHES for k in range(cl.start, end)):
                _split_clitics(text, cl.start, end, out)
            else:
                out.append(Token(text[cl.start : end], cl.start, end))
            p = q + 1
            continue
        if cl.kind == _K_SYM:
            nxt = clusters[p + 1] if p + 1 < m else None
            if (
                cl.end - cl.start == 1
                and cl.base in _APOSTROPHES
                and nxt is not None
                and nxt.kind == _K_WORD
                and nxt.start == cl.end
            ):
                q = _word_end(clusters, p + 1)
                end = clusters[q].end
                if text[nxt.start : end].lower() in _CLITICS:
                    out.append(Token(text[cl.start : end], cl.start, end))
                    p = q + 1
                    continue
            piece = text[cl.start : cl.end]
            q = p
            while (
                q + 1 < m
                and clusters[q + 1].start == clusters[q].end
                and clusters[q + 1].kind == _K_SYM
                and text[clusters[q + 1].start : clusters[q + 1].end] == piece
            ):
                q += 1
            end = clusters[q].end
            out.append(Token(text[cl.start : end], cl.start, end))
            p = q + 1
            continue
        out.append(Token(text[cl.start : cl.end], cl.start, cl.end))  # emoji, CJK
        p += 1
    return out
