"""Half-open integer intervals and Gregorian calendar arithmetic."""

from spans.calendar import (
    add_days,
    day_of_year,
    days_between,
    days_in_month,
    from_ordinal,
    is_leap_year,
    month_weeks,
    nth_weekday,
    to_ordinal,
    weekday,
)
from spans.interval import Interval, gaps, merge, subtract, total_length

__all__ = [
    "Interval",
    "add_days",
    "day_of_year",
    "days_between",
    "days_in_month",
    "from_ordinal",
    "gaps",
    "is_leap_year",
    "merge",
    "month_weeks",
    "nth_weekday",
    "subtract",
    "to_ordinal",
    "total_length",
    "weekday",
]
