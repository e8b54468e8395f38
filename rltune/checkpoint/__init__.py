"""Atomic checkpoints (safetensors + JSON) and exact resume of the whole training state."""

from rltune.checkpoint.state import (
    optimizer_from_state,
    optimizer_to_state,
    rng_from_state,
    rng_to_state,
    scheduler_from_state,
    scheduler_to_state,
)
from rltune.checkpoint.store import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

__all__ = [
    "CheckpointError",
    "latest_checkpoint",
    "load_checkpoint",
    "optimizer_from_state",
    "optimizer_to_state",
    "rng_from_state",
    "rng_to_state",
    "save_checkpoint",
    "scheduler_from_state",
    "scheduler_to_state",
]
