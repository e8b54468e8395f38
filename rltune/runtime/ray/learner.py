"""The learner group as Ray actors (``runtime.mode: ray``).

``runtime.placement.learners`` actors (:class:`LearnerActor`), one per bundle of the run's
placement group, form one torch.distributed group (gloo on CPU, NCCL when the actor
reserved a GPU) and train one model laid out by ``train.parallel`` (or, with nothing
set there, DDP or FSDP2 of ``runtime.placement.learner_strategy``: ``learner_layout.py``),
each rank a :class:`~rltune.learner.learner.LocalLearner` with that parallelism. The
driver holds a :class:`RayLearnerGroup`, which implements the Learner protocol of
``rltune/runtime/loop.py``: it cuts each global batch into shards by data rank (tp and pp
peers get the same rows), calls every rank together and returns rank 0's answer. The group's update is the one a
:class:`~rltune.learner.learner.LocalLearner` of the same config makes on the whole batch
(see ``rltune/learner/parallel.py`` for why), and every actor builds its learner as
``rltune.runtime.local.LocalRoles`` builds the local one, so both start identical.

The model lives in the actors: the group has no ``model`` attribute. The driver gets the
weights with :meth:`RayLearnerGroup.export_weights` (a :class:`WeightsRef` into Ray's
object store, for generator actors to load without a copy through the driver) or
:meth:`RayLearnerGroup.fetch_weights` (the dict, on the driver, for exports).

Failures. A learner actor that dies makes the call that needed it raise
:class:`LearnerDied` naming the rank; the other ranks are then stuck in a collective with
a dead peer, so the group kills them and is closed. The run's supervisor resumes from the
newest checkpoint with a new group. A rank that raises (a non-finite gradient, running out
of memory) closes the group too, for the same reason, and its error propagates.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError

from rltune.config import Config
from rltune.data.records import TrainBatch
from rltune.learner.distributed import init_group, loopback_interface
from rltune.learner.learner import LocalLearner
from rltune.metrics.types import Metric
from rltune.learner.pair_scoring import group_fingerprint, learner_pair_outputs, learner_weights_fingerprint
from rltune.runtime.roles import learner_model, learner_objective, learner_options, lookup_algorithm, seed_everything
from rltune.runtime.ray.cluster import Placement, actor_setup, death_reason, refuses_at_start
from rltune.runtime.ray.learner_layout import (
    Position,
    data_shards,
    group_strategy,
    learner_parallelism,
    output_actors,
    position_of,
    rank_logprobs,
)
from rltune.checkpoint.sharded import writes_shards
from rltune.runtime.ray.fsdp_state import rank_checkpoint_state, rank_load_checkpoint_state
from rltune.runtime.ray.gather import gather_one_by_one, send_streamed

ROLE = "learner"
"""The placement role of the learner actors (``runtime.placement.learner``)."""


class LearnerDied(RuntimeError):
    """A learner actor died (or stopped answering); the group is closed. Resume the run
    from its newest checkpoint with a new group."""


@dataclass(frozen=True)
class WeightsRef:
    """Rank 0's full weights (``dict[str, Tensor]``, CPU) in Ray's object store, at
    policy ``version``.

    Pass it to a generator actor, which loads ``ray.get(weights.ref)`` (an ObjectRef
    inside an argument is not resolved by Ray); the driver never copies the tensors."""

    ref: ray.ObjectRef
    version: int

    def get(self, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        """The weights, here."""
        return ray.get(self.ref, timeout=timeout_s)


@dataclass(frozen=True)
class BroadcastWeights:
    """The learner group's weights at ``version`` or newer, to be received by broadcast
    (``runtime.weight_sync: broadcast``); the generators' pool runs the exchange."""

    group: Any
    version: int


# ----------------------------------------------------------------------------- one rank


