"""The dev split: a stable hash of the group key decides, so adding records moves nothing.

A group (a repository for SWE pools, a source family for terminal tasks) goes to dev when
sha256(salt/key) read as a fraction of 2^256 falls below ``dev_fraction``. The decision is
a pure function of the key: the split of a group never changes when the pool grows, and
no group spans both splits.
"""

from __future__ import annotations

import hashlib


def in_dev(group_key: str, dev_fraction: float, salt: str = "thundersync-dev-split") -> bool:
    if not 0.0 <= dev_fraction < 1.0:
        raise ValueError(f"dev_fraction must be in [0, 1), got {dev_fraction}")
    digest = hashlib.sha256(f"{salt}/{group_key}".encode()).digest()
    return int.from_bytes(digest, "big") < dev_fraction * 2**256
