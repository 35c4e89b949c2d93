"""`ClientGone`: the connection's protocol tells a request's watchers that its client has gone, in place of a task
per request awaiting `receive()`. Its watches behave as the watcher tasks did for `ClientWatch` and `send_events`
(callbacks on the loop's next turn, cancel drops them, done/cancelled); the live disconnect tests
(test_gateway_disconnects.py, test_gateway_api.py's dropped streams) fail when it never fires."""

from __future__ import annotations

import asyncio

import pytest

from gateway.http_guard import CLIENT_GONE, ClientGone
from gateway.streaming import ClientWatch, disconnect_watcher


class _Flow:
    def __init__(self) -> None:
        self.resumed = 0

    def resume_reading(self) -> None:
        self.resumed += 1


async def test_a_watch_is_told_once_on_the_loops_next_turn():
    loop = asyncio.get_running_loop()
    flow = _Flow()
    gone = ClientGone(loop, flow)
    watch = gone.watch()
    assert flow.resumed == 1  # reading resumed, as uvicorn's receive() does, so a closed socket is seen
    seen = []
    watch.add_done_callback(seen.append)
    assert not watch.done() and not watch.cancelled() and watch.exception() is None
    gone.fire()
    gone.fire()
    assert watch.done() and not watch.cancelled() and seen == []  # not called in the protocol's callback
    await asyncio.sleep(0)
    assert seen == [watch]
    await asyncio.sleep(0)
    assert seen == [watch]


async def test_a_cancelled_watch_is_never_told_and_others_still_are():
    gone = ClientGone(asyncio.get_running_loop(), None)
    first, second = gone.watch(), gone.watch()
    told = []
    first.add_done_callback(lambda w: told.append("first"))
    second.add_done_callback(lambda w: told.append("second"))
    assert first.cancel() and not first.cancel()
    assert first.done() and first.cancelled()
    gone.fire()
    await asyncio.sleep(0)
    assert told == ["second"]


async def test_a_watch_made_after_the_client_left_is_told_at_once():
    gone = ClientGone(asyncio.get_running_loop(), None)
    gone.fire()
    watch = gone.watch()
    told = []
    watch.add_done_callback(told.append)
    assert watch.done() and not watch.cancelled()
    await asyncio.sleep(0)
    assert told == [watch]


async def _never() -> dict:
    await asyncio.Future()
    return {}


async def test_client_watch_uses_the_servers_notice_without_a_task_and_cancels_the_request():
    loop = asyncio.get_running_loop()
    gone = ClientGone(loop, None)
    scope = {"extensions": {CLIENT_GONE: gone}}
    started = asyncio.Event()
    before = len(asyncio.all_tasks())

    async def request() -> None:
        watch = ClientWatch(_never, scope)
        assert len(asyncio.all_tasks()) == before + 1  # the request's own task only: no watcher task
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            assert watch.uncancel_if_left()
            raise
        finally:
            watch.stop()

    task = asyncio.create_task(request())
    await started.wait()
    gone.fire()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)
    assert task.cancelled()


async def test_without_the_notice_a_task_awaits_the_disconnect():
    messages = asyncio.Queue()
    watcher = disconnect_watcher({}, messages.get)  # another ASGI server: the task, as before
    assert isinstance(watcher, asyncio.Task)
    messages.put_nowait({"type": "http.disconnect"})
    await asyncio.wait_for(watcher, 2)
    assert watcher.done() and not watcher.cancelled()
