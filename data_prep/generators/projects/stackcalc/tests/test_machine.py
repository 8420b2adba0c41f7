import pytest
from stackcalc import Machine, StackUnderflow, run_program


def test_arithmetic_words():
    assert run_program("3 4 +") == [7]
    assert run_program("3 4 -") == [-1]
    assert run_program("3 4 *") == [12]
    assert run_program("2 5 ^") == [32]


def test_division_and_modulo():
    assert run_program("9 3 /") == [3]
    assert run_program("9 4 /") == [2.25]
    assert run_program("9 4 %") == [1]


def test_division_of_floats_stays_float():
    assert run_program("9.0 3 /") == [3.0]
    assert isinstance(run_program("9.0 3 /")[0], float)


def test_division_by_zero():
    with pytest.raises(ZeroDivisionError, match="division by zero"):
        run_program("1 0 /")
    with pytest.raises(ZeroDivisionError, match="modulo by zero"):
        run_program("1 0 %")


def test_stack_words():
    assert run_program("1 2 swap") == [2, 1]
    assert run_program("1 2 over") == [1, 2, 1]
    assert run_program("1 dup") == [1, 1]
    assert run_program("1 2 drop") == [1]
    assert run_program("5 neg") == [-5]


def test_square_with_dup():
    assert run_program("7 dup *") == [49]


def test_variables_store_and_load():
    assert run_program("4 !x x x *") == [16]


def test_variables_given_up_front():
    assert run_program("a b -", {"a": 10, "b": 4}) == [6]


def test_unknown_word():
    with pytest.raises(KeyError, match="unknown word 'frob'"):
        run_program("1 frob")


def test_bare_bang_is_unknown():
    with pytest.raises(KeyError, match="unknown word '!'"):
        run_program("1 !")


def test_underflow_names_the_word():
    with pytest.raises(StackUnderflow, match="'\\+' needs 2 values, the stack holds 1"):
        run_program("1 +")


def test_underflow_on_empty_stack():
    with pytest.raises(StackUnderflow, match="'dup' needs 1 values, the stack holds 0"):
        run_program("dup")


def test_pop_returns_deepest_first():
    machine = Machine()
    machine.run(["1", "2", "3"])
    assert machine.pop(2, "test") == [2, 3]
    assert machine.stack == [1]


def test_functions():
    assert run_program("3 9 max") == [9]
    assert run_program("3 9 min") == [3]
    assert run_program("4 neg abs") == [4]
    assert run_program("9 sqrt") == [3.0]


def test_sqrt_of_negative():
    with pytest.raises(ValueError, match="sqrt of a negative number: -1"):
        run_program("1 neg sqrt")


def test_sqrt_of_zero():
    assert run_program("0 sqrt") == [0.0]


def test_run_returns_the_stack():
    machine = Machine({"k": 2})
    assert machine.run(["k", "k", "+"]) is machine.stack
    assert machine.stack == [4]
