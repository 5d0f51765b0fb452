"""Speculative-rejection tooling: the paper's metrics (Eq. 5/6, appendix D), the counterfactual
job, the bench-model grammar and build (toy sizes), and the benchmark's synthetic path."""

import gzip
import json
import math
import random

import pytest

from pipeline.decoding.metrics import PromptRewards, correlations, grid, normalized_score, simulate


def test_normalized_score_is_eq5():
    assert normalized_score([1.0, 3.0, 5.0], 5.0) == 100.0
    assert normalized_score([1.0, 3.0, 5.0], 3.0) == 50.0
    assert normalized_score([1.0, 3.0, 5.0], -9.0) == 0.0  # floored at Best-of-N's worst
    assert math.isnan(normalized_score([2.0, 2.0], 2.0))


def test_simulate_replays_algorithm_1_on_collected_rewards():
    p = PromptRewards(lengths=[10, 10, 3, 10], final=[1.0, 4.0, 0.5, 2.0],
                      partial={4: [0.9, 0.1, 0.5, 0.8]})
    # alpha 0.5 keeps the top 2 partials (0.9 and 0.8); row 2 ended before tau and is kept as is.
    score, rate = simulate(p, 4, 0.5, keep_lowest=False)
    assert score == pytest.approx(100 * (1 - (4.0 - 2.0) / (4.0 - 0.5)))
    assert rate == pytest.approx((10 + 4 + 3 + 10) / 33)
    assert simulate(p, 4, 0.0) == (100.0, 1.0)
    # keep_lowest also finishes the lowest live partial (row 1, 0.1), whose final reward is the best
    assert simulate(p, 4, 0.5) == (100.0, 1.0)
    cells = grid([p, p], [4], [0.0, 0.5], keep_lowest=False)
    assert [(c["tau"], c["alpha"]) for c in cells] == [(4, 0.0), (4, 0.5)]
    assert cells[1]["score"] == pytest.approx(score)


class FixedLengthGenerator:
    """Row r of prompt 0 writes LENGTHS[r] tokens, then EOS; like HFEngine, a row that has reached
    ``until`` tokens is not finished until it emits EOS on a later step."""

    LENGTHS = [4, 10, 10, 10]

    def open(self, session, prompts, num_samples, seeds, sampling):
        self.cap, self.tokens, self.live = sampling.max_new_tokens, {r: [] for r in range(4)}, set(range(4))

    def extend(self, session, until, keep=None):
        from pipeline.decoding.domain import RowState

        self.live = set(keep) if keep is not None else self.live
        states = []
        for r in sorted(self.live):
            self.tokens[r] += [r + 1] * (min(until, self.LENGTHS[r]) - len(self.tokens[r]))
            finished = len(self.tokens[r]) == self.LENGTHS[r] and until > self.LENGTHS[r]
            states.append(RowState(r, list(self.tokens[r]), f"row{r}:{len(self.tokens[r])}", finished))
        return states

    def close(self, session):
        return {}


def test_a_response_of_exactly_tau_tokens_is_live_at_tau_in_runs_and_in_simulate():
    """Row 0 ends exactly at tau = 4 (its EOS comes after tau) with the lowest partial reward, which
    is also its final one (the same text). The live algorithm sees it live at tau, so with
    keep_lowest it is the row kept to supply the rejected side, at no extra cost, and row 3 stops;
    the counterfactual must decide the same (counting row 0 as ended would finish row 3 instead)."""
    from pipeline.decoding.domain import PromptInput
    from pipeline.decoding.sampling import SamplingParams
    from pipeline.decoding.speculative_rejection import SpeculativeRejectionParams, speculative_rejection

    partial, final = [0.1, 0.9, 0.8, 0.2], [0.1, 1.0, 2.0, 0.0]
    rewards = {f"row{r}:4": partial[r] for r in range(4)} | {f"row{r}:10": final[r] for r in range(1, 4)}

    class Scorer:
        def score(self, prompts, responses, finished=None, columns=None):
            return [rewards[t] for t in responses]

    collected = PromptRewards(lengths=FixedLengthGenerator.LENGTHS, final=final, partial={4: partial})
    for keep_lowest, want_stopped in ((False, [0, 3]), (True, [3])):
        result = speculative_rejection([PromptInput("p", "p", "p", [1])], FixedLengthGenerator(), Scorer(),
                                       SpeculativeRejectionParams(decision_token=4, rejection_rate=0.5,
                                                                  streaming_rewards=False, keep_lowest=keep_lowest),
                                       SamplingParams(max_new_tokens=16), 4, seed=0)[0]
        assert sorted(c.sample for c in result.candidates if c.stopped_early) == want_stopped
        live_best = max(c.score for c in result.candidates if not c.stopped_early)
        score, rate = simulate(collected, 4, 0.5, keep_lowest)
        assert score == pytest.approx(normalized_score(final, live_best))
        assert rate == pytest.approx(sum(len(c.token_ids) for c in result.candidates) / 34) == pytest.approx(28 / 34)


@pytest.mark.parametrize("seed", range(40))
def test_decision_tokens_in_turn_replay_as_the_live_algorithm_decides(seed):
    """metrics.accepted_in_turn on collected completions stops the same rows at the same decision
    tokens as speculative_rejection with decision_token as a list (rows that end between two decision
    tokens, or exactly at one, included), and keeps the same ones; with one tau it is ``accepted``."""
    from pipeline.decoding.domain import PromptInput
    from pipeline.decoding.metrics import accepted, accepted_in_turn
    from pipeline.decoding.sampling import SamplingParams
    from pipeline.decoding.speculative_rejection import SpeculativeRejectionParams, speculative_rejection

    rng = random.Random(seed)
    n = 8
    lengths = [rng.choice([3, 4, 6, 8, 11, 12, 20]) for _ in range(n)]
    taus = sorted(rng.sample([4, 8, 12], rng.choice([1, 2, 3])))
    alpha, keep_lowest = rng.choice([0.25, 0.5, 0.75]), rng.random() < 0.5
    final = [rng.random() for _ in range(n)]
    # a response's reward by its text: the whole response's is its final reward, a prefix's is its own
    reward = {(r, m): final[r] if m == lengths[r] else rng.random() for r in range(n) for m in range(1, 21)}

    class Generator(FixedLengthGenerator):
        LENGTHS = lengths

        def open(self, session, prompts, num_samples, seeds, sampling):
            self.cap, self.tokens, self.live = sampling.max_new_tokens, {r: [] for r in range(n)}, set(range(n))

    class Scorer:
        def score(self, prompts, responses, finished=None, columns=None):
            return [reward[tuple(map(int, t[3:].split(":")))] for t in responses]

    result = speculative_rejection([PromptInput("p", "p", "p", [1])], Generator(), Scorer(),
                                   SpeculativeRejectionParams(decision_token=taus, rejection_rate=alpha,
                                                              streaming_rewards=False, keep_lowest=keep_lowest),
                                   SamplingParams(max_new_tokens=24), n, seed=0)[0]
    collected = PromptRewards(lengths, final, {t: [reward[r, min(t, lengths[r])] for r in range(n)] for t in taus})
    kept, stopped = accepted_in_turn(collected, taus, alpha, keep_lowest)
    assert stopped == {c.sample: c.stopped_at for c in result.candidates if c.stopped_early}
    assert kept == {c.sample for c in result.candidates if not c.stopped_early}
    assert sum(len(c.token_ids) for c in result.candidates) == sum(min(l, stopped.get(r, l)) for r, l in enumerate(lengths))
    if len(taus) == 1:
        assert kept == accepted(collected, taus[0], alpha, keep_lowest)


