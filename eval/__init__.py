"""Evaluation: pass@k, SWE-bench and terminal-task harnesses, checkpoint cadence, budget matching.

passk.py          the unbiased pass@k estimator over per-attempt JSONL results
swebench_eval.py  SWE-bench / SWE-smith log grading, predictions, the official run report
swe_tasks.py      SWE-smith-schema records as agent tasks (snapshot + bug patch + grade_swe)
terminal_eval.py  k attempts per task with the bash agent, one result line per attempt
cadence.py        every published checkpoint of a run folder, keyed by device-hours
budget.py         time-to-target, score-at-budget and speedups at matched device-hours
report.py         the comparison's table, JSON and plots
cli.py            ``thundersync eval``
"""
