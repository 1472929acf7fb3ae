"""Lowering: graph programs + a backend profile -> Python functions as lists of source lines.

Each step becomes one call of the implementation the profile picks for its op (the reference, a
composite or a native device op); values resolve to parameters by official key, batch and cache
fields, or earlier outputs, and are checked per layer kind, so a step that reads a tensor a kind
lacks fails here, naming graph.yaml and the line, not at run time. Templates only lay out what
this module returns.
"""
from __future__ import annotations

import re
from typing import Mapping, NamedTuple

from codegen.layer_kinds import AXES, lacking, layer_param_keys, runtime_key
from spec.graph import BATCH_FIELDS, CACHE_FIELDS, TAP_OP, LoadedGraph, Program, Step
from spec.profile import Profile, QuantisedNorm
from spec.schedule import LayerInfo
from spec.tables import TensorTable
from spec.yamlio import SpecError

STAGE_REFS = {"first.": "params.drafter[0]", "last.": "params.drafter[-1]"}   # model-scope refs to drafter stages
WRAP = 112  # generated lines longer than this put one argument per line
ENTRY_FUNCTIONS = {"model": "forward", "model_v41": "forward_v41"}   # each model generation's forward


class Function(NamedTuple):
    name: str
    signature: str
    doc: str
    body: tuple[str, ...]


class OpUse(NamedTuple):
    op: str
    format: str            # runtime format of the op's dispatch port ("" when it has none)
    impl: str
    call: str
    reason: str
    device_ops: tuple[str, ...]
    lessons: tuple[str, ...]
    kernel: str = ""       # the fused kernel (profile `fused`) this lowering belongs to, chosen by shape


class Rewrite(NamedTuple):
    """Changes to one rendering of a backend, for a temporary generated package (conformance renders a
    catalogued field bug this way, the way the port's own code carried it); the checked-in output
    never has one. `calls`: op -> "module:function" called instead of the profile's lowering
    ("op@kernel": instead of the lowering of fused kernel `kernel`);
    `kwargs`: op -> {keyword: Python expression, or "module:function" for a function} set on (or
    added to) every call of the op; `args`: program -> {a step's first output -> {its input port -> the value it
    reads instead}} (a graph wired wrong, as a port's hand-written forward was)."""
    calls: Mapping[str, str] = {}
    kwargs: Mapping[str, Mapping[str, str]] = {}
    args: Mapping[str, Mapping[str, Mapping[str, str]]] = {}
    runtime_formats: Mapping[str, str] = {}     # tensor class -> runtime format (generated loader)
    expert_modes: Mapping[str, str] = {}        # expert mode -> runtime format of class routed_expert
    converters: Mapping[str, str] = {}          # runtime format -> converter, added or replaced
    record_ops: tuple[str, ...] = ()            # ops whose every call is appended to the module's RECORDED
    record_dispatch: bool = False               # likewise every call through a dispatch table (sub-layers)
    time_ops: tuple[str, ...] = ()              # ops whose calls add their wall time to TIMES["<function>.<op>"]


class Lowered(NamedTuple):
    imports: tuple[str, ...]
    functions: tuple[Function, ...]
    dispatch: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]   # (table, ((kind, function), ...))
    ops: tuple[OpUse, ...]


