"""Metric names, each declared once by the part that produces it, and the one way two parts' metrics
join into a step's row.

A producer (the learner ranks, the driver) declares the names it emits (`MetricNames`): exact names,
and families for names made at run time (`staleness/hist_<k>`, `reward/<function>`). No name is declared
by two producers (`collisions`, checked by tests/test_metric_names.py), and `merge_metrics` refuses two
rows that share a key instead of letting the later one silently overwrite the earlier one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class MetricNames:
    producer: str  # who emits them ("learner", "driver")
    names: frozenset[str]
    families: tuple[str, ...] = ()  # prefixes of names made at run time

    def declares(self, key: str) -> bool:
        return key in self.names or key.startswith(self.families)

    def namespaces(self) -> set[str]:
        """The part before the first '/' of each name and family ("rollout", "time")."""
        return {n.split("/", 1)[0] for n in (*self.names, *self.families) if "/" in n}


def collisions(declared: Iterable[MetricNames]) -> list[str]:
    """One line per name (or family) that two producers declare: a name of one inside the other's names
    or families, or two families where one is a prefix of the other."""
    declared = list(declared)
    out = []
    for i, a in enumerate(declared):
        for b in declared[i + 1 :]:
            both = sorted(n for n in a.names if b.declares(n)) + sorted(n for n in b.names if a.declares(n))
            both += [f"{f}*" for f in a.families for g in b.families if f.startswith(g) or g.startswith(f)]
            out += [f"{n}: {a.producer} and {b.producer}" for n in sorted(set(both))]
    return out


def merge_metrics(*rows: Mapping[str, float]) -> dict[str, float]:
    """The rows' metrics in one dict; a key in two of them is a ValueError naming it (two producers of
    one name: one would silently overwrite the other)."""
    out: dict[str, float] = {}
    for row in rows:
        shared = sorted(out.keys() & row.keys())
        if shared:
            raise ValueError(f"metric(s) {shared} produced twice in one step's row")
        out.update(row)
    return out
