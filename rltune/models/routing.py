"""Routing of mixture-of-experts models: replaying the generator's expert choices in the
learner, measuring how often the learner's router agrees with them, and auxiliary-loss-free
load balancing.

**Why replay.** The generator and the learner compute the same router in different
numerics (a KV-cached decode step against one full-sequence forward, other kernels, other
precision), and after a weight update the learner's router is not the one that sampled.
A small difference in the router logits flips a top-k choice, the token's hidden state
then goes through other experts, and the log-prob ratio of a sample to itself is no longer
near 1: the policy gradient is taken through experts that never produced the sample. With
``model.moe.routing_replay: rollout`` (the R3 method, "rollout routing replay") the
generator records, per token and MoE layer, the top-k experts it used; the learner's
forwards (the training one and the no-grad old-log-prob one) send each token to those
experts. The router still computes its probabilities, and the routing weights are the
probabilities at the replayed experts (renormalised as the model does), so the router and
the replayed experts' weights get their gradients.

**Routers.** The ``gate`` of a transformers 5 sparse-MoE block: ``Qwen2MoeTopKRouter``,
``Qwen3MoeTopKRouter`` (softmax, renormalised over the top k when the config's
``norm_topk_prob``; weights cast to the logits' dtype) and ``MixtralTopKRouter`` (softmax,
always renormalised, weights kept in float32). Each is called on the ``N = B * T`` tokens
of a forward flattened row-major and returns ``(logits [N, E], weights [N, k], experts
[N, k])``. :func:`install_routing` replaces each router's ``forward`` on the instance (the
class, weights and state-dict keys stay) by one that computes exactly what the original
does, then lets the forward's :class:`RoutingPass` choose: record, replay, compare, count.

**Routes.** ``[B, T, L, k]`` ``int16`` (``L`` MoE layers in module order), aligned with
``input_ids``; :data:`NO_ROUTE` (-1) where nothing was recorded (padding, and a
completion's last token, which the generator never feeds back). A token without a route
is routed by the learner's own router.

**Agreement.** ``moe/router_agreement``: over the attended completion tokens that have a
recorded route and every MoE layer, the share of (token, layer) pairs whose recorded top-k
*set* (order ignored) equals the top-k the learner's router picks itself in that forward
(with the aux-free bias when it is on). Logged by the training forward whenever the batch
carries routes, with or without replay; 1.0 means the learner would have routed every
token as the generator did.

**Aux-free balancing** (DeepSeek-V3, Wang et al. 2024): with ``model.moe.aux_free_bias``
``> 0`` every router holds a persistent buffer ``routing_bias [E]`` (float32, in the state
dict, so checkpoints and the generators' weight copies carry it) added to the
probabilities for the top-k *selection* only; the weights stay the plain probabilities.
After each optimizer step :func:`update_routing_bias` moves each expert's bias by
``rate * sign(mean load - load)`` from the step's actual routing counts.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rltune.metrics import keys
from rltune.metrics.types import Histogram, Mean, Metric

ROUTE_DTYPE = torch.int16
"""The dtype routes travel in (expert indices up to 32767; -1 for none)."""
NO_ROUTE = -1
"""A route entry for a token the generator did not route (padding, a last token)."""
BIAS_BUFFER = "routing_bias"


class RoutingError(ValueError):
    """Routing replay or aux-free balancing asked of a model or batch that cannot take it."""


@dataclass(frozen=True)
class _Kind:
    """How a router class turns probabilities into weights."""

    always_normalise: bool
    """Renormalise the top-k weights to sum 1 whatever the config (Mixtral)."""
    cast: bool
    """Cast the weights to the logits' dtype (Qwen) rather than keep float32 (Mixtral)."""


