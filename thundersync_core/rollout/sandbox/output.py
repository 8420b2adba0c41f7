"""Bounded capture of a process's output stream.

A sandboxed command may print gigabytes (``yes``, a runaway log loop). The reader must keep
its own memory flat whatever the command does, yet the agent still needs to see how the
output began and how it ended (the first error and the final traceback). ``BoundedOutput``
is fed chunks as they are read from a pipe and keeps at most ``limit_bytes``: the first
half verbatim and a rolling window over the last half, counting every byte it was given.
``render`` joins them with an explicit marker saying how many bytes were dropped.

Pure: no I/O, no processes; both sandbox backends share it.
"""

from __future__ import annotations

__all__ = ["BoundedOutput", "elision_marker"]


def elision_marker(elided_bytes: int) -> str:
    """The text that stands where ``elided_bytes`` of output were dropped."""
    return f"\n[... {elided_bytes} bytes elided ...]\n"


class BoundedOutput:
    """Head and tail of a byte stream within ``limit_bytes``, plus the stream's true length.

    Memory held is at most ``limit_bytes`` plus one chunk, however long the stream runs.
    """

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._head_cap = limit_bytes // 2
        self._tail_cap = limit_bytes - self._head_cap
        self._head = bytearray()
        self._tail = bytearray()
        self.total_bytes = 0

    def feed(self, chunk: bytes) -> None:
        """Account for the next ``chunk`` of the stream."""
        self.total_bytes += len(chunk)
        room = self._head_cap - len(self._head)
        if room > 0:
            self._head += chunk[:room]
            chunk = chunk[room:]
        if not chunk or self._tail_cap == 0:
            return
        if len(chunk) >= self._tail_cap:
            self._tail[:] = chunk[-self._tail_cap :]
            return
        self._tail += chunk
        excess = len(self._tail) - self._tail_cap
        if excess > 0:
            del self._tail[:excess]

    @property
    def truncated(self) -> bool:
        return self.total_bytes > self.limit_bytes

    @property
    def elided_bytes(self) -> int:
        return self.total_bytes - len(self._head) - len(self._tail)

    def render(self) -> str:
        """The kept bytes as text; undecodable bytes become U+FFFD, so len <= bytes kept."""
        if not self.truncated:
            return bytes(self._head + self._tail).decode("utf-8", errors="replace")
        head = bytes(self._head).decode("utf-8", errors="replace")
        tail = bytes(self._tail).decode("utf-8", errors="replace")
        return head + elision_marker(self.elided_bytes) + tail
