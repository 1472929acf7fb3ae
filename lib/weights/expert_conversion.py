"""`dsv4gen convert`: routed experts converted once to a backend's runtime format, per EP rank.

Converting 256 MXFP4 experts per layer at every start cost the 310P port minutes per restart
(L18). `convert` writes each EP rank's experts in the backend's resident format (W8A8 rows on
310P) into `rank-NN-of-MM.safetensors` files plus a marker recording backend, format, TP and EP;
the `preconverted` expert mode reads them instead of converting, after checking the marker
against what it is asked to load. Written atomically: a half-written conversion never loads.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from lib.weights.checkpoint import Checkpoint
from lib.weights.checkpoint_writer import publish_dir
from lib.quant.reference_formats import resolve
from lib.distributed.process_group import check_sizes
from lib.records.expert_placement import expert_placement
from lib.weights.tp_slices import check_tp
from spec.profile import load_profile, load_runtime_formats

MARKER = "dsv4gen-converted.json"
MARKER_VERSION = 2


def _rank_file(rank: int, world: int) -> str:
    return f"rank-{rank:02d}-of-{world:02d}.safetensors"


def _fields(value) -> dict[str, torch.Tensor]:
    return {name: getattr(value, name) for name in value._fields}


def _source_id(ckpt: Checkpoint) -> str:
    return hashlib.sha256((ckpt.root / "config.json").read_bytes()).hexdigest()[:16] + f":{ckpt.total_bytes()}"


def default_dir(src: Path | str, backend: str, tp: int, ep: int) -> Path:
    return Path(src) / f"converted-{backend}-tp{tp}-ep{ep}"


def convert(src: Path | str, backend: str, out: Path | str | None = None, tp: int = 1, ep: int = 1,
            overwrite: bool = False, progress: bool = False) -> Path:
    """Write the target's routed experts of `src`, converted for `backend`, one file per EP rank.

    Routed experts are never TP-sliced (tensors.yaml `tp: experts`), so the files depend on EP only:
    of a world of max(TP, EP) ranks, each reads the file of its EP rank. TP is checked (the
    checkpoint must split that many ways, lib/weights/tp_slices.py) and recorded, so a load with another TP
    size is refused rather than run on a conversion made for a different deployment."""
    profile = load_profile(backend)
    fmt = profile.expert_modes.get("preconverted")
    if fmt is None:
        raise ValueError(f"backend {backend} has no preconverted expert mode (profile expert_modes: "
                         f"{', '.join(profile.expert_modes) or 'none'})")
    converter = resolve(load_runtime_formats().formats[fmt].convert)
    ckpt = Checkpoint(src)
    check_sizes(ckpt.config, tp, ep)                # the deployment rule: TP and EP each 1 or max(TP, EP)
    check_tp(ckpt.config, ckpt.logical, tp, 0)      # every TP-split tensor (and its scale) splits on blocks
    placement = expert_placement(ckpt.config.n_routed_experts, ep, 0)
    per_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(ep)]
    # target experts only: the drafter's are read from the source in their stored format (B17)
    experts = [t for t in ckpt.logical if t.entry.tensor_class == "routed_expert" and t.layer.role == "backbone"]
    for t in tqdm(experts, desc=f"converting experts for {backend}", unit="tensor", leave=False, disable=not progress):
        rank = t.expert // placement.n_local
        value = converter(t.format, ckpt.read_parts(t), ckpt.config)
        per_rank[rank].update({f"{t.key}.{name}": tensor.contiguous() for name, tensor in _fields(value).items()})
    marker = {"tool": "dsv4gen convert", "version": MARKER_VERSION, "backend": backend, "format": fmt,
              "tp": tp, "ep": ep, "source": _source_id(ckpt), "files": [_rank_file(r, ep) for r in range(ep)]}

    def write(tmp: Path) -> None:
        from safetensors.torch import save_file
        for rank, tensors in enumerate(per_rank):
            save_file(tensors, str(tmp / _rank_file(rank, ep)), metadata={"format": fmt})
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")

    return publish_dir(Path(out) if out else default_dir(src, backend, tp, ep), write, overwrite)


class PreconvertedExperts:
    """Read side: validates the marker, then serves converted experts by official key."""

    def __init__(self, root: Path | str, backend: str, source: Checkpoint, ep: int, tp: int = 1):
        self.root = Path(root)
        path = self.root / MARKER
        if not path.is_file():
            raise ValueError(f"{self.root}: no {MARKER}: expert mode 'preconverted' reads the output of "
                             f"`dsv4gen convert --backend {backend}`")
        marker = json.loads(path.read_text(encoding="utf-8"))
        want = {"version": MARKER_VERSION, "backend": backend,
                "format": load_profile(backend).expert_modes.get("preconverted"), "tp": tp, "ep": ep,
                "source": _source_id(source)}
        for key, value in want.items():
            if marker.get(key) != value:
                raise ValueError(f"{path}: {key} is {marker.get(key)!r}, but loading needs {value!r} "
                                 f"(re-run `dsv4gen convert --backend {backend} --tp {tp} --ep {ep}`)")
        self.format = marker["format"]
        self.files = [self.root / name for name in marker["files"]]
        missing = [f.name for f in self.files if not f.is_file()]
        if missing:
            raise ValueError(f"{self.root}: marker lists {missing[0]}, which does not exist")
        self._handles: dict[int, object] = {}

    def read(self, key: str, expert: int, n_local: int):
        """The converted value of one expert's logical tensor, from its EP rank's file: a process
        running one EP rank opens only its own file."""
        from lib.quant.runtime_formats import FORMAT_RECORDS

        rank = expert // n_local
        handle = self._handles.get(rank)
        if handle is None:
            handle = self._handles[rank] = safe_open(str(self.files[rank]), framework="pt")
        record = FORMAT_RECORDS[self.format]
        return record(*(handle.get_tensor(f"{key}.{name}") for name in record._fields))
