"""Composite rewards (issue 37, item 1): ``models.reward`` as a list of reward models and functions,
summed with ``models.reward_weights`` (pipeline.engines.rewards.CompositeScorer).

Over the fake generator of tests/test_decoding.py and the reward functions of
tests/reward_functions.py: the sum, the weights, a component with no partial score, a tie in one
component broken by the other. On the tiny models: a function beside a reward model (stateless and
streaming), the output's chosen_scores / rejected_scores and the dataset card, in-process and on Ray."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import config_from_dict
from pipeline.decoding.domain import RowState, components_of, ranks_of
from pipeline.decoding.speculative_rejection import (SpeculativeRejectionParams, _accepted, _record_rewards,
                                                     rejection_cutoff)
from pipeline.engines.rewards import CompositeScorer, FunctionScorer, RewardScorer, combine, load_rewards
from pipeline.errors import ConfigError
from tests import reward_functions
from tests.conftest import GOOD_PROMPTS, write_jsonl
from tests.test_decoding import FakeGenerator
from tests.test_partial_rewards import function, sbon


def composite(*names: str, weights=None) -> CompositeScorer:
    weights = weights or [1.0] * len(names)
    return CompositeScorer([function(n) for n in names], weights, [f"tests.reward_functions:{n}" for n in names])


# -- the sum -----------------------------------------------------------------------------------------


finite = st.floats(-1e3, 1e3, allow_nan=False)
score = st.one_of(finite, st.just(math.nan))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_combine_sums_what_speaks_and_fails_a_final_with_any_component_missing(data):
    """Per response: finished -> sum_k w_k r_k when every r_k is finite, else NaN. Partial -> the sum
    over the components finite for every partial response of its group (prompt), NaN when none is.
    The rank: a finished response's in a group with partial responses sums the same components as
    theirs (NaN when none, or one it has no score for); every other response's is its score. A
    group's sums and ranks do not depend on the other groups in the call."""
    n = data.draw(st.integers(1, 8))
    k = data.draw(st.integers(1, 3))
    parts = [data.draw(st.lists(score, min_size=n, max_size=n)) for _ in range(k)]
    weights = data.draw(st.lists(finite, min_size=k, max_size=k))
    finished = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    groups = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    got = combine(parts, weights, finished, groups)
    same = lambda a, b: (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b)  # noqa: E731
    for i in range(n):
        members = [j for j in range(n) if groups[j] == groups[i] and not finished[j]]
        speaking = [c for c in range(k) if all(math.isfinite(parts[c][j]) for j in members)]
        by_speaking = (sum(weights[c] * parts[c][i] for c in speaking)
                       if speaking and all(math.isfinite(parts[c][i]) for c in speaking) else math.nan)
        if finished[i]:
            ok = all(math.isfinite(p[i]) for p in parts)
            want = sum(w * p[i] for w, p in zip(weights, parts)) if ok else math.nan
            rank = by_speaking if members else want
        else:
            want = rank = by_speaking
        assert same(got[i], want) and same(got.ranks[i], rank)
        # The same response alone with its group gives the same sum.
        mine = [j for j in range(n) if groups[j] == groups[i]]
        alone = combine([[p[j] for j in mine] for p in parts], weights, [finished[j] for j in mine],
                        [groups[j] for j in mine])
        assert alone[mine.index(i)] == got[i] or (math.isnan(alone[mine.index(i)]) and math.isnan(got[i]))
        assert same(alone.ranks[mine.index(i)], got.ranks[i])


def test_two_functions_sum_with_their_weights_stateless_and_in_sessions():
    scorer = composite("scored", "scored_again", weights=[2.0, -0.5])
    texts = ["a b c", "d e", "f"]
    want = [2 * reward_functions.real_score(t) - 0.5 * reward_functions._second_score(t) for t in texts]
    assert scorer.score(["p"] * 3, texts) == pytest.approx(want)
    assert scorer.components(["p"] * 3, texts) == [[reward_functions.real_score(t), reward_functions._second_score(t)]
                                                   for t in texts]
    scorer.open("s", ["p", "q"], 2)
    assert scorer.extend("s", [0, 1, 3], texts, finished=[False] * 3) == pytest.approx(want)
    assert scorer.close("s") == {"tokens_read": 0} and not scorer.sessions
    stats = scorer.stats()
    assert [c["reward"] for c in stats["components"]] == ["tests.reward_functions:scored",
                                                         "tests.reward_functions:scored_again"]
    assert [c["weight"] for c in stats["components"]] == [2.0, -0.5]


