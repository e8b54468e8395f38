"""What one reward call is given: its own copies of the sample's mutable data.

A reward gets the prompt, the completion and ``meta`` (the row's fields, an episode's
turns, the config's kwargs). Those are the dataset's and the run's own objects, kept
across the samples of a group and across epochs, so each call gets copies of the mutable
ones: a reward that changes a list in ``meta`` (``tests.pop()``), the prompt's ``meta`` or
``messages``, or a config kwarg changes only what that call sees. Every pool then scores
alike (a worker process is sent copies anyway), and the cache, keyed on the sample before
the call, stays true.

What cannot change is shared, not copied: strings, numbers, bytes, tuples of those, a
prompt's images (frozen, their bytes immutable). The tensors of ``prompt.vision`` are
shared too (copying pixel tensors per call would cost more than most rewards do; rewards
must not change them in place).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from rltune.data.records import Prompt

_IMMUTABLE = frozenset({str, int, float, bool, type(None), bytes, complex})
"""Types whose values are shared as they are (exact types: a subclass may add state)."""


def own_copy(value: Any, memo: dict[int, Any]) -> Any:
    """A deep copy of ``value`` that shares immutable values. Lists and dicts (the usual
    contents of a dataset row) are copied here, fast; anything else by ``copy.deepcopy``.
    ``memo`` is shared by one call's copies, so an object met twice is copied once."""
    cls = type(value)
    if cls in _IMMUTABLE:
        return value
    done = memo.get(id(value))
    if done is not None:
        return done
    if cls is list:
        out: Any = []
        memo[id(value)] = out
        out.extend(v if type(v) in _IMMUTABLE else own_copy(v, memo) for v in value)
        return out
    if cls is dict:
        out = {}
        memo[id(value)] = out
        for key, v in value.items():
            out[key] = v if type(v) in _IMMUTABLE else own_copy(v, memo)
        return out
    if cls is tuple and all(type(v) in _IMMUTABLE for v in value):
        return value
    return copy.deepcopy(value, memo)


def own_prompt(prompt: Prompt, memo: dict[int, Any]) -> Prompt:
    """A copy of ``prompt`` for one call: its own ``meta``, ``messages`` and
    ``input_ids``; the images and vision tensors shared (see the module docstring)."""
    done = memo.get(id(prompt))
    if done is not None:
        return done
    copied = dataclasses.replace(
        prompt,
        messages=own_copy(prompt.messages, memo),
        meta=own_copy(prompt.meta, memo),
        input_ids=None if prompt.input_ids is None else list(prompt.input_ids),
        images=None if prompt.images is None else list(prompt.images),
        vision=None if prompt.vision is None else dict(prompt.vision),
    )
    memo[id(prompt)] = copied
    return copied


def own_kwargs(kwargs: Mapping[str, Any], memo: dict[int, Any]) -> dict[str, Any]:
    """The config's kwargs for one call (a list in them is the same for every call)."""
    return {key: own_copy(value, memo) for key, value in kwargs.items()}
