"""Which fused kernels a checkpoint's shapes allow (profile `fused`, spec/profile.py FusedKernel).

`chosen` is what load_model stores in RankConfig.fused and what `PLAN.md` shows per known variant:
a kernel is chosen when every one of its limits holds on the rank's config; `unmet` names the
limits that fail, each with the value found, so a plan can say why a checkpoint runs the composite.
"""
from __future__ import annotations

from typing import Iterable, Mapping


def _holds(limit, value) -> bool:
    """A list-valued key (compress_ratios) holds when every element does."""
    if isinstance(value, (list, tuple)):
        return all(_holds(limit, v) for v in value)
    return ((not limit.one_of or value in limit.one_of)
            and (limit.min is None or value >= limit.min)
            and (limit.max is None or value <= limit.max)
            and (limit.multiple_of is None or value % limit.multiple_of == 0))


def describe(limit) -> str:
    """'hidden_size in {4096, 7168}', 'index_topk <= 2048', ... (of every element, for a list-valued key)"""
    parts = []
    if limit.one_of:
        parts.append(f"{limit.key} in {{{', '.join(map(str, limit.one_of))}}}" if len(limit.one_of) > 1
                     else f"{limit.key} == {limit.one_of[0]}")
    if limit.min is not None:
        parts.append(f"{limit.key} >= {limit.min}")
    if limit.max is not None:
        parts.append(f"{limit.key} <= {limit.max}")
    if limit.multiple_of is not None:
        parts.append(f"{limit.key} % {limit.multiple_of} == 0")
    return " and ".join(parts)


def unmet(limits: Iterable, cfg, relax_widths: bool = False) -> list[str]:
    """The limits `cfg` fails, as 'hidden_size in {4096, 7168} (found 64)'; width limits count as met
    under `relax_widths` (the emulation only, lib/emulation/relaxed.py)."""
    return [f"{describe(lim)} (found {getattr(cfg, lim.key)})" for lim in limits
            if not (relax_widths and lim.width) and not _holds(lim, getattr(cfg, lim.key))]


def chosen(kernels: Mapping[str, Iterable], cfg, relax_widths: bool = False) -> frozenset[str]:
    """Names of the fused kernels (name -> its limits) every limit of which `cfg` meets."""
    return frozenset(name for name, limits in kernels.items() if not unmet(limits, cfg, relax_widths))
