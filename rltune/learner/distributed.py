"""A learner group: N torch.distributed processes training one model as one process would.

Every process (rank) holds a :class:`DistributedLearner` and receives its own shard of
each global batch (:func:`shard_batch`: contiguous blocks of rows). The group's update
is the one a :class:`~rltune.learner.learner.LocalLearner` makes on the whole batch,
up to the order in which fp32 gradients are summed:

* **the whole-batch denominator is the group's**: every rank all-reduces its shard's
  ``objective.denominator`` before its micro-batch loop, so each token (or sequence, or
  pair) is normalised by the same count as in one process. Every rltune objective's
  denominator is a count over rows, so the sum over shards is the whole batch's.
* **gradients are summed over ranks**: DDP and FSDP2 both *average* gradients over the
  ``W`` ranks, so each rank's losses are divided by ``denominator / W`` instead of by
  ``denominator`` (``W`` times its share of the global loss); the average is then the
  sum, which is the single-process gradient.
* **one gradient exchange per step**: all but the synchronising micro-batch run without
  gradient synchronisation (DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync(False)``)
  and only accumulate locally.
* **the clip uses the global norm**: with DDP every rank holds the same summed gradient;
  with FSDP2 ``clip_grad_norm_`` on the sharded (DTensor) gradients all-reduces the norm.
  Every rank therefore sees the same norm and takes (or skips) the same step.
* **metrics are the group's**: each rank's step metrics are combined with
  :func:`rltune.metrics.types.all_reduce`, and every rank returns the same values.

``strategy="ddp"`` replicates the model (``DistributedDataParallel``); ``"fsdp2"`` shards
parameters, gradients and optimizer state over the ranks (``fully_shard``, each
transformer block and then the root). Both run on CPU with gloo and on GPUs with NCCL.

Processes join the group through :func:`init_group` (the standard ``torchrun``
environment), or :func:`spawn_learner_group` starts a group on this machine without any
launcher.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing
from torch.distributed.device_mesh import init_device_mesh
from torch.multiprocessing.spawn import ProcessException
from torch.nn.parallel import DistributedDataParallel

try:  # FSDP2's public API (torch >= 2.6)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch: DDP only
    fully_shard = None
    DTensor = ()

from rltune.config.schema import TrainConfig
from rltune.data.records import TrainBatch
from rltune.learner.learner import LocalLearner, expert_load_metrics
from rltune.learner.microbatch import split_by_tokens
from rltune.learner.objectives import Objective
from rltune.metrics.types import Metric, all_reduce
from rltune.models.load import is_moe

Strategy = Literal["ddp", "fsdp2"]
STRATEGIES: tuple[str, ...] = ("ddp", "fsdp2")
GROUP_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
"""The environment variables :func:`init_group` reads (``torchrun`` sets them)."""


# ----------------------------------------------------------------------------- the group


def default_backend() -> str:
    """``"cpu:gloo,cuda:nccl"`` when CUDA is available, else ``"gloo"``.

    On GPUs the model's collectives run on NCCL; CPU tensors (the step metrics that
    :func:`rltune.metrics.types.all_reduce` combines in float64) go through gloo, which a
    plain ``"nccl"`` group could not carry."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_group(backend: str | None = None, *, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the process group described by ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and
    ``WORLD_SIZE``; returns ``(rank, world_size)``.

    ``backend`` None means :func:`default_backend`. A backend with NCCL binds this
    process to the GPU ``LOCAL_RANK`` names (the index among the processes of this
    machine), so no device index is ever fixed in code. ``timeout_s`` bounds how long a
    collective waits for the other ranks."""
    if dist.is_initialized():
        raise RuntimeError("init_group: this process already belongs to a process group; "
                           "call destroy_group() first")
    missing = [name for name in GROUP_ENV if not os.environ.get(name)]
    if missing:
        raise RuntimeError(
            f"init_group: environment variable(s) {', '.join(missing)} not set; start the "
            "processes with torchrun (or rltune.learner.distributed.spawn_learner_group), "
            f"which sets {', '.join(GROUP_ENV)}"
        )
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if not 0 <= rank < world:
        raise RuntimeError(f"init_group: RANK={rank} is not in [0, WORLD_SIZE={world})")
    backend = backend or default_backend()
    device_id = None
    if "nccl" in backend:
        if not torch.cuda.is_available():
            raise RuntimeError(f"init_group: backend {backend!r} needs CUDA, which is not available; "
                               "use backend='gloo' on CPU")
        if not os.environ.get("LOCAL_RANK"):
            raise RuntimeError("init_group: the NCCL backend needs LOCAL_RANK (this process's GPU "
                               "index on its machine); torchrun sets it")
        device_id = torch.device("cuda", _env_int("LOCAL_RANK"))
        torch.cuda.set_device(device_id)
    dist.init_process_group(
        backend, init_method="env://", rank=rank, world_size=world,
        timeout=timedelta(seconds=timeout_s), device_id=device_id,
    )
    return rank, world


def destroy_group() -> None:
    """Leave the process group, if this process is in one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def group_device() -> torch.device:
    """Where this rank computes: ``cuda:LOCAL_RANK`` when the group has an NCCL backend,
    else the CPU."""
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", _env_int("LOCAL_RANK"))
    return torch.device("cpu")


