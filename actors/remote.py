"""The Ray transport of the handle chain (actors.factory gives the whole order): RemoteProxy, blocking
calls on a Ray actor behind a stable slot; PinnedActor, the same calls bound to one actor of the slot;
RemoteDrafter, a DraftActor as its generator's engine calls it.

When its actor dies (RayActorError) or a call runs longer than ``runtime.call_timeout_s`` (the actor
is killed), the proxy raises WorkerFailure, whose recovery starts a replacement actor with the same
options and swaps it into the slot. The coordinator then resubmits the batch.

A lost node is told apart from a dead actor before the replacement starts. The driver hears of the
actor's death (its calls fail) seconds before Ray declares the node dead (missed health checks:
about 15-30 s at Ray's defaults); a replacement started in between is placed on the dead node (its
placement-group bundle is still there, or no other node has room), dies, and costs the batch a
second attempt. So the recovery first waits, up to NODE_VERDICT_WAIT_S, until Ray's actor table
says the actor is dead: at once for an actor that exited or was killed, and once the node is
declared dead for a lost node, whose placement-group bundles Ray then moves to live nodes. Only
then does it start the replacement, and it names the lost node. A replacement that no live node
has room for is reported on the progress line after ROOM_NOTICE_S, with what the cluster has; after
ROOM_WAIT_S the slot is given up (``lost``): the coordinator goes on with the role's other actors,
or, where none is left, fails the batch with one line naming the lost capacity. While a
replacement is under way the slot's new calls wait for it (bounded by the same waits) instead of
failing on the dead actor, so a node loss costs only the batches that were on it, one attempt each.

A call's timeout runs from when the actor STARTS it, not from when the driver sent it: an actor
serves its calls one at a time (or a few), so a call may wait in the actor's queue behind other
batches' slow calls (model-side searches, a long extend) for longer than the timeout while the
actor is healthy. The actor's classes are wrapped by ``with_call_clock``: each public method
records when it started under its Ray task id, and ``calls_running`` (served in its own concurrency
group, ``CLOCK_GROUP``, so it answers while the actor is busy) says how long a call has run. The
proxy waits for the result; whenever the timeout passes with no result it asks, and kills the actor
only once the call has RUN for the timeout (or the actor cannot even answer that question within
the timeout: frozen). An actor without the clock is timed from the send, as before.
"Starts" is when the actor's method is entered: a threaded actor (continuous batching) enters its
calls at once, so there a call that waits inside the engine (a model-side search queued behind
another between the step loop's steps) is timed from its entry.

Once the workers are shut down (``retire``, called by the factory's shutdown before it kills the
actors), a call fails with WorkersShutDown instead: the batches still in flight when a build ends
early (an error in one batch) end too, rather than failing over onto new actors.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from typing import Any, Callable

from pipeline.decoding.domain import DraftLayer
from pipeline.decoding.sampling import SamplingParams
from pipeline.errors import WorkerFailure, WorkersShutDown

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0
"""The least time a placed replacement actor gets to load its model and answer."""
NODE_VERDICT_WAIT_S = 90.0
"""How long a recovery waits for Ray's actor table to say the failed actor is dead (its node declared
dead, for a lost node) before it starts the replacement anyway. Ray declares a node dead after
health_check_failure_threshold missed checks of health_check_period_ms (5 x 3 s, plus a 10 s
timeout, at its defaults)."""
ROOM_NOTICE_S = 3.0
"""A replacement that no node has taken after this long is reported on the progress line (a warning
naming what it asks for and what the cluster has)."""
ROOM_WAIT_S = 120.0
"""How long a replacement may wait for a node with room (its bundle moved, its resources freed, a
node added by an autoscaler) before its slot is given up (RemoteProxy.lost)."""
CLOCK_GROUP = "call_clock"
"""The Ray concurrency group that serves ``calls_running`` beside the actor's work calls."""
CONCURRENCY_GROUPS = {CLOCK_GROUP: 1}
"""What an actor with the clock is declared with (``ray.remote(concurrency_groups=...)``; Ray refuses
them in ``.options()``)."""
GLANCE_TIMEOUT_S = 5.0
"""How long a glance (RemoteProxy.glance: a progress figure) waits for an actor's answer."""
QUEUED_POLL_FRACTION = 0.25
"""While a call has not started, ask again after this fraction of the timeout: a call that starts
just after it was asked is thus killed at most this fraction of the timeout late."""


