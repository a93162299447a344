"""Builtin tools an environment may offer the model (`tools = [...]`)."""

from __future__ import annotations

import ast
import operator

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
              ast.Mod: operator.mod, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """Evaluate integer arithmetic: + - * // % and parentheses.

    Args:
        expression: the arithmetic to evaluate, such as "12+19".
    """
    return str(_evaluate(ast.parse(expression.strip(), mode="eval").body))


def _evaluate(node):
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not integer arithmetic: {ast.unparse(node)!r}")
