"""Partial rewards that say nothing (issue 36, item 1), and a reward session that fails to open or
close (item 6): speculative rejection over the fake generator of tests/test_decoding.py and the
reward functions of tests/reward_functions.py (through FunctionScorer, as a build runs them), then
the issue's reproduction on the tiny models.

None (TRL's "no reward for this one"), NaN or inf for a *partial* response is no signal at that
decision token: the row stays live and out of every ranking. Only a non-finite *final* reward fails
a candidate."""

from __future__ import annotations

import json
import math

import pytest

from pipeline.decoding.best_of_n import best_of_n
from pipeline.decoding.domain import Candidate
from pipeline.decoding.sampling import SamplingParams, row_seed
from pipeline.decoding.speculative_rejection import (SpeculativeRejectionParams, _bon_tokens, rejection_cutoff,
                                                     speculative_rejection)
from pipeline.engines.rewards import FunctionScorer
from pipeline.errors import WorkerFailure
from tests import reward_functions
from tests.conftest import GOOD_PROMPTS, write_jsonl
from tests.test_decoding import FakeGenerator, prompts

T = 24
SAMPLING = SamplingParams(max_new_tokens=T)


def function(name: str) -> FunctionScorer:
    return FunctionScorer(f"tests.reward_functions:{name}")


def partial_texts(prompt_ids: list[str], width: int, tau: int, seed: int) -> dict[tuple[int, int], str]:
    """(prompt index, sample) -> the row's response text at tau (the fake generator's streams)."""
    out = {}
    for i, pid in enumerate(prompt_ids):
        probe = FakeGenerator()
        probe.open("x", [[1]], width, [row_seed(seed, pid, s) for s in range(width)], SAMPLING)
        out.update({(i, r.row): r.text for r in probe.extend("x", tau)})
    return out


def sbon(scorer, n_prompts=3, num_samples=4, seed=0, generator=None, **params):
    params = {"decision_token": 6, "rejection_rate": 0.5, **params}
    return speculative_rejection(prompts(n_prompts), generator or FakeGenerator(), scorer,
                                 SpeculativeRejectionParams(**params), SAMPLING, num_samples, seed)


@pytest.mark.parametrize("name", ["none_partial", "nan_partial", "inf_partial"])
@pytest.mark.parametrize("streaming", [True, False])
def test_absent_partial_rewards_stop_nothing_and_cost_what_best_of_n_costs(name, streaming):
    """The issue's case in miniature: with no partial reward anywhere, no row is stopped or failed,
    the candidates are Best-of-N's (same seeds), and generated tokens equal the Best-of-N tokens,
    which equal what plain Best-of-N generates (HEAD: every row failed at tau, 0% saved)."""
    results = sbon(function(name), streaming_rewards=streaming)
    bon = best_of_n(prompts(3), FakeGenerator(), function("scored"), None, SAMPLING, 4, 0)
    for got, want in zip(results, bon):
        assert all(c.completed and not c.failed and not c.stopped_early for c in got.candidates)
        assert [c.token_ids for c in got.candidates] == [c.token_ids for c in want.candidates]
        assert [c.score for c in got.candidates] == [c.score for c in want.candidates]
        assert got.generated_tokens == got.bon_equivalent_tokens == want.generated_tokens == 4 * T
        assert all(math.isnan(c.partials[6]) for c in got.candidates)  # recorded as "no signal at 6"


@pytest.mark.parametrize("keep_lowest", [True, False])
def test_unscored_rows_go_on_and_stay_out_of_the_cutoff_and_the_floor(keep_lowest):
    """Per prompt: the rows with no partial reward all go on; among the scored ones, exactly those
    at or above the alpha quantile of the scored partials go on, plus (keep_lowest) the lowest
    scored one. Nothing is quarantined."""
    n, width, tau, alpha = 4, 8, 6, 0.75
    results = sbon(function("none_partial_sometimes"), n_prompts=n, num_samples=width, decision_token=tau,
                   rejection_rate=alpha, keep_lowest=keep_lowest)
    texts = partial_texts([f"p{i}" for i in range(n)], width, tau, 0)
    unscored_seen = stopped_seen = 0
    for i, result in enumerate(results):
        partial = {s: reward_functions.real_score(texts[i, s]) for s in range(width)
                   if not reward_functions.absent_for(texts[i, s])}
        unscored = set(range(width)) - set(partial)
        r_cut = rejection_cutoff(list(partial.values()), alpha)
        expected = unscored | {s for s, v in partial.items() if v >= r_cut}
        if keep_lowest and partial:
            expected.add(min(partial, key=lambda s: (partial[s], s)))
        went_on = {c.sample for c in result.candidates if c.completed}
        assert went_on == expected
        assert all(not c.failed for c in result.candidates)
        assert all(c.stopped_at == tau and c.score == partial[c.sample] for c in result.candidates if c.stopped_early)
        unscored_seen += len(unscored)
        stopped_seen += width - len(went_on)
    assert unscored_seen and stopped_seen  # the case is not vacuous: both kinds of row occur


