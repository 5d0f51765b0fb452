"""Runs a decoding strategy for many prompts at once against generator and reward handles.

Prompts are cut into batches (``prompts_per_batch`` prompts, decoded together as one engine
batch). Each generator handle serves ``batches_in_flight`` batches at a time, so while one batch
waits for the reward model at a decision token, another is decoding on the same generator: neither
actor sits idle. With ``rows_in_flight`` a generator also takes a new batch only while its batches'
live rows (as their open / extend(keep) / close calls and the rows they report finished show them)
number fewer than that: a batch that prunes its candidates makes room for the next batch at once,
and with continuous batching (pipeline.engines.hf's step loop) the rows of every batch in flight
share each step, so the generator stays full. A batch keeps its generator for its whole life (the
KV cache lives there); stateless reward calls are spread round-robin, and a streaming reward
session (its reward-side KV cache) stays on the reward handle that opened it.

Handles are the layered chain actors.factory assembles (its docstring gives the whole order). The
coordinator adds the two outer layers, per batch: ``handle.pinned()``, the handle bound to the
actor that holds the batch's session (in-process, the handle itself), and over it, with
``rows_in_flight``, ``_CountedRows``, which reports the batch's live rows to the admission.

Faults: a handle whose actor died or hung raises WorkerFailure ("hung": a call ran longer than
runtime.call_timeout_s from when the actor started it; time queued on the actor does not count,
see actors.remote). The coordinator then asks the failure to recover (the proxy replaces its actor,
once, however many batches saw it fail) and runs the whole batch again from the start: its KV cache
died with the actor, and per-row seeds make the rerun produce the same candidates (with continuous
batching, up to the rare token that differs when the batch shares its passes with other batches:
runtime.continuous_batching in pipeline.config). This wraps whole strategy calls, so it covers every
call pattern (open/extend/close, score, or one ``generator.search``). After ``max_attempts`` the
batch raises BatchFailed, naming its prompts.

A slot whose actor cannot be replaced (its node was lost and no other node has room: the handle's
``lost`` says why) is given up: the pool goes on with the role's other actors, and the batch's next
attempt runs on one of them. With none of the role left, the batch fails at once with that reason
rather than waiting on capacity that is gone.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterator

from pipeline.config import Config
from pipeline.decoding.domain import Generator, PromptInput, PromptResult, Scorer, SearchOutput
from pipeline.decoding.sampling import SamplingParams
from pipeline.errors import BatchFailed, WorkerFailure
from pipeline.strategies import lookup


def sampling_params(config: Config) -> SamplingParams:
    """The sampling every candidate of a build is drawn with (config.sampling)."""
    s = config.sampling
    return SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)


class _Admission:
    """Which generator a batch starts on, and when: one with fewer than ``batches`` batches and (when
    ``rows`` > 0) room for the batch's rows under ``rows`` live rows in flight, or no rows in flight
    at all (a batch larger than the limit runs alone); the least loaded one first. The limit holds:
    a generator's KV memory is sized by it (runtime.rows_in_flight).

    ``generators`` is the coordinator's list of handles, read as it is now: a generator added to it
    (runtime.generator_actors as a range: a node joined) takes batches within POLL_S; one whose
    slot is being replaced (its handle's ``replacing``) takes none meanwhile, so new batches go to the
    others instead of waiting on the replacement."""

    POLL_S = 0.5

    def __init__(self, generators: list | int, batches: int, rows: int):
        self._generators = [None] * generators if isinstance(generators, int) else generators
        self._batches, self._rows = [0] * len(self._generators), [0] * len(self._generators)
        self._max_batches, self._max_rows = batches, rows
        self._cond = threading.Condition()
        self._retired: dict[int, str] = {}  # generator given up -> why

    def acquire(self, rows: int = 0) -> int:
        """A generator for a new batch, counted with ``rows`` rows until the batch says otherwise.
        WorkerFailure (with the reason) once every generator was given up (retire)."""
        with self._cond:
            while True:
                added = len(self._generators) - len(self._batches)
                self._batches += [0] * added
                self._rows += [0] * added
                if len(self._retired) == len(self._batches):
                    raise WorkerFailure(f"no generator left: {'; '.join(self._retired.values())}")
                free = [g for g in range(len(self._batches)) if self._batches[g] < self._max_batches
                        and g not in self._retired and not getattr(self._generators[g], "replacing", False)
                        and (not self._max_rows or not self._rows[g] or self._rows[g] + rows <= self._max_rows)]
                if free:
                    index = min(free, key=lambda g: (self._rows[g], self._batches[g], g))
                    self._batches[index] += 1
                    self._rows[index] += rows
                    return index
                self._cond.wait(self.POLL_S)

    def release(self, index: int) -> None:
        with self._cond:
            self._batches[index] -= 1
            self._cond.notify_all()

    def retire(self, index: int, why: str) -> None:
        """Take no more batches to generator ``index`` (its slot was given up: ``why``)."""
        with self._cond:
            self._retired[index] = why
            self._cond.notify_all()

    def live(self) -> int:
        """Generators not given up."""
        with self._cond:
            return len(self._generators) - len(self._retired)

    def share(self, rows_per_prompt: int, prompts: int) -> int:
        """One batch's share of a generator's ``rows_per_prompt`` (what its whole KV pool holds for
        the batch's ``prompts``): 1 / batches of it, and no more than ``rows`` rows in all."""
        share = rows_per_prompt // self._max_batches
        return min(share, self._max_rows // max(prompts, 1)) if self._max_rows else share

    def add_rows(self, index: int, rows: int) -> None:
        if not rows:
            return
        with self._cond:
            self._rows[index] += rows
            self._cond.notify_all()


class _CountedRows:
    """A generator as one batch's strategy sees it, reporting the batch's live rows to the admission:
    a session's rows count from its open, drop to ``keep`` when an extend prunes, to the unfinished
    rows an extend returns, and to none at its close (or when the batch ends, however it ends). A
    search counts its rows for as long as it runs. The outermost layer of the handle chain."""

    def __init__(self, generator: Generator, admission: _Admission, index: int, reserved: int):
        self._generator, self._admission, self._index = generator, admission, index
        # session (or a running search's own key) -> its live rows; None: the rows the batch was
        # admitted with, until its first open or search
        self._sessions: dict[object, int] = {None: reserved}

    def _set(self, session: object, rows: int) -> None:
        self._admission.add_rows(self._index, rows - self._sessions.get(session, 0))
        self._sessions[session] = rows

    def open(self, session: str, prompts: list[list[int]], num_samples: int, seeds: list[int],
             sampling: SamplingParams, rewards: bool = False) -> None:
        self._set(None, 0)
        self._set(session, len(seeds))
        asked = {"rewards": True} if rewards else {}  # only when asked: see Generator.open
        return self._generator.open(session, prompts, num_samples, seeds, sampling, **asked)

    def extend(self, session: str, until: int, keep: list[int] | None = None) -> list:
        if keep is not None:
            self._set(session, min(len(keep), self._sessions.get(session, len(keep))))
        rows = self._generator.extend(session, until=until, keep=keep)
        self._set(session, sum(not r.finished for r in rows))
        return rows

    def close(self, session: str) -> dict:
        self._set(session, 0)
        return self._generator.close(session)

    def capacity(self, prompts: list[list[int]], until: int) -> int:
        """The generator's answer, shared: its pool over the batches it takes at once, and at most
        rows_in_flight rows for the batch (memory-budget speculative rejection sizes its batch by it)."""
        return self._admission.share(self._generator.capacity(prompts, until), len(prompts))

    def search(self, search: Callable[..., list[SearchOutput]], prompts: list[list[int]], num_samples: int,
               seeds: list[int], sampling: SamplingParams, params) -> list[SearchOutput]:
        call = object()  # this search's key: a batch may run more than one
        self._set(None, 0)
        self._set(call, len(seeds))
        try:
            return self._generator.search(search, prompts, num_samples, seeds, sampling, params)
        finally:
            self._set(call, 0)

    def release(self) -> None:
        """The batch ended: whatever it did not close no longer counts."""
        self._admission.add_rows(self._index, -sum(self._sessions.values()))
        self._sessions.clear()


class _RoundRobin:
    """The scorers as one Scorer: each stateless call to the next handle in turn; a streaming
    session's calls to the pinned handle that opened it."""

    def __init__(self, scorers: list[Scorer]):
        self._scorers = scorers
        self._cycle = itertools.cycle(scorers)
        self._lock = threading.Lock()
        self._sessions: dict[str, Scorer] = {}  # streaming reward session -> the handle holding its cache

    def _next(self) -> Scorer:
        """The next scorer whose slot was not given up (its ``lost``); WorkerFailure, naming why,
        when every one was."""
        with self._lock:
            for _ in self._scorers:
                scorer = next(self._cycle)
                if not getattr(scorer, "lost", None):
                    return scorer
        raise WorkerFailure(f"no reward actor left: {'; '.join(s.lost for s in self._scorers)}")

    def lost(self) -> str | None:
        """Why no scorer is left, or None while one is."""
        reasons = [getattr(s, "lost", None) for s in self._scorers]
        return None if not all(reasons) else f"no reward actor left: {'; '.join(reasons)}"

    def score(self, prompts: list[str], responses: list[str], finished: list[bool] | None = None,
              columns: list[dict] | None = None) -> list[float]:
        return self._next().score(prompts, responses, finished=finished, columns=columns)

    def open(self, session: str, prompts: list[str], num_samples: int, columns: list[dict] | None = None) -> None:
        # Pinned like a generator batch: if this actor is replaced, the session's later calls
        # fail over (WorkerFailure, batch retried) instead of asking a new actor without the cache.
        scorer = self._next().pinned()
        with self._lock:
            self._sessions[session] = scorer
        scorer.open(session, prompts, num_samples, columns=columns)

    def extend(self, session: str, rows: list[int], responses: list[str],
               finished: list[bool] | None = None) -> list[float]:
        return self._sessions[session].extend(session, rows, responses, finished=finished)

    def close(self, session: str) -> dict:
        with self._lock:
            scorer = self._sessions.pop(session, None)
        return scorer.close(session) if scorer is not None else {}


class Coordinator:
    def __init__(self, strategy: str, params: Any, sampling: SamplingParams, num_samples: int, seed: int,
                 generators: list[Generator], scorers: list[Scorer], prompts_per_batch: int = 4,
                 batches_in_flight: int = 2, max_attempts: int = 1,
                 on_retry: Callable[[BatchFailed], None] = lambda failure: None, rows_in_flight: int = 0,
                 max_generators: int = 0):
        """``generators`` / ``scorers``: handles with ``pinned()`` (actors.factory's chain).
        ``rows_in_flight`` > 0: a generator takes a new batch only while fewer candidate rows than
        that are live on it (see the module docstring); 0: ``batches_in_flight`` alone decides.
        ``max_generators``: the most generators ``generators`` may grow to while a run goes on (the
        list is the factory's, which appends a generator when a node joins); batches are handed out
        for that many, those beyond the current generators' share waiting for one to be free."""
        if not generators or not scorers:
            raise ValueError("need at least one generator and one scorer")
        self.strategy_name = strategy
        self.strategy = lookup(strategy).run
        self.params = params
        self.sampling = sampling
        self.num_samples = num_samples
        self.seed = seed
        self.generators = generators
        self.scorer = _RoundRobin(scorers)
        self.prompts_per_batch = prompts_per_batch
        self.batches_in_flight = batches_in_flight
        self.rows_in_flight = rows_in_flight
        self.max_attempts = max_attempts
        self.max_generators = max_generators
        self.on_retry = on_retry
        self.retries = 0

    @classmethod
    def from_config(cls, config: Config, generators: list[Generator], scorers: list[Scorer],
                    on_retry: Callable[[BatchFailed], None] | None = None) -> Coordinator:
        """The coordinator a build runs: ``config``'s strategy, sampling, seed, and every runtime
        setting that decides how batches are admitted and retried (prompts_per_batch,
        batches_in_flight, rows_in_flight, max_attempts), so that whatever runs one (a build, a
        benchmark) measures the same policy."""
        rt = config.runtime
        return cls(config.strategy.name, config.strategy.params, sampling_params(config),
                   config.sampling.num_samples, config.seed, generators, scorers, rt.prompts_per_batch,
                   rt.batches_in_flight, max_attempts=rt.max_attempts, rows_in_flight=rt.rows_in_flight,
                   on_retry=on_retry or (lambda failure: None), max_generators=rt.generator_range[1])

    def _run_batch(self, batch: list[PromptInput], admission: _Admission) -> list[PromptResult]:
        prompt_ids = [p.prompt_id for p in batch]
        for attempt in range(1, self.max_attempts + 1):
            reserved = len(batch) * self.num_samples if self.rows_in_flight else 0
            try:
                index = admission.acquire(reserved)
            except WorkerFailure as exc:  # every generator was given up
                raise BatchFailed(prompt_ids, attempt - 1, exc) from None
            generator = None
            try:
                # A batch's session lives in one actor: pin the batch to it, so a batch that outlives a
                # replacement fails over too, rather than asking the new actor. Pinned, and counting its
                # rows for the admission (with no rows_in_flight they count for nothing).
                generator = _CountedRows(self.generators[index].pinned(), admission, index, reserved)
                results = self.strategy(batch, generator, self.scorer, self.params, self.sampling,
                                        self.num_samples, self.seed)
                break
            except WorkerFailure as exc:
                failure = BatchFailed(prompt_ids, attempt, exc)
                if attempt == self.max_attempts:
                    raise failure from None
                try:
                    note = exc.recover()
                    if note:  # what the recovery found (a lost node) joins the retry's line
                        failure = BatchFailed(prompt_ids, attempt, WorkerFailure(f"{exc}; {note}"))
                except WorkerFailure as again:  # the replacement did not start: the next attempt retries it
                    failure = BatchFailed(prompt_ids, attempt, again)
                self._give_up_lost(admission)
                if not admission.live() or self.scorer.lost():  # nothing left to run the batch on
                    raise failure from None
                self.retries += 1
                self.on_retry(failure)
            finally:
                if isinstance(generator, _CountedRows):
                    generator.release()
                admission.release(index)
        if [r.prompt.prompt_id for r in results] != [p.prompt_id for p in batch]:
            raise RuntimeError(f"{self.strategy_name}: results do not match the batch's prompts")
        for r in results:
            if len(r.candidates) != self.num_samples:
                raise RuntimeError(f"{self.strategy_name}: prompt {r.prompt.prompt_id} has "
                                   f"{len(r.candidates)} candidates, expected {self.num_samples}")
        return results

    def _give_up_lost(self, admission: _Admission) -> None:
        """Generators whose slot was given up (their ``lost``) take no more batches."""
        for index, handle in enumerate(self.generators):
            why = getattr(handle, "lost", None)
            if why:
                admission.retire(index, why)

    def run(self, prompts: list[PromptInput]) -> Iterator[PromptResult]:
        """Yields one PromptResult per prompt, in completion order."""
        batches = [prompts[i:i + self.prompts_per_batch] for i in range(0, len(prompts), self.prompts_per_batch)]
        workers = max(len(self.generators), self.max_generators) * self.batches_in_flight
        admission = _Admission(self.generators, self.batches_in_flight, self.rows_in_flight)
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="coordinator")
        pending = iter(batches)
        running = {pool.submit(self._run_batch, b, admission) for b in itertools.islice(pending, workers)}
        try:
            while running:
                done, running = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    yield from future.result()
                    nxt = next(pending, None)
                    if nxt is not None:
                        running.add(pool.submit(self._run_batch, nxt, admission))
            pool.shutdown()
        finally:
            # On failure, don't wait for batches still running: the caller shuts the actors down,
            # which ends their calls.
            pool.shutdown(wait=False, cancel_futures=True)
