"""SIGTERM to `mergeflow serve`: the runner's handler stops it through the event loop (no exit from inside it)."""

from __future__ import annotations

import asyncio
import os
import signal

from flows.schedule import StoppableRunner


def test_sigterm_asks_the_runner_to_stop_on_its_loop():
    runner = StoppableRunner(name="test")
    stopped = asyncio.Event()
    calls = []

    async def astop() -> None:
        calls.append("astop")
        stopped.set()

    runner.astop = astop

    async def serving() -> None:
        signal.signal(signal.SIGTERM, runner.handle_sigterm)  # as Runner.start installs it
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a second one while stopping changes nothing
        await asyncio.wait_for(stopped.wait(), 10)

    previous = signal.getsignal(signal.SIGTERM)
    try:
        asyncio.run(serving())
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert runner.terminated and calls == ["astop"]
