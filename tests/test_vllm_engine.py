"""vLLM backend: bookkeeping against the Generator protocol with a fake LLM, and a build through
the public job on real vLLM (marker ``vllm``: ``make test-vllm`` runs it on CPU; tests/test_vllm_real.py
holds the engine-level tests on real vLLM)."""

import random
import time
from types import SimpleNamespace

import pytest

from pipeline.decoding.best_of_n import BestOfNParams, best_of_n
from pipeline.decoding.domain import PromptInput
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative_rejection import SpeculativeRejectionParams, speculative_rejection
from pipeline.engines.vllm_engine import ContinuousVLLMEngine, VLLMEngine, segment_seed

EOS = 0


def _stops(token: int, params) -> bool:
    """vLLM's stop rule (vllm.v1.core.sched.utils.check_stop): a stop token ends a request even
    with ignore_eos, which only covers the tokenizer's EOS (here EOS)."""
    return token in params.stop_token_ids or (token == EOS and not params.ignore_eos)


class FakeLLM:
    """Stands in for vllm.LLM.generate: tokens from the request seed, EOS with probability 0.05."""

    def __init__(self):
        self.calls = []
        self.generated = 0

    def generate(self, requests, sampling_params, use_tqdm=True):
        self.calls.append([(list(r["prompt_token_ids"]), p) for r, p in zip(requests, sampling_params)])
        outputs = []
        for p in sampling_params:
            rng, tokens = random.Random(p.seed), []
            while len(tokens) < p.max_tokens:
                tokens.append(EOS if rng.random() < 0.05 else rng.randint(1, 50))
                if _stops(tokens[-1], p):
                    break
            reason = "stop" if tokens[-1] == EOS else "length"
            self.generated += len(tokens)
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, finish_reason=reason)]))
        return outputs


class FakeLLMEngine:
    """Stands in for vLLM's engine (``LLM.llm_engine``) under ContinuousVLLMEngine: each step adds one
    token to each of the first ``max_running`` requests (the others wait, as in vLLM's scheduler),
    drawn as FakeLLM draws them, so a request equals the FakeLLM request with the same seed."""

    def __init__(self, max_running: int = 6, fail_after: int | None = None, step_seconds: float = 0.0):
        self.running: dict[str, tuple[random.Random, object, list[int]]] = {}
        self.max_running, self.fail_after, self.step_seconds = max_running, fail_after, step_seconds
        self.added, self.aborted, self.steps, self.step_rows = [], [], 0, []
        self.tokens_made: dict[str, int] = {}  # request id -> tokens decoded for it (EOS included)
        self.engine_core = SimpleNamespace(shutdown=lambda: None)

    def add_request(self, request_id, prompt, params):
        self.added.append((request_id, list(prompt["prompt_token_ids"]), params))
        self.running[request_id] = (random.Random(params.seed), params, [])

    def abort_request(self, request_ids):
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            self.running.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        self.steps += 1
        time.sleep(self.step_seconds)  # a forward pass: the scorer decides while rows decode
        if self.fail_after is not None and self.steps > self.fail_after:
            raise RuntimeError("engine core died")
        outputs = []
        for request_id in list(self.running)[:self.max_running]:
            rng, params, tokens = self.running[request_id]
            tokens.append(EOS if rng.random() < 0.05 else rng.randint(1, 50))
            self.tokens_made[request_id] = len(tokens)
            finished = len(tokens) >= params.max_tokens or _stops(tokens[-1], params)
            if finished:
                del self.running[request_id]
            outputs.append(SimpleNamespace(request_id=request_id, finished=finished,
                                           outputs=[SimpleNamespace(token_ids=[tokens[-1]])]))
        self.step_rows.append(len(outputs))
        return outputs


class FakeTokenizer:
    def batch_decode(self, seqs, skip_special_tokens=True):
        return [" ".join(map(str, s)) for s in seqs]


def fake_engine():
    return VLLMEngine(FakeLLM(), FakeTokenizer(), {EOS}, lambda **kw: SimpleNamespace(**kw))


def continuous_engine(**fake):
    llm = SimpleNamespace(llm_engine=FakeLLMEngine(**fake))
    return ContinuousVLLMEngine(llm, FakeTokenizer(), {EOS}, lambda **kw: SimpleNamespace(**kw))


