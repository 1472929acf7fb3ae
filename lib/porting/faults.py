"""The fault-injection catalogue: field bugs (data/porting-lessons.yaml B01-B22) re-introduced
into a backend's code path at run time, so conformance can prove it catches each one.

Each entry patches one function the way the field port got it wrong, for the duration of a
`with injection(id, backend):` block. Conformance loads and runs the device backend inside the
block and the cpu reference outside it, so only the backend under test is broken.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Callable, NamedTuple

import torch


class Injection(NamedTuple):
    bug: str                         # lesson id
    what: str
    backends: tuple[str, ...]        # backends whose code path has the bug site
    target: str                      # "module:attribute" replaced while active ({backend} expands)
    make: Callable                   # original value -> broken value
    converters: tuple[tuple[str, str], ...] = ()   # extra (runtime format, converter) the broken value needs
    min_tp: int = 1                  # TP size the bug site needs: B05 shows only on a rank past 0 of TP >= 2


ALL = ("ascend310p", "ascend910", "hip936")
GMM = ("ascend310p", "ascend910")
PRECONVERTED = ("ascend310p",)


def _planar_unpack(original):
    def unpack(packed):                      # B01: all low nibbles, then all high nibbles
        codes = original(packed)
        return torch.cat((codes[..., 0::2], codes[..., 1::2]), dim=-1)
    return unpack


def _unsigned_e2m1(original):
    return lambda codes: original(codes & 7)  # B02: sign bit ignored


def _inverted_requant(original):
    def quantize_rows(w, qmax=127):          # B03: multiply by the scale instead of dividing
        amax = w.abs().amax(dim=-1)
        scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
        q = torch.round(w * scale.unsqueeze(-1)).clamp(-qmax, qmax).to(torch.int8)
        return original.__globals__["W8A8"](q, scale.float())
    return quantize_rows


def _value_converted_e8m0(original):
    def decode(bits):                        # B04: the byte value itself converted to E8M0 (rounds to 2^7)
        b = bits.view(torch.uint8).float().clamp_min(1)
        return torch.exp2(torch.round(torch.log2(b)))
    return decode


def _unsliced_tp_scales(original):
    """B05: the weight of a row-parallel linear (tp: cols, wo_b) is sliced for TP but its scale is not.
    The field's full scale (32, 64) met a rank's (32, 8) buffer and tripped a load assert; the silent
    form of the same bug copies the full scale into that buffer from its start, so every rank gets
    rank 0's scale blocks. That form loads on every backend and is wrong only in the numbers."""
    def part_index(logical, cfg, tp_size, tp_rank):
        index = original(logical, cfg, tp_size, tp_rank)
        if index is None or logical.entry.tp != "cols" or "scale" not in index:
            return index
        scale = index["scale"]
        return {**index, "scale": scale._replace(start=0, stop=scale.stop - scale.start)}
    return part_index


def _uninitialised_head(original):
    """B06: the loader treats the BF16 head as FP8 and multiplies it by a scale that was never
    loaded (whatever memory held): route class `head` to a converter that does exactly that."""
    formats = dict(original)
    formats["head"] = "__b06_fp8_head__"
    return formats


def b06_fp8_head(storage, parts, cfg):
    from lib.quant import reference_formats as formats
    value = formats.decode(storage, parts, cfg).float()
    gen = torch.Generator().manual_seed(6)
    garbage = torch.exp2(torch.randint(-20, 20, (value.shape[0], 1), generator=gen).float())
    return value * garbage


def _gate_topk_routing(original):
    def route_hash(x, gate, tid2eid, tokens, route_scale):   # B07: hash layers routed by gate top-k
        from backends.common import moe
        scores = moe._scores(x, gate)
        ids = torch.topk(scores, tid2eid.shape[1], dim=-1).indices.to(torch.int32)
        return moe._weights(scores, ids, route_scale), ids
    return route_hash


def _unclipped_swiglu(original):
    return lambda gate, up, limit: torch.nn.functional.silu(gate.float()) * up.float()   # B08


def _shared_over_scale(original):
    return lambda a, b: a + b.to(a.dtype) / 1.5      # B09: routed + shared / 1.5


def _keep_tail_rows(original):
    return lambda group_list, rows: torch.ones(rows, 1, dtype=torch.bool)   # B10: tail rows not zeroed


def _rank0_map(original):
    def placement(n_experts, ep_size=1, rank=0, simulate=False):            # B11: rank 0's map everywhere
        p = original(n_experts, ep_size, rank, simulate)
        return p._replace(local_of=p.local_of[:1].expand_as(p.local_of).contiguous())
    return placement