class _Lowerer:
    def __init__(self, lg: LoadedGraph, profile: Profile, table: TensorTable, rewrite: Rewrite):
        self.lg, self.profile, self.table, self.rewrite = lg, profile, table, rewrite
        self.modules: dict[str, str] = {}     # module path -> alias
        self.ops: dict[tuple[str, str], OpUse] = {}

    def dispatch_format(self, op: str, step: Step, scope: str, kind: dict[str, str], where: str) -> str | None:
        """Runtime format of the parameter bound to the op's dispatch port (profile table lookup)."""
        port = self.lg.graph.ops[op].dispatch_on
        if port is None or not self.profile.ops.get(op) or not self.profile.ops[op].by_format:
            return None
        ref = step.args[port]
        stage = next((pre for pre in STAGE_REFS if ref.startswith(pre)), None)
        if not ref.startswith("p.") and stage is None:
            raise SpecError(f"{where}: op '{op}' dispatches on '{port}', which must be bound to a parameter (p.<key>)")
        key = ref[len(stage or "p."):]
        block = scope == "layer" or stage is not None
        classes = {e.tensor_class for e in self.table.entries
                   if runtime_key(e.key) == key and (e.scope == "block") == block}
        formats = {self.profile.runtime_format(c) for c in classes}
        if len(formats) != 1:
            raise SpecError(f"{where}: parameter '{key}' has runtime formats {sorted(formats)}; expected exactly one")
        return formats.pop()

    def impl(self, op: str, fmt: str | None = None) -> str:
        """The function a step of `op` calls; where a fused kernel can replace the op, the choice
        between the two, made by the kernel's name in the rank's config (chosen at load by shape)."""
        low = self.profile.lowering(op, fmt)
        ref = self.lg.graph.ops[op].reference if low.impl == "reference" else low.call
        self.ops[(op, fmt or "")] = OpUse(op, fmt or "", low.impl, ref, low.reason, low.device_ops, low.lessons)
        own = self.function(self.rewrite.calls.get(op, ref))
        if (fused := self.profile.fused_of(op)) is None:
            return own
        kernel, flow = fused
        self.ops[(op, f"~{kernel}")] = OpUse(op, "", flow.impl, flow.call, flow.reason, flow.device_ops,
                                             flow.lessons, kernel)
        fn = self.function(self.rewrite.calls.get(f"{op}@{kernel}", flow.call))
        return f'({fn} if "{kernel}" in cfg.fused else {own})'

    def call(self, op: str, fmt: str | None = None, site: str = "") -> str:
        """What a step of `op` calls: its lowering, wrapped by the recorder in a recording render and
        by the timer (keyed by the generated function `site` it is called from) in a timing one."""
        impl = self.impl(op, fmt)
        if op in self.rewrite.time_ops:
            impl = f'_timed("{site}.{op}", {impl})'
        return f'_record("{op}", {impl})' if op in self.rewrite.record_ops else impl

    def function(self, ref: str) -> str:
        """'package.module:function' -> the aliased name the generated code calls."""
        module, _, fn = ref.partition(":")
        alias = self.modules.setdefault(module, "_" + module.split(".")[-1])
        return f"{alias}.{fn}"

    def kwarg(self, value: str) -> str:
        return self.function(value) if re.fullmatch(r"[\w.]+:\w+", value) else value

    def lower_program(self, name: str, kind: dict[str, str]) -> Function:
        prog = self.lg.graph.programs[name]
        scope = "layer" if prog.params == "layer" else "model"
        pkeys = (layer_param_keys(self.table, kind) if scope == "layer"
                 else {e.key for e in self.table.entries if e.scope == "model"}
                 | {d.key for d in self.table.derived if d.scope == "model"})
        env = set(prog.inputs)
        body: list[str] = []
        fname = ENTRY_FUNCTIONS.get(name, name + "".join(f"_{v}" for v in kind.values()))
        pairs = self.linear_pairs(name, kind, scope)
        self.check_one_gemm(name, kind, pairs, pkeys)
        norms = self.quantised_norms(name, kind, scope)
        for i, step in enumerate(prog.steps):
            if not step.when.matches(kind) or i in pairs.values():
                continue                                     # a pair's second linear was made with its first
            where = self.lg.where(name, i)
            wired = self.rewrite.args.get(name, {}).get(step.out[0], {}) if step.out else {}
            args = [self.value(wired.get(port, v), env, pkeys, scope, where, kind) for port, v in step.args.items()]
            if i in pairs:
                second = prog.steps[pairs[i]]
                pair = self.pair_of(step, second)
                weight = self.value(second.args["weight"], env, pkeys, scope, where, kind)
                body += _assign(step.out + second.out, f"{self.function(pair.call)}(",
                                args + [weight] + (["merged=True"] if pair.one_gemm else []))
                env |= set(step.out) | set(second.out)
                continue
            if i in norms:
                attrs = [f"{k}={v}" for k, v in step.attrs.items()]
                body += _assign(step.out, f"{self.function(norms[i].call)}(", args + attrs)
                env |= set(step.out)
                continue
            if step.op is not None:
                rewritten = {k: self.kwarg(v) for k, v in self.rewrite.kwargs.get(step.op, {}).items()}
                attrs = [f"{k}={v}" for k, v in {**step.attrs, **rewritten}.items()]
                fmt = self.dispatch_format(step.op, step, scope, kind, where)
                self.check_consumed(name, i, step, fmt, kind, where)
                body += _assign(step.out, f"{self.call(step.op, fmt, fname)}(", args + attrs)
            elif step.loop is not None:
                body += self.loop(step, args, where)
            else:
                body += _assign(step.out, f"{self.callee(step.call)}(", ["lp", *args, "layer", "cfg", "rope"])
            env |= set(step.out) | ({step.tap} if step.tap else set())
        body.append("return " + ", ".join(self.results(prog, env, name)))
        first = "params" if scope == "model" else "lp"
        extra = ["cfg", "rope"] if scope == "model" else ["layer", "cfg", "rope"]
        doc = prog.doc.strip() + (f" Variant: {', '.join(f'{k}={v}' for k, v in kind.items())}." if kind else "")
        return Function(fname, ", ".join([first, *prog.inputs, *extra]), doc, tuple(body))

    def check_one_gemm(self, name: str, kind: dict[str, str], pairs: dict[int, int], pkeys: set[str]) -> None:
        """The first weight of a one_gemm pair holds both weights' rows in a block that has both: a step reading it
        outside the pair call (a render that records, times or rewrites `linear`, or a program using it alone)
        would get the wrong rows."""
        prog = self.lg.graph.programs[name]
        for pair in self.profile.shared_inputs.values():
            if not pair.one_gemm or not set(pair.keys) <= pkeys:
                continue
            for i, step in enumerate(prog.steps):
                if step.when.matches(kind) and i not in pairs and f"p.{pair.keys[0]}" in step.args.values():
                    raise SpecError(f"{self.lg.where(name, i)}: backend '{self.profile.name}' holds {pair.keys[0]} and "
                                    f"{pair.keys[1]} as one weight (shared_inputs one_gemm), but this step reads "
                                    f"{pair.keys[0]} outside their pair call")

    def pair_of(self, first, second):
        keys = (first.args["weight"][2:], second.args["weight"][2:])
        return next(p for p in self.profile.shared_inputs.values() if p.keys == keys)

    def linear_pairs(self, name: str, kind: dict[str, str], scope: str) -> dict[int, int]:
        """{first step: second step} of the profile's shared inputs in this program variant: two `linear` steps
        on the same input whose weights are a declared pair in the declared runtime format. Not in a render that
        records, times or rewrites `linear` (its calls stay one per step there)."""
        rw = self.rewrite
        if not self.profile.shared_inputs or "linear" in rw.record_ops or "linear" in rw.time_ops or "linear" in rw.calls:
            return {}
        prog = self.lg.graph.programs[name]
        steps = {s.args.get("weight"): (i, s) for i, s in enumerate(prog.steps)
                 if s.op == "linear" and s.when.matches(kind)}
        out = {}
        for pair in self.profile.shared_inputs.values():
            a, b = (steps.get(f"p.{k}") for k in pair.keys)
            if a is None or b is None or a[1].args["x"] != b[1].args["x"] or a[0] > b[0]:
                continue
            where = self.lg.where(name, a[0])
            if {self.dispatch_format("linear", s, scope, kind, where) for _, s in (a, b)} == {pair.format}:
                out[a[0]] = b[0]
        return out

    def quantised_norms(self, name: str, kind: dict[str, str], scope: str) -> dict[int, QuantisedNorm]:
        """{step: declaration} of the profile's quantised norms in this program variant: an `rms_norm` step with the
        declared weight whose output is read by one or more later steps, every one a `linear` whose weight has the
        declared runtime format, and is not a result. Not in a render that records, times or rewrites either op."""
        rw = self.rewrite
        ops = ("rms_norm", "linear")
        if not self.profile.quantised_norms or any(op in rw.record_ops or op in rw.time_ops or op in rw.calls
                                                   for op in ops):
            return {}
        prog = self.lg.graph.programs[name]
        out = {}
        for i, step in enumerate(prog.steps):
            norm = next((n for n in self.profile.quantised_norms.values()
                         if step.op == "rms_norm" and step.args.get("weight") == f"p.{n.key}"), None)
            if norm is None or not step.when.matches(kind) or step.out[0] in prog.returns:
                continue
            readers = [(j, s) for j, s in enumerate(prog.steps) if j > i and s.when.matches(kind)
                       and step.out[0] in {_base(v) for v in s.args.values()}]
            if readers and all(s.op == "linear" and s.args.get("x") == step.out[0]
                               and self.dispatch_format("linear", s, scope, kind, self.lg.where(name, j)) == norm.format
                               for j, s in readers):
                out[i] = norm
        return out

    def check_consumed(self, name: str, i: int, step, fmt: str | None, kind: dict[str, str], where: str) -> None:
        """A lowering that overwrites an input in place (`consumes`) must get a value this program made and
        nothing after the step reads: not a program input, a parameter or the cache, not a later step's
        argument, not a result."""
        prog = self.lg.graph.programs[name]
        lows = [self.profile.lowering(step.op, fmt)] + ([f[1]] if (f := self.profile.fused_of(step.op)) else [])
        for port in sorted({p for low in lows for p in low.consumes}):
            if port not in step.args:
                raise SpecError(f"{where}: backend '{self.profile.name}' declares op '{step.op}' consumes input "
                                f"'{port}', which it does not have (inputs: {', '.join(step.args)})")
            value = step.args[port]
            if value in prog.inputs or not re.fullmatch(r"\w+", value):
                raise SpecError(f"{where}: backend '{self.profile.name}' overwrites input '{port}' of op '{step.op}' "
                                f"in place, but it is bound to '{value}', which this program did not make")
            later = [(j, s) for j, s in enumerate(prog.steps) if j > i and s.when.matches(kind)
                     and value in {_base(v) for v in s.args.values()}]
            if later or value in prog.returns:
                at = self.lg.where(name, later[0][0]) if later else "the program's results"
                raise SpecError(f"{where}: backend '{self.profile.name}' overwrites input '{port}' of op '{step.op}' "
                                f"in place, but '{value}' is read afterwards ({at})")

    def value(self, ref: str, env: set[str], pkeys: set[str], scope: str, where: str, kind: dict[str, str]) -> str:
        if ref == "none":
            return "None"
        for pre, record in STAGE_REFS.items():
            if ref.startswith(pre):
                key = ref[len(pre):]
                if key not in self.stage_keys(pre):
                    raise SpecError(f"{where}: the {pre[:-1]} drafter stage has no parameter '{key}' "
                                    f"(accepted: {', '.join(sorted(self.stage_keys(pre)))})")
                return f'{record}["{key}"]'
        if ref.startswith("p."):
            key, optional = (ref[2:-1], True) if ref.endswith("?") else (ref[2:], False)
            if optional and key not in pkeys and scope == "layer" and key in layer_param_keys(self.table, kind, False):
                return f'lp.get("{key}")'           # a parameter only some layers of this kind have: None elsewhere
            if key not in pkeys:
                if scope == "layer" and key in layer_param_keys(self.table, {}, every=False):
                    raise SpecError(f"{where}: parameter '{key}' does not exist in {lacking(self.table, kind, key)} "
                                    "layers, which this step runs for (restrict the step with 'when')")
                raise SpecError(f"{where}: unknown parameter '{key}' (accepted: {', '.join(sorted(pkeys))})")
            return f'lp["{key}"]' if scope == "layer" else f'params.model["{key}"]'
        root, dot, field = ref.partition(".")
        if dot:
            allowed = {"batch": BATCH_FIELDS, "cache": CACHE_FIELDS}.get(root)
            if allowed is None or field not in allowed or root not in env:
                raise SpecError(f"{where}: cannot resolve '{ref}' (accepted: p.<key>, batch.<{'|'.join(BATCH_FIELDS)}>, "
                                f"cache.<{'|'.join(CACHE_FIELDS)}>, earlier outputs)")
            return ref
        if ref.endswith("?"):
            return ref[:-1] if ref[:-1] in env else "None"
        if ref not in env:
            raise SpecError(f"{where}: '{ref}' is not defined before this step (defined: {', '.join(sorted(env))})")
        return ref

    def stage_keys(self, pre: str) -> set[str]:
        """Block keys of the first or last stage of a drafter: a three-stage DSpark drafter's, or the
        one-layer MTP drafter's (its only stage is both)."""
        stage = 0 if pre == "first." else 2
        layers = (LayerInfo(stage, f"mtp.{stage}", "dspark", "dspark", 0, "learned", "main", stage, stage == 2),
                  LayerInfo(0, "mtp.0", "mtp", "swa", 0, "learned", "main", 0, True))
        return {runtime_key(e.key) for e in self.table.entries
                if e.scope == "block" and any(e.when.matches(layer) for layer in layers)}

    def callee(self, program: str) -> str:
        axis = self.lg.graph.programs[program].variants
        return f"{program.upper()}[layer.{axis}]" if axis else program

    def loop(self, step: Step, args: list[str], where: str) -> list[str]:
        # The callee's `cache` input is bound element-wise from the list argument, and its
        # returned cache collected back, so each layer sees and updates only its own state.
        callee = self.lg.graph.programs[step.call]
        names = list(callee.inputs)
        if "cache" not in names or step.out[-1] != args[names.index("cache")]:
            raise SpecError(f"{where}: a loop step must thread its 'cache' list through as the last output")
        caches = args[names.index("cache")]
        records = "params.layers" if step.loop == "backbone" else "params.drafter"
        call_args = ["lp", *("cache" if n == "cache" else a for n, a in zip(names, args)), "layer", "cfg", "rope"]
        x = step.out[0]
        tap = [] if step.tap is None else [
            f"    if layer.index in ({step.tap_layers}):",
            f"        {step.tap}.append({self.call(TAP_OP)}({x}))"]
        head = [] if step.tap is None else [f"{step.tap} = []"]
        before, after = (tap, []) if step.tap_input else ([], tap)
        return [*head, "new_caches = []",
                f"for layer, lp, cache in zip(params.{step.loop}_layers, {records}, {caches}):",
                *before,
                *("    " + line for line in _assign(step.out[:-1] + ("cache",), f"{self.callee(step.call)}(", call_args)),
                "    new_caches.append(cache)",
                *after,
                f"{step.out[-1]} = tuple(new_caches)"]

    def results(self, prog: Program, env: set[str], name: str) -> list[str]:
        out = []
        for r in prog.returns:
            if r not in env:
                line = self.lg.lines.get(("programs", name, "returns"), "?")
                raise SpecError(f"{self.lg.path}:{line}: program '{name}' returns '{r}', which no step defines")
            out.append(r)
        if prog.updates:
            fields = [f"{k}={v.rstrip('?')}" for k, v in prog.updates.items() if v.rstrip("?") in env]
            out.append(f"cache._replace({', '.join(fields)})")
        return out


