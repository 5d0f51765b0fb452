"""The paged KV cache (pipeline.engines.kv_cache, issue 48) on the tiny Llama: block accounting over
any admit, prune, finish and step sequence; a recomputed (preempted) row's logits; a budget at half
of a workload's need completing with every row, by preemption; budgets and errors."""

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipeline.engines.kv_cache as kv_cache
from pipeline.decoding.sampling import SamplingParams
from pipeline.engines.backends import parse_memory
from pipeline.engines.hf import HFEngine
from pipeline.engines.kv_cache import KVCache
from pipeline.config import config_from_dict
from pipeline.errors import ConfigError, KVBudgetError
from pipeline.engines.rows import RowBatch

@pytest.fixture(autouse=True)
def _compiled_kernel(flex_kernel):
    """Every test here steps its pools as a build does: compiled flex_attention (conftest turns it off
    for the rest of the suite)."""


TEXTS = ["Hi", "Describe how the blender works", "Tell me if the camera is good, and why, in two lines",
         "Write a review of the lamp " * 3]


def ids(engine, text):
    return engine.tokenizer(text).input_ids


def _expected_blocks(live: dict, block_size: int) -> tuple[int, int]:
    """(blocks, unique tokens) the live rows should hold: each admission group's whole prompt blocks
    once while any of its rows still holds them, and each row's own tokens past the ones it shares."""
    groups: dict = {}
    own_blocks = own_tokens = 0
    for group, shared, length in live.values():
        groups[group] = max(groups.get(group, 0), shared)
        own = length - shared * block_size
        own_blocks += -(-own // block_size)
        own_tokens += own
    shared_blocks = sum(groups.values())
    return shared_blocks + own_blocks, shared_blocks * block_size + own_tokens


ops = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.lists(st.integers(0, len(TEXTS) - 1), min_size=1, max_size=3),
              st.integers(1, 4)),
    st.tuples(st.just("step"), st.integers(1, 6)),
    st.tuples(st.just("drop"), st.integers(0, 10 ** 6)),
    st.tuples(st.just("feed"), st.integers(1, 6), st.integers(1, 9)),
    st.tuples(st.just("truncate"), st.integers(0, 10 ** 6), st.floats(0, 1)),
    st.tuples(st.just("open"), st.integers(1, 3)),
), min_size=1, max_size=14)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sequence=ops, block_size=st.sampled_from([2, 4, 8]))
def test_blocks_held_follow_the_live_tokens_over_any_sequence(engine, sequence, block_size):
    """At every point of a generated admit / step / chunked feed / truncate / open / prune-or-finish
    sequence, the blocks held are exactly the live rows' (a prompt's whole blocks once per
    admission while a row holds them, each row's own past them; a truncation inside a shared block
    copies it), so the bytes held are at most the live tokens' bytes plus one block per row, shared
    prompt blocks counted once; reference counts add up, and all is free at the end."""
    kv = KVCache(engine.model, engine.device, memory=64 << 20, block_size=block_size)
    live: dict[int, tuple] = {}  # handle -> (admission, whole prompt blocks it shares, length)
    for number, op in enumerate(sequence):
        if op[0] == "admit":
            _, texts, samples = op
            prompts = [ids(engine, TEXTS[t]) for t in texts]
            batch, _ = RowBatch.prefill(engine.model, prompts, engine.pad_id, engine.device)
            sources = [p for p in range(len(prompts)) for _ in range(samples)]
            handles = kv.admit(batch, sources)
            for h, p in zip(handles, sources):
                live[h] = ((number, p), len(prompts[p]) // block_size, len(prompts[p]))
        elif op[0] == "step" and any(length for _, _, length in live.values()):
            handles = [h for h in sorted(live) if live[h][2]][:op[1]]  # a step continues a row's tokens
            kv.step(handles, torch.full((len(handles),), 7), logits_to_keep=1)
            for h in handles:
                group, shared, length = live[h]
                live[h] = (group, shared, length + 1)
        elif op[0] == "feed" and live:
            handles = sorted(live)[:op[1]]
            chunks = [[7 + (h + i) % 5 for i in range(1 + (op[2] + h) % op[2])] for h in handles]
            kv.feed(handles, chunks, engine.pad_id, logits_to_keep=1)
            for h, chunk in zip(handles, chunks):
                group, shared, length = live[h]
                live[h] = (group, shared, length + len(chunk))
        elif op[0] == "truncate" and live:
            handle = sorted(live)[op[1] % len(live)]
            group, shared, length = live[handle]
            keep = int(op[2] * length)
            kv.truncate([handle], [keep])
            live[handle] = (group, min(shared, keep // block_size), keep)
            assert kv.length(handle) == keep
        elif op[0] == "open":
            for h in kv.open_rows(op[1]):
                live[h] = (("open", h), 0, 0)
        elif op[0] == "drop" and live:
            handle = sorted(live)[op[1] % len(live)]
            kv.release([handle])
            del live[handle]
        kv.collect()
        blocks, tokens = _expected_blocks(live, block_size)
        assert kv.used_blocks == blocks
        assert int(kv.refs.sum()) == sum(-(-length // block_size) for _, _, length in live.values())
        per_token = kv.block_bytes // block_size if kv.allocated else 0
        assert kv.held_bytes() <= tokens * per_token + len(live) * kv.block_bytes
        assert kv.live_tokens() == sum(length for _, _, length in live.values())
        assert int(kv.refs.min(initial=0)) >= 0
    kv.release(list(live))
    kv.collect()
    assert kv.used_blocks == 0


def test_chunked_feeds_and_a_copy_on_write_truncation_give_each_rows_own_unpadded_logits(engine):
    """KVCache.feed (several tokens per row, as the reward model's streaming sessions read) gives
    every token the logits of the row's own unpadded run; a truncation inside the prompt's shared
    blocks copies the block, so the rows that share it read what they did before."""
    model = engine.model
    kv = KVCache(model, engine.device, memory=64 << 20, block_size=4, decode=False)
    prompt = ids(engine, TEXTS[3])[:11]  # two whole blocks, shared, and a partial one per row
    batch, _ = RowBatch.prefill(model, [prompt], engine.pad_id, engine.device)
    handles = kv.admit(batch, [0, 0, 0])
    assert kv.used_blocks == 2 + 3
    texts = [prompt + [9], prompt + [5, 6, 7, 8, 9], prompt + list(range(10, 19))]

    def own(tokens):
        return model(input_ids=torch.tensor([tokens])).logits[0]

    out = kv.feed(handles, [t[len(prompt):] for t in texts], engine.pad_id)
    width = out.logits.shape[1]
    for i, tokens in enumerate(texts):
        fed = len(tokens) - len(prompt)
        assert torch.allclose(out.logits[i, width - fed:], own(tokens)[len(prompt):], atol=1e-5)
    kv.truncate([handles[2]], [6])  # inside the second shared block: copied, then written
    out = kv.feed([handles[2], handles[0]], [[3, 4, 5], [6]], engine.pad_id)
    assert torch.allclose(out.logits[0, -1], own(prompt[:6] + [3, 4, 5])[-1], atol=1e-5)
    assert torch.allclose(out.logits[1, -1], own(texts[0] + [6])[-1], atol=1e-5)
    (empty,) = kv.open_rows(1)
    out = kv.feed([empty], [prompt[:5]], engine.pad_id)
    assert torch.allclose(out.logits[0], own(prompt[:5]), atol=1e-5)
    kv.release(handles + [empty])
    kv.collect()
    assert kv.used_blocks == 0


def test_a_recomputed_row_continues_with_the_same_logits(engine):
    """Preemption frees a row's blocks and recomputes its KV from its tokens (one prefill): the
    next step's logits agree with the row that was never preempted within 1e-4."""
    kv = KVCache(engine.model, engine.device, memory=8 << 20, block_size=8)
    prompt = ids(engine, TEXTS[2])
    batch, _ = RowBatch.prefill(engine.model, [prompt], engine.pad_id, engine.device)
    (kept,) = kv.admit(batch)
    fed = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    for token in fed:
        kv.step([kept], torch.tensor([token]), logits_to_keep=1)
    again, _ = RowBatch.prefill(engine.model, [prompt + fed], engine.pad_id, engine.device)
    (recomputed,) = kv.admit(again)
    logits = kv.step([kept, recomputed], torch.tensor([5, 5]), logits_to_keep=1).logits[:, -1]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def _run_sessions(engine, prompts, sampling, width=4):
    """Sessions on concurrent threads: open, decode to 3, prune every other row, decode to the end."""
    out = {}

    def run(i, prompt):
        try:
            once(i, prompt)
        except Exception as exc:  # noqa: BLE001 - the test names it
            out[i] = exc

    def once(i, prompt):
        name = f"s{i}"
        seeds = [100 * i + k for k in range(width)]
        engine.open(name, [prompt], width, seeds, sampling)
        first = engine.extend(name, until=3)
        rest = engine.extend(name, until=sampling.max_new_tokens, keep=[r.row for r in first][::2])
        engine.close(name)
        out[i] = [(r.row, r.token_ids) for r in first + rest]

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = {i: v for i, v in out.items() if isinstance(v, Exception)}
    assert not failed, failed
    return out


def test_a_budget_at_half_the_need_completes_every_row_by_preemption(tiny_models, monkeypatch):
    """A KV budget at half of the workload's peak need: sessions wait for blocks and the newest are
    preempted (their KV recomputed later), every row of every session completes, and the candidates
    equal those of an unconstrained run with the same seeds (the tiny model's passes agree to the
    last bit; on a real model a token sampled near a tie could differ after a recompute)."""
    monkeypatch.setattr(kv_cache, "BLOCK_SIZE", 4)
    base = HFEngine.from_pretrained(str(tiny_models["generator"]))
    prompts = [ids(base, t) for t in TEXTS]
    sampling = SamplingParams(max_new_tokens=24, ignore_eos=True)
    free = HFEngine(base.model, base.tokenizer)
    expected = _run_sessions(free, prompts, sampling)
    need = free.runner.kv.peak_blocks
    tight = HFEngine(base.model, base.tokenizer, kv_cache_memory=f"{(need // 2) * free.runner.kv.block_bytes}B")
    got = _run_sessions(tight, prompts, sampling)
    stats = tight.stats()
    assert stats["kv_blocks_total"] == need // 2 and stats["kv_blocks_peak"] <= need // 2
    assert stats["kv_preemptions"] > 0
    changed = [(i, row) for i in expected for (row, a), (_, b) in zip(expected[i], got[i]) if a != b]
    assert not changed, f"tokens changed after a recompute in (session, row) {changed}"
    tight.runner.kv.collect()
    assert tight.runner.kv.used_blocks == 0


def test_a_session_that_can_never_fit_fails_alone_with_one_line(tiny_models, monkeypatch):
    monkeypatch.setattr(kv_cache, "BLOCK_SIZE", 4)
    base = HFEngine.from_pretrained(str(tiny_models["generator"]))
    kv = base.runner.kv
    small = HFEngine(base.model, base.tokenizer, kv_cache_memory="1B")  # one block (a pool has at least one)
    prompt = ids(base, TEXTS[3])
    small.open("big", [prompt], 2, [1, 2], SamplingParams(max_new_tokens=4))
    with pytest.raises(KVBudgetError, match="raise runtime.kv_cache_memory") as error:
        small.extend("big", until=4)
    assert "\n" not in str(error.value)
    small.close("big")
    small.open("ok", [ids(base, "Hi")], 1, [1], SamplingParams(max_new_tokens=2))
    assert len(small.extend("ok", until=2)) == 1  # the engine still serves
    assert kv is base.runner.kv


def test_generate_beyond_the_pool_runs_in_sessions_that_fit_with_every_row_in_order(tiny_models, monkeypatch):
    """A generate call whose rows outgrow the pool (an evaluation's prompts x samples on a small
    default pool) runs as consecutive sessions of what fits, a prompt's own rows split where even they
    do not: every row comes back, in order, with the tokens a pool that holds them all samples."""
    monkeypatch.setattr(kv_cache, "BLOCK_SIZE", 4)
    monkeypatch.setenv(kv_cache.KERNEL_ENV, "gather")  # scheduling, not the kernel: no compile per pool shape
    base = HFEngine.from_pretrained(str(tiny_models["generator"]))
    prompts = [ids(base, text) for text in TEXTS]
    sampling = SamplingParams(max_new_tokens=12, ignore_eos=True)
    seeds = list(range(100, 100 + 3 * len(prompts)))
    whole = base.generate(prompts, 3, seeds, sampling)
    block_bytes = base.runner.kv.block_bytes
    longest = max(len(p) for p in prompts)
    for blocks in (120, 40, -(-(longest + 12) // 4) + 2):  # all; a few prompts at a time; one row at a time
        small = HFEngine(base.model, base.tokenizer, kv_cache_memory=f"{blocks * block_bytes}B")
        groups = list(small._groups(prompts, 3, 12))
        assert [first for _, _, first in groups] == sorted(first for _, _, first in groups)
        assert sum(len(g) * count for g, count, _ in groups) == 3 * len(prompts)
        rows = small.generate(prompts, 3, seeds, sampling)
        assert [r.token_ids for r in rows] == [r.token_ids for r in whole], blocks
        small.runner.kv.collect()
        assert small.stats()["kv_preemptions"] == 0 and small.runner.kv.used_blocks == 0
    assert len(groups) > len(prompts)  # the smallest pool split a prompt's own rows


@pytest.mark.parametrize("value, expected", [
    ("auto", None), (None, None), (0.5, 0.5), (1, 1.0), (4, 4 * 2**30), ("512MB", 512 * 2**20), ("2GiB", 2 * 2**30),
    ("0.25", 0.25), ("65536B", 65536)])
def test_kv_cache_memory_forms(value, expected):
    assert parse_memory(value) == expected


@pytest.mark.parametrize("value", ["lots", -1, 0, "0GB", True])
def test_kv_cache_memory_refuses_the_rest_with_the_forms(value):
    with pytest.raises(ValueError, match="a fraction in"):
        parse_memory(value)


def test_a_sliding_window_generator_is_refused_at_plan_time_on_the_hf_backend(tiny_models, tmp_path):
    """The paged KV cache holds full-attention layers only: a Mistral-style generator with a sliding
    window is refused with one line before any model loads; Llama and a Qwen2 config whose window is
    off pass."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    from pipeline.preflight import _slides, check_models

    assert _slides(MistralConfig(sliding_window=4096)) and not _slides(LlamaConfig())
    assert not _slides(Qwen2Config(use_sliding_window=False))
    MistralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, sliding_window=8, architectures=["MistralForCausalLM"]
                  ).save_pretrained(tmp_path / "mistral")
    config = config_from_dict({"models": {"generator": str(tmp_path / "mistral"), "reward": str(tiny_models["reward"])},
                               "data": {"prompts": str(tmp_path / "p.jsonl"), "output": str(tmp_path / "out")},
                               "runtime": {"local": True}})
    with pytest.raises(ConfigError, match="sliding-window attention layers.*models.backend: vllm") as error:
        check_models(config)
    assert "\n" not in str(error.value)


def test_at_a_fixed_budget_memory_budget_sbon_starts_three_times_the_rows_best_of_n_fits(tiny_models, scorer,
                                                                                            monkeypatch):
    """Section 6.3's mode on the paged cache: at a budget where Best-of-N fits R rows to the length
    cap, speculative rejection with initial_candidates: auto starts as many rows as the pool holds to
    the decision token (at least 3R: they are short until then), keeps two past it, and completes without a preemption; Best-of-N's R rows complete, and its 3R rows in one session
    fail with one line (a session is preempted whole, never split)."""
    from pipeline.decoding.best_of_n import BestOfNParams, best_of_n
    from pipeline.decoding.domain import PromptInput
    from pipeline.decoding.speculative_rejection import SpeculativeRejectionParams, speculative_rejection

    monkeypatch.setattr(kv_cache, "BLOCK_SIZE", 4)
    base = HFEngine.from_pretrained(str(tiny_models["generator"]))
    text = TEXTS[1]
    prompt = PromptInput("p0", text, text, ids(base, text))
    cap, tau, budget = 48, 4, 60
    length = len(prompt.token_ids)
    shared = length // 4
    fits = (budget - shared) // (-(-(length + cap) // 4) - shared)  # Best-of-N rows to the cap
    sampling = SamplingParams(max_new_tokens=cap, ignore_eos=True)

    def engine():
        probe = HFEngine(base.model, base.tokenizer)
        probe.generate([ids(base, "Hi")], 1, [0], SamplingParams(max_new_tokens=2))  # admits, allocates: block bytes
        return HFEngine(base.model, base.tokenizer, kv_cache_memory=f"{budget * probe.runner.kv.block_bytes}B")

    sbon = engine()
    params = SpeculativeRejectionParams(decision_token=tau, rejection_rate=0.5, initial_candidates="auto",
                                        max_live_candidates=2)
    (result,) = speculative_rejection([prompt], sbon, scorer, params, sampling, 2, seed=3)
    stats = sbon.stats()
    assert stats["kv_blocks_total"] == budget and stats["kv_preemptions"] == 0
    # auto: the rows whose blocks to tau the pool holds (less the watermark), the prompt's whole blocks once
    width = int((budget * (1 - kv_cache.WATERMARK) - shared) // (-(-(length + tau) // 4) - shared))
    assert result.stats["initial_candidates"] == width >= 3 * fits >= 3 and len(result.candidates) == 2
    bon = engine()
    (plain,) = best_of_n([prompt], bon, scorer, BestOfNParams(), sampling, fits, seed=3)
    assert len(plain.candidates) == fits and all(len(c.token_ids) == cap for c in plain.candidates)
    with pytest.raises(KVBudgetError, match="outgrow the whole pool"):  # one session: preempted whole, never split
        best_of_n([prompt], bon, scorer, BestOfNParams(), sampling, 3 * fits, seed=3)


def test_where_flex_attention_cannot_compile_a_step_gathers_the_blocks_with_the_same_logits(engine, monkeypatch):
    """The fallback (no compiler, none for a pool's shape, or BON_KV_KERNEL=gather): each row's blocks
    gathered for SDPA; the logits equal the compiled kernel's, the pool zeroed nowhere it was not
    before."""
    prompts = [ids(engine, TEXTS[2]), ids(engine, "Hi")]
    batch, _ = RowBatch.prefill(engine.model, prompts, engine.pad_id, engine.device)
    out = {}
    monkeypatch.setitem(kv_cache._kernel, "broken", set())
    for broken in (False, True):
        if broken:
            monkeypatch.setenv(kv_cache.KERNEL_ENV, "gather")
        kv = KVCache(engine.model, engine.device, memory=8 << 20, block_size=8)
        handles = kv.admit(batch, [0, 0, 1])
        for token in range(3, 12):
            logits = kv.step(handles, torch.full((3,), token), logits_to_keep=1).logits[:, -1]
        out[broken] = logits
    torch.testing.assert_close(out[True], out[False], atol=1e-5, rtol=1e-5)


def test_a_pool_shape_that_fails_to_compile_gathers_alone(engine, monkeypatch, caplog):
    """Inductor's CPU template builds some pool shapes and not others. A pool whose kernel fails to
    build gathers its blocks (one warning naming its shape), and a pool of another shape in the same
    process still runs the compiled kernel; the logits agree."""
    prompts = [ids(engine, TEXTS[2]), ids(engine, "Hi")]
    batch, _ = RowBatch.prefill(engine.model, prompts, engine.pad_id, engine.device)
    monkeypatch.setitem(kv_cache._kernel, "broken", set())
    torch._dynamo.reset()  # as a fresh process: what the file compiled before changes what inductor builds
    compiled = kv_cache._flex()
    calls = {"flex": 0}

    def length(memory):  # a pool's length in tokens at this budget, read from one that compiles nothing
        probe = KVCache(engine.model, engine.device, memory=memory, block_size=8, decode=False)
        probe._allocate_for_model()
        return probe.keys[0].shape[2]

    failing = length(8 << 20)

    def flaky(query, key, value, **kwargs):  # the first pool's shape fails to build, as a C++ compile error would
        if key.shape[2] == failing:
            raise RuntimeError("C++ compile error (simulated)")
        calls["flex"] += 1
        return compiled(query, key, value, **kwargs)

    monkeypatch.setattr(kv_cache, "_flex", lambda: flaky)
    shapes, out = [], []
    for memory in (8 << 20, 6 << 20):
        kv = KVCache(engine.model, engine.device, memory=memory, block_size=8)
        handles = kv.admit(batch, [0, 0, 1])
        shapes.append(kv.keys[0].shape[2])
        for token in range(3, 12):
            logits = kv.step(handles, torch.full((3,), token), logits_to_keep=1).logits[:, -1]
        out.append(logits)
    assert shapes[0] != shapes[1] and calls["flex"] > 0
    assert len(kv_cache._kernel["broken"]) == 1
    assert caplog.text.count("could not be compiled for a pool of") == 1
    torch.testing.assert_close(out[0], out[1], atol=1e-5, rtol=1e-5)


def test_past_the_recompile_limit_a_new_pool_gathers_its_blocks_with_the_same_logits(engine, monkeypatch, caplog):
    """Pools of many shapes in one process (a test suite) use up dynamo's recompile limit. A pool whose
    kernel would need one more compile then gathers its blocks for SDPA, with one warning, instead of
    running flex_attention eagerly over the whole pool (which took minutes a step); same logits."""
    prompts = [ids(engine, TEXTS[2]), ids(engine, "Hi")]
    batch, _ = RowBatch.prefill(engine.model, prompts, engine.pad_id, engine.device)
    out, pools = {}, {}
    monkeypatch.setitem(kv_cache._kernel, "limit_logged", False)
    monkeypatch.setitem(kv_cache._kernel, "broken", set())  # an earlier test's shape that failed to build
    torch._dynamo.reset()  # no entry compiled by an earlier test may serve the second pool
    for limited in (False, True):
        # Room for the first pool's compiles whatever the process compiled before (the suite), none for the
        # second's; the second has a block count no other test uses, so its kernel is not compiled yet.
        monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 0 if limited else 100_000)
        monkeypatch.setattr(torch._dynamo.config, "accumulated_recompile_limit", 0 if limited else 100_000)
        memory = 173 * pools[False].block_bytes if limited else 8 << 20
        kv = KVCache(engine.model, engine.device, memory=memory, block_size=8)
        handles = kv.admit(batch, [0, 0, 1])
        for token in range(3, 12):
            logits = kv.step(handles, torch.full((3,), token), logits_to_keep=1).logits[:, -1]
        out[limited], pools[limited] = logits, kv
    assert pools[True].num_blocks == 173 != pools[False].num_blocks  # a new pool shape: it needs a compile
    assert all(getattr(k, "bon_gather", False) for k in pools[True].keys)
    assert not any(getattr(k, "bon_gather", False) for k in pools[False].keys)
    assert "recompile limit is reached" in caplog.text
    torch.testing.assert_close(out[True], out[False], atol=1e-5, rtol=1e-5)


def test_initial_candidates_auto_is_refused_off_the_hf_backend_and_checked_as_a_value():
    """``auto`` reads the HF engine's pool: with vLLM it is a one-line config error; other strings too."""
    base = {"models": {"generator": "g", "reward": ["r"], "backend": "vllm"},
            "strategy": {"name": "sbon", "decision_token": 4, "initial_candidates": "auto"}}
    with pytest.raises(ConfigError, match="initial_candidates: auto sizes the first batch by the generator's KV blocks; backend vllm"):
        config_from_dict(base)
    with pytest.raises(ConfigError, match="initial_candidates: expected a positive int or auto, got 'many'"):
        config_from_dict({**base, "models": {**base["models"], "backend": "hf"},
                          "strategy": {**base["strategy"], "initial_candidates": "many"}})
    assert config_from_dict({**base, "models": {**base["models"], "backend": "hf"}}).strategy.params.initial_candidates \
        == "auto"
