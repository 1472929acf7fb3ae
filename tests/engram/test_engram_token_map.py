"""lib/engram/token_map.py: the Engram compressed token map ([EN] official DeepSeek-V4.1
inference/engram.py, code-index id 71212907549), on the tiny tokenizers (the real V4.1 tokenizer, whose
map has 99,092 ids, is not available here). Ids are picked by their decoded text; CPU only."""
import re
import unicodedata

import numpy as np
import pytest

from lib.engram.hashing import DEAD, hash_ids, hash_params
from lib.engram.token_map import build_token_map, normalise, token_key
from lib.text.tokenizer import SPECIAL_TOKENS, Tokenizer, build_tiny_tokenizer
from spec.variants import variant_config

ACCENTS = "Café CAFÉ cafe café é naïve naive\n" * 3


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(build_tiny_tokenizer(1024))


@pytest.fixture(scope="module")
def accented() -> Tokenizer:
    """A tiny tokenizer whose merges include accented letters and words in several cases."""
    return Tokenizer(build_tiny_tokenizer(300, corpus=ACCENTS))


def _ids_by_text(t: Tokenizer) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in range(t.vocab_size):
        out.setdefault(t.decode([i]), i)
    return out


def _by_hand(text: str) -> str:
    """The normalisation chain written out with Python's unicodedata, for plain strings."""
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = re.sub(r"[ \t\r\n]+", " ", "".join(ch for ch in s if unicodedata.category(ch) != "Mn").lower())
    return s if s == " " else s.strip()


@pytest.mark.parametrize("text, want", [
    (" ", " "), ("  ", " "), ("\n", " "), ("\t\r\n", " "),       # a lone (run of) space stays one space
    (" Héllo\n\tWORLD ", "hello world"), ("ＡＢＣ１", "abc1"), ("Ångström", "angstrom"),
    ("，", ","), ("", ""),
])
def test_normalise(text, want):
    assert normalise(text) == want == _by_hand(text)


def test_case_and_whitespace_share_an_id(tok):
    m, ids = build_token_map(tok, 2), _ids_by_text(tok)
    for a, b in [("A", "a"), ("T", "t"), ("The", " the"), (",", "，")]:
        assert m.table[ids[a]] == m.table[ids[b]], (a, b)
    space = m.table[ids[" "]]
    assert token_key(tok, ids[" "]) == " "                                       # not stripped away
    for ws in ("\t", "\n", "\r", "  ", "\n  "):
        assert m.table[ids[ws]] == space, repr(ws)
    assert m.table[ids["a"]] != m.table[ids["b"]] and m.table[ids["a"]] != space


def test_accents_are_stripped(accented):
    m, ids = build_token_map(accented, 2), _ids_by_text(accented)
    assert m.table[ids["é"]] == m.table[ids["e"]]
    assert m.table[ids["Café"]] == m.table[ids["CAFÉ"]]


def test_partial_utf8_ids_keep_their_raw_token(tok):
    m = build_token_map(tok, 2)
    # the lead bytes of 你 (E4) and of 世 (E4 B8 96: B8 alone) decode to U+FFFD: keyed by the raw token
    lead, cont = tok.token_to_id("ä"), tok.token_to_id("¸")         # byte-level symbols of 0xE4, 0xB8
    assert "\ufffd" in tok.decode([lead]) and "\ufffd" in tok.decode([cont])
    assert token_key(tok, lead) == "ä" and token_key(tok, cont) == "¸"
    assert m.table[lead] != m.table[cont]


def test_first_appearance_ids_pad_and_determinism(tok):
    m = build_token_map(tok, 2)
    assert m.table.shape == (1024,) and m.table.dtype == np.int64
    # the specials come first and all differ: ids 0..15 get compressed ids 0..15
    assert m.table[:len(SPECIAL_TOKENS)].tolist() == list(range(len(SPECIAL_TOKENS)))
    # first appearance: every compressed id first occurs in increasing order, none skipped
    firsts = [int(v) for i, v in enumerate(m.table) if v not in m.table[:i]]
    assert firsts == list(range(m.size)) and m.size == len(set(m.table.tolist())) < 1024
    assert m.pad == m.table[2] == 2                                   # map[engram_pad_token_id]
    again = build_token_map(Tokenizer(build_tiny_tokenizer(1024)), 2)
    assert (again.table == m.table).all() and again.size == m.size
    with pytest.raises(ValueError):
        m.table[0] = 5                                                # read-only


def test_compress_and_dead(tok):
    m, ids = build_token_map(tok, 2), _ids_by_text(tok)
    got = m.compress([ids["A"], ids["a"], 5, ids[" "]], dead=[False, False, True, False])
    assert got.tolist() == [m.table[ids["a"]]] * 2 + [DEAD, m.table[ids[" "]]]
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 1024\)"):
        m.compress([1024])


def test_size_check_and_pad_range(tok):
    size = build_token_map(tok, 2).size
    with pytest.raises(ValueError, match=f"compressed Engram vocabulary has {size} ids, the config says "
                                         "engram_compressed_vocab_size 99092"):
        build_token_map(tok, 2, expected_size=99_092)
    with pytest.raises(ValueError, match=r"engram_pad_token_id 1024 is outside the tokenizer's \[0, 1024\)"):
        build_token_map(tok, 1024)


def test_tokens_to_hash_ids_with_the_tiny_map(tok):
    """Text -> token ids -> compressed ids -> hash ids, with V4.1's layout and the tiny map's own vocab
    size (the multipliers follow it): 'The' and ' the' are different tokens with one compressed id."""
    m = build_token_map(tok, 2)
    params = hash_params(variant_config("v41-flash"), pad=m.pad, compressed_vocab=m.size)
    a, b = tok.encode("The quick brown fox"), tok.encode(" the quick brown fox")
    assert a[0] != b[0] and a[1:] == b[1:]
    ha = hash_ids(m.compress(a), params)
    assert ha.shape == (len(a), 2, 24)
    assert (ha == hash_ids(m.compress(b), params)).all()
    assert not (ha == hash_ids(m.compress(tok.encode("A quick brown fox")), params)).all()
