"""Text utilities: case conversion, string metrics, simple codecs and plain-text layout."""

from textkit.case import camel_to_snake, slugify, snake_to_camel, title_case
from textkit.codec import caesar, from_base, rle_decode, rle_encode, to_base
from textkit.layout import center, columns, indent, truncate, wrap
from textkit.metrics import (
    common_prefix,
    hamming,
    is_palindrome,
    jaccard,
    levenshtein,
    word_frequencies,
)

__all__ = [
    "caesar",
    "camel_to_snake",
    "center",
    "columns",
    "common_prefix",
    "from_base",
    "hamming",
    "indent",
    "is_palindrome",
    "jaccard",
    "levenshtein",
    "rle_decode",
    "rle_encode",
    "slugify",
    "snake_to_camel",
    "title_case",
    "to_base",
    "truncate",
    "word_frequencies",
    "wrap",
]