class SecretEnv:
    """Environment variables that are secrets (the driver's HF_TOKEN), carried to a Ray actor as a
    constructor argument and put in the actor's process environment before the model loads.

    Not through the actor's runtime_env: Ray keeps that in its state API and writes it in plain text to
    runtime_env_agent.log. An actor's arguments are in neither, nor in any Ray log; and this object's
    repr shows the names only, so no traceback or log line that prints it shows a value. A variable
    the actor's node already sets (its own Kubernetes Secret, say) keeps the node's value."""

    def __init__(self, values: dict[str, str]):
        self._values = dict(values)

    def __bool__(self) -> bool:
        return bool(self._values)

    def __repr__(self) -> str:
        return f"SecretEnv({', '.join(sorted(self._values))}: [redacted])"

    def install(self) -> None:
        import os

        for name, value in self._values.items():
            os.environ.setdefault(name, value)


def with_call_clock(cls: type) -> type:
    """A subclass of actor class ``cls`` whose public methods record their start under the calling
    Ray task's id, and which answers ``calls_running`` (see the module docstring). Wrap it outermost
    (around actors.faults.with_faults): a fault that hangs a call hangs a started call. Its
    constructor also takes ``secret_env`` (SecretEnv), installed before ``cls`` loads anything."""

    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            import ray

            task = ray.get_runtime_context().get_task_id()
            with self._clock_lock:
                self._call_started[task] = time.monotonic()
            try:
                return method(self, *args, **kwargs)
            finally:
                with self._clock_lock:
                    self._call_started.pop(task, None)

        return call

    def __init__(self, *args, secret_env: SecretEnv | None = None, **kwargs):
        self._call_started: dict[str | None, float] = {}
        self._clock_lock = threading.Lock()
        if secret_env is not None:
            secret_env.install()
        cls.__init__(self, *args, **kwargs)

    def calls_running(self, task_ids: list[str]) -> dict[str, float]:
        """Seconds each of ``task_ids`` has run on this actor so far; calls that have not started
        (or have ended) are absent."""
        now = time.monotonic()
        with self._clock_lock:
            return {t: now - self._call_started[t] for t in task_ids if t in self._call_started}

    namespace = {"__init__": __init__, "__doc__": cls.__doc__, "__module__": cls.__module__,
                 "calls_running": calls_running}
    namespace.update({name: wrap(fn) for name, fn in inspect.getmembers(cls, inspect.isfunction)
                      if not name.startswith("_")})
    return type(cls.__name__, (cls,), namespace)


