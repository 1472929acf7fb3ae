"""`dsv4gen plan --ops`: kernel launches and host syncs of one decode step, per layer kind.

Launch count is what bounds a real NPU (one 910C stack spends 85% of a step on ~2,900 launches),
and it depends on the layer schedule and expert fan-out, not on widths. So this runs the real
DeepSeek-V4-Flash schedule (43 layers, 256 experts, top-6) with shrunken widths, through the same
checkpoint format, loader and generated code as any model, under the capability guard.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
from pathlib import Path
from typing import NamedTuple

from lib.batch import make_batch
from lib.guard import CapabilityGuard, rules_from_profile
from lib.runtime import load_model, step
from lib.tiny import cache_root, make_tiny
from spec.profile import load_profile
from spec.schedule import backbone
from spec.variants import variant_config

# flash-0731's schedule and expert counts with every width shrunk (launches do not depend on widths)
SHRUNK = {
    "vocab_size": 1024, "hidden_size": 128, "num_attention_heads": 8, "head_dim": 128, "q_lora_rank": 64,
    "o_lora_rank": 16, "index_n_heads": 4, "index_head_dim": 64, "moe_intermediate_size": 32,
    "dspark_markov_rank": 16, "dspark_noise_token_id": 15, "max_position_embeddings": 4096,
}
PREFILL = 3      # the decode step runs at position 3, where a CSA (ratio 4) window completes


class KindRow(NamedTuple):
    kind: str          # "csa / learned"
    layers: int
    launches: int      # per layer
    syncs: int         # per layer


class LaunchReport(NamedTuple):
    backend: str
    rows: tuple[KindRow, ...]
    outside: int       # launches outside the blocks (embedding, hc_head, norm, head)
    total: int
    syncs: int


def shrunk_flash() -> Path:
    """The shrunken Flash checkpoint, made once into the cache (full official key set)."""
    cfg = variant_config("flash-0731", SHRUNK)
    tag = hashlib.sha256(repr(sorted(cfg.to_json_dict().items())).encode()).hexdigest()[:12]
    path = cache_root() / f"flash-shrunk-{tag}"
    if not (path / "config.json").exists():
        overrides = {k: v for k, v in cfg.to_json_dict().items() if k not in ("architectures", "model_type")}
        make_tiny(path, overrides=overrides, overwrite=True, shards=8, progress=True)
    return path


@contextlib.contextmanager
def _per_block_sections(module, guard: CapabilityGuard):
    original = module.block

    def block(lp, x, batch, cache, layer, cfg, rope):
        with guard.section(f"{layer.attention} / {layer.routing}"):
            return original(lp, x, batch, cache, layer, cfg, rope)

    module.block = block
    try:
        yield
    finally:
        module.block = original


def decode_launches(backend: str, path: Path | None = None) -> LaunchReport:
    path = path or shrunk_flash()
    model = load_model(path, backend, progress=True)
    _, caches = step(model, make_batch([list(range(20, 20 + PREFILL))]), [model.new_cache()])
    guard = CapabilityGuard(rules_from_profile(load_profile(backend)), mode="count")
    module = importlib.import_module(f"backends.{backend}._generated.model")
    with guard, _per_block_sections(module, guard), guard.section("decode"):
        step(model, make_batch([[7]], [PREFILL], last_only=True), caches)
    report = guard.report()
    layers: dict[str, int] = {}
    for layer in backbone(model.cfg):
        key = f"{layer.attention} / {layer.routing}"
        layers[key] = layers.get(key, 0) + 1
    rows = []
    for kind, n in layers.items():
        counts = report.sections[f"decode/{kind}"]
        rows.append(KindRow(kind, n, counts.ops // n, counts.syncs // n))
    outside = report.sections["decode"].ops
    return LaunchReport(backend, tuple(rows), outside, report.total.ops, report.total.syncs)


def format_report(r: LaunchReport) -> str:
    lines = [f"backend {r.backend}: one decode step of the DeepSeek-V4-Flash schedule (43 layers, 256 experts, "
             f"top-6; widths shrunk)", f"  {'layer kind':<18} {'layers':>6} {'launches/layer':>15} {'syncs/layer':>12}"]
    lines += [f"  {row.kind:<18} {row.layers:>6} {row.launches:>15} {row.syncs:>12}" for row in r.rows]
    lines += [f"  {'outside blocks':<18} {'':>6} {r.outside:>15}", f"  total launches {r.total}, host syncs {r.syncs}"]
    return "\n".join(lines)
