"""Where a uniform layout's degraded TP groups go: which replica, which stage position.

In a stock layout every replica runs the same split and the same microbatches, so the iteration waits
for the replica whose slow groups cost it most. Packing every slow group into one replica leaves the
others at full speed, but that replica then pays each slow stage on its pipeline's fill and drain;
spreading them costs more replicas one slow stage each. Neither wins always, and the stage position
matters too (the ends carry the embedding and the head), so the search tries placements.

What is searched, and why the rest loses nothing:

* The used groups are the fastest dp x pp (`SlotInventory`: each damaged node's healthy GPUs grouped
  consecutively in speed order). For any grouping of a node's GPUs, its j-th fastest group is at most
  as fast as the (j tp)-th fastest GPU (the j fastest groups hold j tp GPUs at least that fast), which
  the consecutive grouping reaches: its sorted group speeds are elementwise the best. Stage times fall
  with speed and a fixed schedule's makespan (a longest path) rises with every op time, so a faster
  group in the same cell never hurts.
* Replicas are interchangeable (same split, microbatches, links: the cost model prices pipeline links
  by the job's device count, not by where a group sits), and so are groups of equal speed: a placement
  is the multiset of its replicas' speed vectors.
* Every such placement is enumerated while there are at most `limit` of them. Beyond that the packed
  placement and a spread one are tried, and `slowest_anywhere` gives what a bound may still assume of
  the rest: some replica holds the slowest used group, at some position, the others at full speed at
  best.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import perm

from planner.devices import SlotInventory


@dataclass(frozen=True, order=True)
class Placement:
    """One speed vector per replica holding a degraded group (sorted), the other replicas at full speed.

    `ep` > 1 (expert parallelism): replicas 0..ep-1, ep..2ep-1, ... of `rows` share their stages' routed
    experts and exchange tokens with each other at every layer, so each runs every stage at the pace of
    the slowest of its group there (`paced_rows`, what pricing reads). Which replicas share a group is
    then part of the placement: the space searched fills groups in `rows` order (slow rows first, sorted),
    and plans keep that order (`planner.assemble`)."""

    slow_rows: tuple[tuple[float, ...], ...]
    healthy_rows: int
    pp: int
    ep: int = 1

    @property
    def rows(self) -> tuple[tuple[float, ...], ...]:
        """Every replica's speed vector, slow ones first (the grid `place_slots` fills)."""
        return self.slow_rows + ((1.0,) * self.pp,) * self.healthy_rows

    @property
    def paced_rows(self) -> tuple[tuple[float, ...], ...]:
        """Each replica's stage speeds as it runs: its own, or its expert-parallel group's slowest."""
        return expert_group_pace(self.rows, self.ep)

    @property
    def distinct(self) -> tuple[tuple[float, ...], ...]:
        """The distinct paced speed vectors (what pricing needs: equal replicas run alike)."""
        return tuple(dict.fromkeys(self.paced_rows))


def expert_group_pace(rows: tuple[tuple[float, ...], ...], ep: int) -> tuple[tuple[float, ...], ...]:
    """Per replica, per stage, the slowest speed among the `ep` consecutive replicas of its group."""
    if ep <= 1:
        return tuple(rows)
    out: list[tuple[float, ...]] = []
    for start in range(0, len(rows), ep):
        block = rows[start:start + ep]
        out += [tuple(min(column) for column in zip(*block))] * len(block)
    return tuple(out)


def degraded_speeds_used(inventory: SlotInventory, pp: int, dp: int) -> tuple[float, ...]:
    """Speeds of the degraded groups among the fastest dp x pp, slowest first."""
    used = max(0, pp * dp - inventory.full_speed_count)
    return tuple(sorted(slot.speed for slot in inventory.degraded[:used]))


def _placement(rows: list[list[float]], pp: int, dp: int) -> Placement:
    slow = tuple(sorted(tuple(row) for row in rows))
    return Placement(slow, dp - len(slow), pp)


def _middle_first(pp: int) -> list[int]:
    return list(range(1, pp - 1)) + ([0, pp - 1] if pp > 1 else [0])


def packed(speeds: tuple[float, ...], pp: int, dp: int) -> Placement:
    """Slowest first into as few replicas as possible, middle positions first."""
    rows: list[list[float]] = []
    for index, speed in enumerate(speeds):
        if index % pp == 0:
            rows.append([1.0] * pp)
        rows[-1][_middle_first(pp)[index % pp]] = speed
    return _placement(rows, pp, dp)


def spread(speeds: tuple[float, ...], pp: int, dp: int) -> Placement:
    """Slowest first, one per replica in turn, middle positions first."""
    rows = [[1.0] * pp for _ in range(min(dp, len(speeds)))]
    for index, speed in enumerate(speeds):
        rows[index % len(rows)][_middle_first(pp)[index // len(rows)]] = speed
    return _placement(rows, pp, dp)


def placement_count_bound(k: int, pp: int, dp: int) -> int:
    """An upper bound on the placements (and recursion leaves) `all_placements` makes: k groups into
    distinct cells of the at most min(dp, k) replicas they can occupy, in order."""
    return perm(pp * min(dp, k), k) if k else 1


def all_placements(speeds: tuple[float, ...], pp: int, dp: int) -> list[Placement]:
    """Every placement of these degraded groups, up to interchangeable replicas and equal speeds."""
    found: set[Placement] = set()

    def place(index: int, rows: list[list[float]]) -> None:
        if index == len(speeds):
            found.add(_placement(rows, pp, dp))
            return
        # Into a replica already holding one, or the next fresh replica (replicas are interchangeable).
        for row in range(min(len(rows) + 1, dp)):
            if row == len(rows):
                rows.append([1.0] * pp)
            for position in range(pp):
                if rows[row][position] == 1.0:
                    rows[row][position] = speeds[index]
                    place(index + 1, rows)
                    rows[row][position] = 1.0
            if row == len(rows) - 1 and all(speed == 1.0 for speed in rows[row]):
                rows.pop()

    place(0, [])
    return sorted(found)


def placements(speeds: tuple[float, ...], pp: int, dp: int, limit: int) -> tuple[list[Placement], bool]:
    """The placements to try and whether they are all of them (else the packed and spread ones)."""
    if placement_count_bound(len(speeds), pp, dp) <= limit:
        return all_placements(speeds, pp, dp), True
    return sorted({packed(speeds, pp, dp), spread(speeds, pp, dp)}), False


def slowest_anywhere(speeds: tuple[float, ...], pp: int) -> list[tuple[float, ...]]:
    """Speed vectors one of which is elementwise at least as fast as some replica of any placement:
    the slowest used group at each position, every other stage at full speed."""
    return [tuple(speeds[0] if stage == position else 1.0 for stage in range(pp)) for position in range(pp)]
