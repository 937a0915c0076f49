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
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    return value(ast.parse(expression, mode="eval").body)


class CalculatorTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        try:
            result = evaluate(str(parameters.get("expression", "")))
        except (ValueError, SyntaxError, ZeroDivisionError, OverflowError) as exc:
            return ToolResponse(text=f"Error: {exc}"), 0.0, {"status": "error"}
        if isinstance(result, float) and result.is_integer():
            result = int(result)
        return ToolResponse(text=str(result)), 0.0, {"status": "ok"}
