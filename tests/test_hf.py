"""HF engine on a tiny real Llama: KV-cache decoding, batching, pruning, counters."""

import numpy as np
import pytest
import torch

from pipeline.decoding.sampling import SamplingParams
from pipeline.engines.hf import HFEngine

SAMPLE = SamplingParams(max_new_tokens=12)
GREEDY = SamplingParams(max_new_tokens=10, temperature=0)


def ids(engine, text):
    return engine.tokenizer(text).input_ids


def test_greedy_matches_hf_generate_with_left_padding(engine):
    short, long = ids(engine, "Write a review"), ids(engine, "Tell me if the battery lasts well in the cold")
    rows = engine.generate([short, long], 1, [0, 1], GREEDY)
    for prompt, row in zip([short, long], rows):
        out = engine.model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                    pad_token_id=engine.pad_id, eos_token_id=None)
        assert row.token_ids == out[0, len(prompt):].tolist()


def test_rows_do_not_depend_on_batch_company(engine):
    a, b = ids(engine, "Write a review of the lamp"), ids(engine, "Explain why the phone broke so quickly today")
    alone = engine.generate([a], 3, [11, 12, 13], SAMPLE)
    mixed = engine.generate([b, a], 3, [21, 22, 23, 11, 12, 13], SAMPLE)
    assert [r.token_ids for r in alone] == [r.token_ids for r in mixed[3:]]
    again = engine.generate([a], 3, [11, 12, 13], SAMPLE)
    assert [r.token_ids for r in alone] == [r.token_ids for r in again]
    assert len({tuple(r.token_ids) for r in alone}) == 3  # different seeds, different samples


def test_generate_bounds_each_sessions_padded_prefill(engine, monkeypatch):
    """Many or long prompts are prefilled a bounded group at a time (one left-padded pass per session,
    whose memory grows with padded tokens): the rows are the same and in the same order."""
    import pipeline.engines.hf as hf

    prompts = [ids(engine, f"Write {k} words about the lamp" + " and more" * (k % 4)) for k in range(6)]
    seeds = list(range(100, 112))
    whole = engine.generate(prompts, 2, seeds, SAMPLE)
    opened = []
    original = engine.open
    monkeypatch.setattr(engine, "open", lambda name, group, *a, **k: opened.append(group) or original(name, group, *a, **k))
    longest = max(len(p) for p in prompts)
    monkeypatch.setattr(hf, "GENERATE_PREFILL_TOKENS", 2 * longest)
    split = engine.generate(prompts, 2, seeds, SAMPLE)
    assert len(opened) >= 3 and [p for group in opened for p in group] == prompts
    assert all(len(group) * max(map(len, group)) <= 2 * longest for group in opened)
    assert [(r.row, r.token_ids) for r in split] == [(r.row, r.token_ids) for r in whole]
    monkeypatch.setattr(hf, "GENERATE_PREFILL_TOKENS", 1)  # a prompt over the bound goes alone
    opened.clear()
    assert [r.token_ids for r in engine.generate(prompts, 2, seeds, SAMPLE)] == [r.token_ids for r in whole]
    assert [len(group) for group in opened] == [1] * 6


def test_pruned_rows_leave_the_batch_and_kept_rows_continue_unchanged(engine):
    prompt = ids(engine, "Describe how the blender works")
    seeds = [5, 6, 7, 8]
    full = engine.generate([prompt], 4, seeds, SAMPLE)
    assert all(len(r.token_ids) == 12 for r in full)  # precondition: no row hits EOS with these seeds
    engine.open("prune", [prompt], 4, seeds, SAMPLE)
    first = engine.extend("prune", until=4)
    assert [len(r.token_ids) for r in first] == [4, 4, 4, 4]
    before = len(engine.sessions["prune"].kv)  # its rows sit in the engine's KV cache
    rest = engine.extend("prune", until=12, keep=[1, 3])
    state = engine.sessions.get("prune")
    assert [r.row for r in rest] == [1, 3]
    assert [r.token_ids for r in rest] == [full[1].token_ids, full[3].token_ids]
    assert state.rows == [] and before == 4
    counters = engine.close("prune")
    # 4 rows x 4 tokens, then 2 rows x 8 tokens; 1 prefill + 3 + 8 decode steps.
    assert counters == {"generated_tokens": 4 * 4 + 2 * 8, "forward_passes": 1 + 3 + 8}