def test_frontier_taus_in_turn_are_parsed_and_checked(capsys):
    from benchmarks.frontier import _tau, _taus

    assert _taus("16,16+64,32") == [16, (16, 64), 32] and _tau([16, 64]) == "16+64" and _tau(16) == "16"
    for bad in ("64+16", "16+x"):
        with pytest.raises(SystemExit) as exit_:
            _taus(bad)
        assert exit_.value.code == 2 and "--taus" in capsys.readouterr().err


def test_correlations_per_prompt():
    p = PromptRewards(lengths=[5] * 4, final=[1.0, 2.0, 3.0, 4.0], partial={2: [0.1, 0.2, 0.3, 0.4], 3: [4, 3, 2, 1]})
    assert correlations(p, 2) == pytest.approx((1.0, 1.0))
    assert correlations(p, 3) == pytest.approx((-1.0, -1.0))
    flat = PromptRewards(lengths=[5] * 3, final=[1.0, 1.0, 1.0], partial={2: [0.1, 0.2, 0.3]})
    assert all(math.isnan(v) for v in correlations(flat, 2))


def test_counterfactual_job_writes_json_and_plots(tiny_models, tmp_path):
    from jobs.counterfactual import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Review the lamp for me."}\n{"prompt": "How good is the camera?"}\n')
    out = tmp_path / "cf"
    rc = main(["--generator", str(tiny_models["generator"]), "--reward", str(tiny_models["reward"]),
               "--prompts", str(prompts), "--num-samples", "4", "--taus", "4", "8", "--alphas", "0.5", "0.75",
               "--max-new-tokens", "12", "--output", str(out), "--no-progress"])
    assert rc == 0
    report = json.loads((out / "counterfactual.json").read_text())
    assert report["prompts"] == 2 and report["streaming_reward"]
    assert [len(c["final"]) for c in report["completions"]] == [4, 4]
    summary = json.loads((out / "summary.json").read_text())  # what a results folder keeps
    assert "completions" not in summary and summary["grid"] == report["grid"]
    assert summary["final_reward_spread"][str(tiny_models["reward"])]["median_distinct"] >= 1
    # The completions are plain sampling with the build's row seeds, and their final rewards are
    # the reward model's full scores of those texts (streamed, so to float tolerance).
    from pipeline.data.chat import PromptFormatter, prompt_id
    from pipeline.decoding.sampling import SamplingParams, row_seed
    from pipeline.engines.hf import HFEngine
    from pipeline.engines.rewards import RewardScorer, common_prefix

    engine = HFEngine.from_pretrained(str(tiny_models["generator"]))
    scorer = RewardScorer.from_pretrained(str(tiny_models["reward"]))
    formatter = PromptFormatter(engine.tokenizer, engine.max_context - 12)
    for text, completions in zip(["Review the lamp for me.", "How good is the camera?"], report["completions"]):
        seeds = [row_seed(0, prompt_id(text), s) for s in range(4)]
        rows = engine.generate([formatter.render(text)[1]], 4, seeds, SamplingParams(max_new_tokens=12))
        assert completions["lengths"] == [len(r.token_ids) for r in rows]
        assert completions["prompt_id"] == prompt_id(text)  # what benchmarks.frontier --more-samples matches
        # The prompt's tokens as the models read them: the generator's prefill, and the reward model's
        # text before the response (what two responses share in RewardScorer.encode's own text).
        assert completions["prompt_tokens"] == len(formatter.render(text)[1])
        head = common_prefix(scorer.encode(text, "Yes, it is."), scorer.encode(text, "No."))
        assert completions["reward_prompt_tokens"] == head and scorer.encode(text, rows[0].text)[:head] == \
            scorer.encode(text, "")[:head] and 0 < head < len(scorer.encode(text, rows[0].text))
        assert completions["final"] == pytest.approx(scorer.score([text] * 4, [r.text for r in rows]), abs=1e-4)
        # The partial rewards that drive the grid: each row's first tau tokens (all of them if it
        # ended earlier) as text, scored afresh in full by the reward model, not streamed.
        for tau in (4, 8):
            partial_texts = engine.tokenizer.batch_decode([r.token_ids[:tau] for r in rows], skip_special_tokens=True)
            assert any(len(r.token_ids) > tau for r in rows)  # a real partial response, not a final one
            assert completions["partial"][str(tau)] == pytest.approx(scorer.score([text] * 4, partial_texts), abs=1e-4)
    # The grid is Algorithm 1 replayed on exactly those rewards.
    collected = [PromptRewards(c["lengths"], c["final"], {int(t): v for t, v in c["partial"].items()})
                 for c in report["completions"]]
    assert report["keep_lowest"] and report["grid"] == grid(collected, [4, 8], [0.5, 0.75])
    assert (out / "tradeoff.png").stat().st_size > 0 and (out / "correlations.png").stat().st_size > 0


def test_counterfactual_job_bad_input_exits_2(tmp_path, capsys):
    from jobs.counterfactual import main

    rc = main(["--generator", "x", "--reward", "y", "--prompts", str(tmp_path / "missing.jsonl")])
    assert rc == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_review_grammar_labels_are_the_mean_sentence_points():
    from jobs.bench_models import POINTS, cut_at_word, quality, review_corpus

    rows = review_corpus(0, 200)
    assert review_corpus(0, 5) == rows[:5]
    for r in rows:
        assert len(r["points"]) == r["response"].count(".") + r["response"].count("?")
        assert set(r["points"]) <= set(POINTS.values())
    labels = [quality(r["points"]) for r in rows]
    assert min(labels) < 0 < max(labels)
    prefix, label = cut_at_word(random.Random(1), "It is a thing. Who even cares. The lens", [0.0, -3.0, 2.0])
    assert rows and prefix and label in (0.0, -1.5, quality([0.0, -3.0, 2.0]))
    assert cut_at_word(random.Random(0), "Who even cares. It is", [-3.0, 0.0]) in (
        ("Who", 0.0), ("Who even", 0.0), ("Who even cares.", -3.0), ("Who even cares. It", -3.0),
        ("Who even cares. It is", -3.0))


