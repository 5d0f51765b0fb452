"""Best-of-N and speculative rejection (Algorithm 1) against fakes and against tiny real models."""

import math
import random

import pytest
import torch

from pipeline.config import ConfigError, config_from_dict
from pipeline.decoding.best_of_n import BestOfNParams, best_of_n
from pipeline.decoding.domain import PromptInput, RowState
from pipeline.decoding.sampling import SamplingParams, row_seed
from pipeline.decoding.speculative_rejection import (SpeculativeRejectionParams, adaptive_cutoff, rejection_cutoff,
                                                     speculative_rejection)

EOS = 0


class FakeGenerator:
    """Each row's token stream comes from its seed alone; token 0 is EOS. Records every call."""

    def __init__(self, eos_rate=0.0):
        self.sessions, self.calls, self.eos_rate = {}, [], eos_rate

    def open(self, session, prompts, num_samples, seeds, sampling):
        self.sessions[session] = {"rng": {i: random.Random(s) for i, s in enumerate(seeds)},
                                  "tokens": {i: [] for i in range(len(seeds))}, "done": set(),
                                  "live": set(range(len(seeds))), "cap": sampling.max_new_tokens}
        self.calls.append(("open", len(seeds)))

    def extend(self, session, until, keep=None):
        s = self.sessions[session]
        if keep is not None:
            s["live"] &= set(keep)
        self.calls.append(("extend", until, sorted(s["live"])))
        for row in sorted(s["live"] - s["done"]):
            while len(s["tokens"][row]) < min(until, s["cap"]) and row not in s["done"]:
                rng = s["rng"][row]
                tok = EOS if rng.random() < self.eos_rate else rng.randint(1, 99)
                if tok == EOS:
                    s["done"].add(row)
                else:
                    s["tokens"][row].append(tok)
            if len(s["tokens"][row]) >= s["cap"]:
                s["done"].add(row)
        rows = sorted(keep) if keep is not None else sorted(s["live"])
        return [RowState(r, list(s["tokens"][r]), " ".join(map(str, s["tokens"][r])), r in s["done"]) for r in rows]

    def close(self, session):
        self.sessions.pop(session)
        return {}


class FakeScorer:
    """Reward = mean token value / 100, so partial and final rewards correlate."""

    def __init__(self, nan_for=()):
        self.nan_for = set(nan_for)

    def score(self, prompts, responses, finished=None, columns=None):
        out = []
        for r in responses:
            toks = [int(t) for t in r.split()]
            out.append(math.nan if r in self.nan_for else (sum(toks) / len(toks) / 100 if toks else 0.0))
        return out


def prompts(n=3):
    return [PromptInput(f"p{i}", f"prompt {i}", f"prompt {i}", [1, 2, 3]) for i in range(n)]


SAMPLING = SamplingParams(max_new_tokens=24)


def test_registry_resolves_aliases_and_names_the_choices():
    from pipeline.errors import ConfigError
    from pipeline.strategies import lookup

    assert lookup("speculative_rejection") is lookup("sbon") and lookup("sbon").run is speculative_rejection
    assert lookup("best_of_n").run is best_of_n and lookup("best_of_n").search is None
    with pytest.raises(ConfigError, match=r"unknown strategy 'beam'.*'best_of_n'.*'speculative_rejection'"):
        lookup("beam")


def test_cutoff_is_the_alpha_lower_quantile():
    scores = [0.1, 0.5, 0.3, 0.9, 0.7, 0.2, 0.8, 0.4]
    assert rejection_cutoff(scores, 0.0) == 0.1
    assert rejection_cutoff(scores, 0.5) == 0.5  # keep the top 4: 0.9, 0.8, 0.7, 0.5
    assert rejection_cutoff(scores, 0.75) == 0.8
    assert rejection_cutoff(scores, 0.99) == 0.9  # at least one survives
    assert rejection_cutoff([math.nan, 0.2, math.inf, 0.4], 0.5) == 0.4  # finite values only
    assert rejection_cutoff([math.nan], 0.5) == -math.inf


