"""Tokens of infix expressions: numbers, names, operators, parentheses and commas."""

from __future__ import annotations

from dataclasses import dataclass

OPERATOR_CHARS = "+-*/%^"


class CalcSyntaxError(ValueError):
    """A malformed expression; the message names the position."""


@dataclass(frozen=True)
class Token:
    kind: str  # "number", "name", "op", "lparen", "rparen" or "comma"
    text: str
    position: int

    @property
    def value(self) -> float | int:
        if self.kind != "number":
            raise TypeError(f"token {self.text!r} is not a number")
        return float(self.text) if "." in self.text else int(self.text)


def read_number(source: str, start: int) -> int:
    """The end of the number starting at ``start`` (digits with at most one dot)."""
    end = start
    seen_dot = False
    while end < len(source) and (source[end].isdigit() or source[end] == "."):
        if source[end] == ".":
            if seen_dot:
                raise CalcSyntaxError(f"second decimal point at {end}")
            seen_dot = True
        end += 1
    return end


def read_name(source: str, start: int) -> int:
    end = start
    while end < len(source) and (source[end].isalnum() or source[end] == "_"):
        end += 1
    return end


def tokenize(source: str) -> list[Token]:
    tokens = []
    index = 0
    while index < len(source):
        char = source[index]
        if char.isspace():
            index += 1
            continue
        if char.isdigit() or char == ".":
            end = read_number(source, index)
            kind = "number"
        elif char.isalpha() or char == "_":
            end = read_name(source, index)
            kind = "name"
        elif char in OPERATOR_CHARS:
            end, kind = index + 1, "op"
        elif char in "(),":
            end, kind = index + 1, {"(": "lparen", ")": "rparen", ",": "comma"}[char]
        else:
            raise CalcSyntaxError(f"unexpected character {char!r} at {index}")
        tokens.append(Token(kind, source[index:end], index))
        index = end
    return tokens
