"""The streaming backward executor: sources, sufficient statistics, boundary adjoints, barrier."""

from thundersync_core.streaming.base import BatchResult, GroupSpec, LearnerRefusal, groups_of
from thundersync_core.streaming.grpo_stream import StreamingGRPOLearner
from thundersync_core.streaming.grpo_sync import SyncGRPOLearner

__all__ = [
    "BatchResult",
    "GroupSpec",
    "LearnerRefusal",
    "StreamingGRPOLearner",
    "SyncGRPOLearner",
    "groups_of",
]
