"""The vLLM backend on a real vLLM engine (``make test-vllm``: vLLM's CPU backend in .venv-vllm;
on a GPU node, the [vllm] extra). One engine serves the module: starting one takes 30-90 s on CPU.

The rounds engine (VLLMEngine: LLM.generate per call) and the continuous one (ContinuousVLLMEngine:
a request per row on the engine's step loop) share that engine, one test at a time.

The generator is jobs.make_tiny_models.make_vllm_model (head size 64: vLLM's CPU attention does not
take the tiny generator's 16); the reward model is the tiny one, on the HF RewardScorer.
"""

from __future__ import annotations

import pytest

from pipeline.decoding.best_of_n import BestOfNParams, best_of_n
from pipeline.decoding.domain import PromptInput
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative_rejection import SpeculativeRejectionParams, speculative_rejection

pytestmark = pytest.mark.vllm

N = 8
SAMPLING = SamplingParams(max_new_tokens=24, temperature=1.0)


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory) -> str:
    pytest.importorskip("vllm", reason="vllm is not installed (make install-vllm, or pip install .[vllm] on a GPU)")
    from jobs.make_tiny_models import make_vllm_model

    return str(make_vllm_model(tmp_path_factory.mktemp("vllm-model")))


@pytest.fixture(scope="module")
def vllm_engine(vllm_model):
    from pipeline.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine.from_pretrained(vllm_model, dtype="float32", gpu_memory_utilization=0.12, max_model_len=256,
                                        max_num_batched_tokens=512)
    yield engine
    del engine


@pytest.fixture(scope="module")
def continuous(vllm_engine):
    """The continuous engine over the same vLLM engine (its step thread idles between tests)."""
    import functools

    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    from pipeline.engines.vllm_engine import ContinuousVLLMEngine

    return ContinuousVLLMEngine(vllm_engine.llm, vllm_engine.tokenizer, vllm_engine.eos_ids,
                                functools.partial(VLLMSamplingParams, output_kind=RequestOutputKind.DELTA))


def prompts(engine, count: int) -> list[PromptInput]:
    texts = [f"Write a short review of product number {i}." for i in range(count)]
    return [PromptInput(f"p{i}", t, t, engine.tokenizer(t).input_ids) for i, t in enumerate(texts)]


def tokens(results) -> list[list[list[int]]]:
    return [[c.token_ids for c in r.candidates] for r in results]


def test_best_of_n_accounts_for_every_row_and_is_reproducible_at_160_rows(vllm_engine, scorer):
    batch = prompts(vllm_engine, 20)  # 20 prompts x 8 samples = 160 seeded requests in one call
    engine_tokens = vllm_engine.generated_tokens
    first = best_of_n(batch, vllm_engine, scorer, BestOfNParams(), SAMPLING, N, seed=3)
    assert [r.prompt.prompt_id for r in first] == [p.prompt_id for p in batch]
    for r in first:
        assert sorted(c.sample for c in r.candidates) == list(range(N))
        assert all(c.completed and not c.stopped_early for c in r.candidates)
        assert all(len(c.token_ids) <= SAMPLING.max_new_tokens for c in r.candidates)
    lengths = [len(c.token_ids) for r in first for c in r.candidates]
    assert sum(r.generated_tokens for r in first) == sum(lengths)
    # The engine's own count includes each EOS it sampled: one per row that ended before the cap.
    assert vllm_engine.generated_tokens - engine_tokens == sum(lengths) + sum(n < 24 for n in lengths)
    again = best_of_n(batch, vllm_engine, scorer, BestOfNParams(), SAMPLING, N, seed=3)
    assert tokens(again) == tokens(first)  # same seeds, same candidates
    other = best_of_n(batch[:2], vllm_engine, scorer, BestOfNParams(), SAMPLING, N, seed=4)
    assert tokens(other) != tokens(first[:2])
    assert len({tuple(c.token_ids) for c in first[0].candidates}) > 1  # rows are independent samples


