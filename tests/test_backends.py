"""The engine contract (pipeline.engines.backends: Engine, SearchEngine), run against every backend of
the registry that can run here, loaded the way the actors load it (``Backend.load_generator``).

hf runs in ``make test``; vllm in ``make test-vllm`` (marker vllm, its own venv), in both of its modes
(rounds, and continuous batching). A backend added to the registry without a case here fails
``test_every_backend_has_a_contract_case``.
"""

from __future__ import annotations

import threading

import pytest

from pipeline.decoding.domain import SearchOutput
from pipeline.decoding.sampling import SamplingParams
from pipeline.engines.backends import BACKENDS, SEARCH, SESSIONS, Engine, EngineOptions, SearchEngine

SAMPLING = SamplingParams(max_new_tokens=6, temperature=1.0)
PROMPTS = [[1, 5, 6, 7], [1, 9, 3]]
NUM_SAMPLES = 3
SEEDS = list(range(len(PROMPTS) * NUM_SAMPLES))

# (case id, backend name, continuous_batching)
CASES = [
    pytest.param(("hf", True), id="hf"),
    pytest.param(("vllm", False), id="vllm-rounds", marks=pytest.mark.vllm),
    pytest.param(("vllm", True), id="vllm-continuous", marks=pytest.mark.vllm),
]


def test_every_backend_has_a_contract_case():
    assert {case.values[0][0] for case in CASES} == set(BACKENDS)


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory) -> str:
    pytest.importorskip("vllm", reason="vllm is not installed (make install-vllm, or pip install .[vllm] on a GPU)")
    from jobs.make_tiny_models import make_vllm_model

    return str(make_vllm_model(tmp_path_factory.mktemp("vllm-model")))


@pytest.fixture(scope="module", params=CASES)
def loaded(request, tiny_models):
    """(backend record, engine) loaded through the registry."""
    name, continuous = request.param
    record = BACKENDS[name]
    if name == "hf":
        engine = record.load_generator(str(tiny_models["generator"]), EngineOptions(continuous_batching=continuous))
    else:
        model = request.getfixturevalue("vllm_model")
        engine = record.load_generator(model, EngineOptions(
            dtype="float32", continuous_batching=continuous,
            settings={"gpu_memory_utilization": 0.12, "max_model_len": 256, "max_num_batched_tokens": 512}))
    yield record, engine
    engine.shutdown()


def test_engine_satisfies_the_protocol_of_what_its_backend_serves(loaded):
    record, engine = loaded
    assert SESSIONS in record.serves and isinstance(engine, Engine)
    assert isinstance(engine, SearchEngine) == (SEARCH in record.serves)
    assert isinstance(engine.continuous_batching, bool)


def test_session_lifecycle(loaded):
    _, engine = loaded
    engine.open("s", PROMPTS, NUM_SAMPLES, SEEDS, SAMPLING)
    assert "s" in engine.sessions
    with pytest.raises(ValueError):
        engine.open("s", PROMPTS, NUM_SAMPLES, SEEDS, SAMPLING)  # an open session's id
    rows = engine.extend("s", until=2)
    assert [r.row for r in rows] == SEEDS
    assert all(len(r.token_ids) == 2 or r.finished for r in rows)
    kept = engine.extend("s", until=SAMPLING.max_new_tokens, keep=[0, 4])
    assert [r.row for r in kept] == [0, 4]
    assert all(r.finished and 0 < len(r.token_ids) <= SAMPLING.max_new_tokens for r in kept)
    # A kept row continues what it had: its first two tokens are the ones the first extend returned.
    first = {r.row: r.token_ids for r in rows}
    assert all(r.token_ids[:len(first[r.row])] == first[r.row] for r in kept)
    counters = engine.close("s")
    assert counters["generated_tokens"] >= sum(len(r.token_ids) for r in kept)
    assert "s" not in engine.sessions
    stats = engine.stats()
    assert {"generated_tokens", "forward_passes", "open_sessions"} <= set(stats) and stats["open_sessions"] == 0
    with pytest.raises(ValueError, match="unknown session"):
        engine.extend("s", until=3)


def test_same_seeds_same_rows_and_concurrent_sessions_when_batching_continuously(loaded):
    """A session's rows depend only on its seeds; with continuous batching two sessions extended
    from two threads at once come out as each does alone."""
    _, engine = loaded

    def run(session: str) -> list[list[int]]:
        engine.open(session, PROMPTS, NUM_SAMPLES, SEEDS, SAMPLING)
        try:
            return [r.token_ids for r in engine.extend(session, until=SAMPLING.max_new_tokens)]
        finally:
            engine.close(session)

    alone = run("alone")
    assert run("again") == alone
    if not engine.continuous_batching:
        return
    out: dict[str, list] = {}
    threads = [threading.Thread(target=lambda s=s: out.__setitem__(s, run(s))) for s in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert out == {"a": alone, "b": alone}


def empty_rows(host, prompts, num_samples, seeds, sampling, params) -> list[SearchOutput]:
    """A model-side search function that records the host it was given and returns empty rows."""
    from pipeline.decoding.domain import RowState

    params.append(host)
    return [SearchOutput(rows=[RowState(row=i * num_samples + s, token_ids=[], text="", finished=True)
                               for s in range(num_samples)], generated_tokens=0) for i in range(len(prompts))]


def test_search_runs_the_function_it_is_given(loaded):
    record, engine = loaded
    if SEARCH not in record.serves:  # nothing to run: such an engine has no search at all
        assert not hasattr(engine, "search")
        return
    from pipeline.decoding import ults

    hosts: list = []
    out = engine.search(empty_rows, PROMPTS, NUM_SAMPLES, SEEDS, SAMPLING, hosts)
    assert [[r.row for r in o.rows] for o in out] == [[0, 1, 2], [3, 4, 5]]
    assert len(hosts) == 1 and hosts[0].engine is engine
    searched = engine.search(ults.search, PROMPTS, NUM_SAMPLES, SEEDS, SAMPLING, ults.ULTSParams())
    assert len(searched) == len(PROMPTS) and all(len(o.rows) == NUM_SAMPLES for o in searched)
    with pytest.raises(TypeError):
        engine.search("ults", PROMPTS, NUM_SAMPLES, SEEDS, SAMPLING, None)  # a name is not a search
