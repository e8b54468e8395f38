"""State that a reward function builds once per distinct configuration and then reuses.

A reward is named in a config as ``module:function`` plus ``kwargs``; there is no
constructor step. A reward that needs heavy state (a loaded model, a thread pool, a
compiled rule set) builds it on the first call and finds it again on later calls with the
same kwargs. Rewards may be called from a thread pool, so the cache is thread-safe, and two
threads asking for the same key build the state once.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class KeyedCache(Generic[V]):
    """A dict of built values guarded by locks: one global lock for the dict, one per key
    for building, so different keys build in parallel and one key builds only once.

    A build that raises caches nothing: the next call with that key tries again (a user
    who fixes a path between runs is not stuck with the old error).
    """

    def __init__(self) -> None:
        self._values: dict[Hashable, V] = {}
        self._building: dict[Hashable, threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, build: Callable[[], V]) -> V:
        """The value cached under ``key``, built by ``build()`` if there is none yet."""
        with self._lock:
            if key in self._values:
                return self._values[key]
            key_lock = self._building.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                if key in self._values:  # built by another thread while this one waited
                    return self._values[key]
            value = build()
            with self._lock:
                self._values[key] = value
                self._building.pop(key, None)
            return value

    def clear(self) -> None:
        """Forget every cached value (the values themselves are not closed)."""
        with self._lock:
            self._values.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)


def cache_key(**settings: Any) -> str:
    """A hashable key of ``settings`` (YAML kwargs may hold lists and dicts, which do not
    hash): their JSON with sorted keys. Values JSON cannot write are written with ``repr``."""
    return json.dumps(settings, sort_keys=True, default=repr)