def test_extend_sends_prefix_plus_tokens_and_stops_at_the_decision_token():
    engine = fake_engine()
    engine.open("s", [[7, 8], [9]], 3, [11, 12, 13, 14, 15, 16], SamplingParams(max_new_tokens=20))
    rows = engine.extend("s", until=5)
    assert [r.row for r in rows] == list(range(6))
    assert all(len(r.token_ids) == 5 or r.finished for r in rows)
    first = engine.llm.calls[0]
    assert [req for req, _ in first] == [[7, 8]] * 3 + [[9]] * 3
    assert all(p.max_tokens == 5 and p.seed == segment_seed(s, 0) for (_, p), s in zip(first, range(11, 17)))
    unfinished = [r.row for r in rows if not r.finished]
    keep = unfinished[:2]
    later = engine.extend("s", until=12, keep=keep)
    assert [r.row for r in later] == keep
    second = engine.llm.calls[1]
    assert len(second) == 2
    for (req, p), r in zip(second, keep):
        prompt = [7, 8] if r < 3 else [9]
        assert req == prompt + rows[r].token_ids  # continued from its own tokens (prefix cache hit)
        assert p.max_tokens == 12 - 5 and p.seed == segment_seed(11 + r, 5)
        assert later[keep.index(r)].token_ids[:5] == rows[r].token_ids
    assert all(EOS not in r.token_ids for r in later)
    assert engine.close("s") == {"generated_tokens": engine.llm.generated, "forward_passes": 6 + 2}
    with pytest.raises(ValueError, match="unknown session"):
        engine.extend("s", until=3)


def test_speculative_rejection_and_best_of_n_run_on_the_vllm_backend():
    from tests.test_decoding import FakeScorer

    prompts = [PromptInput(f"p{i}", "x", "x", [1, 2]) for i in range(2)]
    sampling = SamplingParams(max_new_tokens=16)
    sbon = speculative_rejection(prompts, fake_engine(), FakeScorer(),
                                 SpeculativeRejectionParams([4, 8], 0.5, keep_lowest=False), sampling, 8, seed=1)
    bon = best_of_n(prompts, fake_engine(), FakeScorer(), BestOfNParams(), sampling, 8, seed=1)
    for a, b in zip(sbon, bon):
        assert len(a.candidates) == len(b.candidates) == 8
        assert a.generated_tokens < b.generated_tokens
        assert any(c.stopped_early for c in a.candidates)
        # Same seeds, same segment seeds: every row's first 4 tokens agree with Best-of-N's.
        assert [c.token_ids[:4] for c in a.candidates] == [c.token_ids[:4] for c in b.candidates]


@pytest.mark.vllm
def test_a_build_with_the_vllm_backend_writes_pairs(tiny_models, tmp_path):
    """The public job with models.backend vllm (in-process actors; make test-vllm runs it on CPU)."""
    pytest.importorskip("vllm", reason="vllm is not installed (make install-vllm, or pip install .[vllm] on a GPU)")
    import json

    import pyarrow.parquet as pq

    from jobs.build_dataset import main
    from jobs.make_tiny_models import make_vllm_model
    from tests.conftest import GOOD_PROMPTS, write_jsonl

    model = make_vllm_model(tmp_path / "vllm-model")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:6]])
    out = tmp_path / "out"
    assert main(["--config", "configs/demo.yaml", "--prompts", str(prompts), "--output", str(out),
                 "--set", f"models.generator={model}", "--set", f"models.reward={tiny_models['reward']}",
                 "--set", "models.draft=", "--set", "models.backend=vllm", "--set", "runtime.local=true",
                 "--num-samples", "4", "--max-new-tokens", "16", "--set", "strategy.decision_token=4",
                 "--no-progress"]) == 0
    manifest = json.loads((out / "_manifest.json").read_text())
    pairs = [r for part in sorted(out.glob("train-*.parquet")) for r in pq.read_table(part).to_pylist()]
    assert manifest["pairs"] + manifest["prompts_rejected"] == len(GOOD_PROMPTS[:6]) == manifest["prompts_in"]
    assert len(pairs) == manifest["pairs"] >= 1
    assert all(p["chosen"] != p["rejected"] and p["chosen_score"] >= p["rejected_score"] for p in pairs)


