"""The step loop: the HF engine's scheduler (continuous batching), shared by every thread that calls
one engine (a threaded GeneratorActor serving several batches, the coordinator's threads in-process).
The model work itself is the model runner's (pipeline.engines.model_runner); this module decides
what runs when.

The ``extend`` calls pending at any moment share one forward pass per step, over the live rows of
every session being extended. Their KV lives in the runner's KV pool (pipeline.engines.kv_pool): a
session's rows are written into pool slots when they first join (the one copy of their prefilled
KV), and stay there until they finish or are pruned, which frees their slots; no surviving row is
ever copied. Each call returns when its own rows reach its ``until`` (or EOS), so a session that
stops to be scored leaves the step (its rows keep their slots; a step computes only the rows that
step, see the pool) while the others go on, and a session that opens meanwhile is prefilled between two steps and joins at its first
``extend``. A model whose cache layers are not all full attention (sliding windows) has no pool: its
sessions share a RowBatch instead, concatenated on joining (``RowBatch.concat``) and cut on leaving
(``RowBatch.split``). Other model work (a prefill, a model-side search, a speculative step, see the
model runner) is a job, run between two steps, one at a time.

The loop has no thread of its own: a calling thread that finds no one driving it drives it (runs
the waiting jobs, then one step, and again) until its own call is done, then hands it to a thread
still waiting. A model error in a step reaches every call with rows in that step; the loop goes on
serving the others.

Rows sample from their own random streams, so with the same seeds and the same batch composition the
candidates are identical. A row's logits depend slightly on the rows that share its forward pass
(left padding to a common length, kernels chosen by batch shape; up to ~1.3e-4 on a real model), so
a token sampled near a tie in the inverse CDF may rarely differ between runs whose batches were
composed differently, and the row diverges from there. The candidates' distribution is the same.
(The tiny test models' CPU passes happen to agree exactly.)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from pipeline.engines.model_runner import ModelRunner, Session
from pipeline.engines.rows import RowBatch


@dataclass(eq=False)
class _Job:
    """Model work other than a decoding step, run by the thread that drives the loop, between two steps."""

    run: Callable[[], Any]
    result: Any = None
    error: BaseException | None = None
    done: bool = False


@dataclass(eq=False)
class _Member:
    """One extend's session in the shared batch (or waiting to join it)."""

    session: Session
    positions: list[int] = field(default_factory=list)  # the session's live rows' positions in the shared batch
    left: bool = False  # the extend is done (or failed): the rows are back in the session's own batch
    error: BaseException | None = None  # why the loop dropped the session's rows