@pytest.mark.parametrize("budget, num_samples", [(3, 4), (2, 4), (5, 4)])
def test_memory_budget_puts_unscored_rows_first_and_fills_the_rest_by_rank(budget, num_samples):
    """Memory-budget mode: rows with no partial reward go on (never stopped, even past the budget);
    scored rows fill what is left of the budget by rank (keep_lowest's floor in the last slot when
    two or more are left). No returned candidate fails, also with a budget under num_samples, where
    stopped rows are returned."""
    n, width, tau = 4, 8, 6
    results = sbon(function("none_partial_sometimes"), n_prompts=n, num_samples=num_samples, decision_token=tau,
                   initial_candidates=width, max_live_candidates=budget)
    texts = partial_texts([f"p{i}" for i in range(n)], width, tau, 0)
    over_budget = stopped = 0
    for i, result in enumerate(results):
        partial = {s: reward_functions.real_score(texts[i, s]) for s in range(width)
                   if not reward_functions.absent_for(texts[i, s])}
        unscored = set(range(width)) - set(partial)
        over_budget += len(unscored) > budget
        ranked = sorted(partial, key=lambda s: (-partial[s], s))
        room = max(budget - len(unscored), 0)
        kept = ranked[:room]
        if room >= 2 and ranked[-1] not in kept:
            kept[-1] = ranked[-1]
        went_on = unscored | set(kept)
        stopped += width - len(went_on)
        # The result holds num_samples rows: the rows that went on first (they complete), then stopped ones.
        completed = [c for c in result.candidates if c.completed]
        assert len(completed) == min(len(went_on), num_samples)
        assert all(not c.failed for c in result.candidates)
        assert result.stats == {"initial_candidates": width, "screened_out": width - num_samples}
        # Which rows those are: each completed candidate's tokens are one of the rows that went on.
        streams = {s: texts[i, s] for s in went_on}
        assert all(" ".join(c.text.split()[:tau]) in streams.values() for c in completed)
    assert over_budget and stopped  # both cases occur: more unscored rows than the budget, and fewer


def test_memory_budget_with_no_signal_anywhere_stops_nothing():
    results = sbon(function("none_partial"), num_samples=4, initial_candidates=8, max_live_candidates=2)
    for result in results:
        assert all(c.completed and not c.failed for c in result.candidates)
        assert result.generated_tokens == 8 * T  # all 8 rows went on: none could be ranked


def test_best_of_n_estimate_uses_the_anchors_that_have_a_partial_at_that_tau():
    """A row stopped at tau is estimated from the prompt's rows live at tau that finished: the line
    through those scored at tau; when none was scored there, their mean length (HEAD: the cap)."""
    tau, cap = 4, SamplingParams(max_new_tokens=30)

    def rows(*anchors):
        out = {0: Candidate(0, [1] * tau, "", score=0.2, stopped_early=True, stopped_at=tau, partials={tau: 0.2})}
        for k, (partial, length) in enumerate(anchors, start=1):
            out[k] = Candidate(k, [1] * length, "", score=1.0, completed=True, partials={tau: partial})
        return out

    assert _bon_tokens(rows((math.nan, 10), (math.nan, 14)), 3, cap)[0] == 12  # none scored: mean length
    assert _bon_tokens(rows((0.5, 10), (math.nan, 14)), 3, cap)[0] == 10  # one scored anchor: its length
    assert _bon_tokens(rows((0.1, 10), (0.3, 20), (math.nan, 29)), 4, cap)[0] == 15  # the line through the scored
    # A row that ended before tau has no partial at tau: it is no anchor.
    early = rows((math.nan, 10))
    early[2] = Candidate(2, [1, 1], "", score=1.0, completed=True)
    assert _bon_tokens(early, 3, cap)[0] == 10


