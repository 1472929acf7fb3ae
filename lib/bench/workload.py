"""The checkpoints and prompts `dsv4gen bench` runs on, made once and cached like the embedded tiny one.

Two configs, both `make_tiny` overrides so every weight is in the official storage formats (FP8
block-scaled linears, MXFP4 experts) that transformers and our loader both read:

- `bench`: CPU-sized, hidden 1024, so matrix work dominates a step as it does on a device. Four
  layers cover every layer kind of DeepSeek-V4-Flash's schedule (SWA/hash, CSA/hash, HCA/learned,
  CSA/learned) with the real window 128 and compress ratios 4 / 128. No drafter: the bench
  measures the backbone (the engine benchmark measures DSpark).
- `scaling`: the tiny preset's widths with the real window 128 and ratios 4 / 128 and room for 1M
  positions, to show how prefill and decode cost grow with context (lib/bench/long_context.py).

Must not know about timing or transformers.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from lib.weights.tiny_checkpoint import cache_root, make_tiny, maker_hash

# Absent dspark_* keys and no drafter-stage compress_ratios entries: a checkpoint without mtp.*.
NO_DRAFTER = {"dspark_block_size": None, "dspark_noise_token_id": None, "dspark_target_layer_ids": None,
              "dspark_markov_rank": None}

CONFIGS: dict[str, dict] = {
    "bench": {
        # widths: a quarter of Flash's heads, experts and ranks; head_dim 128 keeps the 64-dim RoPE part
        "vocab_size": 4096, "hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16,
        "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 512, "o_groups": 4, "o_lora_rank": 256,
        "index_n_heads": 16, "index_head_dim": 64, "index_topk": 128,
        "n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 512,
        # Flash's window, ratios and SwiGLU limit; layers 0-1 hash-routed like Flash's first three
        "sliding_window": 128, "compress_ratios": [0, 4, 128, 4], "num_hash_layers": 2,
        "swiglu_limit": 10.0, "max_position_embeddings": 65536, **NO_DRAFTER,
    },
    "scaling": {
        "sliding_window": 128, "compress_ratios": [0, 0, 4, 128, 4, 128], "index_topk": 64,
        "max_position_embeddings": 1048576, **NO_DRAFTER,
    },
}


def checkpoint(name: str, progress: bool = True) -> Path:
    """The named bench checkpoint under $DSV4GEN_CACHE, made on first use (about 30 s for `bench`).

    The folder name hashes the overrides with everything else the bytes depend on (lib.weights.tiny_checkpoint)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown bench checkpoint '{name}' (accepted: {', '.join(CONFIGS)})")
    path = cache_root() / f"bench-{name}-{maker_hash(json.dumps(CONFIGS[name], sort_keys=True))}"
    if not (path / "config.json").exists():
        if progress:
            print(f"making the '{name}' bench checkpoint in {path} (once; cached)", flush=True)
        make_tiny(path, overrides=CONFIGS[name], overwrite=True, progress=progress)
    return path


def prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` distinct prompts of exactly `length` ordinary token ids (the special tokens sit at the
    bottom of the vocabulary), the same for every engine of a run."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(16, vocab_size, (count, length), generator=gen).tolist()
