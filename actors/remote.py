"""RemoteProxy: blocking calls on a Ray actor behind a stable slot.

When its actor dies (RayActorError) or a call outlives ``runtime.call_timeout_s`` (the actor is
killed), the proxy raises WorkerFailure, whose recovery starts a replacement actor with the same
options and swaps it into the slot. The coordinator then resubmits the batch.

Once the workers are shut down (``retire``, called by the factory's shutdown before it kills the
actors), a call fails with WorkersShutDown instead: the batches still in flight when a build ends
early (an error in one batch) end too, rather than failing over onto new actors.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from pipeline.coordinator import WorkerFailure

STARTUP_TIMEOUT_S = 300.0


class WorkersShutDown(RuntimeError):
    """A call on a retired proxy: the workers were shut down. Not a WorkerFailure, so the
    coordinator does not retry the batch."""


class RemoteProxy:
    """Blocking method calls on a Ray actor, so algorithm code sees a plain object. Each
    coordinator thread blocks on its own call; many calls are in flight at once."""

    def __init__(self, handle: Any = None, *, spawn: Callable[[], Any] | None = None, name: str = "actor",
                 timeout_s: float | None = None):
        """Either an actor ``handle`` (no replacement: a dead actor stays dead and its batches fail
        after their attempts) or ``spawn``, which starts the actor now and again after each failure."""
        if (handle is None) == (spawn is None):
            raise ValueError("give an actor handle or a spawn function")
        self._spawn = spawn
        self._handle = spawn() if spawn is not None else handle
        self._lock = threading.Lock()
        self.name = name
        self.timeout_s = timeout_s
        self.restarts = 0
        self._retired = False

    @property
    def handle(self) -> Any:
        return self._handle

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.call(self._handle, name, args, kwargs)

    def retire(self) -> None:
        """No more calls and no more replacements: from now on every call raises WorkersShutDown, and
        a replacement being started is killed. The caller kills the current actor."""
        self._retired = True

    def pinned(self) -> _Pinned:
        """A view bound to the current actor, for a stateful sequence of calls (a decoding session
        lives in one actor's memory): once that actor is replaced, its calls fail instead of
        reaching the new actor, which never saw the session."""
        return _Pinned(self, self._handle)

    def call(self, handle: Any, name: str, args: tuple, kwargs: dict) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if self._retired:
            raise WorkersShutDown(f"{self.name}: {name}() after the workers were shut down")
        try:
            return ray.get(getattr(handle, name).remote(*args, **kwargs), timeout=self.timeout_s)
        except RayActorError as exc:
            cause = f"{self.name} actor died during {name}() ({type(exc).__name__})"
        except GetTimeoutError:
            ray.kill(handle, no_restart=True)
            cause = f"{self.name} actor hung: {name}() took over {self.timeout_s:g}s; killed"
        if self._retired:  # killed by the shutdown, not a fault
            raise WorkersShutDown(f"{self.name}: {name}() ended by the workers' shutdown")
        raise WorkerFailure(cause, lambda: self.replace(handle))

    def replace(self, failed: Any) -> None:
        """Start a new actor in place of ``failed``, unless another thread already did."""
        import ray

        with self._lock:
            if self._handle is not failed or self._spawn is None or self._retired:
                return
            ray.kill(failed, no_restart=True)
            self._handle = self._spawn()
            self.restarts += 1
            if self._retired:  # shut down while it was being spawned: the shutdown may have missed it
                ray.kill(self._handle, no_restart=True)
                raise WorkersShutDown(f"{self.name}: replacement abandoned, the workers were shut down")
            try:  # a fresh actor loads its model first: give it at least STARTUP_TIMEOUT_S
                ray.get(self._handle.stats.remote(), timeout=max(self.timeout_s or 0, STARTUP_TIMEOUT_S))
            except Exception as exc:  # noqa: BLE001 - a replacement that cannot start is one more failure
                if self._retired:
                    raise WorkersShutDown(f"{self.name}: replacement ended by the workers' shutdown") from None
                raise WorkerFailure(f"replacement {self.name} actor failed to start ({exc})",
                                    lambda: self.replace(self._handle)) from None


class _Pinned:
    def __init__(self, proxy: RemoteProxy, handle: Any):
        self._proxy = proxy
        self._handle = handle

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self._proxy.call(self._handle, name, args, kwargs)