def test_trained_bench_models_toy_build_is_cached(tmp_path):
    from jobs.bench_models import BenchSettings, make_bench_models
    from pipeline.engines.hf import HFEngine
    from pipeline.engines.rewards import RewardScorer

    toy = BenchSettings(corpus_size=64, vocab_size=300, generator_steps=2, reward_steps=2, batch_size=4,
                        generator_hidden=32, generator_layers=1, draft_hidden=16, draft_layers=1,
                        reward_hidden=32, reward_layers=1)
    paths = make_bench_models(tmp_path, toy, progress=False)
    stamp = (tmp_path / "bench.json").stat().st_mtime_ns
    assert make_bench_models(tmp_path, toy, progress=False) == paths
    assert (tmp_path / "bench.json").stat().st_mtime_ns == stamp  # cached: nothing rebuilt
    report = json.loads((tmp_path / "bench.json").read_text())["report"]
    assert report["generator_parameters"] > report["draft_parameters"] > 0
    engine = HFEngine.from_pretrained(str(paths["generator"]))
    draft = HFEngine.from_pretrained(str(paths["draft"]))
    assert engine.tokenizer.get_vocab() == draft.tokenizer.get_vocab()
    assert RewardScorer.from_pretrained(str(paths["reward"])).streaming
    assert len(paths["prompts"].read_text().splitlines()) == 32