def test_alpha_zero_equals_best_of_n_with_fakes():
    bon = best_of_n(prompts(), FakeGenerator(0.02), FakeScorer(), BestOfNParams(), SAMPLING, 8, seed=5)
    sbon = speculative_rejection(prompts(), FakeGenerator(0.02), FakeScorer(),
                                 SpeculativeRejectionParams(decision_token=6, rejection_rate=0.0), SAMPLING, 8, seed=5)
    for a, b in zip(bon, sbon):
        assert [c.text for c in a.candidates] == [c.text for c in b.candidates]
        assert max(a.candidates, key=lambda c: c.score).sample == max(b.candidates, key=lambda c: c.score).sample
        assert a.generated_tokens == b.generated_tokens


def test_rejected_rows_stop_and_accepted_rows_finish():
    gen = FakeGenerator()
    results = speculative_rejection(prompts(2), gen, FakeScorer(), SpeculativeRejectionParams(8, 0.5, keep_lowest=False),
                                    SAMPLING, 8, seed=1)
    open_call, first, final = gen.calls
    assert first[1] == 8 and len(first[2]) == 16
    assert len(final[2]) == 8  # half of each prompt's 8 rows continue
    for result in results:
        stopped = [c for c in result.candidates if c.stopped_early]
        kept = [c for c in result.candidates if not c.stopped_early]
        assert len(stopped) == 4 and all(len(c.token_ids) == 8 and c.stopped_at == 8 for c in stopped)
        assert all(c.completed and len(c.token_ids) == 24 for c in kept)
        # Eq. 4: every stopped row's partial reward is below every kept row's partial reward.
        kept_partials = FakeScorer().score([""] * 4, [" ".join(map(str, c.token_ids[:8])) for c in kept])
        assert max(c.score for c in stopped) < min(kept_partials)
        assert result.generated_tokens == 4 * 8 + 4 * 24
        assert result.bon_equivalent_tokens == 8 * 24


def test_keep_lowest_finishes_each_prompts_lowest_ranked_row_for_the_rejected_side():
    from pipeline.data.pairs import select_pair

    gen = FakeGenerator()
    results = speculative_rejection(prompts(2), gen, FakeScorer(), SpeculativeRejectionParams(8, 0.75), SAMPLING, 8,
                                    seed=1)
    assert len(gen.calls[-1][2]) == 2 * (2 + 1)  # per prompt: the top quarter of 8, and the lowest row
    for result in results:
        kept = [c for c in result.candidates if not c.stopped_early]
        stopped = [c for c in result.candidates if c.stopped_early]
        assert len(kept) == 3 and all(c.completed and len(c.token_ids) == 24 for c in kept)
        partial = dict(zip([c.sample for c in kept], FakeScorer().score(
            [""] * 3, [" ".join(map(str, c.token_ids[:8])) for c in kept])))
        lowest = min(partial, key=partial.get)
        assert partial[lowest] < min(c.score for c in stopped)  # it ranked last at tau, yet finished
        pair, _ = select_pair(result, "sbon")
        assert not pair["rejected_is_partial"] and pair["rejected_score"] == min(c.score for c in kept)
        assert result.generated_tokens == 5 * 8 + 3 * 24


def test_rows_that_end_before_tau_are_kept_unchanged():
    gen = FakeGenerator(eos_rate=0.15)
    results = speculative_rejection(prompts(3), gen, FakeScorer(), SpeculativeRejectionParams(10, 0.9),
                                    SAMPLING, 8, seed=3)
    early = [c for r in results for c in r.candidates if c.completed and len(c.token_ids) < 10]
    assert early, "the fake should end some rows before tau"
    assert all(not c.stopped_early for c in early)
    final_keep = gen.calls[-1][2]
    assert all(c.sample + 8 * i not in final_keep for i, r in enumerate(results) for c in r.candidates
               if c in early)


def test_non_finite_partial_reward_keeps_the_candidate_live():
    """A NaN partial reward is no signal at that decision token (issue 36): the row goes on, unranked."""
    gen = FakeGenerator()
    # Row 2's partial response at tau=6, which the scorer gives no reward.
    probe = FakeGenerator()
    probe.open("x", [[1]], 1, [row_seed(0, "p0", 2)], SAMPLING)
    poisoned = probe.extend("x", 6)[0].text
    results = speculative_rejection(prompts(1), gen, FakeScorer(nan_for=[poisoned]),
                                    SpeculativeRejectionParams(6, 0.0), SAMPLING, 4, seed=0)
    c = results[0].candidates[2]
    assert not c.failed and c.completed and len(c.token_ids) == 24 and math.isnan(c.partials[6])
    assert all(not o.failed and o.completed for o in results[0].candidates)


