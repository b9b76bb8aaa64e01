"""A stream factory for CPU tests: fake handles whose idleness and failures tests control."""

from __future__ import annotations

import itertools
import threading

from tensorferry.runtime import StreamKey


class FakeStreamFactory:
    """Hands out integer handles; ``busy`` handles never go idle, ``broken`` ones fail queries."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.created: dict[int, StreamKey] = {}
        self.destroyed: list[int] = []
        self.busy: set[int] = set()
        self.broken: set[int] = set()

    def create(self, key: StreamKey) -> int:
        with self._lock:
            handle = next(self._ids)
            self.created[handle] = key
            return handle

    def is_idle(self, handle: int) -> bool:
        if handle in self.broken:
            raise RuntimeError(f"stream {handle} is in an error state")
        return handle not in self.busy

    def destroy(self, handle: int) -> None:
        with self._lock:
            assert handle in self.created, f"destroying unknown stream {handle}"
            assert handle not in self.destroyed, f"stream {handle} destroyed twice"
            self.destroyed.append(handle)

    def wrap(self, handle: int, key: StreamKey) -> tuple[str, int]:
        return ("fake-stream", handle)

    @property
    def alive(self) -> set[int]:
        return set(self.created) - set(self.destroyed)
