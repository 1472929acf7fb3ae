"""The fault-injection catalogue: field bugs (data/porting-lessons.yaml B01-B22) re-introduced into a
backend's code path, so conformance can prove it catches each one; four pitfalls of the fused kernels
(F01-F04: a fused path's own wrong turn, ascend910; F03 shows only where the fused compressor runs, in
`--context` conformance); two long-context bugs (C01, C02, lib/porting/state_faults.py) that only
`--context` conformance can see; and DeepSeek-V4.1's own pitfalls (V01-V03, lib/porting/v41_faults.py), which
only a V4.1 checkpoint exercises.

Nothing is patched. A bug reaches the backend the way the field port carried it, through one of
the code's explicit fault sites: the generated code rendered again with the wrong call, argument
or runtime-format table (codegen Rewrite, into a temporary package the device model is loaded
from); the loader's LoadFaults (the stored bytes as the port read them, TP slicing, the EP map);
the paged state's address arithmetic and pool sharing (PagedSites, passed to PagedCache); V4.1's Engram hash
parameters (LoadFaults); the engine's logprob scorer. `with injection(bug, backend) as fault`
yields what to pass where; conformance loads and runs only the device backend with it.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, NamedTuple

import torch

from codegen.lower import Rewrite
from lib.engine.sampling import TokenLogprobs, token_logprobs
from lib.porting import state_faults as state
from lib.porting import v41_faults as v41
from lib.porting.rendering import rendered
from lib.quant import bit_codecs, reference_formats
from lib.quant.runtime_formats import W8A8, to_w4a8_channel, to_w8a8_group, to_w8a8_row
from lib.records.addressing import PagedSites
from lib.records.expert_placement import expert_placement
from lib.runtime.loaded_model import Generated
from lib.weights.params import LoadFaults, LoadOptions
from lib.weights.tp_slices import part_index
from spec.fused import chosen

ALL = ("ascend310p", "ascend910", "hip936")
GMM = ("ascend310p", "ascend910")
PRECONVERTED = ("ascend310p",)
V41 = ("deepseek_v41",)


class Injection(NamedTuple):
    bug: str                         # lesson id
    what: str
    backends: tuple[str, ...]        # backends whose code path has the bug site
    rewrite: Callable[[str], Rewrite] | None = None   # backend -> how its generated code is rendered wrong
    load: LoadFaults = LoadFaults()
    paged: PagedSites = PagedSites()
    logprob_scorer: Callable = token_logprobs
    min_tp: int = 1                  # TP size the bug site needs: B05 shows only on a rank past 0 of TP >= 2
    min_context: int = 0             # positions before the bug changes anything (C01, C02: long-context conformance)
    strict_widths: bool = False      # conformance keeps the fused kernels' width limits (F02: the bug is skipping them)
    models: tuple[str, ...] = ("deepseek_v4",)   # the generations (config model_type) whose code has the bug site

    @property
    def load_only(self) -> bool:
        """Whether every site of the bug is a load-time one (what each rank of a TP / EP launch gets)."""
        return self.rewrite is None and self.paged == PagedSites() and self.logprob_scorer is token_logprobs


class Faulted(NamedTuple):
    """What a run passes explicitly to put one injected bug in place (the correct code for None)."""
    injection: Injection | None
    code: Generated | None           # the device's generated package (None: the checked-in one)

    def options(self, options: LoadOptions) -> LoadOptions:
        return options if self.injection is None else options._replace(faults=self.injection.load)

    @property
    def paged(self) -> PagedSites:
        return PagedSites() if self.injection is None else self.injection.paged

    @property
    def logprob_scorer(self) -> Callable:
        return token_logprobs if self.injection is None else self.injection.logprob_scorer


# ---- load-time sites: the stored bytes as the port read them --------------------------------------
def _nibbles(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b = packed.view(torch.uint8)
    return b & 0xF, b >> 4


def planar_nibbles(logical, parts: dict) -> dict:
    """B01: MXFP4 unpacked as all low nibbles, then all high nibbles. The bytes are rearranged so the
    correct unpack yields exactly the codes the planar unpack gave: row codes [low..., high...]."""
    if logical.format != "mxfp4":
        return parts
    low, high = _nibbles(parts["weight"])
    codes = torch.cat((low, high), dim=-1)                         # [..., K]: what the port decoded
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return {**parts, "weight": packed.to(torch.uint8).view(torch.int8)}


def unsigned_e2m1(logical, parts: dict) -> dict:
    """B02: the FP4 sign bit ignored (every code read as code & 7)."""
    if logical.format != "mxfp4":
        return parts
    return {**parts, "weight": (parts["weight"].view(torch.uint8) & 0x77).view(torch.int8)}


def value_converted_e8m0(logical, parts: dict) -> dict:
    """B04: E8M0 scale bytes value-converted on copy: byte b became the E8M0 nearest to the number b
    (2^round(log2 b)), so every block scale is between 1 and 256."""
    if "scale" not in parts:
        return parts
    bits = bit_codecs.as_bits(parts["scale"]).float().clamp_min(1)
    converted = (127 + torch.round(torch.log2(bits))).to(torch.uint8)
    return {**parts, "scale": converted.view(parts["scale"].dtype)}


def unsliced_tp_scales(logical, cfg, tp_size, tp_rank):
    """B05: the weight of a row-parallel linear (tp: cols, wo_b) is sliced for TP but its scale is not.
    The field's full scale (32, 64) met a rank's (32, 8) buffer and tripped a load assert; the silent
    form of the same bug copies the full scale into that buffer from its start, so every rank gets
    rank 0's scale blocks. That form loads on every backend and is wrong only in the numbers."""
    index = part_index(logical, cfg, tp_size, tp_rank)
    if index is None or logical.entry.tp != "cols" or "scale" not in index:
        return index
    scale = index["scale"]
    return {**index, "scale": scale._replace(start=0, stop=scale.stop - scale.start)}