def test_several_decision_tokens_reject_at_each():
    gen = FakeGenerator()
    results = speculative_rejection(prompts(1), gen, FakeScorer(),
                                    SpeculativeRejectionParams([12, 4], 0.5, keep_lowest=False), SAMPLING, 8,
                                    seed=2)
    assert [c[1] for c in gen.calls[1:]] == [4, 12, 24]
    assert [len(c[2]) for c in gen.calls[1:]] == [8, 4, 2]
    stops = sorted(c.stopped_at for c in results[0].candidates if c.stopped_early)
    assert stops == [4, 4, 4, 4, 12, 12]


@pytest.mark.parametrize("strategy", ["best_of_n", "sbon"])
def test_candidate_counts_on_real_models(engine, scorer, strategy):
    from pipeline.config import config_from_dict
    cfg = config_from_dict({"strategy": {"name": strategy}})
    ps = [PromptInput(f"id{i}", t, t, engine.tokenizer(t).input_ids) for i, t in
          enumerate(["Write a review of the lamp.", "Explain why the phone broke."])]
    from pipeline.strategies import lookup
    results = lookup(strategy).run(ps, engine, scorer, cfg.strategy.params, SamplingParams(max_new_tokens=40), 6, 0)
    assert [len(r.candidates) for r in results] == [6, 6]
    assert sorted(c.sample for c in results[0].candidates) == list(range(6))


def test_alpha_zero_equals_best_of_n_on_real_models(engine, scorer):
    ps = [PromptInput(f"id{i}", t, t, engine.tokenizer(t).input_ids) for i, t in
          enumerate(["Describe how the blender works.", "Tell me if this jacket fits."])]
    sampling = SamplingParams(max_new_tokens=20, top_p=0.9)
    bon = best_of_n(ps, engine, scorer, BestOfNParams(), sampling, 8, seed=7)
    sbon = speculative_rejection(ps, engine, scorer, SpeculativeRejectionParams(decision_token=[5, 10],
                                                                                rejection_rate=0.0),
                                 sampling, 8, seed=7)
    for a, b in zip(bon, sbon):
        best_a = max(a.candidates, key=lambda c: c.score)
        best_b = max(b.candidates, key=lambda c: c.score)
        assert (best_a.sample, best_a.text) == (best_b.sample, best_b.text)
        assert best_a.score == pytest.approx(best_b.score, abs=1e-5)


def _ancestral(host, prompts, num_samples, seeds, sampling, params):
    """A model-side method for the test: plain sampling, run inside the engine on its model runner
    (a search runs between the engine's steps, so it may not call the engine itself)."""
    from pipeline.decoding.domain import SearchOutput
    runner = host.engine.runner
    with torch.inference_mode():
        state = runner.prefill(prompts, num_samples, seeds, sampling)
        runner.unpool(state)  # a batch row per sample (a pooled engine's prefill keeps one per prompt)
        state.until = sampling.max_new_tokens
        while not state.extended():
            width = len(state.batch.next_position)
            finished = set(runner.step(state.batch, [state], list(range(width)))[0])
            state.batch.select([i for i in range(width) if i not in finished])
    rows = runner.report(state, list(state.tokens))
    per = [rows[i * num_samples:(i + 1) * num_samples] for i in range(len(prompts))]
    return [SearchOutput(rows=r, generated_tokens=sum(len(x.token_ids) for x in r) + 1, stats={"calls": 1})
            for r in per]


def register(monkeypatch, name, search):
    """A model-side method for the test: one record, as a new method file would add."""
    from pipeline.strategies import STRATEGIES, Strategy
    record = Strategy(name, BestOfNParams, "test method", search=search)
    monkeypatch.setitem(STRATEGIES, name, record)
    return record