def test_pruning_frees_blocks_and_moves_no_row(engine):
    """The paged KV cache (issue 48): a prune frees the dropped rows' blocks; the kept rows' blocks
    stay where they are, in buffers allocated once (no row's KV is copied), the prompt's whole
    blocks are shared by its samples, and a close frees the rest."""
    kv = engine.runner.kv
    prompt = ids(engine, "Tell me if the camera is good " * 30)  # longer than one block
    engine.open("shrink", [prompt], 6, list(range(6)), SAMPLE)
    engine.extend("shrink", until=3)
    assert len(prompt) > kv.block_size
    handles, buffer = list(engine.sessions["shrink"].kv), kv.keys[0].data_ptr()
    tables = {h: kv._rows.tables[h, :2].copy() for h in handles}
    assert len({tables[h][0] for h in handles}) == 1  # the prompt's whole block, shared by the six rows
    assert kv.refs[tables[handles[0]][0]] == 6
    used = kv.used_blocks
    engine.extend("shrink", until=5, keep=[0, 2])
    assert engine.sessions["shrink"].kv == [handles[0], handles[2]] and kv.keys[0].data_ptr() == buffer
    assert kv.used_blocks == used - 4 and kv.refs[tables[handles[0]][0]] == 2  # four tails back; shared ref 2
    for h in (handles[0], handles[2]):
        assert (kv._rows.tables[h, :2] == tables[h]).all() and kv._rows.length[h] == len(prompt) + 4
    engine.close("shrink")
    kv.collect()
    assert kv.used_blocks == 0 and kv.stats()["kv_prompt_bytes_shared"] >= 5 * kv.block_bytes


def test_eos_stops_a_row_and_is_not_in_the_text(tiny_models):
    engine = HFEngine.from_pretrained(str(tiny_models["generator"]))
    prompt = ids(engine, "Write a review")
    greedy = engine.generate([prompt], 1, [0], GREEDY)[0].token_ids
    engine.model.generation_config.eos_token_id = greedy[3]  # the 4th greedy token now ends the response
    engine = HFEngine(engine.model, engine.tokenizer)
    row = engine.generate([prompt], 1, [0], GREEDY)[0]
    assert row.finished and row.token_ids == greedy[:3]
    assert engine.generated_tokens == 4  # the EOS token was generated, then the row left the batch
    fixed = engine.generate([prompt], 1, [0], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))[0]
    assert fixed.token_ids == greedy  # ignore_eos: the EOS token is kept and decoding runs to the cap


def _sbon_like(engine, name, prompts, width, seeds, sampling, pause=0.0):
    """open, decode to a decision token, prune to every third row, decode to the end, close."""
    import time

    engine.open(name, prompts, width, seeds, sampling)
    time.sleep(pause)
    first = engine.extend(name, until=3)
    live = [r.row for r in first if not r.finished][::3]
    rest = engine.extend(name, until=sampling.max_new_tokens, keep=live)
    counters = engine.close(name)
    return [(r.row, r.token_ids, r.text, r.finished) for r in first + rest], counters


