"""Which block parameters each generated program variant may read: the layer kinds a variant stands for.

A program with `variants` is generated once per value of its axis (a LayerInfo field: V4's attention kind or
routing, V4.1's kv_role or engram_kind); its steps may read the parameters every layer of that kind has (and,
marked optional, those only some have). The kinds are made here as example layers of the schedule and matched
against the tensor table's `when` conditions, so the tensor table stays the one place that says which layer
holds which tensor.
"""
from __future__ import annotations

from spec.schedule import LayerInfo
from spec.tables import TensorTable

AXES = {"attention": ("swa", "csa", "hca", "dspark"), "routing": ("hash", "learned"),
        "kv_role": ("swa", "source", "reindex", "reuse", "dspark"), "engram_kind": ("plain", "engram")}
V41_AXES = ("kv_role", "engram_kind")   # the axes of V4.1's own programs


def runtime_key(key: str) -> str:
    return key.replace("{expert}.", "")


def _combos(kind: dict[str, str]) -> list[tuple[str, str]]:
    # drafter stages always learn their routing: there is no hash-routed DSpark layer
    return [(a, r) for a in AXES["attention"] for r in AXES["routing"]
            if kind.get("attention", a) == a and kind.get("routing", r) == r and (a, r) != ("dspark", "hash")]


def _v41_examples(kind: dict[str, str]) -> list[LayerInfo]:
    """V4.1 backbone layers of every role and Engram kind consistent with `kind`: a ratio-2 and a ratio-1 KV source
    (the latter the candidate source), a ratio-1 reindex layer, reusers of either ratio, a sliding layer."""
    def layer(attention, ratio, **flags):
        return [LayerInfo(0, "layers.0", "backbone", attention, ratio, routing, "compress" if ratio else "main", None,
                          False, engram=engram, **flags)
                for routing in AXES["routing"] if kind.get("routing", routing) == routing
                for engram in (False, True) if kind.get("engram_kind", "engram" if engram else "plain")
                == ("engram" if engram else "plain")]
    roles = {"swa": lambda: layer("swa", 0),
             "source": lambda: layer("csa2", 2, kv_source=True, index_source=True)
             + layer("csa1", 1, kv_source=True, index_source=True, candidate_source=True),
             "reindex": lambda: layer("csa1", 1, index_source=True),
             "reuse": lambda: layer("csa2", 2) + layer("csa1", 1),
             # a middle DSpark stage (no Engram; the first / last stages' extras are not block-program keys)
             "dspark": lambda: [LayerInfo(1, "mtp.1", "dspark", "dspark", 0, "learned", "main", 1, False)]
             if kind.get("routing", "learned") == "learned" and kind.get("engram_kind", "plain") == "plain" else []}
    return [x for role, make in roles.items() if kind.get("kv_role", role) == role for x in make()]


def _layer_keys(table: TensorTable, layer: LayerInfo) -> set[str]:
    stored = {runtime_key(e.key) for e in table.entries if e.scope == "block" and e.when.matches(layer)}
    return stored | {d.key for d in table.derived if d.scope == "block" and d.when.matches(layer)}


def _combo_keys(table: TensorTable, attention: str, routing: str) -> set[str]:
    if attention == "dspark":       # a middle stage: first/last-stage extras are not block-program keys
        layer = LayerInfo(1, "mtp.1", "dspark", attention, 0, routing, "main", 1, False)
    else:
        # a V4 layer of this kind: every compressed layer owns its compressor, every CSA one its indexer
        layer = LayerInfo(0, "layers.0", "backbone", attention, 4, routing, "main", None, False,
                          kv_source=attention in ("csa", "hca"), index_source=attention == "csa")
    return _layer_keys(table, layer)


def layer_param_keys(table: TensorTable, kind: dict[str, str], every: bool = True) -> set[str]:
    """Block parameter keys present in EVERY (or, with every=False, in SOME) backbone layer
    consistent with `kind` (a V4.1 kind when it names one of V4.1's axes)."""
    if any(axis in kind for axis in V41_AXES):
        sets = [_layer_keys(table, layer) for layer in _v41_examples(kind)]
    else:
        sets = [_combo_keys(table, a, r) for a, r in _combos(kind)]
    return set.intersection(*sets) if every else set.union(*sets)


def lacking(table: TensorTable, kind: dict[str, str], key: str) -> str:
    """The layer kinds consistent with `kind` that lack parameter `key`, e.g. 'attention=swa'."""
    if any(axis in kind for axis in V41_AXES):
        without = [x for x in _v41_examples(kind) if key not in _layer_keys(table, x)]
        return ", ".join(dict.fromkeys(f"kv_role={x.kv_role} attention={x.attention}" for x in without))
    missing = [(a, r) for a, r in _combos(kind) if key not in _combo_keys(table, a, r)]
    atts = list(dict.fromkeys(a for a, _ in missing))
    if all((a, r) in missing for a in atts for r in AXES["routing"]):
        return "attention=" + "|".join(atts)
    routs = list(dict.fromkeys(r for _, r in missing))
    if all((a, r) in missing for a in AXES["attention"] for r in routs):
        return "routing=" + "|".join(routs)
    return ", ".join(f"attention={a} routing={r}" for a, r in missing)
