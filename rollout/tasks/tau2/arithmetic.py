"""A bound on τ²-bench's `calculate` tool (retail and airline), checked before it evaluates.

The benchmark's `calculate` admits an expression whose characters are digits, `+-*/().`
and spaces, then hands it to `eval`; those characters also spell `**`, so `9**9**8` passes
and computes a number of 140 million bits, in C, for as long as it takes. `check` walks the
expression's syntax tree, computing as Python does, and refuses before any operation whose
integer result would pass `MAX_BITS`; everything else goes on to the benchmark's own code,
which computes the same value and answers as it always does (`2**10` stays legal, and
syntax errors and divisions by zero keep the benchmark's messages).

What is refused could not have been an answer: the benchmark turns the result into a float,
which holds no number beyond 2**1024, so a refused expression ends in the benchmark's own
OverflowError unless it cancels back down (`9**9999 - 9**9999`), which no arithmetic a
customer-service policy needs does.
"""

from __future__ import annotations

import ast
import functools
import operator
from collections.abc import Callable

MAX_BITS = 4096
"""The largest integer, in bits, an expression may compute on the way (1233 digits)."""
ALLOWED_CHARACTERS = frozenset("0123456789+-*/(). ")
"""The benchmark's own character check (`calculate` in tau2.domains.{retail,airline}.tools)."""
BINARY: dict[type[ast.operator], Callable[[int | float, int | float], int | float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
}
UNARY: dict[type[ast.unaryop], Callable[[int | float], int | float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def check(expression: str) -> None:
    """ValueError for an expression the benchmark's `eval` would compute without a bound;
    nothing for one it refuses itself (a character it does not allow, bad syntax)."""
    if not set(expression) <= ALLOWED_CHARACTERS:
        return
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        return
    _value(tree.body)


def _value(tree: ast.AST):
    """The tree's value, computed as Python does (left operand first), without recursion:
    the parser admits sums of a few thousand terms, deeper than Python's call stack."""
    results, stack = [], [(tree, False)]
    while stack:
        node, operands_done = stack.pop()
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            results.append(_bounded(node.value))
        elif isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
            if operands_done:
                results.append(UNARY[type(node.op)](results.pop()))
            else:
                stack += [(node, True), (node.operand, False)]
        elif isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            if operands_done:
                right, left = results.pop(), results.pop()
                results.append(_binary(node.op, left, right))
            else:
                stack += [(node, True), (node.right, False), (node.left, False)]
        else:
            raise ValueError("calculate takes numbers, the operators + - * / and parentheses")
    return results.pop()


def _binary(op: ast.operator, left, right):
    if isinstance(op, ast.Pow):
        _check_power(left, right)
    return _bounded(BINARY[type(op)](left, right))


def _check_power(base, exponent) -> None:
    """Refuse an integer power of at least MAX_BITS bits before computing it: |base| holds
    at least 2**(bit_length - 1), so the power has at least (bit_length - 1) * exponent bits."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        if (abs(base).bit_length() - 1) * exponent > MAX_BITS:
            raise ValueError(f"the result is too large to compute (over {MAX_BITS} bits)")


def _bounded(value):
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise ValueError(f"the result is too large to compute (over {MAX_BITS} bits)")
    return value


def guard_calculate() -> None:
    """Make the retail and airline toolkits' `calculate` refuse what `check` refuses, for
    every environment of this process (the episode's calls and the verdict's replays)."""
    from tau2.domains.airline.tools import AirlineTools
    from tau2.domains.retail.tools import RetailTools

    for toolkit in (AirlineTools, RetailTools):
        toolkit.calculate = _guarded(toolkit.calculate)


def _guarded(calculate):
    @functools.wraps(calculate)
    def guarded(self, expression: str) -> str:
        check(expression)
        return calculate(self, expression)

    return guarded