@pytest.mark.vllm
@pytest.mark.parametrize("strategy", ["best_of_n", "sbon"])
def test_a_reward_function_scores_a_vllm_build(tiny_models, tmp_path, strategy):
    """models.reward as a function (module:function) on the vLLM backend: the function's scores,
    and the input's other columns reach it and the output (make test-vllm runs it on CPU)."""
    pytest.importorskip("vllm", reason="vllm is not installed (make install-vllm, or pip install .[vllm] on a GPU)")
    import pyarrow.parquet as pq

    from jobs.build_dataset import main
    from jobs.make_tiny_models import make_vllm_model
    from pipeline.data.store import OutputStore
    from tests.conftest import GOOD_PROMPTS, write_jsonl

    model = make_vllm_model(tmp_path / "vllm-model")
    rows = [{"prompt": p, "letter": "aeiou"[i % 5]} for i, p in enumerate(GOOD_PROMPTS[:6])]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    out = tmp_path / "out"
    assert main(["--config", "configs/demo.yaml", "--strategy", strategy, "--prompts", str(prompts),
                 "--output", str(out), "--set", f"models.generator={model}",
                 "--set", "models.reward=tests.test_reward_function:letter_reward", "--set", "models.draft=",
                 "--set", "models.backend=vllm", "--set", "runtime.local=true", "--num-samples", "4",
                 "--max-new-tokens", "16", "--no-progress",
                 *(["--set", "strategy.decision_token=4"] if strategy == "sbon" else [])]) == 0
    pairs = [r for part in OutputStore(str(out)).committed_parts() for r in pq.read_table(part).to_pylist()]
    assert pairs
    for p in pairs:
        letter = {r["prompt"]: r["letter"] for r in rows}[p["raw_prompt"]]
        assert p["letter"] == letter
        for side in ("chosen", "rejected"):
            assert p[f"{side}_score"] == pytest.approx(p[side].count(letter) + len(p[side]) * 1e-3)


def test_model_side_strategies_are_refused_by_the_vllm_backend():
    """The vLLM backend serves sessions only: its engine is no SearchEngine, and a generator actor on
    it refuses a search (config refuses the pairing before that: tests/test_config.py)."""
    from actors.generator import GeneratorActor
    from pipeline.decoding import dsbd
    from pipeline.engines.backends import BACKENDS, SEARCH, Engine, SearchEngine

    assert SEARCH not in BACKENDS["vllm"].serves
    engine = fake_engine()
    assert isinstance(engine, Engine) and not isinstance(engine, SearchEngine)
    actor = GeneratorActor.__new__(GeneratorActor)  # the actor's guard alone, without loading a model
    actor.backend, actor.engine = BACKENDS["vllm"], engine
    with pytest.raises(ValueError, match="backend vllm serves no model-side strategy"):
        actor.search(dsbd.search, [[1, 2]], 2, [0, 1], None, None)


def candidates(results):
    return [[(c.token_ids, c.completed, c.stopped_early) for c in r.candidates] for r in results]


def test_continuous_mode_sends_one_request_per_row_and_best_of_n_equals_the_rounds_engine():
    prompts = [PromptInput(f"p{i}", "x", "x", [1, 2 + i]) for i in range(3)]
    sampling = SamplingParams(max_new_tokens=16)
    engine = continuous_engine()
    try:
        got = best_of_n(prompts, engine, _scorer(), BestOfNParams(), sampling, 4, seed=2)
        added = engine._engine.added
        assert len(added) == 12 and len({r for r, _, _ in added}) == 12  # one request per row, own id
        assert all(p.max_tokens == 16 and p.n == 1 for _, _, p in added)
        assert [prompt for _, prompt, _ in added] == [[1, 2]] * 4 + [[1, 3]] * 4 + [[1, 4]] * 4
        assert max(engine._engine.step_rows) == 6  # requests past max_running waited for room
        expected = best_of_n(prompts, fake_engine(), _scorer(), BestOfNParams(), sampling, 4, seed=2)
        assert candidates(got) == candidates(expected)
        assert sum(r.generated_tokens for r in got) == sum(r.generated_tokens for r in expected)
        assert engine.sessions == {} and engine._requests == {}
    finally:
        engine.shutdown()


