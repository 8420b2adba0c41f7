"""A stack machine for reverse Polish words: numbers, arithmetic, stack words, variables."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

Number = float | int


class StackUnderflow(RuntimeError):
    """A word needed more values than the stack held."""


def divide(a: Number, b: Number) -> Number:
    if b == 0:
        raise ZeroDivisionError("division by zero")
    quotient = a / b
    return int(quotient) if isinstance(a, int) and isinstance(b, int) and a % b == 0 else quotient


def modulo(a: Number, b: Number) -> Number:
    if b == 0:
        raise ZeroDivisionError("modulo by zero")
    return a % b


BINARY: dict[str, Callable[[Number, Number], Number]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": divide,
    "%": modulo,
    "^": lambda a, b: a**b,
}
# Functions callable from infix expressions, by arity.
FUNCTIONS: dict[str, int] = {"max": 2, "min": 2, "abs": 1, "sqrt": 1}


class Machine:
    def __init__(self, variables: Mapping[str, Number] | None = None) -> None:
        self.stack: list[Number] = []
        self.variables = dict(variables or {})

    def pop(self, count: int, word: str) -> list[Number]:
        """The top ``count`` values, deepest first, removed from the stack."""
        if len(self.stack) < count:
            raise StackUnderflow(
                f"{word!r} needs {count} values, the stack holds {len(self.stack)}"
            )
        values = self.stack[len(self.stack) - count :]
        del self.stack[len(self.stack) - count :]
        return values

    def step(self, word: str) -> None:
        if word in BINARY:
            a, b = self.pop(2, word)
            self.stack.append(BINARY[word](a, b))
        elif word in FUNCTIONS:
            self.call(word)
        elif word in ("neg", "dup", "drop", "swap", "over"):
            self.stack_word(word)
        elif word.startswith("!") and len(word) > 1:
            (self.variables[word[1:]],) = self.pop(1, word)
        elif word[0].isdigit() or word[0] == ".":
            self.stack.append(float(word) if "." in word else int(word))
        elif word in self.variables:
            self.stack.append(self.variables[word])
        else:
            raise KeyError(f"unknown word {word!r}")

    def call(self, name: str) -> None:
        args = self.pop(FUNCTIONS[name], name)
        if name == "max":
            self.stack.append(max(args))
        elif name == "min":
            self.stack.append(min(args))
        elif name == "abs":
            self.stack.append(abs(args[0]))
        else:
            if args[0] < 0:
                raise ValueError(f"sqrt of a negative number: {args[0]}")
            self.stack.append(math.sqrt(args[0]))

    def stack_word(self, word: str) -> None:
        if word == "neg":
            (value,) = self.pop(1, word)
            self.stack.append(-value)
        elif word == "dup":
            (value,) = self.pop(1, word)
            self.stack.extend([value, value])
        elif word == "drop":
            self.pop(1, word)
        elif word == "swap":
            a, b = self.pop(2, word)
            self.stack.extend([b, a])
        else:
            a, b = self.pop(2, word)
            self.stack.extend([a, b, a])

    def run(self, words: list[str]) -> list[Number]:
        for word in words:
            self.step(word)
        return self.stack


def run_program(program: str, variables: Mapping[str, Number] | None = None) -> list[Number]:
    """Run a whitespace-separated RPN program; returns the final stack, bottom first."""
    return Machine(variables).run(program.split())
