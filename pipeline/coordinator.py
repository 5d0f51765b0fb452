"""Runs a decoding strategy for many prompts at once against generator and reward handles.

Prompts are cut into batches (``prompts_per_batch`` prompts, decoded together as one engine
batch). Each generator handle serves ``batches_in_flight`` batches at a time, so while one batch
waits for the reward model at a decision token, another is decoding on the same generator: neither
actor sits idle. A batch keeps its generator for its whole life (the KV cache lives there);
stateless reward calls are spread round-robin, and a streaming reward session (its reward-side KV
cache) stays on the reward handle that opened it.

Handles are anything that satisfies the Generator / Scorer protocols: Ray actor proxies in
production (actors.RemoteProxy), plain in-process engines wrapped in ``Serialized`` in tests.

Faults: a handle whose actor died or hung raises WorkerFailure. The coordinator then asks the
failure to recover (the proxy replaces its actor, once, however many batches saw it fail) and runs
the whole batch again from the start: its KV cache died with the actor, and per-row seeds make the
rerun produce the same candidates. This wraps whole strategy calls, so it covers every call pattern
(open/extend/close, score, or one ``generator.search``). After ``max_attempts`` the batch raises
BatchFailed, naming its prompts.
"""

from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterator

from pipeline.decoding.protocols import Generator, PromptInput, PromptResult, Scorer
from pipeline.decoding.sampling import SamplingParams
from pipeline.methods import method


class WorkerFailure(Exception):
    """An actor behind a handle died or hung. ``recover()`` replaces it (idempotent per failure)."""

    def __init__(self, message: str, recover: Callable[[], None] = lambda: None):
        super().__init__(message)
        self.recover = recover


class BatchFailed(Exception):
    """A batch failed ``attempts`` times (or is about to be retried, when passed to on_retry)."""

    def __init__(self, prompt_ids: list[str], attempts: int, cause: BaseException):
        super().__init__(f"batch of {len(prompt_ids)} prompts failed after {attempts} attempts: {cause}")
        self.prompt_ids = prompt_ids
        self.attempts = attempts
        self.cause = cause


class Serialized:
    """Lets several coordinator threads share one in-process engine, one call at a time,
    the way a Ray actor serves its callers."""

    def __init__(self, target: Any):
        self._target = target
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        method = getattr(self._target, name)

        def call(*args, **kwargs):
            with self._lock:
                return method(*args, **kwargs)

        return call


class _RoundRobin:
    def __init__(self, scorers: list[Scorer]):
        self._cycle = itertools.cycle(scorers)
        self._lock = threading.Lock()
        self._sessions: dict[str, Scorer] = {}  # streaming reward session -> the handle holding its cache

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        with self._lock:
            scorer = next(self._cycle)
        return scorer.score(prompts, responses)

    def open(self, session: str, prompts: list[str], num_samples: int) -> None:
        with self._lock:
            scorer = next(self._cycle)
            # Pinned like a generator batch: if this actor is replaced, the session's later calls
            # fail over (WorkerFailure, batch retried) instead of asking a new actor without the cache.
            scorer = self._sessions[session] = scorer.pinned() if hasattr(scorer, "pinned") else scorer
        scorer.open(session, prompts, num_samples)

    def extend(self, session: str, rows: list[int], responses: list[str]) -> list[float]:
        return self._sessions[session].extend(session, rows, responses)

    def close(self, session: str) -> dict:
        with self._lock:
            scorer = self._sessions.pop(session, None)
        return scorer.close(session) if scorer is not None else {}


class Coordinator:
    def __init__(self, strategy: str, params: Any, sampling: SamplingParams, num_samples: int, seed: int,
                 generators: list[Generator], scorers: list[Scorer], prompts_per_batch: int = 4,
                 batches_in_flight: int = 2, max_attempts: int = 1,
                 on_retry: Callable[[BatchFailed], None] = lambda failure: None):
        if not generators or not scorers:
            raise ValueError("need at least one generator and one scorer")
        self.strategy_name = strategy
        self.strategy = method(strategy).run
        self.params = params
        self.sampling = sampling
        self.num_samples = num_samples
        self.seed = seed
        self.generators = generators
        self.scorer = _RoundRobin(scorers)
        self.prompts_per_batch = prompts_per_batch
        self.batches_in_flight = batches_in_flight
        self.max_attempts = max_attempts
        self.on_retry = on_retry
        self.retries = 0

    def _run_batch(self, batch: list[PromptInput], slots: queue.Queue) -> list[PromptResult]:
        for attempt in range(1, self.max_attempts + 1):
            index = slots.get()
            generator = self.generators[index]
            # A batch's session lives in one actor: pin the batch to it (Ray proxies), so a batch
            # that outlives a replacement fails over too, rather than asking the new actor.
            generator = generator.pinned() if hasattr(generator, "pinned") else generator
            try:
                results = self.strategy(batch, generator, self.scorer, self.params, self.sampling,
                                        self.num_samples, self.seed)
                break
            except WorkerFailure as exc:
                failure = BatchFailed([p.prompt_id for p in batch], attempt, exc)
                if attempt == self.max_attempts:
                    raise failure from None
                try:
                    exc.recover()
                except WorkerFailure as again:  # the replacement did not start: the next attempt retries it
                    failure = BatchFailed(failure.prompt_ids, attempt, again)
                self.retries += 1
                self.on_retry(failure)
            finally:
                slots.put(index)
        if [r.prompt.prompt_id for r in results] != [p.prompt_id for p in batch]:
            raise RuntimeError(f"{self.strategy_name}: results do not match the batch's prompts")
        for r in results:
            if len(r.candidates) != self.num_samples:
                raise RuntimeError(f"{self.strategy_name}: prompt {r.prompt.prompt_id} has "
                                   f"{len(r.candidates)} candidates, expected {self.num_samples}")
        return results

    def run(self, prompts: list[PromptInput]) -> Iterator[PromptResult]:
        """Yields one PromptResult per prompt, in completion order."""
        batches = [prompts[i:i + self.prompts_per_batch] for i in range(0, len(prompts), self.prompts_per_batch)]
        workers = len(self.generators) * self.batches_in_flight
        slots: queue.Queue = queue.Queue()
        for _ in range(self.batches_in_flight):
            for g in range(len(self.generators)):
                slots.put(g)
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="coordinator")
        pending = iter(batches)
        running = {pool.submit(self._run_batch, b, slots) for b in itertools.islice(pending, workers)}
        try:
            while running:
                done, running = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    yield from future.result()
                    nxt = next(pending, None)
                    if nxt is not None:
                        running.add(pool.submit(self._run_batch, nxt, slots))
            pool.shutdown()
        finally:
            # On failure, don't wait for batches still running: the caller shuts the actors down,
            # which ends their calls.
            pool.shutdown(wait=False, cancel_futures=True)