def test_sbon_benchmark_runs_on_a_synthetic_pair(tmp_path, capsys):
    from benchmarks.sbon import main

    rc = main(["--synthetic", "tiny", "--num-prompts", "2", "--num-samples", "4", "--sr", "4:0.5", "--adaptive", "0",
               "--memory", "8:4:4", "--max-new-tokens", "10", "--repeats", "1", "--json", str(tmp_path / "s.json"),
               "--plot", str(tmp_path / "s.png")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Bo4" in out and "streaming / re-scoring reward-model tokens" in out
    report = json.loads((tmp_path / "s.json").read_text())
    methods = [r["method"] for r in report["tables"]["4"]["rows"]]
    assert methods[0].startswith("SBoN") and "Bo4" in methods and any(m.startswith("memory") for m in methods)
    assert report["tables"]["4"]["max_stream_score_diff"] < 1e-3


@pytest.fixture(scope="module")
def small_bench_models(tmp_path_factory):
    """Bench models trained briefly (about a minute on 2 cores): a real length-reward relation."""
    from jobs.bench_models import BenchSettings, make_bench_models

    out = tmp_path_factory.mktemp("bench")
    make_bench_models(out, BenchSettings(corpus_size=3000, generator_steps=150, reward_steps=100), progress=False)
    return out


@pytest.mark.slow
def test_bon_equivalent_estimate_is_within_10_percent_of_a_real_best_of_n_run(small_bench_models):
    """What speculative rejection claims Best-of-N would have generated, against a Best-of-N run on
    the same prompts and seeds (tau 16, alpha 0.875, N 16: the setting where survivors' lengths
    alone overstated it by 12-14%)."""
    from pipeline.data.chat import PromptFormatter, prompt_id
    from pipeline.decoding.best_of_n import BestOfNParams, best_of_n
    from pipeline.decoding.domain import PromptInput
    from pipeline.decoding.sampling import SamplingParams
    from pipeline.decoding.speculative_rejection import SpeculativeRejectionParams, speculative_rejection
    from pipeline.engines.hf import HFEngine
    from pipeline.engines.rewards import RewardScorer

    engine = HFEngine.from_pretrained(str(small_bench_models / "generator"))
    scorer = RewardScorer.from_pretrained(str(small_bench_models / "reward"))
    texts = [json.loads(line)["prompt"] for line in (small_bench_models / "prompts.jsonl").read_text().splitlines()]
    formatter = PromptFormatter(engine.tokenizer, 4096)
    prompts = [PromptInput(prompt_id(t), *formatter.render(t)[:1], t, formatter.render(t)[1]) for t in texts[:12]]
    sampling, params = SamplingParams(max_new_tokens=96), SpeculativeRejectionParams(16, 0.875)
    batches = [prompts[i:i + 4] for i in range(0, len(prompts), 4)]
    real = sum(r.generated_tokens for b in batches for r in best_of_n(b, engine, scorer, BestOfNParams(), sampling,
                                                                         16, 0))
    sbon = [r for b in batches for r in speculative_rejection(b, engine, scorer, params, sampling, 16, 0)]
    claimed = sum(r.bon_equivalent_tokens for r in sbon)
    assert sum(r.generated_tokens for r in sbon) < real
    assert abs(claimed / real - 1) < 0.10, (claimed, real)


def test_vllm_benchmark_builds_read_the_first_num_prompts_rows(vllm_bench, tmp_path):
    """``--set data.prompts=FILE`` picks the file benchmarks.vllm_sbon takes its first --num-prompts
    rows from; every build reads those rows, not the whole file (it once ran all 64 of 8 asked)."""
    bench, argvs = vllm_bench
    args = bench.parse_args(["--runs", "bon_vllm,sbon_continuous", "--set", "data.prompts=configs/prompts/ifeval-eval.jsonl",
                             "--set", "strategy.decision_token=32", "--output", str(tmp_path)])
    for name in args.runs:
        bench.build(name, args, tmp_path / "prompts.jsonl", 8)
    for name, argv in argvs.items():
        sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        assert not any(s.startswith("data.prompts=") for s in sets), name
        assert argv[argv.index("--prompts") + 1] == str(tmp_path / "prompts.jsonl")
    assert "strategy.decision_token=32" in argvs["sbon_continuous"] and "strategy.decision_token=32" not in argvs["bon_vllm"]


# -- the equal-compute frontier (benchmarks.frontier, issue 49) -----------------------------------


def _frontier_prompts(seed: int, n: int, prompts: int = 3, agreeing: bool = False):
    """Random prompts; ``agreeing``: the judge follows the final reward (instructions followed at
    final >= 2 and >= 3), so Best-of-K's quality grows with K."""
    from benchmarks.frontier import Prompt

    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        lengths = [rng.choice([5, 20, 40, 64]) for _ in range(n)]
        final = [float(rng.choice([0, 1, 2, 2, 3])) for _ in range(n)]  # ties on purpose
        partial = {t: [f + rng.random() if length >= t else f for f, length in zip(final, lengths)] for t in (8, 16)}
        judged = [[f >= 2, f >= 3] if agreeing else [rng.random() < 0.5 for _ in range(2)] for f in final]
        out.append(Prompt(PromptRewards(lengths, final, partial), judged))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_frontier_best_of_k_is_the_exact_mean_over_every_k_subset(seed):
    """Best-of-K's closed form (rank r chosen in C(N-1-r, K-1) of C(N, K) subsets) equals the mean of
    Algorithm 1's own choice (metrics.chosen, ties to the lower index) over all K-subsets."""
    from itertools import combinations

    from benchmarks.frontier import best_of_k
    from pipeline.decoding.metrics import chosen

    prompts = _frontier_prompts(seed, n=6)
    for k in range(1, 7):
        point = best_of_k(prompts, k)
        for i, p in enumerate(prompts):
            picks = [chosen(p.rewards, set(s)) for s in combinations(range(6), k)]
            assert point.prompt_level[i] == pytest.approx(sum(all(p.judged[c]) for c in picks) / len(picks))
            assert point.followed[i] == pytest.approx(sum(sum(p.judged[c]) for c in picks) / len(picks))
            assert point.generator[i] == pytest.approx(k * sum(p.rewards.lengths) / 6)


def test_frontier_sbon_without_rejection_is_best_of_n_and_the_ratio_interpolates():
    """alpha 0 keeps every row: sbon at N_max spends Best-of-N's tokens and picks its choice, so its
    equal-quality ratio is 1; a cut saves tokens; the curve is interpolated linearly between two K."""
    import numpy as np

    from benchmarks.frontier import aggregate, best_of_k, equal_quality_compute, frontier, sbon

    prompts = _frontier_prompts(7, n=8, prompts=5, agreeing=True)
    instructions = np.array([2.0] * 5)
    full, plain = sbon(prompts, 8, 8, 0.0, 1, 0), best_of_k(prompts, 8)
    same_n = aggregate(full, instructions, (1, 1))
    assert same_n.pop("normalized_score") == pytest.approx(100.0)  # Best-of-N's own choice
    assert same_n == pytest.approx(aggregate(plain, instructions, (1, 1)))
    cut = sbon(prompts, 8, 8, 0.75, 1, 0)
    assert cut.generator.sum() < full.generator.sum()
    curve = [{"compute": 10.0, "q": 0.2}, {"compute": 20.0, "q": 0.6}, {"compute": 40.0, "q": 0.6}]
    assert equal_quality_compute(curve, 0.5, "q") == (17.5, False)
    assert equal_quality_compute(curve, 0.7, "q") == (40.0, True)
    result = frontier(prompts, [4, 8], [8], [0.0], "instruction_level", (1.0, 1.0), 20, 50, 0)
    at_n = {p["n"]: p for p in result["sbon"]}
    assert at_n[8]["ratio"] == pytest.approx(1.0) and at_n[8]["ratio_low"] <= 1.0 <= at_n[8]["ratio_high"]
    assert [c["k"] for c in result["best_of_k"]] == list(range(1, 9))


def test_frontier_same_n_figures_are_eq5_against_best_of_n_of_the_same_candidates():
    """The same-N columns: at N_max with one tau, each prompt's score is metrics.simulate's Eq. 5
    (the paper's own replay), averaged over the prompts whose rewards do not all tie; alpha 0 keeps
    Best-of-N's choice (100) at its compute (1x); a cut's same-N ratio is Best-of-N's tokens over its own."""
    import math

    import numpy as np

    from benchmarks.frontier import frontier, sbon
    from pipeline.decoding.metrics import simulate

    prompts = _frontier_prompts(11, n=8, prompts=6)
    prompts[0].rewards.final[:] = [2.0] * 8  # every reward ties: no range, left out of the mean
    for alpha in (0.5, 0.75):
        point = sbon(prompts, 8, 8, alpha, 1, 0)
        expected = [simulate(p.rewards, 8, alpha)[0] for p in prompts]
        assert math.isnan(point.score[0]) and math.isnan(expected[0])
        assert point.score[1:] == pytest.approx(expected[1:])
    result = frontier(prompts, [8], [8], [0.0, 0.75], "final_reward", (1.0, 1.0), 5, 5, 0)
    plain, cut = result["sbon"]
    assert plain["normalized_score"] == pytest.approx(100.0) and plain["same_n_ratio"] == pytest.approx(1.0)
    tokens = sum(sum(p.rewards.lengths) for p in prompts) / len(prompts)
    assert cut["same_n_ratio"] == pytest.approx(2 * tokens / cut["compute"]) and cut["same_n_ratio"] > 1
    assert cut["normalized_score"] == pytest.approx(np.nanmean([simulate(p.rewards, 8, 0.75)[0] for p in prompts]))


def _collection(prompts, keep, seed: int, ids=None) -> dict:
    """A counterfactual JSON of ``prompts`` with only the completions ``keep`` of each (``ids``: prompt ids)."""
    return {"taus": [8, 16], "alphas": [0.5], "num_samples": len(keep), "seed": seed, "completions": [
        {**({"prompt_id": ids[i]} if ids else {}), "prompt_tokens": 0, "reward_prompt_tokens": 0,
         "lengths": [p.rewards.lengths[k] for k in keep],
         "final": [p.rewards.final[k] for k in keep],
         "partial": {str(t): [v[k] for k in keep] for t, v in p.rewards.partial.items()},
         "judged": [p.judged[k] for k in keep]} for i, p in enumerate(prompts)]}


def test_frontier_more_samples_pools_each_prompts_completions(tmp_path, capsys):
    """Two halves of each prompt's completions, collected under two seeds and pooled with
    --more-samples, replay exactly as the whole collection does (N_max their sum); a second seed
    that repeats the first, other prompts, or a --more-samples count that does not match are one
    line, exit 2."""
    from benchmarks.frontier import main

    prompts, paths = _frontier_prompts(5, n=8, prompts=4, agreeing=True), {}
    for name, keep, seed, ids in (("whole", range(8), 0, None), ("a", range(4), 0, "pqrs"), ("b", range(4, 8), 1, "pqrs"),
                                  ("same_seed", range(4, 8), 0, "pqrs"), ("other", range(4, 8), 1, "pqrz")):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(_collection(prompts, list(keep), seed, ids)))
    results = {}
    for name, argv in (("whole", [str(paths["whole"])]), ("pooled", [str(paths["a"]), "--more-samples", str(paths["b"])])):
        assert main(["--counterfactual", *argv, "--sizes", "4,8", "--bootstrap", "20", "--json", str(tmp_path / name)]) == 0
        results[name] = json.loads((tmp_path / name).read_text())
    assert results["pooled"]["n_max"] == 8 and results["pooled"]["more_samples"] == [[str(paths["b"])]]
    for key in ("best_of_k", "sbon"):
        assert results["pooled"][key] == results["whole"][key]  # the same completions in the same order
    capsys.readouterr()
    for more, message in ((["same_seed"], "collected with seed 0"), (["other"], "prompt 3's id"),
                          (["b", "b"], "2 paths for 1 --counterfactual"), (["whole"], "the same completions again")):
        argv = ["--counterfactual", str(paths["a"]), "--more-samples", *(str(paths[m]) for m in more)]
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_frontier_cli_writes_json_and_png_and_refuses_bad_input(tmp_path, capsys):
    from benchmarks.frontier import main

    prompts = _frontier_prompts(3, n=6)
    data = {"taus": [8, 16], "alphas": [0.5], "completions": [
        {"prompt_tokens": 0, "reward_prompt_tokens": 0, "lengths": p.rewards.lengths, "final": p.rewards.final,
         "partial": {str(t): v for t, v in p.rewards.partial.items()}, "judged": p.judged} for p in prompts]}
    path = tmp_path / "counterfactual.json"
    path.write_text(json.dumps(data))
    assert main(["--counterfactual", str(path), "--bootstrap", "20", "--json", str(tmp_path / "f.json"),
                 "--plot", str(tmp_path / "f.png")]) == 0
    written = json.loads((tmp_path / "f.json").read_text())
    assert written["n_max"] == 6 and len(written["sbon"]) == 2 and (tmp_path / "f.png").stat().st_size > 0
    # The committed collections are gzip-compressed: the same data read from .json.gz gives the same frontier.
    (tmp_path / "counterfactual.json.gz").write_bytes(gzip.compress(path.read_bytes()))
    assert main(["--counterfactual", str(tmp_path / "counterfactual.json.gz"), "--bootstrap", "20",
                 "--json", str(tmp_path / "gz.json")]) == 0
    assert json.loads((tmp_path / "gz.json").read_text())["sbon"] == written["sbon"]
    (tmp_path / "torn.json.gz").write_bytes(gzip.compress(path.read_bytes())[:-20])
    for bad, message in ((tmp_path / "none.json", "not a counterfactual JSON"),
                         (tmp_path / "torn.json.gz", "torn.json.gz: not a counterfactual JSON")):
        with pytest.raises(SystemExit) as exit_:
            main(["--counterfactual", str(bad)])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["--counterfactual", str(path), "--taus", "32"])
    assert exit_.value.code == 2 and "no partial rewards at tau [32]" in capsys.readouterr().err