ROUTER_CLASSES: dict[str, _Kind] = {
    "Qwen2MoeTopKRouter": _Kind(always_normalise=False, cast=True),
    "Qwen3MoeTopKRouter": _Kind(always_normalise=False, cast=True),
    "MixtralTopKRouter": _Kind(always_normalise=True, cast=False),
}
"""The router classes (transformers 5) this module installs on, by class name."""


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The supported routers of ``model`` in module order (= layer order)."""
    return [m for m in model.modules() if _class_name(m) in ROUTER_CLASSES]


def installed_routers(model: nn.Module) -> list[nn.Module]:
    """The routers :func:`install_routing` patched, in layer order (none if not installed)."""
    cached = model.__dict__.get("_rltune_routers")
    if cached is not None:
        return cached
    return [m for m in model.modules() if "_rltune_layer" in m.__dict__]


def _class_name(module: nn.Module) -> str:
    """The router class a module is, seen through FSDP2's dynamic subclass."""
    for cls in type(module).__mro__:
        if cls.__name__ in ROUTER_CLASSES:
            return cls.__name__
    return type(module).__name__


def install_routing(model: nn.Module, *, replay: bool = False, aux_free_bias: float = 0.0) -> int:
    """Patch ``model``'s routers so forwards can record, replay and compare routes, and
    (``aux_free_bias > 0``) select with a per-expert bias buffer; returns how many routers.

    Idempotent in effect: calling it again updates the settings, and a bias already
    installed keeps its values. Install before the model is wrapped for parallelism and
    before a checkpoint is loaded into it (the bias is part of its state). A model with no
    supported router is left alone, unless replay or a bias was asked for: then that is a
    :class:`RoutingError` naming what the model has instead."""
    if aux_free_bias < 0:
        raise RoutingError(f"model.moe.aux_free_bias must be >= 0, got {aux_free_bias}")
    routers = find_routers(model)
    if not routers:
        if replay or aux_free_bias > 0:
            raise RoutingError(_no_router_message(model, replay, aux_free_bias))
        return 0
    for layer, gate in enumerate(routers):
        gate.__dict__["_rltune_layer"] = layer
        gate.__dict__["_rltune_kind"] = ROUTER_CLASSES[_class_name(gate)]
        gate.__dict__["_rltune_replay"] = replay
        gate.__dict__["_rltune_rate"] = float(aux_free_bias)
        if aux_free_bias > 0 and BIAS_BUFFER not in gate._buffers:
            gate.register_buffer(BIAS_BUFFER, torch.zeros(gate.num_experts, device=gate.weight.device))
        gate.forward = types.MethodType(_route, gate)
    model.__dict__["_rltune_routers"] = routers
    return len(routers)


def restore_routing_bias(model: nn.Module, directory: str | Path, names: list[str]) -> list[str]:
    """Read back a saved aux-free routing bias: of the state-dict ``names`` transformers
    did not place (its unexpected keys, from ``directory``), those that are a supported
    router's ``routing_bias`` become that router's bias buffer, the routers installed
    (:func:`install_routing`) with rate 0, so the model selects experts as the model that
    was saved did; returns the names restored. A later :func:`install_routing` keeps the
    values and sets the rate. An exported MoE model keeps its bias this way (transformers'
    router classes have no such buffer and drop it)."""
    routers = {name: m for name, m in model.named_modules() if _class_name(m) in ROUTER_CLASSES}
    wanted = {n: n.removesuffix(f".{BIAS_BUFFER}") for n in names if n.endswith(f".{BIAS_BUFFER}")}
    wanted = {n: owner for n, owner in wanted.items() if owner in routers}
    if not wanted:
        return []
    from rltune.models.safetensors_io import open_tensors

    values: dict[str, torch.Tensor] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with open_tensors(path, error=RoutingError) as f:
            values.update({n: f.get_tensor(n) for n in wanted if n in f.keys()})
    install_routing(model)
    for name, owner in wanted.items():
        gate, value = routers[owner], values.get(name)
        if value is None or value.shape != (gate.num_experts,):
            raise RoutingError(
                f"{directory}: {name} should be a [{gate.num_experts}] tensor (one bias per "
                f"expert), got {None if value is None else list(value.shape)}"
            )
        if BIAS_BUFFER in gate._buffers:
            gate._buffers[BIAS_BUFFER].copy_(value)
        else:
            gate.register_buffer(BIAS_BUFFER, value.to(gate.weight.device, torch.float32))
    return sorted(wanted)