def test_concurrent_sessions_make_the_same_candidates_as_one_at_a_time(tiny_models):
    """Sessions on concurrent threads share the step loop's batch (rows join, prune, hit EOS and
    leave at different steps), and every row's tokens and text equal those of the sessions run one
    at a time."""
    from concurrent.futures import ThreadPoolExecutor

    base = HFEngine.from_pretrained(str(tiny_models["generator"]))
    prompt = ids(base, "Write a review")
    sampling = SamplingParams(max_new_tokens=16)
    # An EOS the tiny model samples now and then, so some rows finish early.
    sampled = base.generate([prompt], 8, list(range(8)), sampling)
    eos = max({t for r in sampled for t in r.token_ids[2:]}, key=lambda t: sum(r.token_ids.count(t) for r in sampled))
    base.model.generation_config.eos_token_id = eos
    alone = HFEngine(base.model, base.tokenizer)
    shared = HFEngine(base.model, base.tokenizer)
    texts = ["Write a review of the lamp", "Explain why the phone broke so quickly today", "Describe the blender",
             "Tell me if the camera is good", "Summarize the app", "A note about the delivery, please, today"]
    jobs = [(f"s{i}", [ids(base, t) for t in texts[i:i + 1 + i % 2]], 3 + i % 3, 0.01 * (i % 3))
            for i in range(len(texts))]
    jobs = [(name, p, w, [1000 * i + k for k in range(len(p) * w)], pause)
            for i, (name, p, w, pause) in enumerate(jobs)]
    expected = [_sbon_like(alone, name, p, w, seeds, sampling) for name, p, w, seeds, _ in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _sbon_like(shared, job[0], job[1], job[2], job[3], sampling, job[4]), jobs))
    assert [g[0] for g in got] == [e[0] for e in expected]
    assert [g[1]["generated_tokens"] for g in got] == [e[1]["generated_tokens"] for e in expected]
    assert any(finished for rows, _ in expected for *_, finished in rows)  # precondition: EOS happened
    # One at a time, each step decodes one session; together, the sessions shared forward passes.
    assert alone.forward_passes == sum(c["forward_passes"] for _, c in expected)
    assert shared.forward_passes < sum(c["forward_passes"] for _, c in got)
    shared.runner.kv.collect()
    assert shared.sessions == {} and shared.loop._members == [] and shared.runner.kv.used_blocks == 0


def test_the_step_loop_hands_a_model_error_to_every_call_in_the_step(tiny_models):
    from concurrent.futures import ThreadPoolExecutor

    engine = HFEngine.from_pretrained(str(tiny_models["generator"]))
    prompt = ids(engine, "Write a review")
    engine.open("a", [prompt], 2, [1, 2], SAMPLE)
    engine.open("b", [prompt], 3, [3, 4, 5], SAMPLE)
    forward = engine.model.forward
    engine.model.forward = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("device lost"))
    try:
        with ThreadPoolExecutor(2) as pool:
            calls = [pool.submit(engine.extend, name, 4) for name in ("a", "b")]
            for call in calls:
                with pytest.raises(RuntimeError, match="device lost"):
                    call.result()
    finally:
        engine.model.forward = forward
    assert engine.loop._members == [] and engine.loop._driving is None
    engine.open("c", [prompt], 2, [1, 2], SAMPLE)  # the loop still serves
    assert len(engine.extend("c", until=4)) == 2


def test_the_step_loop_refuses_a_call_from_inside_its_own_model_work(tiny_models):
    """A model-side search runs between steps, as the loop's driver: an engine call from it would
    wait for itself, so it fails at once instead of hanging."""
    from pipeline.decoding.best_of_n import BestOfNParams

    def nested(host, token_ids, num_samples, seeds, sampling, params):
        return host.engine.generate(token_ids, num_samples, seeds, sampling)

    engine = HFEngine.from_pretrained(str(tiny_models["generator"]))
    prompt = ids(engine, "Write a review")
    with pytest.raises(RuntimeError, match="would wait for itself"):
        engine.search(nested, [prompt], 2, [1, 2], SAMPLE, BestOfNParams())
    assert len(engine.generate([prompt], 2, [1, 2], SAMPLE)) == 2  # the engine still serves


def test_search_takes_the_search_function_and_refuses_a_name(engine):
    """The engine runs the function it is given, with its search host; a strategy's name is no
    function (the engine looks nothing up)."""
    from pipeline.decoding.best_of_n import BestOfNParams

    seen = []

    def search(host, token_ids, num_samples, seeds, sampling, params):
        seen.append((host, token_ids, num_samples, seeds, params, torch.is_inference_mode_enabled()))
        return ["done"]

    params = BestOfNParams()
    assert engine.search(search, [[1, 2]], 2, [3, 4], SAMPLE, params) == ["done"]
    assert seen == [(engine.search_host, [[1, 2]], 2, [3, 4], params, False)]
    with pytest.raises(TypeError, match="got 'ults'"):
        engine.search("ults", [[1, 2]], 2, [3, 4], SAMPLE, params)


def _speculative(k=4, max_rows=16):
    from pipeline.decoding.speculative import SpeculativeDecoding

    return SpeculativeDecoding(num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3, max_rows=max_rows)


