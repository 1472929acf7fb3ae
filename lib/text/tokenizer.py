"""Byte-level BPE tokenizer for DeepSeek-V4 checkpoints (DSV4-REFERENCE §6, §1.1).

Holds the V4 special-token table, builds the deterministic tiny tokenizer used by test checkpoints,
writes tokenizer files, and wraps a checkpoint's tokenizer.json with a streaming detokenizer.
Must not know the chat layout (lib/text/chat_encoding.py) or the tool markup (lib/text/dsml.py): it only knows which
strings are single tokens (its special tokens, and whole strings a caller names).
"""
from __future__ import annotations

import codecs
import heapq
import json
import os
import tempfile
from collections import Counter
from pathlib import Path
from types import MappingProxyType

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
# The official vocabulary holds the bare marker as one added token (id 128825 in V4); the angle
# brackets and tag names around it ("<｜DSML｜invoke") are ordinary text.
DSML = "｜DSML｜"
TASK_TOKENS = MappingProxyType({
    "action": "<｜action｜>", "query": "<｜query｜>", "authority": "<｜authority｜>",
    "domain": "<｜domain｜>", "title": "<｜title｜>", "read_url": "<｜read_url｜>",
    "extracted_url": "<｜extracted_url｜>",
})
# The tiny model's DSpark noise token: a reserved slot, like the real vocabulary's placeholders.
PLACEHOLDER = "<｜place▁holder▁no▁{}｜>"
DSPARK_NOISE = PLACEHOLDER.format(0)

# Order is the id assignment of the tiny tokenizer: BOS=0 and EOS=1 match the real checkpoint;
# the others live at 128xxx there, which a tiny vocabulary cannot mirror.
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS, EOS, USER, ASSISTANT, LATEST_REMINDER, THINK_START, THINK_END, DSML,
    *TASK_TOKENS.values(), DSPARK_NOISE,
)

# Written for this module; mixes English prose, Python and Chinese so the merges cover all three.
TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model is still a model: it reads tokens,
predicts the next one, and writes it back. We test the server with a tiny checkpoint so that every
test runs on a laptop in seconds. The tokenizer splits text into bytes, then merges frequent pairs.
Hello, world! How are you today? I am fine, thank you. What is the weather like in Beijing?
It is sunny and warm, with a light wind from the north. Please answer the question in one line.
The capital of France is Paris. The capital of China is Beijing. Two plus two equals four.
Reasoning step by step: first read the question, then check each assumption, then answer.
The user asked for a list of numbers; the assistant wrote them in order and stopped.
When the request carries tools, the model may call a function instead of answering directly.
The result of each call comes back as a message, and the model continues from there.
Streaming sends the answer in small pieces, so the reader sees words as soon as they exist.
A good test can fail: it checks one behaviour, names it clearly, and runs quickly.
Errors should say what went wrong, where it happened, and which values would have been accepted.

def add(a, b):
    return a + b

def mean(values):
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)

class Counter:
    def __init__(self):
        self.count = 0

    def step(self, n=1):
        self.count += n
        return self.count

for i in range(10):
    print(f"step {i}: {add(i, i)}")

import json
data = {"name": "get_weather", "arguments": {"location": "Beijing", "unit": "celsius"}}
print(json.dumps(data, ensure_ascii=False))
x = [1, 2, 3]; y = {k: v for k, v in zip("abc", x)}
while x:
    x.pop()

def softmax(logits, temperature=1.0):
    scaled = [v / temperature for v in logits]
    top = max(scaled)
    exps = [math.exp(v - top) for v in scaled]
    total = sum(exps)
    return [e / total for e in exps]

with open("config.json", encoding="utf-8") as f:
    config = json.load(f)
assert config["vocab_size"] > 0, "vocab_size must be positive"

你好，世界！今天天气很好，我们去公园散步吧。
北京是中国的首都，上海是中国最大的城市之一。
这个模型很小，但是它可以帮助我们测试服务器和分词器。
请一步一步地思考，然后给出最终的答案。
二加二等于四。三乘以三等于九。
用户问了一个问题，助手认真地回答了这个问题。
我们在中文、英文和代码之间切换，以确保分词器能够处理各种文本。
如果问题需要查询天气，助手可以调用工具，然后根据工具的结果回答用户。
流式输出会把答案分成很多小段，用户可以更早地看到文字。
一个好的测试应该能够失败，它只检查一种行为，并且运行得很快。
"""


def _byte_alphabet() -> tuple[str, ...]:
    """GPT-2's byte -> printable char table (index = byte value), as in tokenizers' ByteLevel."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, shifted = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:  # unprintable bytes move to U+0100.. in byte order
            table[b] = chr(0x100 + shifted)
            shifted += 1
    return tuple(table[b] for b in range(256))


