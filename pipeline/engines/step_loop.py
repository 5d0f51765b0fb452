"""The step loop: the HF engine's scheduler (continuous batching), shared by every thread that calls
one engine (a threaded GeneratorActor serving several batches, the coordinator's threads in-process).
The model work itself is the model runner's (pipeline.engines.model_runner); this module decides
what runs when.

The ``extend`` calls pending at any moment share one forward pass per step, over the live rows of
every session being extended. Their KV lives in the runner's KV cache (pipeline.engines.kv_cache):
a session's rows are admitted when they first join (each prompt's whole blocks written once and
shared by its samples), and keep their blocks until they finish or are pruned; no surviving row is
ever copied. Each call returns when its own rows reach its ``until`` (or EOS), so a session that
stops to be scored leaves the step (its rows keep their blocks) while the others go on, and a
session that opens meanwhile is prefilled between two steps and joins at its first ``extend``.

Admission and preemption go by free blocks, first come first served: a joining session waits
while its blocks do not fit (``ModelRunner.admit``), and when a step needs more blocks than are
free, the newest sessions holding blocks are preempted (their blocks given back, their KV recomputed
from their tokens when they are admitted again), as vLLM does; the oldest session always makes
progress, and a session that could never fit fails alone with a one-line KVBudgetError. Other
model work (a prefill, a model-side search, a speculative step, see the model runner) is a job,
run between two steps, one at a time.

The loop has no thread of its own: a calling thread that finds no one driving it drives it (runs
the waiting jobs, then one step, and again) until its own call is done, then hands it to a thread
still waiting. An out-of-memory inside a step is not an error of the calls: the step (which gave
back every block it took) runs again with the newest sessions preempted, down to one.

A session's fault is its own (docs/design.md, "Fault containment: row and session"). A close
(``close``, from any thread, at any time) takes the session's extend out of the step, or out of the
waiting extends if it is preempted or waiting for blocks, at the next gap between steps, and only
then frees its rows; the extend raises ``closed_error`` and the session is never admitted again. A
session whose sampler raises leaves the step alone (``Session.fault``). Any other error in a step is
attributed by stepping each member alone (``_isolate``): a member whose own step raises gets its
error, the others take the token they would have had. The loop goes on serving the others.

Rows sample from their own random streams, so with the same seeds the candidates are identical
whatever else shares the step: the paged attention reads each row's own blocks, so a row's logits
do not depend on its company beyond float rounding of batched kernels. A preempted row's recomputed
KV (one prefill) can differ from its step-by-step KV in the last bits, so a token sampled near a tie
may rarely differ after a preemption; the candidates' distribution is the same.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from pipeline.engines.model_runner import ModelRunner, Session
from pipeline.errors import SessionClosed


def closed_error(state: Session) -> SessionClosed:
    """What a session's extend raises when the session is closed before it is done (HFEngine.close
    from another thread: a caller that gave up on it, a timeout): its own error, naming it; the
    sessions beside it go on."""
    return SessionClosed(f"session {state.name or '(unnamed)'}: closed while its extend was under way")


@dataclass(eq=False)
class _Job:
    """Model work other than a decoding step, run by the thread that drives the loop, between two steps."""

    run: Callable[[], Any]
    result: Any = None
    error: BaseException | None = None
    done: bool = False


@dataclass(eq=False)
class _Member:
    """One extend's session in the step (or waiting to be admitted to it)."""

    session: Session
    left: bool = False  # the extend is done (or failed)
    error: BaseException | None = None  # why the loop dropped the session's rows