def rank0_placement(n_experts, ep_size=1, rank=0, simulate=False):
    """B11: every EP rank uses rank 0's expert map."""
    p = expert_placement(n_experts, ep_size, rank, simulate)
    return p._replace(local_of=p.local_of[:1].expand_as(p.local_of).contiguous())


def inverted_quantize_rows(w, qmax=127):
    """B03: the requantisation multiplies by the scale instead of dividing."""
    amax = w.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    q = torch.round(w * scale.unsqueeze(-1)).clamp(-qmax, qmax).to(torch.int8)
    return W8A8(q, scale.float())


inverted_to_w8a8_row = functools.partial(to_w8a8_row, quantize=inverted_quantize_rows)
inverted_to_w8a8_group = functools.partial(to_w8a8_group, quantize=inverted_quantize_rows)
inverted_to_w4a8_channel = functools.partial(to_w4a8_channel, quantize=inverted_quantize_rows)


def b06_fp8_head(storage, parts, cfg):
    """B06: the loader treats the BF16 head as FP8 and multiplies it by a scale that was never
    loaded (whatever memory held)."""
    value = reference_formats.decode(storage, parts, cfg).float()
    gen = torch.Generator().manual_seed(6)
    garbage = torch.exp2(torch.randint(-20, 20, (value.shape[0], 1), generator=gen).float())
    return value * garbage


def b17_taken_as_converted(storage, parts, cfg):
    """B17: the drafter's stored MXFP4 expert used as the W8A8 record it was assumed to be: buffers of the
    runtime shapes filled with the stored bytes as they are (packed FP4 codes as int8 weights, the E8M0
    exponent bytes read on as float32 row scales, ~1e35 each: expert outputs overflow, the field's NaN)."""
    weight, scale = parts["weight"], bit_codecs.as_bits(parts["scale"])
    rows, cols = weight.shape[0], weight.shape[1] * 2
    qweight = torch.zeros(rows, cols, dtype=torch.int8)
    qweight.view(-1)[: weight.numel()] = weight.reshape(-1).view(torch.int8)
    raw = torch.cat((scale.reshape(-1), weight.reshape(-1).view(torch.uint8)))   # the scale buffer runs on
    return W8A8(qweight, raw[: 4 * rows].clone().view(torch.float32))


