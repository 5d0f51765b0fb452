"""runtime.call_timeout_s on Ray (actors.remote): a call's timeout runs from when the actor starts
it, so calls queued behind a slow one on a healthy actor are not taken for a hang, while a call
that really runs too long (or hangs) still gets its actor killed. The actors are started by the
factory's own spawner, as the build starts them."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from actors.factory import _RayPlacement
from actors.remote import RemoteProxy
from pipeline.config import ActorResources
from pipeline.errors import WorkerFailure

pytestmark = pytest.mark.integration


class SlowActor:
    """Each call takes ``seconds``, one at a time (a GeneratorActor without continuous batching: a
    model-side search per call)."""

    def search(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def stats(self) -> dict:
        return {}


def proxy(timeout_s: float) -> RemoteProxy:
    """A slot on a fresh SlowActor, once it is up (as the factory waits for its actors: startup is
    not part of any call)."""
    import ray

    spawn = _RayPlacement(runtime_env={}).spawner(SlowActor, (), ActorResources(num_cpus=0), bundle=0)
    slot = RemoteProxy(spawn=spawn, name="generator 0", timeout_s=timeout_s)
    ray.get(slot.handle.stats.remote())
    return slot


def test_calls_queued_behind_a_slow_call_do_not_time_out(cluster):
    """Three 1.2 s calls sent at once to a one-at-a-time actor with a 2 s timeout: the last waits
    2.4 s in the actor's queue and ends 3.6 s after it was sent, yet each ran within its timeout,
    so none may be treated as a hang (timed from the send, the last two were killed)."""
    slots = proxy(timeout_s=2.0)
    with ThreadPoolExecutor(3) as pool:
        started = time.monotonic()
        results = list(pool.map(lambda _: slots.call("search", 1.2), range(3)))
        elapsed = time.monotonic() - started
    assert results == [1.2] * 3
    assert elapsed > 3.0  # they did run one after another: the last was queued past its timeout
    assert slots.restarts == 0


def test_a_call_that_runs_past_its_timeout_is_still_a_hang(cluster):
    """Behind a 2 s call, a call that runs 30 s on a 3 s timeout: the actor is killed and the call
    fails 3 s after it STARTED (about 4.9 s after it was sent: queued 1.9 s), not 3 s after it was
    sent (the queueing counted) and not after it ends (30 s)."""
    slots = proxy(timeout_s=3.0)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(slots.call, "search", 2.0)
        time.sleep(0.1)  # the long call is sent second: it waits in the queue first
        started = time.monotonic()
        with pytest.raises(WorkerFailure, match=r"generator 0 actor hung: search\(\) ran over 3s after it started"):
            slots.call("search", 30.0)
        failed_after = time.monotonic() - started
        assert first.result() == 2.0
    # Load can only delay the kill: the lower bound separates "timed from the start" (>= 4.9 s)
    # from "timed from the send" (about 3 s); the upper bound, a kill from "waited for the end".
    assert 4.3 < failed_after < 20.0