def _env_int(name: str) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={value!r} is not an integer") from None


# ----------------------------------------------------------------------------- sharding


def shard_bounds(rows: int, rank: int, world: int, *, unit: int = 1) -> tuple[int, int]:
    """``(start, stop)``: the contiguous rows of a ``rows``-row batch that ``rank`` of
    ``world`` trains on.

    The batch is cut into ``rows / unit`` units (``unit`` consecutive rows that must stay
    together, 2 for chosen/rejected pairs), dealt out in contiguous blocks whose sizes
    differ by at most one unit, the larger blocks first. Contiguous blocks also keep a
    prompt's group of samples together."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"shard_bounds: rank={rank} is not in [0, world={world})")
    if unit < 1 or rows % unit:
        raise ValueError(f"shard_bounds: {rows} rows do not split into units of {unit}")
    units = rows // unit
    if units < world:
        raise ValueError(
            f"shard_bounds: {rows} rows ({units} units of {unit}) cannot give each of "
            f"{world} ranks at least one unit; use a batch of at least {world * unit} rows"
        )
    base, extra = divmod(units, world)
    start = rank * base + min(rank, extra)
    stop = start + base + (rank < extra)
    return start * unit, stop * unit


def shard_batch(batch: TrainBatch, rank: int, world: int, *, unit: int = 1) -> TrainBatch:
    """``rank``'s shard of the global ``batch`` (rows :func:`shard_bounds`; views, the
    batch is not modified). Pass the objective's ``unit``."""
    start, stop = shard_bounds(len(batch), rank, world, unit=unit)
    return batch.select(slice(start, stop))


# ----------------------------------------------------------------------------- the learner


@dataclass
class _StepState:
    """Bookkeeping of one train step on this rank."""

    batch: TrainBatch
    micro_batches: int  # this rank's
    sync_at: int  # index of the micro-batch whose backward exchanges gradients
    forwards: int  # the group's largest micro-batch count (FSDP2 pads up to it)
    calls: int = 0
    load: torch.Tensor | None = None


# The model's only buffers are constants (rotary frequencies): DDP need not broadcast them
# before every forward (newer torch calls the keyword ``forward_sync_buffers``).
_NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


class _GroupDDP(DistributedDataParallel):
    """DDP that shows the wrapped model's ``config``: the forward helpers read it (MoE
    routing, expert count)."""

    @property
    def config(self) -> Any:
        return self.module.config


