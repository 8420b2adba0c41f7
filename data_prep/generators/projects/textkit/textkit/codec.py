"""Reversible encodings: run-length, Caesar shift and integer bases."""

from __future__ import annotations

DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def rle_encode(text: str) -> str:
    """``aaabcc`` -> ``a3bc2``: a count follows a character repeated more than once."""
    if any(char.isdigit() for char in text):
        raise ValueError("rle_encode: digits cannot be encoded unambiguously")
    out = []
    index = 0
    while index < len(text):
        run = 1
        while index + run < len(text) and text[index + run] == text[index]:
            run += 1
        out.append(text[index] if run == 1 else f"{text[index]}{run}")
        index += run
    return "".join(out)


def rle_decode(encoded: str) -> str:
    """The inverse of ``rle_encode``."""
    out = []
    index = 0
    while index < len(encoded):
        char = encoded[index]
        if char.isdigit():
            raise ValueError(f"rle_decode: count without a character at {index}")
        end = index + 1
        while end < len(encoded) and encoded[end].isdigit():
            end += 1
        count = int(encoded[index + 1 : end]) if end > index + 1 else 1
        out.append(char * count)
        index = end
    return "".join(out)


def caesar(text: str, shift: int) -> str:
    """Shift ASCII letters by ``shift`` places, keeping case; other characters unchanged."""
    out = []
    for char in text:
        if "a" <= char <= "z":
            out.append(chr((ord(char) - ord("a") + shift) % 26 + ord("a")))
        elif "A" <= char <= "Z":
            out.append(chr((ord(char) - ord("A") + shift) % 26 + ord("A")))
        else:
            out.append(char)
    return "".join(out)


def to_base(number: int, base: int) -> str:
    """``number`` written in ``base`` (2 to 36), lowercase digits, ``-`` for negatives."""
    if not 2 <= base <= len(DIGITS):
        raise ValueError(f"base must be between 2 and {len(DIGITS)}, got {base}")
    if number == 0:
        return "0"
    sign = "-" if number < 0 else ""
    number = abs(number)
    digits = []
    while number > 0:
        number, remainder = divmod(number, base)
        digits.append(DIGITS[remainder])
    return sign + "".join(reversed(digits))


def from_base(text: str, base: int) -> int:
    """The inverse of ``to_base``; digits are case-insensitive."""
    if not 2 <= base <= len(DIGITS):
        raise ValueError(f"base must be between 2 and {len(DIGITS)}, got {base}")
    body = text.strip().lower()
    negative = body.startswith("-")
    if negative:
        body = body[1:]
    if not body:
        raise ValueError(f"no digits in {text!r}")
    value = 0
    for char in body:
        digit = DIGITS.find(char)
        if digit < 0 or digit >= base:
            raise ValueError(f"{char!r} is not a base-{base} digit")
        value = value * base + digit
    return -value if negative else value
