"""Plain-text layout: wrapping, truncation, padding, indentation and tables."""

from __future__ import annotations


def wrap(text: str, width: int) -> list[str]:
    """Greedy word wrap; a word longer than ``width`` gets a line of its own."""
    if width < 1:
        raise ValueError(f"width must be positive, got {width}")
    lines: list[str] = []
    line = ""
    for word in text.split():
        if not line:
            line = word
        elif len(line) + 1 + len(word) <= width:
            line = line + " " + word
        else:
            lines.append(line)
            line = word
    if line:
        lines.append(line)
    return lines


def truncate(text: str, limit: int, ellipsis: str = "...") -> str:
    """``text`` cut to at most ``limit`` characters, ending in ``ellipsis`` when cut."""
    if limit < len(ellipsis):
        raise ValueError(f"limit {limit} is shorter than the ellipsis {ellipsis!r}")
    if len(text) <= limit:
        return text
    return text[: limit - len(ellipsis)] + ellipsis


def center(text: str, width: int, fill: str = " ") -> str:
    """Pad ``text`` to ``width``; an odd padding puts the extra fill on the right."""
    if len(fill) != 1:
        raise ValueError(f"fill must be one character, got {fill!r}")
    padding = width - len(text)
    if padding <= 0:
        return text
    left = padding // 2
    right = padding - left
    return fill * left + text + fill * right


def indent(text: str, prefix: str, skip_blank: bool = True) -> str:
    """Prefix every line; blank lines stay bare when ``skip_blank``."""
    lines = text.split("\n")
    out = []
    for line in lines:
        if skip_blank and not line.strip():
            out.append(line)
        else:
            out.append(prefix + line)
    return "\n".join(out)


def columns(rows: list[list[str]], sep: str = " | ") -> list[str]:
    """Left-aligned table lines; short rows are padded with empty cells."""
    if not rows:
        return []
    n_columns = max(len(row) for row in rows)
    widths = [0] * n_columns
    for row in rows:
        for index, cell in enumerate(row):
            widths[index] = max(widths[index], len(cell))
    lines = []
    for row in rows:
        cells = [*row, *[""] * (n_columns - len(row))]
        padded = [cell.ljust(width) for cell, width in zip(cells, widths, strict=True)]
        lines.append(sep.join(padded).rstrip())
    return lines
