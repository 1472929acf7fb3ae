"""What `dsv4gen train-tiny` trains on: the training split of the task mix (lib/evaluation/tasks.py) in the V4 chat
encoding, its tokenizer, and batches of whole conversations.

The tokenizer is the tiny byte-level BPE (lib/text/tokenizer.py) with its merges learnt from the task mix's own text
(the chat template and tools block included), one token per digit, so prompts are short and arithmetic is learnt digit
by digit, and a space before a letter a token of its own, so a word copied from the question into the answer is the
same tokens in both; each fixed piece of a DSML call is one token (lib/text/dsml.py MARKUP_PIECES), so a call's
arguments sit close to the request they are copied from. A training sequence is one conversation; the loss is taken
on the assistant's reply (its end-of-sentence included), the only tokens a user ever sees generated. Retrieval gaps
are drawn from one window up to past the held-out gap, so that the model learns to look back any distance rather than
one fixed one.
Must not know the model, the optimiser or the checkpoint format.
"""
from __future__ import annotations

import random
from typing import NamedTuple

from lib.evaluation import tasks
from lib.evaluation.suite import prompt_text, reply_text
from lib.text.dsml import MARKUP_PIECES
from lib.text.tokenizer import SPECIAL_TOKENS, TINY_CORPUS, Tokenizer, build_tiny_tokenizer

# share of each task in the training stream, by conversation (tool calls and retrieval are long; arithmetic needs
# the most examples; retrieval reads its code back through compressed attention alone, at every gap, and gets the
# digits' order wrong when it has seen too few)
MIX = {"arithmetic": 0.53, "counting": 0.03, "copying": 0.10, "facts": 0.10, "retrieval": 0.12, "tool_call": 0.12}
# share of the arithmetic drawn from the cases a uniform draw rarely gives (tasks.arithmetic_edges)
ARITHMETIC_EDGES = 0.3
# The first OPENING_BATCHES batches draw only these short tasks, so each batch holds many of them. Copying is what makes
# the model form the attention that finds a token's successor earlier in the context (an induction head), which tool
# arguments and counting need too; it forms suddenly once enough copies have been seen (docs/training.md).
OPENING = {"copying": 0.5, "arithmetic": 0.5}
OPENING_BATCHES = 300
CORPUS_EXAMPLES = 60        # per task: the text the tokenizer's merges are learnt from
MAX_GAP_WINDOWS = 10        # retrieval gaps are drawn from 1 to this many sliding windows


class Sequence(NamedTuple):
    task: str
    ids: list[int]          # prompt then reply tokens
    reply_start: int        # index of the first reply token (the loss covers ids[reply_start:])


def task_tokenizer(vocab_size: int) -> Tokenizer:
    """The trained preset's tokenizer: merges from the task mix's text (special tokens left out)."""
    rng_seed = 0
    parts = [TINY_CORPUS]
    for task in tasks.TASKS:
        for ex in tasks.examples(task, "train", CORPUS_EXAMPLES, rng_seed, gap_tokens=40,
                                 count_tokens=lambda s: len(s) // 3):
            parts.append(prompt_text(ex) + reply_text(ex))
    text = "\n".join(parts)
    for special in (*MARKUP_PIECES, *SPECIAL_TOKENS):
        text = text.replace(special, "\n")
    return Tokenizer(build_tiny_tokenizer(vocab_size, text, single_digits=True, lone_spaces=True, whole=MARKUP_PIECES))


class TrainingStream:
    """An endless, seeded stream of training conversations, tokenized."""

    def __init__(self, tokenizer: Tokenizer, window: int, seed: int, mix: dict[str, float] = MIX,
                 opening_batches: int = OPENING_BATCHES):
        unknown = set(mix) - set(tasks.TASKS)
        if unknown:
            raise ValueError(f"unknown task(s) in the training mix: {sorted(unknown)}")
        self.tokenizer, self.window, self.mix = tokenizer, window, mix
        self.opening_batches, self.batches = opening_batches, 0
        self.rng = random.Random(f"train-tiny:{seed}")
        self._pending: Sequence | None = None     # drawn, but did not fit the last batch

    def _example(self, task: str) -> tasks.Example:
        seed = self.rng.randrange(1 << 30)
        gap = self.rng.randint(1, MAX_GAP_WINDOWS) * self.window
        if task == "arithmetic" and self.rng.random() < ARITHMETIC_EDGES:
            return tasks.arithmetic_edges(random.Random(seed), "train")
        return tasks.examples(task, "train", 1, seed, gap_tokens=gap,
                              count_tokens=lambda s: len(self.tokenizer.encode(s)))[0]

    def next(self) -> Sequence:
        mix = OPENING if self.batches < self.opening_batches else self.mix
        task = self.rng.choices(list(mix), weights=list(mix.values()))[0]
        ex = self._example(task)
        prompt = self.tokenizer.encode(prompt_text(ex))
        reply = self.tokenizer.encode(reply_text(ex))
        return Sequence(task, prompt + reply, len(prompt))

    def batch(self, tokens: int) -> list[Sequence]:
        """Whole conversations until adding the next would pass `tokens` (at least one)."""
        out, total = [], 0
        while True:
            seq, self._pending = self._pending or self.next(), None
            if out and total + len(seq.ids) > tokens:
                self._pending = seq
                self.batches += 1
                return out
            out.append(seq)
            total += len(seq.ids)
