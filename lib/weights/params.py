"""The runtime parameter tree, built from a checkpoint by a backend's generated loader.

`Params` holds runtime tensors under their official keys: model-level ones in `model`, each
block's in `layers` (backbone, schedule order) or `drafter` (stages) relative to its prefix.
Routed experts are stacked per block into `[E, rows, cols]` under the key without `{expert}.`.
Under TP a rank reads only its slice of each split tensor, scales included (lib/weights/tp_slices.py, B05);
under EP only its own routed experts ([E/ep_size, ...], local order). Every logical tensor this
rank holds is read exactly once, and the ledger proves it (B06, B16).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from tqdm import tqdm

from lib.weights import tp_slices as shard
from lib.weights.checkpoint import Checkpoint, CheckpointError, LoadLedger
from lib.quant.reference_formats import resolve
from lib.quant.runtime_formats import W4A8, W8A8, PackedFP4
from lib.records.expert_placement import expert_placement
from spec.schedule import LayerInfo, schedule
from spec.tables import Logical, block_experts, load_tensor_table


class Params(NamedTuple):
    model: dict[str, torch.Tensor]
    layers: tuple[dict[str, torch.Tensor], ...]
    drafter: tuple[dict[str, torch.Tensor], ...]
    # The layer schedule, derived once at load (spec/schedule.py): the generated forward walks these
    # beside `layers` / `drafter` and never re-derives them from the config.
    backbone_layers: tuple[LayerInfo, ...] = ()
    drafter_layers: tuple[LayerInfo, ...] = ()


class LoadFaults(NamedTuple):
    """Load-time fault sites, passed in explicitly (lib/porting/faults.py re-introduces catalogued
    field bugs through them): None is the correct code, a function is what the field's port ran."""
    stored_parts: Callable | None = None       # (logical, parts) -> the stored bytes as the port read them
    part_index: Callable | None = None         # TP slicing of a tensor's stored parts (tp_slices.part_index)
    expert_placement: Callable | None = None   # EP expert map (lib/records/expert_placement.py)
    fused_choice: Callable | None = None       # (kernels, cfg, relax_widths) -> fused kernels chosen (spec/fused.py chosen)
    merged_layout: Callable | None = None      # (first key, the profile's layout) -> the layout the port merged with
    engram_params: Callable | None = None      # V4.1 Engram hash parameters -> the ones the port hashed with


class LoadOptions(NamedTuple):
    """Load-time choices that change runtime formats or placement, never the model's meaning."""
    expert_mode: str | None = None     # backend expert mode (ascend310p: resident | streaming | preconverted)
    ep_size: int = 1                   # expert-parallel group size
    ep_rank: int = 0                   # this process's EP rank
    ep_simulate: bool = False          # run every EP rank's share in this process (conformance)
    tp_size: int = 1                   # tensor-parallel group size: tensors with a `tp` rule are sliced
    tp_rank: int = 0                   # this process's TP rank (its slice of every TP-split tensor)
    ep_group: object = None            # torch.distributed group of the EP ranks (None: no EP communication)
    ep_dispatch: str = "allgather"     # EP token exchange: "allgather" (310P) or "alltoall"
    preconverted: str | None = None    # folder written by `dsv4gen convert` (expert mode preconverted)
    backend: str | None = None         # set by the runtime: whose preconverted experts to read
    faults: LoadFaults = LoadFaults()  # re-introduced field bugs (conformance only)


def stack(values: list):
    """Stack per-expert runtime values: tensors, or records (NamedTuples) of tensors field by field."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(values)
    return type(first)(*(torch.stack(parts) for parts in zip(*values)))


def runtime_key(logical: Logical) -> str:
    """Key inside its scope's dict: official key relative to the block, experts un-numbered."""
    return logical.entry.key.replace("{expert}.", "")


def reads_preconverted(logical: Logical) -> bool:
    """Whether a tensor comes from the preconverted shards: the target's routed experts only.
    Drafter experts are decoded from their own stored format whatever the target's mode (B17)."""
    return logical.entry.tensor_class == "routed_expert" and logical.layer.role == "backbone"


def own_experts(cfg, options: LoadOptions, layer=None) -> range:
    """Global ids of the routed experts of a block (`layer`; the backbone's without one) this process loads:
    every expert, or under EP (not simulated) its rank's contiguous share, the range lib.records.expert_placement
    gives it (placement_for_block builds the same for every block). V4.1's DSpark stages have experts of their
    own (spec/tables.py block_experts), split alike."""
    n = block_experts(cfg, layer)
    if options.ep_simulate or options.ep_size == 1:
        return range(n)
    share = expert_placement(n, options.ep_size, options.ep_rank).experts_of(options.ep_rank)
    return range(share.start, share.stop)


