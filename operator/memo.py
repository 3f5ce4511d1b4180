"""`IdentityMemo`: results of pure functions of large frozen objects (a build's architecture, a GPU profile, a
snapshot of the nodes), kept by the objects' identity, so that passes over the same inputs do not work them out
again."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class IdentityMemo:
    """Results of a pure function of frozen objects, by those objects' identity and small hashable extras. Each
    entry holds its objects, so an id is not reused while its entry lives; the least recently used go first."""

    def __init__(self, size: int) -> None:
        self._entries: OrderedDict[tuple[Any, ...], tuple[tuple[object, ...], Any]] = OrderedDict()
        self._size, self._lock = size, threading.Lock()

    def get(self, objects: tuple[object, ...], extras: tuple[Any, ...], compute: Callable[[], T]) -> T:
        key = (tuple(map(id, objects)), extras)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                found: T = self._entries[key][1]
                return found
        value = compute()  # outside the lock: two threads may both compute a missing entry, never a wrong one
        with self._lock:
            self._entries[key] = (objects, value)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
        return value