class _Containment:
    """A StepLoop's faults, each kept to the smallest unit that holds it (see the module docstring): a
    step out of memory shed, a failed step's error attributed, closed sessions taken out of the step,
    failed members ended. Uses the loop's ``runner``, ``_members``, ``_joining``, ``_closing`` and
    ``_step``; the loop's driver calls these between two steps."""

    def _shed(self, exc: BaseException) -> list[_Member]:
        """An out-of-memory inside a step (the step gave back what it took): the step again with fewer
        rows, the newest member preempted back to the head of the waiting extends each time (as
        ``_make_room`` does), so the oldest make progress; a lone member's step cannot shrink, so its
        caller gets the error."""
        while len(self._members) > 1:
            victim = self._members.pop()
            self.runner.preempt(victim.session)
            self._joining.insert(0, victim)
            try:
                return self._step()
            except (torch.OutOfMemoryError, MemoryError) as again:
                exc = again
        failed, self._members = self._members, []
        return self._fail(failed, exc)

    def _isolate(self, exc: BaseException) -> list[_Member]:
        """A step that raised (not for want of memory, or a shed step's own error; it gave back what
        it took): each member steps alone, so an error that one session's rows cause ends that
        session only, and the others take this step's token as they would have; a member whose own
        step raises gets its error (an out-of-memory too: a lone step cannot shrink). A lone member
        gets ``exc``. The solo steps need no block the shared one did not have free."""
        members, self._members = self._members, []
        if len(members) <= 1:
            return self._fail(members, exc)
        left: list[_Member] = []
        for member in members:
            state = member.session
            try:
                self.runner.step_kv([state])
                if state.fault is not None:
                    raise state.fault
            except Exception as own:  # noqa: BLE001 - this member's alone
                left += self._fail([member], own)
                continue
            (left if state.extended() else self._members).append(member)
        return left

    def _take_closed(self) -> list[_Member]:
        """The extends of the sessions closed since the last turn, out of the step and the waiting
        extends, each with ``closed_error`` (the lock held: other threads join meanwhile)."""
        if not self._closing:
            return []
        closed, self._closing = {id(s) for s in self._closing}, []
        ended = [m for m in self._members + self._joining if id(m.session) in closed]
        if ended:
            self._members = [m for m in self._members if id(m.session) not in closed]
            self._joining = [m for m in self._joining if id(m.session) not in closed]
            for member in ended:
                member.error = closed_error(member.session)
        return ended

    def _fail(self, members: list[_Member], exc: BaseException) -> list[_Member]:
        for member in members:
            member.error, member.session.rows, member.session.fault = exc, [], None
            self.runner.release(member.session)
        return members