def load_params(ckpt: Checkpoint, converter_for: Callable[[Logical], str], progress: bool = False,
                options: LoadOptions = LoadOptions(), merged: tuple[tuple[str, str, str], ...] = ()) -> Params:
    """Convert every logical tensor with the converter the backend's table names for it, hold each `merged`
    (first, second, layout) of a block as one weight (merge_outputs), then build the derived runtime parameters (tensors.yaml
    `derived`)."""
    # refuse a TP or EP size the config cannot be split by before reading anything
    shard.check_tp(ckpt.config, ckpt.logical, options.tp_size, options.tp_rank)
    own = {}                             # block prefix -> the experts this process loads of it
    ledger = LoadLedger(ckpt.logical)
    model: dict[str, torch.Tensor] = {}
    blocks: dict[str, dict[str, object]] = {}
    expert_parts: dict[tuple[str, str], list[torch.Tensor]] = {}
    other_ranks: set[str] = set()        # routed experts another EP rank loads: never read here
    store = _preconverted(ckpt, options)
    n_local = ckpt.config.n_routed_experts // options.ep_size
    items = tqdm(ckpt.logical, desc="loading weights", unit="tensor", disable=not progress, leave=False)
    for t in items:
        if t.expert is not None and t.layer.prefix not in own:       # each block's share once, not per tensor
            own[t.layer.prefix] = own_experts(ckpt.config, options, t.layer)
        if t.expert is not None and t.expert not in own[t.layer.prefix]:
            other_ranks.add(t.key)
            continue
        if store is not None and reads_preconverted(t):
            ledger.mark(t)                  # read once, from the converted shards instead
            value = store.read(t.key, t.expert, n_local)
        else:
            index = (options.faults.part_index or shard.part_index)(t, ckpt.config, options.tp_size, options.tp_rank)
            parts = ckpt.read_parts(t, ledger, index)
            check_copies(ckpt, t, parts, index)
            if options.faults.stored_parts is not None:
                parts = options.faults.stored_parts(t, parts)
            value = resolve(converter_for(t))(t.format, parts, ckpt.config)
        if t.layer is None:
            model[runtime_key(t)] = value
        elif t.expert is not None:
            expert_parts.setdefault((t.layer.prefix, runtime_key(t)), []).append(value)
        else:
            blocks.setdefault(t.layer.prefix, {})[runtime_key(t)] = value
    for (prefix, key), values in expert_parts.items():
        blocks.setdefault(prefix, {})[key] = stack(values)   # [E or E/ep_size, rows, cols], expert order
    ledger.check(other_ranks=other_ranks)
    for block in blocks.values():
        for first, second, layout in merged:
            if options.faults.merged_layout is not None:
                layout = options.faults.merged_layout(first, layout)
            if first in block and second in block:
                block[first], block[second] = merged_pair(block[first], block[second], layout)
    _add_derived(blocks, model, ckpt.config, options)
    infos = schedule(ckpt.config)
    n = ckpt.config.num_hidden_layers
    layers = tuple(blocks.get(info.prefix, {}) for info in infos[:n])
    drafter = tuple(blocks.get(info.prefix, {}) for info in infos[n:])
    return Params(model, layers, drafter, infos[:n], infos[n:])


def check_copies(ckpt: Checkpoint, logical: Logical, parts: dict[str, torch.Tensor], index) -> None:
    """A copy of this tensor the checkpoint also saves (a V4.1 ModelSlim drafter's vocabulary) must hold the same
    bytes: the runtime reads one tensor for both, and applies no rotation (QuaRot) that would tell them apart."""
    copy = ckpt.copy_of.get(logical.key)
    if copy is None:
        return
    (role, value), = parts.items()
    theirs = ckpt.read(copy, None if index is None else index[role].index())
    if not torch.equal(theirs.view(torch.uint8), value.view(torch.uint8)):
        raise CheckpointError(f"{ckpt.headers[copy].shard}: {copy}: differs from {logical.key}, which it copies; "
                              f"the runtime shares the backbone's vocabulary with the drafter and applies no "
                              f"rotation (a QuaRot-rotated export is not supported)")