REPETITIVE = ["the lamp is good the lamp is good the lamp is good the lamp",
              "one two three one two three one two three one two"]


def test_speculative_decoding_makes_the_same_rows_in_fewer_forward_passes(tiny_models):
    """Prompt-lookup drafts verified with ADED's sampling acceptance: every row equals plain
    decoding's (greedy and sampled, EOS included), and accepted drafts save forward passes."""
    base = HFEngine.from_pretrained(str(tiny_models["generator"]))
    prompts = [ids(base, t) for t in REPETITIVE]
    for sampling in (SamplingParams(max_new_tokens=24, temperature=0), SamplingParams(max_new_tokens=24, temperature=0.7)):
        plain = HFEngine(base.model, base.tokenizer)
        fast = HFEngine(base.model, base.tokenizer, speculative=_speculative())
        expected = plain.generate(prompts, 3, list(range(6)), sampling)
        got = fast.generate(prompts, 3, list(range(6)), sampling)
        assert [(r.row, r.token_ids, r.finished) for r in got] == [(r.row, r.token_ids, r.finished) for r in expected]
        assert fast.generated_tokens == plain.generated_tokens
        assert fast.forward_passes <= plain.forward_passes
    # A batch advances with its slowest row: greedy rows of the prompt the tiny model answers in a
    # loop accept their drafts, and save passes.
    greedy = SamplingParams(max_new_tokens=24, temperature=0)
    plain = HFEngine(base.model, base.tokenizer)
    fast = HFEngine(base.model, base.tokenizer, speculative=_speculative())
    assert [r.token_ids for r in fast.generate(prompts[1:], 3, [0, 1, 2], greedy)] == \
        [r.token_ids for r in plain.generate(prompts[1:], 3, [0, 1, 2], greedy)]
    assert fast.forward_passes < plain.forward_passes
    # More live rows than max_rows when the extend starts: plain steps, the same passes as without it.
    wide = HFEngine(base.model, base.tokenizer, speculative=_speculative(max_rows=2))
    wide.generate(prompts[1:], 3, [0, 1, 2], greedy)
    assert wide.forward_passes == plain.forward_passes