def _no_router_message(model: nn.Module, replay: bool, bias: float) -> str:
    asked = " and ".join(
        s for s, on in (("model.moe.routing_replay: rollout", replay), (f"model.moe.aux_free_bias: {bias}", bias > 0))
        if on
    )
    gates = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith(".gate")})
    found = f"its routers are {gates}" if gates else "it has no expert router (a dense model)"
    return (f"{asked} needs a mixture-of-experts model with one of the routers "
            f"{sorted(ROUTER_CLASSES)}; {type(model).__name__}: {found}. Turn the option off "
            f"for this model")


def _route(gate: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's forward: the original arithmetic, then the active pass's choice."""
    kind: _Kind = gate.__dict__["_rltune_kind"]
    hidden = hidden_states.reshape(-1, gate.hidden_dim)
    logits = F.linear(hidden, gate.weight)  # [N, E]
    probs = torch.softmax(logits.float(), dim=-1)
    bias = gate._buffers.get(BIAS_BUFFER)
    scores = probs if bias is None else probs + bias
    own = torch.topk(scores, gate.top_k, dim=-1).indices  # [N, k]
    active: RoutingPass | None = gate.__dict__.get("_rltune_pass")
    chosen = own if active is None else active.route(gate, own)
    weights = probs.gather(-1, chosen)
    if kind.always_normalise or gate.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if kind.cast:
        weights = weights.to(logits.dtype)
    return logits, weights, chosen


@dataclass
class RoutingPass:
    """What one forward (or one generation) does with the routes of its routers.

    ``routes`` ``[B, T, L, k]`` (or None): the recorded routes of this forward's tokens;
    each layer replays them where ``replay`` (the model was installed with replay) and a
    token has one. ``compare`` ``[B*T]`` bool: the tokens counted in the agreement.
    ``attended`` ``[B*T]`` bool: the tokens counted in ``load``. ``recorded``: per layer,
    the experts chosen in each forward (generation)."""

    rows: int | None = None
    routes: torch.Tensor | None = None
    compare: torch.Tensor | None = None
    attended: torch.Tensor | None = None
    load: torch.Tensor | None = None
    recorded: list[list[torch.Tensor]] | None = None
    matches: torch.Tensor | None = None
    compared: torch.Tensor | None = None

    def route(self, gate: nn.Module, own: torch.Tensor) -> torch.Tensor:
        """The experts ``gate``'s tokens go to, given its own top-k ``own`` ``[N, k]``."""
        layer = gate.__dict__["_rltune_layer"]
        if self.rows is not None and own.shape[0] != self.rows:
            raise RoutingError(
                f"router of MoE layer {layer} ({type(gate).__name__}) saw {own.shape[0]} tokens, "
                f"but the routes given are for {self.rows} (B x T); routes can be replayed only on "
                f"a forward whose router sees the whole [B, T] batch (no sequence or pipeline split)"
            )
        if self.recorded is not None:
            self.recorded[layer].append(own.to(ROUTE_DTYPE))
        chosen = own
        if self.routes is not None:
            given = self.routes[:, :, layer].reshape(own.shape[0], -1).to(own.device, torch.long)
            if self.compare is not None:
                same = (own.sort(dim=-1).values == given.sort(dim=-1).values).all(dim=-1)
                self.matches = self.matches + (same & self.compare).sum()
                self.compared = self.compared + self.compare.sum()
            if gate.__dict__["_rltune_replay"]:
                chosen = torch.where(given[:, :1] >= 0, given, own)
        if self.load is not None:
            picked = chosen[self.attended].reshape(-1)
            self.load[layer] += torch.bincount(picked, minlength=self.load.shape[1]).to(self.load.dtype)
        return chosen

    @property
    def agreement(self) -> torch.Tensor | None:
        """``[2]``: (token-layer routes whose sets agree, routes compared), or None."""
        if self.matches is None:
            return None
        return torch.stack([self.matches, self.compared]).float()


@contextlib.contextmanager
def _active(routers: list[nn.Module], state: RoutingPass) -> Iterator[RoutingPass]:
    for gate in routers:
        gate.__dict__["_rltune_pass"] = state
    try:
        yield state
    finally:
        for gate in routers:
            gate.__dict__.pop("_rltune_pass", None)


@contextlib.contextmanager
def routing_pass(
    model: nn.Module, attention_mask: torch.Tensor, prompt_len: int, *,
    routes: torch.Tensor | None = None, count_load: bool = False,
) -> Iterator[RoutingPass]:
    """Around one forward of ``model`` on a ``[B, T]`` batch (``prompt_len`` prompt
    columns): replay ``routes`` ``[B, T, L, k]`` where installed with replay, count the
    router agreement on the attended completion tokens that have a route (``agreement``),
    and with ``count_load`` the ``[L, E]`` experts actually chosen by attended tokens
    (``load``). A model without installed routers gets an inert pass: nothing is replayed
    or counted (the frozen reference model routes by itself)."""
    routers = installed_routers(model)
    if not routers:
        yield RoutingPass()
        return
    attended = attention_mask.reshape(-1).bool()
    state = RoutingPass(rows=attention_mask.numel(), attended=attended)
    if count_load:
        state.load = torch.zeros(len(routers), routers[0].num_experts, device=attention_mask.device)
    if routes is not None:
        _check_routes(routes, attention_mask, routers)
        state.routes = routes
        completion = torch.zeros_like(attention_mask, dtype=torch.bool)
        completion[:, prompt_len:] = True
        have = routes[:, :, 0, 0].to(attention_mask.device) >= 0
        state.compare = (completion & attention_mask.bool() & have).reshape(-1)
        state.matches = state.compared = attention_mask.new_zeros((), dtype=torch.long)
    with _active(routers, state):
        yield state


def _check_routes(routes: torch.Tensor, attention_mask: torch.Tensor, routers: list[nn.Module]) -> None:
    want = (*attention_mask.shape, len(routers), routers[0].top_k)
    if tuple(routes.shape) != want:
        raise RoutingError(
            f"routes of shape {tuple(routes.shape)} do not fit this forward: expected {want} "
            f"([B, T] of the batch, {len(routers)} MoE layers, top-{routers[0].top_k}); were "
            f"they recorded by another model?"
        )


class RouteRecorder:
    """The routes a generation's forwards chose: a prefill over ``[R, P]`` then one-token
    steps. :meth:`routes` gives ``[R, P + steps, L, k]`` (``int16``, on the CPU)."""

    def __init__(self, rows: int, layers: int) -> None:
        self.rows = rows
        self.state = RoutingPass(recorded=[[] for _ in range(layers)])

    def routes(self) -> torch.Tensor:
        per_layer = []
        for calls in self.state.recorded or []:
            if not calls:
                raise RoutingError("no route was recorded: the model's routers were not called")
            per_layer.append(torch.cat([c.view(self.rows, -1, c.shape[-1]) for c in calls], dim=1))
        return torch.stack(per_layer, dim=2).cpu()


@contextlib.contextmanager
def recording(model: nn.Module, rows: int) -> Iterator[RouteRecorder | None]:
    """Record the experts ``model``'s routers choose over a generation of ``rows`` rows;
    None (nothing recorded) for a model without installed routers."""
    routers = installed_routers(model)
    if not routers:
        yield None
        return
    recorder = RouteRecorder(rows, len(routers))
    with _active(routers, recorder.state):
        yield recorder


def route_counts(routes: torch.Tensor, experts: int) -> torch.Tensor:
    """``[L, E]`` float counts of the recorded routes ``[..., L, k]`` (entries of
    :data:`NO_ROUTE` left out)."""
    layers = routes.shape[-2]
    flat = routes.reshape(-1, layers, routes.shape[-1]).long()
    offset = torch.arange(layers, device=flat.device).view(1, layers, 1) * experts
    valid = flat >= 0
    counts = torch.bincount((flat + offset)[valid], minlength=layers * experts)
    return counts.view(layers, experts).float()


def expert_count(model: nn.Module) -> int:
    """The number of routed experts of ``model``'s installed routers (0: none)."""
    routers = installed_routers(model)
    return int(routers[0].num_experts) if routers else 0


@torch.no_grad()
def update_routing_bias(model: nn.Module, load: torch.Tensor) -> bool:
    """Aux-free balancing after an optimizer step: each router's bias moves by ``rate *
    sign(mean load - load)`` per expert, ``load`` ``[L, E]`` the step's routing counts (the
    group's, so every rank moves alike). False when no router holds a bias."""
    moved = False
    for gate in installed_routers(model):
        bias = gate._buffers.get(BIAS_BUFFER)
        if bias is None:
            continue
        row = load[gate.__dict__["_rltune_layer"]].to(bias.device, torch.float32)
        bias += gate.__dict__["_rltune_rate"] * torch.sign(row.mean() - row)
        moved = True
    return moved


def expert_load_metrics(
    load: torch.Tensor, *, per_expert_up_to: int = 16, key: Callable[[str], str] = lambda k: k,
) -> dict[str, Metric]:
    """How evenly an MoE model's routing spread over its experts.

    ``load`` ``[L, E]``: routing choices per layer and expert. Each expert's share of its
    layer's choices is scaled by ``E``, so 1.0 is a perfectly even load: ``moe/load_max``
    (the busiest expert of any layer), ``moe/load_min`` (the idlest), ``moe/load/eI``
    (expert I averaged over layers, for models with at most ``per_expert_up_to`` experts)
    and the histogram ``moe/expert_load`` of every layer's experts; each name passed
    through ``key`` (:func:`rltune.metrics.keys.generation_key` for the generator's)."""
    layers, experts = load.shape
    share = load / load.sum(-1, keepdim=True).clamp(min=1) * experts  # [L, E]
    metrics: dict[str, Metric] = {
        key(keys.MOE_LOAD_MAX): Mean(float(share.max())),
        key(keys.MOE_LOAD_MIN): Mean(float(share.min())),
        key(keys.MOE_EXPERT_LOAD): Histogram(share.reshape(-1)),
    }
    if experts <= per_expert_up_to:
        metrics.update({key(keys.moe_expert_load_key(i)): Mean(float(v)) for i, v in enumerate(share.mean(0))})
    return metrics


def agreement_metrics(agreement: torch.Tensor | None) -> dict[str, Metric]:
    """``moe/router_agreement`` from ``[2]`` counts (agreeing, compared), weighted by the
    routes compared so that micro-batches and ranks combine into one share; nothing when
    no route was compared (None)."""
    if agreement is None:
        return {}
    matches, compared = agreement[0], agreement[1]
    return {keys.MOE_ROUTER_AGREEMENT: Mean(matches / compared.clamp(min=1), weight=compared)}


__all__ = [
    "BIAS_BUFFER", "NO_ROUTE", "ROUTER_CLASSES", "ROUTE_DTYPE", "RouteRecorder", "RoutingError",
    "RoutingPass", "agreement_metrics", "expert_count", "expert_load_metrics", "find_routers",
    "install_routing", "installed_routers", "recording", "restore_routing_bias", "route_counts", "routing_pass",
    "update_routing_bias",
]