def merged_pair(first, second, layout: str):
    """What a block holds under the two keys of a merged pair: the one weight, then None, or for "stacked" (a
    shared_inputs pair with one_gemm) a W8A8 view of the second's rows, which a lone use of the second reads."""
    if layout != "stacked":
        return merge_outputs(first, second, layout), None
    if not isinstance(first, W8A8) or not isinstance(second, W8A8):
        raise TypeError(f"stacked weights are W8A8 rows, got {type(first).__name__} and {type(second).__name__}")
    merged = merge_outputs(first, second, "halves")
    n = second.qweight.shape[-2]
    return merged, W8A8(merged.qweight[..., -n:, :], merged.scale[..., -n:])     # contiguous rows: no copy


def merge_outputs(first, second, layout: str = "halves"):
    """One weight computing both projections, in their runtime format (a plain [..., N, K] tensor, W8A8 rows
    [..., N, K] with scales [..., N], W4A8 [..., K, N/8] packed along N with scales [..., N], packed MXFP4 rows
    [..., N, K/2] with block scales [..., N, K/32], halves only). Its GEMM gives
    [..., 2N]: the first's outputs then the second's ("halves"), or output 2j the first's j-th and 2j+1 the
    second's ("interleaved"; both N equal)."""
    if type(first) is not type(second):
        raise TypeError(f"merged weights need one runtime format, got {type(first).__name__} and {type(second).__name__}")
    if layout not in ("halves", "interleaved"):
        raise ValueError(f"merged weight layout '{layout}' (accepted: halves, interleaved)")
    if isinstance(first, torch.Tensor):
        return _join(first, second, -2, layout)
    if isinstance(first, W4A8):
        if layout == "interleaved":     # the outputs are packed 8 to a word: interleave the codes, then repack
            return W4A8(_interleave_int4(first.qweight, second.qweight), _join(first.scale, second.scale, -1, layout))
        return W4A8(torch.cat((first.qweight, second.qweight), dim=-1), torch.cat((first.scale, second.scale), dim=-1))
    if isinstance(first, W8A8):
        return W8A8(_join(first.qweight, second.qweight, -2, layout), _join(first.scale, second.scale, -1, layout))
    if isinstance(first, PackedFP4) and layout == "halves":     # rows [..., N, K/2] and their block scales [..., N, K/32]
        return PackedFP4(torch.cat((first.weight, second.weight), dim=-2), torch.cat((first.scale, second.scale), dim=-2))
    raise TypeError(f"no output-row concatenation for runtime format {type(first).__name__}")


def _interleave_int4(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Packed int4 words [..., K, N/8] of two weights -> [..., K, 2N/8], output 2j a's j-th and 2j+1 b's j-th; one
    [K, N/8] matrix at a time, because unpacking goes through int64 (a whole Flash layer's experts at once would
    take gigabytes)."""
    from lib.emulation.int_numerics import pack_int4, unpack_int4

    if a.shape != b.shape:
        raise ValueError(f"interleaved merged weights need one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    lead, (k, words) = a.shape[:-2], a.shape[-2:]
    pairs = zip(a.reshape(-1, k, words), b.reshape(-1, k, words))
    out = [pack_int4(_join(unpack_int4(x), unpack_int4(y), -1, "interleaved")) for x, y in pairs]
    return torch.stack(out).reshape(*lead, k, 2 * words)


def _join(a: torch.Tensor, b: torch.Tensor, dim: int, layout: str) -> torch.Tensor:
    """a and b along output dim `dim`: one after the other, or alternating (a's j-th, then b's j-th)."""
    if layout == "halves":
        return torch.cat((a, b), dim=dim)
    if a.shape != b.shape:
        raise ValueError(f"interleaved merged weights need one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    return torch.stack((a, b), dim=dim).flatten(dim - 1, dim) if dim < 0 else torch.stack((a, b), dim + 1).flatten(dim, dim + 1)


def _add_derived(blocks: dict, model: dict, cfg, options: LoadOptions) -> None:
    table = load_tensor_table()
    for d in table.derived:
        build = resolve(d.build)
        if d.scope == "model":
            model[d.key] = build(cfg, None, options)
            continue
        for layer in schedule(cfg):
            if d.when.matches(layer):
                blocks.setdefault(layer.prefix, {})[d.key] = build(cfg, layer, options)


def _preconverted(ckpt: Checkpoint, options: LoadOptions):
    if options.expert_mode != "preconverted":
        return None
    from lib.weights.expert_conversion import PreconvertedExperts, default_dir

    root = options.preconverted or default_dir(ckpt.root, options.backend, options.tp_size, options.ep_size)
    return PreconvertedExperts(root, options.backend, ckpt, ep=options.ep_size, tp=options.tp_size)
