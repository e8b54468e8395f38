"""The learner group's DeviceMesh and the questions every parallel module asks it.

One mesh of five named dims (:data:`~rltune.parallel.layout.MESH_DIMS`:
``pp, dp_replicate, dp_shard, ep, tp``), built once per group by :func:`build_mesh`,
with three flattened dims made at the same time (creating a process group is a
collective every rank must join, so it cannot be left to whoever asks first):

* ``data`` = ``dp_replicate x dp_shard x ep``: the ranks that train on different rows.
  A rank's data rank is its index along it (:func:`data_rank`), which decides its shard
  of each global batch; tp and pp peers have the same data rank, so the same rows.
* ``dp_shard_ep`` = ``dp_shard x ep``: the dense weights' shard dim (FSDP2); with
  ``dp_replicate`` it makes the 2-D HSDP mesh of :func:`dense_dp_mesh`.
* the experts' data-parallel mesh ``dp_replicate x dp_shard`` (:func:`expert_dp_mesh`):
  experts are split over ``ep`` by index, so only those dims hold copies of them.

No device index or rank arithmetic lives anywhere else: modules ask the mesh.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rltune.parallel.layout import DATA_DIMS, MESH_DIMS, Layout

DATA = "data"
"""The flattened dim of :data:`~rltune.parallel.layout.DATA_DIMS`."""
SHARD_EP = "dp_shard_ep"
"""The flattened ``dp_shard x ep`` dim: where dense weights are sharded."""
_DERIVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each mesh of :func:`build_mesh` -> its flattened meshes (torch asks that they be kept,
not sliced again from the root)."""


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The group's mesh of ``layout`` (every rank calls it, in a process group of exactly
    ``layout.world`` ranks) on ``device_type`` (``cpu`` or ``cuda``), with the flattened
    dims of the module docstring (kept beside the mesh: ask the helpers below)."""
    import torch.distributed as dist

    if dist.get_world_size() != layout.world:
        raise ValueError(f"build_mesh: the layout ({layout.describe()}) has {layout.world} ranks, but the "
                         f"process group has {dist.get_world_size()}; check the layout first (rltune.parallel.layout)")
    world = init_device_mesh(device_type, (layout.world,), mesh_dim_names=("world",))
    mesh = world._unflatten(0, layout.shape, MESH_DIMS)
    data = mesh[DATA_DIMS]._flatten(DATA)
    dense = data._unflatten(0, (layout.dp_replicate, layout.dp_shard * layout.ep), ("dp_replicate", SHARD_EP))
    _DERIVED[mesh] = {DATA: data, "dense": dense}
    return mesh


def _derived(mesh: DeviceMesh, name: str) -> DeviceMesh:
    try:
        return _DERIVED[mesh][name]
    except KeyError:
        raise ValueError("this DeviceMesh was not made by rltune.parallel.mesh.build_mesh, which makes the "
                         "learner group's flattened dims; build the group's mesh with it") from None


def dim_size(mesh: DeviceMesh, dim: str) -> int:
    """How many ranks ``mesh``'s ``dim`` (one of the five named dims) has."""
    return mesh[dim].size()


def data_rank(mesh: DeviceMesh) -> int:
    """This rank's index among the ranks that train on different rows (its shard of each
    global batch): the flattened ``dp_replicate, dp_shard, ep`` coordinate."""
    return _derived(mesh, DATA).get_local_rank()


def data_world(mesh: DeviceMesh) -> int:
    """How many shards each global batch is cut into: ``dp_replicate * dp_shard * ep``."""
    return _derived(mesh, DATA).size()


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of this rank's data peers (same tp and pp coordinate, other rows):
    where step plans are agreed and metrics combined."""
    return _derived(mesh, DATA)


def data_group(mesh: DeviceMesh) -> torch.distributed.ProcessGroup:
    """The process group of :func:`data_mesh`."""
    return _derived(mesh, DATA).get_group()


def dense_dp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh the dense weights are data parallel over: 2-D ``(dp_replicate,
    dp_shard_ep)`` for ``fully_shard`` (HSDP when both are > 1, replication when only
    ``dp_replicate`` is, plain sharding when only the shard dim is); None when the group
    has one data rank (nothing to synchronise)."""
    if data_world(mesh) == 1:
        return None
    return _derived(mesh, "dense")


def expert_dp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh the expert weights are data parallel over: 2-D ``(dp_replicate,
    dp_shard)`` (``ep`` splits the experts themselves); None when both are 1."""
    if dim_size(mesh, "dp_replicate") * dim_size(mesh, "dp_shard") == 1:
        return None
    return mesh[("dp_replicate", "dp_shard")]


def is_first_stage(mesh: DeviceMesh) -> bool:
    """Whether this rank holds the pipeline's first stage (always, with pp=1)."""
    return mesh["pp"].get_local_rank() == 0


def is_last_stage(mesh: DeviceMesh) -> bool:
    """Whether this rank holds the pipeline's last stage, where the loss is (always, with
    pp=1)."""
    return mesh["pp"].get_local_rank() == mesh["pp"].size() - 1


__all__ = [
    "DATA",
    "SHARD_EP",
    "build_mesh",
    "data_group",
    "data_mesh",
    "data_rank",
    "data_world",
    "dense_dp_mesh",
    "dim_size",
    "expert_dp_mesh",
    "is_first_stage",
    "is_last_stage",
]
