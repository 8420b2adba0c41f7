import pytest
from stackcalc import CalcSyntaxError, evaluate, to_rpn


def test_rpn_precedence():
    assert to_rpn("1 + 2 * 3") == ["1", "2", "3", "*", "+"]


def test_rpn_left_associative():
    assert to_rpn("8 - 3 - 2") == ["8", "3", "-", "2", "-"]
    assert to_rpn("8 / 4 / 2") == ["8", "4", "/", "2", "/"]


def test_rpn_power_is_right_associative():
    assert to_rpn("2 ^ 3 ^ 2") == ["2", "3", "2", "^", "^"]


def test_rpn_parentheses():
    assert to_rpn("(1 + 2) * 3") == ["1", "2", "+", "3", "*"]


def test_rpn_unary_minus():
    assert to_rpn("-x") == ["x", "neg"]
    assert to_rpn("2 * -3") == ["2", "3", "neg", "*"]


def test_rpn_function_call():
    assert to_rpn("max(1, 2 + 3)") == ["1", "2", "3", "+", "max"]


def test_evaluate_arithmetic():
    assert evaluate("1 + 2 * 3") == 7
    assert evaluate("(1 + 2) * 3") == 9
    assert evaluate("10 - 4 - 3") == 3


def test_evaluate_division_keeps_integers_when_exact():
    assert evaluate("12 / 4") == 3
    assert isinstance(evaluate("12 / 4"), int)
    assert evaluate("7 / 2") == 3.5


def test_evaluate_modulo():
    assert evaluate("17 % 5") == 2


def test_evaluate_power():
    assert evaluate("2 ^ 3 ^ 2") == 512
    assert evaluate("2 ^ 10") == 1024


def test_evaluate_unary_minus_binds_looser_than_power():
    assert evaluate("-2 ^ 2") == -4
    assert evaluate("(-2) ^ 2") == 4


def test_evaluate_unary_minus_binds_tighter_than_product():
    assert evaluate("-2 * 3 + 10") == 4
    assert evaluate("3 - -2") == 5


def test_evaluate_power_of_negative_exponent():
    assert evaluate("2 ^ -1") == 0.5


def test_evaluate_variables():
    assert evaluate("rate * hours + 5", rate=20, hours=3) == 65


def test_evaluate_functions():
    assert evaluate("max(3, 7) - min(3, 7)") == 4
    assert evaluate("abs(2 - 9)") == 7
    assert evaluate("sqrt(16) + 1") == 5.0


def test_evaluate_nested_calls():
    assert evaluate("max(min(4, 9), abs(-6))") == 6


def test_evaluate_decimals():
    assert evaluate("0.5 + .25") == 0.75


def test_unbalanced_closing_paren():
    with pytest.raises(CalcSyntaxError, match=r"unbalanced '\)' at 5"):
        evaluate("(1+2))")


def test_unbalanced_opening_paren():
    with pytest.raises(CalcSyntaxError, match=r"unbalanced '\('"):
        evaluate("((1+2)")


def test_leftover_values_are_refused():
    with pytest.raises(CalcSyntaxError, match="leaves 2 values, expected 1"):
        evaluate("1 2")