def test_the_sum_comes_with_each_rewards_score_nan_where_it_was_left_out_and_survives_pickling():
    """combine's Scores: a partial response's component left out of its group's sum is NaN beside it,
    a final's components are as given; pickled (as Ray sends it), the components and ranks come along."""
    got = combine([[1.0, math.nan, 2.0, 7.0], [3.0, 4.0, 5.0, 6.0]], [1.0, 0.5], [False, False, True, True],
                  [0, 0, 1, 0])
    assert list(got) == [1.5, 2.0, 4.5, 10.0]
    assert got.ranks == [1.5, 2.0, 4.5, 3.0]  # the last ended beside group 0's partials: ranked on their reward
    back = pickle.loads(pickle.dumps(got))
    assert list(back) == list(got) and back.ranks == got.ranks
    for components in (got.components, back.components):
        assert [[None if math.isnan(v) else v for v in c] for c in components] == \
            [[None, 3.0], [None, 4.0], [2.0, 5.0], [7.0, 6.0]]
    assert components_of([0.25, 1.0]) == [[0.25], [1.0]]  # one reward: its score is its one component
    assert ranks_of([0.25, 1.0]) == [0.25, 1.0]  # and its rank


def test_a_finished_response_is_ranked_on_what_its_groups_partial_responses_are_scored_on():
    """Like with like (issue 49, item 4): a checker silent on prefixes (None) scores a finished
    response 1; beside its prompt's partial responses that response ranks on the other reward alone,
    while its score keeps both. A group with no partial response ranks by score; one whose partial
    responses have no reward in common gives its finished responses no rank (NaN)."""
    checker = [math.nan, math.nan, 1.0, 1.0, math.nan, 1.0]
    model = [0.2, 0.6, 0.3, 0.9, math.nan, 0.5]
    groups, finished = [0, 0, 0, 1, 2, 2], [False, False, True, True, False, True]
    got = combine([checker, model], [1.0, 2.0], finished, groups)
    assert got[:4] == pytest.approx([0.4, 1.2, 1.6, 2.8]) and got[5] == pytest.approx(2.0) and math.isnan(got[4])
    assert got.ranks[:4] == pytest.approx([0.4, 1.2, 0.6, 2.8])  # row 2 as its group's partials; row 3 alone
    assert math.isnan(got.ranks[4]) and math.isnan(got.ranks[5])  # group 2: no reward speaks for its partial
    assert got.components[2] == [1.0, 0.3]  # the output's lists are the full ones
    assert pickle.loads(pickle.dumps(got)).ranks[:4] == pytest.approx([0.4, 1.2, 0.6, 2.8])


def test_load_rewards_gives_one_reward_its_own_scorer_and_several_a_composite():
    assert isinstance(load_rewards(["tests.reward_functions:scored"], None, None), FunctionScorer)
    weighted = load_rewards(["tests.reward_functions:scored"], [3.0], None)
    assert isinstance(weighted, CompositeScorer)
    assert weighted.score(["p"], ["x"]) == pytest.approx([3 * reward_functions.real_score("x")])
    loaded = []

    def load_model(spec):
        loaded.append(spec)
        return function("scored_again")

    both = load_rewards(["tests.reward_functions:scored", "some/model"], [1.0, 1.0], load_model)
    assert isinstance(both, CompositeScorer) and both.names == ["tests.reward_functions:scored", "some/model"]
    assert loaded == ["some/model"]  # functions load themselves; models through the backend's loader


# -- the decisions ------------------------------------------------------------------------------------


