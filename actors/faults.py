"""Fault injection: a test hook the actors read from ``runtime.faults``, so tests exercise the real
recovery path (a real process exit, a real hang) rather than a mock of it.

Each fault is a mapping:

    actor:     generator | reward          which actor class it applies to
    method:    extend | score | search ... the public method it fires in
    call:      1                           fire from this call of that method (1-based, per actor process)
    action:    exit | hang | delay | raise os._exit(1) / sleep forever / sleep ``seconds``, then serve the call /
                                           raise WorkerFailure without serving it
    seconds:   0.0                         for delay
    times:     1                           how often it may fire across all actor processes; null = always
    state_dir: /tmp/faults                 where the firings are counted (needed when times is set; the
                                           actors of a test run share one machine)

Example: ``{actor: generator, method: extend, call: 2, action: exit, times: 1, state_dir: ...}`` kills
the first generator on its second extend; its replacement runs clean. With ``runtime.local`` the
"actors" live in the driver's process, so exit and hang there stop the driver itself. In-process,
``raise`` stands in for them: the call raises WorkerFailure, as a dead actor's call does through its
RemoteProxy, so the coordinator reruns the batch; the "actor" keeps its state (a real dead actor's
sessions die with it), so a test can count the sessions a fault left open. It is meant for
in-process runs: through Ray, exit and hang test the real thing.
"""

from __future__ import annotations

import inspect
import os
import time
from dataclasses import dataclass, fields

from pipeline.config import ConfigError
from pipeline.errors import WorkerFailure

ACTIONS = ("exit", "hang", "delay", "raise")


@dataclass
class Fault:
    actor: str
    method: str
    call: int = 1
    action: str = "exit"
    seconds: float = 0.0
    times: int | None = 1
    state_dir: str | None = None

    @classmethod
    def parse(cls, raw: dict, index: int) -> Fault:
        where = f"runtime.faults[{index}]"
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a mapping")
        names = {f.name for f in fields(cls)}
        for key in raw:
            if key not in names:
                raise ConfigError(f"{where}.{key}: unknown key (known: {', '.join(sorted(names))})")
        try:
            fault = cls(**raw)
        except TypeError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if fault.action not in ACTIONS:
            raise ConfigError(f"{where}.action: expected one of {ACTIONS}, got {fault.action!r}")
        if fault.times is not None and not fault.state_dir:
            raise ConfigError(f"{where}.state_dir: needed to count firings when times is set")
        return fault

    def should_fire(self, call: int, index: int) -> bool:
        if call < self.call:
            return False
        if self.times is None:
            return True
        os.makedirs(self.state_dir, exist_ok=True)
        for k in range(self.times):
            try:  # O_EXCL: exactly one actor process takes each firing ticket
                os.close(os.open(os.path.join(self.state_dir, f"fault-{index}-{k}"), os.O_CREAT | os.O_EXCL))
                return True
            except FileExistsError:
                continue
        return False

    def fire(self) -> None:
        if self.action == "exit":
            os._exit(1)
        if self.action == "raise":
            raise WorkerFailure(f"fault injected: {self.actor} died during {self.method}() (call {self.call})")
        if self.action == "hang":
            while True:
                time.sleep(3600)
        time.sleep(self.seconds)


def parse_faults(raw: list) -> list[Fault]:
    return [Fault.parse(item, i) for i, item in enumerate(raw or [])]


def with_faults(cls: type, role: str, faults: list[Fault]) -> type:
    """A subclass of actor class ``cls`` whose public methods first consult the fault plan
    (the faults whose ``actor`` is ``role``). With no such fault, ``cls`` itself is returned."""
    mine = [(i, f) for i, f in enumerate(faults) if f.actor == role]
    if not mine:
        return cls

    def wrap(name, method):
        def call(self, *args, **kwargs):
            self._fault_calls[name] = self._fault_calls.get(name, 0) + 1
            for index, fault in mine:
                if fault.method == name and fault.should_fire(self._fault_calls[name], index):
                    fault.fire()
            return method(self, *args, **kwargs)

        call.__name__ = name
        return call

    def __init__(self, *args, **kwargs):
        self._fault_calls = {}
        cls.__init__(self, *args, **kwargs)

    namespace = {"__init__": __init__, "__doc__": cls.__doc__}
    namespace.update({name: wrap(name, fn) for name, fn in inspect.getmembers(cls, inspect.isfunction)
                      if not name.startswith("_")})
    return type(cls.__name__, (cls,), namespace)