def test_continuous_speculative_rejection_aborts_pruned_rows_and_keeps_best_of_ns_tokens():
    prompts = [PromptInput(f"p{i}", "x", "x", [1, 2]) for i in range(2)]
    sampling = SamplingParams(max_new_tokens=24)
    params = SpeculativeRejectionParams([4, 8], 0.5, keep_lowest=False)
    engine = continuous_engine(max_running=16, step_seconds=0.01)
    try:
        sbon = speculative_rejection(prompts, engine, _scorer(), params, sampling, 8, seed=1)
        bon = best_of_n(prompts, fake_engine(), _scorer(), BestOfNParams(), sampling, 8, seed=1)
        aborted = set(engine._engine.aborted)
        for a, b in zip(sbon, bon):
            stopped = [c for c in a.candidates if c.stopped_early]
            assert stopped and all(len(c.token_ids) == c.stopped_at for c in stopped)
            for c, full in zip(a.candidates, b.candidates):
                # One request per row from position 0: a stopped row is a prefix of Best-of-N's, a kept
                # one is Best-of-N's whole response.
                assert c.token_ids == full.token_ids[:len(c.token_ids)]
                if not c.stopped_early:
                    assert c.token_ids == full.token_ids and c.completed
            assert a.generated_tokens < b.generated_tokens
        stopped = {f"{r}" for r in range(16) if sbon[r // 8].candidates[r % 8].stopped_early}
        assert aborted and {request.split(":")[1] for request in aborted} <= stopped  # kept rows run on
        assert engine._requests == {} and not engine._engine.running
    finally:
        engine.shutdown()


def test_continuous_mode_alpha_zero_chooses_best_of_ns_candidate():
    prompts = [PromptInput(f"p{i}", "x", "x", [3, i]) for i in range(2)]
    sampling = SamplingParams(max_new_tokens=12)
    engine = continuous_engine()
    try:
        sbon = speculative_rejection(prompts, engine, _scorer(), SpeculativeRejectionParams(4, 0.0), sampling, 6,
                                     seed=9)
        bon = best_of_n(prompts, fake_engine(), _scorer(), BestOfNParams(), sampling, 6, seed=9)
        assert candidates(sbon) == candidates(bon)
        best = [max(r.candidates, key=lambda c: c.score).token_ids for r in sbon]
        assert best == [max(r.candidates, key=lambda c: c.score).token_ids for r in bon]
        assert engine._engine.aborted == []
    finally:
        engine.shutdown()


def test_continuous_mode_serves_batches_from_many_threads_like_one_at_a_time():
    from actors.factory import local_generator, local_scorer
    from pipeline.coordinator import Coordinator

    prompts = [PromptInput(f"p{i}", "x", "x", [1, 5 + i]) for i in range(6)]
    sampling = SamplingParams(max_new_tokens=20)
    params = SpeculativeRejectionParams([3, 6], 0.5, streaming_rewards=False)  # FakeScorer has no sessions

    def run(generator, **kwargs):
        coordinator = Coordinator("sbon", params, sampling, 4, 0, [generator], [local_scorer(_scorer(), timed=False)],
                                  **kwargs)
        return {r.prompt.prompt_id: candidates([r]) for r in coordinator.run(prompts)}

    alone = continuous_engine()
    shared = continuous_engine()
    try:
        expected = run(local_generator(alone, timed=False), prompts_per_batch=1, batches_in_flight=1)
        got = run(local_generator(shared, concurrent=True, timed=False), prompts_per_batch=1, batches_in_flight=6)
        assert got == expected
        assert shared.sessions == {} and shared._requests == {}
        assert max(shared._engine.step_rows) > max(alone._engine.step_rows)  # batches shared steps
    finally:
        alone.shutdown()
        shared.shutdown()


def test_a_failed_vllm_engine_fails_every_waiting_call_and_the_next_ones():
    engine = continuous_engine(fail_after=3)
    try:
        engine.open("s", [[1, 2]], 2, [0, 1], SamplingParams(max_new_tokens=10))
        with pytest.raises(RuntimeError, match="the vLLM engine failed: .*engine core died"):
            engine.extend("s", until=10)
        with pytest.raises(RuntimeError, match="engine core died"):
            engine.open("t", [[1, 2]], 2, [0, 1], SamplingParams(max_new_tokens=10))
    finally:
        engine.shutdown()


def _scorer():
    from tests.test_decoding import FakeScorer

    return FakeScorer()


@pytest.mark.parametrize("make", [fake_engine, continuous_engine])
def test_ignore_eos_decodes_every_row_to_max_new_tokens(make):
    """sampling.ignore_eos: no row stops at EOS, on either vLLM engine (vLLM stops at any stop token
    even with ignore_eos, so the engine must send none)."""
    engine = make()
    try:
        engine.open("s", [[1, 2]], 8, list(range(8)), SamplingParams(max_new_tokens=40, ignore_eos=True))
        rows = engine.extend("s", until=40)
        assert all(len(r.token_ids) == 40 and r.finished for r in rows)
        assert any(EOS in r.token_ids for r in rows)  # EOS was drawn (p = 0.05 a token) and did not stop
        engine.close("s")
    finally:
        engine.shutdown()


class SlowScorer:
    """FakeScorer's rewards, after ``seconds``: the continuous engine's rows decode on meanwhile."""

    def __init__(self, seconds: float):
        self.inner, self.seconds = _scorer(), seconds

    def score(self, prompts, responses, finished=None, columns=None):
        time.sleep(self.seconds)
        return self.inner.score(prompts, responses)


def test_continuous_speculative_rejection_counts_the_tokens_rows_decode_while_they_are_scored():
    """Rows go on decoding past tau while the reward model scores them; the ones then dropped made
    tokens that no candidate holds. generated_tokens (and so tokens_saved) must count every token
    the engine decoded (EOS aside, as everywhere), prompt by prompt."""
    prompts = [PromptInput(f"p{i}", "x", "x", [1, 2 + i]) for i in range(2)]
    sampling = SamplingParams(max_new_tokens=40)
    params = SpeculativeRejectionParams(4, 0.5, keep_lowest=False, streaming_rewards=False)
    engine = continuous_engine(max_running=16, step_seconds=0.002)
    try:
        results = speculative_rejection(prompts, engine, SlowScorer(0.1), params, sampling, 8, seed=3)
        running = engine._engine
        decoded = {}  # prompt -> tokens the fake engine decoded for its rows, EOS not counted
        for request_id, _, params_ in running.added:
            row = int(request_id.split(":")[1])
            tokens = _replay(params_, running.tokens_made.get(request_id, 0))
            decoded[row // 8] = decoded.get(row // 8, 0) + len(tokens) - (tokens[-1] == EOS if tokens else 0)
        held = [sum(len(c.token_ids) for c in r.candidates) for r in results]
        assert all(decoded[i] > held[i] for i in range(2))  # dropped rows ran past tau (the test has power)
        assert [r.generated_tokens for r in results] == [decoded[0], decoded[1]]
    finally:
        engine.shutdown()


def _replay(params, count: int) -> list[int]:
    """The first ``count`` tokens FakeLLMEngine drew for a request with these parameters."""
    rng = random.Random(params.seed)
    return [EOS if rng.random() < 0.05 else rng.randint(1, 50) for _ in range(count)]


@pytest.mark.vllm
def test_ignore_eos_on_real_vllm_decodes_past_every_eos(tmp_path):
    """On a real vLLM engine (rounds and continuous): with ignore_eos no row stops at a token of the
    engine's EOS set. A token the free rows often sample is made an EOS, as in
    tests/test_vllm_real.py, so EOS is certain to be drawn."""
    pytest.importorskip("vllm", reason="vllm is not installed (make install-vllm, or pip install .[vllm] on a GPU)")
    import functools

    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    from jobs.make_tiny_models import make_vllm_model

    engine = VLLMEngine.from_pretrained(str(make_vllm_model(tmp_path)), dtype="float32", gpu_memory_utilization=0.12,
                                        max_model_len=256, max_num_batched_tokens=512)
    continuous = ContinuousVLLMEngine(engine.llm, engine.tokenizer, engine.eos_ids,
                                      functools.partial(VLLMSamplingParams, output_kind=RequestOutputKind.DELTA))
    try:
        prompts = [PromptInput(f"p{i}", "x", "x", engine.tokenizer(f"Review product {i}.").input_ids) for i in range(2)]
        sampling = SamplingParams(max_new_tokens=24, ignore_eos=True)
        scorer = SimpleNamespace(score=lambda prompts_, texts, **_: [float(len(t)) for t in texts])
        free = best_of_n(prompts, engine, scorer, BestOfNParams(), sampling, 8, seed=7)
        counts: dict[int, int] = {}
        for c in (c for r in free for c in r.candidates):
            for t in set(c.token_ids[1:]):
                counts[t] = counts.get(t, 0) + 1
        stop = max(counts, key=counts.get)
        for generator in (engine, continuous):
            generator.eos_ids = engine.eos_ids | {stop}
            results = best_of_n(prompts, generator, scorer, BestOfNParams(), sampling, 8, seed=7)
            rows = [c.token_ids for r in results for c in r.candidates]
            assert all(len(t) == 24 for t in rows)
            assert sum(stop in t for t in rows) >= 3  # drawn, and decoding went on past it
    finally:
        continuous.shutdown()
