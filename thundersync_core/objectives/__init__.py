"""Objectives: one module per algorithm, its equations in the module docstring."""
