"""Coordinator scheduling without Ray: rows in flight decide when a generator takes the next batch,
a search's rows count while it runs, and continuous batching (pipeline.engines.hf's step loop) under
the coordinator's threads changes no candidate."""

import threading

import pytest

from actors.factory import local_generator, local_scorer
from pipeline.coordinator import Coordinator, _Admission, _CountedRows
from pipeline.decoding.domain import PromptInput, RowState
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative_rejection import SpeculativeRejectionParams
from pipeline.engines.hf import HFEngine
from tests.conftest import GOOD_PROMPTS


class Rows:
    """A generator whose extend reports the kept rows, the first ``finished`` of them finished."""

    def __init__(self, finished: int = 0):
        self.finished = finished

    def open(self, session, prompts, num_samples, seeds, sampling):
        pass

    def extend(self, session, until, keep=None):
        return [RowState(row=r, token_ids=[], text="", finished=i < self.finished) for i, r in enumerate(keep)]

    def close(self, session):
        return {}


class Waiting:
    """A batch waiting for admission on a thread of its own."""

    def __init__(self, admission: _Admission, rows: int):
        self.got: list[int] = []
        self.thread = threading.Thread(target=lambda: self.got.append(admission.acquire(rows)), daemon=True)
        self.thread.start()

    def admitted(self, seconds: float) -> bool:
        self.thread.join(seconds)
        return bool(self.got)


def test_a_batch_is_admitted_once_its_rows_fit_under_the_limit():
    """runtime.rows_in_flight holds (the KV pool is sized by it): a batch waits until its rows fit
    beside the live ones; a batch larger than the limit runs alone, never beside another."""
    admission = _Admission(generators=1, batches=8, rows=10)
    first = _CountedRows(Rows(finished=1), admission, admission.acquire(6), reserved=6)
    second = Waiting(admission, 6)
    assert not second.admitted(0.2)  # 6 + 6 rows > 10: it waits...
    first.open("s", [[1], [2]], 3, list(range(6)), SamplingParams())
    first.extend("s", until=4, keep=[0, 1, 2, 3, 4])  # ...at 5 rows, then 4 (one row finished)
    assert second.admitted(1.0)  # 4 + 6 = 10 rows: it fits
    third = Waiting(admission, 1)
    assert not third.admitted(0.2)  # 11 rows would not
    first.close("s")
    assert third.admitted(1.0) and admission._rows == [7]
    alone = _Admission(generators=1, batches=8, rows=10)
    alone.acquire(16)  # nothing in flight: a batch over the limit runs...
    assert not Waiting(alone, 1).admitted(0.2)  # ...alone


def test_batches_in_flight_still_caps_a_generator_and_release_returns_the_rows():
    admission = _Admission(generators=2, batches=1, rows=100)
    counted = [_CountedRows(Rows(), admission, admission.acquire(4), reserved=4) for _ in range(2)]
    assert sorted(c._index for c in counted) == [0, 1]  # the least loaded generator first
    waiting = Waiting(admission, 4)
    assert not waiting.admitted(0.2)  # one batch each: full
    counted[0].release()
    admission.release(counted[0]._index)
    assert waiting.admitted(1.0) and waiting.got == [counted[0]._index]
    assert admission._rows[counted[0]._index] == 4  # the released batch's rows left with it


class Searching:
    """A generator whose search runs until the test lets it end."""

    def __init__(self):
        self.started, self.end = threading.Event(), threading.Event()

    def search(self, search, prompts, num_samples, seeds, sampling, params):
        self.started.set()
        assert self.end.wait(5.0)
        return search(prompts, num_samples)


def test_a_search_counts_its_rows_while_it_runs():
    admission = _Admission(generators=1, batches=8, rows=10)
    generator = Searching()
    counted = _CountedRows(generator, admission, admission.acquire(4), reserved=4)
    results = []
    running = threading.Thread(target=lambda: results.append(counted.search(
        lambda prompts, n: ["done"] * len(prompts), [[1], [2], [3]], 2, list(range(6)), SamplingParams(), None)),
        daemon=True)
    running.start()
    assert generator.started.wait(1.0)
    assert admission._rows == [6]  # the batch's 4 reserved rows gave way to the search's 6
    generator.end.set()
    running.join(1.0)
    assert results == [["done"] * 3] and admission._rows == [0]


def prompts(engine, n=6):
    return [PromptInput(f"id{i}", t, t, engine.tokenizer(t).input_ids) for i, t in enumerate(GOOD_PROMPTS[:n])]


def test_continuous_batching_under_the_coordinator_gives_the_same_candidates(engine, scorer):
    params = SpeculativeRejectionParams(decision_token=[3, 6], rejection_rate=0.5)
    sampling = SamplingParams(max_new_tokens=12)

    def run(generator, **kwargs):
        coordinator = Coordinator("sbon", params, sampling, 4, 0, [generator], [local_scorer(scorer, timed=False)],
                                  **kwargs)
        return {r.prompt.prompt_id: [(c.token_ids, c.text, c.score, c.stopped_early) for c in r.candidates]
                for r in coordinator.run(prompts(engine))}

    expected = run(local_generator(engine, timed=False), prompts_per_batch=2, batches_in_flight=1)
    shared = HFEngine(engine.model, engine.tokenizer)
    got = run(local_generator(shared, concurrent=True, timed=False), prompts_per_batch=1, batches_in_flight=6,
              rows_in_flight=10)
    # Candidates are identical; the reward model scores other batches, so scores agree to rounding.
    assert {k: [c[:2] + c[3:] for c in v] for k, v in got.items()} == {k: [c[:2] + c[3:] for c in v]
                                                                        for k, v in expected.items()}
    for prompt_id, candidates in got.items():
        assert [c[2] for c in candidates] == pytest.approx([c[2] for c in expected[prompt_id]], abs=1e-5)
    assert any(c[3] for v in got.values() for c in v)  # precondition: some candidates were stopped early
    assert shared.sessions == {}
