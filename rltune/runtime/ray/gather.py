"""The full weights of a sharded learner, one tensor at a time, for the generators.

rltune's generators are one process each (the HF engine, or vLLM in one process), so
each needs every weight whole: the learner group must gather. It gathers tensor by
tensor, in the name order of the weight channel's buckets (``rltune/runtime/ray/sync.py``),
so no rank ever holds a second full copy of the model on its device:

* **broadcast** (``runtime.weight_sync: broadcast``): every rank takes part in gathering
  each tensor; rank 0 sends a bucket as soon as it is complete and frees it. Extra
  memory on rank 0: one bucket (``sync.BUCKET_BYTES``) and its flat copy; on the other
  ranks, one gathered tensor.
* **object store** (the default): rank 0 moves each gathered tensor to its CPU at once,
  so its device holds one gathered tensor at a time; its CPU holds the full weights,
  which Ray's object store needs as one object. The other ranks keep nothing.

A generator sharded as the learner is (vLLM with the same tp, its own process per rank)
could take each rank's shard without any gather; rltune's generators are not, so that is
not done. Under pipeline parallelism a rank holds only its stage's tensors and the
pipeline gathers the stages' state dicts whole (:meth:`MeshParallelism.full_state_dict`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch: no sharded tensors
    DTensor = ()

from rltune.learner.learner import LocalLearner


def streams(learner: LocalLearner) -> bool:
    """Whether this learner's weights can be gathered one tensor at a time: every rank
    holds every name (all but pipeline parallelism, whose stages hold different names)."""
    return getattr(learner.parallelism, "pipeline", None) is None


class Gathering(Mapping):
    """The learner's weights by name, each gathered when it is read (a collective of the
    group for a sharded tensor: every rank must read the same names in the same order).
    Iterating and ``items()`` give the live (sharded) tensors, whose shape, dtype and
    size are the full ones: enough to plan buckets without gathering anything."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.live = {k: v.detach() for k, v in model.state_dict().items()}
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self.live[name]
        self.read.add(name)
        return value.full_tensor() if isinstance(value, DTensor) else value

    def finish(self) -> None:
        """Gather (and drop) every name not read yet, in name order: what the other
        ranks still do when the sender stopped early, so the group's collectives match."""
        for name in sorted(self.live):
            if name not in self.read:
                self[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.live)

    def __len__(self) -> int:
        return len(self.live)

    def items(self):  # noqa: ANN201 - the live tensors, unlike Mapping.items
        return self.live.items()


def gather_one_by_one(learner: LocalLearner, *, keep: bool) -> dict[str, torch.Tensor] | None:
    """Every rank together: each weight gathered in turn; ``keep`` (rank 0): each one
    copied to the CPU at once and returned by name; otherwise dropped (None)."""
    if not streams(learner):
        weights = learner.export_weights()
        return {k: v.detach().cpu() for k, v in weights.items()} if keep else None
    gathering = Gathering(learner.model)
    if not keep:
        gathering.finish()
        return None
    # one gathered tensor on the device at a time; the CPU copy is what is kept
    return {name: gathering[name].detach().cpu() for name in sorted(gathering)}


def send_streamed(channel, learner: LocalLearner, *, sender: bool) -> int | None:
    """Broadcast the weights on ``channel`` (``sync.WeightChannel``), gathered tensor by
    tensor as its buckets are filled; every rank of a sharded group calls it together,
    ``sender`` (rank 0) sends and returns the bytes sent, the others only gather."""
    if not streams(learner):
        weights = learner.export_weights()
        return channel.send(weights, learner.version) if sender else None
    gathering = Gathering(learner.model)
    if not sender:
        gathering.finish()  # every name, in the order the sender's buckets read them
        return None
    try:
        return channel.send(gathering, learner.version)
    except BaseException:
        gathering.finish()  # a receiver gone: the group still completes its gathers
        raise


__all__ = ["Gathering", "gather_one_by_one", "send_streamed", "streams"]
