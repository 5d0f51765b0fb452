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
    from transformers import MistralForCausalLM  # past the plan (an engine built in-process): the layers named

    from pipeline.engines.hf import load_tokenizer

    model = MistralForCausalLM(MistralConfig.from_pretrained(tmp_path / "mistral"))
    with pytest.raises(ValueError, match=r"not full attention \(DynamicSlidingWindowLayer: sliding-window"):
        HFEngine(model, load_tokenizer(str(tiny_models["generator"])))


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


def _steps(engine, kv, batch, sources=(0, 0, 1), count=9):
    handles = kv.admit(batch, list(sources))
    for token in range(3, 3 + count):
        logits = kv.step(handles, torch.full((len(handles),), token), logits_to_keep=1).logits[:, -1]
    return handles, logits


@pytest.mark.parametrize("block_size", [16, 128])
def test_the_compiled_kernel_is_checked_then_used_with_no_compile_during_steps(engine, block_size, monkeypatch):
    """The kernel a build runs (compiled flex_attention, static row buckets, block sizes builds use):
    compiled once per bucket at the pool's allocation and checked against the gather there, then every
    step runs it (no compile, whatever the row count) with the logits the gather gives."""
    prompts = [ids(engine, TEXTS[2]), ids(engine, "Hi")]
    batch, _ = RowBatch.prefill(engine.model, prompts, engine.pad_id, engine.device)
    kv = KVCache(engine.model, engine.device, memory=8 << 20, block_size=block_size, max_rows=16)
    kv.admit(batch, [0])  # allocates: compiles and checks
    stats = kv.stats()
    assert stats["kv_kernel"] == "flex_attention" and stats["kv_kernel_reason"] == ""
    assert stats["kv_kernel_buckets"] == [1, 16] and stats["kv_kernel_compiles"] == 2
    assert stats["kv_kernel_check_error"] < 1e-4
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    calls = {"n": 0}
    attend = kv.kernel.attend
    monkeypatch.setattr(kv.kernel, "attend", lambda *a: calls.__setitem__("n", calls["n"] + 1) or attend(*a))
    _, compiled = _steps(engine, kv, batch, (0, 0, 1, 1, 0), count=2 * block_size + 2)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no compile during the steps
    assert calls["n"] > 0 and kv.stats()["kv_kernel_gathered_steps"] == 0
    monkeypatch.setenv(kv_cache.KERNEL_ENV, "gather")
    gathered = KVCache(engine.model, engine.device, memory=8 << 20, block_size=block_size)
    gathered.admit(batch, [0])
    _, reference = _steps(engine, gathered, batch, (0, 0, 1, 1, 0), count=2 * block_size + 2)
    assert gathered.stats()["kv_kernel"] == "gather"
    torch.testing.assert_close(compiled, reference, atol=1e-5, rtol=1e-5)


def _wrong_kernel(own_flex, options, backend):
    """A compiled kernel that is off by a little (the kind of error an ISA-specific build made)."""
    right = own_flex(options, backend)
    return lambda *args: right(*args) + 0.05


def test_a_kernel_that_disagrees_with_the_gather_is_never_trusted(engine, monkeypatch, caplog):
    """The self-check at allocation: a compiled kernel whose attention differs from the gather past
    float tolerance is not used; the pool gathers, one warning line says why, and stats (the
    generator's section of _report.json) records the kernel and the reason. Logits: the gather's."""
    from pipeline.engines import attention_kernel

    prompts = [ids(engine, TEXTS[2]), ids(engine, "Hi")]
    batch, _ = RowBatch.prefill(engine.model, prompts, engine.pad_id, engine.device)
    own = attention_kernel._own_flex
    monkeypatch.setattr(attention_kernel, "_own_flex", lambda options, backend: _wrong_kernel(own, options, backend))
    kv = KVCache(engine.model, engine.device, memory=8 << 20, block_size=16, max_rows=4)
    _, logits = _steps(engine, kv, batch)
    stats = kv.stats()
    assert stats["kv_kernel"] == "gather" and "differs from the gather by 0.05" in stats["kv_kernel_reason"]
    warnings = [r for r in caplog.records if "differs from the gather" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage()
    monkeypatch.setenv(kv_cache.KERNEL_ENV, "gather")
    _, reference = _steps(engine, KVCache(engine.model, engine.device, memory=8 << 20, block_size=16), batch)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)


