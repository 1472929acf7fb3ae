"""Ascend ModelSlim (msmodelslim) checkpoint folders: recognising one and checking it against the spec.

A ModelSlim export (spec/msmodelslim.yaml) holds the official tensor names, but each quantised
linear as int8 (W8A8_DYNAMIC) or packed int4 (W4A8_DYNAMIC) with `.weight_scale`, `.weight_offset`
and `.scale_bias` siblings, labelled per tensor in `quant_model_description.json`. Reading one is
the official reader with two differences, both made here: the shards come from ModelSlim's index,
and each logical tensor's storage format comes from its label. Every label is checked against what
the tensor may be (norms, hc, router, embed and head are never quantised: B06), every saved tensor
must be described and every described tensor saved. Knows the file layout, not any backend.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from spec.config import ModelConfig
from spec.msmodelslim import allowed_labels, format_for, load_msmodelslim
from spec.tables import Logical, with_format

# the description's bookkeeping entries; every other entry labels one saved tensor
DESCRIPTION_META = ("version", "model_quant_type", "metadata", "group_size", "optional")


class ModelSlimLayout(NamedTuple):
    labels: dict[str, str]          # saved tensor key -> FLOAT | W8A8_DYNAMIC | W4A8_DYNAMIC
    model_quant_type: str
    weight_map: dict[str, str]      # saved tensor key -> shard file


def is_modelslim(root: Path) -> bool:
    return (Path(root) / load_msmodelslim().files.description).is_file()


def config_replacements(config_path: Path) -> dict:
    """ModelSlim drops `quantization_config` from config.json (or a guide sets an `ascend` one): the
    official one of the checkpoint's model generation stands in (V4's FP8 blocks of 128, V4.1's of 32), so shape
    expressions of the spec still evaluate. V4.1 kept `expert_dtype` inside it, so that comes back too."""
    from spec.variants import variant_config

    try:
        model_type = json.loads(Path(config_path).read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None           # load_config_json reports what is wrong with the file
    official = variant_config("v41-flash" if model_type == "deepseek_v41" else "flash-0731").to_json_dict()
    out = {"quantization_config": official["quantization_config"]}
    return out | ({"expert_dtype": official["expert_dtype"]} if model_type == "deepseek_v41" else {})


def read_layout(root: Path, weight_map: dict[str, str], error: type[Exception]) -> ModelSlimLayout:
    """The description's labels beside the export's weight map (read from its index by the caller)."""
    files = load_msmodelslim().files
    path = Path(root) / files.description
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise error(f"{files.description}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise error(f"{files.description}: expected a JSON object of tensor name -> quant type")
    if data.get("group_size", 0) not in (0, None):
        raise error(f"{files.description}: group_size {data['group_size']}: per-group weight scales are not "
                    f"supported (vllm-ascend refuses them for W4A8 experts too); export per-channel (group_size 0)")
    labels = {k: v for k, v in data.items() if k not in DESCRIPTION_META}
    known = load_msmodelslim().labels
    bad = [f"{files.description}: {k}: unknown quant type {v!r} (accepted: {', '.join(known)})"
           for k, v in labels.items() if v not in known]
    if bad:
        raise error("\n".join(bad[:20]))
    return ModelSlimLayout(labels, str(data.get("model_quant_type", "")), weight_map)


def relabel(logical: tuple[Logical, ...], layout: ModelSlimLayout,
            cfg: ModelConfig) -> tuple[tuple[Logical, ...], list[str]]:
    """Each logical tensor in the storage format its label names, and every description problem."""
    files = load_msmodelslim().files
    desc, index = files.description, files.index
    out, problems = [], []
    for t in logical:
        label = layout.labels.get(t.key)
        allowed = allowed_labels(t)
        if label is None:
            problems.append(f"{desc}: {t.key}: not described (every tensor needs a quant type: {', '.join(allowed)})")
            out.append(t)
            continue
        if label not in allowed:
            problems.append(f"{desc}: {t.key}: quant type {label}, but a {t.entry.tensor_class} tensor "
                            f"{list(t.shape)} is never quantised (allowed: {', '.join(allowed)})")
            out.append(t)
            continue
        new = with_format(t, format_for(t, label), cfg)
        for part in new.parts[1:]:
            theirs = layout.labels.get(part.key)
            if theirs is not None and theirs != label:
                problems.append(f"{desc}: {part.key}: quant type {theirs}, but its weight {t.key} is {label}")
        out.append(new)
    saved, described = set(layout.weight_map), set(layout.labels)
    problems += [f"{desc}: {k}: described as {layout.labels[k]}, but {index} has no such tensor"
                 for k in sorted(described - saved)]
    problems += [f"{index}: {k}: saved in {layout.weight_map[k]}, but {desc} does not describe it"
                 for k in sorted(saved - described)]
    return tuple(out), problems
