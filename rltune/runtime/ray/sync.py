"""Weights from the learner to the generators by collective broadcast
(``runtime.weight_sync: broadcast``): learner rank 0 and every generator actor form a
process group of their own (NCCL between GPUs, gloo on CPU), and each sync is one
broadcast per bucket of the flattened weights, received by the generators straight into
their models' tensors. Nothing passes through the driver or Ray's object store.

The group is not torch's default process group (the learner ranks already have theirs):
it is a stand-alone ``ProcessGroupGloo``/``ProcessGroupNCCL`` over its own TCPStore, so a
generator can join it without joining the learners' group. When a generator dies the
channel is torn down everywhere and formed again with its replacement.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 * 2**20
"""Largest flat buffer one broadcast carries (bounds the extra memory of a sync)."""

Layout = list[tuple[str, tuple[int, ...], str]]


def layout(tensors: Mapping[str, torch.Tensor]) -> Layout:
    """Name, shape and dtype of each tensor, in name order: both ends of a channel must
    have the same layout (checked by the driver before the first sync)."""
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in sorted(tensors.items())]


def buckets(tensors: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Names grouped into buckets of one dtype and at most BUCKET_BYTES (a larger tensor
    is a bucket of its own), in name order; both ends compute the same from one layout."""
    out: list[list[str]] = []
    current: list[str] = []
    size, dtype = 0, None
    for name, t in sorted(tensors.items()):
        nbytes = t.numel() * t.element_size()
        if current and (t.dtype != dtype or size + nbytes > BUCKET_BYTES):
            out.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
        dtype = t.dtype
    if current:
        out.append(current)
    return out


class WeightChannel:
    """One member of a broadcast group: ``rank`` 0 sends (learner rank 0), the others
    receive (generators). ``device``: where the tensors live (a CUDA device makes it NCCL)."""

    def __init__(self, addr: str, port: int, rank: int, world: int, *, device: torch.device,
                 timeout_s: float = 300.0) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world, self.device = rank, world, device
        self.store = dist.TCPStore(addr, port, world, rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore("rltune-weights", self.store)
        if device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(prefixed, rank, world)
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, world, timeout)

    def _broadcast(self, flat: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([flat], opts).wait()

    def send(self, tensors: Mapping[str, torch.Tensor], version: int) -> int:
        """Rank 0: broadcast the policy ``version``, then ``tensors`` bucket by bucket;
        returns the bytes sent."""
        self._broadcast(torch.tensor([version], dtype=torch.int64, device=self.device))
        sent = 0
        with torch.no_grad():
            for names in buckets(tensors):
                flat = torch.cat([tensors[n].detach().to(self.device).reshape(-1) for n in names])
                self._broadcast(flat)
                sent += flat.numel() * flat.element_size()
        return sent

    def receive_into(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """The other ranks: receive the version and every bucket, copied into ``tensors``
        in place (a model's own parameters and buffers); returns the version."""
        version, received = self._receive(tensors)
        with torch.no_grad():
            for bucket in received:
                for name, value in bucket:
                    tensors[name].copy_(value)
        return version

    def receive_buckets(self, layout: Layout) -> tuple[int, Iterator[list[tuple[str, torch.Tensor]]]]:
        """The other ranks, for a receiver whose weights are not laid out as the sender's
        (a vLLM engine): the version, and an iterator that receives one bucket at a time
        as ``(name, tensor)`` views of a fresh buffer, for the receiver to load before the
        next arrives (so at most one bucket is held). Consume the iterator to the end."""
        shapes = {
            name: torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device="meta")
            for name, shape, dtype in layout
        }
        return self._receive(shapes)

    def _receive(self, like: Mapping[str, torch.Tensor]) -> tuple[int, Iterator[list[tuple[str, torch.Tensor]]]]:
        """Receive the version now, and return it with an iterator over the buckets of
        tensors shaped as ``like``'s (any device, meta too), each received when reached."""
        version = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(version)

        def each() -> Iterator[list[tuple[str, torch.Tensor]]]:
            for names in buckets(like):
                parts = [like[n] for n in names]
                flat = torch.empty(sum(p.numel() for p in parts), dtype=parts[0].dtype, device=self.device)
                self._broadcast(flat)
                views, offset = [], 0
                for name, p in zip(names, parts):
                    views.append((name, flat[offset : offset + p.numel()].view(p.shape)))
                    offset += p.numel()
                yield views

        return int(version), each()

    def close(self) -> None:
        """Leave the group (the other members' next broadcast fails rather than hangs)."""
        shutdown = getattr(self.group, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - a group whose peers are gone may refuse to shut down cleanly
                pass
        self.group = None
        self.store = None
