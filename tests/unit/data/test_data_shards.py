"""``shard_bounds``: the one way a batch is cut among workers (learner ranks, Ray actors)."""

from __future__ import annotations

import pytest

from rltune.data.shards import shard_bounds


def bounds(rows: int, world: int, **kw) -> list[tuple[int, int]]:
    return [shard_bounds(rows, rank, world, **kw) for rank in range(world)]


def test_blocks_by_hand_larger_first() -> None:
    assert bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert bounds(10, 2, unit=2) == [(0, 6), (6, 10)]  # 5 pairs: 3 then 2
    assert bounds(5, 2) == [(0, 3), (3, 5)]


def test_fewer_items_than_workers_gives_empty_blocks_only_when_allowed() -> None:
    assert bounds(1, 3, allow_empty=True) == [(0, 1), (1, 1), (1, 1)]
    assert bounds(0, 2, allow_empty=True) == [(0, 0), (0, 0)]
    with pytest.raises(ValueError, match="cannot give each of 3 ranks at least one unit"):
        shard_bounds(1, 0, 3)


@pytest.mark.parametrize("rows, world, unit", [(7, 3, 1), (12, 5, 2), (3, 4, 1), (100, 7, 4)])
def test_blocks_cover_every_row_once_in_order(rows: int, world: int, unit: int) -> None:
    got = bounds(rows, world, unit=unit, allow_empty=True)
    assert got[0][0] == 0 and got[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(got, got[1:]))
    sizes = [stop - start for start, stop in got]
    assert all(s % unit == 0 for s in sizes) and max(sizes) - min(sizes) <= unit
    assert sizes == sorted(sizes, reverse=True)
