"""Distances and statistics over strings and words."""

from __future__ import annotations

from collections import Counter


def levenshtein(a: str, b: str) -> int:
    """The number of single-character insertions, deletions and substitutions from a to b."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            cost = 0 if char_a == char_b else 1
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + cost))
        previous = current
    return previous[-1]


def hamming(a: str, b: str) -> int:
    """Positions at which two equally long strings differ."""
    if len(a) != len(b):
        raise ValueError(f"hamming needs equal lengths, got {len(a)} and {len(b)}")
    return sum(1 for x, y in zip(a, b, strict=True) if x != y)


def common_prefix(words: list[str]) -> str:
    """The longest prefix shared by every word ("" for no words)."""
    if not words:
        return ""
    shortest = min(words, key=len)
    for index, char in enumerate(shortest):
        if any(word[index] != char for word in words):
            return shortest[:index]
    return shortest


def is_palindrome(text: str, strict: bool = False) -> bool:
    """Whether ``text`` reads the same backwards; non-strict ignores case and punctuation."""
    if not strict:
        text = "".join(char.lower() for char in text if char.isalnum())
    left, right = 0, len(text) - 1
    while left < right:
        if text[left] != text[right]:
            return False
        left += 1
        right -= 1
    return True


def word_frequencies(text: str, top: int | None = None) -> list[tuple[str, int]]:
    """(word, count) pairs, most frequent first, ties alphabetical; ``top`` keeps the first n."""
    words = [word.strip(".,;:!?\"'()").lower() for word in text.split()]
    counts = Counter(word for word in words if word)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    if top is not None:
        ranked = ranked[:top]
    return ranked


def jaccard(a: str, b: str) -> float:
    """Jaccard similarity of the two texts' lowercase word sets (1.0 for two empty texts)."""
    words_a = set(a.lower().split())
    words_b = set(b.lower().split())
    union = words_a | words_b
    if not union:
        return 1.0
    return len(words_a & words_b) / len(union)