def test_frontier_weights_recombine_the_collections_own_rewards(tmp_path, capsys):
    """--weights 0,1 replays the second reward alone: the same frontier as a collection whose
    combined rewards were that reward's; a weight count that does not match refuses in one line."""
    from benchmarks.frontier import main

    first, second = _frontier_prompts(3, n=6), _frontier_prompts(4, n=6)
    taus = sorted(first[0].rewards.partial)

    def entry(p, q, combined):
        return {"prompt_tokens": 0, "reward_prompt_tokens": 0, "lengths": p.rewards.lengths, "final": combined.rewards.final,
                "partial": {str(t): v for t, v in combined.rewards.partial.items()}, "judged": p.judged,
                "ended": {str(t): [False] * 6 for t in taus},
                "rewards": {spec: {"final": r.rewards.final, "partial": {str(t): v for t, v in r.rewards.partial.items()}}
                            for spec, r in (("a", p), ("b", q))}}

    both = tmp_path / "both.json"
    both.write_text(json.dumps({"reward": ["a", "b"], "reward_weights": [1, 1], "taus": taus, "alphas": [0.5],
                                "completions": [entry(p, q, p) for p, q in zip(first, second)]}))
    alone = tmp_path / "alone.json"
    alone.write_text(json.dumps({"reward": ["a", "b"], "reward_weights": [1, 1], "taus": taus, "alphas": [0.5],
                                 "completions": [entry(p, q, q) for p, q in zip(first, second)]}))
    for name, argv in (("weighted", [str(both), "--weights", "0,1"]), ("alone", [str(alone)]),
                       ("collected", [str(both)])):
        assert main(["--counterfactual", *argv, "--bootstrap", "10", "--json", str(tmp_path / f"{name}-out.json")]) == 0
    result = {n: json.loads((tmp_path / f"{n}-out.json").read_text()) for n in ("weighted", "alone", "collected")}
    for key in ("best_of_k", "sbon"):
        assert result["weighted"][key] == result["alone"][key]
    assert result["weighted"]["reward_weights"] == [0.0, 1.0]
    assert result["weighted"]["best_of_k"] != result["collected"]["best_of_k"]  # the first reward's own frontier differs
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["--counterfactual", str(both), "--weights", "1"])
    assert exit_.value.code == 2 and "--weights has 1 weights for its 2 rewards (a, b)" in capsys.readouterr().err
    # Two collections replay as one set of prompts; collections made differently refuse in one line.
    assert main(["--counterfactual", str(both), str(alone), "--bootstrap", "10", "--json", str(tmp_path / "two.json")]) == 0
    assert json.loads((tmp_path / "two.json").read_text())["prompts"] == 6
    other = json.loads(both.read_text()) | {"taus": [8]}
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit) as exit_:
        main(["--counterfactual", str(both), str(tmp_path / "other.json")])
    assert exit_.value.code == 2 and "other.json: not collected as" in capsys.readouterr().err


# -- held-out selection of the frontier's best point (benchmarks.frontier --held-out-splits, issue 62) -----


def _fixed_points(prompts: int, fluke: float):
    """Best-of-K for K 1..4 spending 2K a prompt at final reward K on every prompt; ``steady``: 4 a
    prompt at final 3 on every prompt (Best-of-3's 6 over 4: 1.5x on any half); ``fluke``: 4 a prompt
    at final ``fluke`` on prompt 0 and 1 elsewhere (above the curve, 8 / 4 = 2x, wherever prompt 0
    is; Best-of-1's 2 / 4 = 0.5x where it is not)."""
    import numpy as np

    from benchmarks.frontier import Point

    def point(spend: float, final) -> Point:
        final = np.asarray(final, dtype=float)
        return Point(np.full(prompts, spend / 2), np.full(prompts, spend / 2), final * 0, final * 0, final)

    curve = [point(2 * k, [k] * prompts) for k in range(1, 5)]
    return curve, point(4, [3] * prompts), point(4, [fluke] + [1] * (prompts - 1))