# ---- forward sites: calls the generated code makes ------------------------------------------------
def gate_topk_route_hash(x, gate, tid2eid, tokens, route_scale):
    """B07: hash layers routed by the gate's top-k instead of tid2eid."""
    from backends.common import moe

    scores = moe._scores(x, gate)
    ids = torch.topk(scores, tid2eid.shape[1], dim=-1).indices.to(torch.int32)
    return moe._weights(scores, ids, route_scale), ids


def comb_before_sinkhorn(x, fn, base, scale, iters, norm_eps, hc_eps):
    """F01: the fused path's h_res (comb) taken before the Sinkhorn normalisation: softmax + eps only,
    rows and columns no longer summing to one, so the streams grow or fade layer by layer."""
    from backends.ascend910 import lowerings
    from backends.common import hc

    u, post, _ = lowerings.hc_pre_fused(x, fn, base, scale, iters, norm_eps, hc_eps)
    n = x.shape[1]
    m = hc._mix(x, fn, norm_eps)
    logits = scale.float()[2] * m[:, 2 * n:] + base.float()[2 * n:]
    return u, post, torch.softmax(logits.unflatten(-1, (n, n)), dim=-1) + hc_eps


def compressor_table_without_slot0(h, batch, pools, wkv, wgate, ape, norm, *, ratio, overlap, eps, angles, rope_dim):
    """F03: the fused compressor's state block table made of the slots themselves, without the + 1 that steps over
    the pool's unused block 0: every sequence stores and reads its projections in the slot before its own (its
    neighbour's), and the sequence in slot 0 stores nothing (the kernel skips every write to block 0), so the
    entries a decode step completes pool another sequence's rows."""
    from backends.ascend910 import fused_attention

    addr, ring = batch.state, pools.state.shape[1]
    if fused_attention.compressor_takes(batch, ring, ratio=ratio, overlap=overlap, angles=angles):
        rows = dict(addr.rows)
        rows[("state_table", ring)] = addr.rows[("state_table", ring)] - 1
        batch = batch._replace(state=addr._replace(rows=rows))
    return fused_attention.compress_fused(h, batch, pools, wkv, wgate, ape, norm, ratio=ratio, overlap=overlap,
                                          eps=eps, angles=angles, rope_dim=rope_dim)


def halves_merge(first: str, layout: str) -> str:
    """F04: gate | up merged one after the other (the merge's default layout) although the kernel that reads the
    GEMM, npu_dequant_swiglu_quant's clipped SwiGLU (swiglu_mode 1), takes the gate from the even columns and up
    from the odd ones: every activation mixes gate and up rows. Other merges keep their layout."""
    return "halves" if layout == "interleaved" else layout


def unchecked_fused_widths(kernels, cfg, relax_widths=False):
    """F02: a fused kernel chosen without its width limit (only the other limits checked), so it runs
    at a hidden size it is not built for; the device refuses (here: the emulation's own check)."""
    return chosen(kernels, cfg, relax_widths=True)


# ---- engine sites (the paged state's: lib/porting/state_faults.py) ----------------------------------
def mask_indexed_logprobs(logits, token_ids, top):
    """B20: the chosen token's logprob picked out by a boolean mask (nonzero on the device, L12)."""
    logp = torch.log_softmax(logits.float(), -1)
    hit = torch.arange(logp.shape[-1], device=logp.device) == token_ids.long().unsqueeze(-1)   # [R, V]
    chosen = logp[hit]
    top_logprobs, top_ids = logp.topk(top, dim=-1)
    return TokenLogprobs(chosen, (logp > chosen.unsqueeze(-1)).sum(-1) + 1, top_ids, top_logprobs)


def _rewrite(**fields) -> Callable[[str], Rewrite]:
    return lambda backend: Rewrite(**fields)