def _base(ref: str) -> str:
    """The value a step argument reads: 'entries?' -> 'entries', 'cache.window' -> 'cache', 'rope[x]' -> 'rope'."""
    return re.split(r"[.\[?]", ref, maxsplit=1)[0]


def _assign(targets: tuple[str, ...], head: str, args: list[str]) -> list[str]:
    lhs = ", ".join(targets) + " = "
    one = lhs + head + ", ".join(args) + ")"
    if len(one) <= WRAP:
        return [one]
    return [lhs + head, *(f"    {a}," for a in args), ")"]


def lower(lg: LoadedGraph, profile: Profile, table: TensorTable, rewrite: Rewrite = Rewrite()) -> Lowered:
    lw = _Lowerer(lg, profile, table, rewrite)
    functions, dispatch = [], []
    for name, prog in lg.graph.programs.items():
        if prog.variants is None:
            functions.append(lw.lower_program(name, {}))
            continue
        entries = []
        for value in AXES[prog.variants]:
            fn = lw.lower_program(name, {prog.variants: value})
            functions.append(fn)
            entries.append((value, fn.name))
        dispatch.append((name.upper(), tuple(entries)))
    imports = tuple(f"import {m} as {a}" for m, a in sorted(lw.modules.items()))
    return Lowered(imports, tuple(functions), tuple(dispatch), tuple(sorted(lw.ops.values())))