def test_held_out_selection_chooses_on_one_half_and_scores_on_the_other():
    """A grid of two points: steady (1.5x on any prompts) and a fluke that wins on all prompts (2x, above
    the curve) only through prompt 0. The in-sample headline is the fluke; chosen on a half, it wins
    exactly when prompt 0 is in that half, and scored on the other half (without prompt 0) it gives
    0.5x; otherwise steady is chosen and gives 1.5x. A figure taken on the choosing half, or on all
    prompts, would read 2x."""
    import numpy as np

    from benchmarks.frontier import choose_on, held_out, ratio

    curve, steady, fluke = _fixed_points(8, fluke=33.0)  # fluke's mean final on all 8: (33 + 7) / 8 = 5, above 4
    instructions = np.ones(8)
    assert ratio(curve, fluke, instructions, (1, 1), "final_reward") == (2.0, True)
    assert ratio(curve, steady, instructions, (1, 1), "final_reward") == (1.5, False)
    with_0, without_0 = np.array([0, 2, 4, 6]), np.array([1, 3, 5, 7])
    assert choose_on(curve, [steady, fluke], instructions, (1, 1), "final_reward", with_0, without_0) == (1, 2.0, 0.5, False)
    assert choose_on(curve, [steady, fluke], instructions, (1, 1), "final_reward", without_0, with_0) == (0, 1.5, 1.5, False)
    result = held_out(curve, [steady, fluke], instructions, (1, 1), "final_reward", splits=200, seed=3)
    assert sorted(set(result["ratios"])) == [0.5, 1.5]
    assert result["ratios"].count(0.5) == result["chosen"][1] and result["ratios"].count(1.5) == result["chosen"][0]
    assert 70 < result["chosen"][1] < 130  # prompt 0 lands in the choosing half about half the time
    assert result["in_sample_median"] >= 1.5 and result["ratio_low"] == 0.5 and result["ratio_high"] == 1.5
    assert (result["select_prompts"], result["measure_prompts"], result["splits"]) == (4, 4, 200)
    # No fluke: the steady point is chosen every time, and held out it keeps its 1.5x.
    curve, steady, tame = _fixed_points(8, fluke=1.0)
    same = held_out(curve, [tame, steady], instructions, (1, 1), "final_reward", splits=50, seed=3)
    assert same["chosen"] == {1: 50} and same["ratio_median"] == same["ratio_low"] == same["ratio_high"] == 1.5


def test_held_out_figure_is_the_ratio_on_the_measured_prompts_alone():
    """One split of random prompts: the choice is the headline of a collection of the choosing prompts
    alone, and the held-out ratio is that point's ratio in a collection of the measured prompts alone
    (their own Best-of-K curve). At N_max, where sbon replays every completion, a prompt's figures do
    not depend on the others."""
    import numpy as np

    from benchmarks.frontier import best_of_k, choose_on, frontier, sbon

    prompts = _frontier_prompts(21, n=8, prompts=10, agreeing=True)
    taus, alphas = [8, 16], [0.25, 0.5, 0.75]
    select, measure = np.array([0, 3, 4, 7, 9]), np.array([1, 2, 5, 6, 8])
    curve = [best_of_k(prompts, k) for k in range(1, 9)]
    points = [sbon(prompts, 8, t, a, 1, 0) for t in taus for a in alphas]
    best, in_sample, value, above = choose_on(curve, points, np.full(10, 2.0), (1, 1), "instruction_level",
                                              select, measure)
    alone = {name: frontier([prompts[i] for i in index], [8], taus, alphas, "instruction_level", (1.0, 1.0), 1, 0, 0)["sbon"]
             for name, index in (("select", select), ("measure", measure))}
    headline = int(np.argmax([p["ratio"] for p in alone["select"]]))
    assert best == headline and in_sample == pytest.approx(alone["select"][headline]["ratio"])
    assert value == pytest.approx(alone["measure"][headline]["ratio"]) and above == alone["measure"][headline]["above_curve"]
    assert len({round(p["ratio"], 9) for p in alone["select"]}) > 1  # the choice is not a tie of every point


def test_frontier_held_out_splits_in_the_json_and_plot_beside_the_fixed_point_interval(tmp_path, capsys):
    """--held-out-splits adds ``held_out`` (headline with its fixed-point interval, the held-out
    median and range, the chosen points) and changes nothing else; without it there is none; a
    negative count is one line, exit 2."""
    from benchmarks.frontier import main

    prompts = _frontier_prompts(9, n=8, prompts=12, agreeing=True)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_collection(prompts, list(range(8)), 0)))
    argv = ["--counterfactual", str(path), "--sizes", "4,8", "--alphas", "0.5,0.75", "--bootstrap", "20"]
    assert main([*argv, "--json", str(tmp_path / "plain.json")]) == 0
    assert main([*argv, "--held-out-splits", "40", "--json", str(tmp_path / "held.json"),
                 "--plot", str(tmp_path / "held.png")]) == 0
    out = capsys.readouterr().out
    plain, held = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("plain", "held"))
    assert "held_out" not in plain and plain["sbon"] == held["sbon"] and plain["best_of_k"] == held["best_of_k"]
    figure = held["held_out"]
    top = max(held["sbon"], key=lambda p: p["ratio"])
    assert figure["headline"] == {k: top[k] for k in ("n", "tau", "alpha", "ratio", "ratio_low", "ratio_high")}
    assert figure["splits"] == len(figure["ratios"]) == sum(c["splits"] for c in figure["chosen"]) == 40
    assert figure["ratio_low"] <= figure["ratio_median"] <= figure["ratio_high"]
    assert (figure["select_prompts"], figure["measure_prompts"]) == (6, 6)
    assert "held out, the best point chosen on 6 prompts and scored on the other 6" in out
    assert (tmp_path / "held.png").stat().st_size > 0
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--held-out-splits", "-1"])
    assert exit_.value.code == 2 and "--held-out-splits -1" in capsys.readouterr().err


# -- the prompt's tokens in the frontier's compute (benchmarks.frontier, issue 62) -------------------


