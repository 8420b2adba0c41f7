import pytest
from textkit import caesar, from_base, rle_decode, rle_encode, to_base


def test_rle_encode_runs():
    assert rle_encode("aaabcc") == "a3bc2"


def test_rle_encode_no_runs():
    assert rle_encode("abc") == "abc"


def test_rle_encode_long_run():
    assert rle_encode("x" * 12 + "y") == "x12y"


def test_rle_encode_empty():
    assert rle_encode("") == ""


def test_rle_encode_rejects_digits():
    with pytest.raises(ValueError, match="digits"):
        rle_encode("a1")


def test_rle_decode_runs():
    assert rle_decode("a3bc2") == "aaabcc"


def test_rle_decode_multi_digit_count():
    assert rle_decode("x12y") == "x" * 12 + "y"


def test_rle_decode_rejects_leading_count():
    with pytest.raises(ValueError, match="count without a character at 0"):
        rle_decode("3a")


def test_rle_round_trip():
    for text in ["", "a", "aa", "abba", "zzzzzzzzzzzq", "mississippi"]:
        assert rle_decode(rle_encode(text)) == text


def test_caesar_shifts_letters():
    assert caesar("abc xyz", 3) == "def abc"


def test_caesar_keeps_case_and_punctuation():
    assert caesar("Hello, World!", 13) == "Uryyb, Jbeyq!"


def test_caesar_negative_shift_undoes():
    assert caesar(caesar("Attack at Dawn", 7), -7) == "Attack at Dawn"


def test_caesar_boundaries():
    assert caesar("zZ", 1) == "aA"
    assert caesar("aA", -1) == "zZ"


def test_to_base_binary_and_hex():
    assert to_base(10, 2) == "1010"
    assert to_base(255, 16) == "ff"


def test_to_base_zero_and_negative():
    assert to_base(0, 7) == "0"
    assert to_base(-35, 36) == "-z"


def test_to_base_powers():
    assert to_base(36, 36) == "10"
    assert to_base(8, 8) == "10"
    assert to_base(1, 2) == "1"


def test_to_base_rejects_bad_base():
    with pytest.raises(ValueError, match="base must be between 2 and 36"):
        to_base(5, 1)
    with pytest.raises(ValueError, match="base must be between 2 and 36"):
        to_base(5, 37)


def test_to_base_accepts_extreme_bases():
    assert to_base(5, 2) == "101"
    assert to_base(71, 36) == "1z"


def test_from_base_parses():
    assert from_base("1010", 2) == 10
    assert from_base("FF", 16) == 255


def test_from_base_negative_and_spaces():
    assert from_base("  -z ", 36) == -35


def test_from_base_rejects_digit_out_of_range():
    with pytest.raises(ValueError, match="'2' is not a base-2 digit"):
        from_base("102", 2)


def test_from_base_accepts_highest_digit():
    assert from_base("1", 2) == 1
    assert from_base("z", 36) == 35


def test_from_base_rejects_bad_base_and_empty():
    with pytest.raises(ValueError, match="base must be"):
        from_base("1", 40)
    with pytest.raises(ValueError, match="no digits"):
        from_base("-", 10)


def test_base_round_trip():
    for number in [0, 1, 2, 35, 36, 1295, -4096, 123456789]:
        for base in [2, 3, 10, 16, 36]:
            assert from_base(to_base(number, base), base) == number
