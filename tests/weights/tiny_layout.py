"""What the make-tiny tests know of the files: the tiny preset written out by hand, a cheaper valid
config for tests about writing, and readers of the raw safetensors headers and index."""
import json
import re
import struct
from pathlib import Path

INDEX = "model.safetensors.index.json"
SHARDS = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
WIDTH = {"BF16": 2, "F32": 4, "I64": 8, "I8": 1, "F8_E4M3": 1, "F8_E8M0": 1}
# The tiny preset (spec/models/deepseek-v4-flash.yaml, variant tiny), written out by hand.
H, VOCAB, E, MOE, HEADS, HEAD_DIM, Q_LORA, HC = 256, 1024, 8, 128, 8, 64, 128, 4
KINDS = {"layers.0": "swa", "layers.1": "swa", "layers.2": "csa", "layers.3": "hca", "layers.4": "csa",
         "layers.5": "hca", "mtp.0": "swa", "mtp.1": "swa", "mtp.2": "swa"}
HASH_LAYERS = {"layers.0", "layers.1", "layers.2"}
# A much cheaper valid config for tests about writing, not about the model (2 layers, 1 stage).
MINI = {"hidden_size": 128, "num_hidden_layers": 2, "num_hash_layers": 1, "compress_ratios": [0, 4, 0],
        "dspark_target_layer_ids": [1], "n_routed_experts": 2, "num_experts_per_tok": 1, "vocab_size": 512}
MINI_SET = [a for k, v in MINI.items() for a in ("--set", f"{k}={json.dumps(v)}")]


def raw_header(path: Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """key -> (dtype, shape, data bytes), straight from the safetensors header JSON."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n))
    meta.pop("__metadata__", None)
    return {k: (v["dtype"], tuple(v["shape"]), v["data_offsets"][1] - v["data_offsets"][0])
            for k, v in meta.items()}


def read_layout(root: Path) -> tuple[dict, dict[str, tuple[str, str, tuple[int, ...], int]]]:
    """(index JSON, key -> (shard, dtype, shape, bytes)) of every tensor in every shard."""
    index = json.loads((root / INDEX).read_text(encoding="utf-8"))
    tensors = {}
    for shard in sorted(p.name for p in root.glob("*.safetensors")):
        for key, (dtype, shape, nbytes) in raw_header(root / shard).items():
            assert key not in tensors, f"{key} is stored in {tensors[key][0]} and {shard}"
            tensors[key] = (shard, dtype, shape, nbytes)
    return index, tensors


def block_of(key: str) -> str | None:
    m = re.match(r"(layers\.\d+|mtp\.\d+)\.", key)
    return m.group(1) if m else None


def all_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}