def _by_hand(prompts: int, **settings) -> dict:
    """A collection of ``prompts`` alike prompts: 4 completions of 10 tokens, final rewards 1..4 that
    the partial reward at tau 2 already shows; 30 prefill tokens and 20 reward prompt tokens each."""
    entry = {"prompt_tokens": 30, "reward_prompt_tokens": 20, "lengths": [10] * 4, "final": [1.0, 2.0, 3.0, 4.0],
             "partial": {"2": [1.0, 2.0, 3.0, 4.0]}, "judged": [[True]] * 4}
    return {"taus": [2], "alphas": [0.75], "num_samples": 4, "seed": 0, **settings, "completions": [entry] * prompts}


def test_frontier_counts_the_prompt_once_per_prompt_or_once_per_candidate(tmp_path, capsys):
    """By hand. sbon at N 4, tau 2, alpha 0.75 keeps the best row and (keep_lowest) the worst and stops
    two at 2 tokens: 24 generated tokens, each read once by the streaming reward, 48 in all; it
    chooses final 4, Best-of-4's, whose compute is 4 x (10 + 10) = 80. Without the prompt 80 / 48.
    With 30 prefill tokens (once per prompt, both methods: the engine shares the prompt among its
    samples) and 20 reward prompt tokens per read: read once per prompt, (80 + 50) / (48 + 50); once
    per candidate (4 each), (80 + 30 + 80) / (48 + 30 + 80). The held-out figure (every prompt
    alike) is the same ratio; the default follows the collection's streaming_reward."""
    from benchmarks.frontier import main

    cases = {"streaming": ({"streaming_reward": True}, [], 130 / 98, "per-prompt"),
             "whole": ({"streaming_reward": False}, [], 190 / 158, "per-candidate"),
             "whole-as-streaming": ({"streaming_reward": False}, ["--reward-prompt", "per-prompt"], 130 / 98, "per-prompt"),
             "streaming-as-whole": ({"streaming_reward": True}, ["--reward-prompt", "per-candidate"], 190 / 158,
                                    "per-candidate"),
             "left-out": ({"streaming_reward": True}, ["--leave-out-prompt"], 80 / 48, "per-prompt")}
    for name, (settings, flags, expected, reads) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(_by_hand(4, **settings)))
        assert main(["--counterfactual", str(path), "--level", "final_reward", "--bootstrap", "0",
                     "--held-out-splits", "5", *flags, "--json", str(tmp_path / f"{name}-out.json")]) == 0
        out = capsys.readouterr().out
        result = json.loads((tmp_path / f"{name}-out.json").read_text())
        (point,) = result["sbon"]
        assert point["final_reward"] == 4.0 and point["ratio"] == pytest.approx(expected), name
        assert result["held_out"]["ratio_median"] == pytest.approx(expected), name
        assert result["prompt_tokens"]["reward_prompt"] == reads
        counted = 0 if name == "left-out" else 1
        candidates = 4 if reads == "per-candidate" else 1
        assert point["generator_tokens"] == pytest.approx(24 + 30 * counted)
        assert point["reward_tokens"] == pytest.approx(24 + 20 * candidates * counted)
        assert point["prompt_tokens"] == pytest.approx((30 + 20 * candidates) * counted)
        assert [c["compute"] for c in result["best_of_k"]] == pytest.approx(
            [20 * k + (30 + 20 * (k if reads == "per-candidate" else 1)) * counted for k in range(1, 5)])
        assert result["prompt_tokens"]["per_prompt"] == {"generator": [30 * counted] * 4, "reward": [20 * counted] * 4}
        assert f"the generator's prefill {30.0 * counted:.1f} (once per prompt), the reward model's " \
               f"{20.0 * counted:.1f} per read ({reads}: once per {reads.split('-')[1]})" in out


def test_frontier_counts_an_older_collections_prompt_tokens_from_its_prompt_file(tiny_models, tmp_path, capsys):
    """A collection made before jobs.counterfactual recorded the counts: --prompts counts them with the
    tokenizers of the models it names (the generator's chat template; the reward model's text before
    the response; the reward function reads none), a prompt found by its id, or, without one, as the
    file's row of its index. A file whose row does not match, no file, or a tokenizer that does not
    load: one line, exit 2."""
    from transformers import AutoTokenizer

    from benchmarks.frontier import main
    from pipeline.data.chat import PromptFormatter, prompt_id, reward_prompt_tokens

    texts = ["Review the lamp for me.", "A row between, with three instructions of its own.",
             "How good is the camera? Answer in one word, please."]
    prompt_file = tmp_path / "p.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": t, "instruction_id_list": ["x"] * n}) + "\n"
                                   for t, n in zip(texts, (1, 3, 2))))
    entry = {"lengths": [10] * 4, "final": [1.0, 2.0, 3.0, 4.0], "partial": {"2": [1.0, 2.0, 3.0, 4.0]}}
    collection = {"generator": str(tiny_models["generator"]), "reward": ["pipeline.judge:ifeval_reward",
                  str(tiny_models["reward"])], "taus": [2], "alphas": [0.75], "completions": [
                      {**entry, "judged": [[True]] * 4},  # no id: the file's row 0
                      {**entry, "prompt_id": prompt_id(texts[2]), "judged": [[True, False]] * 4}]}  # row 2, by id
    path = tmp_path / "old.json"
    path.write_text(json.dumps(collection))
    assert main(["--counterfactual", str(path), "--prompts", str(prompt_file), "--bootstrap", "0",
                 "--json", str(tmp_path / "out.json")]) == 0
    generator = AutoTokenizer.from_pretrained(str(tiny_models["generator"]))
    reward = AutoTokenizer.from_pretrained(str(tiny_models["reward"]))
    expected = {"generator": [len(PromptFormatter(generator, 10**6).render(t)[1]) for t in (texts[0], texts[2])],
                "reward": [reward_prompt_tokens(reward, t) for t in (texts[0], texts[2])]}
    counted = json.loads((tmp_path / "out.json").read_text())["prompt_tokens"]
    assert counted["per_prompt"] == expected and counted["reward_prompt"] == "per-prompt"
    assert expected["generator"][0] != expected["generator"][1] and min(expected["reward"]) > 0
    capsys.readouterr()
    wrong_row = tmp_path / "wrong.jsonl"
    wrong_row.write_text("".join(prompt_file.read_text().splitlines(keepends=True)[1:]))
    missing = tmp_path / "missing-model"
    for argv, message in (([str(path)], "old.json: no prompt token counts"),
                          ([str(path), "--prompts", str(wrong_row)], "prompt 0 has 1 instructions, row 1 of"),
                          ([str(path), "--prompts", str(prompt_file), str(prompt_file)], "--prompts: 2 files for 1"),
                          ([str(tmp_path / "lost.json"), "--prompts", str(prompt_file)],
                           f"{missing}: cannot load the tokenizer")):
        if "lost.json" in argv[0]:
            (tmp_path / "lost.json").write_text(json.dumps({**collection, "generator": str(missing)}))
        with pytest.raises(SystemExit) as exit_:
            main(["--counterfactual", *argv])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_equal_reward_crossing_interpolates_between_k_and_claims_nothing_outside():
    import numpy as np

    from benchmarks.equal_reward import at, crossing

    curve = np.array([4.0, 4.4, 4.6])
    assert crossing(curve, 4.5) == (pytest.approx(2.5), "within")
    assert crossing(curve, 4.0) == (1.0, "within")
    assert crossing(curve, 3.9) == (1.0, "below")
    assert crossing(curve, 4.7) == (3.0, "above")
    assert crossing(np.array([4.5, 4.5]), 4.5) == (1.0, "within")
    assert at(np.array([100.0, 140.0, 150.0]), 1.5) == pytest.approx(120.0)
    assert at(np.array([100.0, 140.0, 150.0]), 3.0) == 150.0


