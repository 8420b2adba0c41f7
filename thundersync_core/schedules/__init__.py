"""Schedules: short drivers that decide when the learner runs relative to rollouts."""