def test_a_non_finite_final_reward_still_fails_the_candidate():
    results = sbon(function("none_final"), num_samples=4)
    for result in results:
        assert all(c.failed == c.completed for c in result.candidates)  # stopped ones keep a finite partial
        assert any(c.stopped_early for c in result.candidates)
    results = sbon(function("nan_final_sometimes"), n_prompts=4, num_samples=6)
    candidates = [c for r in results for c in r.candidates]
    assert [c.failed for c in candidates] == [
        c.completed and not reward_functions.final_is_finite("nan_final_sometimes", c.text) for c in candidates]
    assert any(c.failed for c in candidates) and any(c.completed and not c.failed for c in candidates)


# -- item 6: the generator's session is closed whatever the reward session does -------------------


class FailingRewards:
    """A streaming scorer whose ``fail`` call raises WorkerFailure, as a dead reward actor's does."""

    def __init__(self, fail: str):
        self.fail, self.sessions = fail, set()
        self.inner = function("scored")

    def _maybe_fail(self, method):
        if method == self.fail:
            raise WorkerFailure(f"reward actor died during {method}()")

    def score(self, prompts, responses, finished=None, columns=None):
        self._maybe_fail("score")
        return self.inner.score(prompts, responses, finished, columns)

    def open(self, session, prompts, num_samples, columns=None):
        self._maybe_fail("open")
        self.sessions.add(session)
        self.inner.open(session, prompts, num_samples, columns)

    def extend(self, session, rows, responses, finished=None):
        self._maybe_fail("extend")
        return self.inner.extend(session, rows, responses, finished)

    def close(self, session):
        self._maybe_fail("close")
        self.sessions.discard(session)
        return self.inner.close(session)


@pytest.mark.parametrize("fail", ["open", "extend", "close"])
def test_a_reward_session_failure_closes_the_generator_session(fail):
    """HEAD: a reward session that failed to open (or to close) left the generator's prefilled batch
    open: one batch of KV cache leaked per reward-actor failure."""
    generator, rewards = FakeGenerator(), FailingRewards(fail)
    with pytest.raises(WorkerFailure, match=f"during {fail}"):
        sbon(rewards, generator=generator)
    assert generator.sessions == {}
    assert len(rewards.sessions) == (1 if fail == "close" else 0)  # a refused close keeps its one


# -- the issue's reproduction on the tiny models ---------------------------------------------------


def build(tiny_models, tmp_path, strategy: str, reward: str, **strategy_params) -> dict:
    from actors import start_workers
    from pipeline.build import plan_build, run_build
    from pipeline.config import config_from_dict

    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in GOOD_PROMPTS])
    out = tmp_path / strategy
    config = config_from_dict({
        "models": {"generator": str(tiny_models["generator"]), "reward": f"tests.reward_functions:{reward}"},
        "strategy": {"name": strategy, **strategy_params},
        "sampling": {"num_samples": 4, "max_new_tokens": 16, "top_p": 0.95},
        "data": {"prompts": str(prompts), "output": str(out), "shard_size": 4},
        "runtime": {"local": True, "batches_in_flight": 1},  # no shared passes: bit-equal to best_of_n
        "seed": 0,
    })
    workers = start_workers(config)
    try:
        run_build(plan_build(config), workers, progress=False)
    finally:
        workers.shutdown()
    return json.loads((out / "_manifest.json").read_text())


def test_issue_36_none_for_partials_builds_what_best_of_n_builds(tiny_models, tmp_path):
    """Issue 36, item 1: a reward function returning None for partial responses, sbon with tau 8,
    N 4, T 16. HEAD: 1 pair out of 24 prompts, 94 prefixes quarantined, "saved 0.0%" at half of
    Best-of-N's tokens. Now no row can be ranked at tau, so every row goes on: the same pairs and
    tokens as a best_of_n build with the same seeds, nothing quarantined, nothing saved."""
    sbon_manifest = build(tiny_models, tmp_path, "sbon", "none_partial", decision_token=8, rejection_rate=0.5)
    bon_manifest = build(tiny_models, tmp_path, "best_of_n", "scored")
    assert sbon_manifest["candidates_quarantined"] == 0
    assert sbon_manifest["pairs"] == bon_manifest["pairs"] == len(GOOD_PROMPTS)
    assert sbon_manifest["generated_tokens"] == bon_manifest["generated_tokens"]
    assert sbon_manifest["bon_equivalent_tokens"] == bon_manifest["generated_tokens"]
    assert sbon_manifest["tokens_saved"] == 0


