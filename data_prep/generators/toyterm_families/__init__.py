"""The registry of toyterm task families: family name -> ``build_<family>(rng)``.

Adding a family: write ``build_<name>(rng: random.Random) -> TaskSpec`` in the module of its
theme (or a new one), drawing every parameter from ``rng`` and computing the expected
outputs in Python; add it to ``FAMILIES`` below (names are lowercase letters only: they
become part of task ids); then run ``python -m data_prep.validate_terminal`` on a fresh
generation, which proves for every task that doing nothing scores 0 and the reference
solution scores 1. Appending keeps the ids of existing tasks; inserting renumbers them.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from data_prep.generators.toyterm_families.archives import build_mktar, build_untar
from data_prep.generators.toyterm_families.basics import build_count, build_mkfiles, build_oneliner
from data_prep.generators.toyterm_families.data import build_csv, build_json
from data_prep.generators.toyterm_families.files import build_perms, build_rename
from data_prep.generators.toyterm_families.jobs import build_jobs
from data_prep.generators.toyterm_families.scripts import build_bashscript, build_pyscript
from data_prep.generators.toyterm_families.search import build_find, build_grep
from data_prep.generators.toyterm_families.spec import TaskSpec
from data_prep.generators.toyterm_families.text import build_columns, build_sedit, build_sortuniq

__all__ = ["FAMILIES", "FamilyBuilder", "TaskSpec"]

FamilyBuilder = Callable[[random.Random], TaskSpec]

FAMILIES: dict[str, FamilyBuilder] = {
    "oneliner": build_oneliner,
    "count": build_count,
    "mkfiles": build_mkfiles,
    "sortuniq": build_sortuniq,
    "sedit": build_sedit,
    "columns": build_columns,
    "grep": build_grep,
    "find": build_find,
    "untar": build_untar,
    "mktar": build_mktar,
    "json": build_json,
    "csv": build_csv,
    "rename": build_rename,
    "perms": build_perms,
    "bashscript": build_bashscript,
    "pyscript": build_pyscript,
    "jobs": build_jobs,
}
