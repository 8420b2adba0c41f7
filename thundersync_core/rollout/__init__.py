"""Rollouts: engines, the agent loop, sandboxes and graders."""
