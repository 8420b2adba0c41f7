"""Loaders of task pools: each returns valid records and the quarantined rest, never drops."""
