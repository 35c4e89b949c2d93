"""gateway.app.in_own_thread: start-up work (the engines' load, whose kernel timing runs multi-threaded) runs on a
thread started for it that has ended by the time its result is back, so it leaves no OpenMP pool beside the
step loop's (kernels/thread_governor.py); its result or exception reaches the awaiting task."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gateway.app import in_own_thread


def test_the_work_runs_on_a_thread_of_its_own_that_ends_with_it():
    seen = {}

    def work():
        seen["thread"] = threading.current_thread()
        return 42

    async def main():
        result = await in_own_thread(work)
        seen["thread"].join(timeout=5)  # it ends right after handing the result back
        return result

    assert asyncio.run(main()) == 42
    assert seen["thread"] is not threading.main_thread()
    assert seen["thread"].name == "tandem-start-up" and not seen["thread"].is_alive()
    executor_threads = [t for t in threading.enumerate() if t.name.startswith("asyncio_")]
    assert executor_threads == []  # not the default executor's (its threads outlive the work)


def test_an_exception_reaches_the_awaiting_task():
    def work():
        raise ValueError("bad checkpoint")

    with pytest.raises(ValueError, match="bad checkpoint"):
        asyncio.run(in_own_thread(work))
