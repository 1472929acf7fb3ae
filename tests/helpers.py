"""Shared test helpers: tiny checkpoints made and loaded through the user paths (B21)."""
from __future__ import annotations

import torch

from lib.records.batch import make_batch
from lib.runtime.loaded_model import Model
from lib.runtime.paged_cache import PagedCache
from lib.runtime.paged_step import paged_step

# A second tiny config for parity tests: other widths, window 8, HCA ratio 16, one hash layer.
TINY_B = {
    "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 128,
    "qk_rope_head_dim": 32, "q_lora_rank": 128, "o_groups": 4, "o_lora_rank": 32, "sliding_window": 8,
    "compress_ratios": [0, 4, 16, 4, 0, 0, 0], "index_n_heads": 8, "index_head_dim": 64, "index_topk": 3,
    "n_routed_experts": 4, "num_experts_per_tok": 3, "moe_intermediate_size": 64, "num_hash_layers": 1,
    "dspark_target_layer_ids": [1, 2, 3],
}


def prompt_ids(n: int, vocab: int, seed: int = 1) -> list[int]:
    """Deterministic ordinary-token ids (skipping the special tokens at the bottom of the vocab)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(16, vocab, (n,), generator=gen).tolist()


def prefill_logits(model: Model, ids: list[int]) -> torch.Tensor:
    from lib.runtime.paged_step import prefill_logits as logits_of
    return logits_of(model, ids)


def chunked_logits(model: Model, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits of every position when the sequence arrives in chunks of the given sizes."""
    store = PagedCache.for_lengths(model, [len(ids)])
    store.add(0)
    out, pos = [], 0
    for size in chunks:
        (logits,) = paged_step(model, make_batch([ids[pos:pos + size]], [pos]), store, [0])
        out.append(logits)
        pos += size
    assert pos == len(ids)
    return torch.cat(out)


def messages(stderr: str) -> list[str]:
    """stderr less the stage announcements of long commands (`[make-tiny] writing ... ...`,
    lib/console/stages.py): the lines a test pins."""
    return [line for line in stderr.splitlines() if not line.startswith("[")]
