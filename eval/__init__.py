"""Evaluation: pass@k, SWE-bench Verified and Terminal-Bench harnesses, budget matching."""
