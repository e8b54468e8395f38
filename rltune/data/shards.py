"""Which contiguous rows of a batch each of several workers takes: the learner group's
ranks (rows of a global batch) and the Ray generator and scorer actors (prompts and
rollouts of a step) cut their work the same way."""

from __future__ import annotations


def shard_bounds(rows: int, rank: int, world: int, *, unit: int = 1, allow_empty: bool = False) -> tuple[int, int]:
    """``(start, stop)``: the contiguous rows of a ``rows``-row batch that ``rank`` of
    ``world`` takes.

    The batch is cut into ``rows / unit`` units (``unit`` consecutive rows that must stay
    together, 2 for chosen/rejected pairs), dealt out in contiguous blocks whose sizes
    differ by at most one unit, the larger blocks first. Contiguous blocks also keep a
    prompt's group of samples together. With fewer units than ranks the last ranks get
    empty blocks when ``allow_empty``; otherwise that is a ValueError (a learner rank
    without rows could not take part in the step)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"shard_bounds: rank={rank} is not in [0, world={world})")
    if unit < 1 or rows % unit:
        raise ValueError(f"shard_bounds: {rows} rows do not split into units of {unit}")
    units = rows // unit
    if units < world and not allow_empty:
        raise ValueError(
            f"shard_bounds: {rows} rows ({units} units of {unit}) cannot give each of "
            f"{world} ranks at least one unit; use a batch of at least {world * unit} rows"
        )
    base, extra = divmod(units, world)
    start = rank * base + min(rank, extra)
    stop = start + base + (rank < extra)
    return start * unit, stop * unit
