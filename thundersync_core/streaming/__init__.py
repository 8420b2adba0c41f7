"""The streaming backward executor: sources, sufficient statistics, boundary adjoints, barrier."""

from thundersync_core.streaming.base import BatchResult, GroupSpec, LearnerRefusal, groups_of
from thundersync_core.streaming.grpo_stream import StreamingGRPOLearner
from thundersync_core.streaming.grpo_sync import SyncGRPOLearner
from thundersync_core.streaming.opd_stream import StreamingOPDLearner
from thundersync_core.streaming.opd_sync import SyncOPDLearner

__all__ = [
    "BatchResult",
    "GroupSpec",
    "LearnerRefusal",
    "StreamingGRPOLearner",
    "StreamingOPDLearner",
    "SyncGRPOLearner",
    "SyncOPDLearner",
    "groups_of",
]