@pytest.mark.parametrize("streaming", [True, False])
def test_a_component_with_no_partial_score_leaves_the_decision_to_the_other(streaming):
    """none_partial says nothing at the decision token; the composite then ranks the partials by
    ``scored`` alone, so the same rows stop as under ``scored`` alone; the finals add both (here
    twice ``scored``'s, as none_partial scores a final response as ``scored`` does)."""
    alone = sbon(function("scored"), streaming_rewards=streaming)
    both = sbon(composite("none_partial", "scored"), streaming_rewards=streaming)
    stopped = 0
    for got, want in zip(both, alone):
        assert [c.stopped_early for c in got.candidates] == [c.stopped_early for c in want.candidates]
        for g, w in zip(got.candidates, want.candidates):
            assert g.score == pytest.approx(w.score if g.stopped_early else 2 * w.score)
            stopped += g.stopped_early
    assert stopped  # rows were stopped: the decision was taken, on the other component


@pytest.mark.parametrize("streaming", [True, False])
def test_rows_that_ended_before_tau_are_ranked_on_the_rewards_the_live_rows_are(streaming):
    """Issue 49, item 4: a checker silent on prefixes (None) that scores finished responses above
    any prefix (none_partial_high_final), beside ``scored``; rows end before tau (EOS). At the
    decision token the rows that ended early rank on ``scored`` alone, as the live rows do, so the
    same rows stop as under ``scored`` alone (same seeds, same streams), and the finished rows'
    scores are still the full sums. HEAD ranked the ended rows on their full sums (above 1) beside
    the live rows' ``scored`` (below 1): they took the top of the quantile, and better live rows
    were stopped than ``scored`` would stop (here in most prompts)."""
    n, width, tau, alpha = 8, 8, 6, 0.5
    def run(scorer):
        return sbon(scorer, n_prompts=n, num_samples=width, generator=FakeGenerator(eos_rate=0.1), decision_token=tau,
                    rejection_rate=alpha, streaming_rewards=streaming)

    alone = run(function("scored"))
    both = run(composite("none_partial_high_final", "scored"))
    ended = mixed = 0
    for got, want in zip(both, alone):
        assert [c.stopped_early for c in got.candidates] == [c.stopped_early for c in want.candidates]
        assert [c.token_ids for c in got.candidates] == [c.token_ids for c in want.candidates]
        for c in got.candidates:
            real = reward_functions.real_score(c.text)
            if c.stopped_early:  # its partial reward at tau: ``scored``'s, the checker left out
                assert c.score == pytest.approx(real) and math.isnan(c.components[0])
            else:
                assert c.completed and c.score == pytest.approx(1 + 2 * real) and c.components == [1 + real, real]
        # What the mixed ranking (full sums of the rows that ended, partial sums of the live ones) would
        # have kept: it differs from what ran in some prompts, so this case is not vacuous.
        early = {c.sample for c in got.candidates if tau not in c.partials}
        rank = {c.sample: c.score if c.sample in early else c.partials[tau] for c in got.candidates}
        r_cut = rejection_cutoff(list(rank.values()), alpha)
        live = set(rank) - early
        floor = min(live, key=lambda s: (rank[s], s)) if live else None
        went_on = {c.sample for c in got.candidates if c.completed} - early
        mixed += went_on != {s for s in live if rank[s] >= r_cut or s == floor}
        ended += len(early)
    assert ended and mixed


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_decision_keeps_the_rows_the_speaking_rewards_alone_keep(data):
    """Over random values, with one reward silent on every partial response (any value, any size, on
    a finished one): the live rows a composite keeps at a decision token are those the other rewards
    alone, at the same weights, keep (Eq. 3 and 4, keep_lowest's floor, memory-budget mode)."""
    n = data.draw(st.integers(1, 10))
    finished = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    silent = [data.draw(score) if f else math.nan for f in finished]
    k = data.draw(st.integers(1, 2))
    speaking = [data.draw(st.lists(score, min_size=n, max_size=n)) for _ in range(k)]
    weights = data.draw(st.lists(finite, min_size=k + 1, max_size=k + 1))
    params = SpeculativeRejectionParams(decision_token=6, rejection_rate=data.draw(st.floats(0, 0.99)),
                                        keep_lowest=data.draw(st.booleans()),
                                        max_live_candidates=data.draw(st.one_of(st.none(), st.integers(1, n))))
    rows = [RowState(i, [1] * (3 if f else 6), "", f) for i, f in enumerate(finished)]

    def kept(scores) -> set[int]:
        candidates = {}
        by_prompt, rank = _record_rewards(candidates, rows, scores, n, 6)
        return _accepted(candidates, by_prompt[0], rank, 0, params, {}) - {i for i in range(n) if finished[i]}

    assert kept(combine([silent, *speaking], weights, finished, [0] * n)) == kept(
        combine(speaking, weights[1:], finished, [0] * n))