# -- issue 49, item 3: self-speculative rejection (partial_reward: generator) ----------------------


@pytest.fixture(scope="module")
def rt_dir(tiny_models, tmp_path_factory):
    """The tiny generator as a Reward Transformer with an untrained channel whose head is drawn at
    random (seeded), so that its rewards spread and rank the rows."""
    import torch
    from transformers import AutoTokenizer

    from pipeline.engines.reward_transformer import RewardTransformer

    rt = RewardTransformer.from_pretrained(str(tiny_models["generator"]), hidden_size=16)
    torch.manual_seed(0)
    with torch.no_grad():
        rt.channel.head.weight.normal_()
    path = tmp_path_factory.mktemp("rt") / "generator"
    rt.save_pretrained(str(path), AutoTokenizer.from_pretrained(str(tiny_models["generator"])))
    return path


class CountingScorer:
    """A reward model seen through ``score`` only, counting the rows it reads; its streaming session
    methods fail the test if called (partials from the generator need none)."""

    def __init__(self, inner):
        self.inner, self.rows, self.finished = inner, 0, []

    def score(self, prompts, responses, finished=None, columns=None):
        self.rows += len(responses)
        self.finished += list(finished if finished is not None else [True] * len(responses))
        return self.inner.score(prompts, responses, finished=finished, columns=columns)

    def open(self, *args, **kwargs):
        raise AssertionError("a streaming reward session was opened")

    extend = close = open


class RecordingGenerator:
    """An engine whose extends' rows and keeps are kept, in call order."""

    def __init__(self, engine):
        self.engine, self.extends = engine, []

    def open(self, session, prompts, num_samples, seeds, sampling, rewards=False):
        self.engine.open(session, prompts, num_samples, seeds, sampling, rewards=rewards)

    def extend(self, session, until, keep=None):
        rows = self.engine.extend(session, until, keep)
        self.extends.append((until, keep, rows))
        return rows

    def close(self, session):
        return self.engine.close(session)


def channel_reward(rt, prompt: list[int], row) -> float:
    """R' computed apart from the engine: the Reward Transformer over the prompt and the part of the
    response the engine has read (all of it after EOS; all but the newest token otherwise)."""
    import torch

    read = row.token_ids if row.finished and len(row.token_ids) < T else row.token_ids[:-1]
    ids = torch.tensor([prompt + read])
    with torch.no_grad():
        return float(rt.token_rewards(ids, torch.ones_like(ids))[0, -1])


