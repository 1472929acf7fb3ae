"""The nested `config.json` of DeepSeek-V4.1 (V41-REFERENCE §1.1-1.3, from a copy of the release config.json,
code-index id 71473622996, and the pinned release record, id 68878548201), to and from the spec's flat keys.

V4's config.json is flat. V4.1's puts the model's keys under `text_config` (model_type "deepseek_v41_text")
and the vision tower's under `vision_config`, keeps `architectures`, `model_type`, `dtype`, the bos / eos / pad
ids, `image_token_id` and `quantization_config` at the root, and moves `expert_dtype` into the
quantization_config. The spec holds one flat form (spec/models/deepseek-v4.1-flash.yaml): text keys keep their
names, vision keys take a `vision_` prefix, `expert_dtype` sits at the top level, `dtype` is `torch_dtype`, and
rope_scaling's `rope_type` is `type`. `nest` writes the release layout from a V4.1 config's flat keys (which
always hold torch_dtype, expert_dtype and quantization_config) and `flatten` reads it back: flatten(nest(x)) == x.
"""
from __future__ import annotations

NESTED_MODEL_TYPES = frozenset({"deepseek_v41"})
ROOT_KEYS = ("architectures", "model_type", "bos_token_id", "eos_token_id", "image_token_id")
VISION_PREFIX = "vision_"


def is_nested(data: dict) -> bool:
    return isinstance(data.get("text_config"), dict)


def nest(flat: dict) -> dict:
    """Flat spec keys (ModelConfig.to_json_dict) -> the release's nested config.json object."""
    text = {k: v for k, v in flat.items() if k not in ROOT_KEYS and not k.startswith(VISION_PREFIX)
            and k not in ("quantization_config", "expert_dtype", "torch_dtype")}
    if isinstance(text.get("rope_scaling"), dict):
        text["rope_scaling"] = {("rope_type" if k == "type" else k): v for k, v in text["rope_scaling"].items()}
    out = {k: flat[k] for k in ROOT_KEYS if k in flat}
    out["dtype"] = flat.get("torch_dtype", "bfloat16")
    out["quantization_config"] = {**flat.get("quantization_config", {}), "expert_dtype": flat["expert_dtype"]}
    out["text_config"] = {"model_type": f"{flat['model_type']}_text", **text}
    vision = {k[len(VISION_PREFIX):]: v for k, v in flat.items() if k.startswith(VISION_PREFIX)}
    if vision:
        out["vision_config"] = {"model_type": f"{flat['model_type']}_vision", **vision}
    return out


def flatten(data: dict) -> dict:
    """The release's nested config.json object -> flat spec keys. The vision tower's own model_type is dropped;
    any other key the spec does not know is passed on (vision keys prefixed), to be reported as an unknown key,
    never fatal."""
    flat = {k: v for k, v in data.items() if k not in ("text_config", "vision_config", "quantization_config", "dtype")}
    text = dict(data["text_config"])
    text.pop("model_type", None)
    if isinstance(text.get("rope_scaling"), dict):
        text["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in text["rope_scaling"].items()}
    flat.update(text)
    if "dtype" in data:
        flat.setdefault("torch_dtype", data["dtype"])
    if isinstance(data.get("quantization_config"), dict):
        quant = dict(data["quantization_config"])
        if "expert_dtype" in quant:
            flat["expert_dtype"] = quant.pop("expert_dtype")
        flat["quantization_config"] = quant
    vision = data.get("vision_config") or {}
    flat.update({f"{VISION_PREFIX}{k}": v for k, v in vision.items() if k != "model_type"})
    return flat