def test_model_side_strategy_matches_best_of_n(engine, scorer, monkeypatch):
    record = register(monkeypatch, "ancestral", _ancestral)
    ps = [PromptInput(f"id{i}", t, t, engine.tokenizer(t).input_ids) for i, t in
          enumerate(["Describe the kettle.", "Is the chair comfortable?"])]
    sampling = SamplingParams(max_new_tokens=12)
    got = record.run(ps, engine, scorer, None, sampling, 3, 5)
    want = best_of_n(ps, engine, scorer, BestOfNParams(), sampling, 3, seed=5)
    for a, b in zip(got, want):
        assert [c.text for c in a.candidates] == [c.text for c in b.candidates]
        assert [c.score for c in a.candidates] == pytest.approx([c.score for c in b.candidates], abs=1e-5)
        assert a.generated_tokens == b.generated_tokens + 1 and a.stats == {"calls": 1}


def test_model_side_strategy_refuses_wrong_row_counts(engine, scorer, monkeypatch):
    def lossy(host, prompts, num_samples, seeds, sampling, params):
        out = _ancestral(host, prompts, num_samples, seeds, sampling, params)
        out[0].rows = out[0].rows[1:]
        return out

    record = register(monkeypatch, "lossy", lossy)
    ps = [PromptInput("a", "Hi", "Hi", engine.tokenizer("Hi").input_ids)]
    with pytest.raises(RuntimeError, match="expected 2 rows"):
        record.run(ps, engine, scorer, None, SamplingParams(max_new_tokens=4), 2, 0)
    with pytest.raises(TypeError, match="got 'nope'"):  # the engine runs a function, it looks up no name
        engine.search("nope", [[1, 2]], 1, [0], SamplingParams(max_new_tokens=2), None)


def test_memory_budget_mode_starts_wide_and_keeps_the_budget():
    gen = FakeGenerator()
    params = SpeculativeRejectionParams(decision_token=6, rejection_rate=0.5, initial_candidates=16, keep_lowest=False,
                                        max_live_candidates=3)
    results = speculative_rejection(prompts(2), gen, FakeScorer(), params, SAMPLING, 5, seed=4)
    assert gen.calls[0] == ("open", 32)
    assert len(gen.calls[1][2]) == 32 and len(gen.calls[2][2]) == 6  # 3 of 16 rows per prompt go on
    for i, result in enumerate(results):
        assert len(result.candidates) == 5
        done = [c for c in result.candidates if c.completed]
        stopped = [c for c in result.candidates if c.stopped_early]
        assert len(done) == 3 and all(len(c.token_ids) == 24 for c in done)
        assert len(stopped) == 2 and all(len(c.token_ids) == 6 for c in stopped)
        # The 3 rows that went on had the best partial rewards of all 16; the 2 stopped rows
        # returned are the next best, and the cost counts all 16 rows.
        probe = FakeGenerator()
        probe.open("x", [[1]], 16, [row_seed(4, f"p{i}", s) for s in range(16)], SAMPLING)
        partial = dict(zip(range(16), FakeScorer().score([""] * 16, [r.text for r in probe.extend("x", 6)])))
        ranked = sorted(partial, key=partial.get, reverse=True)
        assert sorted(c.sample for c in done) == sorted(ranked[:3])
        assert sorted(c.sample for c in stopped) == sorted(ranked[3:5])
        assert result.generated_tokens == 16 * 6 + 3 * (24 - 6)
        assert result.stats == {"initial_candidates": 16, "screened_out": 11}


def test_memory_budget_mode_with_keep_lowest_keeps_exactly_the_budget():
    """Issue 27: keep_lowest's floor row came on top of the budget (4 rows went on for a budget of 3)."""
    gen = FakeGenerator()
    params = SpeculativeRejectionParams(decision_token=6, initial_candidates=16, max_live_candidates=3)
    results = speculative_rejection(prompts(2), gen, FakeScorer(), params, SAMPLING, 5, seed=4)
    assert len(gen.calls[2][2]) == 6  # 3 of 16 rows per prompt go on, the budget exactly
    for i, result in enumerate(results):
        probe = FakeGenerator()
        probe.open("x", [[1]], 16, [row_seed(4, f"p{i}", s) for s in range(16)], SAMPLING)
        partial = dict(zip(range(16), FakeScorer().score([""] * 16, [r.text for r in probe.extend("x", 6)])))
        ranked = sorted(partial, key=lambda r: (-partial[r], r))
        done = sorted(c.sample for c in result.candidates if c.completed)
        assert done == sorted(ranked[:2] + ranked[-1:])  # the best two and the lowest-ranked row


