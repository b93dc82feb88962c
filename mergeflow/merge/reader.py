"""A reader thread that fills buffers ahead of the merge, so reading overlaps with merging.

File reads (``os.preadv``) and torch's dtype conversions release the GIL, so on two cores the
reader and the merging thread run in parallel.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

Item = TypeVar("Item")
Buffers = TypeVar("Buffers")


class Reader(Generic[Item, Buffers]):
    """Runs ``fill(item, buffers)`` for each item in a thread, as far ahead as there are free buffer sets.

    ``start``, if given, runs first in the thread (to set it up). Iterating yields ``(item, buffers)`` in
    order; hand each set back with ``release`` once merged.
    An error in the thread is raised in the iterating one. Use as a context manager: leaving it
    stops and joins the thread, so the files it reads can be closed after.
    """

    def __init__(
        self,
        items: Iterable[Item],
        fill: Callable[[Item, Buffers], None],
        buffers: list[Buffers],
        start: Callable[[], None] | None = None,
    ) -> None:
        self._free: queue.SimpleQueue[Buffers | None] = queue.SimpleQueue()
        for entry in buffers:
            self._free.put(entry)
        self._ready: queue.SimpleQueue[tuple[Item, Buffers] | BaseException | None] = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(
            target=self._run, args=(items, fill, start), name="mergeflow-reader", daemon=True
        )
        self._thread.start()

    def _run(
        self, items: Iterable[Item], fill: Callable[[Item, Buffers], None], start: Callable[[], None] | None
    ) -> None:
        try:
            if start is not None:
                start()
            for item in items:
                buffers = self._free.get()
                if self._stopped or buffers is None:
                    return
                fill(item, buffers)
                self._ready.put((item, buffers))
            self._ready.put(None)
        except BaseException as error:  # handed to the merging thread, which raises it
            self._ready.put(error)

    def __iter__(self) -> Iterator[tuple[Item, Buffers]]:
        while (got := self._ready.get()) is not None:
            if isinstance(got, BaseException):
                raise got
            yield got

    def release(self, buffers: Buffers) -> None:
        """Hand a buffer set back to the reader."""
        self._free.put(buffers)

    def __enter__(self) -> Reader[Item, Buffers]:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped = True
        self._free.put(None)
        self._thread.join()
