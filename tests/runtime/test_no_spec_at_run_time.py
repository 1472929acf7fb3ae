"""The run path reads no spec: a loaded model carries its profile facts and its layer schedule.

Everything spec/ loads or derives (YAML files, profiles, the graph, the tensor table, the layer
schedule) is read once, when the model loads; the generated forward, the paged cache, the
scheduler and the drafter run on what the model carries. Patching every spec loader to raise after
the load proves it for a prefill, decode steps and DSpark rounds through the engine.
"""
from __future__ import annotations

import sys

import pytest

import spec.config
import spec.graph
import spec.profile
import spec.schedule
import spec.tables
import spec.variants
import spec.yamlio
from lib.engine.llm_engine import Engine, EngineConfig
from lib.engine.sampling import SamplingParams
from lib.runtime.loaded_model import load_model

LOADERS = {
    spec.yamlio: ("load_yaml",),
    spec.config: ("load_config_json",),
    spec.profile: ("load_profile", "load_runtime_formats", "backend_names", "profile_path"),
    spec.graph: ("load_graph",),
    spec.tables: ("load_tensor_table", "load_quant", "expand"),
    spec.schedule: ("schedule", "backbone", "drafter", "drafter_kind"),
    spec.variants: ("variant_config",),
}


def _refuse_spec_loaders(monkeypatch) -> list[str]:
    """Every spec loader raises, under its own name and under every name a module imported it as."""
    patched = []
    for module, names in LOADERS.items():
        for name in names:
            original = getattr(module, name)

            def refuse(*args, _name=f"{module.__name__}.{name}", **kwargs):
                raise AssertionError(f"{_name} called on the run path")
            for holder in list(sys.modules.values()):
                for attr, value in list(getattr(holder, "__dict__", {}).items()):
                    if value is original:
                        monkeypatch.setattr(holder, attr, refuse)
                        patched.append(f"{holder.__name__}.{attr}")
    return patched


@pytest.mark.parametrize("backend", ["cpu", "ascend910"])
def test_engine_steps_read_no_spec(tiny_ckpt, monkeypatch, backend):
    model = load_model(tiny_ckpt, backend)
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, speculative="dspark"))
    patched = _refuse_spec_loaders(monkeypatch)
    assert "spec.schedule.backbone" in patched and "spec.profile.load_profile" in patched
    (req,) = engine.generate([list(range(20, 45))], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(req.output) == 6 and engine.drafted[0] > 0        # prefill, decodes and DSpark rounds ran
    assert all(used == 0 for used, _ in engine.store.usage().values())   # and the finished request was freed


def test_generated_code_imports_no_spec():
    for backend in spec.profile.backend_names():
        source = (spec.profile.BACKENDS_DIR / backend / "_generated" / "model.py").read_text()
        imports = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
        assert not [line for line in imports if " spec" in line or "spec." in line], (backend, imports)
