"""Learner parallelism, applied around the single-device learner (which stays testable alone).

- ``data_parallel``: the barrier's exact reduction over ranks and the group-to-rank routing.
- ``fsdp``: replicated or FSDP2-sharded parameters, gradients and optimizer; publication.
- ``dcp``: distributed checkpoints that resume at another world size.

The Ray side (rank actors forming the process group, the facade the schedules call) is
``runtime/learner_group.py``.
"""