def _inverted_requant(backend: str) -> Rewrite:
    # load-time requantisation everywhere; at run time where routed experts are requantised per step
    converters = {"w8a8_row": "lib.porting.faults:inverted_to_w8a8_row",
                  "w8a8_group": "lib.porting.faults:inverted_to_w8a8_group",
                  "w4a8_channel": "lib.porting.faults:inverted_to_w4a8_channel"}
    runtime = {"routed_experts": {"quantize": "lib.porting.faults:inverted_quantize_rows"}}
    return Rewrite(converters=converters, kwargs=runtime if backend in ("ascend310p", "hip936") else {})


UNCLIPPED = {"limit": "float('inf')"}
# F03 changes nothing until a decode step's compressor runs fused (a `--context` run of the tiny-long preset: the
# tiny preset's ratio 8 is not one the kernel takes) and an entry pools a position that step stored
F03_SHOWS_FROM = 64

CATALOGUE: dict[str, Injection] = {
    "B01": Injection("B01", "MXFP4 unpacked as all low nibbles then all high nibbles", ALL,
                     load=LoadFaults(stored_parts=planar_nibbles)),
    "B02": Injection("B02", "FP4 sign bit ignored", ALL, load=LoadFaults(stored_parts=unsigned_e2m1)),
    "B03": Injection("B03", "requantisation scale inverted", ALL, rewrite=_inverted_requant),
    "B04": Injection("B04", "E8M0 scale bytes value-converted on copy", ALL,
                     load=LoadFaults(stored_parts=value_converted_e8m0)),
    # TP slicing is shared loader code: every backend that decodes an FP8 scale reads it
    "B05": Injection("B05", "scales of row-parallel linears not sliced for TP (rank 0's scales on every rank)",
                     ALL + ("cpu",), load=LoadFaults(part_index=unsliced_tp_scales), min_tp=2),
    "B06": Injection("B06", "LM head treated as FP8 with an uninitialised scale", ALL,
                     rewrite=_rewrite(runtime_formats={"head": "__b06_fp8_head__"},
                                      converters={"__b06_fp8_head__": "lib.porting.faults:b06_fp8_head"})),
    "B07": Injection("B07", "hash routing dropped: gate top-k in the hash layers", ALL,
                     rewrite=_rewrite(calls={"route_hash": "lib.porting.faults:gate_topk_route_hash",
                                             "route_hash@gating": "lib.porting.faults:gate_topk_route_hash"})),
    "B08": Injection("B08", "swiglu_limit not applied", ALL,
                     rewrite=_rewrite(kwargs={"routed_experts": UNCLIPPED, "swiglu_mlp": UNCLIPPED})),
    "B09": Injection("B09", "shared expert combined as routed + shared / 1.5", ALL,
                     rewrite=_rewrite(kwargs={"routed_experts": {"shared_weight": "1 / 1.5"}})),
    "B10": Injection("B10", "grouped-matmul tail rows not zeroed", GMM,
                     rewrite=_rewrite(kwargs={"routed_experts": {"zero_tail": "False"}})),
    "B11": Injection("B11", "every EP rank uses rank 0's expert map", ALL,
                     load=LoadFaults(expert_placement=rank0_placement)),
    # paged decode state: only 310P's hybrid geometry (L19) makes logical and physical ids differ
    "B12": Injection("B12", "logical block id used as physical block id", ("ascend310p",),
                     paged=PagedSites(physical_slots=state.logical_as_physical)),
    "B13": Injection("B13", "compressed entries slotted by raw token positions", ALL,
                     paged=PagedSites(entry_ids=state.raw_token_positions)),
    "B14": Injection("B14", "every layer reads the last entry group's block tables", ALL,
                     paged=PagedSites(group_of=state.last_group)),
    # drafter: only backends with a preconverted expert mode (profile expert_modes) have the flag
    "B17": Injection("B17", "drafter experts taken as already converted in expert mode preconverted", PRECONVERTED,
                     rewrite=_rewrite(expert_modes={"preconverted": "__b17_taken_as_converted__"},
                                      converters={"__b17_taken_as_converted__":
                                                  "lib.porting.faults:b17_taken_as_converted"})),
    # the engine's logprob assembly is shared by every backend; the guard refuses mask indexing on all
    "B20": Injection("B20", "logprobs assembled with boolean-mask indexing", ALL, logprob_scorer=mask_indexed_logprobs),
    # long-context bugs (not from the field): exact below min_context positions, so only
    # `--context` conformance past that length can see them
    # the fused kernels' own pitfalls (ascend910 only: no other profile has a fused kernel)
    "F01": Injection("F01", "fused mHC: h_res (comb) taken before the Sinkhorn normalisation", ("ascend910",),
                     rewrite=_rewrite(calls={"hc_pre@mhc": "lib.porting.faults:comb_before_sinkhorn"})),
    "F02": Injection("F02", "fused mHC chosen without its width limit (hidden size outside {4096, 7168})",
                     ("ascend910",), load=LoadFaults(fused_choice=unchecked_fused_widths), strict_widths=True),
    "F03": Injection("F03", "fused compressor state table without the + 1 over the unused block 0 (each sequence in "
                     "its neighbour's slot)", ("ascend910",), rewrite=_rewrite(calls={
                         "compress@compressor": "lib.porting.faults:compressor_table_without_slot0"}),
                     min_context=F03_SHOWS_FROM),
    "F04": Injection("F04", "merged gate | up held as halves while npu_dequant_swiglu_quant reads even | odd columns",
                     ("ascend910",), load=LoadFaults(merged_layout=halves_merge)),
    "C01": Injection("C01", "compressed-entry RoPE positions carried in float16 (one window off past 8192)", ALL,
                     rewrite=_rewrite(calls={"compress": "lib.porting.state_faults:fp16_entry_positions",
                                             "compress@compressor": "lib.porting.state_faults:fp16_entry_positions_fused"}),
                     min_context=state.C01_SHOWS_FROM),
    "C02": Injection("C02", "indexer top-k restarted per block of entries (only the last block's survives)", ALL,
                     rewrite=_rewrite(calls={"index_select": "lib.porting.state_faults:last_block_top_k",
                                             "index_select@indexer": "lib.porting.state_faults:last_block_top_k"}),
                     min_context=state.C02_SHOWS_FROM),
    # DeepSeek-V4.1's own pitfalls (lib/porting/v41_faults.py)
    "V01": Injection("V01", "a layer after a KV source reads its own never-written pools instead of its source's",
                     ALL, paged=PagedSites(reused_pools=v41.own_unwritten_pools), models=V41),
    "V02": Injection("V02", "Engram bucket primes handed to each order's heads in reverse (wrong prime per head)",
                     ALL, load=LoadFaults(engram_params=v41.reversed_head_primes), models=V41),
    "V03": Injection("V03", "each sub-layer's streams collapsed with its own pre, not the previous sub-layer's",
                     ALL, rewrite=_rewrite(args=v41.OWN_PRE_WIRING), models=V41),
}

def check(bug: str, backend: str, model_type: str | None = None) -> Injection:
    if bug not in CATALOGUE:
        raise ValueError(f"unknown injection '{bug}' (accepted: {', '.join(CATALOGUE)})")
    inj = CATALOGUE[bug]
    if backend not in inj.backends:
        raise ValueError(f"{bug} has no bug site on backend {backend} (it applies to {', '.join(inj.backends)})")
    if model_type is not None and model_type not in inj.models:
        raise ValueError(f"{bug} has no bug site in a {model_type} checkpoint's code path (it applies to "
                         f"{', '.join(inj.models)} checkpoints)")
    return inj


@contextlib.contextmanager
def injection(bug: str | None, backend: str, model_type: str | None = None):
    """Yield the Faulted record that puts `bug` in place on `backend` (the correct code for None) for a checkpoint of
    `model_type` (None: not checked); a rendered package lives in a temporary folder for the duration of the block."""
    if bug is None:
        yield Faulted(None, None)
        return
    inj = check(bug, backend, model_type)
    if inj.rewrite is None:
        yield Faulted(inj, None)
        return
    with rendered(backend, inj.rewrite(backend), bug) as code:
        yield Faulted(inj, code)
