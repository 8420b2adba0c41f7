"""Offline generators of real task pools: minismith (SWE bugs) and toyterm (terminal tasks)."""
