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

MAX_BITS = 4096
"""The largest integer, in bits, an expression may compute on the way (1233 digits)."""
ALLOWED_CHARACTERS = frozenset("0123456789+-*/(). ")
"""The benchmark's own character check (`calculate` in tau2.domains.{retail,airline}.tools)."""
BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


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


def _value(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _bounded(BINARY[type(node.op)](left, right))
    raise ValueError("calculate takes numbers, the operators + - * / and parentheses")


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
