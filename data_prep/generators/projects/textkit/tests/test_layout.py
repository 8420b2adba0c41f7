import pytest
from textkit import center, columns, indent, truncate, wrap


def test_wrap_greedy():
    assert wrap("the quick brown fox jumps over the lazy dog", 10) == [
        "the quick",
        "brown fox",
        "jumps over",
        "the lazy",
        "dog",
    ]


def test_wrap_exact_fit():
    assert wrap("ab cd", 5) == ["ab cd"]
    assert wrap("ab cd", 4) == ["ab", "cd"]


def test_wrap_long_word_on_its_own_line():
    assert wrap("a extraordinarily b", 5) == ["a", "extraordinarily", "b"]


def test_wrap_empty_and_whitespace():
    assert wrap("", 5) == []
    assert wrap("   ", 5) == []


def test_wrap_rejects_non_positive_width():
    with pytest.raises(ValueError, match="width must be positive"):
        wrap("a", 0)


def test_wrap_width_one():
    assert wrap("a b", 1) == ["a", "b"]


def test_truncate_short_text_unchanged():
    assert truncate("hello", 5) == "hello"
    assert truncate("hello", 10) == "hello"


def test_truncate_cuts_with_ellipsis():
    assert truncate("hello world", 8) == "hello..."


def test_truncate_custom_ellipsis():
    assert truncate("hello world", 6, ellipsis="~") == "hello~"


def test_truncate_limit_equal_to_ellipsis():
    assert truncate("hello", 3) == "..."


def test_truncate_rejects_tiny_limit():
    with pytest.raises(ValueError, match="shorter than the ellipsis"):
        truncate("hello", 2)


def test_center_even_padding():
    assert center("ab", 6) == "  ab  "


def test_center_odd_padding_extra_on_right():
    assert center("ab", 5, fill="*") == "*ab**"


def test_center_no_padding_needed():
    assert center("abcdef", 4) == "abcdef"
    assert center("abc", 3) == "abc"


def test_center_rejects_long_fill():
    with pytest.raises(ValueError, match="one character"):
        center("a", 4, fill="ab")


def test_indent_skips_blank_lines():
    assert indent("a\n\n  \nb", "> ") == "> a\n\n  \n> b"


def test_indent_all_lines():
    assert indent("a\n\nb", "# ", skip_blank=False) == "# a\n# \n# b"


def test_columns_pads_cells():
    rows = [["name", "qty"], ["apple", "3"], ["fig", "12"]]
    assert columns(rows) == ["name  | qty", "apple | 3", "fig   | 12"]


def test_columns_short_rows_and_separator():
    rows = [["a", "bb", "c"], ["ddd"]]
    assert columns(rows, sep=",") == ["a  ,bb,c", "ddd,  ,"]


def test_columns_empty():
    assert columns([]) == []
