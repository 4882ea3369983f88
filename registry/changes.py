"""A change counter that watchers await: the backbone of the registry's watch streams."""

from __future__ import annotations

import asyncio


class Changes:
    def __init__(self) -> None:
        self._version = 0
        self._changed = asyncio.Condition()

    async def bump(self) -> None:
        async with self._changed:
            self._version += 1
            self._changed.notify_all()

    async def newer_than(self, seen: int) -> int:
        """Waits until the version differs from ``seen``; returns the new version."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._version != seen)
            return self._version
