"""Shape expressions of the spec: integer arithmetic over config names.

`hidden_size`, `2*head_dim`, `(2+hc_mult)*hc_mult`, `in/2` (exact division: an inexact one is a
spec or config error), `cdiv(out, block_out)` (ceiling division). Parsed once with `ast`, never
`eval`ed. This module knows nothing about which names exist; callers pass an environment.
"""
from __future__ import annotations

import ast
import functools
import operator

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


class ExprError(ValueError):
    pass


@functools.lru_cache(maxsize=None)
def parse(text: str | int) -> ast.AST:
    """Parse and validate an expression; raises ExprError naming the offending construct."""
    if isinstance(text, int):
        return ast.Constant(text)
    try:
        tree = ast.parse(str(text), mode="eval").body
    except SyntaxError:
        raise ExprError(f"cannot parse shape expression '{text}'") from None
    for node in ast.walk(tree):
        ok = isinstance(node, (ast.BinOp, ast.Name, ast.Load, ast.Call, ast.Div, ast.USub, ast.UnaryOp))
        ok = ok or type(node) in _BINOPS or (isinstance(node, ast.Constant) and type(node.value) is int)
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id == "cdiv"):
            ok = False
        if not ok:
            raise ExprError(f"shape expression '{text}' uses unsupported syntax ({type(node).__name__})")
    return tree


def names(text: str | int) -> set[str]:
    """Every variable an expression reads (so a loader can check them before evaluating)."""
    return {n.id for n in ast.walk(parse(text)) if isinstance(n, ast.Name) and n.id != "cdiv"}


def unknown_name(text: str | int, known) -> str | None:
    """The first name (alphabetically) `text` reads that `known` lacks, None when it knows them all;
    ExprError when `text` does not parse."""
    unknown = names(text) - set(known)
    return min(unknown) if unknown else None


def evaluate(text: str | int, env: dict[str, int]) -> int:
    return _eval(parse(text), env, text)


def _eval(node, env, text) -> int:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise ExprError(f"shape expression '{text}' uses unknown name '{node.id}'")
        return int(env[node.id])
    if isinstance(node, ast.UnaryOp):
        return -_eval(node.operand, env, text)
    if isinstance(node, ast.Call):
        if len(node.args) != 2:
            raise ExprError(f"cdiv takes two arguments in '{text}'")
        a, b = (_eval(arg, env, text) for arg in node.args)
        return -(-a // b)
    left, right = _eval(node.left, env, text), _eval(node.right, env, text)
    if isinstance(node.op, ast.Div):
        if right == 0 or left % right:
            raise ExprError(f"'{text}' is not an exact division ({left} / {right})")
        return left // right
    return _BINOPS[type(node.op)](left, right)