def test_speculative_rejection_stops_rows_and_agrees_with_best_of_n_up_to_the_decision_token(vllm_engine, scorer):
    batch = prompts(vllm_engine, 4)
    bon = best_of_n(batch, vllm_engine, scorer, BestOfNParams(), SAMPLING, N, seed=5)
    sbon = speculative_rejection(batch, vllm_engine, scorer, SpeculativeRejectionParams(8, 0.5, keep_lowest=False),
                                 SAMPLING, N, seed=5)
    for a, b in zip(sbon, bon):
        assert sorted(c.sample for c in a.candidates) == list(range(N))
        stopped = [c for c in a.candidates if c.stopped_early]
        assert len(stopped) >= 1 and all(c.stopped_at == 8 and len(c.token_ids) == 8 for c in stopped)
        # The first segment is the same request (same segment seed) in both runs.
        assert [c.token_ids[:8] for c in a.candidates] == [c.token_ids[:8] for c in b.candidates]
    assert sum(r.generated_tokens for r in sbon) < sum(r.generated_tokens for r in bon)


def test_alpha_zero_keeps_every_row_and_chooses_the_best_final_reward(vllm_engine, scorer):
    batch = prompts(vllm_engine, 3)
    results = speculative_rejection(batch, vllm_engine, scorer, SpeculativeRejectionParams(8, 0.0), SAMPLING, N,
                                    seed=6)
    for r in results:
        assert not any(c.stopped_early for c in r.candidates) and all(c.completed for c in r.candidates)
        # Each reward is the final one: re-scoring the completed texts gives the same numbers.
        rescored = scorer.score([r.prompt.reward_input] * N, [c.text for c in r.candidates])
        assert [c.score for c in r.candidates] == pytest.approx(rescored, rel=1e-4, abs=1e-5)


def test_a_row_ends_at_its_first_eos(vllm_engine, scorer):
    batch = prompts(vllm_engine, 4)
    free = best_of_n(batch, vllm_engine, scorer, BestOfNParams(), SAMPLING, N, seed=7)
    counts: dict[int, int] = {}
    for r in free:
        for c in r.candidates:
            for t in set(c.token_ids[1:]):
                counts[t] = counts.get(t, 0) + 1
    stop = max(counts, key=counts.get)  # a token many rows sample after their first: make it an EOS
    saved = set(vllm_engine.eos_ids)
    vllm_engine.eos_ids = saved | {stop}
    try:
        ended = best_of_n(batch, vllm_engine, scorer, BestOfNParams(), SAMPLING, N, seed=7)
    finally:
        vllm_engine.eos_ids = saved
    hits = 0
    for before, after in zip(free, ended):
        for c0, c1 in zip(before.candidates, after.candidates):
            if stop in c0.token_ids:
                hits += 1
                assert c1.token_ids == c0.token_ids[:c0.token_ids.index(stop)] and c1.completed
            else:
                assert c1.token_ids == c0.token_ids
            assert stop not in c1.token_ids
    assert hits >= 3


def test_continuous_best_of_n_equals_the_rounds_engine_at_160_rows(vllm_engine, continuous, scorer):
    batch = prompts(vllm_engine, 20)
    rounds = best_of_n(batch, vllm_engine, scorer, BestOfNParams(), SAMPLING, N, seed=3)
    before = continuous.generated_tokens
    got = best_of_n(batch, continuous, scorer, BestOfNParams(), SAMPLING, N, seed=3)
    assert tokens(got) == tokens(rounds)  # one request per row, the seed of its position 0
    lengths = [len(c.token_ids) for r in got for c in r.candidates]
    assert continuous.generated_tokens - before == sum(lengths) + sum(n < 24 for n in lengths)
    assert continuous.sessions == {} and continuous._requests == {}


