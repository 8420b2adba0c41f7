"""Shunting-yard compilation of infix tokens to reverse Polish notation.

Unary minus becomes the ``neg`` word and calls ``name(a, b)`` become ``a b name``; ``^``
is right-associative and binds tighter than unary minus, as in ``-2^2 == -4``.
"""

from __future__ import annotations

from stackcalc.lexer import CalcSyntaxError, Token, tokenize
from stackcalc.machine import FUNCTIONS, Machine

PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2, "%": 2, "neg": 3, "^": 4}
RIGHT_ASSOCIATIVE = frozenset({"^", "neg"})


def is_operand_end(previous: Token | None) -> bool:
    """Whether a ``-`` after ``previous`` is binary (it follows a complete operand)."""
    return previous is not None and previous.kind in ("number", "name", "rparen")


def pops_before(top: str, incoming: str) -> bool:
    """Whether operator ``top`` on the stack is emitted before ``incoming`` is pushed."""
    if top not in PRECEDENCE:
        return False
    if incoming in RIGHT_ASSOCIATIVE:
        return PRECEDENCE[top] > PRECEDENCE[incoming]
    return PRECEDENCE[top] >= PRECEDENCE[incoming]


def close_paren(stack: list[str], output: list[str], token: Token) -> None:
    while stack and stack[-1] != "(":
        output.append(stack.pop())
    if not stack:
        raise CalcSyntaxError(f"unbalanced ')' at {token.position}")
    stack.pop()
    if stack and stack[-1] in FUNCTIONS:
        output.append(stack.pop())


def push_operator(
    stack: list[str], output: list[str], token: Token, previous: Token | None
) -> None:
    op = token.text
    if op == "-" and not is_operand_end(previous):
        op = "neg"
    # A prefix operator has no left operand yet, so nothing is complete to emit.
    while op != "neg" and stack and pops_before(stack[-1], op):
        output.append(stack.pop())
    stack.append(op)


def to_rpn(source: str) -> list[str]:
    """The reverse Polish words of an infix expression."""
    output: list[str] = []
    stack: list[str] = []
    previous: Token | None = None
    for token in tokenize(source):
        if token.kind == "number":
            output.append(token.text)
        elif token.kind == "name" and token.text in FUNCTIONS:
            stack.append(token.text)
        elif token.kind == "name":
            output.append(token.text)
        elif token.kind == "op":
            push_operator(stack, output, token, previous)
        elif token.kind == "lparen":
            stack.append("(")
        elif token.kind == "rparen":
            close_paren(stack, output, token)
        else:
            while stack and stack[-1] != "(":
                output.append(stack.pop())
        previous = token
    while stack:
        word = stack.pop()
        if word == "(":
            raise CalcSyntaxError("unbalanced '(' at the end of the expression")
        output.append(word)
    return output


def evaluate(source: str, **variables: float) -> float | int:
    """The value of an infix expression; names are looked up in ``variables``."""
    machine = Machine(variables)
    machine.run(to_rpn(source))
    if len(machine.stack) != 1:
        raise CalcSyntaxError(f"expression leaves {len(machine.stack)} values, expected 1")
    return machine.stack[0]
