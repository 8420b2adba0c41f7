"""Case conversions between identifiers, titles and URL slugs."""

from __future__ import annotations

MINOR_WORDS = frozenset({"a", "an", "and", "as", "at", "but", "by", "for", "in", "of", "on"})
MINOR_WORDS |= {"or", "the", "to"}


def slugify(text: str, sep: str = "-") -> str:
    """Lowercase ``text`` and join its runs of letters and digits with ``sep``."""
    words = []
    current = []
    for char in text.lower():
        if char.isalnum() and char.isascii():
            current.append(char)
        elif current:
            words.append("".join(current))
            current = []
    if current:
        words.append("".join(current))
    return sep.join(words)


def camel_to_snake(name: str) -> str:
    """``parseHTTPResponse2`` -> ``parse_http_response2``; acronyms stay one word."""
    out = []
    for index, char in enumerate(name):
        if char.isupper() and index > 0:
            prev = name[index - 1]
            nxt = name[index + 1] if index + 1 < len(name) else ""
            if prev.islower() or prev.isdigit() or (prev.isupper() and nxt.islower()):
                out.append("_")
        out.append(char.lower())
    return "".join(out)


def snake_to_camel(name: str, upper_first: bool = False) -> str:
    """``parse_http_response`` -> ``parseHttpResponse`` (``ParseHttpResponse`` if asked)."""
    parts = [part for part in name.split("_") if part]
    if not parts:
        return ""
    head = parts[0].capitalize() if upper_first else parts[0].lower()
    return head + "".join(part.capitalize() for part in parts[1:])


def title_case(text: str) -> str:
    """Capitalise each word except minor words, which stay lowercase unless first or last."""
    words = text.split()
    last = len(words) - 1
    titled = []
    for index, word in enumerate(words):
        lower = word.lower()
        if lower in MINOR_WORDS and 0 < index < last:
            titled.append(lower)
        else:
            titled.append(lower[:1].upper() + lower[1:])
    return " ".join(titled)