@refuses_at_start
class LearnerActor:
    """One rank of the learner group, run as a Ray actor (``ray.remote(LearnerActor)``).

    Joins the torch.distributed group at ``master_addr:master_port`` as ``rank`` of
    ``world`` and builds the policy learner from ``cfg`` as ``LocalRoles`` does: seeded
    with ``train.seed``, the model from ``model_dir`` (``learner_model``: LoRA when
    configured; a preference method's model), the objective of ``algo``, the options of
    ``learner_options``. Every method that the group calls on all ranks must be called on
    all ranks together.
    ``threads``: torch's intra-op threads (the actor's reserved CPUs, which take the place
    of ``train.threads`` here)."""

    def __init__(
        self,
        cfg: Config,
        model_dir: str,
        rank: int,
        world: int,
        master_addr: str,
        master_port: int,
        threads: int,
    ) -> None:
        actor_setup(threads)
        backend = _join_environment(rank, world, master_addr, master_port)
        init_group(backend)
        self.rank, self.world = rank, world
        seed_everything(cfg.train.seed)
        algorithm = lookup_algorithm(cfg.algo.name)
        model = learner_model(cfg, model_dir)
        objective = learner_objective(cfg, algorithm)
        # the layout of train.parallel, or learner_strategy's DDP/FSDP2 (learner_layout.py)
        self.parallelism, self.strategy = learner_parallelism(cfg, world)
        self.learner = LocalLearner(
            model, objective, cfg.train, parallelism=self.parallelism, **learner_options(cfg, algorithm, model)
        )

    # -- training and prediction (every rank) ------------------------------------------

    def step(self, batch: TrainBatch) -> tuple[int, dict[str, Metric] | None]:
        """One optimizer step of the group on this rank's shard: ``(version, metrics)``,
        the metrics (the group's, the same on every rank) from rank 0 only."""
        metrics = self.learner.step(batch)
        return self.learner.version, (metrics if self.rank == 0 else None)

    def export_weights(self) -> tuple[list[ray.ObjectRef], int] | None:
        """Rank 0: ``([ref], version)``, ``ref`` to the full weights put into Ray's object
        store by this actor (in a list, so that Ray hands the driver the reference and
        not the tensors). Other ranks take part in gathering the sharded weights, one tensor
        at a time (``rltune/runtime/ray/gather.py``), and return None."""
        weights = gather_one_by_one(self.learner, keep=self.rank == 0)
        if self.rank != 0:
            return None
        return [ray.put(weights)], self.learner.version

    # -- weights by broadcast (runtime.weight_sync: broadcast) ---------------------------

    def open_channel(self, addr: str, port: int, world: int) -> Any:
        """Rank 0: become rank 0 (the sender) of a new weight channel of ``world`` members
        (the others are the generators); returns the layout of the weights it will send."""
        from rltune.runtime.ray.sync import WeightChannel, layout

        self.close_channel()
        self.channel = WeightChannel(addr, port, 0, world, device=self.parallelism.device)
        return layout(self.learner.model.state_dict())

    def close_channel(self) -> None:
        channel, self.channel = getattr(self, "channel", None), None
        if channel is not None:
            channel.close()

    def send_weights(self) -> tuple[int, int, str | None] | None:
        """Broadcast the full weights on the channel (sharded: every rank takes part in
        gathering them tensor by tensor as rank 0 fills and sends each bucket,
        ``rltune/runtime/ray/gather.py``). Rank 0: ``(version, bytes, error)``; a failed
        send (a receiver gone) is reported, not raised, so the group stays usable."""
        if self.rank != 0:
            return send_streamed(None, self.learner, sender=False)
        try:
            sent = send_streamed(self.channel, self.learner, sender=True)
        except Exception as err:  # noqa: BLE001 - the driver decides: re-form the channel
            return self.learner.version, 0, f"{type(err).__name__}: {err}"
        return self.learner.version, sent, None

    # -- checkpoints --------------------------------------------------------------------

    def checkpoint_state(self, prefix: str, directory: str | None = None) -> tuple[dict, dict] | None:
        """Rank 0: the learner's checkpoint part, CPU tensors; other ranks None. Sharded
        (a mesh layout): every rank writes its shards into ``directory``; FSDP2: every
        rank takes part in gathering (``rltune/runtime/ray/fsdp_state.py``)."""
        return rank_checkpoint_state(self.learner, self.strategy, prefix, directory)

    def writes_shards(self) -> bool:
        return writes_shards(self.learner)

    def load_checkpoint_state(self, tensors: dict, meta: dict, path: str, prefix: str) -> int:
        """Apply a checkpoint's learner part, of either format (every rank, the same
        arguments); returns the restored version."""
        rank_load_checkpoint_state(self.learner, self.strategy, tensors, meta, Path(path), prefix)
        return self.learner.version

    # -- small queries ------------------------------------------------------------------

    def version(self) -> int:
        return self.learner.version

    def position(self) -> tuple[int, Position]:
        """``(version, where this rank sits in the mesh)``: which rows it trains on."""
        return self.learner.version, position_of(self.parallelism)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(learner, *args)`` on this rank's learner (collectives inside ``fn`` need
        every rank to run it)."""
        return fn(self.learner, *args)


def _join_environment(rank: int, world: int, master_addr: str, master_port: int) -> str | None:
    """Set the variables :func:`init_group` reads; returns the backend: None (its default,
    NCCL for the model) when Ray gave this actor a GPU, else gloo."""
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank), WORLD_SIZE=str(world))
    gpu_ids = [str(i) for i in ray.get_gpu_ids()]
    if gpu_ids and torch.cuda.is_available():
        # the device index among those this process sees (Ray sets CUDA_VISIBLE_DEVICES)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        names = [name.strip() for name in visible.split(",")] if visible else []
        os.environ["LOCAL_RANK"] = str(names.index(gpu_ids[0]) if gpu_ids[0] in names else int(gpu_ids[0]))
        return None
    os.environ["LOCAL_RANK"] = "0"
    if master_addr.startswith("127."):
        # a single-node cluster bound to loopback: gloo's own connections stay on it too
        loopback = loopback_interface()
        if loopback is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    return "gloo"


@ray.remote(num_cpus=0)
def _endpoint() -> tuple[str, int]:
    """This node's IP and a TCP port free on it: where rank 0 listens for the others. On a
    cluster of one node the group meets on loopback, so gloo's connections stay on it."""
    one_node = sum(1 for node in ray.nodes() if node["Alive"]) == 1
    with socket.socket() as s:
        s.bind(("", 0))
        return "127.0.0.1" if one_node else ray.util.get_node_ip_address(), s.getsockname()[1]


