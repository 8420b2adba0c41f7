"""Prefect artifacts: what a flow run produced, readable in the Prefect UI, with links."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.common import IO_RETRY

__all__ = ["publish_report"]


@task(**IO_RETRY)
def publish_report(
    key: str,
    markdown: str,
    *,
    table: list[dict[str, Any]] | None = None,
    description: str = "",
) -> None:
    """A markdown artifact ``key`` and, given rows, a table artifact ``<key>-table``.

    Keys are Prefect artifact keys (lowercase letters, digits, dashes): each new artifact
    with a key becomes its latest version, so a nightly report keeps its history.
    """
    create_markdown_artifact(markdown=markdown, key=key, description=description)
    if table:
        create_table_artifact(table=table, key=f"{key}-table", description=description)