def test_generator_partials_rank_by_the_reward_channel_and_score_only_finished_rows(rt_dir, scorer):
    """sbon with partial_reward: generator on a tiny Reward Transformer: the rows that go on past tau
    are those the channel's rewards, computed apart, keep (Eq. 3-4 with keep_lowest); the reward model
    reads only finished rows (those that ended by tau, then the final ones), never a streaming session;
    every prompt ends with a chosen and a rejected complete response."""
    from pipeline.decoding.domain import PromptInput
    from pipeline.engines.hf import HFEngine
    from pipeline.engines.reward_transformer import RewardTransformer

    engine = HFEngine.from_pretrained(str(rt_dir))
    rt = RewardTransformer.from_pretrained(str(rt_dir)).eval()
    texts = GOOD_PROMPTS[:3]
    inputs = [PromptInput(f"p{i}", t, t, engine.tokenizer(t).input_ids) for i, t in enumerate(texts)]
    generator, counting = RecordingGenerator(engine), CountingScorer(scorer)
    params = SpeculativeRejectionParams(decision_token=4, rejection_rate=0.5, partial_reward="generator")
    n = 4
    results = speculative_rejection(inputs, generator, counting, params, SAMPLING, n, seed=0)

    (tau, _, at_tau), (_, keep, final) = generator.extends
    assert tau == 4 and all(r.reward is not None for r in at_tau)
    ranks = {}
    for r in at_tau:
        ranks[r.row] = channel_reward(rt, inputs[r.row // n].token_ids, r)
        assert r.reward == pytest.approx(ranks[r.row], abs=1e-4)
    expected = []
    for i in range(len(inputs)):
        members = [r for r in at_tau if r.row // n == i]
        r_cut = rejection_cutoff([ranks[r.row] for r in members], 0.5)
        live = [r.row for r in members if not r.finished]
        lowest = min(live, key=lambda m: ranks[m]) if live else None
        expected += [m for m in live if ranks[m] >= r_cut or m == lowest]
    assert sorted(keep) == sorted(expected)
    assert 0 < len(keep) < sum(not r.finished for r in at_tau)  # something was stopped
    assert counting.rows == sum(r.finished for r in at_tau) + len(final)
    assert all(counting.finished)
    for result in results:
        assert len(result.candidates) == n
        assert sum(c.completed and not c.failed for c in result.candidates) >= 2
        for c in result.candidates:
            assert c.stopped_early == (c.stopped_at == tau)
            if c.stopped_early:  # its score is the channel's partial reward; no reward model read it
                assert c.components == [] and c.score == pytest.approx(c.partials[tau])


def test_rewards_are_read_by_every_decoding_path_only_when_asked(rt_dir, engine):
    """The prefill, the paged step and the RowBatch step each record R' at the last token read;
    a session that did not ask reports None, and a model without a channel refuses to be asked."""
    import torch

    from pipeline.engines.hf import HFEngine
    from pipeline.engines.reward_transformer import RewardTransformer

    hf = HFEngine.from_pretrained(str(rt_dir))
    rt = RewardTransformer.from_pretrained(str(rt_dir)).eval()
    prompt = hf.tokenizer(GOOD_PROMPTS[0]).input_ids
    sampling = SamplingParams(max_new_tokens=T)
    hf.open("asked", [prompt], 3, [1, 2, 3], sampling, rewards=True)
    hf.open("not", [prompt], 3, [1, 2, 3], sampling)
    for until in (1, 5, T):  # 1: the prefill's rewards; then paged steps
        rows = hf.extend("asked", until)
        assert [r.reward for r in hf.extend("not", until)] == [None] * 3
        for r in rows:
            assert r.reward == pytest.approx(channel_reward(rt, prompt, r), abs=1e-4)
    hf.close("asked"), hf.close("not")

    runner = hf.runner  # the RowBatch path (model-side searches' sessions)
    with torch.inference_mode():
        state = runner.prefill([prompt], 3, [4, 5, 6], sampling, rewards=True)
        runner.unpool(state)
        state.until = 6
        while not state.extended():
            width = len(state.batch.next_position)
            finished = set(runner.step(state.batch, [state], list(range(width)))[0])
            state.batch.select([i for i in range(width) if i not in finished])
    for r in runner.report(state, list(state.tokens)):
        assert r.reward == pytest.approx(channel_reward(rt, prompt, r), abs=1e-4)
    runner.release(state)

    with pytest.raises(ValueError, match="no reward channel"):
        engine.open("refused", [prompt], 1, [0], sampling, rewards=True)


def test_partial_reward_generator_is_checked_at_plan_time(tiny_models, rt_dir, tmp_path, caplog):
    """A bad value, a backend that reads no channel and a generator without one are refused, one
    line naming strategy.partial_reward; an untrained channel is warned about."""
    from pipeline.config import ConfigError, config_from_dict
    from pipeline.preflight import check_models

    def config(generator, **extra):
        return config_from_dict({
            "models": {"generator": str(generator), "reward": "tests.reward_functions:scored",
                       **extra.pop("models", {})},
            "strategy": {"name": "sbon", "decision_token": 4, **extra},
            "data": {"prompts": str(tmp_path / "p.jsonl"), "output": str(tmp_path / "out")},
        })

    with pytest.raises(ConfigError, match=r"^strategy\.partial_reward: expected one of") as bad:
        config(rt_dir, partial_reward="reward")
    assert "\n" not in str(bad.value)
    with pytest.raises(ConfigError, match=r"^strategy\.partial_reward: generator .* backend vllm"):
        config(rt_dir, partial_reward="generator", models={"backend": "vllm"})
    with pytest.raises(ConfigError, match=r"^strategy\.partial_reward: generator .* no Reward Transformer"):
        check_models(config(tiny_models["generator"], partial_reward="generator"))
    check_models(config(tiny_models["generator"]))  # the default reads models.reward: nothing to check
    with caplog.at_level("WARNING"):
        check_models(config(rt_dir, partial_reward="generator"))
    assert "untrained" in caplog.text
