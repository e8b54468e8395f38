"""How far the layout search (``rltune.plan.search``) goes: the largest cluster and the
largest staleness it takes, and the one-line refusal of an input past them, naming the
flag or key. Past these the search would run for minutes to hours without a word, so
``rltune plan`` refuses them before it starts. No torch."""

from __future__ import annotations

MAX_GPUS = 2048
"""The largest cluster the search takes. Its cost grows with the device count: there is a
role split for every generator count (about ``gpus`` of them per generator TP), TPE's
split parameter ranges over them, and each move of the climb (``search.polish``) prices the
nearest layout on every split. On a 2-core CPU a 7B GRPO plan takes about 20 s at 1,024
devices, 40 s at 2,048 (65 s for an MoE model with vLLM generators) and 110 s at 4,096,
so this bound keeps a plan near a minute (a plan for 10^8 devices, unbounded, did not
finish in minutes)."""

MAX_STALENESS = 64
"""The largest staleness searched (``--max-staleness`` or ``runtime.max_staleness``).
The space holds every staleness 0..K, and the climb prices each of them at each move,
so the search time grows with K; the cost model prices every staleness of 1 or more
alike (generation overlaps learning, ``timing.overlapped_step``), so a larger K can only
be ranked below a smaller one and finds nothing the bound misses."""


def search_bound_problems(gpus: int, max_staleness: int, *, gpus_name: str = "--gpus",
                          staleness_name: str = "--max-staleness") -> list[str]:
    """The device count and staleness past what the search takes (:data:`MAX_GPUS`,
    :data:`MAX_STALENESS`), one line each naming the flag or key (``*_name``)."""
    problems = []
    if gpus > MAX_GPUS:
        problems.append(f"{gpus_name} {gpus}: the planner searches clusters of at most {MAX_GPUS:,} devices "
                        f"(its time grows with the count); plan for {MAX_GPUS} or fewer")
    if max_staleness > MAX_STALENESS:
        problems.append(f"{staleness_name} {max_staleness}: the planner searches staleness up to {MAX_STALENESS} "
                        f"(every staleness of 1 or more overlaps generation the same way); give --max-staleness "
                        f"{MAX_STALENESS} or less")
    return problems