def test_memory_budget_mode_needs_enough_initial_candidates():
    params = SpeculativeRejectionParams(decision_token=6, initial_candidates=4)
    with pytest.raises(ValueError, match="at least num_samples"):
        speculative_rejection(prompts(1), FakeGenerator(), FakeScorer(), params, SAMPLING, 8, seed=0)
    with pytest.raises(ConfigError, match="initial_candidates: 4 is less than sampling.num_samples 8"):
        config_from_dict({"strategy": {"name": "sbon", "initial_candidates": 4}, "sampling": {"num_samples": 8}})


def test_adaptive_cutoff_follows_the_fit_residuals():
    prev = [0.1, 0.2, 0.3, 0.4, 0.5]
    assert adaptive_cutoff(prev, [1.0, 2.0, 3.0, 4.0, 5.0], z=2.0) == pytest.approx(5.0)  # exact fit: keep the best
    noisy = [1.0, 2.5, 2.0, 4.5, 4.0]
    loose, tight = adaptive_cutoff(prev, noisy, z=2.0), adaptive_cutoff(prev, noisy, z=0.5)
    assert loose < tight < 4.5
    assert adaptive_cutoff([0.1, math.nan], [1.0, 2.0], z=1.0) is None  # too few rows to fit


def test_adaptive_rejection_prunes_per_prompt_from_the_second_decision_token():
    gen = FakeGenerator()
    params = SpeculativeRejectionParams(decision_token=[4, 10], rejection_rate=0.25, adaptive_rejection=1.0,
                                        keep_lowest=False)
    results = speculative_rejection(prompts(2), gen, FakeScorer(), params, SAMPLING, 8, seed=9)
    assert len(gen.calls[2][2]) == 12  # alpha 0.25 at the first decision token: 6 of 8 per prompt
    for i, result in enumerate(results):
        at_4 = {c.sample: c for c in result.candidates if c.stopped_at == 4}
        assert len(at_4) == 2
        # Recompute the rule from the fake's partial rewards at both decision tokens.
        probe = FakeGenerator()
        probe.open("x", [[1]], 8, [row_seed(9, f"p{i}", s) for s in range(8)], SAMPLING)
        r4 = FakeScorer().score([""] * 8, [r.text for r in probe.extend("x", 4)])
        r10 = FakeScorer().score([""] * 8, [r.text for r in probe.extend("x", 10)])
        rows = [s for s in range(8) if s not in at_4]
        cut = adaptive_cutoff([r4[s] for s in rows], [r10[s] for s in rows], 1.0)
        kept = {c.sample for c in result.candidates if c.completed}
        assert kept == {s for s in rows if r10[s] >= cut}
        assert all(c.stopped_at == 10 for c in result.candidates if c.sample in set(rows) - kept)


def test_streaming_rewards_match_rescoring_on_real_models(engine, scorer):
    ps = [PromptInput(f"id{i}", t, t, engine.tokenizer(t).input_ids) for i, t in
          enumerate(["Describe how the blender works.", "Tell me if this jacket fits."])]
    sampling = SamplingParams(max_new_tokens=24)
    runs, tokens = {}, {}
    for streaming in (True, False):
        params = SpeculativeRejectionParams(decision_token=[4, 8, 16], rejection_rate=0.4, streaming_rewards=streaming)
        before = scorer.tokens_read
        runs[streaming] = speculative_rejection(ps, engine, scorer, params, sampling, 6, seed=3)
        tokens[streaming] = scorer.tokens_read - before
    assert not scorer.sessions  # the reward session was closed
    for a, b in zip(runs[True], runs[False]):
        assert [(c.text, c.stopped_at) for c in a.candidates] == [(c.text, c.stopped_at) for c in b.candidates]
        assert [c.score for c in a.candidates] == pytest.approx([c.score for c in b.candidates], abs=1e-4)
    assert tokens[True] < tokens[False]