def test_a_component_missing_for_some_rows_is_left_out_for_their_whole_prompt():
    """none_partial_sometimes has no partial score for one text in three: at that decision token the
    prompt's partial rows are ranked on ``scored_again`` alone, never on a mix."""
    results = sbon(composite("none_partial_sometimes", "scored_again"), n_prompts=6, num_samples=6)
    mixed = 0
    for result in results:
        partials = [c for c in result.candidates if 6 in c.partials]
        texts = [" ".join(c.text.split()[:6]) for c in partials]
        missing = any(reward_functions.absent_for(t) for t in texts)
        mixed += missing
        for c, t in zip(partials, texts):
            want = reward_functions._second_score(t) + (0 if missing else reward_functions.real_score(t))
            assert c.partials[6] == pytest.approx(want)
    assert 0 < mixed < len(results)  # both cases occur


def test_a_tie_in_one_reward_is_broken_by_the_other():
    """A constant reward alone ties every candidate (no pair, no ranking); beside ``scored`` the
    composite stops and pairs as ``scored`` does."""
    tied = sbon(function("constant_always"))
    assert all(len({c.score for c in r.candidates}) == 1 for r in tied)
    alone = sbon(function("scored"))
    both = sbon(composite("constant_always", "scored", weights=[10.0, 0.01]))
    for got, want in zip(both, alone):
        assert [c.stopped_early for c in got.candidates] == [c.stopped_early for c in want.candidates]
        best = max(range(len(want.candidates)), key=lambda i: want.candidates[i].score)
        assert max(range(len(got.candidates)), key=lambda i: got.candidates[i].score) == best


def test_weights_decide_which_reward_leads():
    """Weighted towards one component, the composite's choice is that component's choice."""
    for lead, weights in (("scored", [1.0, 1e-6]), ("scored_again", [1e-6, 1.0])):
        want = sbon(function(lead), rejection_rate=0.0)
        got = sbon(composite("scored", "scored_again", weights=weights), rejection_rate=0.0)
        for g, w in zip(got, want):
            assert max(g.candidates, key=lambda c: c.score).sample == max(w.candidates, key=lambda c: c.score).sample


# -- a function and a reward model ----------------------------------------------------------------------


def test_a_function_beside_a_reward_model_streams_as_it_scores(tiny_models):
    model = RewardScorer.from_pretrained(str(tiny_models["reward"]))
    scorer = CompositeScorer([model, function("scored")], [1.0, 0.5], ["reward", "scored"])
    assert scorer.streaming
    prompts, texts = ["Say hi.", "Count."], ["Hello there", "one two three four"]
    alone = model.score(prompts, texts)
    want = [a + 0.5 * reward_functions.real_score(t) for a, t in zip(alone, texts)]
    assert scorer.score(prompts, texts) == pytest.approx(want, abs=1e-5)
    scorer.open("s", prompts, 1)
    first = scorer.extend("s", [0, 1], ["Hello", "one two"], finished=[False, False])
    assert first == pytest.approx([a + 0.5 * reward_functions.real_score(t) for a, t in
                                   zip(model.score(prompts, ["Hello", "one two"]), ["Hello", "one two"])], abs=1e-4)
    assert scorer.extend("s", [0, 1], texts, finished=[True, True]) == pytest.approx(want, abs=1e-4)
    assert scorer.stats()["tokens_read"] > 0 and scorer.stats()["open_sessions"] == 1
    scorer.close("s")
    assert not model.sessions


