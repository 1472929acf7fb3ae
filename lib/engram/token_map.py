"""The Engram compressed token map: token id -> compressed id, built once from the tokenizer.

From the official DeepSeek-V4.1 `inference/engram.py` ([EN], code-index id 71212907549, its
CompressedTokenizer; also TensorFold's CUDA spec [TFS], id 71186709713, and the V4.1 architecture
notes [ARCH], id 70122151154). For each id 0 .. len(tokenizer) - 1:

  text = decode([id]) with the raw backend, special tokens kept, no clean-up;
  key  = the raw token string (id_to_token) if text contains U+FFFD, else normalise(text), or text
         itself when that normalises to the empty string;
  normalise = NFKC -> NFD -> strip accents -> lowercase -> runs of space/tab/CR/LF to one space ->
              a string that is exactly one space becomes the private-use sentinel U+E000 -> strip ->
              the sentinel back to a space (so a lone space stays a space);

compressed ids are given in first-appearance order of the keys. pad = map[engram_pad_token_id] (a
compressed id; engram_pad_token_id is 2 on V4.1, and the tokenizer's own pad id differs [HFC], HF
V4.1 config class, id 70354872143). normalise is the `tokenizers` library's own normalizer sequence,
as [EN] builds it (normalisation libraries of other languages are not guaranteed identical [ARCH]).

The real V4.1 map has 99,092 compressed ids (engram_compressed_vocab_size, asserted by [EN]; every
multiplier depends on it). That needs the real V4.1 tokenizer.json, which is not available here: the
tests build the map of the tiny tokenizer only, and `expected_size` checks a real one when given.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from tokenizers import Regex, normalizers

from lib.engram.hashing import DEAD

SENTINEL = "\ue000"     # private use: keeps a lone space through Strip
REPLACEMENT = "\ufffd"  # an id whose bytes are not whole UTF-8 characters decodes to this

_NORMALISER = normalizers.Sequence([
    normalizers.NFKC(),
    normalizers.NFD(),
    normalizers.StripAccents(),
    normalizers.Lowercase(),
    normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
    normalizers.Replace(Regex(r"^ $"), SENTINEL),
    normalizers.Strip(),
    normalizers.Replace(SENTINEL, " "),
])


class TokenizerLike(Protocol):
    """What the map reads of a tokenizer (lib/text/tokenizer.py `Tokenizer` has it)."""
    vocab_size: int     # with the added tokens, as len() of an HF tokenizer

    def decode(self, ids, skip_special_tokens: bool = False) -> str: ...

    def id_to_token(self, token_id: int) -> str | None: ...


def normalise(text: str) -> str:
    return _NORMALISER.normalize_str(text)


def token_key(tokenizer: TokenizerLike, token_id: int) -> str:
    """The string a token id is compressed by."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if REPLACEMENT in text:
        raw = tokenizer.id_to_token(token_id)
        return raw if raw is not None else text
    return normalise(text) or text


@dataclass(frozen=True)
class TokenMap:
    """table[token id] = compressed id; `size` compressed ids; `pad` = table[engram_pad_token_id]."""
    table: np.ndarray       # [tokenizer vocab] int64, read-only
    size: int
    pad: int

    def compress(self, token_ids, dead=None) -> np.ndarray:
        """Compressed ids of `token_ids`; DEAD (-1) where the boolean mask `dead` (image-span tokens) is set."""
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self.table)):
            raise ValueError(f"token ids must lie in [0, {len(self.table)}), got {ids.min()} .. {ids.max()}")
        out = self.table[ids]
        if dead is not None:
            out = np.where(np.asarray(dead, dtype=bool), np.int64(DEAD), out)
        return out


def build_token_map(tokenizer: TokenizerLike, pad_token_id: int, expected_size: int | None = None) -> TokenMap:
    """The compressed token map of `tokenizer`. `expected_size`: the config's engram_compressed_vocab_size,
    checked when given (a map of another size would silently change every multiplier)."""
    n = int(tokenizer.vocab_size)
    if not 0 <= pad_token_id < n:
        raise ValueError(f"engram_pad_token_id {pad_token_id} is outside the tokenizer's [0, {n})")
    key_to_new: dict[str, int] = {}
    table = np.empty(n, dtype=np.int64)
    for tid in range(n):
        table[tid] = key_to_new.setdefault(token_key(tokenizer, tid), len(key_to_new))
    if expected_size is not None and len(key_to_new) != expected_size:
        raise ValueError(f"the tokenizer's compressed Engram vocabulary has {len(key_to_new)} ids, the config "
                         f"says engram_compressed_vocab_size {expected_size}")
    table.flags.writeable = False
    return TokenMap(table, len(key_to_new), int(table[pad_token_id]))