class DistributedLearner(LocalLearner):
    """One rank's learner in a group that trains one model with DDP or FSDP2.

    Every rank calls every method together, each with its own shard of the global batch
    (:func:`shard_batch`); ``step`` returns the group's metrics, the same on every rank.
    ``model`` stays the plain module (FSDP2 shards it in place); with DDP the training
    forward runs through the DDP wrapper. ``objective`` is the group-aware objective
    (its denominator is :meth:`global_denominator`); ``local_objective`` the one given.

    The model must start with the same weights on every rank (loaded from the same
    directory); DDP and FSDP2 both broadcast rank 0's weights at construction anyway.
    Each rank needs at least one unit of rows in every ``step``, ``logprobs`` and
    ``values`` call.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        objective: Objective,
        cfg: TrainConfig,
        *,
        strategy: Strategy = "ddp",
        temperature: float = 1.0,
        aux_loss_coef: float = 0.0,
        updates_per_step: int = 1,
        device: torch.device | None = None,
    ) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"DistributedLearner: strategy={strategy!r}; expected one of {list(STRATEGIES)}")
        if not dist.is_initialized():
            raise RuntimeError("DistributedLearner needs a process group: call init_group() in every "
                               "process first (torchrun or spawn_learner_group starts the processes)")
        self.strategy = strategy
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = device if device is not None else group_device()
        self.local_objective = objective
        self._step_state: _StepState | None = None
        self._shared_names: tuple[str, ...] = ()
        model = model.to(self.device)
        self._ddp: _GroupDDP | None = None
        if strategy == "ddp":
            self._ddp = _GroupDDP(
                model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                # an MoE micro-batch leaves the experts it did not route to without gradient
                find_unused_parameters=_is_moe(model),
                **_NO_BUFFER_SYNC,
            )
        else:
            if fully_shard is None:
                raise RuntimeError(f"DistributedLearner: strategy 'fsdp2' needs torch >= 2.6 "
                                   f"(torch.distributed.fsdp.fully_shard); this is torch {torch.__version__}")
            _broadcast_weights(model)
            shard_model(model, init_device_mesh(self.device.type, (self.world,)))
        group_objective = replace(objective, count=self.global_denominator, forward=self._forward)
        super().__init__(
            model, group_objective, cfg,
            temperature=temperature, aux_loss_coef=aux_loss_coef, updates_per_step=updates_per_step,
        )

    # -- the step ---------------------------------------------------------------------

    def step(self, batch: TrainBatch) -> dict[str, Metric]:
        """One optimizer step of the group on this rank's shard ``batch``; returns the
        group's metrics (identical on every rank)."""
        batch = to_device(batch, self.device)
        state = self._plan_step(batch)
        if self._ddp is not None:
            self._ddp.train()
        self._step_state = state
        try:
            metrics = super().step(batch)
        finally:
            self._step_state = None
            if self._ddp is None:
                self.model.set_requires_gradient_sync(True)
        return self._group_metrics(metrics, state)

    def global_denominator(self, batch: TrainBatch) -> torch.Tensor:
        """What this rank's micro-batch losses divide by: the group's whole-batch
        denominator (the sum of every rank's ``local_objective.denominator``) over the
        world size, so that the average DDP/FSDP2 take of the ranks' gradients is their
        sum. A collective: every rank calls it once per step."""
        local = self.local_objective.denominator(batch)
        total = local.detach().to(device=self.device, dtype=torch.float64)
        dist.all_reduce(total)
        return (total / self.world).to(device=local.device, dtype=local.dtype)

    def _plan_step(self, batch: TrainBatch) -> _StepState:
        """This rank's micro-batch count, checked against the group's: every rank needs
        rows, and which micro-batch synchronises gradients."""
        unit = self.local_objective.unit
        count = len(split_by_tokens(batch, self.cfg.micro_batch_tokens, unit=unit)) if len(batch) else 0
        rows, counts = _gather_ints([len(batch), count], self.device)
        if min(rows) == 0:
            raise ValueError(
                f"DistributedLearner.step: rank(s) {[r for r, n in enumerate(rows) if n == 0]} received no "
                f"rows (rows per rank: {rows}); every rank needs at least {unit} row(s): shard a global "
                f"batch of at least {self.world * unit} rows with shard_batch"
            )
        # DDP exchanges gradients in the backward of each rank's own last micro-batch and
        # communicates nowhere else; FSDP2 also gathers parameters in every forward, so all
        # ranks run as many forwards as the rank with the most micro-batches
        forwards = count if self._ddp is not None else max(counts)
        sync_at = forwards - 1
        return _StepState(batch=batch, micro_batches=count, sync_at=sync_at, forwards=forwards)

    def _forward(self, model: torch.nn.Module, mb: TrainBatch, **kwargs: Any) -> Any:
        """The objective's forward; during a step, the training forward of micro-batch
        number ``calls``, with gradient synchronisation only on the synchronising one."""
        state = self._step_state
        if state is None:  # a no-grad prediction (``values``)
            return self.local_objective.forward(model, mb, **kwargs)
        index = state.calls
        state.calls += 1
        out = self._train_forward(mb, sync=index == state.sync_at, **kwargs)
        load = getattr(out, "expert_load", None)
        if load is not None:
            state.load = load.detach() if state.load is None else state.load + load.detach()
        return out

    def _train_forward(self, mb: TrainBatch, *, sync: bool, **kwargs: Any) -> Any:
        if self._ddp is not None:
            # DDP decides in its forward whether the following backward all-reduces
            with contextlib.nullcontext() if sync else self._ddp.no_sync():
                return self.local_objective.forward(self._ddp, mb, **kwargs)
        self.model.set_requires_gradient_sync(sync)
        return self.local_objective.forward(self.model, mb, **kwargs)

    def _apply_gradients(self) -> dict[str, Metric]:
        """Pad FSDP2's forwards up to the group's count, check that every micro-batch
        went through :meth:`_forward`, then clip (global norm) and step."""
        state = self._step_state
        if state is not None:
            if state.calls != state.micro_batches:
                raise RuntimeError(
                    f"DistributedLearner: the step ran {state.calls} micro-batch forwards through the "
                    f"objective, {state.micro_batches} were planned; gradients would not be synchronised"
                )
            self._pad_forwards(state)
        shared = super()._apply_gradients()
        self._shared_names = tuple(shared)
        return shared

    def _pad_forwards(self, state: _StepState) -> None:
        """FSDP2 only: forwards and zero backwards on one row until this rank has run as
        many forwards as the group's busiest rank; they add nothing to the gradient."""
        rows = state.batch.select(slice(0, self.local_objective.unit)).trim()
        for index in range(state.micro_batches, state.forwards):
            with self._autocast():
                out = self._train_forward(rows, sync=index == state.sync_at,
                                          temperature=self.temperature, router_logits=self.moe)
            outputs = [t for t in vars(out).values() if isinstance(t, torch.Tensor) and t.requires_grad]
            if outputs:
                torch.autograd.backward(outputs, [torch.zeros_like(t) for t in outputs])

    def _group_metrics(self, metrics: dict[str, Metric], state: _StepState) -> dict[str, Metric]:
        """Combine the ranks' step metrics. What the optimizer step reports (gradient
        norm, lr, skipped, counters) is already the same on every rank and kept; the MoE
        expert load is recomputed from the group's summed routing counts."""
        shared = {name: metrics.pop(name) for name in self._shared_names if name in metrics}
        if state.load is not None:
            metrics = {k: m for k, m in metrics.items() if not k.startswith("moe/")}
        combined = all_reduce(metrics)
        combined.update(shared)
        if state.load is not None:
            load = state.load.to(self.device)
            dist.all_reduce(load)
            combined.update(expert_load_metrics(load.cpu()))
        return combined

    # -- predictions and weights ---------------------------------------------------------

    def predict(self, batch: TrainBatch, forward, field: str) -> torch.Tensor:
        """``LocalLearner.predict`` on this rank's rows. With FSDP2 every forward gathers
        parameters, so the rows go in chunks within the token budget, one forward each,
        and a rank with fewer chunks than another runs extra forwards on one row (results
        dropped) until the counts match."""
        batch = to_device(batch, self.device)
        if self._ddp is not None:
            return super().predict(batch, forward, field)
        per_chunk = max(1, self.cfg.micro_batch_tokens // batch.input_ids.shape[1])
        chunks = [slice(i, i + per_chunk) for i in range(0, len(batch), per_chunk)]
        rows, counts = _gather_ints([len(batch), len(chunks)], self.device)
        if min(rows) == 0:
            raise ValueError(f"DistributedLearner.predict: rows per rank {rows}; every rank needs at least one row")
        local_predict = super().predict  # each chunk fits the budget: one forward
        parts = [local_predict(batch.select(chunk), forward, field) for chunk in chunks]
        first = batch.select(slice(0, 1))
        with torch.no_grad():
            for _ in range(max(counts) - len(chunks)):
                with self._autocast():
                    forward(self.model, first, temperature=self.temperature, router_logits=False)
        return torch.cat(parts)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The full, unsharded weights, on every rank (FSDP2 gathers each sharded
        tensor: a collective, so every rank calls it)."""
        weights = {}
        for name, value in self.model.state_dict().items():
            weights[name] = (value.full_tensor() if isinstance(value, DTensor) else value).detach()
        return weights


def shard_model(model: torch.nn.Module, mesh: Any = None) -> None:
    """FSDP2 in place: each transformer block (the classes a Hugging Face model lists in
    ``_no_split_modules``) is one sharded unit, then the root holds the rest (embeddings,
    final norm, head, tied weights together)."""
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules of ``model`` whose class a Hugging Face model inside it names in
    ``_no_split_modules``; empty for a model without that attribute."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]


def to_device(batch: TrainBatch, device: torch.device) -> TrainBatch:
    """``batch`` with every tensor on ``device`` (itself when they already are)."""
    if batch.input_ids.device == device:
        return batch
    moved = {f.name: getattr(batch, f.name).to(device) for f in fields(batch)
             if isinstance(getattr(batch, f.name), torch.Tensor)}
    return replace(batch, **moved)


def _is_moe(model: torch.nn.Module) -> bool:
    return hasattr(model, "config") and is_moe(model)


@torch.no_grad()
def _broadcast_weights(model: torch.nn.Module) -> None:
    """Every rank takes rank 0's parameters and buffers (FSDP2 shards each rank's own
    copy, so they must agree before sharding)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)