# ----------------------------------------------------------------------------- the group


_RemoteLearnerActor = ray.remote(LearnerActor)


class RayLearnerGroup:
    """The driver's handle on the learner actors: the Learner protocol of
    ``rltune/runtime/loop.py`` (``version``, ``step``, ``logprobs``, ``export_weights``)
    plus checkpoints (``checkpoint_state``, ``load_checkpoint_state``, which
    ``rltune/runtime/state.py`` calls), ``fetch_weights`` and ``close``.

    Starts ``cfg.runtime.placement.learners`` actors in ``placement``'s learner bundles,
    each loading ``model_dir``; rank 0 listens on a free port of its own node. There is no
    ``model`` attribute: the model lives in the actors (``fetch_weights()`` gives its
    weights). ``timeout_s`` bounds every call (None: wait as long as the ranks compute; a
    dead actor is reported at once either way); a call past it raises
    :class:`LearnerDied`. ``last_sync_s``: seconds the last ``export_weights`` took."""

    def __init__(
        self, cfg: Config, model_dir: str, placement: Placement, *, timeout_s: float | None = None, wait: bool = True
    ) -> None:
        algorithm = lookup_algorithm(cfg.algo.name)
        try:  # refuses the algorithms with a learner of their own before any actor starts
            objective = learner_objective(cfg, algorithm)
        except ValueError as err:
            raise ValueError(f"RayLearnerGroup: {err}; the Ray learner group trains the policy "
                             "learner's algorithms (those that generate, SFT and the preference methods)") from None
        self.unit = objective.unit
        self.world = cfg.runtime.placement.learners
        if len(placement.index[ROLE]) < self.world:
            raise ValueError(f"RayLearnerGroup: runtime.placement.learners={self.world}, but the placement "
                             f"has {len(placement.index[ROLE])} learner bundle(s); place the same placement config")
        self.strategy = group_strategy(cfg, self.world, model_dir)  # checks a train.parallel layout
        self.weight_sync = cfg.runtime.weight_sync
        self.placement = placement
        self._lock = threading.Lock()
        self.timeout_s = timeout_s
        self.last_sync_s = 0.0
        self.closed = False
        first = {**placement.options(ROLE, 0), "num_cpus": 0, "num_gpus": 0}
        master_addr, master_port = ray.get(_endpoint.options(**first).remote(), timeout=timeout_s)
        threads = placement.threads(ROLE)
        self.actors: list[ray.actor.ActorHandle] = [
            _RemoteLearnerActor.options(**placement.options(ROLE, rank)).remote(
                cfg, model_dir, rank, self.world, master_addr, master_port, threads
            )
            for rank in range(self.world)
        ]
        self._starting: list[ray.ObjectRef] | None = [a.position.remote() for a in self.actors]
        self._version, self.positions = 0, list[Position]()
        if wait:
            self.started()

    def started(self) -> None:
        """Waits until every rank has loaded its model (``wait=False`` leaves this to the caller)."""
        if self._starting is not None:
            started, self._starting = self._gather(self._starting, "start"), None
            self._version = started[0][0]
            self.positions = [position for _, position in started]

    @property
    def version(self) -> int:
        """The policy version: optimizer steps taken (restored by a checkpoint)."""
        return self._version

    def step(self, batch: TrainBatch) -> dict[str, Metric]:
        """One optimizer step of the group on the global ``batch`` (each rank its
        contiguous shard); returns the group's metrics."""
        shards = self._shards(batch)
        with self._lock:
            refs = [actor.step.remote(shard) for actor, shard in zip(self.actors, shards)]
        version, metrics = self._gather(refs, "step")[0]
        self._version = version
        return metrics

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, C]`` log-probs of ``batch`` under the current weights, rows in order."""
        return self._rows(batch, "logprobs", rank_logprobs)

    def pair_outputs(self, batch: TrainBatch, field: str, *, adapters_off: bool = False) -> torch.Tensor:
        """A preference pair batch scored by the ranks, each its shard of the rows
        (:func:`~rltune.learner.pair_scoring.learner_pair_outputs`); the driver holds no
        model for DPO's reference or the held-out metrics."""
        return self._rows(batch, "pair_outputs", learner_pair_outputs, field, adapters_off)

    def weights_fingerprint(self) -> str:
        """Of every rank's weights (:func:`~rltune.learner.pair_scoring.group_fingerprint`)."""
        return group_fingerprint(self.run_on_ranks(learner_weights_fingerprint))

    def _rows(self, batch: TrainBatch, what: str, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        """``fn(learner, shard, *args)`` on every rank's shard of ``batch``: the rows' outputs
        in order. A batch of fewer units than data ranks is padded with copies of its first
        unit (every rank needs rows to take part), whose outputs are dropped."""
        rows, short = len(batch), self.positions[0].data_world * self.unit - len(batch)
        if short > 0:
            batch = batch.select(torch.cat([torch.arange(rows), torch.arange(self.unit).repeat(short // self.unit)]))
        shards = self._shards(batch)
        with self._lock:
            refs = [actor.run.remote(fn, shard, *args) for actor, shard in zip(self.actors, shards)]
        answers = self._gather(refs, what)  # tp/pp peers answer for the same rows
        return torch.cat([answers[i] for i in output_actors(self.positions)])[:rows]

    def export_weights(self) -> WeightsRef | BroadcastWeights:
        """A :class:`WeightsRef` to the full weights, put into Ray's object store by rank 0
        (the driver does not copy them; takes ``last_sync_s`` seconds). With
        ``runtime.weight_sync: broadcast`` nothing moves here: a :class:`BroadcastWeights`
        tells the generators to receive them from the group (:meth:`start_send`)."""
        if self.weight_sync == "broadcast":
            return BroadcastWeights(self, self._version)
        return self._put_weights()

    def _put_weights(self) -> WeightsRef:
        start = time.perf_counter()
        (refs, version), *_ = self._gather(self._submit("export_weights"), "export_weights")
        self.last_sync_s = time.perf_counter() - start
        return WeightsRef(refs[0], version)

    def _submit(self, method: str, *args: Any) -> list[ray.ObjectRef]:
        """``method`` on the ranks that hold full weights when asked for them: rank 0 with
        DDP, every rank with FSDP2 or a mesh layout (they gather them). Submitted under the group's lock, so
        that calls from two driver threads reach every rank in the same order."""
        ranks = self.actors[:1] if self.strategy == "ddp" else self.actors
        with self._lock:
            return [getattr(a, method).remote(*args) for a in ranks]

    def open_channel(self, world: int) -> tuple[str, int, ray.ObjectRef]:
        """Make rank 0 the sender of a new weight channel of ``world`` members: returns the
        address and port the receivers join and a ref to the sender's weight layout (it
        resolves once every member has joined)."""
        self._check_open()
        first = {**self.placement.options(ROLE, 0), "num_cpus": 0, "num_gpus": 0}
        addr, port = ray.get(_endpoint.options(**first).remote(), timeout=self.timeout_s)
        with self._lock:
            ref = self.actors[0].open_channel.remote(addr, port, world)
        return addr, port, ref

    def finish_open(self, ref: ray.ObjectRef) -> Any:
        """The sender's weight layout, once the channel of :meth:`open_channel` is formed."""
        return self._gather([ref], "open_channel")[0]

    def start_send(self) -> list[ray.ObjectRef]:
        """Start broadcasting the weights on the channel (the receivers must be receiving)."""
        self._check_open()
        return self._submit("send_weights")

    def finish_send(self, refs: list[ray.ObjectRef]) -> tuple[int, str | None]:
        """Wait for :meth:`start_send`: ``(version sent, error or None)``; ``last_sync_s``."""
        start = time.perf_counter()
        version, _, error = self._gather(refs, "send_weights")[0]
        self.last_sync_s = time.perf_counter() - start
        return version, error

    def fetch_weights(self) -> dict[str, torch.Tensor]:
        """The full weights as a dict on the driver (for checkpoints and exports)."""
        return self._put_weights().get(self.timeout_s)

    def step_metrics(self) -> dict[str, Metric]:
        """Nothing to report per step (a dead rank ends the run: :class:`LearnerDied`)."""
        return {}

    @property
    def writes_shards(self) -> bool:
        """Whether the ranks write checkpoints in shards (a mesh layout): then
        :meth:`checkpoint_state` needs the checkpoint's directory."""
        if getattr(self, "_writes_shards", None) is None:
            self._writes_shards = self._gather([self.actors[0].writes_shards.remote()], "writes_shards")[0]
        return self._writes_shards

    def checkpoint_state(self, prefix: str, directory: Path | str | None = None) -> tuple[dict, dict]:
        """``(tensors, meta)`` of the learner's checkpoint part, from rank 0: sharded, each
        rank writes its own file into ``directory``; otherwise the one-file format of a
        ``LocalLearner`` (FSDP2: gathered from every rank; LoRA with FSDP2 is refused)."""
        if directory is None:
            return self._gather(self._submit("checkpoint_state", prefix), "checkpoint_state")[0]
        with self._lock:
            refs = [a.checkpoint_state.remote(prefix, str(directory)) for a in self.actors]
        return self._gather(refs, "checkpoint_state")[0]

    def load_checkpoint_state(self, tensors: dict, meta: dict, path: Path | str, prefix: str) -> None:
        """Apply a checkpoint's learner part (``prefix``) on every rank: its model and
        optimizer tensors go into Ray's object store once, and every rank reads them from
        there."""
        state = ray.put({k: v for k, v in tensors.items() if k in (f"{prefix}model", f"{prefix}optimizer")})
        with self._lock:
            refs = [a.load_checkpoint_state.remote(state, meta, str(path), prefix) for a in self.actors]
        self._version = self._gather(refs, "load_checkpoint_state")[0]

    def run_on_ranks(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(learner, *args)`` on every rank's :class:`LocalLearner`, together;
        each rank's result, in rank order. ``fn`` must be picklable by Ray."""
        with self._lock:
            refs = [a.run.remote(fn, *args) for a in self.actors]
        return self._gather(refs, "run_on_ranks")

    def close(self) -> None:
        """Stop the actors (at once: a rank may be stuck in a collective)."""
        if self.closed:
            return
        self.closed = True
        for actor in self.actors:
            ray.kill(actor, no_restart=True)

    def __enter__(self) -> RayLearnerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ------------------------------------------------------------------------

    def _shards(self, batch: TrainBatch) -> list[ray.ObjectRef]:
        """Each rank's shard of ``batch`` by its data rank (tp/pp peers share one), put
        into the object store once per shard."""
        self._check_open()
        return data_shards(batch, self.positions, self.unit)

    def _gather(self, refs: list[ray.ObjectRef], what: str) -> list[Any]:
        """The results of ``refs`` (ref ``i`` from rank ``i``), taken as they finish so that
        a dead rank is reported as soon as Ray knows, not after its peers time out. Any
        failure closes the group: its other ranks may wait forever in a collective."""
        self._check_open()
        results: list[Any] = [None] * len(refs)
        pending = {ref: rank for rank, ref in enumerate(refs)}
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
            if not ready:
                self.close()
                raise LearnerDied(
                    f"learner rank(s) {sorted(pending.values())} of {self.world} did not finish {what} "
                    f"within {self.timeout_s} s; the learner group is closed"
                )
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except RayActorError as err:
                    self.close()
                    raise LearnerDied(
                        f"learner rank {rank} of {self.world} died during {what}; the learner group "
                        f"is closed: {death_reason(err)}"
                    ) from err
                except Exception:
                    self.close()
                    raise
        return results

    def _check_open(self) -> None:
        if self.closed:
            raise LearnerDied("the learner group is closed (a rank died or failed); build a new one")


__all__ = ["ROLE", "LearnerActor", "LearnerDied", "RayLearnerGroup", "WeightsRef"]
