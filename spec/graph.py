"""Typed loading and static checks of `graph.yaml`: ops (ports, attrs, reference) and programs.

Checks that need no backend run here, each error naming graph.yaml and the step's line: every
op port bound exactly once, attrs complete, outputs counted right, calls matching the callee's
signature, attribute expressions reading only `cfg`, `layer` and `rope`. Per-variant checks
(which names and parameters exist for a layer kind) run when the code generator lowers it.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Literal

import msgspec

from spec.config import CONFIG_KEYS, RANK_KEYS
from spec.schedule import Attention, KVRole, LayerInfo
from spec.tables import SPEC_DIR
from spec.yamlio import SpecError, decode, load_yaml

GRAPH_PATH = SPEC_DIR / "graph.yaml"
BATCH_FIELDS = ("tokens", "positions", "logit_rows", "engram_ids")
CACHE_FIELDS = ("window", "comp", "index")
ATTR_ROOTS = ("cfg", "layer", "rope")
TAP_OP = "stream_mean"      # the op a loop step's `tap` calls on each tapped block's streams


class OpDef(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    section: str
    doc: str
    inputs: dict[str, str]
    outputs: dict[str, str]
    reference: str
    attrs: tuple[str, ...] = ()
    dispatch_on: str | None = None      # input port whose runtime format selects the lowering


VARIANT_AXES = ("attention", "routing", "kv_role", "engram_kind")   # LayerInfo fields a program may vary on


class StepWhen(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    attention: tuple[Attention, ...] | None = None
    routing: tuple[Literal["hash", "learned"], ...] | None = None
    kv_role: tuple[KVRole, ...] | None = None                          # V4.1 attention
    engram_kind: tuple[Literal["plain", "engram"], ...] | None = None  # V4.1 blocks

    def matches(self, kind: dict[str, str]) -> bool:
        for axis in VARIANT_AXES:
            allowed = getattr(self, axis)
            if allowed is not None and axis in kind and kind[axis] not in allowed:
                return False
        return True


class Step(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    op: str | None = None
    call: str | None = None
    loop: Literal["backbone", "drafter"] | None = None
    args: dict[str, str] = {}
    attrs: dict[str, str | int | float | bool] = {}
    out: tuple[str, ...] = ()
    when: StepWhen = StepWhen()
    # loop steps only: collect `stream_mean(x)` after each block whose index is in `tap_layers`
    # (a cfg expression) into the list named by `tap` (DSpark context features, §5.2)
    tap: str | None = None
    tap_layers: str | None = None
    tap_input: bool = False             # tap a block's input instead of its output (V4.1's DSpark taps)


class Program(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    doc: str
    params: Literal["layer", "model"]
    inputs: tuple[str, ...]
    steps: tuple[Step, ...]
    returns: tuple[str, ...]
    variants: Literal["attention", "routing", "kv_role", "engram_kind"] | None = None
    updates: dict[str, str] = {}

    def n_results(self) -> int:
        return len(self.returns) + (1 if self.updates else 0)


class Graph(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    ops: dict[str, OpDef]
    programs: dict[str, Program]


class LoadedGraph(msgspec.Struct, frozen=True):
    graph: Graph
    path: str
    lines: dict

    def step_line(self, program: str, index: int) -> int | str:
        return self.lines.get(("programs", program, "steps", index), "?")

    def where(self, program: str, index: int) -> str:
        return f"{self.path}:{self.step_line(program, index)}"


def program_ops(g: Graph) -> set[str]:
    """The ops the programs run: what every backend must lower."""
    steps = [step for prog in g.programs.values() for step in prog.steps]
    return {step.op for step in steps if step.op is not None} | {TAP_OP for step in steps if step.tap is not None}


@functools.lru_cache(maxsize=None)
def load_graph(path: Path = GRAPH_PATH) -> LoadedGraph:
    data, lines = load_yaml(path)
    loaded = LoadedGraph(decode(data, Graph, str(path), lines), str(path), lines)
    check_graph(loaded)
    return loaded


def check_graph(lg: LoadedGraph) -> None:
    g = lg.graph
    for name, op in g.ops.items():
        if op.dispatch_on is not None and op.dispatch_on not in op.inputs:
            raise SpecError(f"{lg.path}:{lg.lines[('ops', name)]}: op '{name}' dispatches on '{op.dispatch_on}', "
                            f"which is not one of its inputs ({', '.join(op.inputs)})")
    for name, prog in g.programs.items():
        if prog.variants is not None and prog.params != "layer":
            raise SpecError(f"{lg.path}:{lg.lines[('programs', name)]}: program '{name}' has variants but no layer")
        for i, step in enumerate(prog.steps):
            where = lg.where(name, i)
            kinds = [k for k in ("op", "call") if getattr(step, k) is not None]
            if len(kinds) != 1:
                raise SpecError(f"{where}: a step needs exactly one of 'op' or 'call'")
            if step.op is not None:
                _check_op_step(step, g, where)
            else:
                _check_call_step(step, g, where)
            for attr, value in step.attrs.items():
                check_attr_expr(value, f"{where}: attr '{attr}'")
            if (step.tap is None) != (step.tap_layers is None) or (step.tap is not None and step.loop is None):
                raise SpecError(f"{where}: 'tap' and 'tap_layers' go together, on a loop step")
            if step.tap_layers is not None:
                check_attr_expr(step.tap_layers, f"{where}: tap_layers")


def _check_op_step(step: Step, g: Graph, where: str) -> None:
    if step.op not in g.ops:
        raise SpecError(f"{where}: unknown op '{step.op}' (accepted: {', '.join(sorted(g.ops))})")
    op = g.ops[step.op]
    _same_keys(step.args, op.inputs, f"{where}: op '{step.op}'", "argument")
    _same_keys(step.attrs, dict.fromkeys(op.attrs), f"{where}: op '{step.op}'", "attr")
    if len(step.out) != len(op.outputs):
        raise SpecError(f"{where}: op '{step.op}' has {len(op.outputs)} output{'s' if len(op.outputs) != 1 else ''} "
                        f"({', '.join(op.outputs)}), step binds {len(step.out)}")


def _check_call_step(step: Step, g: Graph, where: str) -> None:
    if step.call not in g.programs:
        raise SpecError(f"{where}: unknown program '{step.call}' (accepted: {', '.join(sorted(g.programs))})")
    callee = g.programs[step.call]
    _same_keys(step.args, dict.fromkeys(callee.inputs), f"{where}: call '{step.call}'", "argument")
    if step.attrs:
        raise SpecError(f"{where}: a call takes no attrs")
    if len(step.out) != callee.n_results():
        raise SpecError(f"{where}: program '{step.call}' returns {callee.n_results()} values, step binds {len(step.out)}")


def _same_keys(given: dict, wanted: dict, what: str, noun: str) -> None:
    extra = [k for k in given if k not in wanted]
    if extra:
        raise SpecError(f"{what} has no {noun} '{extra[0]}' (accepted: {', '.join(wanted) or 'none'})")
    missing = [k for k in wanted if k not in given]
    if missing:
        raise SpecError(f"{what}: {noun} '{missing[0]}' is not bound")


def check_attr_expr(value, where: str) -> None:
    """Attr values are literals or expressions reading cfg.<key>, layer.<field>, rope[...]."""
    if not isinstance(value, str):
        return
    try:
        tree = ast.parse(value, mode="eval")
    except SyntaxError:
        raise SpecError(f"{where}: cannot parse expression '{value}'") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id not in ATTR_ROOTS + ("True", "False", "None"):
            raise SpecError(f"{where}: unknown name '{node.id}' in '{value}' (accepted: {', '.join(ATTR_ROOTS)})")
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            fields = {"cfg": ("config key", sorted(CONFIG_KEYS | RANK_KEYS)), "layer": ("layer field", LayerInfo._fields)}
            what, accepted = fields.get(node.value.id, (None, ()))
            if what is not None and node.attr not in accepted:
                raise SpecError(f"{where}: unknown {what} '{node.attr}' in '{value}' (accepted: {', '.join(accepted)})")
        if isinstance(node, (ast.Call, ast.Lambda, ast.ListComp, ast.DictComp, ast.GeneratorExp)):
            raise SpecError(f"{where}: calls and comprehensions are not allowed in attrs ('{value}')")