def _gather_ints(values: list[int], device: torch.device) -> list[list[int]]:
    """``values`` of every rank, transposed: one list per position, indexed by rank."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [list(column) for column in zip(*(t.tolist() for t in every))]


# ----------------------------------------------------------------------------- launcher


def spawn_learner_group(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str | None = None,
    timeout_s: float = 300.0,
) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` fresh processes forming one process group on
    127.0.0.1 (no launcher, no Ray); returns each rank's return value, in rank order.

    Each process gets ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` and
    ``LOCAL_RANK`` and joins with :func:`init_group` (``backend`` None: its default)
    before ``fn`` runs, and leaves after. ``fn`` must be importable by name (a module's
    top-level function), its arguments picklable and its return value made of tensors,
    numbers, strings and lists/tuples/dicts of them (read back with
    ``torch.load(weights_only=True)``: no pickle of arbitrary objects). A rank that
    raises fails the whole group: the others are stopped and a ``RuntimeError`` shows
    the tracebacks, the first rank to fail first (the others usually fail because of
    it). A group still running after ``timeout_s`` seconds is stopped with a
    ``TimeoutError``."""
    if world_size < 1:
        raise ValueError(f"spawn_learner_group: world_size={world_size} must be >= 1")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="rltune-group-") as out_dir:
        context = torch.multiprocessing.start_processes(
            _group_worker, args=(world_size, port, backend, out_dir, fn, args),
            nprocs=world_size, join=False, start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    _stop(context.processes)
                    raise TimeoutError(f"spawn_learner_group: {fn.__name__} on {world_size} ranks still ran "
                                       f"after {timeout_s} s; stopped")
        except ProcessException as err:
            _stop(context.processes)
            raise RuntimeError(_failure_report(Path(out_dir), fn, err)) from None
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=True) for r in range(world_size)]


