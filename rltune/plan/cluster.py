"""The cluster a plan is for: a preset device (``PRESETS``) with any of its figures
overridden, from the command line (``cluster_from_args``) or a small YAML file
(``load_cluster``). Nonsense (no devices, a partial node, a bandwidth of zero) is a
``PlanError`` naming the flag or the key and file.

Figures are the vendors' datasheet peaks per device: dense 16-bit matmul TFLOP/s
(without 2:4 sparsity), HBM bandwidth, NVLink bandwidth per direction (half the
datasheet's bidirectional total), and the InfiniBand of a typical node (one NIC per GPU),
per direction. What a device reaches of them is ``Efficiency``'s business.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import yaml

from rltune.plan.errors import PlanError
from rltune.plan.bounds import search_bound_problems
from rltune.plan.spec import Cluster

PRESETS: dict[str, Cluster] = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM: BF16 1,979 TFLOPS with sparsity (989.5
    # dense), FP32 67 TFLOPS, 3.35 TB/s HBM3, NVLink 900 GB/s (both directions); DGX H100:
    # 8 x ConnectX-7 400 Gb/s (50 GB/s per GPU); PCIe Gen5 x16 (64 GB/s, ~55 in practice).
    "h100-80gb": Cluster(gpus=8, gpus_per_node=8, memory_gb=80.0, tflops=989.0, hbm_gbps=3350.0,
                         intra_gbps=450.0, inter_gbps=50.0, host_gbps=55.0,
                         fp32_ratio=67.0 / 989.0, name="H100 SXM 80GB"),
    # NVIDIA A100 Tensor Core GPU datasheet, SXM 80GB: BF16 312 TFLOPS dense, FP32 19.5
    # TFLOPS, 2,039 GB/s HBM2e, NVLink 600 GB/s (both directions); DGX A100: 8 x HDR
    # 200 Gb/s (25 GB/s per GPU); PCIe Gen4 x16 (32 GB/s, ~25 in practice).
    "a100-80gb": Cluster(gpus=8, gpus_per_node=8, memory_gb=80.0, tflops=312.0, hbm_gbps=2039.0,
                         intra_gbps=300.0, inter_gbps=25.0, host_gbps=25.0,
                         fp32_ratio=19.5 / 312.0, name="A100 SXM 80GB", fp8=False),  # compute capability 8.0
    # NVIDIA H200 Tensor Core GPU datasheet, SXM: BF16 1,979 TFLOPS with sparsity (989.5
    # dense), FP32 67 TFLOPS, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s (both directions);
    # HGX H200 with 400 Gb/s per GPU; PCIe Gen5 x16.
    "h200-141gb": Cluster(gpus=8, gpus_per_node=8, memory_gb=141.0, tflops=989.0, hbm_gbps=4800.0,
                          intra_gbps=450.0, inter_gbps=50.0, host_gbps=55.0,
                          fp32_ratio=67.0 / 989.0, name="H200 SXM 141GB"),
    # NVIDIA HGX B200 datasheet, per GPU (the 8-GPU figures / 8): BF16 4.5 PFLOPS with
    # sparsity (2,250 dense), FP32 75 TFLOPS, 8 TB/s HBM3e, NVLink 5 1.8 TB/s (both
    # directions); DGX B200: 8 x ConnectX-7 400 Gb/s; PCIe Gen5 x16. Memory: B200's 192 GB
    # (DGX B200 lists 180 GB usable per GPU: set --gpu-memory-gb 180 for it).
    "b200-192gb": Cluster(gpus=8, gpus_per_node=8, memory_gb=192.0, tflops=2250.0, hbm_gbps=8000.0,
                          intra_gbps=900.0, inter_gbps=50.0, host_gbps=55.0,
                          fp32_ratio=75.0 / 2250.0, name="B200 192GB"),
}
"""Device presets by name; their ``gpus`` (8, one node) is a placeholder the caller's
count replaces."""

_FIELDS = {  # file key / argument -> (Cluster field, command-line flag)
    "gpus": ("gpus", "--gpus"),
    "gpus_per_node": ("gpus_per_node", "--gpus-per-node"),
    "gpu_memory_gb": ("memory_gb", "--gpu-memory-gb"),
    "gpu_tflops": ("tflops", "--gpu-tflops"),
    "intra_gbps": ("intra_gbps", "--intra-gbps"),
    "inter_gbps": ("inter_gbps", "--inter-gbps"),
    "hbm_gbps": ("hbm_gbps", "--hbm-gbps"),
    "host_gbps": ("host_gbps", "--host-gbps"),
}
CLUSTER_KEYS = (*_FIELDS, "preset")
"""The keys of a cluster YAML file."""


def _preset(name: Any, where: str) -> Cluster:
    if not isinstance(name, str) or name.lower() not in PRESETS:
        raise PlanError(f"{where}: unknown device preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name.lower()]


def _checked(key: str, value: Any, where: str) -> int | float:
    """``value`` of ``key`` if it is a sensible number: a positive integer for the device
    counts, a positive finite number for the rest."""
    integer = key in ("gpus", "gpus_per_node")
    kind = "an integer >= 1" if integer else "a number > 0"
    number = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    if not number or not math.isfinite(value) or value <= 0:
        raise PlanError(f"{where} is {value!r}; it must be {kind}")
    return value


def _build(values: dict[str, Any], preset: str, name_of: dict[str, str], source: str) -> Cluster:
    """The preset with ``values`` (file keys, None: the preset's) put in, then checked as a
    whole. ``name_of`` maps a key to how the user wrote it (a flag, or the key and file)."""
    base = _preset(preset, source)
    changes = {}
    for key, value in values.items():
        if value is not None:
            changes[_FIELDS[key][0]] = _checked(key, value, name_of[key])
    if "gpus" not in changes:
        raise PlanError(f"{name_of['gpus']} is missing: how many devices the run may use")
    problems = search_bound_problems(changes["gpus"], 0, gpus_name=name_of["gpus"])
    if problems:
        raise PlanError(problems[0])
    cluster = dataclasses.replace(base, **changes)
    if cluster.gpus > cluster.gpus_per_node and cluster.gpus % cluster.gpus_per_node:
        raise PlanError(
            f"{name_of['gpus']} {cluster.gpus} spans more than one node but is not a multiple of "
            f"{name_of['gpus_per_node']} {cluster.gpus_per_node}: plan for whole nodes"
        )
    return cluster


def cluster_from_args(
    gpus: int,
    gpus_per_node: int | None = None,
    memory_gb: float | None = None,
    tflops: float | None = None,
    intra_gbps: float | None = None,
    inter_gbps: float | None = None,
    preset: str = "h100-80gb",
    *,
    hbm_gbps: float | None = None,
    host_gbps: float | None = None,
) -> Cluster:
    """The cluster the command-line flags describe: ``preset``'s device with every flag
    that is set (not None) in its place. Raises ``PlanError`` naming the flag for a count
    below 1, a figure that is not positive, or more than one node of devices that is not
    a whole number of nodes."""
    values = dict(gpus=gpus, gpus_per_node=gpus_per_node, gpu_memory_gb=memory_gb,
                  gpu_tflops=tflops, intra_gbps=intra_gbps, inter_gbps=inter_gbps,
                  hbm_gbps=hbm_gbps, host_gbps=host_gbps)
    flags = {key: flag for key, (_, flag) in _FIELDS.items()}
    return _build(values, preset, flags, "--preset")


def load_cluster(path: str | Path) -> Cluster:
    """The cluster a YAML file describes, with the keys ``CLUSTER_KEYS`` (those of the
    command-line flags, ``gpu_memory_gb`` for ``--gpu-memory-gb``, and so on, plus
    ``hbm_gbps``, ``host_gbps`` and ``preset``); ``gpus`` is required, the rest default
    to the preset's (``h100-80gb``). Raises ``PlanError`` naming the file and key for an
    unknown key or a bad value, and naming the file when it cannot be read."""
    from rltune.config.load import parse_yaml

    path = Path(path)
    try:
        data = parse_yaml(path.read_text(encoding="utf-8"), str(path))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        reason = " ".join(str(exc).split())
        raise PlanError(f"cannot read cluster file {path}: {reason}") from None
    if not isinstance(data, dict):
        raise PlanError(f"cluster file {path} must be a mapping of {', '.join(CLUSTER_KEYS)}")
    unknown = [str(k) for k in data if k not in CLUSTER_KEYS]
    if unknown:
        raise PlanError(f"cluster file {path}: unknown key {', '.join(unknown)}; the keys are "
                        f"{', '.join(CLUSTER_KEYS)}")
    names = {key: f"`{key}` in {path}" for key in _FIELDS}
    values = {key: data.get(key) for key in _FIELDS}
    preset = data.get("preset")  # absent or empty: the default device
    return _build(values, "h100-80gb" if preset is None else preset, names, f"`preset` in {path}")