def test_continuous_speculative_rejection_from_many_threads_aborts_pruned_rows(vllm_engine, continuous, scorer):
    """Four batches in flight at once on the one engine, each pruning on its own schedule: every
    candidate is Best-of-N's row (whole when kept, its first tau tokens when stopped)."""
    from concurrent.futures import ThreadPoolExecutor

    from actors.factory import local_scorer

    batch = prompts(vllm_engine, 8)
    long = SamplingParams(max_new_tokens=64, temperature=1.0)
    bon = best_of_n(batch, vllm_engine, scorer, BestOfNParams(), long, N, seed=8)
    params = SpeculativeRejectionParams([8, 16], 0.5)
    before = continuous.generated_tokens
    shared = local_scorer(scorer, timed=False)  # one reward call at a time, as a reward actor serves them
    with ThreadPoolExecutor(4) as pool:  # row seeds follow the prompt ids: the same as best_of_n's
        parts = list(pool.map(lambda i: speculative_rejection(batch[i:i + 2], continuous, shared, params, long, N,
                                                              seed=8), range(0, 8, 2)))
    sbon = [r for part in parts for r in part]
    stopped = 0
    for a, b in zip(sbon, bon):
        assert sorted(c.sample for c in a.candidates) == list(range(N))
        for c, full in zip(a.candidates, b.candidates):
            if c.stopped_early:
                stopped += 1
                assert c.token_ids == full.token_ids[:c.stopped_at] and len(c.token_ids) == c.stopped_at
            else:
                assert c.token_ids == full.token_ids and c.completed
    assert stopped >= 8
    assert continuous.generated_tokens - before < sum(r.generated_tokens for r in bon)
    # Every token the engine decoded is some prompt's cost, those decoded while rewards were
    # computed included (issue 27: they were left out). The engine also counts each EOS, which no
    # response holds (generated_tokens counts response tokens): one per row that ended on it, and
    # at most one per stopped row, which may have reached its EOS while it was being scored.
    eos = sum(c.completed and not c.stopped_early and len(c.token_ids) < 64 for r in sbon for c in r.candidates)
    uncounted = continuous.generated_tokens - before - sum(r.generated_tokens for r in sbon)
    assert eos <= uncounted <= eos + stopped
    assert continuous.sessions == {} and continuous._requests == {}


@pytest.fixture(scope="module")
def speculative_engine(vllm_model):
    """A second engine on the same model, with vLLM's ngram speculative decoding (models.speculative)
    while at most 8 requests decode, and its statistics on (to count the drafted tokens)."""
    from pipeline.decoding.speculative import SpeculativeDecoding
    from pipeline.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine.from_pretrained(vllm_model, dtype="float32", gpu_memory_utilization=0.12, max_model_len=256,
                                        max_num_batched_tokens=512, disable_log_stats=False,
                                        speculative=SpeculativeDecoding(4, prompt_lookup_min=1, max_rows=8))
    yield engine
    engine.shutdown()


def _drafted(engine) -> int:
    return sum(int(getattr(m, "value", 0)) for m in engine.llm.get_metrics() if m.name == "vllm:spec_decode_num_draft_tokens")


def test_speculative_decoding_on_vllm_keeps_greedy_rows_and_speculates_only_small_batches(vllm_engine,
                                                                                      speculative_engine, scorer):
    """vLLM's ngram speculative decoding (models.speculative): greedy rows equal the plain engine's
    (its rejection sampling keeps the target's distribution; greedy makes that a token check), it
    drafts while at most max_rows requests decode and not above, and speculative rejection on it
    accounts for every row."""
    greedy = SamplingParams(max_new_tokens=48, temperature=0)
    batch = prompts(vllm_engine, 2)
    plain = best_of_n(batch, vllm_engine, scorer, BestOfNParams(), greedy, 2, seed=1)
    before = _drafted(speculative_engine)
    fast = best_of_n(batch, speculative_engine, scorer, BestOfNParams(), greedy, 2, seed=1)  # 4 requests
    assert tokens(fast) == tokens(plain)
    assert _drafted(speculative_engine) > before  # it speculated
    before = _drafted(speculative_engine)
    steady = SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True)  # all 32 rows to the cap together
    wide = best_of_n(prompts(vllm_engine, 4), speculative_engine, scorer, BestOfNParams(), steady, 8, seed=1)
    assert _drafted(speculative_engine) == before  # 32 requests a step: above max_rows, no drafts
    assert all(len(r.candidates) == 8 for r in wide)
    sbon = speculative_rejection(prompts(vllm_engine, 2), speculative_engine, scorer,
                                 SpeculativeRejectionParams(8, 0.75), SAMPLING, N, seed=2)
    for r in sbon:
        assert sorted(c.sample for c in r.candidates) == list(range(N))
        assert all(c.completed or (c.stopped_early and len(c.token_ids) == 8) for c in r.candidates)