def _group_worker(rank: int, world: int, port: int, backend: str | None, out_dir: str,
                  fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    loopback = _loopback_interface()
    if loopback is not None:  # gloo's connections between the ranks, too, stay on this machine
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    try:
        init_group(backend)
        result = fn(*args)
    except BaseException:
        # written before this rank leaves the group, so before the others notice
        (Path(out_dir) / f"rank{rank}.error").write_text(f"{time.time()}\n{traceback.format_exc()}")
        raise
    finally:
        destroy_group()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def _failure_report(out_dir: Path, fn: Callable[..., Any], err: ProcessException) -> str:
    """The failed ranks' tracebacks, earliest failure first."""
    failures = []
    for path in out_dir.glob("rank*.error"):
        written, _, trace = path.read_text().partition("\n")
        failures.append((float(written), int(path.stem.removeprefix("rank")), trace))
    if not failures:  # killed without a Python exception (a signal, a crash in C++)
        return f"spawn_learner_group: {fn.__name__} failed: {err}"
    failures.sort()
    parts = [f"rank {rank}:\n{trace}" for _, rank, trace in failures]
    return (f"spawn_learner_group: {fn.__name__} failed on rank(s) {[r for _, r, _ in failures]}, "
            f"rank {failures[0][1]} first\n\n" + "\n".join(parts))


def _stop(processes: list[Any]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
        process.join()


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


__all__ = [
    "STRATEGIES",
    "DistributedLearner",
    "default_backend",
    "destroy_group",
    "group_device",
    "init_group",
    "shard_batch",
    "shard_bounds",
    "shard_model",
    "spawn_learner_group",
    "to_device",
    "transformer_blocks",
]
