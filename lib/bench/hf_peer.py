"""transformers 5.23.0 DeepseekV4ForCausalLM: the independent peer, loaded from our checkpoints.

Loads an official-format checkpoint (FP8/FP4 + E8M0 scales, official key names) through the real
HF loader, dequantized on CPU, in fp32 (DSV4-REFERENCE §7). The parity tests use it as the
numerical oracle and `dsv4gen bench` as the speed baseline on the same weights. Must not know
about our runtime: it only reads the checkpoint folder.
"""
import json
import math
import re
from pathlib import Path

import torch

_SWA, _CSA, _HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# Official keys HF never reads: it hard-wires these values, so a config with other values
# would silently describe a different model than the one HF builds.
_HF_HARDWIRED = {"num_key_value_heads": 1, "n_shared_experts": 1, "norm_topk_prob": True,
                 "topk_method": "noaux_tc", "attention_bias": False}
# Copied as is and all required: the dataclass defaults mix Flash and Pro (§7.4 pitfall 1).
_COPIED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
           "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "rope_theta",
           "compress_rope_theta", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
           "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps", "n_routed_experts", "num_experts_per_tok",
           "moe_intermediate_size", "scoring_func", "routed_scaling_factor", "swiglu_limit")
# The strict dataclass rejects an int for these (e.g. "swiglu_limit": 10).
_FLOATS = ("hc_eps", "rms_norm_eps", "routed_scaling_factor", "swiglu_limit")
_OPTIONAL = ("max_position_embeddings", "hidden_act", "tie_word_embeddings")
_REQUIRED = _COPIED + ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling")


def hf_config_from_official(config: dict):
    """DeepseekV4Config for an official-format config.json dict (not modified)."""
    from transformers import DeepseekV4Config

    if missing := [k for k in _REQUIRED if k not in config]:
        raise KeyError(f"official config lacks {missing}")
    for key, want in _HF_HARDWIRED.items():
        if config.get(key, want) != want:
            raise ValueError(f"HF DeepSeek-V4 hard-wires {key}={want!r}; config has {config[key]!r}")
    n = config["num_hidden_layers"]
    # Trailing compress_ratios entries are MTP/DSpark stages, which HF does not build.
    ratios = config["compress_ratios"][:n]
    # HF maps only 0/4/128 itself and keeps one rate per type, so pass both explicitly.
    hca = sorted({r for r in ratios if r not in (0, 4)})
    if len(hca) > 1:
        raise ValueError(f"HF supports a single HCA ratio; compress_ratios has {hca}")
    kw = {k: float(config[k]) if k in _FLOATS else config[k] for k in _COPIED}
    kw.update({k: config[k] for k in _OPTIONAL if k in config})
    kw["layer_types"] = [_SWA if r == 0 else _CSA if r == 4 else _HCA for r in ratios]
    kw["compress_rates"] = {_CSA: 4, _HCA: hca[0] if hca else 128}
    kw["mlp_layer_types"] = ["hash_moe" if i < config["num_hash_layers"] else "moe" for i in range(n)]
    kw["partial_rotary_factor"] = config["qk_rope_head_dim"] / config["head_dim"]
    # HF makes this YaRN for the compress table only, with attention_factor 1.0 (copy:
    # the config's rope validation edits the dict in place).
    kw["rope_scaling"] = dict(config["rope_scaling"])
    if "quantization_config" in config:
        # Explicit dequantize: HF only does it by itself when no CUDA GPU >= SM89 is
        # visible; on one it would run FP8 GEMMs on dynamically quantized activations.
        # expert_dtype only matters to those kernels: the dequantizer spots FP4 by I8 dtype.
        kw["quantization_config"] = {"expert_dtype": config.get("expert_dtype", "fp8"),
                                     **config["quantization_config"], "dequantize": True}
    return DeepseekV4Config(**kw)


