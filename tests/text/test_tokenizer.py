"""lib/text/tokenizer.py: the V4 special-token table, the deterministic tiny tokenizer, file writing,
the checkpoint wrapper and the streaming detokenizer. CPU only, no network."""
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lib.text.tokenizer import (SPECIAL_TOKENS, DetokenizeStream, Tokenizer, _learn_merges,
                           build_tiny_tokenizer, write_tokenizer_files)

# Spelled out here, not imported, so a typo in the module cannot agree with itself.
EXPECTED_SPECIALS = [
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<｜latest_reminder｜>", "<think>", "</think>", "｜DSML｜",
    "<｜action｜>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>", "<｜title｜>", "<｜read_url｜>",
    "<｜extracted_url｜>", "<｜place▁holder▁no▁0｜>",
]
MIXED = ("Hello, 世界! 🙂👍🏽 naïve café — def f(x):\n\treturn {'k': [1, 2]}  # 注释\r\n"
         "\x00\x7f\u200b tail  ")
VOCAB = 1024


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(build_tiny_tokenizer(VOCAB))


def _sha(backend) -> str:
    return hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()


def test_special_tokens_are_the_v4_strings_in_order():
    assert list(SPECIAL_TOKENS) == EXPECTED_SPECIALS
    # Full-width bar U+FF5C and U+2581, never ASCII '|' or '_' (a common transcription slip).
    assert EXPECTED_SPECIALS[0] == "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
    assert not any("|" in t for t in SPECIAL_TOKENS)


def test_specials_get_ids_zero_upwards(tok):
    for i, t in enumerate(EXPECTED_SPECIALS):
        assert tok.token_to_id(t) == i
        assert tok.id_to_token(i) == t
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert set(range(len(EXPECTED_SPECIALS))) <= tok.special_ids


@pytest.mark.parametrize("special", EXPECTED_SPECIALS)
def test_special_inside_text_is_one_id(tok, special):
    i = EXPECTED_SPECIALS.index(special)
    ids = tok.encode(f"abc{special}def")
    assert ids.count(i) == 1
    assert tok.decode(ids) == f"abc{special}def"


def test_dsml_tag_keeps_marker_as_one_token(tok):
    ids = tok.encode('<｜DSML｜invoke name="f">')
    assert ids.count(EXPECTED_SPECIALS.index("｜DSML｜")) == 1
    assert not any(t.startswith("｜") for t in map(tok.id_to_token, ids) if t != "｜DSML｜")


def test_encode_never_adds_bos(tok):
    assert tok.encode("hello")[0] != tok.bos_id
    assert tok.encode("") == []


@pytest.mark.parametrize("size", [272, 300, VOCAB, 3000])
def test_vocab_size_is_exact(size):
    backend = build_tiny_tokenizer(size)
    assert backend.get_vocab_size(with_added_tokens=True) == size
    assert sorted(backend.get_vocab(with_added_tokens=True).values()) == list(range(size))


def test_merges_fill_a_small_vocab_without_placeholders(tok):
    # The corpus must carry the 1024-token model: only the 16 real specials are special.
    assert tok.special_ids == frozenset(range(len(EXPECTED_SPECIALS)))
    assert len(tok.encode("The weather in Beijing is sunny.")) < 12


def test_too_small_vocab_is_refused():
    with pytest.raises(ValueError, match="at least 272"):
        build_tiny_tokenizer(271)


def test_whole_strings_are_one_plain_token_each_wherever_they_occur():
    whole = ('<｜DSML｜invoke name="', '" string="true">')
    tok = Tokenizer(build_tiny_tokenizer(VOCAB, whole=whole))
    assert tok.vocab_size == VOCAB
    text = 'x<｜DSML｜invoke name="get" string="true">y" string="true">'
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert [tok.id_to_token(i) for i in ids].count(whole[1]) == 2
    assert whole[0] in map(tok.id_to_token, ids)
    assert not tok.special_ids & set(ids)                      # text: kept when specials are skipped
    assert tok.decode(ids, skip_special_tokens=True) == text
    stream = DetokenizeStream(tok, skip_special_tokens=True)           # as the engine streams a reply
    assert "".join(map(stream.feed, ids)) + stream.flush() == text
    with pytest.raises(ValueError, match="whole-string"):
        build_tiny_tokenizer(272, whole=whole)
    with pytest.raises(ValueError, match="already in the vocabulary"):
        build_tiny_tokenizer(VOCAB, whole=("a",))                      # a byte symbol


