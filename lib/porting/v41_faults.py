"""DeepSeek-V4.1's own pitfalls as fault sites (V41-REFERENCE §3.1, §3.5, §4.4): what a port of V4.1 gets wrong
where V4.1 differs from V4. The catalogue (lib/porting/faults.py) re-introduces them through the runtime's
explicit sites: the paged state's pool sharing (PagedSites.reused_pools), the Engram hash parameters
(LoadFaults.engram_params) and the generated block's wiring (Rewrite.args).
"""
from __future__ import annotations

import dataclasses

import torch

from lib.engram.buckets import BucketLayout
from lib.records.decode_state import CompressorPools


def own_unwritten_pools(source, own):
    """V01: a layer after a KV source reads compressor and key pools of its own, which nothing writes (all zeros),
    instead of its source's: it attends zero entries wherever the reference attends the source's."""
    def fresh(pools: CompressorPools | None) -> CompressorPools | None:
        return None if pools is None else CompressorPools(None, torch.zeros_like(pools.entries), pools.ratio)
    return own._replace(comp=fresh(source.comp), index=fresh(source.index))


def reversed_head_primes(params):
    """V02: each n-gram order's bucket primes handed to its heads in reverse order (head h hashed modulo head
    H-1-h's prime): the layer's rows and offsets stay consistent and in range, so only the rows read are wrong."""
    lay: BucketLayout = params.layout
    primes = []
    for layer in lay.primes:
        orders = [layer[i:i + lay.n_heads][::-1] for i in range(0, len(layer), lay.n_heads)]
        primes.append(tuple(p for order in orders for p in order))
    offsets = tuple(tuple(sum(layer[:c]) for c in range(len(layer))) for layer in primes)
    return dataclasses.replace(params, layout=dataclasses.replace(lay, primes=tuple(primes), offsets=offsets))


# V03: every sub-layer's input collapsed with its own pre, as V4's hc_pre does, instead of the previous
# sub-layer's (the attention's with the last FFN's, the FFN's with this attention's): the steps of block_v41 that
# make u_attn and u_ffn read the pre their own hc_mix made
OWN_PRE_WIRING = {"block_v41": {"u_attn": {"pre": "pre_attn"}, "u_ffn": {"pre": "pre_ffn"}}}
