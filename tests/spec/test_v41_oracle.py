"""The dense V4.1 oracle (tests/oracle_v41.py) on a `make-tiny --variant v41-tiny` checkpoint: causal, and every
V4.1 part it has is wired where V41-REFERENCE puts it (a KV source's entries reach the layers that reuse them only
once a group is complete; Engram changes what follows it)."""
from __future__ import annotations

import msgspec
import pytest
import torch

from tests.oracle_v41 import V41Oracle

TOKENS = [5, 301, 42, 42, 17, 900, 3, 64, 512, 7, 7, 250]


@pytest.fixture(scope="module")
def oracle(v41_tiny_ckpt):
    return V41Oracle(v41_tiny_ckpt)


def test_the_oracle_is_causal(oracle):
    whole = oracle.logits(TOKENS)
    assert whole.shape == (len(TOKENS), oracle.cfg.vocab_size) and bool(torch.isfinite(whole).all())
    for n in (1, 2, 5, 9):                    # a prefix's logits do not depend on what comes after it
        assert torch.allclose(oracle.logits(TOKENS[:n]), whole[:n], rtol=0, atol=1e-9), n


def test_a_kv_source_reaches_its_reusers_once_a_group_is_complete(oracle):
    """Layer 2 is the ratio-2 KV source that layer 3 reuses: changing its compressor changes nothing at position 0
    (no pair complete yet) and every later position."""
    base = oracle.logits(TOKENS)
    key = "layers.2.attn.compressor.wkv.weight"
    saved = oracle.w[key].clone()
    try:
        oracle.w[key] = saved * 3 + 0.01
        moved = oracle.logits(TOKENS)
    finally:
        oracle.w[key] = saved
    assert torch.equal(moved[0], base[0])
    assert bool(((moved[1:] - base[1:]).abs().amax(-1) > 1e-6).all())


def test_engram_changes_what_follows_it(oracle):
    base = oracle.logits(TOKENS)
    key = "layers.1.engram.wkv.weight"
    saved = oracle.w[key].clone()
    try:
        oracle.w[key] = torch.zeros_like(saved)          # no value, no key: the gate adds nothing
        plain = oracle.logits(TOKENS)
    finally:
        oracle.w[key] = saved
    assert bool(((plain - base).abs().amax(-1) > 1e-6).all())


def test_the_candidate_blocks_restrict_the_reindex_layer_only_past_their_budget(oracle):
    """Layer 4 keeps 4 blocks of 2 entries (one per token at ratio 1); layer 6 re-selects inside them. Up to 8
    visible entries every block is kept, so lifting the budget changes nothing there; past it, it does."""
    tokens = TOKENS + [11, 12, 13, 14, 15, 16, 17, 18]
    base = oracle.logits(tokens)
    cfg = oracle.cfg
    try:
        oracle.cfg = msgspec.structs.replace(cfg, candidate_topk_blocks=64)
        free = oracle.logits(tokens)
    finally:
        oracle.cfg = cfg
    assert torch.equal(free[:8], base[:8])
    assert bool(((free[8:] - base[8:]).abs().amax(-1) > 1e-6).any())


def test_a_dspark_round_drafts_from_the_ring_the_block_and_the_markov_chain(oracle):
    """The V4.1 drafter (V41-REFERENCE §5): the block rows see each other both ways (a later noise id changes row
    0), the Markov head's bias changes the drafts (without it each is its base row's argmax), and the rings hold
    the target's main_x."""
    b, drafts, base, confidence = oracle.draft(TOKENS)
    assert b == int(oracle.logits(TOKENS)[-1].argmax()) and len(drafts) == len(confidence) == 5
    assert all(0 <= d < oracle.cfg.vocab_size for d in drafts)
    saved = oracle.w["mtp.2.markov_head.head.weight"].clone()
    try:
        oracle.w["mtp.2.markov_head.head.weight"] = torch.zeros_like(saved)     # no Markov bias
        _, plain, same_base, _ = oracle.draft(TOKENS)
    finally:
        oracle.w["mtp.2.markov_head.head.weight"] = saved
    assert torch.equal(same_base, base) and plain == [int(row.argmax()) for row in base] and plain != drafts
    cfg = oracle.cfg
    try:
        oracle.cfg = msgspec.structs.replace(cfg, dspark_noise_token_id=cfg.dspark_noise_token_id + 1)
        _, _, other, _ = oracle.draft(TOKENS)
    finally:
        oracle.cfg = cfg
    assert not torch.allclose(other[0], base[0])         # row 0 reads the later (noise) rows: bidirectional
    key = "mtp.0.main_proj.weight"
    saved = oracle.w[key].clone()
    try:
        oracle.w[key] = saved * 2 + 0.01
        _, _, moved, _ = oracle.draft(TOKENS)
    finally:
        oracle.w[key] = saved
    assert not torch.allclose(moved, base)               # the rings are the target's main_x