def _check_scales(ckpt_dir: Path, block: list[int]) -> None:
    """Every FP8/FP4 weight needs a `.scale` whose grid HF reads as the official block."""
    from safetensors import safe_open

    # HF's loading info stays empty when a scale is missing (raw codes are used unscaled)
    # or mis-shaped: Fp8Dequantize takes the block from the grid (rows // scale_rows),
    # never from weight_block_size. mtp.* is skipped because HF never loads it.
    meta, bad = {}, []
    for shard in sorted(ckpt_dir.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            meta.update({k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape())
                         for k in f.keys() if not k.startswith("mtp.")})
    for key, (dtype, (out, inp)) in ((k, v) for k, v in meta.items() if v[0] in ("F8_E4M3", "I8")):
        if dtype == "I8":  # FP4 experts: two codes per byte, one scale per 32 inputs
            want = [out, 2 * inp // 32]
        else:  # a partial block is read right only when it is the sole block along its dim
            want = [math.ceil(out / block[0]), math.ceil(inp / block[1])]
            if any(d > b and d % b for d, b in zip((out, inp), block)):
                bad.append(f"{key} {[out, inp]}: partial {block} block after a full one")
        got = meta.get(key.removesuffix(".weight") + ".scale")
        if got is None or list(got[1]) != want:
            bad.append(f"{key}: scale {got and list(got[1])}, want {want}")
    if bad:
        raise RuntimeError(f"HF would dequantize {ckpt_dir} wrongly: " + "; ".join(bad[:10]))


# Loader facts (checked on a tiny random official-format checkpoint, CPU torch 2.13):
# * FP8 needs `accelerate` even to dequantize (ImportError otherwise).
# * Key renames: conversion_mapping "deepseek_v4" plus the quantizer's `X.scale` ->
#   `X.weight_scale_inv`; routed experts are dequantized per expert, then merged.
# * Dequantized tensors are bit-identical to fp8/e2m1 code * 2^(e8m0 - 127), FP4 low nibble
#   first; a [64, k] weight with a [1, k/128] scale is fine.
# * Loading info lists missing, unexpected and mis-shaped keys (mtp.* filtered by HF);
#   missing/mis-shaped scales are silent, hence _check_scales.
# * dtype must be given: "auto" probes the shards and fails on F8_E8M0.
# * Load ~0.4 s for an 8 MB checkpoint, after ~4.5 s importing transformers.
def load_hf_model(ckpt_dir):
    """DeepseekV4ForCausalLM from an official checkpoint dir, fully loaded, fp32, eval."""
    from transformers import DeepseekV4ForCausalLM

    ckpt_dir = Path(ckpt_dir)
    config = hf_config_from_official(json.loads((ckpt_dir / "config.json").read_text()))
    if quant := getattr(config, "quantization_config", None):
        _check_scales(ckpt_dir, quant.get("weight_block_size") or [128, 128])
    model, info = DeepseekV4ForCausalLM.from_pretrained(
        ckpt_dir, config=config, dtype=torch.float32, output_loading_info=True)
    # A key the loader could not place leaves a randomly initialised tensor behind,
    # which would make every comparison meaningless: refuse to return such a model.
    # mtp.* (MTP / DSpark drafter) is not part of HF's model and rightly left out.
    bad = {k: sorted(str(x) for x in v if not re.match(r"mtp\.", str(x)))
           for k, v in info.items() if k != "error_msgs"}
    bad = {k: v for k, v in bad.items() if v}
    if bad or info.get("error_msgs"):
        raise RuntimeError(f"HF did not load {ckpt_dir} cleanly: {bad} {info.get('error_msgs')}")
    # BF16-stored tensors stay BF16 even with dtype=float32 (§7.4 pitfall 2).
    return model.float().eval()


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), vocab], one full forward, no cache."""
    out = model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0].float()


@torch.no_grad()
def hf_incremental_logits(model, ids: list[int], n_prefill: int) -> torch.Tensor:
    """Prefill ids[:n_prefill], then one token per step through HF's cache."""
    if not 1 <= n_prefill <= len(ids):
        raise ValueError(f"n_prefill must be in [1, {len(ids)}], got {n_prefill}")
    # The model builds its own DynamicCache with the per-type CSA/HCA/sliding layers.
    first = model(input_ids=torch.tensor([ids[:n_prefill]]), use_cache=True)
    out, cache = [first.logits[0]], first.past_key_values
    for t in range(n_prefill, len(ids)):
        out.append(model(input_ids=torch.tensor([[ids[t]]]), position_ids=torch.tensor([[t]]),
                         past_key_values=cache, use_cache=True).logits[0])
    return torch.cat(out).float()


# ---- what `dsv4gen bench` runs on the peer ----------------------------------------------------------------
PEER_VERSION = "5.23.0"


def missing_peer() -> list[str]:
    """Requirements for loading the peer that this environment lacks, as pip requirement strings."""
    import importlib.metadata as md

    missing = []
    for dist, want in (("transformers", PEER_VERSION), ("accelerate", None)):
        try:
            found = md.version(dist)
        except md.PackageNotFoundError:
            missing.append(f"{dist}=={want}" if want else dist)
            continue
        if want and found != want:
            missing.append(f"{dist}=={want} (found {found})")
    return missing


@torch.no_grad()
def hf_prefill(model, ids: list[list[int]], chunk: int):
    """Prefill equal-length prompts [B, T] in `chunk`-token pieces through HF's own cache.

    Returns (last-position logits [B, vocab], cache). Chunking is HF's own incremental path
    (cache + position_ids), the same split our engine makes; one 8K-token forward would build
    the eager [T, T + entries] attention matrices (~21 GB and ~15x slower on this machine)."""
    tokens = torch.tensor(ids)
    cache, logits = None, None
    for lo in range(0, tokens.shape[1], chunk):
        part = tokens[:, lo: lo + chunk]
        positions = torch.arange(lo, lo + part.shape[1]).expand(part.shape[0], -1)
        out = model(input_ids=part, position_ids=positions, past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
        cache, logits = out.past_key_values, out.logits[:, -1]
    return logits.float(), cache


@torch.no_grad()
def hf_decode_step(model, tokens: list[int], position: int, cache):
    """One greedy decode step for B sequences all at `position`: (logits [B, vocab], cache)."""
    out = model(input_ids=torch.tensor(tokens)[:, None], position_ids=torch.full((len(tokens), 1), position),
                past_key_values=cache, use_cache=True)
    return out.logits[:, -1].float(), out.past_key_values
