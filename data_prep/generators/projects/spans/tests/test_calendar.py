import calendar
import datetime

import pytest
from spans import (
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

SAMPLE_DATES = [
    (1, 1, 1),
    (1, 12, 31),
    (4, 2, 29),
    (100, 3, 1),
    (400, 12, 31),
    (1582, 10, 15),
    (1900, 2, 28),
    (1900, 3, 1),
    (1999, 12, 31),
    (2000, 2, 29),
    (2000, 12, 31),
    (2023, 1, 1),
    (2024, 2, 29),
    (2024, 3, 1),
    (2024, 12, 31),
    (9999, 12, 31),
]


def test_leap_years():
    assert is_leap_year(2024)
    assert is_leap_year(2000)
    assert not is_leap_year(1900)
    assert not is_leap_year(2023)


def test_leap_years_match_the_standard_library():
    for year in range(1, 2500):
        assert is_leap_year(year) == calendar.isleap(year), year


def test_days_in_month():
    assert days_in_month(2023, 2) == 28
    assert days_in_month(2024, 2) == 29
    assert days_in_month(2024, 1) == 31
    assert days_in_month(2024, 4) == 30
    assert days_in_month(2024, 12) == 31


def test_days_in_month_rejects_bad_month():
    with pytest.raises(ValueError, match=r"month must be 1\.\.12, got 13"):
        days_in_month(2024, 13)
    with pytest.raises(ValueError, match=r"month must be 1\.\.12, got 0"):
        days_in_month(2024, 0)


def test_day_of_year():
    assert day_of_year(2023, 1, 1) == 1
    assert day_of_year(2023, 12, 31) == 365
    assert day_of_year(2024, 12, 31) == 366
    assert day_of_year(2024, 3, 1) == 61
    assert day_of_year(2023, 3, 1) == 60


def test_day_of_year_february_in_leap_year():
    assert day_of_year(2024, 2, 29) == 60


def test_invalid_dates_are_refused():
    with pytest.raises(ValueError, match="day 30 is outside 2023-02"):
        day_of_year(2023, 2, 30)
    with pytest.raises(ValueError, match="day 0 is outside"):
        day_of_year(2023, 5, 0)
    with pytest.raises(ValueError, match="year must be >= 1"):
        day_of_year(0, 5, 1)


def test_last_day_of_month_is_valid():
    assert day_of_year(2023, 4, 30) == 120


def test_to_ordinal_matches_the_standard_library():
    for date in SAMPLE_DATES:
        assert to_ordinal(*date) == datetime.date(*date).toordinal(), date


def test_from_ordinal_matches_the_standard_library():
    for date in SAMPLE_DATES:
        ordinal = datetime.date(*date).toordinal()
        assert from_ordinal(ordinal) == date, ordinal


def test_from_ordinal_first_day():
    assert from_ordinal(1) == (1, 1, 1)


def test_from_ordinal_rejects_non_positive():
    with pytest.raises(ValueError, match="ordinal must be >= 1, got 0"):
        from_ordinal(0)


def test_round_trip_over_a_leap_cycle():
    start = to_ordinal(1999, 12, 25)
    for ordinal in range(start, start + 4 * 366, 17):
        assert to_ordinal(*from_ordinal(ordinal)) == ordinal


def test_weekday():
    assert weekday(2024, 1, 1) == 0
    assert weekday(2023, 12, 31) == 6
    assert weekday(1, 1, 1) == 0


def test_weekday_matches_the_standard_library():
    for date in SAMPLE_DATES:
        assert weekday(*date) == datetime.date(*date).weekday(), date


def test_add_days_across_month_and_year():
    assert add_days((2023, 12, 30), 3) == (2024, 1, 2)
    assert add_days((2024, 2, 28), 1) == (2024, 2, 29)
    assert add_days((2023, 2, 28), 1) == (2023, 3, 1)


def test_add_days_backwards():
    assert add_days((2024, 3, 1), -1) == (2024, 2, 29)


def test_days_between():
    assert days_between((2024, 1, 1), (2024, 3, 1)) == 60
    assert days_between((2024, 3, 1), (2024, 1, 1)) == -60
    assert days_between((2000, 1, 1), (2000, 1, 1)) == 0


def test_nth_weekday_first():
    # The first Monday of September 2024 (Labor Day in the US).
    assert nth_weekday(2024, 9, 0, 1) == (2024, 9, 2)


def test_nth_weekday_when_month_starts_on_it():
    assert nth_weekday(2024, 1, 0, 1) == (2024, 1, 1)


def test_nth_weekday_fourth_thursday():
    assert nth_weekday(2024, 11, 3, 4) == (2024, 11, 28)


def test_nth_weekday_last():
    assert nth_weekday(2024, 5, 0, -1) == (2024, 5, 27)
    assert nth_weekday(2024, 3, 6, -1) == (2024, 3, 31)


def test_nth_weekday_second_to_last():
    assert nth_weekday(2024, 5, 0, -2) == (2024, 5, 20)


def test_nth_weekday_missing_fifth():
    with pytest.raises(ValueError, match="has no weekday 0 number 5"):
        nth_weekday(2024, 2, 0, 5)


def test_nth_weekday_fifth_exists():
    assert nth_weekday(2024, 2, 3, 5) == (2024, 2, 29)


def test_nth_weekday_rejects_bad_arguments():
    with pytest.raises(ValueError, match="need n != 0"):
        nth_weekday(2024, 2, 0, 0)
    with pytest.raises(ValueError, match="need n != 0"):
        nth_weekday(2024, 2, 7, 1)


def test_month_weeks_matches_the_standard_library():
    for year, month in [(2024, 2), (2024, 9), (2023, 1), (2021, 2), (2026, 6)]:
        assert month_weeks(year, month) == calendar.monthcalendar(year, month)


def test_month_weeks_shape():
    weeks = month_weeks(2024, 4)
    assert weeks[0][:2] == [1, 2]
    assert all(len(week) == 7 for week in weeks)
    assert weeks[-1][1] == 30
