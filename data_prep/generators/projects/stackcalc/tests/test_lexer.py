import pytest
from stackcalc import CalcSyntaxError, Token, tokenize


def kinds(source):
    return [token.kind for token in tokenize(source)]


def texts(source):
    return [token.text for token in tokenize(source)]


def test_tokenize_numbers_and_operators():
    assert texts("12+3.5*x") == ["12", "+", "3.5", "*", "x"]
    assert kinds("12+3.5*x") == ["number", "op", "number", "op", "name"]


def test_tokenize_skips_whitespace_and_records_positions():
    tokens = tokenize("  a  + 10")
    assert [token.position for token in tokens] == [2, 5, 7]


def test_tokenize_parens_and_commas():
    assert kinds("max(a, 2)") == ["name", "lparen", "name", "comma", "number", "rparen"]


def test_tokenize_names_with_digits_and_underscores():
    assert texts("_rate2*x_1") == ["_rate2", "*", "x_1"]


def test_tokenize_leading_dot_number():
    assert texts(".5+1") == [".5", "+", "1"]


def test_tokenize_all_operators():
    assert texts("1+2-3*4/5%6^7") == list("1+2-3*4/5%6^7")


def test_tokenize_rejects_unknown_character():
    with pytest.raises(CalcSyntaxError, match="unexpected character '#' at 2"):
        tokenize("1 # 2")


def test_tokenize_rejects_second_decimal_point():
    with pytest.raises(CalcSyntaxError, match="second decimal point at 3"):
        tokenize("1.2.3")


def test_token_value():
    assert Token("number", "42", 0).value == 42
    assert isinstance(Token("number", "42", 0).value, int)
    assert Token("number", "2.5", 0).value == 2.5


def test_token_value_of_non_number():
    with pytest.raises(TypeError, match="is not a number"):
        _ = Token("name", "x", 0).value


def test_tokenize_empty():
    assert tokenize("") == []
    assert tokenize("   ") == []
