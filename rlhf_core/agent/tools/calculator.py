"""A calculator: the value of an arithmetic expression (+ - * / // % ** and parentheses on
integers and decimals), evaluated from its syntax tree (nothing is executed)."""

from __future__ import annotations

import ast
import operator

from rlhf_core.agent.tools.base import BaseTool, ToolResponse

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPRESSION = 200
MAX_EXPONENT = 64
#: The largest integer any step may make: nested powers ((9**64)**64)**64 grow past any
#: exponent bound, and the call runs on the agent's event loop, where nothing can stop it.
MAX_BITS = 4096


def evaluate(expression: str):
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"an expression of at most {MAX_EXPRESSION} characters")

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"an exponent of at most {MAX_EXPONENT}")
            if isinstance(left, int) and isinstance(right, int) and _bits(node.op, left, right) > MAX_BITS:
                raise ValueError(f"intermediate results of at most {MAX_BITS} bits")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    return value(ast.parse(expression, mode="eval").body)


def _bits(op, left: int, right: int) -> int:
    """An upper bound on the bits of ``left op right``, known before it is computed."""
    if isinstance(op, ast.Pow):
        return abs(left).bit_length() * max(right, 0)
    if isinstance(op, ast.Mult):
        return abs(left).bit_length() + abs(right).bit_length()
    return max(abs(left).bit_length(), abs(right).bit_length()) + 1


class CalculatorTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        try:
            result = evaluate(str(parameters.get("expression", "")))
        except (ValueError, SyntaxError, ZeroDivisionError, OverflowError) as exc:
            return ToolResponse(text=f"Error: {exc}"), 0.0, {"status": "error"}
        if isinstance(result, float) and result.is_integer():
            result = int(result)
        return ToolResponse(text=str(result)), 0.0, {"status": "ok"}
