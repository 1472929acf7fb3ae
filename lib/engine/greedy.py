"""Greedy generation over a loaded model: prefill once, then one token per step.

This is the minimal loop `dsv4gen run` needs; sampling, batching of many requests and
speculative decoding belong to the engine. It must not know about HTTP or chat formats.
"""
from __future__ import annotations

from typing import Iterator

import torch

from lib.records.batch import make_batch
from lib.runtime.loaded_model import Model
from lib.runtime.paged_cache import PagedCache
from lib.runtime.paged_step import paged_step, prefill_logits


def greedy(model: Model, prompt_ids: list[int], max_tokens: int, stop_ids: frozenset[int] = frozenset()) -> Iterator[int]:
    """Yield up to `max_tokens` argmax tokens; stops after yielding a token in `stop_ids`."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: at least one token is needed")
    limit = model.cfg.max_position_embeddings
    if len(prompt_ids) + max_tokens > limit:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max tokens ({max_tokens}) exceeds "
                         f"max_position_embeddings ({limit})")
    store = PagedCache.for_lengths(model, [len(prompt_ids) + max_tokens])
    store.add(0)
    (logits,) = paged_step(model, make_batch([prompt_ids], last_only=True), store, [0])
    position = len(prompt_ids)
    for _ in range(max_tokens):
        token = int(torch.argmax(logits[-1]))
        yield token
        if token in stop_ids:
            return
        (logits,) = paged_step(model, make_batch([[token]], [position], last_only=True), store, [0])
        position += 1


def all_logits(model: Model, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), vocab] of every position, one prefill."""
    if not ids:
        raise ValueError("no token ids given")
    bad = [i for i in ids if not 0 <= i < model.cfg.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (vocab_size {model.cfg.vocab_size})")
    return prefill_logits(model, ids)
