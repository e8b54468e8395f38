"""The communication primitives of the planner's time model: ring collectives in the
alpha-beta model (Thakur, Rabenseifner and Gropp 2005; Hockney 1994), ``time = hops x
latency + bytes moved per rank / bandwidth``, and the bandwidth a group of devices gets
from the links it spans."""

from __future__ import annotations

from rltune.plan.spec import Cluster, Efficiency

GIGA = 1e9


def link_bandwidth(cluster: Cluster, size: int, stride: int, eff: Efficiency) -> float:
    """Achieved bytes/s of a group of ``size`` ranks ``stride`` apart: the intra-node link
    when ``size x stride <= gpus_per_node`` (ranks of a node are consecutive), else the
    inter-node one, times ``eff.comm_bandwidth``."""
    gbps = cluster.intra_gbps if size * stride <= cluster.gpus_per_node else cluster.inter_gbps
    return gbps * GIGA * eff.comm_bandwidth


def all_reduce_s(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` ranks: ``2 (n-1)/n x bytes / bw + 2 (n-1) x
    latency`` (reduce-scatter then all-gather)."""
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * latency


def all_gather_s(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-gather (or reduce-scatter) whose whole result is ``nbytes``: ``(n-1)/n x
    bytes / bw + (n-1) x latency``."""
    return 0.0 if n <= 1 else (n - 1) / n * nbytes / bw + (n - 1) * latency


def all_to_all_s(nbytes: float, n: int, bw: float, latency: float) -> float:
    """All-to-all of ``nbytes`` per rank: ``(n-1)/n`` of it leaves the rank,
    ``(n-1)/n x bytes / bw + (n-1) x latency``."""
    return 0.0 if n <= 1 else (n - 1) / n * nbytes / bw + (n - 1) * latency