class RemoteProxy:
    """Blocking method calls on a Ray actor, so the layers above see a plain call. Each coordinator
    thread blocks on its own call; many calls are in flight at once."""

    def __init__(self, handle: Any = None, *, spawn: Callable[[], Any] | None = None, name: str = "actor",
                 timeout_s: float | None = None, request: dict[str, float] | None = None,
                 bundle: tuple[Any, int] | None = None):
        """Either an actor ``handle`` (no replacement: a dead actor stays dead and its batches fail
        after their attempts) or ``spawn``, which starts the actor now and again after each failure.
        ``request``: the Ray resources one actor asks for ({"CPU": 2, "GPU": 1}), for the messages
        that say why a replacement cannot be placed. ``bundle``: (placement group, bundle index) the
        actor is started in, None outside a group."""
        if (handle is None) == (spawn is None):
            raise ValueError("give an actor handle or a spawn function")
        self._spawn = spawn
        self._handle = spawn() if spawn is not None else handle
        self._lock = threading.Lock()
        self.name = name
        self.timeout_s = timeout_s
        self.request = dict(request or {})
        self.bundle = bundle
        self.restarts = 0
        """Replacement actors started so far."""
        self.replacing = False
        """A replacement is under way: the coordinator admits no new batch to the slot meanwhile."""
        self.lost: str | None = None
        """Why the slot was given up (no node had room for a replacement within ROOM_WAIT_S), or None.
        A lost slot takes no more calls; the coordinator goes on without it."""
        self._retired = False

    @property
    def handle(self) -> Any:
        return self._handle

    def _current(self) -> Any:
        """The slot's actor; while a replacement is under way, the replacement once it has started
        (the lock is held for the whole replacement, whose waits are bounded). WorkerFailure, with no
        recovery, once the slot is lost."""
        with self._lock:
            if self.lost:
                raise WorkerFailure(self.lost)
            return self._handle

    def call(self, method: str, *args, **kwargs) -> Any:
        """``method`` of the slot's current actor, called with these arguments."""
        return self.call_on(self._current(), method, args, kwargs)

    def retire(self) -> None:
        """No more calls and no more replacements: from now on every call raises WorkersShutDown, and
        a replacement being started is killed. The caller kills the current actor."""
        self._retired = True

    def pinned(self) -> PinnedActor:
        """A view bound to the current actor, for a stateful sequence of calls (a decoding session
        lives in one actor's memory): once that actor is replaced, its calls fail instead of
        reaching the new actor, which never saw the session."""
        return PinnedActor(self, self._current())

    def call_on(self, handle: Any, name: str, args: tuple, kwargs: dict) -> Any:
        """``name`` of actor ``handle`` (one of this slot's), under the call clock: its result, or
        WorkerFailure (the actor died or hung; its recovery replaces it) or WorkersShutDown."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if self._retired:
            raise WorkersShutDown(f"{self.name}: {name}() after the workers were shut down")
        try:
            ref = getattr(handle, name).remote(*args, **kwargs)
            return ray.get(ref) if self.timeout_s is None else self._result(handle, ref)
        except RayActorError as exc:
            cause = f"{self.name} actor died during {name}(){_where(handle)} ({type(exc).__name__})"
        except GetTimeoutError:
            ray.kill(handle, no_restart=True)
            cause = f"{self.name} actor hung: {name}() ran over {self.timeout_s:g}s after it started; killed"
        if self._retired:  # killed by the shutdown, not a fault
            raise WorkersShutDown(f"{self.name}: {name}() ended by the workers' shutdown")
        raise WorkerFailure(cause, lambda: self.replace(handle))

    def _result(self, handle: Any, ref: Any) -> Any:
        """``ref``'s value, once its call has run for at most ``timeout_s`` on the actor (time queued
        there does not count); GetTimeoutError once it has run longer, or when the actor does not
        answer how long within ``timeout_s``."""
        import ray
        from ray.exceptions import GetTimeoutError

        sent = time.monotonic()
        task = ref.task_id().hex()
        wait_s = self.timeout_s
        while True:
            ready, _ = ray.wait([ref], timeout=wait_s)
            if ready:
                return ray.get(ref)
            try:
                probe = handle.calls_running.options(concurrency_group=CLOCK_GROUP)
            except AttributeError:  # an actor without the clock: timed from the send
                running = {task: time.monotonic() - sent}
            else:
                running = ray.get(probe.remote([task]), timeout=self.timeout_s)
            ran = running.get(task)
            if ran is None:  # queued behind other calls (or just ended: the next wait returns at once)
                wait_s = self.timeout_s * QUEUED_POLL_FRACTION
            elif ran >= self.timeout_s:
                raise GetTimeoutError(f"{task} ran {ran:.1f}s")
            else:
                wait_s = self.timeout_s - ran

    def glance(self, method: str) -> Any:
        """A read-only call in the clock's concurrency group, so it answers beside the work under
        way (the progress line's KV use); GLANCE_TIMEOUT_S at most."""
        import ray

        return ray.get(getattr(self._handle, method).options(concurrency_group=CLOCK_GROUP).remote(),
                       timeout=GLANCE_TIMEOUT_S)

    def replace(self, failed: Any) -> str | None:
        """Start a new actor in place of ``failed``, unless another thread already did; returns a note
        for the retry's log line (the lost node, where the replacement went), or None.

        Waits first for Ray's verdict on ``failed`` (the module docstring says why), then for the
        replacement to be placed and to load. WorkerFailure when the replacement dies while it
        starts (the next attempt retries it), or when no node had room for it within ROOM_WAIT_S
        (the slot is then ``lost``)."""
        import ray

        with self._lock:
            if self._handle is not failed or self._spawn is None or self._retired:
                return None
            if self.lost:
                raise WorkerFailure(self.lost)
            self.replacing = True
            try:
                return self._replace(failed)
            finally:
                self.replacing = False

    def _replace(self, failed: Any) -> str | None:
        """replace, under the lock (the slot marked ``replacing``)."""
        import ray

        gone = self._await_verdict(failed)
        ray.kill(failed, no_restart=True)
        self._handle = self._spawn()
        self.restarts += 1
        if self._retired:  # shut down while it was being spawned: the shutdown may have missed it
            ray.kill(self._handle, no_restart=True)
            raise WorkersShutDown(f"{self.name}: replacement abandoned, the workers were shut down")
        lost = f"its node {gone} is gone" if gone else ""
        try:
            self.await_start(lost)
        except WorkerFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - a replacement that cannot start is one more failure
            if self._retired:
                raise WorkersShutDown(f"{self.name}: replacement ended by the workers' shutdown") from None
            raise WorkerFailure(f"replacement {self.name} actor failed to start ({exc})",
                                lambda: self.replace(self._handle)) from None
        return f"{self.name}: {lost}; replacement started on node {_node_of(self._handle)}" if gone else None

    def _await_verdict(self, failed: Any) -> str | None:
        """Wait (NODE_VERDICT_WAIT_S at most) until Ray's actor table says ``failed`` is dead; the
        node it ran on ("id8 at ip") when that node is dead too, else None. The wait is what keeps
        the replacement off a node that is gone but not yet declared dead."""
        import ray

        started, told, info = time.monotonic(), False, {}
        while True:
            info = _actor_info(failed)
            if info is None or info.get("State") == "DEAD" or time.monotonic() - started > NODE_VERDICT_WAIT_S:
                break
            if not told and time.monotonic() - started > ROOM_NOTICE_S:
                log.warning(f"{self.name}: its actor on node {_node_name(info)} does not answer and Ray has not "
                            f"declared it dead; waiting up to {NODE_VERDICT_WAIT_S:g} s for Ray's verdict on the "
                            f"node before a replacement is placed")
                told = True
            time.sleep(0.2)
        if not info:
            return None
        node_id = info.get("Address", {}).get("NodeID")
        node = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
        return _node_name(info) if node is None or not node["Alive"] else None

    def await_start(self, lost: str = "") -> None:
        """Wait for the slot's current actor to answer: as long as it takes to load once a node has
        taken it (max(timeout_s, STARTUP_TIMEOUT_S)); ROOM_WAIT_S while no node has room for it,
        saying so on the progress line after ROOM_NOTICE_S; past that the slot is ``lost`` and
        WorkerFailure names the capacity. ``lost``: what was lost ("its node ... is gone"), for the
        messages. Whatever the actor raised while it started (its model failed to load) propagates."""
        import ray

        handle, started, told = self._handle, time.monotonic(), False
        ref = handle.stats.remote()
        while True:
            ready, _ = ray.wait([ref], timeout=0.5)
            if ready:
                ray.get(ref)
                return
            waited = time.monotonic() - started
            if _placed(handle) or self._has_room():
                if waited > max(self.timeout_s or 0, STARTUP_TIMEOUT_S):
                    raise TimeoutError(f"it did not answer within {waited:.0f} s of its start")
                continue
            why = f"{self.name}: {lost + '; ' if lost else ''}no node has room for its actor ({_resources(self.request)})"
            if not told and waited > ROOM_NOTICE_S:
                log.warning(f"{why}; waiting up to {ROOM_WAIT_S:g} s (the cluster has {cluster_capacity()})")
                told = True
            if waited > ROOM_WAIT_S:
                ray.kill(handle, no_restart=True)
                self.lost = f"{why} within {ROOM_WAIT_S:g} s; the cluster has {cluster_capacity()}"
                raise WorkerFailure(self.lost)

    def _has_room(self) -> bool:
        """Whether the actor has room to start in (it is only slow to start: its worker process is
        still coming up): its placement-group bundle is placed on a live node; outside a group, a
        live node has its request free."""
        import ray

        try:
            if self.bundle is not None:
                from ray.util.placement_group import placement_group_table

                group, index = self.bundle
                table = placement_group_table(group)
                live = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
                return table.get("state") == "CREATED" and table.get("bundles_to_node_id", {}).get(index) in live
            return room_for(self.request)
        except Exception:  # noqa: BLE001 - without Ray's view, only the worker's pid tells
            return False


def room_for(request: dict[str, float]) -> bool:
    """Whether some live node has ``request`` free now (Ray's per-node free resources)."""
    from ray._private import state

    free = state.available_resources_per_node()
    return any(all(node.get(k, 0) >= v for k, v in request.items()) for node in free.values())


def _actor_info(handle: Any) -> dict | None:
    """The actor's row of Ray's actor table (State, Address.NodeID, Pid), or None where it cannot be
    read (an actor handle of another kind, or a Ray whose table reads otherwise)."""
    try:
        from ray._private import state

        return state.actors(handle._actor_id.hex()) or None
    except Exception:  # noqa: BLE001 - without the table, recovery works as it did without the verdict
        return None


def _placed(handle: Any) -> bool:
    """Whether a node has taken the actor (a worker process runs it: its pid is known), even if it is
    still loading; True where the table cannot be read (then only the load timeout applies)."""
    info = _actor_info(handle)
    return info is None or info.get("State") in ("ALIVE", "DEAD") or bool(info.get("Pid"))


def _node_name(info: dict) -> str:
    address = info.get("Address", {})
    return f"{address.get('NodeID', '?')[:8]} at {address.get('IPAddress') or '?'}"


def _node_of(handle: Any) -> str:
    info = _actor_info(handle)
    return _node_name(info) if info else "?"


def _where(handle: Any) -> str:
    """" on node ID8 at IP" for an actor the table knows, so that a failure names the node."""
    info = _actor_info(handle)
    return f" on node {_node_name(info)}" if info and info.get("Address", {}).get("NodeID") else ""


def _resources(request: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in request.items() if v) or "no resources"


def cluster_capacity() -> str:
    """What the live nodes of the cluster have, for a message: "2 live node(s): CPU 4 (1 free), GPU 0"."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    total, free = ray.cluster_resources(), ray.available_resources()
    return (f"{len(nodes)} live node(s): " + ", ".join(f"{k} {total.get(k, 0):g} ({free.get(k, 0):g} free)"
                                                       for k in ("CPU", "GPU")))


class PinnedActor:
    """A RemoteProxy's calls bound to the actor that was current when it was made (RemoteProxy.pinned):
    after a replacement they fail over (WorkerFailure) rather than reach the new actor."""

    def __init__(self, proxy: RemoteProxy, handle: Any):
        self._proxy = proxy
        self._handle = handle

    @property
    def restarts(self) -> int:
        return self._proxy.restarts

    def call(self, method: str, *args, **kwargs) -> Any:
        return self._proxy.call_on(self._handle, method, args, kwargs)

    def pinned(self) -> PinnedActor:
        return self


class RemoteDrafter:
    """A DraftActor as its generator's engine sees it (the Drafter protocol; runtime.draft_placement
    actor): each draft a Ray call; a draft actor that died fails the call (WorkerFailure), and with it
    the generator's call. No replacement here: a replaced generator gets a fresh draft actor
    (actors.factory starts the two together)."""

    def __init__(self, actor: Any):
        self._slot = RemoteProxy(actor)

    def draft(self, contexts: list[list[int]], prefix_logp: list[float], width: int, depth: int,
              sampling: SamplingParams, seed: int) -> list[DraftLayer]:
        return self._slot.call("draft", contexts, prefix_logp, width, depth, sampling, seed)
