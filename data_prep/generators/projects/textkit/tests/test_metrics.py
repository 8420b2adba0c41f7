import pytest
from textkit import common_prefix, hamming, is_palindrome, jaccard, levenshtein, word_frequencies


def test_levenshtein_classic():
    assert levenshtein("kitten", "sitting") == 3


def test_levenshtein_is_symmetric():
    assert levenshtein("flaw", "lawn") == levenshtein("lawn", "flaw") == 2


def test_levenshtein_empty():
    assert levenshtein("", "abc") == 3
    assert levenshtein("abc", "") == 3
    assert levenshtein("", "") == 0


def test_levenshtein_identical():
    assert levenshtein("same", "same") == 0


def test_levenshtein_single_edits():
    assert levenshtein("cat", "cut") == 1
    assert levenshtein("cat", "cast") == 1
    assert levenshtein("cast", "cat") == 1


def test_hamming_counts_differences():
    assert hamming("karolin", "kathrin") == 3


def test_hamming_identical_is_zero():
    assert hamming("abc", "abc") == 0


def test_hamming_rejects_unequal_lengths():
    with pytest.raises(ValueError, match="equal lengths"):
        hamming("abc", "ab")


def test_common_prefix():
    assert common_prefix(["interstellar", "internet", "interval"]) == "inter"


def test_common_prefix_one_word_is_a_prefix_of_the_others():
    assert common_prefix(["car", "cart", "carbon"]) == "car"


def test_common_prefix_none_shared():
    assert common_prefix(["dog", "cat"]) == ""


def test_common_prefix_empty_list():
    assert common_prefix([]) == ""


def test_is_palindrome_plain():
    assert is_palindrome("racecar")
    assert not is_palindrome("racecars")


def test_is_palindrome_ignores_punctuation_and_case():
    assert is_palindrome("A man, a plan, a canal: Panama!")


def test_is_palindrome_strict_respects_case():
    assert not is_palindrome("Abba", strict=True)
    assert is_palindrome("abba", strict=True)


def test_is_palindrome_differs_only_in_the_middle():
    assert not is_palindrome("abcxba")
    assert not is_palindrome("ab")


def test_is_palindrome_trivial():
    assert is_palindrome("")
    assert is_palindrome("x")


def test_word_frequencies_orders_by_count_then_word():
    text = "the cat and the hat and the bat"
    assert word_frequencies(text) == [("the", 3), ("and", 2), ("bat", 1), ("cat", 1), ("hat", 1)]


def test_word_frequencies_strips_punctuation_and_case():
    assert word_frequencies("Yes! yes, YES? no.") == [("yes", 3), ("no", 1)]


def test_word_frequencies_top():
    assert word_frequencies("b a b c c c", top=2) == [("c", 3), ("b", 2)]


def test_word_frequencies_top_zero():
    assert word_frequencies("a b", top=0) == []


def test_jaccard_partial_overlap():
    assert jaccard("the cat sat", "the dog sat") == pytest.approx(2 / 4)


def test_jaccard_identical_and_disjoint():
    assert jaccard("A b", "b a") == 1.0
    assert jaccard("a", "b") == 0.0


def test_jaccard_empty_texts():
    assert jaccard("", "") == 1.0
    assert jaccard("", "word") == 0.0
