"""Control calls from the server's front end (AsyncLLM.sleep / wake_up / profiling) to one or several engine
processes: every data-parallel replica is asked, each answer reaches its caller, and a refusal or the engine's
death is raised there."""

from __future__ import annotations

import asyncio

import pytest

from runtime.engine.control import EngineControlError
from runtime.engine.control_client import ControlCalls
from runtime.engine.core_client import EngineDeadError, UtilityResult
from runtime.engine.dp_client import DPEngineCoreClient


class FakeClient:
    def __init__(self):
        self.sent = []

    def send_utility(self, call_id, method, args):
        self.sent.append((call_id, method, args))
        return 1


def run(coro):
    return asyncio.run(coro)


def test_a_call_goes_to_every_replica_and_gathers_their_answers():
    async def main():
        replicas = [FakeClient(), FakeClient()]
        dp = DPEngineCoreClient(replicas)
        dp._queue = asyncio.Queue()
        calls = ControlCalls(dp)
        task = asyncio.create_task(calls.call("is_sleeping"))
        await asyncio.sleep(0)
        assert [r.sent for r in replicas] == [[(0, "is_sleeping", [])]] * 2
        for index, value in ((1, True), (0, False)):
            dp._queue.put_nowait((index, UtilityResult(0, True, value)))
            engine_index, message = await dp.get_indexed_output()  # passed through, not read as step outputs
            calls.resolve(engine_index, message)
        return await task

    assert run(main()) == [False, True]


def test_a_refusal_and_the_engines_death_are_raised_to_the_caller():
    async def main():
        calls = ControlCalls(FakeClient())
        refused = asyncio.create_task(calls.call("sleep", 3))
        await asyncio.sleep(0)
        calls.resolve(0, UtilityResult(0, False, ["ValueError", "sleep level 3 is not valid; valid: 1, 2"]))
        with pytest.raises(ValueError, match="sleep level 3 is not valid"):
            await refused
        busy = asyncio.create_task(calls.call("sleep", 1))
        await asyncio.sleep(0)
        calls.resolve(0, UtilityResult(1, False, ["EngineControlError", "cannot sleep with 1 unfinished request(s)"]))
        with pytest.raises(EngineControlError, match="cannot sleep with 1 unfinished"):
            await busy
        lost = asyncio.create_task(calls.call("wake_up", None))
        await asyncio.sleep(0)
        calls.fail_all(EngineDeadError("the engine process exited unexpectedly"))
        with pytest.raises(EngineDeadError):
            await lost
        calls.resolve(0, UtilityResult(2, True, None))  # a late answer to a call that is gone: ignored
        assert calls._pending == {}

    run(main())