def _pre_tokenizer(single_digits: bool, lone_spaces: bool = False):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    steps = [pre_tokenizers.Split(Regex(r" (?=[A-Za-z])"), behavior="isolated")] if lone_spaces else []
    if single_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    return pre_tokenizers.Sequence([*steps, byte_level]) if steps else byte_level


def _word_counts(corpus: str, single_digits: bool = False,
                 lone_spaces: bool = False) -> list[tuple[tuple[str, ...], int]]:
    split = _pre_tokenizer(single_digits, lone_spaces)
    counts = Counter(word for word, _ in split.pre_tokenize_str(corpus))
    return [(tuple(word), n) for word, n in sorted(counts.items())]


def _learn_merges(words, budget: int, taken: set[str]):
    """Greedy BPE: most frequent adjacent pair first, ties broken by the pair's string order.

    Written out (not BpeTrainer) because the tie-break must be a pure function of the corpus for
    tokenizer.json to be byte-identical across processes. Returns (merges, new tokens in order).
    """
    taken = set(taken)  # spellings that already have an id; the caller's set is left alone
    symbols_of = [list(symbols) for symbols, _ in words]
    freq_of = [n for _, n in words]
    count: dict[tuple[str, str], int] = {}
    where: dict[tuple[str, str], set[int]] = {}

    def account(idx: int, sign: int, touched: set) -> None:
        syms = symbols_of[idx]
        for pair in zip(syms, syms[1:]):
            count[pair] = count.get(pair, 0) + sign * freq_of[idx]
            if sign > 0:
                where.setdefault(pair, set()).add(idx)
            else:
                where[pair].discard(idx)
            touched.add(pair)

    touched: set = set()
    for idx in range(len(symbols_of)):
        account(idx, +1, touched)
    heap = [(-count[p], p) for p in touched]
    heapq.heapify(heap)
    merges, new_tokens = [], []
    while heap and len(new_tokens) < budget:
        neg, pair = heapq.heappop(heap)
        if count.get(pair, 0) != -neg or neg == 0:
            continue  # stale heap entry; the live count was pushed again when it changed
        merged, touched = pair[0] + pair[1], set()
        for idx in sorted(where[pair]):
            account(idx, -1, touched)
            syms, out, i = symbols_of[idx], [], 0
            while i < len(syms):
                if i + 1 < len(syms) and (syms[i], syms[i + 1]) == pair:
                    out.append(merged)
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            symbols_of[idx] = out
            account(idx, +1, touched)
        for p in touched:
            if count.get(p, 0) > 0:
                heapq.heappush(heap, (-count[p], p))
        merges.append(pair)
        if merged not in taken:  # two merge paths can spell the same token; the id is shared
            taken.add(merged)
            new_tokens.append(merged)
    return merges, new_tokens


