"""An environment call that does not return is said on the console (a warning naming
the call and the prompt, again each time its wait doubles), not left silent; a call
that returns in time says nothing."""

from __future__ import annotations

import logging
import threading
import time

from rltune.data.records import SamplingParams
from rltune.envs.base import StepResult
from rltune.envs.watchdog import CallWatch

from test_episodes import _prompt, _runner

FIRST = 0.2  # seconds before the first warning in these tests
# waits are judged by the warnings seen, never by the clock: a slow machine only waits
# longer for each one (up to the bound below, far past 3 * FIRST)
BOUND = 30.0


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rltune.envs.watchdog"]


def _wait_for(caplog, count: int) -> list[str]:
    deadline = time.monotonic() + BOUND
    while len(_warnings(caplog)) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return _warnings(caplog)


def test_a_step_that_does_not_return_is_warned_of_with_its_prompt(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="rltune.envs.watchdog")
    release = threading.Event()

    class Stuck:
        def reset(self, prompt):
            return None

        def step(self, action):
            release.wait(BOUND)
            return StepResult(done=True)

    runner, _ = _runner({"q7": ["go"]}, Stuck, max_turns=1)
    runner.watch = CallWatch(first_s=FIRST)
    done = threading.Thread(target=runner.generate, args=([_prompt("q7", "?")], SamplingParams(n=1, max_new_tokens=8)))
    done.start()
    seen = _wait_for(caplog, 2)
    release.set()
    done.join(BOUND)
    assert len(seen) >= 2, seen
    assert seen[0].startswith("env: step for prompt 'q7' has not returned after 0.2 s;")
    assert seen[1].startswith("env: step for prompt 'q7' has not returned after 0.4 s;")
    assert "give them a timeout of their own" in seen[0]


def test_calls_that_return_in_time_say_nothing(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="rltune.envs.watchdog")
    watch = CallWatch(first_s=FIRST)
    for i in range(20):
        with watch.watching(f"env: step for prompt 'p{i}'"):
            pass
    time.sleep(3 * FIRST)  # past when a warning would have come for any of them
    assert _warnings(caplog) == []


def test_the_warnings_double_their_wait() -> None:
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("rltune.envs.watchdog")
    logger.addHandler(handler)
    try:
        watch = CallWatch(first_s=1.0)
        with watch.watching("env: reset for prompt 'a'"):
            deadline = time.monotonic() + BOUND
            while len(messages) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        logger.removeHandler(handler)
    assert [m.split(";")[0] for m in messages[:2]] == [
        "env: reset for prompt 'a' has not returned after 1 s", "env: reset for prompt 'a' has not returned after 2 s"]