# -- builds ------------------------------------------------------------------------------------------------


def composite_config(tiny_models, tmp_path, strategy="sbon", **runtime) -> dict:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:8]])
    return {
        "models": {"generator": str(tiny_models["generator"]),
                   "reward": [str(tiny_models["reward"]), "tests.reward_functions:scored"],
                   "reward_weights": [1.0, 0.5]},
        "strategy": {"name": strategy, **({"decision_token": 6, "rejection_rate": 0.5} if strategy == "sbon" else {})},
        "sampling": {"num_samples": 4, "max_new_tokens": 16},
        "data": {"prompts": str(prompts), "output": str(tmp_path / "out"), "shard_size": 4},
        "runtime": {"local": True, "prompts_per_batch": 2, **runtime},
        "seed": 0,
    }


def run(raw: dict) -> dict:
    from actors import start_workers
    from pipeline.build import plan_build, run_build

    config = config_from_dict(raw)
    workers = start_workers(config)
    try:
        run_build(plan_build(config), workers, progress=False)
    finally:
        workers.shutdown()
    return json.loads((Path(raw["data"]["output"]) / "_manifest.json").read_text())


def pairs(out) -> list[dict]:
    return [r for f in sorted(out.glob("train-*.parquet")) for r in pq.read_table(f).to_pylist()]


def check_output(out, tiny_models) -> list[dict]:
    """Every pair keeps both rewards' scores; chosen_score is their weighted sum; the reward model's
    score is the one it gives alone; the function's is the function's."""
    rows = pairs(out)
    assert rows
    model = RewardScorer.from_pretrained(str(tiny_models["reward"]))
    for row in rows:
        assert len(row["chosen_scores"]) == len(row["rejected_scores"]) == 2
        for side in ("chosen", "rejected"):
            model_score, function_score = row[f"{side}_scores"]
            assert row[f"{side}_score"] == pytest.approx(model_score + 0.5 * function_score, abs=1e-4)
            assert function_score == reward_functions.real_score(row[side])
            assert model_score == pytest.approx(model.score([row["raw_prompt"]], [row[side]])[0], abs=1e-4)
    return rows


@pytest.mark.parametrize("strategy", ["sbon", "best_of_n", "aded", "ults", "dsbd"])
def test_a_composite_build_keeps_each_rewards_scores_and_lists_them_on_the_card(tiny_models, tmp_path, strategy):
    """Every strategy that takes a reward takes the composite (the model-side ones score their
    candidates through the same Scorer); dsbd drafts with ADED here (no models.draft)."""
    raw = composite_config(tiny_models, tmp_path, strategy)
    manifest = run(raw)
    out = tmp_path / "out"
    rows = check_output(out, tiny_models)
    assert manifest["pairs"] == len(rows)
    card = (out / "README.md").read_text()
    assert (f"the weighted sum of 1 x `{tiny_models['reward']}` + 0.5 x `tests.reward_functions:scored`" in card)
    assert "| `chosen_scores` | list<element: double> |" in card
    assert "| reward[1] | `tests.reward_functions:scored` |" in card and "weight 0.5 |" in card
    provenance = manifest["provenance"]["models"]
    assert provenance["reward[0]"]["weight"] == 1.0 and provenance["reward[1]"]["kind"] == "reward function"


def test_a_single_reward_build_keeps_its_score_as_a_one_item_list(tiny_models, tmp_path):
    raw = composite_config(tiny_models, tmp_path, "best_of_n")
    raw["models"]["reward"], raw["models"]["reward_weights"] = str(tiny_models["reward"]), None
    run(raw)
    rows = pairs(tmp_path / "out")
    assert rows and all(r["chosen_scores"] == [r["chosen_score"]] and r["rejected_scores"] == [r["rejected_score"]]
                        for r in rows)