def test_merges_take_the_most_frequent_pair_and_break_ties_by_string_order():
    words = [(("a", "b"), 3), (("b", "a"), 3), (("c", "d", "c", "d"), 1)]
    merges, new = _learn_merges(words, budget=10, taken=set("abcd"))
    assert merges == [("a", "b"), ("b", "a"), ("c", "d"), ("cd", "cd")]
    assert new == ["ab", "ba", "cd", "cdcd"]
    assert _learn_merges(words, budget=2, taken=set("abcd"))[1] == ["ab", "ba"]
    # A merge whose spelling already has an id is kept (tokenisation needs it) but adds no token.
    merges, new = _learn_merges(words, budget=10, taken={*"abcd", "ba"})
    assert merges[:3] == [("a", "b"), ("b", "a"), ("c", "d")] and new[:2] == ["ab", "cd"]


def test_build_is_deterministic_in_process_and_across_processes():
    first, second = _sha(build_tiny_tokenizer(VOCAB)), _sha(build_tiny_tokenizer(VOCAB))
    code = ("import hashlib; from lib.text.tokenizer import build_tiny_tokenizer as b; "
            f"print(hashlib.sha256(b({VOCAB}).to_str().encode('utf-8')).hexdigest())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parents[2],
                           env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout.strip()
    assert first == second == other
    assert _sha(build_tiny_tokenizer(VOCAB + 1)) != first


def test_byte_round_trip_on_mixed_text(tok):
    ids = tok.encode(MIXED)
    assert tok.decode(ids) == MIXED
    assert b"".join(tok.token_bytes(i) for i in ids) == MIXED.encode("utf-8")


def test_token_bytes_agree_with_decode_for_every_id(tok):
    for i in range(tok.vocab_size):
        text = tok.decode([i])
        if "\ufffd" not in text:  # lone continuation bytes decode to U+FFFD on their own
            assert text.encode("utf-8") == tok.token_bytes(i), i
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.token_bytes(tok.vocab_size)


def test_skip_special_tokens(tok):
    ids = tok.encode("<｜User｜>hi<｜Assistant｜></think>ok<｜end▁of▁sentence｜>")
    assert tok.decode(ids, skip_special_tokens=True) == "hiok"


def test_stream_holds_back_a_split_multibyte_char(tok):
    text = "a🙂b中c"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # the tiny vocab has no merge for 🙂: its 4 bytes are 4 ids
    stream = DetokenizeStream(tok)
    deltas = [stream.feed(i) for i in ids]
    assert "".join(deltas) + stream.flush() == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some ids completed no character and were held


def test_stream_flush_reports_an_unfinished_char(tok):
    ids = tok.encode("🙂")
    stream = DetokenizeStream(tok)
    assert "".join(stream.feed(i) for i in ids[:-1]) == ""
    assert stream.flush() == "\ufffd"


def test_stream_can_skip_specials(tok):
    stream = DetokenizeStream(tok, skip_special_tokens=True)
    ids = tok.encode("<think>x</think>y")
    assert "".join(stream.feed(i) for i in ids) == "xy"


def test_files_round_trip_through_from_dir(tmp_path, tok):
    write_tokenizer_files(tmp_path, tok.backend, model_max_length=4096)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["bos_token"] == EXPECTED_SPECIALS[0]
    assert config["eos_token"] == config["pad_token"] == EXPECTED_SPECIALS[1]
    assert config["add_bos_token"] is False and config["model_max_length"] == 4096
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.encode(MIXED) == tok.encode(MIXED)
    assert (loaded.bos_id, loaded.eos_id, loaded.vocab_size) == (0, 1, VOCAB)
    assert loaded.special_ids == tok.special_ids


def test_from_dir_without_tokenizer_json_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json.*" + tmp_path.name):
        Tokenizer.from_dir(tmp_path)
