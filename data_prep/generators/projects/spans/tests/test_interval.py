import pytest
from spans import Interval, gaps, merge, subtract, total_length


def test_rejects_reversed_bounds():
    with pytest.raises(ValueError, match="start 5 is after its end 3"):
        Interval(5, 3)


def test_empty_interval_is_allowed():
    assert Interval(4, 4).is_empty()
    assert not Interval(4, 5).is_empty()


def test_length():
    assert Interval(3, 10).length == 7
    assert Interval(-2, 2).length == 4


def test_contains_is_half_open():
    interval = Interval(2, 5)
    assert interval.contains(2)
    assert interval.contains(4)
    assert not interval.contains(5)
    assert not interval.contains(1)


def test_overlaps():
    assert Interval(0, 5).overlaps(Interval(4, 8))
    assert Interval(4, 8).overlaps(Interval(0, 5))
    assert Interval(0, 10).overlaps(Interval(3, 4))


def test_touching_intervals_do_not_overlap():
    assert not Interval(0, 5).overlaps(Interval(5, 8))
    assert not Interval(5, 8).overlaps(Interval(0, 5))


def test_intersection():
    assert Interval(0, 5).intersection(Interval(3, 9)) == Interval(3, 5)
    assert Interval(3, 9).intersection(Interval(0, 5)) == Interval(3, 5)


def test_intersection_of_disjoint_or_touching_is_none():
    assert Interval(0, 3).intersection(Interval(5, 9)) is None
    assert Interval(0, 5).intersection(Interval(5, 9)) is None


def test_intersection_nested():
    assert Interval(0, 10).intersection(Interval(2, 4)) == Interval(2, 4)


def test_shift():
    assert Interval(1, 4).shift(3) == Interval(4, 7)
    assert Interval(1, 4).shift(-1) == Interval(0, 3)


def test_split():
    assert Interval(0, 10).split(4) == (Interval(0, 4), Interval(4, 10))


def test_split_at_the_edges():
    assert Interval(0, 10).split(0) == (Interval(0, 0), Interval(0, 10))
    assert Interval(0, 10).split(10) == (Interval(0, 10), Interval(10, 10))


def test_split_outside_is_refused():
    with pytest.raises(ValueError, match="split point 11 outside"):
        Interval(0, 10).split(11)
    with pytest.raises(ValueError, match="split point -1 outside"):
        Interval(0, 10).split(-1)


def test_merge_overlapping_and_unsorted():
    found = merge([Interval(8, 10), Interval(1, 3), Interval(2, 6)])
    assert found == [Interval(1, 6), Interval(8, 10)]


def test_merge_touching_intervals_join():
    assert merge([Interval(0, 2), Interval(2, 4)]) == [Interval(0, 4)]


def test_merge_nested_keeps_outer_end():
    assert merge([Interval(0, 10), Interval(2, 3)]) == [Interval(0, 10)]


def test_merge_drops_empty_intervals():
    assert merge([Interval(3, 3), Interval(5, 6)]) == [Interval(5, 6)]


def test_merge_nothing():
    assert merge([]) == []


def test_total_length_counts_overlap_once():
    assert total_length([Interval(0, 5), Interval(3, 8), Interval(10, 12)]) == 10


def test_gaps_inside_window():
    found = gaps([Interval(2, 4), Interval(6, 7)], within=Interval(0, 10))
    assert found == [Interval(0, 2), Interval(4, 6), Interval(7, 10)]


def test_gaps_ignores_intervals_outside_window():
    found = gaps([Interval(-5, 1), Interval(12, 20)], within=Interval(0, 10))
    assert found == [Interval(1, 10)]


def test_gaps_with_interval_starting_at_window_end():
    assert gaps([Interval(10, 12)], within=Interval(0, 10)) == [Interval(0, 10)]


def test_gaps_fully_covered():
    assert gaps([Interval(-1, 4), Interval(4, 11)], within=Interval(0, 10)) == []


def test_gaps_interval_ending_at_window_start():
    assert gaps([Interval(-3, 0), Interval(5, 6)], within=Interval(0, 8)) == [
        Interval(0, 5),
        Interval(6, 8),
    ]


def test_subtract():
    assert subtract(Interval(0, 10), [Interval(3, 5)]) == [Interval(0, 3), Interval(5, 10)]
