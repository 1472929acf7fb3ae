"""`dsv4gen convert --format msmodelslim`: an official checkpoint written as an Ascend ModelSlim export.

Each tensor takes the label its class has in the chosen recipe (spec/msmodelslim.yaml): W8A8 /
W4A8 weights are quantised by the same per-row quantiser the device loaders use on an official
checkpoint (lib/quant/int_codecs.py), so loading the export gives the very integers and scales a
load of the original computes; FLOAT tensors keep their stored bytes, or are dequantised to BF16
where the original is FP8 / FP4 (exactly). Each part of the export goes to its own files, as the field's V4.1
release lays them out (spec/msmodelslim.yaml `files`): the backbone's shards, the drafter's `mtpq-*`, Engram's
tables one file each under `engram_int8/`. Shards are written as the conversion goes (one part
held in memory at a time) into a temporary folder that is moved into place only when complete.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from lib.quant.reference_formats import decode, encode
from lib.weights.checkpoint import INDEX_NAME, Checkpoint, CheckpointError
from lib.weights.checkpoint_writer import publish_dir
from spec.msmodelslim import allowed_labels, format_for, load_msmodelslim, part_of, recipe_label, vocabulary_copies
from spec.tables import Logical, with_format


def default_out(model: Path, quant_type: str) -> Path:
    model = Path(model)
    return model.with_name(f"{model.name}-msmodelslim-{quant_type}")


def convert(model: Path | str, out: Path | str, quant_type: str = "w8a8", part_size_gib: float | None = None,
            overwrite: bool = False, progress: bool = False) -> Path:
    spec = load_msmodelslim()
    if quant_type not in spec.recipes:
        raise ValueError(f"unknown ModelSlim quant type '{quant_type}' (accepted: {', '.join(spec.recipes)})")
    ckpt = Checkpoint(model)
    if ckpt.layout != "official":
        raise CheckpointError(f"{ckpt.root}: already a {ckpt.layout} export; convert from the official checkpoint")
    limit = int((part_size_gib or spec.files.part_size_gib) * 2 ** 30)

    def write(tmp: Path) -> None:
        labels: dict[str, str] = {}
        shards: dict[str, dict[str, torch.Tensor]] = {}      # part -> the shard being filled
        held: dict[str, int] = {}
        written: dict[str, list[tuple[str, list[str]]]] = {}  # part -> (temporary name, keys) per shard
        weight_map: dict[str, str] = {}
        total = 0
        copied = {source: copy for copy, source in vocabulary_copies(ckpt.config).items()}

        def flush(part: str) -> None:
            if shards.get(part):
                name = f"{part}-{len(written.setdefault(part, [])):05d}.part"
                save_file(shards[part], str(tmp / name), metadata={"format": "pt"})
                written[part].append((name, list(shards[part])))
                shards[part], held[part] = {}, 0

        for t in tqdm(ckpt.logical, desc="converting to msmodelslim", unit="tensor", disable=not progress, leave=False):
            label = recipe_label(t, quant_type)
            stored = list(_stored(ckpt, t, label).items())
            if t.key in copied:                             # the drafter's own vocabulary: a copy, in its part
                (_, value), = stored
                stored.append((copied[t.key], value.clone()))
            for key, value in stored:
                part = part_of(t, key)
                labels[key] = label
                size = value.numel() * value.element_size()
                total += size
                single = spec.files.tensor_file(part, key)
                if single is not None:                      # a file of its own (the field's engram_int8/)
                    (tmp / single).parent.mkdir(parents=True, exist_ok=True)
                    save_file({key: value.contiguous()}, str(tmp / single), metadata={"format": "pt"})
                    weight_map[key] = single
                    continue
                if held.get(part) and held[part] + size > limit:
                    flush(part)
                shards.setdefault(part, {})[key] = value.contiguous()
                held[part] = held.get(part, 0) + size
        for part in list(shards):
            flush(part)
        for part, parts in written.items():
            for i, (name, keys) in enumerate(parts):
                final = spec.files.shard_name(i + 1, len(parts), part)
                os.replace(tmp / name, tmp / final)
                weight_map.update({k: final for k in keys})
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / spec.files.index).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        description = {"version": spec.files.version, "model_quant_type": spec.recipes[quant_type].model_quant_type,
                       "group_size": 0, "metadata": {}, **dict(sorted(labels.items()))}
        (tmp / spec.files.description).write_text(json.dumps(description, indent=2) + "\n", encoding="utf-8")
        _side_files(ckpt.root, tmp, spec.files.config_drops)

    return publish_dir(Path(out), write, overwrite)


def _stored(ckpt: Checkpoint, t: Logical, label: str) -> dict[str, torch.Tensor]:
    """The saved tensors (key -> value) of one logical tensor under `label`."""
    if label not in allowed_labels(t):
        raise ValueError(f"{t.key}: the recipe labels it {label}, which a {t.entry.tensor_class} tensor cannot be")
    new = with_format(t, format_for(t, label), ckpt.config)
    parts = ckpt.read_parts(t)
    if new.format != t.format:
        try:
            parts = encode(new.format, decode(t.format, parts, ckpt.config), ckpt.config)
        except ValueError as err:
            raise ValueError(f"{t.key}: cannot store as {label}: {err}") from None
    return {p.key: parts[p.role] for p in new.parts}


def _side_files(src: Path, dst: Path, drops: tuple[str, ...]) -> None:
    """Every non-weight file of the source (tokenizer, chat template, generation config), and its
    config.json without the keys ModelSlim drops."""
    for path in sorted(src.iterdir()):
        if not path.is_file() or path.suffix == ".safetensors" or path.name == INDEX_NAME:
            continue
        if path.name == "config.json":
            data = json.loads(path.read_text(encoding="utf-8"))
            for key in drops:
                data.pop(key, None)
                if isinstance(data.get("text_config"), dict):
                    data["text_config"].pop(key, None)
            (dst / path.name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        else:
            shutil.copyfile(path, dst / path.name)
