"""Can these resource bundles be placed on these nodes at all? An exact check, bounded in effort.

Ray marks a placement group INFEASIBLE only when one bundle fits no node; a group whose bundles
each fit somewhere but not all together (three 0.6-CPU bundles on two 1-CPU nodes, or 4 CPUs
asked of 3) stays pending forever. `pack` decides the whole question against the nodes' total
resources (the cluster idle), so a plan no cluster state can hold fails at once.

Quantities are compared in Ray's own unit, 1/10000 of a resource, as integers (no float drift).
"""

from __future__ import annotations

from collections.abc import Mapping

UNIT = 10_000  # Ray keeps resource quantities to 4 decimal places


class PackingUndecided(RuntimeError):
    """The search ran out of its step budget before finding a placement or proving there is none."""


def _units(amounts: Mapping[str, float], keys: list[str]) -> tuple[int, ...]:
    return tuple(round(float(amounts.get(k, 0.0)) * UNIT) for k in keys)


def pack(
    items: list[Mapping[str, float]], nodes: list[Mapping[str, float]], budget: int = 200_000
) -> list[int] | None:
    """A node index per item such that no node holds more of any resource than it has, or None
    when no such assignment exists. Only the resources the items ask for are compared.

    Depth-first search, largest items first; equal items take non-decreasing node indices and
    nodes with equal room left are tried once, so symmetric branches are not searched twice.
    Raises `PackingUndecided` after `budget` placements tried.
    """
    keys = sorted({k for item in items for k, v in item.items() if v > 0})
    wants = [_units(item, keys) for item in items]
    order = sorted(range(len(items)), key=lambda i: wants[i], reverse=True)
    room = [list(_units(node, keys)) for node in nodes]
    chosen = [-1] * len(items)
    steps = 0

    def place(pos: int) -> bool:
        nonlocal steps
        if pos == len(order):
            return True
        i = order[pos]
        want = wants[i]
        first = chosen[order[pos - 1]] if pos and wants[order[pos - 1]] == want else 0
        tried: set[tuple[int, ...]] = set()
        for j in range(first, len(room)):
            left = tuple(room[j])
            if left in tried or any(w > r for w, r in zip(want, left, strict=True)):
                continue
            tried.add(left)
            steps += 1
            if steps > budget:
                raise PackingUndecided(f"no answer within {budget} placements tried")
            room[j] = [r - w for r, w in zip(left, want, strict=True)]
            chosen[i] = j
            if place(pos + 1):
                return True
            room[j] = list(left)
        chosen[i] = -1
        return False

    return list(chosen) if place(0) else None