def build_tiny_tokenizer(vocab_size: int, corpus: str = TINY_CORPUS, single_digits: bool = False,
                         lone_spaces: bool = False, whole: tuple[str, ...] = ()) -> _Backend:
    """Specials at 0..S-1, the 256 byte symbols, then `corpus` merges, then `whole`, up to exactly vocab_size ids.

    When the corpus runs out of pairs, the rest is filled with reserved <｜place▁holder▁no▁N｜> tokens,
    as the real vocabulary pads itself. `single_digits`: every digit is a token of its own (numbers are
    never merged), so a model can learn arithmetic digit by digit instead of one token per number.
    `lone_spaces`: a space before a letter is a token of its own, so a word is spelt by the same tokens whether a space
    precedes it or not ("Tell Naitros" and `">Naitros`), and copying it is copying tokens.
    `whole`: strings that are one token each wherever they occur (added tokens that are not special, so they decode as
    text), for fixed markup a pre-tokenizer would otherwise cut into many pieces.
    """
    floor = len(SPECIAL_TOKENS) + 256 + len(whole)
    if vocab_size < floor:
        raise ValueError(f"vocab_size {vocab_size} is too small: the {len(SPECIAL_TOKENS)} special tokens, 256 byte "
                         f"symbols and {len(whole)} whole-string tokens need at least {floor}")
    alphabet = _byte_alphabet()
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *alphabet))}
    merges, new_tokens = _learn_merges(_word_counts(corpus, single_digits, lone_spaces), vocab_size - floor, set(vocab))
    for tok in new_tokens:
        vocab[tok] = len(vocab)
    for tok in whole:
        # a string the vocabulary already holds would have two spellings of its bytes under one id
        if tok in vocab or tok.startswith(PLACEHOLDER.split("{")[0]):
            raise ValueError(f"whole-string token {tok!r} is already in the vocabulary (a special token, byte symbol, "
                             f"merge or filler)")
        vocab[tok] = len(vocab)
    fillers = [PLACEHOLDER.format(n) for n in range(1, vocab_size - len(vocab) + 1)]
    for tok in fillers:
        vocab[tok] = len(vocab)
    backend = _Backend(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = _pre_tokenizer(single_digits, lone_spaces)
    backend.decoder = decoders.ByteLevel()
    # Already in the model vocab, so the added tokens keep ids 0..S-1 (and the filler ids).
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in (*SPECIAL_TOKENS, *fillers)])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in whole])
    assert backend.get_vocab_size(with_added_tokens=True) == vocab_size
    return backend


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tokenizer_files(tokenizer: _Backend, model_max_length: int) -> dict[str, str]:
    """tokenizer.json + tokenizer_config.json contents; add_bos_token is false because the chat
    encoder inserts BOS itself (official add_bos_token=false)."""
    for tok in (BOS, EOS):
        if tokenizer.token_to_id(tok) is None:
            raise ValueError(f"tokenizer has no {tok!r} token; cannot write a V4 tokenizer_config")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(model_max_length),
    }
    return {"tokenizer.json": tokenizer.to_str(pretty=True),
            "tokenizer_config.json": json.dumps(config, ensure_ascii=False, indent=2) + "\n"}


def write_tokenizer_files(dir: str | os.PathLike, tokenizer: _Backend, model_max_length: int) -> None:
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in tokenizer_files(tokenizer, model_max_length).items():
        _write_atomic(out / name, text)


def _config_token(config: dict, key: str, default: str) -> str:
    value = config.get(key, default)
    return value.get("content", default) if isinstance(value, dict) else (value or default)


class Tokenizer:
    """A checkpoint's tokenizer: ids <-> text, the special-id set and per-id bytes for streaming."""

    def __init__(self, backend: _Backend, *, bos_token: str = BOS, eos_token: str = EOS):
        self.backend = backend
        self.bos_id = self._require(bos_token)
        self.eos_id = self._require(eos_token)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, tok in added.items() if tok.special)
        # Specials whose text carries structure in generated output: the server splits reasoning at
        # </think> and parses DSML tool calls, so it asks the detokenizer to keep these.
        self.markup_ids = frozenset(i for i in map(backend.token_to_id, (THINK_START, THINK_END, DSML))
                                    if i is not None)
        inverse = {ch: b for b, ch in enumerate(_byte_alphabet())}
        table = [b""] * self.vocab_size
        for tok, i in backend.get_vocab(with_added_tokens=True).items():
            if i in added or any(ch not in inverse for ch in tok):
                table[i] = tok.encode("utf-8")  # added tokens are stored as plain text
            else:
                table[i] = bytes(inverse[ch] for ch in tok)
        self._id_bytes = tuple(table)

    def _require(self, token: str) -> int:
        i = self.backend.token_to_id(token)
        if i is None:
            raise ValueError(f"tokenizer has no {token!r} token")
        return i

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        root = Path(path)
        file = root / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in checkpoint directory {root}")
        config_file = root / "tokenizer_config.json"
        config = {}
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))
        return cls(_Backend.from_file(str(file)), bos_token=_config_token(config, "bos_token", BOS),
                   eos_token=_config_token(config, "eos_token", EOS))

    def encode(self, text: str) -> list[int]:
        # No BOS here: add_bos_token is false and the chat encoder writes BOS into the text.
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return self._id_bytes[token_id]


class DetokenizeStream:
    """Feed ids one at a time, get text deltas; bytes of an unfinished UTF-8 char are held back."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False,
                 keep_ids: frozenset[int] = frozenset()):
        self._tok = tokenizer
        # ids dropped from the text: the specials, except `keep_ids` (e.g. tokenizer.markup_ids)
        self._skip = (tokenizer.special_ids - keep_ids) if skip_special_tokens else frozenset()
        # Invalid sequences become U+FFFD (as in decode); only incomplete tails wait for more bytes.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if token_id in self._skip:
            return ""
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        """End of stream: whatever is still held back comes out (as U+FFFD if incomplete)."""
        return self._utf8.decode(b"", final=True)
