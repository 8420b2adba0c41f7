"""Right-padded rows and micro-batches for the synchronous learners."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch

from thundersync_core.batch import Trajectory

Row = TypeVar("Row")


def sequence_length(traj: Trajectory) -> int:
    return len(traj.prompt_ids) + len(traj.response_ids)


def micro_batches(
    rows: Sequence[Row], lengths: Sequence[int], max_tokens: int | None
) -> Iterator[list[Row]]:
    """Consecutive rows in groups whose padded size (rows x longest) stays <= max_tokens.

    A row longer than max_tokens forms a micro-batch of its own. None: one batch.
    """
    if max_tokens is None:
        if rows:
            yield list(rows)
        return
    chunk: list[Row] = []
    longest = 0
    for row, length in zip(rows, lengths, strict=True):
        if chunk and max(longest, length) * (len(chunk) + 1) > max_tokens:
            yield chunk
            chunk, longest = [], 0
        chunk.append(row)
        longest = max(longest, length)
    if chunk:
        yield chunk


def right_padded(
    rows: Sequence[Trajectory], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """ids_BT, scored_BT and a padding mask (None when every row has the same length)."""
    sequences = [list(t.prompt_ids) + list(t.response_ids) for t in rows]
    width = max(len(ids) for ids in sequences)
    ids_BT = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    scored_BT = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
    mask_BT = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    for b, (ids, traj) in enumerate(zip(sequences, rows, strict=True)):
        n_prompt = len(traj.prompt_ids)
        ids_BT[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        scored_BT[b, n_prompt : len(ids)] = torch.tensor(traj.response_scored, dtype=torch.bool)
        mask_BT[b, : len(ids)] = 1
    uniform = all(len(ids) == width for ids in sequences)
    return ids_BT, scored_BT, None if uniform else mask_BT


def check_micro_batch_tokens(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1 or None, got {value}")
    return value
