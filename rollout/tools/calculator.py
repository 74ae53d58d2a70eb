"""Arithmetic the policy can hand off: + - * / // % ** and parentheses on integers and
decimals, evaluated from the expression's syntax tree (never `eval`), with bounds that keep
a hostile expression from eating the rollout server (huge powers, huge numbers)."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING

from rollout.tools.base import ToolError, function_schema

if TYPE_CHECKING:
    from services.config import CalculatorToolSpec

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1000
MAX_DIGITS = 4000
"""The largest integer result, in decimal digits; bigger is an error, not a slow reply."""
MAX_BITS = int(MAX_DIGITS * 3.33)

_BINARY: dict[type[ast.operator], Callable[[int | float, int | float], int | float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[int | float], int | float]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ToolError saying what is wrong otherwise."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip().replace("^", "**").replace("×", "*"), mode="eval")
    except SyntaxError:
        raise ToolError(f"not an arithmetic expression: {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent above {MAX_EXPONENT}")
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and left.bit_length() * right > MAX_BITS:
            raise ToolError(f"result longer than {MAX_DIGITS} digits")  # refused before it is computed
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result too large") from None
        if isinstance(result, complex):
            raise ToolError("the result is not a real number")
        if isinstance(result, int) and result.bit_length() > MAX_BITS:
            raise ToolError(f"result longer than {MAX_DIGITS} digits")
        if isinstance(result, float) and not math.isfinite(result):
            raise ToolError("result too large")
        return result
    raise ToolError(f"unsupported in an arithmetic expression: {ast.unparse(node)!r}")


def format_number(value: int | float) -> str:
    """Integers as they are; floats without a spurious `.0` and at most 12 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


class Calculator:
    def __init__(self, name: str = "calculator", description: str | None = None) -> None:
        self.name = name
        self.description = description or "Evaluate an arithmetic expression (+ - * / // % ** and parentheses)."

    def schema(self) -> dict:
        return function_schema(
            self.name,
            self.description,
            {"expression": {"type": "string", "description": "For example 4821 * 397"}},
            ["expression"],
        )

    async def call(self, arguments: dict) -> str:
        return format_number(evaluate(arguments["expression"]))

    async def close(self) -> None:
        pass


async def open_tools(specs: list[CalculatorToolSpec]) -> list[Calculator]:
    """The tools of `specs` (all of this kind), in their order (`rollout.tools.box.TOOL_MODULES`)."""
    return [Calculator(spec.name, spec.description) for spec in specs]
