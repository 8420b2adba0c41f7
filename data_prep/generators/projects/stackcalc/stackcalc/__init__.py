"""An infix calculator compiled to reverse Polish notation and run on a stack machine."""

from stackcalc.lexer import CalcSyntaxError, Token, tokenize
from stackcalc.machine import Machine, StackUnderflow, run_program
from stackcalc.parser import evaluate, to_rpn

__all__ = [
    "CalcSyntaxError",
    "Machine",
    "StackUnderflow",
    "Token",
    "evaluate",
    "run_program",
    "to_rpn",
    "tokenize",
]