class StepLoop:
    """Continuous batching over one ModelRunner (see the module docstring)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._cond = threading.Condition()  # its lock guards the fields below
        self._driving: int | None = None  # the thread that runs the model now (the loop's driver)
        self._jobs: list[_Job] = []  # model work waiting for the next gap between steps
        self._joining: list[_Member] = []  # extends waiting to join the shared batch
        self._members: list[_Member] = []  # extends in the shared batch, in batch order
        self._batch: RowBatch | None = None  # the members' rows (live, and finished ones riding along), one KV cache
        self._waiters: list[tuple[Callable[[], bool], threading.Condition]] = []  # threads in _serve

    def extend(self, state: Session) -> None:
        """Decode ``state``'s live rows until ``state.extended()`` (its ``until`` set by the caller).
        An extend the runner speculates (``ModelRunner.speculates``, decided here, at its start) runs
        its draft-and-verify steps between the shared batch's, on its own rows; any other joins the
        shared batch."""
        if self.runner.speculates(state):
            if state.slots is not None or state.fan is not None:
                self.between_steps(lambda: self.runner.unpool(state))
            while not state.extended():
                self.between_steps(lambda: self.runner.speculative_step(state))
            return
        if state.extended():
            return
        member = _Member(state)
        with self._cond:
            self._joining.append(member)
            self._serve(lambda: member.left)
        if member.error is not None:
            raise member.error

    def between_steps(self, run: Callable[[], Any]) -> Any:
        """Run ``run`` (model work) in the next gap between two steps of the loop; its result."""
        job = _Job(run)
        with self._cond:
            self._jobs.append(job)
            self._serve(lambda: job.done)
        if job.error is not None:
            raise job.error
        return job.result

    def _serve(self, done: Callable[[], bool]) -> None:
        """Return once ``done()``, the lock held on entry and exit. Meanwhile, if no other thread
        drives the loop, drive it: run the waiting jobs, then one step, and again, until ``done()``;
        then hand the loop to a thread still waiting. Each waiting thread sleeps on its own
        condition and is woken only when its call is done or the loop needs a new driver (a wake-up
        per step for every batch in flight would cost more than the step's bookkeeping)."""
        if self._driving == threading.get_ident():
            raise RuntimeError("step loop: an engine call from inside the engine's own model work "
                               "(a model-side search calling open, extend or search) would wait for itself")
        waiter = (done, threading.Condition(self._cond))
        self._waiters.append(waiter)
        try:
            while not done():
                if self._driving is not None:
                    waiter[1].wait()
                    continue
                self._driving = threading.get_ident()
                try:
                    while not done():
                        self._drive()
                finally:
                    self._driving = None
                    self._wake(lambda d: d is not done and not d())  # the next driver: a call not done
        finally:
            self._waiters.remove(waiter)

    def _wake(self, which: Callable[[Callable[[], bool]], bool], first: bool = True) -> None:
        """Notify the waiting threads (or only the first) whose done-test ``which`` accepts."""
        for done, condition in self._waiters:
            if which(done):
                condition.notify()
                if first:
                    return

    def _drive(self) -> None:
        """One turn of the loop, the lock held on entry and exit but released for the model's work:
        the waiting jobs, then the extends waiting to join, then one step."""
        jobs, self._jobs = self._jobs, []
        joining, self._joining = self._joining, []
        if not jobs and not joining and not self._members:
            raise RuntimeError("step loop: a call waits, but no work is queued")
        self._cond.release()
        try:
            for job in jobs:
                try:
                    job.result = job.run()
                except Exception as exc:  # noqa: BLE001 - it belongs to the job's caller
                    job.error = exc
            try:
                self._join(joining)
                left = self._step()
            except Exception as exc:  # noqa: BLE001 - the step's callers each get the error
                left = self._members + [m for m in joining if m not in self._members]
                for member in left:
                    member.error, member.session.rows = exc, []
                    self.runner.release(member.session)
                self._members, self._batch = [], None
        finally:
            self._cond.acquire()
        for job in jobs:
            job.done = True
        for member in left:
            member.left = True
        if jobs or left:
            self._wake(lambda d: d(), first=False)

    @torch.inference_mode()
    def _join(self, joining: list[_Member]) -> None:
        """Add the joining sessions' rows to the step: into the KV pool (where they stay until they
        finish, once admitted), or to the end of the shared batch."""
        if not joining:
            return
        if self.runner.pool is not None:
            for member in joining:
                self.runner.admit(member.session)
            self._members += joining
            return
        width = len(self._batch.next_position) if self._batch is not None else 0
        for member in joining:
            member.positions = list(range(width, width + len(member.session.rows)))
            width += len(member.session.rows)
        batches = [m.session.batch for m in joining]
        if self._batch is None and len(batches) == 1:
            self._batch = batches[0]  # the shared batch is this session's: nothing to copy
        else:
            self._batch = RowBatch.concat(([self._batch] if self._batch is not None else []) + batches,
                                          counted_by=(self.runner,))
        self._members += joining
        for member in joining:
            member.session.batch = None  # its rows live in the shared batch until they leave

    @torch.inference_mode()
    def _step(self) -> list[_Member]:
        """Decode one token for every member's live rows in one forward pass (the runner's step),
        then cut out the members whose extend is done (returned). Rows that finish stay in the
        shared batch, fed a placeholder token and never sampled, until they make up an eighth of it
        or a member leaves: cutting them out at once would copy the whole KV cache at almost every
        step."""
        if not self._members:
            return []
        if self.runner.pool is not None:
            self.runner.step_pool([m.session for m in self._members])
            leave = [m for m in self._members if m.session.extended()]
            self._members = [m for m in self._members if m not in leave]
            return leave
        live = [p for m in self._members for p in m.positions]  # ascending: members in batch order
        finished = self.runner.step(self._batch, [m.session for m in self._members], live)
        stay: list[_Member] = []
        leave: list[_Member] = []
        for member, done in zip(self._members, finished):
            if done:
                gone = set(done)
                member.positions = [p for i, p in enumerate(member.positions) if i not in gone]
            (leave if member.session.extended() else stay).append(member)
        width = len(self._batch.next_position)
        riding = width - sum(len(m.positions) for m in self._members)  # finished rows still in the batch
        if not leave and riding * 8 < width:
            return []
        parts = self._batch.split([[p for m in stay for p in m.positions]] + [m.positions for m in leave])
        for member, part in zip(leave, parts[1:]):
            member.session.batch, member.positions = part, []
        position = 0
        for member in stay:
            member.positions = list(range(position, position + len(member.positions)))
            position += len(member.positions)
        self._members = stay
        self._batch = parts[0] if stay else None
        return leave
