"""Families over structured data: JSON records and CSV tables.

The reference solutions use ``python3`` for JSON (``jq`` is not in the base image) and
``awk``/``sort`` for CSV; the expected values are computed here with plain Python.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

from data_prep.generators.toyterm_families import checks
from data_prep.generators.toyterm_families.spec import (
    WORDS,
    Difficulty,
    TaskSpec,
    as_lines,
    pick,
    solution,
)


def _data_task(
    instruction: str,
    command: str,
    check: checks.Check,
    files: dict[str, str],
    *,
    difficulty: Difficulty,
    tag: str,
) -> TaskSpec:
    return TaskSpec(
        instruction=instruction,
        solution=solution(command),
        checks=(check,),
        difficulty=difficulty,
        category="data",
        tags=(tag, "data"),
        files=files,
    )


def _python(body: str) -> str:
    """A bash command running ``body`` with python3 from a here-document."""
    return f"python3 - <<'PY'\nimport json\n{body}\nPY"


# -- json ------------------------------------------------------------------------------------


def build_json(rng: random.Random) -> TaskSpec:
    return rng.choice(_JSONS)(rng)


def _records(rng: random.Random) -> tuple[str, list[dict[str, Any]], list[str]]:
    """A file name, records with unique ids and names, and the teams they belong to."""
    teams = pick(rng, rng.randint(2, 4))
    names = pick(rng, rng.randint(5, 30))
    ids = rng.sample(range(1, 1000), len(names))
    records = [
        {
            "id": ident,
            "name": name,
            "team": rng.choice(teams),
            "score": rng.randint(0, 100),
            "active": rng.random() < 0.6,
        }
        for ident, name in zip(ids, names, strict=True)
    ]
    records[0]["active"] = True
    return f"{rng.choice(WORDS)}.json", records, teams


def _dump(records: list[dict[str, Any]]) -> str:
    return json.dumps(records, indent=2) + "\n"


def _json_threshold(rng: random.Random) -> TaskSpec:
    name, records, _teams = _records(rng)
    limit = rng.choice(sorted(r["score"] for r in records)[:-1] or [0])
    hits = sorted(r["name"] for r in records if r["score"] > limit)
    out = f"{rng.choice(WORDS)}_names.txt"
    return _data_task(
        f"The file {name} holds a JSON list of records with fields id, name, team, score and "
        f"active. Write the names of the records whose score is greater than {limit}, sorted "
        f"alphabetically, one per line, to {out}",
        _python(
            f"records = json.load(open({name!r}))\n"
            f"names = sorted(r['name'] for r in records if r['score'] > {limit})\n"
            f"open({out!r}, 'w').write(''.join(n + '\\n' for n in names))"
        ),
        checks.text(out, as_lines(hits)),
        {name: _dump(records)},
        difficulty="medium",
        tag="json",
    )


def _json_team_sum(rng: random.Random) -> TaskSpec:
    name, records, _teams = _records(rng)
    team = rng.choice(sorted({r["team"] for r in records}))
    out = f"{rng.choice(WORDS)}_sum.txt"
    return _data_task(
        f"The file {name} holds a JSON list of records with fields id, name, team, score and "
        f"active. Write the sum of the scores of team {team} (only the number) to {out}",
        _python(
            f"records = json.load(open({name!r}))\n"
            f"total = sum(r['score'] for r in records if r['team'] == {team!r})\n"
            f"open({out!r}, 'w').write(f'{{total}}\\n')"
        ),
        checks.number(out, sum(r["score"] for r in records if r["team"] == team)),
        {name: _dump(records)},
        difficulty="medium",
        tag="json",
    )


def _json_team_counts(rng: random.Random) -> TaskSpec:
    name, records, _teams = _records(rng)
    out = f"{rng.choice(WORDS)}_teams.json"
    counts = Counter(r["team"] for r in records if r["active"])
    return _data_task(
        f"The file {name} holds a JSON list of records with fields id, name, team, score and "
        f"active. Write to {out} a JSON object mapping each team to the number of its "
        f"active records (omit teams with none).",
        _python(
            f"from collections import Counter\nrecords = json.load(open({name!r}))\n"
            f"counts = Counter(r['team'] for r in records if r['active'])\n"
            f"json.dump(dict(counts), open({out!r}, 'w'))"
        ),
        checks.json_value(out, dict(sorted(counts.items()))),
        {name: _dump(records)},
        difficulty="hard",
        tag="json",
    )


def _json_lookup(rng: random.Random) -> TaskSpec:
    name, records, _teams = _records(rng)
    record = rng.choice(records)
    out = f"{rng.choice(WORDS)}_who.txt"
    return _data_task(
        f"The file {name} holds a JSON list of records with fields id, name, team, score and "
        f"active. Write the name of the record with id {record['id']} to {out}",
        _python(
            f"records = json.load(open({name!r}))\n"
            f"hit = next(r for r in records if r['id'] == {record['id']})\n"
            f"open({out!r}, 'w').write(hit['name'] + '\\n')"
        ),
        checks.text(out, record["name"] + "\n"),
        {name: _dump(records)},
        difficulty="easy",
        tag="json",
    )


def _json_to_csv(rng: random.Random) -> TaskSpec:
    name, records, _teams = _records(rng)
    out = f"{rng.choice(WORDS)}.csv"
    rows = [["id", "name", "score"]]
    rows += [
        [str(r["id"]), r["name"], str(r["score"])] for r in sorted(records, key=lambda r: r["id"])
    ]
    return _data_task(
        f"The file {name} holds a JSON list of records with fields id, name, team, score and "
        f"active. Convert it to the CSV file {out} with the header `id,name,score` and "
        f"one row per record, ordered by id (smallest first).",
        _python(
            f"records = sorted(json.load(open({name!r})), key=lambda r: r['id'])\n"
            f"lines = ['id,name,score'] + [f\"{{r['id']}},{{r['name']}},{{r['score']}}\" "
            f"for r in records]\n"
            f"open({out!r}, 'w').write('\\n'.join(lines) + '\\n')"
        ),
        checks.csv_rows(out, rows),
        {name: _dump(records)},
        difficulty="hard",
        tag="json",
    )


_JSONS: tuple[Callable[[random.Random], TaskSpec], ...] = (
    _json_threshold,
    _json_team_sum,
    _json_team_counts,
    _json_lookup,
    _json_to_csv,
)


# -- csv -------------------------------------------------------------------------------------

_HEADER = ["region", "product", "units", "price"]


def build_csv(rng: random.Random) -> TaskSpec:
    return rng.choice(_CSVS)(rng)


def _sales(rng: random.Random) -> tuple[str, list[list[str]]]:
    regions, products = pick(rng, rng.randint(2, 5)), pick(rng, rng.randint(3, 8))
    units = rng.sample(range(1, 500), rng.randint(6, 60))
    rows = [
        [rng.choice(regions), rng.choice(products), str(count), str(rng.randint(1, 99))]
        for count in units
    ]
    return f"{rng.choice(WORDS)}.csv", rows


def _csv_text(rows: list[list[str]]) -> str:
    return as_lines([",".join(row) for row in [_HEADER, *rows]])


def _csv_totals(rng: random.Random) -> TaskSpec:
    name, rows = _sales(rng)
    totals = Counter[str]()
    for row in rows:
        totals[row[0]] += int(row[2])
    out = f"{rng.choice(WORDS)}_totals.csv"
    return _data_task(
        f"The file {name} is a CSV file with the header `{','.join(_HEADER)}`. Write to {out} "
        f"one line `<region>,<total units>` per region, sorted by region name, without a header.",
        f"awk -F, 'NR > 1 {{t[$1] += $3}} END {{for (r in t) print r \",\" t[r]}}' {name} "
        f"| sort -t, -k1,1 > {out}",
        checks.csv_rows(out, [[region, str(totals[region])] for region in sorted(totals)]),
        {name: _csv_text(rows)},
        difficulty="hard",
        tag="csv",
    )


def _csv_count_over(rng: random.Random) -> TaskSpec:
    name, rows = _sales(rng)
    limit = rng.choice(sorted(int(row[2]) for row in rows)[:-1])
    out = f"{rng.choice(WORDS)}_over.txt"
    return _data_task(
        f"The file {name} is a CSV file with the header `{','.join(_HEADER)}`. How many rows have "
        f"more than {limit} units? Write only the number to {out}",
        f"awk -F, 'NR > 1 && $3 > {limit}' {name} | wc -l > {out}",
        checks.number(out, sum(int(row[2]) > limit for row in rows)),
        {name: _csv_text(rows)},
        difficulty="medium",
        tag="csv",
    )


def _csv_filter(rng: random.Random) -> TaskSpec:
    name, rows = _sales(rng)
    region = rng.choice(sorted({row[0] for row in rows}))
    out = f"{rng.choice(WORDS)}_{region}.csv"
    return _data_task(
        f"The file {name} is a CSV file with the header `{','.join(_HEADER)}`. Write to {out} "
        f"the header followed by the rows whose region is {region}, in their original order.",
        f"awk -F, 'NR == 1 || $1 == \"{region}\"' {name} > {out}",
        checks.csv_rows(out, [_HEADER, *[row for row in rows if row[0] == region]]),
        {name: _csv_text(rows)},
        difficulty="medium",
        tag="csv",
    )


def _csv_top_product(rng: random.Random) -> TaskSpec:
    name, rows = _sales(rng)
    revenue = Counter[str]()
    for row in rows:
        revenue[row[1]] += int(row[2]) * int(row[3])
    best = max(sorted(revenue), key=lambda product: revenue[product])
    # A unique winner, so that the answer does not depend on how ties are broken.
    rows.append(["bonus", best, "1", "1"])
    out = f"{rng.choice(WORDS)}_best.txt"
    return _data_task(
        f"The file {name} is a CSV file with the header `{','.join(_HEADER)}`. The revenue of a "
        f"row is units times price. Write the name of the product with the highest total revenue "
        f"to {out}",
        f"awk -F, 'NR > 1 {{r[$2] += $3 * $4}} END {{for (p in r) print r[p], p}}' {name} "
        f"| sort -n | tail -n 1 | cut -d' ' -f2 > {out}",
        checks.text(out, best + "\n"),
        {name: _csv_text(rows)},
        difficulty="hard",
        tag="csv",
    )


def _csv_sort(rng: random.Random) -> TaskSpec:
    name, rows = _sales(rng)
    out = f"{rng.choice(WORDS)}_sorted.csv"
    ordered = sorted(rows, key=lambda row: -int(row[2]))
    return _data_task(
        f"The file {name} is a CSV file with the header `{','.join(_HEADER)}`. Write to {out} "
        f"the header followed by all rows sorted by units, largest first.",
        f"{{ head -n 1 {name}; tail -n +2 {name} | sort -t, -k3,3nr; }} > {out}",
        checks.csv_rows(out, [_HEADER, *ordered]),
        {name: _csv_text(rows)},
        difficulty="medium",
        tag="csv",
    )


_CSVS: tuple[Callable[[random.Random], TaskSpec], ...] = (
    _csv_totals,
    _csv_count_over,
    _csv_filter,
    _csv_top_product,
    _csv_sort,
)
