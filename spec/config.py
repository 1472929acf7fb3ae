"""The model configuration, named with the official `config.json` keys (DSV4-REFERENCE §1.1).

`ModelConfig` is the one typed view of a DeepSeek-V4 config, whether it comes from a spec variant
or from a checkpoint's `config.json`. Derived facts (drafter kind, layer kinds) live in
`spec.schedule`; this module only holds and validates the keys.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import msgspec

from spec.config_nesting import NESTED_MODEL_TYPES, flatten, is_nested, nest
from spec.yamlio import SpecError, decode


class RopeScaling(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    type: Literal["yarn"]
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float


class QuantizationConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True,
                         omit_defaults=True):
    quant_method: Literal["fp8"]
    # V4 writes `fmt: e4m3`; V4.1's quantization_config has no `fmt` key (V41-REFERENCE §1.1, from
    # the release config.json: [CFG] code-index id 71473622996, [REL] id 68878548201)
    fmt: Literal["e4m3"] | None = None
    scale_fmt: Literal["ue8m0"]
    weight_block_size: tuple[int, int]
    activation_scheme: Literal["dynamic"]


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: Literal[1]          # one shared K=V head (MQA)
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]         # backbone layers, then one entry per drafter stage
    compress_rope_theta: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: Literal[1]
    moe_intermediate_size: int
    scoring_func: Literal["sqrtsoftplus"]
    topk_method: Literal["noaux_tc"]
    norm_topk_prob: Literal[True]
    routed_scaling_factor: float
    swiglu_limit: float
    num_hash_layers: int = 0                 # V4.1 omits the key: no hash-routed layer
    num_nextn_predict_layers: int
    expert_dtype: Literal["fp4", "fp8"]
    quantization_config: QuantizationConfig
    bos_token_id: int
    eos_token_id: int
    tie_word_embeddings: Literal[False]
    hidden_act: Literal["silu"]
    attention_bias: Literal[False]
    torch_dtype: Literal["bfloat16"]
    architectures: tuple[str, ...] = ("DeepseekV4ForCausalLM",)
    model_type: Literal["deepseek_v4", "deepseek_v41"] = "deepseek_v4"
    # DeepSeek-V4-Flash-0731 only: the DSpark drafter (DSV4-REFERENCE §5.2)
    dspark_block_size: int | None = None
    dspark_noise_token_id: int | None = None
    dspark_target_layer_ids: tuple[int, ...] | None = None
    dspark_markov_rank: int | None = None
    # DeepSeek-V4.1-Flash only (V41-REFERENCE §1.2-1.4; its config.json nests these under
    # `text_config` / `vision_config`, the spec flattens them, vision keys with a `vision_` prefix).
    # All absent for V4: every compressed layer then owns its compressor and indexer.
    kv_source_layer_ids: tuple[int, ...] | None = None      # layers that run a compressor
    index_source_layer_ids: tuple[int, ...] | None = None   # layers that run an indexer query side
    candidate_source_layer_id: int | None = None            # the layer that writes candidate blocks
    candidate_topk_blocks: int | None = None
    candidate_block_size: int | None = None
    engram_layer_ids: tuple[int, ...] | None = None         # layers with an Engram table before them
    engram_num_embeddings: tuple[int, ...] | None = None    # table rows, one per engram_layer_ids entry
    engram_max_ngram_size: int | None = None
    engram_vocab_size: int | None = None
    engram_n_heads: int | None = None
    engram_head_dim: int | None = None
    engram_pad_token_id: int | None = None
    engram_compressed_vocab_size: int | None = None
    dspark_n_routed_experts: int | None = None              # the drafter stages' own MoE width
    dspark_num_experts_per_tok: int | None = None
    image_token_id: int | None = None
    vision_num_hidden_layers: int | None = None             # vision_config.num_hidden_layers
    vision_hidden_size: int | None = None
    vision_num_attention_heads: int | None = None
    vision_intermediate_size: int | None = None
    vision_patch_size: int | None = None
    vision_rope_theta: float | None = None
    vision_downsample_ratio: int | None = None
    vision_max_image_tokens: int | None = None
    vision_min_pixels: int | None = None

    def to_json_dict(self) -> dict:
        """The config's flat keys (absent optional keys omitted): V4's `config.json` object as it is."""
        out = msgspec.to_builtins(self)
        return {k: v for k, v in out.items() if v is not None}

    def config_json(self) -> dict:
        """The official-format `config.json` object: flat for V4, nested under text_config for V4.1."""
        flat = self.to_json_dict()
        return nest(flat) if self.model_type in NESTED_MODEL_TYPES else flat


CONFIG_KEYS = frozenset(f.name for f in msgspec.structs.fields(ModelConfig))

class RankConfig(ModelConfig, frozen=True, kw_only=True):
    """The config one tensor/expert-parallel rank's generated code reads: every model key, plus where
    this rank sits. Graph attrs read `cfg.tp_size` (local head and group counts) and pass
    `cfg.tp_group` to the collectives; with the defaults it is a single process."""
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    tp_group: object = None       # torch.distributed ProcessGroup (None: no communication)
    ep_group: object = None
    # the fused kernels of the backend profile this rank's shapes meet (spec/fused.py; chosen at load):
    # the generated code calls a kernel's lowering of an op when its name is here, the op's own otherwise
    fused: frozenset = frozenset()

    @classmethod
    def of(cls, cfg: ModelConfig, **rank) -> "RankConfig":
        return cls(**{f: getattr(cfg, f) for f in CONFIG_KEYS}, **rank)


RANK_KEYS = frozenset(f.name for f in msgspec.structs.fields(RankConfig)) - CONFIG_KEYS

# Keys that Hugging Face tooling writes into config.json and that carry no model semantics.
IGNORED_CHECKPOINT_KEYS = frozenset({
    "transformers_version", "auto_map", "use_cache", "initializer_range", "attention_dropout",
    "pad_token_id", "_name_or_path", "dtype",
})


def check_config(cfg: ModelConfig, where: str, lines: dict | None = None, context: str = "") -> ModelConfig:
    """Cross-field rules msgspec cannot express; errors name the source, the blamed key's line (when
    `lines` maps `(key,)` to one) and the keys."""
    def bad(key: str, msg: str):
        line = (lines or {}).get((key,))
        raise SpecError(f"{where}{f':{line}' if line else ''}: {context}{msg}")

    n_stages = len(cfg.compress_ratios) - cfg.num_hidden_layers
    if n_stages < 0:
        bad("compress_ratios", f"compress_ratios has {len(cfg.compress_ratios)} entries, fewer than "
            f"num_hidden_layers ({cfg.num_hidden_layers})")
    if cfg.dspark_block_size is not None and n_stages < 1:
        bad("compress_ratios", "dspark_block_size is set but compress_ratios has no drafter-stage entries "
            f"(expected num_hidden_layers + stages = {cfg.num_hidden_layers} + N entries)")
    if any(r < 0 for r in cfg.compress_ratios):
        bad("compress_ratios", "compress_ratios entries must be >= 0")
    if any(r for r in cfg.compress_ratios[cfg.num_hidden_layers:]):
        tail = list(cfg.compress_ratios[cfg.num_hidden_layers:])
        bad("compress_ratios",
            f"drafter-stage entries of compress_ratios must be 0 (drafter stages use sliding attention): its "
            f"first num_hidden_layers ({cfg.num_hidden_layers}) entries are backbone layers and the remaining "
            f"{len(tail)} are drafter stages, found {tail}; change compress_ratios together with num_hidden_layers")
    dspark = {k: getattr(cfg, k) for k in ("dspark_block_size", "dspark_noise_token_id",
                                           "dspark_target_layer_ids", "dspark_markov_rank")}
    present = [k for k, v in dspark.items() if v is not None]
    if present and len(present) < len(dspark):
        bad(present[0], "the dspark_* keys must be all present (DeepSeek-V4-Flash-0731) or all absent "
            f"(preview); missing: {', '.join(k for k in dspark if k not in present)}")
    if cfg.dspark_target_layer_ids is not None:
        for layer in cfg.dspark_target_layer_ids:
            if not 0 <= layer < cfg.num_hidden_layers:
                bad("dspark_target_layer_ids",
                    f"dspark_target_layer_ids names layer {layer}, outside 0..{cfg.num_hidden_layers - 1}")
    if cfg.dspark_noise_token_id is not None and not 0 <= cfg.dspark_noise_token_id < cfg.vocab_size:
        bad("dspark_noise_token_id", f"dspark_noise_token_id {cfg.dspark_noise_token_id} is outside the "
            f"vocabulary (vocab_size {cfg.vocab_size})")
    divisible = [
        ("num_attention_heads", cfg.num_attention_heads, "o_groups", cfg.o_groups),
        ("head_dim", cfg.head_dim, "2", 2),
        ("qk_rope_head_dim", cfg.qk_rope_head_dim, "2", 2),
    ]
    for a, va, b, vb in divisible:
        if va % vb:
            bad(a, f"{a} ({va}) must be divisible by {b} ({vb})")
    if cfg.qk_rope_head_dim > min(cfg.head_dim, cfg.index_head_dim):
        bad("qk_rope_head_dim", f"qk_rope_head_dim ({cfg.qk_rope_head_dim}) exceeds head_dim or index_head_dim")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        bad("num_experts_per_tok",
            f"num_experts_per_tok ({cfg.num_experts_per_tok}) exceeds n_routed_experts ({cfg.n_routed_experts})")
    for key in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
        for layer in getattr(cfg, key) or ():
            if not 0 <= layer < cfg.num_hidden_layers:
                bad(key, f"{key} names layer {layer}, outside 0..{cfg.num_hidden_layers - 1}")
    for layer in cfg.kv_source_layer_ids or ():
        if not cfg.compress_ratios[layer]:
            bad("kv_source_layer_ids", f"kv_source_layer_ids names layer {layer}, whose compress ratio is 0")
    if (cfg.engram_layer_ids is None) != (cfg.engram_num_embeddings is None) or \
            len(cfg.engram_layer_ids or ()) != len(cfg.engram_num_embeddings or ()):
        bad("engram_num_embeddings", "engram_num_embeddings must have one entry per engram_layer_ids entry")
    if cfg.index_source_layer_ids is not None and cfg.kv_source_layer_ids is None:
        bad("index_source_layer_ids", "index_source_layer_ids needs kv_source_layer_ids")
    if not 0 <= cfg.num_hash_layers <= cfg.num_hidden_layers:
        bad("num_hash_layers", f"num_hash_layers ({cfg.num_hash_layers}) must be within 0..num_hidden_layers")
    return cfg


def config_from_dict(data: dict, where: str, lines: dict | None = None,
                     context: str = "") -> tuple[ModelConfig, list[str]]:
    """Decode a config mapping; returns the config and the unknown keys that were ignored.
    `where` is the source file (or a description), `lines` maps `(key,)` to its line there."""
    unknown = sorted(k for k in data if k not in CONFIG_KEYS and k not in IGNORED_CHECKPOINT_KEYS)
    clean = {k: v for k, v in data.items() if k in CONFIG_KEYS}
    cfg = decode(clean, ModelConfig, where, lines or {}, context=context)
    return check_config(cfg, where, lines, context), unknown


def load_config_json(path: Path | str, replace: dict | None = None) -> tuple[ModelConfig, list[str]]:
    """Read a checkpoint's `config.json` (official keys); unknown keys are returned, not fatal,
    because real checkpoints may carry extra bookkeeping keys the model does not depend on.
    `replace` sets keys whatever the file says (a ModelSlim export drops `quantization_config`)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(f"{path}: config.json not found") from None
    except json.JSONDecodeError as err:
        raise SpecError(f"{path}:{err.lineno}: invalid JSON: {err.msg}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a JSON object at the top level")
    if is_nested(data):
        # V4.1 nests its model keys under text_config (V41-REFERENCE §1.1): read as the spec's flat keys
        # (spec/config_nesting.py); the lines of nested keys are not tracked
        if data.get("model_type") not in NESTED_MODEL_TYPES:
            raise SpecError(f"{path}: a nested config.json (text_config) of model_type "
                            f"{data.get('model_type')!r}; nested configs are read for "
                            f"{', '.join(sorted(NESTED_MODEL_TYPES))}")
        return config_from_dict({**flatten(data), **(replace or {})}, str(path), {})
    return config_from_dict({**data, **(replace or {})}, str(path), _json_key_lines(path))


def _json_key_lines(path: Path) -> dict:
    """Line of each top-level key of a JSON file, so config errors can point at a line."""
    lines = {}
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        stripped = text.strip()
        if stripped.startswith('"') and '":' in stripped:
            lines.setdefault((stripped[1:stripped.index('"', 1)],), number)
    return lines
