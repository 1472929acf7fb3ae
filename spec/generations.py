"""Which backends run which model generation: each profile's `models` (config model_type).

The spec describes every generation's checkpoint; a backend generates the forward of the generations its
profile lists, and refuses a checkpoint of another at load, naming the backends that run it. The planner plans
such a deployment for memory only.
"""
from __future__ import annotations

from spec.profile import backend_names, load_profile

MODEL_NAMES = {"deepseek_v4": "DeepSeek-V4", "deepseek_v41": "DeepSeek-V4.1-Flash"}


def runners(model_type: str) -> list[str]:
    """The backends whose generated code runs this model generation (profile `models`)."""
    return [b for b in backend_names() if model_type in load_profile(b).models]


def forward_refusal(cfg, backend: str) -> str | None:
    """Why `backend` cannot run this config's forward (None: it can): its profile does not list the generation."""
    if cfg.model_type in load_profile(backend).models:
        return None
    return (f"{MODEL_NAMES.get(cfg.model_type, cfg.model_type)}: backend {backend} does not run its forward yet "
            f"(backends that do: {', '.join(runners(cfg.model_type)) or 'none'})")