def _logical_as_physical(original):
    def physical_slots(table, q, block_tokens, logical_block_tokens):   # B12: logical id = physical block
        logical = table.index_select(0, (q // logical_block_tokens).to(torch.int32)).to(torch.int64)
        return logical * block_tokens + q % block_tokens
    return physical_slots


def _raw_token_positions(original):
    def group_positions(group, start, end):          # B13: entries slotted by the token that emitted them
        if group.ratio == 0:
            return original(group, start, end)
        return (torch.arange(start // group.ratio, end // group.ratio) + 1) * group.ratio - 1
    return group_positions


def _last_group(original):
    return lambda metas, ratio: metas[-1]              # B14: the last group's metadata for every layer


def _preconverted_means_converted(original):
    """B17: a global flag decides the format: in expert mode `preconverted` every routed expert not
    served from the converted shards (the drafter's) is taken as already in the runtime format."""
    return {**original, "preconverted": "__b17_taken_as_converted__"}


def b17_taken_as_converted(storage, parts, cfg):
    """The drafter's stored MXFP4 expert used as the W8A8 record it was assumed to be: buffers of the
    runtime shapes filled with the stored bytes as they are (packed FP4 codes as int8 weights, the E8M0
    exponent bytes read on as float32 row scales, ~1e35 each: expert outputs overflow, the field's NaN)."""
    from lib.quant.bit_codecs import as_bits
    from lib.quant.runtime_formats import W8A8
    weight, scale = parts["weight"], as_bits(parts["scale"])
    rows, cols = weight.shape[0], weight.shape[1] * 2
    qweight = torch.zeros(rows, cols, dtype=torch.int8)
    qweight.view(-1)[: weight.numel()] = weight.reshape(-1).view(torch.int8)
    raw = torch.cat((scale.reshape(-1), weight.reshape(-1).view(torch.uint8)))   # the scale buffer runs on
    return W8A8(qweight, raw[: 4 * rows].clone().view(torch.float32))


def _mask_indexed_logprobs(original):
    def token_logprobs(logits, token_ids, top):   # B20: the chosen token's logprob picked out by a mask
        from lib.engine.sampling import TokenLogprobs
        logp = torch.log_softmax(logits.float(), -1)
        hit = torch.arange(logp.shape[-1], device=logp.device) == token_ids.long().unsqueeze(-1)   # [R, V]
        chosen = logp[hit]                                                  # nonzero on the device (L12)
        top_logprobs, top_ids = logp.topk(top, dim=-1)
        return TokenLogprobs(chosen, (logp > chosen.unsqueeze(-1)).sum(-1) + 1, top_ids, top_logprobs)
    return token_logprobs


CATALOGUE: dict[str, Injection] = {
    "B01": Injection("B01", "MXFP4 unpacked as all low nibbles then all high nibbles", ALL,
                     "lib.quant.bit_codecs:unpack_e2m1", _planar_unpack),
    "B02": Injection("B02", "FP4 sign bit ignored", ALL, "lib.quant.bit_codecs:_e2m1_value", _unsigned_e2m1),
    "B03": Injection("B03", "requantisation scale inverted", ALL, "lib.quant.runtime_formats:quantize_rows", _inverted_requant),
    "B04": Injection("B04", "E8M0 scale bytes value-converted on copy", ALL, "lib.quant.bit_codecs:e8m0_decode",
                     _value_converted_e8m0),
    # TP slicing is shared loader code: every backend that decodes an FP8 scale reads it
    "B05": Injection("B05", "scales of row-parallel linears not sliced for TP (rank 0's scales on every rank)",
                     ALL + ("cpu",), "lib.weights.tp_slices:part_index", _unsliced_tp_scales, min_tp=2),
    "B06": Injection("B06", "LM head treated as FP8 with an uninitialised scale", ALL,
                     "backends.{backend}._generated.loader:RUNTIME_FORMATS", _uninitialised_head,
                     (("__b06_fp8_head__", "lib.porting.faults:b06_fp8_head"),)),
    "B07": Injection("B07", "hash routing dropped: gate top-k in the hash layers", ALL,
                     "backends.common.moe:route_hash", _gate_topk_routing),
    "B08": Injection("B08", "swiglu_limit not applied", ALL, "backends.common.moe:clipped_swiglu",
                     _unclipped_swiglu),
    "B09": Injection("B09", "shared expert combined as routed + shared / 1.5", ALL, "backends.common.dense:add",
                     _shared_over_scale),
    "B10": Injection("B10", "grouped-matmul tail rows not zeroed", GMM, "backends.common.moe:valid_rows",
                     _keep_tail_rows),
    "B11": Injection("B11", "every EP rank uses rank 0's expert map", ALL, "lib.records.expert_placement:expert_placement",
                     _rank0_map),
    # paged decode state: only 310P's hybrid geometry (L19) makes logical and physical ids differ
    "B12": Injection("B12", "logical block id used as physical block id", ("ascend310p",),
                     "backends.common.paging:physical_slots", _logical_as_physical),
    "B13": Injection("B13", "compressed groups slotted by raw token positions", ALL, "lib.runtime.paged_cache:group_positions",
                     _raw_token_positions),
    "B14": Injection("B14", "every layer reads the last cache group's metadata", ALL, "lib.runtime.paged_cache:group_of",
                     _last_group),
    # drafter: only backends with a preconverted expert mode (profile expert_modes) have the flag
    "B17": Injection("B17", "drafter experts taken as already converted in expert mode preconverted",
                     PRECONVERTED, "backends.{backend}._generated.loader:EXPERT_MODES", _preconverted_means_converted,
                     (("__b17_taken_as_converted__", "lib.porting.faults:b17_taken_as_converted"),)),
    # the engine's logprob assembly is shared by every backend; the guard refuses mask indexing on all
    "B20": Injection("B20", "logprobs assembled with boolean-mask indexing", ALL,
                     "lib.engine.emit:token_logprobs", _mask_indexed_logprobs),
}


@contextlib.contextmanager
def injection(bug: str | None, backend: str):
    """Patch the bug into place for `backend` (no-op for None); restores on exit."""
    if bug is None:
        yield None
        return
    if bug not in CATALOGUE:
        raise ValueError(f"unknown injection '{bug}' (accepted: {', '.join(CATALOGUE)})")
    inj = CATALOGUE[bug]
    if backend not in inj.backends:
        raise ValueError(f"{bug} has no bug site on backend {backend} (it applies to {', '.join(inj.backends)})")
    module_name, _, attr = inj.target.format(backend=backend).partition(":")
    module = importlib.import_module(module_name)
    original = getattr(module, attr)
    setattr(module, attr, inj.make(original))
    converters = getattr(module, "CONVERTERS", {})
    converters.update(inj.converters)
    try:
        yield inj
    finally:
        setattr(module, attr, original)
        for fmt, _ in inj.converters:
            converters.pop(fmt, None)