def test_speculative_decoding_finishes_only_the_rows_after_the_last_decision_token(tiny_models):
    """sbon's pattern (a decision token, prune, finish to the cap): the extend to the decision token
    decodes plainly, the finish speculates; rows, EOS and counters equal plain decoding's, with the
    sessions one at a time and on concurrent threads."""
    from concurrent.futures import ThreadPoolExecutor

    base = HFEngine.from_pretrained(str(tiny_models["generator"]))
    sampling = SamplingParams(max_new_tokens=20, temperature=0.7)
    sampled = base.generate([ids(base, REPETITIVE[0])], 8, list(range(8)), sampling)
    eos = max({t for r in sampled for t in r.token_ids[2:]}, key=lambda t: sum(r.token_ids.count(t) for r in sampled))
    base.model.generation_config.eos_token_id = eos  # some rows end early
    jobs = [(f"s{i}", [ids(base, REPETITIVE[i % 2])], 6, [100 * i + k for k in range(6)]) for i in range(4)]
    plain = HFEngine(base.model, base.tokenizer)
    expected = [_sbon_like(plain, name, p, w, seeds, sampling) for name, p, w, seeds in jobs]
    fast = HFEngine(base.model, base.tokenizer, speculative=_speculative())
    steps = []
    speculative_step = fast.runner.speculative_step
    fast.runner.speculative_step = lambda state: steps.append(len(state.tokens[state.rows[0]])) or speculative_step(state)
    got = [_sbon_like(fast, name, p, w, seeds, sampling) for name, p, w, seeds in jobs]
    assert [g[0] for g in got] == [e[0] for e in expected]
    assert [g[1]["generated_tokens"] for g in got] == [e[1]["generated_tokens"] for e in expected]
    assert steps and min(steps) >= 3  # only the finishes (after the decision token at 3) speculated
    assert any(finished and len(tokens) < 20 for rows, _ in expected for _, tokens, _, finished in rows)  # EOS
    shared = HFEngine(base.model, base.tokenizer, speculative=_speculative())
    with ThreadPoolExecutor(len(jobs)) as pool:
        threaded = list(pool.map(lambda job: _sbon_like(shared, *job, sampling), jobs))
    assert [g[0] for g in threaded] == [e[0] for e in expected]
    assert shared.sessions == {} and shared.loop._members == [] and shared.loop._driving is None


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_prepacked_linears_match_pytorchs_and_do_not_depend_on_the_batch(tiny_models, engine):
    from pipeline.engines.hf import PackedLinear

    plain = HFEngine.from_pretrained(str(tiny_models["generator"]), prepack=False)
    linears = [type(m) for m in plain.model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
    packed = [type(m) for m in engine.model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
    assert linears and set(linears) == {torch.nn.Linear} and packed == [PackedLinear] * len(linears)
    prompt = ids(engine, "Tell me if the battery lasts well in the cold")
    with torch.inference_mode():
        a = engine.model(torch.tensor([prompt])).logits
        b = plain.model(torch.tensor([prompt])).logits
    assert torch.allclose(a, b, atol=1e-4)  # the other kernel, the same numbers to float rounding
    assert [r.token_ids for r in engine.generate([prompt], 2, [3, 4], GREEDY)] == \
        [r.token_ids for r in plain.generate([prompt], 2, [3, 4], GREEDY)]
    layer = PackedLinear(torch.nn.Linear(64, 96))
    x = torch.randn(16, 64)
    with torch.inference_mode():
        full = layer(x)
        assert all(torch.equal(layer(x[:m]), full[:m]) for m in (1, 2, 3, 5, 8))  # bitwise, any batch size


def test_prepack_is_off_for_other_dtypes_and_when_asked(tiny_models):
    from pipeline.engines.hf import PackedLinear

    for kwargs in ({"prepack": False}, {"dtype": "bfloat16"}):
        model = HFEngine.from_pretrained(str(tiny_models["generator"]), **kwargs).model
        assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_models_cpu_prepack_reaches_every_actor(tiny_models, tmp_path):
    from actors.factory import _plan_actors
    from pipeline.config import config_from_dict
    from pipeline.engines.hf import PackedLinear, can_prepack

    def packed(model) -> bool:
        return any(isinstance(m, PackedLinear) for m in model.modules())

    for setting in (True, False):
        config = config_from_dict({
            "models": {"generator": str(tiny_models["generator"]), "reward": str(tiny_models["reward"]),
                       "cpu_prepack": setting},
            "data": {"prompts": str(tmp_path / "prompts.jsonl"), "output": str(tmp_path / "out")},
            "runtime": {"local": True}})
        plan = _plan_actors(config)
        generator = plan.generator_cls(*plan.generator_args, **plan.generator_kwargs)
        reward = plan.reward_cls(*plan.reward_args, **plan.reward_kwargs)
        assert packed(generator.engine.model) == packed(reward.scorer.model) == (setting and can_prepack("cpu", "float32"))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("block_size", [4, 16, 128])
def test_kv_cache_steps_match_each_rows_own_batch(engine, monkeypatch, attention, block_size, flex_kernel):
    """KVCache (issue 48): rows of different lengths admitted from two batches (one prompt's blocks
    shared by two samples), one released, the others stepped in any order across block edges: each
    row's logits are those of its own unpadded RowBatch, whatever the model's own attention
    implementation (a step always reads the blocks with flex_attention), and a row that does not
    step keeps its blocks."""
    from pipeline.engines.kv_cache import KVCache
    from pipeline.engines.rows import RowBatch

    monkeypatch.setattr(engine.model.config, "_attn_implementation", attention)
    prompts = [ids(engine, "Describe how the blender works"), ids(engine, "Hi"),
               ids(engine, "Tell me if the camera is good, and why, in two lines")]
    kv = KVCache(engine.model, engine.device, memory=4 << 20, block_size=block_size)
    first, _ = RowBatch.prefill(engine.model, prompts[:2], engine.pad_id, engine.device)
    second, _ = RowBatch.prefill(engine.model, prompts[2:], engine.pad_id, engine.device)
    handles = kv.admit(first, [0, 0, 1]) + kv.admit(second)
    kv.release([handles[0]])
    own = {h: RowBatch.prefill(engine.model, [p], engine.pad_id, engine.device)[0]
           for h, p in zip(handles[1:], prompts)}
    stepping = [handles[3], handles[2], handles[1]]
    for step in range(2 * block_size + 3):
        if step == block_size:
            still = kv._rows.tables[handles[2]].copy(), kv._rows.length[handles[2]]
            stepping = [handles[3], handles[1]]  # handles[2] waits
        tokens = torch.tensor([5 + step + i for i in range(len(stepping))])
        logits = kv.step(stepping, tokens, logits_to_keep=1).logits[:, -1]
        for row, (h, token) in enumerate(zip(stepping, tokens)):
            expected = own[h].feed(token.view(1, 1), logits_to_keep=1).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4)
    assert (kv._rows.tables[handles[2]] == still[0]).all() and kv._rows.length[handles[2]] == still[1]
    assert engine.model.config._attn_implementation == attention


def test_the_engines_samples_follow_the_models_distribution(engine):
    """Counter-based row streams (pipeline.decoding.sampling.RowStreams) draw the model's own
    distribution: 3,000 rows of one prompt, their first token (sampled after the prefill) and their
    second one (a KV-pool step), each against the model's probabilities by chi-square, the rare
    tokens pooled into one bin. The second tokens' law is the mixture of the model's next-token
    distributions after each first token, weighted by how many rows drew it. The tiny model is
    almost uniform over its vocabulary, so a low temperature gives the test bins worth counting."""
    from scipy.stats import chisquare

    prompt = ids(engine, "Write a review of the lamp")
    rows = 3000
    sampling = SamplingParams(max_new_tokens=2, temperature=0.1)
    out = engine.generate([prompt], rows, list(range(10_000, 10_000 + rows)), sampling)
    eos = sorted(engine.runner.eos_ids)
    first = [r.token_ids[0] for r in out if r.token_ids]
    pairs = [r.token_ids for r in out if len(r.token_ids) == 2]

    def probabilities(contexts):  # [C, V], each context's next-token law, EOS left out
        with torch.inference_mode():
            logits = engine.model(torch.tensor(contexts)).logits[:, -1].float() / sampling.temperature
        probs = logits.softmax(-1)
        probs[:, eos] = 0
        return probs / probs.sum(-1, keepdim=True)

    starts = sorted({t for t, _ in pairs})
    after = probabilities([prompt + [t] for t in starts])  # [U, V]
    weights = torch.tensor([sum(1 for t, _ in pairs if t == u) for u in starts], dtype=torch.float)
    laws = {"first": (first, probabilities([prompt])[0]), "second": ([b for _, b in pairs], weights @ after)}
    for name, (sample, law) in laws.items():
        counts = torch.bincount(torch.tensor(sample), minlength=len(law)).double()
        expected = law.double() / law.sum() * len(sample)
        big = expected >= 5
        observed = torch.cat([counts[big], counts[~big].sum()[None]])
        wanted = torch.cat([expected[big], expected[~big].sum()[None]])
        wanted *= observed.sum() / wanted.sum()  # scipy wants the same totals to the last bits
        assert big.sum() >= 20, name  # the test has bins to count
        assert chisquare(observed.numpy(), wanted.numpy()).pvalue > 1e-3, name


def test_a_pooled_session_keeps_one_kv_row_per_prompt_until_its_rows_join_the_pool(engine):
    """The fanned-out copy of a session's prefilled KV (a prompt's cache once per sample) is never
    made: each prompt's row is written into its samples' slots when they join the pool, and a row
    that finished on its first token just drops out."""
    a, b = ids(engine, "Write a review of the lamp"), ids(engine, "Explain why the phone broke")
    engine.open("fan", [a, b], 4, list(range(8)), SAMPLE)
    try:
        state = engine.sessions["fan"]
        assert len(state.batch.next_position) == 2  # one row per prompt
        assert state.fan == [r // 4 for r in state.rows]
        rows = engine.extend("fan", until=SAMPLE.max_new_tokens)
    finally:
        engine.close("fan")
    assert state.fan is None and state.batch is None
    alone = engine.generate([a, b], 4, list(range(8)), SAMPLE)
    assert [r.token_ids for r in rows] == [r.token_ids for r in alone]