class StepLoop(_Containment):
    """Continuous batching over one ModelRunner (see the module docstring)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._cond = threading.Condition()  # its lock guards the fields below
        self._driving: int | None = None  # the thread that runs the model now (the loop's driver)
        self._jobs: list[_Job] = []  # model work waiting for the next gap between steps
        self._joining: list[_Member] = []  # extends waiting to be admitted, first come first served
        self._members: list[_Member] = []  # extends in the step, in admission order
        self._waiters: list[tuple[Callable[[], bool], threading.Condition]] = []  # threads in _serve
        self._closing: list[Session] = []  # sessions closed since the last turn: out of the step at the next

    def extend(self, state: Session) -> None:
        """Decode ``state``'s live rows until ``state.extended()`` (its ``until`` set by the caller).
        An extend the runner speculates (``ModelRunner.speculates``, decided here, at its start) runs
        its draft-and-verify steps between the loop's steps, on its own rows; any other joins the
        step. Raises ``closed_error`` when the session is closed (``close``) before it is done."""
        if self.runner.speculates(state):
            if state.batch is None or state.fan is not None:
                self.between_steps_of(state, lambda: self.runner.unpool(state))
            while not state.extended():
                self.between_steps_of(state, lambda: self.runner.speculative_step(state))
            if state.closed:  # closed between two of its steps: its rows are gone, not done
                raise closed_error(state)
            return
        member = _Member(state)
        with self._cond:
            if state.closed:
                raise closed_error(state)
            if state.extended():
                return
            self._joining.append(member)
            self._serve(lambda: member.left)
        if member.error is not None:
            raise member.error

    def between_steps(self, run: Callable[[], Any]) -> Any:
        """Run ``run`` (model work) in the next gap between two steps of the loop; its result."""
        return self._run(_Job(run))

    def between_steps_of(self, state: Session, run: Callable[[], Any]) -> Any:
        """``between_steps`` for model work on one session's rows (a prune, a speculative step):
        ``closed_error``, nothing run, when the session is closed by the time it would run."""
        def own():
            if state.closed:
                raise closed_error(state)
            return run()

        return self._run(_Job(own))

    def close(self, state: Session) -> None:
        """End ``state`` for good, at any time (HFEngine.close): at the next gap between two steps,
        its extend in flight (stepping, preempted or waiting to be admitted) leaves the loop and raises
        ``closed_error``, then its rows are freed (``ModelRunner.close``); every other session's rows
        and tokens are what they would be without it. A session is never freed while it is a member
        of the step, and never admitted after its close."""
        self._run(_Job(lambda: self.runner.close(state)), closing=state)

    def _run(self, job: _Job, closing: Session | None = None) -> Any:
        with self._cond:
            if closing is not None:  # with its job, under the lock: an extend that would join sees it
                closing.closed = True
                self._closing.append(closing)
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
        left = self._take_closed()  # before the jobs: a close's job frees rows no step may read again
        if not jobs and not self._joining and not self._members and not left:
            raise RuntimeError("step loop: a call waits, but no work is queued")
        self._cond.release()
        try:
            for job in jobs:
                try:
                    job.result = job.run()
                except Exception as exc:  # noqa: BLE001 - it belongs to the job's caller
                    job.error = exc
            left += self._admit()
            try:
                left += self._step()
            except (torch.OutOfMemoryError, MemoryError) as exc:
                try:
                    left += self._shed(exc)
                except Exception as other:  # noqa: BLE001 - a smaller step's own error
                    left += self._isolate(other)
            except Exception as exc:  # noqa: BLE001 - whose it is: each member steps alone
                left += self._isolate(exc)
        finally:
            self._cond.acquire()
        for job in jobs:
            job.done = True
        for member in left:
            member.left = True
        if jobs or left:
            self._wake(lambda d: d(), first=False)

    @torch.inference_mode()
    def _admit(self) -> list[_Member]:
        """Admit the waiting extends, first come first served, while their blocks fit; when nothing
        steps, sessions parked between calls are preempted to make room for the first. Returns the
        extends that failed (a session that can never fit, or a model error in its recompute)."""
        failed = []
        while self._joining:
            member = self._joining[0]
            try:
                admitted = self.runner.admit(member.session)
                while not admitted and not self._members and self._preempt_parked():
                    admitted = self.runner.admit(member.session)
            except Exception as exc:  # noqa: BLE001 - the extend's caller gets it
                self._joining.pop(0)
                failed += self._fail([member], exc)
                continue
            if not admitted:
                if not self._members:  # nothing holds blocks and it still does not fit: a bug
                    self._joining.pop(0)
                    failed += self._fail([member], RuntimeError("step loop: a session fits an empty KV cache "
                                                                "but was not admitted"))
                    continue
                break
            self._joining.pop(0)
            self._members.append(member)
        return failed

    def _preempt_parked(self) -> bool:
        """Preempt the newest session holding blocks outside the step (waiting to be scored); False
        when there is none."""
        stepping = {id(m.session) for m in self._members}
        for state in reversed(self.runner.resident):
            if id(state) not in stepping:
                self.runner.preempt(state)
                return True
        return False

    def _make_room(self) -> None:
        """Preempt the newest sessions holding blocks until the step's new blocks are free: parked
        ones and members alike, newest first, never the oldest member (a preempted member goes back
        to the head of the waiting extends)."""
        while self._members and self.runner.blocks_needed([m.session for m in self._members]) > 0:
            if self._preempt_parked():
                continue
            if len(self._members) == 1:
                from pipeline.errors import KVBudgetError

                raise KVBudgetError("KV cache: one session's rows outgrow the whole pool "
                                    f"({self.runner.kv.num_blocks} blocks of {self.runner.kv.block_size} tokens); "
                                    "raise runtime.kv_cache_memory")
            victim = self._members.pop()
            self.runner.preempt(victim.session)
            self._joining.insert(0, victim)

    @torch.inference_mode()
    def _step(self) -> list[_Member]:
        """Decode one token for every member's live rows in one forward pass (the runner's step),
        then take out the members whose extend is done (returned)."""
        done = [m for m in self._members if m.session.extended()]  # e.g. no live row left
        if done:
            self._members = [m for m in self._members if m not in done]
            return done
        if not self._members:
            return []
        self._make_room()
        self.runner.step_kv([m.session for m in self._members])
        leave, stay = [], []
        for member in self._members:
            if member.session.fault is not None:  # its sampler raised: it ends alone
                leave += self._fail([member], member.session.fault)
            else:
                (leave if member.session.extended() else stay).append(member)
        self._members = stay
        return leave
