"""Proleptic Gregorian calendar arithmetic on (year, month, day) tuples.

Ordinals count days from 0001-01-01 (ordinal 1); weekdays run Monday 0 to Sunday 6.
"""

from __future__ import annotations

Date = tuple[int, int, int]

DAYS_BEFORE_MONTH = (0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334)
DAYS_IN_MONTH = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
DAYS_IN_400_YEARS = 146_097


def is_leap_year(year: int) -> bool:
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def days_in_month(year: int, month: int) -> int:
    if not 1 <= month <= 12:
        raise ValueError(f"month must be 1..12, got {month}")
    if month == 2 and is_leap_year(year):
        return 29
    return DAYS_IN_MONTH[month - 1]


def check_date(year: int, month: int, day: int) -> None:
    if year < 1:
        raise ValueError(f"year must be >= 1, got {year}")
    if not 1 <= day <= days_in_month(year, month):
        raise ValueError(f"day {day} is outside {year:04d}-{month:02d}")


def day_of_year(year: int, month: int, day: int) -> int:
    """1 for January 1st."""
    check_date(year, month, day)
    leap_day = 1 if month > 2 and is_leap_year(year) else 0
    return DAYS_BEFORE_MONTH[month - 1] + leap_day + day


def days_before_year(year: int) -> int:
    previous = year - 1
    return previous * 365 + previous // 4 - previous // 100 + previous // 400


def to_ordinal(year: int, month: int, day: int) -> int:
    return days_before_year(year) + day_of_year(year, month, day)


def from_ordinal(ordinal: int) -> Date:
    """The date with the given ordinal (1 is 0001-01-01)."""
    if ordinal < 1:
        raise ValueError(f"ordinal must be >= 1, got {ordinal}")
    cycles, rest = divmod(ordinal - 1, DAYS_IN_400_YEARS)
    year = cycles * 400 + 1
    while rest >= 365 + is_leap_year(year):
        rest -= 365 + is_leap_year(year)
        year += 1
    month = 1
    while rest >= days_in_month(year, month):
        rest -= days_in_month(year, month)
        month += 1
    return year, month, rest + 1


def weekday(year: int, month: int, day: int) -> int:
    """Monday 0 .. Sunday 6; 0001-01-01 was a Monday."""
    return (to_ordinal(year, month, day) - 1) % 7


def add_days(date: Date, days: int) -> Date:
    return from_ordinal(to_ordinal(*date) + days)


def days_between(first: Date, second: Date) -> int:
    """Days from ``first`` to ``second``; negative when ``second`` is earlier."""
    return to_ordinal(*second) - to_ordinal(*first)


def nth_weekday(year: int, month: int, target: int, n: int) -> Date:
    """The n-th given weekday of the month (n = 1 first, n = -1 last)."""
    if n == 0 or not 0 <= target <= 6:
        raise ValueError(f"need n != 0 and a weekday 0..6, got n={n}, weekday={target}")
    last_day = days_in_month(year, month)
    if n > 0:
        first = (target - weekday(year, month, 1)) % 7 + 1
        day = first + (n - 1) * 7
    else:
        last = last_day - (weekday(year, month, last_day) - target) % 7
        day = last + (n + 1) * 7
    if not 1 <= day <= last_day:
        raise ValueError(f"{year:04d}-{month:02d} has no weekday {target} number {n}")
    return year, month, day


def month_weeks(year: int, month: int) -> list[list[int]]:
    """Monday-first weeks of the month; 0 marks days of the neighbouring months."""
    offset = weekday(year, month, 1)
    cells = [0] * offset + list(range(1, days_in_month(year, month) + 1))
    cells += [0] * (-len(cells) % 7)
    return [cells[start : start + 7] for start in range(0, len(cells), 7)]
