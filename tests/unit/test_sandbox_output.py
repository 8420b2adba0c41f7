"""Output bounding and the small pure helpers of the sandbox contract (no processes)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from thundersync_core.rollout.sandbox.base import (
    ExecResult,
    SandboxLimits,
    SandboxPathError,
    classify_exit,
    relative_parts,
)
from thundersync_core.rollout.sandbox.output import BoundedOutput, elision_marker


def feed_all(limit: int, chunks: list[bytes]) -> BoundedOutput:
    sink = BoundedOutput(limit)
    for chunk in chunks:
        sink.feed(chunk)
    return sink


@given(
    limit=st.integers(min_value=0, max_value=64),
    chunks=st.lists(st.binary(max_size=40), max_size=12),
)
def test_keeps_exact_head_and_tail_for_any_chunking(limit, chunks):
    stream = b"".join(chunks)
    sink = feed_all(limit, chunks)
    assert sink.total_bytes == len(stream)
    if len(stream) <= limit:
        assert not sink.truncated
        assert sink.render() == stream.decode("utf-8", errors="replace")
        return
    head_bytes, tail_bytes = limit // 2, limit - limit // 2
    assert sink.truncated
    assert sink.elided_bytes == len(stream) - limit
    expected = (
        stream[:head_bytes].decode("utf-8", errors="replace")
        + elision_marker(len(stream) - limit)
        + stream[len(stream) - tail_bytes :].decode("utf-8", errors="replace")
    )
    assert sink.render() == expected


def test_memory_stays_within_the_limit_on_a_long_stream():
    sink = BoundedOutput(1000)
    for i in range(10_000):
        sink.feed(bytes([65 + i % 26]) * 997)
    assert sink.total_bytes == 9_970_000
    assert len(sink._head) + len(sink._tail) == 1000
    text = sink.render()
    assert text.startswith("A" * 500)
    assert len(text) == 1000 + len(elision_marker(9_969_000))
    assert "[... 9969000 bytes elided ...]" in text


def test_undecodable_bytes_do_not_grow_the_text():
    sink = feed_all(8, [b"\xff" * 20])
    assert len(sink.render()) <= 8 + len(elision_marker(12))


def test_negative_limit_is_refused():
    with pytest.raises(ValueError, match="limit_bytes"):
        BoundedOutput(-1)


@pytest.mark.parametrize(
    ("exit_code", "timed_out", "stderr", "reason"),
    [
        (0, False, "", None),
        (1, False, "", None),
        (None, True, "", "timeout"),
        (128 + 24, False, "", "cpu"),
        (128 + 25, False, "", "file_size"),
        (137, False, "", "signal"),
        (1, False, "Traceback ...\nMemoryError\n", "memory"),
        (0, False, "MemoryError", None),
    ],
)
def test_classify_exit(exit_code, timed_out, stderr, reason):
    assert classify_exit(exit_code, timed_out=timed_out, stderr_tail=stderr) == reason


def test_relative_parts_refuses_escapes():
    assert relative_parts("a/./b/c.txt") == ("a", "b", "c.txt")
    assert relative_parts(".") == ()
    with pytest.raises(SandboxPathError, match="relative"):
        relative_parts("/etc/passwd")
    with pytest.raises(SandboxPathError, match=r"'\.\.'"):
        relative_parts("a/../../etc")


def test_exec_result_json_has_exactly_the_documented_fields():
    result = ExecResult(0, "out", "", False, None, 0.5, False, 3, 0)
    assert list(result.to_json()) == [
        "exit_code",
        "stdout",
        "stderr",
        "timed_out",
        "killed_reason",
        "duration_s",
        "output_truncated",
        "stdout_bytes",
        "stderr_bytes",
    ]


def test_limits_name_the_bad_field():
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=0)