def test_equal_reward_figures_from_records_by_hand():
    """Two prompts, one seed: Best-of-K's curve is the mean of the running best, K* where it meets
    sbon's mean reward, and the ratios are Best-of-K*'s interpolated cost over sbon's (compute: twice
    the generated tokens, the generator's and the reward's reads, plus the prompt's)."""
    from benchmarks.equal_reward import figures, records_arrays, summarize

    records = [{"seed": 1, "prompt_id": "a", "prompt_tokens": 10, "reward_prompt_tokens": 12, "sbon_reward": 2.0,
                "sbon_tokens": 30, "candidate_scores": [1.0, 3.0, 2.0], "candidate_tokens": [10, 20, 30]},
               {"seed": 1, "prompt_id": "b", "prompt_tokens": 4, "reward_prompt_tokens": 6, "sbon_reward": 1.0,
                "sbon_tokens": 10, "candidate_scores": [float("nan"), 0.0, 1.0], "candidate_tokens": [5, 5, 5]}]
    a = records_arrays(records, 3)
    assert a["bon_reward"].mean(axis=0).tolist() == [0.5, 1.5, 2.0]
    f = figures(a)
    assert f["sbon_reward"] == 1.5 and f["k_star"] == 2.0 and f["k_star_is"] == "within"
    assert f["tokens_ratio"] == pytest.approx(((10 + 20) + (5 + 5)) / 2 / 20)
    assert f["compute_ratio"] == pytest.approx((2 * 20 + 16) / (2 * 20 + 16))
    s = summarize(records, 3, 200)
    assert s["prompts"] == 2 and s["intervals"]["k_star"][0] <= 2.0 <= s["intervals"]["k_star"][1]
    # the mean over a prompt's seeds is its record: a second seed of prompt a halves its weight
    again = summarize(records + [{**records[0], "seed": 2, "sbon_reward": 0.0}], 3, 200)
    assert again["sbon_reward"] == pytest.approx((1.0 + 1.0) / 2)


def test_equal_reward_live_on_the_tiny_models(tiny_models, tmp_path, capsys):
    """sbon and Best-of-3 with candidate scores through the build job, one seed: each record is the
    builds' own pair rows, the run times are their reports', a rerun reuses the builds, and --replay
    reproduces the JSON from its records."""
    from benchmarks.equal_reward import main
    from benchmarks.real_sbon import read_pairs

    out = tmp_path / "eq"
    argv = ["--config", "configs/demo.yaml", "--prompts", "configs/prompts/demo.jsonl", "--skip", "2",
            "--num-prompts", "3", "--seeds", "7", "--k-max", "3", "--output", str(out), "--bootstrap", "200",
            "--reward", str(tiny_models["reward"]), "--set", f"models.generator={tiny_models['generator']}",
            "--set", "runtime.local=true", "--set", "sampling.max_new_tokens=12",
            "--sbon-set", "sampling.num_samples=4", "--sbon-set", "strategy.decision_token=4",
            "--sbon-set", "strategy.rejection_rate=0.5", "--json", str(tmp_path / "eq.json")]
    assert main(argv) == 0
    figures = json.loads((tmp_path / "eq.json").read_text())
    seed = figures["per_seed"][0]
    sbon, bon = (read_pairs(out / "seed-7" / name) for name in ("sbon", "best_of_3"))
    assert len(figures["records"]) == len(set(sbon) & set(bon)) == figures["summary"]["prompts"]
    for r in figures["records"]:
        assert r["sbon_reward"] == sbon[r["prompt_id"]]["chosen_score"]
        assert max(r["candidate_scores"]) == bon[r["prompt_id"]]["chosen_score"]
        assert r["prompt_tokens"] == len(bon[r["prompt_id"]]["prompt_token_ids"]) and r["reward_prompt_tokens"] > 0
    for name in ("best_of_3", "sbon"):
        report = json.loads((out / "seed-7" / name / "_report.json").read_text())
        assert seed["builds"][name]["run_seconds"] == report["run_seconds"]
        assert seed["builds"][name]["generated_tokens"] == report["generated_tokens"]
    assert "equal reward at K*" in capsys.readouterr().out
    # A rerun reuses the finished builds; --replay recomputes the same figures from the records.
    assert main(argv) == 0
    again = json.loads((tmp_path / "eq.json").read_text())
    assert again["per_seed"] == figures["per_seed"] and again["summary"] == figures["summary"]
    assert main(["--replay", str(tmp_path / "eq.json"), "--json", str(tmp_path / "replay.json")]) == 0
    replay = json.loads((tmp_path / "replay.json").read_text())
    assert replay["summary"] == figures["summary"] and replay["per_seed"] == figures["per_seed"]
    with pytest.raises(SystemExit) as stop:
        main(["--replay", str(tmp_path / "missing.json")])
    assert stop.value.code == 2
    # An unfinished build is read, not run, with --allow-partial: its committed shards' prompts only.
    (out / "seed-7" / "best_of_3" / "_SUCCESS").unlink()
    capsys.readouterr()
    assert main([*argv, "--allow-partial"]) == 0
    assert "best_of_3, seed 7: unfinished" in capsys.readouterr().out
    partial = json.loads((tmp_path / "eq.json").read_text())
    assert partial["per_seed"][0]["builds"]["best_of_3"] == {"unfinished": True, "pairs": len(bon)}
    assert partial["records"] == figures["records"]