def test_changing_the_weights_refuses_a_resume(tiny_models, tmp_path):
    from pipeline.build import plan_build

    raw = composite_config(tiny_models, tmp_path, "best_of_n")
    run(raw)
    raw["models"]["reward_weights"] = [1.0, 2.0]
    with pytest.raises(Exception, match="built differently|config"):
        plan_build(config_from_dict(raw))


@pytest.mark.parametrize("models, message", [
    ({"reward": []}, "models.reward: an empty list"),
    ({"reward": ["a", "b"], "reward_weights": [1.0]}, "models.reward_weights: 1 weights for 2 reward"),
    ({"reward": ["a", "a"]}, "listed twice"),
    ({"reward": ["a", "b"], "reward_weights": [0, 0]}, "every weight is 0"),
    ({"reward": ["a", "b"], "reward_weights": [1, "x"]}, r"models.reward_weights\[1\]: expected a number"),
])
def test_bad_reward_lists_are_refused_naming_the_key(models, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"models": models})


def test_a_bad_entry_of_the_list_is_named_at_plan_time(tiny_models, tmp_path):
    from pipeline.build import plan_build

    raw = composite_config(tiny_models, tmp_path)
    raw["models"]["reward"] = [str(tiny_models["reward"]), "tests.reward_functions:no_such_function"]
    with pytest.raises(ConfigError, match=r"models.reward\[1\]: 'tests.reward_functions:no_such_function'"):
        plan_build(config_from_dict(raw))
    raw["models"]["reward"] = [str(tmp_path / "missing"), "tests.reward_functions:scored"]
    with pytest.raises(ConfigError, match=r"models.reward\[0\]: .* no such model directory"):
        plan_build(config_from_dict(raw))


@pytest.mark.integration
def test_a_composite_build_on_ray_writes_what_the_in_process_build_writes(cluster, tiny_models, tmp_path):
    (tmp_path / "local").mkdir()
    (tmp_path / "ray").mkdir()
    run(composite_config(tiny_models, tmp_path / "local"))
    remote = composite_config(tiny_models, tmp_path / "ray", local=False)
    remote["runtime"].update(generator={"num_cpus": 1}, reward={"num_cpus": 1})
    manifest = run(remote)
    rows = check_output(tmp_path / "ray" / "out", tiny_models)
    want = pairs(tmp_path / "local" / "out")
    key = lambda r: r["prompt_id"]  # noqa: E731
    assert [(r["chosen"], r["rejected"]) for r in sorted(rows, key=key)] == \
        [(r["chosen"], r["rejected"]) for r in sorted(want, key=key)]
    for got, exp in zip(sorted(rows, key=key), sorted(want, key=key)):
        assert got["chosen_scores"] == pytest.approx(exp["chosen_scores"], abs=1e-5)
    assert manifest["pairs"] == len(rows)


def test_each_pair_score_is_the_weighted_sum_of_its_finite_components(tiny_models, tmp_path):
    """Issue 50, item 3: a candidate's components come from the call that gave its score, not from a
    second, stateless call after selection that would score the rejected response alone in its group.
    A rejected response stopped at a decision token where none_partial_sometimes said nothing for one
    of its prompt's rows has that reward left out of its score: NaN in rejected_scores."""
    raw = composite_config(tiny_models, tmp_path)
    raw["models"]["reward"][1] = "tests.reward_functions:none_partial_sometimes"
    raw["sampling"]["num_samples"] = 8
    raw["data"]["rejected"] = "any"
    run(raw)
    rows = pairs(tmp_path / "out")
    assert rows and any(r["rejected_is_partial"] for r in rows)
    for row in rows:
        for side in ("chosen", "rejected"):
            scores = row[f"{side}_scores"]
            assert len(scores) == 2 and math.isfinite(scores[0])
            want = sum(w * s for w, s in zip([1.0, 0.5], scores) if math.isfinite(s))
            assert row[f"{side}_score"] == pytest.approx(want, abs=1e-5), (side, row["prompt_id"])