def test_on_cpu_the_pools_kernel_keeps_inductors_general_template(engine, tmp_path, monkeypatch):
    """Inductor picks its CPU decoding template for a static row count once the pool's tokens over the
    bucket's rows reach 512; that template spans the whole pool as soon as two rows differ in length (a
    zero-filled partition per 128 pool tokens per row and head, a scratch buffer as large, per call):
    45x slower per layer for 8 real rows (docs/benchmarks.md, "The CPU template"). Every kernel the pool
    compiles is the general template (the decoding one's partition loop is in no generated source),
    and its steps give the gather's logits."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # this pool's sources only
    prompts = [ids(engine, TEXTS[2]), ids(engine, "Hi")]
    batch, _ = RowBatch.prefill(engine.model, prompts, engine.pad_id, engine.device)
    kv = KVCache(engine.model, engine.device, memory=8 << 20, block_size=16, max_rows=16)
    _, logits = _steps(engine, kv, batch, (0, 0, 1))
    assert kv.stats()["kv_kernel"] == "flex_attention"
    assert kv.kernel.num_blocks * 16 >= 512 * kv.kernel.buckets[-1]  # inductor would pick decoding for every bucket
    sources = [path.read_text() for path in (tmp_path / "inductor").rglob("*.cpp")]
    assert sources and not any("PARTITION_SIZE" in source for source in sources)
    monkeypatch.setenv(kv_cache.KERNEL_ENV, "gather")
    _, reference = _steps(engine, KVCache(engine.model, engine.device, memory=8 << 20, block_size=16), batch,
                          (0, 0, 1))
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)


def test_a_pool_whose_kernel_does_not_compile_gathers_alone(engine, monkeypatch, caplog):
    """A compile failure (no C++ compiler, an inductor error) switches off that pool's kernel only: the
    next pool compiles its own."""
    from pipeline.engines import attention_kernel

    prompts = [ids(engine, TEXTS[2]), ids(engine, "Hi")]
    batch, _ = RowBatch.prefill(engine.model, prompts, engine.pad_id, engine.device)
    own = attention_kernel._own_flex

    def failing(options, backend):
        def run(*args):
            raise RuntimeError("C++ compile error (simulated)")
        return run

    monkeypatch.setattr(attention_kernel, "_own_flex", failing)
    broken = KVCache(engine.model, engine.device, memory=8 << 20, block_size=16, max_rows=4)
    _, first = _steps(engine, broken, batch)
    monkeypatch.setattr(attention_kernel, "_own_flex", own)
    working = KVCache(engine.model, engine.device, memory=8 << 20, block_size=16, max_rows=4)
    _, second = _steps(engine, working, batch)
    assert broken.stats()["kv_kernel"] == "gather" and "does not compile" in broken.stats()["kv_kernel_reason"]
    assert working.stats()["kv_kernel"] == "flex_attention"
    assert caplog.text.count("does not compile") == 1
    torch.testing.assert_close(first, second, atol=1e-5, rtol=1e-5)


def test_steps_and_feeds_that_raise_give_back_every_block_and_leave_the_kernel_on(engine, monkeypatch):
    """Failure atomicity: steps and chunked feeds whose forward raises (an out-of-memory, injected) leak
    no block; the kernel stays on (a runtime error is not a compile failure); after every row is
    released the pool is empty and a session that fits the empty pool runs."""
    prompts = [ids(engine, TEXTS[3]), ids(engine, "Hi")]
    batch, _ = RowBatch.prefill(engine.model, prompts, engine.pad_id, engine.device)
    kv = KVCache(engine.model, engine.device, memory=8 << 20, block_size=16, max_rows=4)
    handles = kv.admit(batch, [0, 0, 1])
    held = kv.used_blocks
    attend = kv.kernel.attend

    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(kv.kernel, "attend", oom)
    for token in range(40):  # across block edges: many of these steps take a new block first
        with pytest.raises(torch.OutOfMemoryError):
            kv.step(handles, torch.full((3,), token), logits_to_keep=1)
        assert kv.used_blocks == held
    monkeypatch.setattr(kv.kernel, "attend", attend)
    for _ in range(20):
        kv.step(handles, torch.full((3,), 7), logits_to_keep=1)
    held = kv.used_blocks
    forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda *a, **kw: oom())
    for count in (1, 17, 40):
        with pytest.raises(torch.OutOfMemoryError):
            kv.feed(handles, [[5] * count] * 3, engine.pad_id)
        assert kv.used_blocks == held
    monkeypatch.setattr(engine.model, "forward", forward)
    assert kv.stats()["kv_kernel"] == "flex_attention"
    kv.release(handles)
    kv.collect()
    assert kv.used_blocks == 0 and int(kv.refs.sum()) == 0
    handles, _ = _steps(engine, kv, batch)
    assert len(handles) == 3


def test_an_out_of_memory_inside_a_step_retries_with_fewer_rows_and_every_row_completes(tiny_models, monkeypatch):
    """The step loop: an out-of-memory inside a shared step (injected in every step of more than 4
    rows) preempts the newest session and steps the others; every session completes with every row,
    the same tokens as an unconstrained run, and nothing stays held."""
    monkeypatch.setenv(kv_cache.KERNEL_ENV, "gather")  # scheduling, not the kernel
    base = HFEngine.from_pretrained(str(tiny_models["generator"]))
    prompts = [ids(base, t) for t in TEXTS]
    sampling = SamplingParams(max_new_tokens=10, ignore_eos=True)
    expected = _run_sessions(HFEngine(base.model, base.tokenizer), prompts, sampling)
    engine = HFEngine(base.model, base.tokenizer)
    step_kv = engine.runner.step_kv

    def limited(sessions):
        if sum(len(s.rows) for s in sessions) > 4:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return step_kv(sessions)

    monkeypatch.setattr(engine.runner, "step_kv", limited)
    got = _run_sessions(engine, prompts, sampling)
    assert got == expected
    engine.runner.kv.collect()
    assert engine.runner.kv.used_blocks == 0


def test_building_and_stepping_a_pool_changes_no_torch_setting(engine):
    """Nothing process-wide: dynamo's configuration is the same before and after a pool is built (its
    kernel compiled) and stepped, and an unrelated compiled function still falls back to eager at its
    recompile limit instead of raising."""
    before = torch._dynamo.config.get_config_copy()
    batch, _ = RowBatch.prefill(engine.model, [ids(engine, TEXTS[1])], engine.pad_id, engine.device)
    kv = KVCache(engine.model, engine.device, memory=8 << 20, block_size=16, max_rows=4)
    _steps(engine, kv, batch, (0, 0))
    assert torch._dynamo.config.get_config_copy() == before
    unrelated = torch.compile(lambda x: x.sum() * 2, dynamic=False)
    for size in range(1, torch._dynamo.config.recompile_limit + 3):  # past its limit: eager, no error
        assert float(unrelated(torch.ones(size))) == 2 * size


def test_a_reward_feed_that_raises_gives_back_its_blocks_and_the_scorer_serves_on(tiny_models, monkeypatch):
    """The reward model's streaming sessions (a chunked feed per decision token): a feed whose forward
    raises leaks no block; after close the pool is empty."""
    from pipeline.engines.rewards import RewardScorer

    scorer = RewardScorer.from_pretrained(str(tiny_models["reward"]))
    kv = scorer.kv
    prompts = ["Describe how the blender works", "Hi"]
    texts = ["It blends", "Hello there, friend"]
    forward = type(scorer._base_model()).forward
    failures = {"left": 3}

    def flaky(self, *args, **kwargs):
        if failures["left"]:
            failures["left"] -= 1
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return forward(self, *args, **kwargs)

    scorer.open("s", prompts, 2)
    rows = [0, 1, 2, 3]
    answers = [texts[0], texts[0] + " well", texts[1], texts[1] + ", and welcome to the shop"]
    scorer.extend("s", rows, answers)  # the rows' blocks: the prompts' heads shared, each row's own
    kv.collect()
    held = kv.used_blocks
    assert held > 0
    monkeypatch.setattr(type(scorer._base_model()), "forward", flaky)
    longer = [a + " and then some more words to read at the next decision token" for a in answers]
    for _ in range(3):
        with pytest.raises(torch.OutOfMemoryError):
            scorer.extend("s", rows, longer)
        kv.collect()
        assert kv.used_blocks <= held
    assert len(scorer.extend("s", rows, longer)) == 4  # it serves on
    scorer.close("s")
    kv.collect()
    assert kv.used_blocks == 0


def _prompt(length: int, salt: int) -> list[int]:
    return [3 + (salt * 31 + i * 7) % 400 for i in range(length)]


def _session_rows(engine, name, prompt, rows, cap, seed):
    engine.open(name, [prompt], rows, [seed + k for k in range(rows)], SamplingParams(max_new_tokens=cap,
                                                                                       ignore_eos=True))
    try:
        return [r.token_ids for r in engine.extend(name, until=cap)]
    finally:
        engine.close(name)


def _mixed(engine, sessions, cap, stagger):
    """Sessions (prompt, rows, seed) on concurrent threads, started in order with ``stagger`` seconds
    between them; each one's rows' tokens, or the error it raised."""
    import time

    out = {}

    def run(i, prompt, rows, seed):
        try:
            out[i] = _session_rows(engine, f"m{i}", prompt, rows, cap, seed)
        except Exception as exc:  # noqa: BLE001 - the test names it
            out[i] = exc

    threads = []
    for i, session in enumerate(sessions):
        threads.append(threading.Thread(target=run, args=(i, *session)))
        threads[-1].start()
        time.sleep(stagger)
    for t in threads:
        t.join()
    return out


def _pool_engine(base, blocks):
    probe = HFEngine(base.model, base.tokenizer)
    probe.generate([ids(base, "Hi")], 1, [0], SamplingParams(max_new_tokens=2))  # allocates: block bytes
    return lambda: HFEngine(base.model, base.tokenizer, kv_cache_memory=f"{blocks * probe.runner.kv.block_bytes}B")


@pytest.mark.parametrize("blocks", [50, 26])
def test_sessions_that_complete_alone_complete_together_after_preemption(tiny_models, monkeypatch, blocks):
    """The issue's cases: a pool of 4-token blocks, two sessions of 8 rows on a 41-token prompt, 12 new
    tokens (one alone peaks at 34 blocks). A preempted session comes back with its prompt's blocks
    written once and shared (not once per row), so both complete with every row, the tokens they give
    alone; in 26 blocks each completes alone and both complete together (no false KVBudgetError)."""
    monkeypatch.setattr(kv_cache, "BLOCK_SIZE", 4)
    monkeypatch.setenv(kv_cache.KERNEL_ENV, "gather")  # scheduling, not the kernel
    base = HFEngine.from_pretrained(str(tiny_models["generator"]))
    make = _pool_engine(base, blocks)
    rows = 8 if blocks == 50 else 4
    sessions = [(_prompt(41, 1), rows, 10), (_prompt(41, 2), rows, 20)]
    alone = [_session_rows(make(), "a", *session[:2], 12, session[2]) for session in sessions]
    engine = make()
    got = _mixed(engine, sessions, 12, 0.0)
    assert [got[i] for i in range(2)] == alone
    engine.runner.kv.collect()
    assert engine.runner.kv.used_blocks == 0


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blocks=st.integers(12, 60), cap=st.integers(2, 14), stagger=st.sampled_from([0.0, 0.002]),
       sessions=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 6)), min_size=2, max_size=4))
def test_every_session_that_completes_alone_completes_mixed_with_every_row(tiny_models, blocks, cap, stagger,
                                                                              sessions):
    """Property (pool sizes, session mixes, prompt lengths across block boundaries, N, arrival order):
    every session that completes alone in a pool completes, with every row and the same tokens, when
    it runs beside the others in a pool of the same size; the pool is empty after."""
    import os

    old = kv_cache.BLOCK_SIZE, os.environ.get(kv_cache.KERNEL_ENV)
    kv_cache.BLOCK_SIZE, os.environ[kv_cache.KERNEL_ENV] = 4, "gather"
    try:
        base = _base_engine(tiny_models)
        make = _pool_engine(base, blocks)
        specs = [(_prompt(length, i), rows, 100 * i) for i, (length, rows) in enumerate(sessions)]
        alone = {}
        for i, spec in enumerate(specs):
            try:
                alone[i] = _session_rows(make(), "a", spec[0], spec[1], cap, spec[2])
            except KVBudgetError:
                continue
        fitting = sorted(alone)
        engine = make()
        got = _mixed(engine, [specs[i] for i in fitting], cap, stagger)
        assert {fitting[k]: v for k, v in got.items()} == alone
        engine.runner.kv.collect()
        assert engine.runner.kv.used_blocks == 0
    finally:
        kv_cache.BLOCK_SIZE = old[0]
        if old[1] is None:
            os.environ.pop(kv_cache.KERNEL_ENV, None)
        else:
            os.environ[kv_cache.KERNEL_ENV] = old[1]


_bases: dict = {}


def _base_engine(tiny_models):
    if "engine" not in _bases:
        _bases["engine"] = HFEngine.from_pretrained(str(tiny_models["generator"]))
    return _bases["engine"]


def test_initial_candidates_auto_without_a_row_limit_starts_what_the_pool_holds_to_the_cap(tiny_models, scorer,
                                                                                             monkeypatch):
    """``auto`` without max_live_candidates: the first batch is as wide as the pool holds to the first
    decision token AND whose survivors (half of them at rejection_rate 0.5, and keep_lowest's row) it
    holds to the length cap, so the build completes without a preemption (before, it started every
    row the first decision token allowed, whose survivors could outgrow the pool); a pool that holds
    fewer than num_samples rows starts num_samples, no more."""
    from pipeline.decoding.domain import PromptInput
    from pipeline.decoding.speculative_rejection import SpeculativeRejectionParams, _width, speculative_rejection

    monkeypatch.setattr(kv_cache, "BLOCK_SIZE", 4)
    monkeypatch.setenv(kv_cache.KERNEL_ENV, "gather")  # sizing, not the kernel
    base = HFEngine.from_pretrained(str(tiny_models["generator"]))
    text = TEXTS[1]
    prompt = PromptInput("p0", text, text, ids(base, text))
    cap, tau = 40, 4
    sampling = SamplingParams(max_new_tokens=cap, ignore_eos=True)
    params = SpeculativeRejectionParams(decision_token=tau, rejection_rate=0.5, initial_candidates="auto")
    engine = _pool_engine(base, 60)()
    first = engine.capacity([prompt.token_ids], tau)
    last = engine.capacity([prompt.token_ids], cap)
    assert first > 2 * last  # the first decision token's rows alone would outgrow the pool by the cap
    (result,) = speculative_rejection([prompt], engine, scorer, params, sampling, 2, seed=3)
    width = result.stats["initial_candidates"]
    survivors = [round(w / 2) + 1 for w in (width, width + 1)]  # Eq. 3's half, and keep_lowest's row
    assert survivors[0] <= last < survivors[1] and width <= first
    assert engine.stats()["kv_preemptions"] == 0 and len(result.candidates) == 2
    small = _pool_engine(base, 6)()  # fewer rows than num_samples fit: num_samples start, no more
    assert small.capacity([prompt.token_ids], tau) < 4
    assert _width(small, [prompt], params, 4, [tau], sampling) == 4


def test_the_kernels_row_buckets_follow_rows_in_flight(tiny_models, tmp_path, monkeypatch):
    """runtime.rows_in_flight reaches the generator's pool as its largest row bucket (fewer compiles
    at allocation); unset (0), the default MAX_ROWS."""
    from actors.factory import _plan_actors
    from pipeline.engines.attention_kernel import MAX_ROWS, row_buckets

    monkeypatch.setenv(kv_cache.KERNEL_ENV, "gather")  # the buckets, not their compiles

    for rows, expected in ((16, [1, 16]), (100, [1, 16, 100]), (0, row_buckets(MAX_ROWS))):
        config = config_from_dict({"models": {"generator": str(tiny_models["generator"]),
                                              "reward": str(tiny_models["reward"])},
                                   "data": {"prompts": str(tmp_path / "p.jsonl"), "output": str(tmp_path / "out")},
                                   "runtime": {"local": True, "rows_in_flight": rows}})
        plan = _plan_actors(config)
        assert plan.generator_kwargs["kv_rows"] == (rows or None)
        engine = HFEngine(_base_engine(tiny_models).model, _base_engine(tiny_models).tokenizer,
                          kv_cache_memory="8MB", kv_rows=plan.generator_kwargs["kv_rows"])
        engine.generate([ids(engine, "Hi")], 1, [0], SamplingParams(max_new_tokens=2))
        assert engine.stats()["kv_kernel_buckets"] == expected
    auto = HFEngine(_base_engine(tiny_models).model, _base_engine(tiny_models).tokenizer, kv_rows=1)
    auto.generate([ids(auto, "Hi")], 5, list(range(5)), SamplingParams(max_new_tokens=2))  # more rows than kv_rows
    context = auto.model.config.max_position_embeddings  # "auto": what MAX_ROWS rows of the whole context use
    assert auto.runner.kv.num_blocks == MAX_ROWS * (-(-context // auto.runner.kv.block_size) + 1)


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
