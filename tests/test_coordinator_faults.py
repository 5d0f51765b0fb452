"""Coordinator fault handling without Ray: a handle that raises WorkerFailure is recovered and the
whole batch rerun (both call patterns: open/extend/close and one generator.search), retries are
bounded, and progress observers see the right counts."""

from __future__ import annotations

import pytest

from actors.factory import GeneratorHandle, InProcess, local_generator, local_scorer
from pipeline.coordinator import Coordinator
from pipeline.errors import BatchFailed
from pipeline.errors import WorkerFailure
from pipeline.decoding.best_of_n import BestOfNParams
from pipeline.decoding.domain import PromptInput, RowState, SearchOutput
from pipeline.decoding.sampling import SamplingParams
from pipeline.strategies import STRATEGIES, Strategy
from pipeline.observability import BuildMetrics, ProgressBars
from tests.conftest import GOOD_PROMPTS


class Flaky:
    """A transport whose actor 'dies' on the given calls of ``method``, like RemoteProxy's: the call
    raises WorkerFailure, and recover() counts a replacement."""

    def __init__(self, engine, method: str, fail_on: set[int]):
        self.engine = InProcess(engine)
        self.method, self.fail_on = method, fail_on
        self.calls = self.restarts = 0

    def call(self, method: str, *args, **kwargs):
        if method == self.method:
            self.calls += 1
            if self.calls in self.fail_on:
                raise WorkerFailure(f"generator died during {method}()", self.recover)
        return self.engine.call(method, *args, **kwargs)

    def pinned(self) -> Flaky:
        return self

    def recover(self):
        self.restarts += 1


def prompts(engine, n=4):
    return [PromptInput(f"id{i}", t, t, engine.tokenizer(t).input_ids) for i, t in enumerate(GOOD_PROMPTS[:n])]


def run(generator, scorer, engine, strategy="best_of_n", max_attempts=3, retries=None):
    coordinator = Coordinator(strategy, BestOfNParams(), SamplingParams(max_new_tokens=8), 3, 0, [generator],
                              [local_scorer(scorer, timed=False)], prompts_per_batch=2, batches_in_flight=1,
                              max_attempts=max_attempts, on_retry=(retries.append if retries is not None else
                                                                   lambda failure: None))
    return {r.prompt.prompt_id: [(c.sample, c.text) for c in r.candidates] for r in coordinator.run(prompts(engine))}


def test_a_failed_batch_is_recovered_and_rerun_with_the_same_candidates(engine, scorer):
    expected = run(local_generator(engine, timed=False), scorer, engine)
    flaky, retries = Flaky(engine, "extend", {2}), []
    assert run(GeneratorHandle(flaky), scorer, engine, retries=retries) == expected
    assert flaky.restarts == 1 and len(retries) == 1
    assert retries[0].attempts == 1 and retries[0].prompt_ids == ["id2", "id3"]


def test_model_side_search_calls_are_covered_too(engine, scorer, monkeypatch):
    def echo(host, token_ids, num_samples, seeds, sampling, params):
        """A candidate per row made of its seed (per-row seeds: a rerun makes the same ones)."""
        rows = [RowState(i, [40 + seed % 50], f"answer {seed}", True) for i, seed in enumerate(seeds)]
        return [SearchOutput(rows[i * num_samples:(i + 1) * num_samples], num_samples) for i in range(len(token_ids))]

    monkeypatch.setitem(STRATEGIES, "echo_search", Strategy("echo_search", BestOfNParams, "test method", search=echo))
    expected = run(local_generator(engine, timed=False), scorer, engine, strategy="echo_search")
    flaky = Flaky(engine, "search", {1})
    assert run(GeneratorHandle(flaky), scorer, engine, strategy="echo_search") == expected and flaky.restarts == 1


def test_retries_are_bounded_and_name_the_batch(engine, scorer):
    flaky, retries = Flaky(engine, "open", set(range(1, 100))), []
    with pytest.raises(BatchFailed) as info:
        run(GeneratorHandle(flaky), scorer, engine, max_attempts=2, retries=retries)
    assert info.value.attempts == 2 and info.value.prompt_ids == ["id0", "id1"]
    assert "generator died during open()" in str(info.value.cause)
    assert flaky.restarts == 1 and len(retries) == 1  # no recovery after the last attempt


def test_progress_bars_and_metrics_count_without_ray():
    bars = ProgressBars(3, "sbon")
    metrics = BuildMetrics()
    for paired, generated, bon in [(True, 10, 16), (False, 4, 4), (True, 7, 12)]:
        bars.update(paired, bon - generated)
        metrics.prompt_done(paired, generated, bon)
    assert (bars.prompts.n, bars.pairs.n, bars.saved.n) == (3, 2, 11)
    assert (metrics.totals["pairs"], metrics.totals["tokens_generated"], metrics.totals["tokens_saved"]) == (2, 21, 11)
    bars.close()
