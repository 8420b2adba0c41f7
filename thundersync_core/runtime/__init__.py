"""The Ray runtime: rollout workers, the learner and the OPD teacher as actors.

Each role is a plain class (usable without Ray in tests and on one device) that
``placement.remote_role`` turns into a Ray actor with explicit resources, pinned to fixed
cores where the config says so. Roles talk through Ray object references: a rollout
worker's streaming generator yields events as they happen (turn sampled, trajectory
graded), each tagged with the policy version that produced it; the learner's mailbox is its
work-conserving queue (calls execute in submission order).
"""
