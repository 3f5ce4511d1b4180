"""Memos of pure functions: `Memo` by a hashable key (a plan's text), `IdentityMemo` by the identity of large
frozen objects (a build's architecture, a GPU profile, a snapshot of the nodes), so that passes over the same inputs
do not work them out again."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Memo(Generic[T]):
    """Values by key, the least recently used dropped past `size`; thread-safe."""

    def __init__(self, size: int) -> None:
        self._entries: OrderedDict[Hashable, T] = OrderedDict()
        self._size, self._lock = size, threading.Lock()

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        if (found := self.find(key)) is not None:
            return found
        value = compute()  # outside the lock: two threads may both compute a missing entry, never a wrong one
        self.put(key, value)
        return value

    def find(self, key: Hashable) -> T | None:
        """The value kept for `key`, if any."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
            return None

    def put(self, key: Hashable, value: T) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)


class IdentityMemo:
    """Results of a pure function of frozen objects, by those objects' identity and small hashable extras. Each
    entry holds its objects, so an id is not reused while its entry lives."""

    def __init__(self, size: int) -> None:
        self._memo: Memo[tuple[tuple[object, ...], Any]] = Memo(size)

    def get(self, objects: tuple[object, ...], extras: tuple[Any, ...], compute: Callable[[], T]) -> T:
        found: T = self._memo.get((tuple(map(id, objects)), extras), lambda: (objects, compute()))[1]
        return found
