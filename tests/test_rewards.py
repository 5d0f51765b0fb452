"""Reward scoring: chat-template formatting, batching, and non-finite scores."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.engines.rewards import RewardScorer


def test_chat_template_is_used_when_present(scorer):
    text = scorer.format("Hi there", "Hello!")
    assert text == "<s><|user|>Hi there\n<|assistant|>Hello!\n"


def test_batched_scores_match_one_by_one(scorer):
    prompts = ["Write a review of the lamp.", "Explain why", "Tell me if the camera is good in low light."]
    responses = ["It works great.", "", "The camera works well and I would keep it, it is fine."]
    batched = scorer.score(prompts, responses)
    single = [scorer.score([p], [r])[0] for p, r in zip(prompts, responses)]
    assert all(math.isfinite(s) for s in batched)
    for a, b in zip(batched, single):
        assert abs(a - b) < 1e-4
    assert len(set(round(s, 6) for s in batched)) == 3


@given(lengths=st.lists(st.integers(1, 600), max_size=40), batch_size=st.integers(1, 40),
       batch_tokens=st.integers(1, 5000))
@settings(max_examples=200, deadline=None)
def test_stateless_passes_are_bounded_by_sequences_and_padded_tokens(lengths, batch_size, batch_tokens):
    """Every sequence in exactly one pass; a pass holds at most batch_size sequences and at most
    batch_tokens padded tokens unless it is one sequence alone; longest first."""
    scorer = RewardScorer.__new__(RewardScorer)
    scorer.batch_size, scorer.batch_tokens = batch_size, batch_tokens
    batches = scorer._batches(lengths)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) <= batch_size
        padded = len(batch) * max(lengths[i] for i in batch)
        assert padded <= batch_tokens or len(batch) == 1
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(flat, reverse=True)


def test_scores_come_back_in_the_callers_order_whatever_the_passes(scorer):
    prompts = [f"Write a review of lamp {i}." for i in range(7)]
    responses = ["It works " + "great " * (3 * i % 7) for i in range(7)]
    one_pass = scorer.score(prompts, responses)
    before = scorer.batch_tokens
    try:
        scorer.batch_tokens = 1  # a pass per sequence
        alone = scorer.score(prompts, responses)
    finally:
        scorer.batch_tokens = before
    assert all(abs(a - b) < 1e-4 for a, b in zip(one_pass, alone))
    assert len(set(round(s, 6) for s in alone)) == 7


def test_non_finite_scores_are_nan_never_zero(tiny_models):
    poisoned = RewardScorer.from_pretrained(str(tiny_models["reward"]), prepack=False)  # its weights are edited below
    with torch.no_grad():
        poisoned.model.score.weight.fill_(float("inf"))
        poisoned.model.score.weight[0, 0] = float("-inf")  # inf - inf = nan for every input
    scores = poisoned.score(["a", "b"], ["x", "y"])
    assert all(math.isnan(s) for s in scores)


def _growing_texts():
    """Responses at three decision points, cut mid-word so BPE merges cross the old boundary."""
    full = ["The motor works well even after a month. I would recommend it.",
            "Whatever, do not ask me. The lid broke quickly.",
            "It is okay I guess. The jar feels solid unlike my old one.",
            "Not much to say."]
    return [[t[:n] for t in full] for n in (9, 23, 200)]


def test_streaming_scores_equal_full_rescoring_with_fewer_tokens(scorer):
    assert scorer.streaming  # a Llama reward model keeps a KV cache
    prompts = ["Review the blender for me.", "How good is the lamp?"]
    num_samples = 2
    rows = [0, 1, 2, 3]
    session_start, rescoring_tokens = scorer.tokens_read, 0
    scorer.open("s", prompts, num_samples)
    try:
        for step, texts in enumerate(_growing_texts()):
            live = rows if step < 2 else [0, 2]  # rows 1 and 3 are rejected before the last point
            responses = [texts[r] for r in live]
            streamed = scorer.extend("s", live, responses)
            before = scorer.tokens_read
            full = scorer.score([prompts[r // num_samples] for r in live], responses)
            rescoring_tokens += scorer.tokens_read - before
            assert streamed == pytest.approx(full, abs=1e-4)
            assert len(set(round(v, 5) for v in streamed)) == len(live)
            assert sorted(scorer.sessions["s"].handles) == live
    finally:
        counters = scorer.close("s")
    assert "s" not in scorer.sessions
    assert 0 < counters["tokens_read"] < rescoring_tokens
    assert scorer.tokens_read - session_start == counters["tokens_read"] + rescoring_tokens


def _two_sessions(scorer, cache_bytes):
    """Sessions a and b, scored in turn at three decision points by a scorer over ``scorer``'s model
    with a streaming pool of ``cache_bytes``: (that scorer, the scores, the tokens read)."""
    prompts = ["Review the blender for me.", "How good is the lamp?"]
    texts = _growing_texts()
    bounded = RewardScorer(scorer.model, scorer.tokenizer, cache_bytes=cache_bytes)
    for name in "ab":
        bounded.open(name, prompts, 2)
    scores = {}
    for step, rows in enumerate([[0, 1, 2, 3], [0, 1, 2, 3], [0, 2]]):
        for name in "ab":
            scores[name, step] = bounded.extend(name, rows, [texts[step][r] for r in rows])
            assert bounded.cached_bytes() <= (bounded.kv.nbytes() if bounded.kv else 0)
    read = bounded.tokens_read
    for name in "ab":
        bounded.close(name)
    assert bounded.cached_bytes() == 0 and not bounded.sessions
    return bounded, scores, read


@pytest.mark.parametrize("budget", ["one session", "zero"])
def test_a_small_reward_pool_gives_back_the_least_recent_sessions_blocks_and_keeps_the_scores(scorer, budget):
    """runtime.reward_cache_mb sizes the streaming sessions' block pool. When it lacks blocks, the
    session scored least recently gives its rows' blocks back first; those rows are read in full at
    their next score, which comes out the same. 0 keeps no cache: every row is read in full."""
    roomy, unbounded, unbounded_read = _two_sessions(scorer, None)
    assert roomy.dropped_rows == 0
    if budget == "zero":
        cache_bytes = 0
    else:  # the blocks one session holds at its peak, and the admission's watermark
        alone = RewardScorer(scorer.model, scorer.tokenizer)
        alone.open("a", ["Review the blender for me.", "How good is the lamp?"], 2)
        for step, rows in enumerate([[0, 1, 2, 3], [0, 1, 2, 3], [0, 2]]):
            alone.extend("a", rows, [_growing_texts()[step][r] for r in rows])
        cache_bytes = (alone.kv.peak_blocks + 1) * alone.kv.block_bytes
    bounded, scores, read = _two_sessions(scorer, cache_bytes)
    for key, values in scores.items():
        assert values == pytest.approx(unbounded[key], abs=1e-4)
    assert read > unbounded_read
    if budget == "zero":
        assert bounded.kv is None
    else:
        assert bounded.dropped_rows > 0 and bounded.kv.peak_blocks <= bounded.kv.num_blocks


def test_a_long_prompt_is_held_once_for_all_its_samples_in_the_reward_pool(scorer):
    """Issue 48: the reward model's streaming sessions keep a prompt's KV once, not once per sample.
    Eight samples of a long prompt hold its whole blocks once plus each row's own, and score as full
    re-scoring does."""
    prompt = "Write a careful review of the blender, its motor, its jar and its lid. " * 6
    responses = [f"It works {'well ' * i}and I keep it." for i in range(8)]
    kv_scorer = RewardScorer(scorer.model, scorer.tokenizer)
    kv_scorer.open("long", [prompt], 8)
    streamed = kv_scorer.extend("long", list(range(8)), responses)
    assert streamed == pytest.approx(kv_scorer.score([prompt] * 8, responses), abs=1e-4)
    kv = kv_scorer.kv
    head = len(kv_scorer.encode(prompt, ""))
    lengths = [len(kv_scorer.encode(prompt, r)) for r in responses]
    bs = kv.block_size
    assert head > 6 * bs
    own = sum(-(-(length - (head // bs) * bs) // bs) for length in lengths)
    assert kv.used_blocks <= head // bs + own
    assert kv.held_bytes() < 0.4 * sum(lengths) * kv.block_bytes / bs  # one copy per sample would be all of it
    assert kv_scorer.stats()["kv_prompt_bytes_shared"] >= 7 * (head // bs - 1) * kv.block_bytes
    kv_scorer.close("long")
    assert kv.used_blocks == 0


def test_a_finished_row_without_a_cache_is_scored_without_making_one(scorer):
    """A final score (finished) of a row the session holds no cache for reads the text statelessly:
    nothing will extend that row again. A cached row that finishes reads only its new tokens."""
    prompts = ["Review the blender for me.", "How good is the lamp?"]
    short, _, full = _growing_texts()
    scorer.open("final", prompts, 2)
    try:
        scorer.extend("final", [0, 1], [short[0], short[1]], finished=[False, False])  # 0 and 1 cached
        read = scorer.tokens_read
        got = scorer.extend("final", [0, 1, 2, 3], [full[r] for r in range(4)], finished=[True] * 4)
        assert sorted(scorer.sessions["final"].handles) == [0, 1]
        assert scorer.scored and scorer.tokens_read > read
    finally:
        scorer.close("final")
    want = scorer.score([prompts[r // 2] for r in range(4)], [full[r] for r in range(4)])
    assert got == pytest.approx(want, abs=1e-4)


def test_streaming_falls_back_to_rescoring_for_encoder_reward_models(tiny_models):
    from transformers import BertConfig, BertForSequenceClassification

    from pipeline.engines.hf import load_tokenizer

    tok = load_tokenizer(str(tiny_models["reward"]))
    torch.manual_seed(0)
    bert = BertForSequenceClassification(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=64, num_labels=1,
                                                    pad_token_id=tok.pad_token_id)).eval()
    encoder = RewardScorer(bert, tok)
    assert not encoder.streaming
    encoder.open("s", ["How good is the lamp?"], 2)
    texts = _growing_texts()
    for responses in texts:
        assert encoder.extend("s", [0, 1], responses[:2]) == pytest.approx(
            encoder.score(["How good is the lamp?"] * 2, responses[:2]), abs=1e-5)
    assert encoder.close("s")["tokens_read"] > 0


def test_coordinator_keeps_a_reward_session_on_the_scorer_that_opened_it(scorer, tiny_models):
    from actors.factory import local_scorer
    from pipeline.coordinator import _RoundRobin

    other = RewardScorer.from_pretrained(str(tiny_models["reward"]))
    pool = _RoundRobin([local_scorer(scorer, timed=False), local_scorer(other, timed=False)])
    pool.open("a", ["How good is the lamp?"], 2)
    pool.open("b", ["Review the jacket for me."], 2)
    assert ("a" in scorer.sessions) != ("a" in other.sessions)
    assert ("b" in scorer.sessions) != ("b" in other.sessions)
    for _ in range(3):  # stateless calls in between advance the round robin
        pool.score(["x"], ["y"])
        assert len(pool.extend("a", [0, 1], ["The bulb", "Who even"])) == 2
    pool.close("a"), pool.close("b")
    assert not scorer.sessions and not other.sessions
