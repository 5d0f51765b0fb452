"""The equal-compute frontier of speculative rejection against Best-of-K, replayed on collected
completions (issue 49): the paper's own comparison (reward reached against compute spent), and beside
it the same-N one, whose saving one cut at tau caps near L / (tau + (1 - alpha)(L - tau)).

    python -m benchmarks.frontier --counterfactual DIR/counterfactual.json [DIR2/counterfactual.json ...] [--sizes 8,16,32] \
        [--taus 16,32,64,16+64] [--alphas 0.5,0.75,0.9] [--level instruction] [--weights 0,1] [--json OUT.json] [--plot OUT.png]
        [--more-samples DIR3/counterfactual.json [DIR4/counterfactual.json ...]] [--held-out-splits 300]

The input is jobs.counterfactual's JSON (``bon-counterfactual ... --output DIR``): per prompt, N_max
completions with their lengths, the combined reward at each decision token and at the end, and the
judge's verdicts (IFEval strict, per instruction). Nothing is sampled here; every point is replayed on
those same completions (--weights: under another combination of the collection's rewards, e.g. the
reward model alone, whose choices IFEval judges without circularity when the other reward is IFEval's
own checker; --more-samples: collections of the same prompts under another --seed, pooled per prompt, so
N_max 64 costs a second N-32 collection, not a new one):

- Best-of-K for K = 1..N_max, as an exact expectation over the K-subsets: the completion ranked r-th
  by final reward (ties: the lower index, as pair selection breaks them) is Best-of-K's choice in
  C(N - 1 - r, K - 1) of the C(N, K) subsets.
- Speculative rejection at every (N, tau, alpha): Algorithm 1 replayed by
  pipeline.decoding.metrics (accepted_in_turn, chosen), exactly at N = N_max and averaged over
  --subsets random N-subsets below it. A tau of A+B is decision tokens A then B in turn, as a list
  in strategy.decision_token decides: each rejects alpha of the rows still in play.
- Compute per prompt: generator tokens (a stopped row costs min(length, tau), a kept one its
  length) plus the reward model's tokens read (a streaming session reads each generated token
  once; Best-of-K reads its K responses once), weighted by --generator-cost and --reward-cost
  (seconds per token, measured on your models; the defaults count tokens). Prompt tokens are not in
  the counterfactual's data and are left out of both sides.
- Quality: the judge's prompt- and instruction-level accuracy of the chosen completion, and the
  mean final reward.
- For each sbon point: the compute ratio at equal quality, Best-of-K's compute interpolated at
  sbon's quality (--level) over sbon's compute, with a percentile bootstrap interval over prompts
  (--bootstrap resamples). Where sbon's quality is above Best-of-N_max's, the ratio is a lower
  bound (``above_curve``).
- For each sbon point, the same-N comparison as well (``bon-build``'s, and issue 49's "same N" target):
  its normalized score (Eq. 5: 100 for Best-of-N's choice among the same N candidates, 0 for their
  worst; prompts whose N rewards all tie left out) and Best-of-N's compute over its own
  (``same_n_ratio``).
- The headline: the point with the largest ratio. Its bootstrap interval is for that point fixed, and
  ignores that it was the best of the grid on the same prompts it is scored on. --held-out-splits K
  (issue 62) measures the choice instead: K times, the prompts are split at random into two halves
  (the splits drawn from --seed), the point with the largest ratio on the first half is chosen (the
  Best-of-K curve also from that half alone) and its ratio is taken on the other half; the median and
  the 2.5-97.5% range over the splits are printed and written (``held_out``) beside the headline.

Prints the curve and the points; --json writes them, --plot draws quality against compute (the
Best-of-K curve and the sbon points; its title carries the headline and, with --held-out-splits, the
held-out figure). Bad input prints one line and exits with code 2.
"""

from __future__ import annotations

import gzip
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks import bench_parser, fail, parse, write_json, write_png
from pipeline.decoding.metrics import PromptRewards, accepted_in_turn, chosen, normalized_score, subset


@dataclass
class Prompt:
    """One prompt's collected completions: rewards, lengths, the judge's verdicts."""

    rewards: PromptRewards
    judged: list[list[bool]]


@dataclass
class Point:
    """Per-prompt expectations of one method: generator and reward tokens, judged prompt-level
    (all instructions followed), instructions followed, and the chosen completion's final reward."""

    generator: np.ndarray
    reward: np.ndarray
    prompt_level: np.ndarray
    followed: np.ndarray
    final: np.ndarray
    score: np.ndarray | None = None
    """sbon only: the normalized score (Eq. 5) against Best-of-N of the same N candidates; NaN where they tie."""


def read(path: str) -> dict:
    """A counterfactual JSON's data (gzip-compressed where the name ends in .gz, as the committed
    collections under benchmarks/results/counterfactual-heldout are); one line and exit 2 when it
    cannot be read."""
    try:
        raw = Path(path).read_bytes()
        data = json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw)
        if not isinstance(data.get("completions"), list):
            raise KeyError("completions")
        return data
    except (OSError, EOFError, ValueError, KeyError, AttributeError) as exc:
        fail(f"{path}: not a counterfactual JSON with completions ({type(exc).__name__}: {exc})")


def load(path: str, data: dict, weights: list[float] | None = None) -> tuple[list[Prompt], dict]:
    """The prompts of ``data`` (the counterfactual JSON at ``path``, pooled with any --more-samples: ``pool``)
    that the judge saw; one line and exit 2 otherwise. ``weights``: one per reward of the collection, its
    rewards combined anew as a build combines them (jobs.counterfactual.Collected.rewards); None: the
    collection's own combination."""
    try:
        specs = data["reward"] if isinstance(data.get("reward"), list) else [data.get("reward")]
        if weights is not None and len(weights) != len(specs):
            fail(f"{path}: --weights has {len(weights)} weights for its {len(specs)} rewards ({', '.join(map(str, specs))})")
        prompts = [Prompt(_rewards(c, specs, weights), c["judged"]) for c in data["completions"] if c.get("judged")]
    except (ValueError, KeyError, TypeError) as exc:
        fail(f"{path}: not a counterfactual JSON with completions ({type(exc).__name__}: {exc})")
    if not prompts:
        fail(f"{path}: no prompt has the judge's verdicts (the prompts need IFEval's columns)")
    return prompts, data


SAME = ("generator", "reward", "reward_weights", "taus", "max_new_tokens", "num_samples")
"""What the collections replayed together must share."""


def load_all(paths: list[str], weights: list[float] | None = None,
             more: list[list[str]] | None = None) -> tuple[list[Prompt], dict]:
    """``load`` of each path, the prompts concatenated; the first's settings, which the others must share
    (SAME; one line and exit 2 otherwise). ``more``: lists of collections of the same prompts under other
    seeds, one per path in order, whose completions are pooled into that path's prompts (``pool``)."""
    if more and any(len(m) != len(paths) for m in more):
        fail(f"--more-samples: {' / '.join(str(len(m)) for m in more)} paths for {len(paths)} --counterfactual paths "
             "(one per --counterfactual, in order)")
    groups = [[path, *extra] for path, *extra in zip(paths, *(more or []))]
    prompts, first = load(paths[0], pool(groups[0]), weights)
    for group in groups[1:]:
        more_prompts, data = load(group[0], pool(group), weights)
        differ = [key for key in SAME if data.get(key) != first.get(key)]
        if differ:
            fail(f"{group[0]}: not collected as {paths[0]} was ({', '.join(differ)} differ)")
        prompts += more_prompts
    return prompts, first


def pool(paths: list[str]) -> dict:
    """One collection of ``paths``, collections of the same prompts (in the same order) under different
    seeds: each prompt's completions are the first's followed by the others', so N_max is their sum.
    They must share SAME but num_samples, each prompt's id where both record one, and each prompt's
    instruction count; the seeds must differ (the same seed draws the same completions again). One line
    and exit 2 otherwise."""
    data = read(paths[0])
    for path in paths[1:]:
        other = read(path)
        differ = [key for key in SAME if key != "num_samples" and other.get(key) != data.get(key)]
        if len(other["completions"]) != len(data["completions"]):
            differ.append(f"prompts ({len(other['completions'])} against {len(data['completions'])})")
        for i, (mine, theirs) in enumerate(zip(data["completions"], other["completions"])):
            if set(mine) - {"prompt_id"} != set(theirs) - {"prompt_id"}:
                differ.append(f"prompt {i}'s fields")
            elif "prompt_id" in mine and "prompt_id" in theirs and mine["prompt_id"] != theirs["prompt_id"]:
                differ.append(f"prompt {i}'s id")
            elif {len(j) for j in mine.get("judged") or [[]]} != {len(j) for j in theirs.get("judged") or [[]]}:
                differ.append(f"prompt {i}'s instructions")
        if differ:
            fail(f"{path}: not the same prompts and settings as {paths[0]} ({', '.join(differ[:3])} differ)")
        seeds = data.get("seeds", [data.get("seed")])
        if other.get("seed") in seeds:
            fail(f"{path}: collected with seed {other.get('seed')}, as {paths[0]} was: the same completions again")
        data = {**data, "seeds": [*seeds, other.get("seed")],
                "num_samples": data.get("num_samples", 0) + other.get("num_samples", 0),
                "completions": [_pooled(a, b) for a, b in zip(data["completions"], other["completions"])]}
    return data


def _pooled(first: dict, second: dict) -> dict:
    """One prompt's completions of two collections, the first's then the second's (every per-completion list)."""
    def join(a, b):
        return {k: join(a[k], b[k]) for k in a} if isinstance(a, dict) else (a or []) + (b or [])
    pooled = {key: join(value, second[key]) for key, value in first.items() if key != "prompt_id"}
    prompt = first.get("prompt_id", second.get("prompt_id"))
    return pooled if prompt is None else {"prompt_id": prompt, **pooled}


def _rewards(completions: dict, specs: list, weights: list[float] | None) -> PromptRewards:
    """One prompt's rewards: as collected (``weights`` None), or each reward's own values combined by ``weights``."""
    if weights is None:
        return PromptRewards(completions["lengths"], completions["final"],
                             {int(t): v for t, v in completions["partial"].items()})
    from jobs.counterfactual import Collected

    per = [completions["rewards"][spec] for spec in specs]
    taus = [int(t) for t in per[0]["partial"]]
    return Collected(lengths=completions["lengths"], final=[r["final"] for r in per],
                     partial={t: [r["partial"][str(t)] for r in per] for t in taus},
                     ended={t: completions["ended"][str(t)] for t in taus}).rewards(weights)


def _order(rewards: PromptRewards) -> list[int]:
    """Completions best first, as ``chosen`` picks them (finite final rewards first, ties: lower index)."""
    return sorted(range(len(rewards.final)),
                  key=lambda k: (not math.isfinite(rewards.final[k]), -rewards.final[k] if math.isfinite(
                      rewards.final[k]) else 0.0, k))


def best_of_k(prompts: list[Prompt], k: int) -> Point:
    """Best-of-K's exact expectation over the K-subsets of each prompt's completions."""
    rows = []
    for p in prompts:
        n, order = len(p.rewards.final), _order(p.rewards)
        weights = [math.comb(n - 1 - r, k - 1) / math.comb(n, k) for r in range(n)]
        tokens = k * sum(p.rewards.lengths) / n
        pick = list(zip(weights, order))
        rows.append((tokens, tokens, sum(w * all(p.judged[c]) for w, c in pick),
                     sum(w * sum(p.judged[c]) for w, c in pick),
                     sum(w * p.rewards.final[c] for w, c in pick if math.isfinite(p.rewards.final[c]))))
    return Point(*map(np.array, zip(*rows)))


def sbon(prompts: list[Prompt], n: int, tau: int | tuple[int, ...], alpha: float, subsets: int, seed: int,
         keep_lowest: bool = True) -> Point:
    """Algorithm 1 at (tau, alpha) on N-subsets of each prompt's completions (all of them at N_max),
    averaged: per prompt, the tokens spent and the judged quality of its choice. ``tau`` a tuple:
    decision tokens in turn, each rejecting ``alpha`` of the candidates still in play
    (pipeline.decoding.metrics.accepted_in_turn)."""
    taus = _in_turn(tau)
    rows = []
    for i, p in enumerate(prompts):
        total = len(p.rewards.final)
        draws = [list(range(total))] if n >= total else \
            [sorted(random.Random(seed * 1_000_003 + i * 7919 + s).sample(range(total), n)) for s in range(subsets)]
        sums, scores = np.zeros(4), []
        for keep in draws:
            sub = subset(p.rewards, keep)
            kept, stopped = accepted_in_turn(sub, taus, alpha, keep_lowest)
            pick = chosen(sub, kept)
            judged = p.judged[keep[pick]] if pick is not None else [False] * len(p.judged[0])
            tokens = sum(min(length, stopped.get(j, length)) for j, length in enumerate(sub.lengths))
            sums += (tokens, all(judged), sum(judged), sub.final[pick] if pick is not None else 0.0)
            scores.append(normalized_score(sub.final, sub.final[pick] if pick is not None else -math.inf))
        tokens, level, followed, final = sums / len(draws)
        finite = [v for v in scores if math.isfinite(v)]
        score = sum(finite) / len(finite) if finite else math.nan
        rows.append((tokens, tokens, level, followed, final, score))  # streaming: the reward reads each token once
    return Point(*map(np.array, zip(*rows)))


def aggregate(point: Point, instructions: np.ndarray, costs: tuple[float, float], index=None) -> dict:
    """Means over prompts (``index``: a bootstrap resample of them): compute per prompt, quality."""
    index = np.arange(len(point.generator)) if index is None else index
    generator, reward = point.generator[index].mean(), point.reward[index].mean()
    scored = point.score[index] if point.score is not None else np.array([])
    scored = scored[np.isfinite(scored)]
    return {"generator_tokens": float(generator), "reward_tokens": float(reward),
            "compute": float(costs[0] * generator + costs[1] * reward),
            "prompt_level": float(point.prompt_level[index].mean()),
            "instruction_level": float(point.followed[index].sum() / instructions[index].sum()),
            "final_reward": float(point.final[index].mean()),
            **({"normalized_score": float(scored.mean()) if len(scored) else math.nan} if point.score is not None else {})}


def equal_quality_compute(curve: list[dict], quality: float, level: str) -> tuple[float, bool]:
    """Best-of-K's compute interpolated at ``quality`` along the curve (K ascending): the first
    segment that reaches it. (compute, False), or (the curve's last compute, True) when no K reaches it."""
    previous = None
    for point in curve:
        if point[level] >= quality:
            if previous is None or point[level] == previous[level]:
                return point["compute"], False
            share = (quality - previous[level]) / (point[level] - previous[level])
            return previous["compute"] + share * (point["compute"] - previous["compute"]), False
        previous = point
    return curve[-1]["compute"], True


def ratio(curve_points: list[Point], point: Point, instructions, costs, level: str, index=None) -> tuple[float, bool]:
    curve = [aggregate(p, instructions, costs, index) for p in curve_points]
    return _ratio_on(curve, point, instructions, costs, level, index)


def _ratio_on(curve: list[dict], point: Point, instructions, costs, level: str, index=None) -> tuple[float, bool]:
    """``ratio`` against a curve already aggregated over the same ``index``."""
    at = aggregate(point, instructions, costs, index)
    compute, above = equal_quality_compute(curve, at[level], level)
    return compute / at["compute"], above


def held_out(curve_points: list[Point], points: list[Point], instructions: np.ndarray, costs: tuple[float, float],
             level: str, splits: int, seed: int) -> dict:
    """Held-out selection (issue 62): ``splits`` times, the prompts in two random halves, the first
    (half of them, rounded down) to choose the point on, the other to measure it on (``choose_on``).
    Returns the held-out ratios' median and 2.5-97.5% range over splits, the chosen points' ratios
    on their own half (the median: what selection adds), how often each point was chosen (by index
    into ``points``), and how many held-out ratios are lower bounds (the point above the whole curve)."""
    rng = np.random.default_rng([seed, 62])  # apart from the bootstrap's draws, so those stay as they were
    prompts = len(instructions)
    own, held, above, chosen = [], [], 0, {}
    for _ in range(splits):
        order = rng.permutation(prompts)
        best, in_sample, value, is_above = choose_on(curve_points, points, instructions, costs, level,
                                                     np.sort(order[: prompts // 2]), np.sort(order[prompts // 2:]))
        own.append(in_sample)
        held.append(value)
        above += is_above
        chosen[best] = chosen.get(best, 0) + 1
    low, median, high = _spread(held)
    return {"splits": splits, "select_prompts": prompts // 2, "measure_prompts": prompts - prompts // 2,
            "ratio_median": median, "ratio_low": low, "ratio_high": high,
            "in_sample_median": _spread(own)[1], "above_curve_splits": above,
            "chosen": dict(sorted(chosen.items(), key=lambda item: -item[1])), "ratios": held}


def choose_on(curve_points: list[Point], points: list[Point], instructions: np.ndarray, costs: tuple[float, float],
              level: str, select: np.ndarray, measure: np.ndarray) -> tuple[int, float, float, bool]:
    """One split: the index of the point of ``points`` with the largest equal-quality ratio on the
    prompts ``select`` (as the headline is chosen; ties: the first in grid order), its ratio there, and
    its ratio on the prompts ``measure`` with whether that is a lower bound; each ratio is against
    Best-of-K's curve over the same prompts alone."""
    curve = [aggregate(p, instructions, costs, select) for p in curve_points]
    in_sample = [_ratio_on(curve, p, instructions, costs, level, select)[0] for p in points]
    best = int(np.argmax(in_sample))
    curve = [aggregate(p, instructions, costs, measure) for p in curve_points]
    return (best, in_sample[best], *_ratio_on(curve, points[best], instructions, costs, level, measure))


def _spread(values: list[float]) -> tuple[float, float, float]:
    """The 2.5% percentile, the median and the 97.5% percentile of ``values`` (the bootstrap's
    convention for the ends); NaN for none."""
    if not values:
        return math.nan, math.nan, math.nan
    ordered = sorted(values)
    return ordered[int(0.025 * len(ordered))], float(np.median(ordered)), ordered[int(0.975 * len(ordered)) - 1]


def frontier(prompts: list[Prompt], sizes: list[int], taus: list[int], alphas: list[float], level: str,
             costs: tuple[float, float], subsets: int, resamples: int, seed: int, splits: int = 0) -> dict:
    """The Best-of-K curve and every sbon point with its equal-quality compute ratio and interval;
    ``splits`` above 0: the held-out selection of the best point as well (``held_out``)."""
    n_max = min(len(p.rewards.final) for p in prompts)
    instructions = np.array([len(p.judged[0]) for p in prompts], dtype=float)
    curve_points = [best_of_k(prompts, k) for k in range(1, n_max + 1)]
    rng = np.random.default_rng(seed)
    samples = [rng.integers(0, len(prompts), len(prompts)) for _ in range(resamples)]
    points, replayed = [], []
    for n in (s for s in sizes if s <= n_max):
        for tau in taus:
            for alpha in alphas:
                point = sbon(prompts, n, tau, alpha, subsets, seed)
                value, above = ratio(curve_points, point, instructions, costs, level)
                spread = sorted(ratio(curve_points, point, instructions, costs, level, s)[0] for s in samples)
                low, high = (spread[int(0.025 * len(spread))], spread[int(0.975 * len(spread)) - 1]) if spread \
                    else (math.nan, math.nan)
                at = aggregate(point, instructions, costs)
                same_n = aggregate(curve_points[n - 1], instructions, costs)["compute"] / at["compute"]
                points.append({"n": n, "tau": list(tau) if isinstance(tau, tuple) else tau, "alpha": alpha, **at,
                               "ratio": value, "ratio_low": low, "ratio_high": high, "above_curve": above,
                               "same_n_ratio": same_n})
                replayed.append(point)
    result = {"prompts": len(prompts), "n_max": n_max, "level": level, "costs_per_token": list(costs),
              "best_of_k": [{"k": k, **aggregate(p, instructions, costs)} for k, p in enumerate(curve_points, 1)],
              "sbon": points}
    if splits > 0 and points:
        held = held_out(curve_points, replayed, instructions, costs, level, splits, seed)
        top = points[int(np.argmax([p["ratio"] for p in points]))]  # the headline: ties to the first, as held_out
        held["chosen"] = [{**_grid_point(points[i]), "splits": count} for i, count in held["chosen"].items()]
        result["held_out"] = {"headline": {**_grid_point(top), "ratio": top["ratio"], "ratio_low": top["ratio_low"],
                                           "ratio_high": top["ratio_high"]}, **held}
    return result


def _grid_point(point: dict) -> dict:
    """A point's place in the grid: N, tau, alpha."""
    return {"n": point["n"], "tau": point["tau"], "alpha": point["alpha"]}


def draw(result: dict, level: str):
    def figure(plt):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        curve = result["best_of_k"]
        ax.plot([c["compute"] for c in curve], [c[level] for c in curve], "-o", ms=3, label="Best-of-K, K = 1..N")
        best = sorted(result["sbon"], key=lambda p: -p["ratio"])[:5]  # labelled: the five best ratios
        ax.scatter([p["compute"] for p in result["sbon"]], [p[level] for p in result["sbon"]], s=18, marker="^",
                   color="tab:red", label="speculative rejection (N, tau, alpha)")
        for p in best:
            ax.annotate(f"N{p['n']} tau{_tau(p['tau'])} a{p['alpha']}: {p['ratio']:.2f}x", (p["compute"], p[level]),
                        fontsize=7, xytext=(4, -10), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("compute per prompt (generator + reward tokens, cost-weighted)")
        ax.set_ylabel("the chosen completion's final reward" if level == "final_reward"
                      else f"IFEval {level.replace('_', '-')} (strict)")
        ax.set_title(f"Equal-compute frontier, {result['prompts']} prompts" + _title_figures(result), fontsize=9)
        ax.legend(loc="lower right")
        return fig
    return figure


def _title_figures(result: dict) -> str:
    """With --held-out-splits: the headline's in-sample ratio with its fixed-point interval, and the
    held-out figure beside it (the PNG carries both)."""
    held = result.get("held_out")
    if not held:
        return ""
    top = held["headline"]
    return (f"\nbest of {len(result['sbon'])} points, chosen and scored on all: N{top['n']} tau{_tau(top['tau'])} "
            f"a{top['alpha']}: {top['ratio']:.2f}x [{top['ratio_low']:.2f}, {top['ratio_high']:.2f}] (fixed point)"
            f"\nheld out (chosen on {held['select_prompts']}, scored on the other {held['measure_prompts']}): "
            f"{held['ratio_median']:.2f}x [{held['ratio_low']:.2f}, {held['ratio_high']:.2f}] over {held['splits']} splits")


def _in_turn(tau: int | tuple[int, ...]) -> list[int]:
    """A point's decision tokens, in turn: [tau] for one."""
    return list(tau) if isinstance(tau, tuple) else [tau]


def _tau(tau: int | list[int]) -> str:
    """A point's decision token(s) as --taus writes them: 64, or 16+64 for decision tokens in turn."""
    return "+".join(map(str, tau)) if isinstance(tau, list) else str(tau)


def _taus(text: str) -> list[int | tuple[int, ...]]:
    """--taus: decision tokens, comma-separated; A+B is one point with decision tokens A then B."""
    try:
        out = [tuple(int(t) for t in item.split("+")) for item in text.split(",") if item.strip()]
    except ValueError:
        fail(f"--taus {text}: decision tokens are integers, comma-separated, A+B for several in turn")
    if any(list(t) != sorted(set(t)) for t in out):
        fail(f"--taus {text}: the decision tokens of one point increase (A+B with A < B)")
    return [t[0] if len(t) == 1 else t for t in out]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__name__, __doc__, json=None, plot=None, seed=0)
    parser.add_argument("--counterfactual", required=True, nargs="+",
                        help="jobs.counterfactual's counterfactual.json; several: their prompts replayed as one set "
                             "(collections of the same generator, rewards, taus and cap, e.g. a prompt file's two halves)")
    parser.add_argument("--sizes", default="", help="sbon's N values (default: N_max)")
    parser.add_argument("--taus", default="", help="decision tokens, comma-separated; A+B: one point with decision "
                             "tokens A then B, each rejecting alpha of the rows in play (default: the counterfactual's)")
    parser.add_argument("--alphas", default="", help="rejection rates (default: the counterfactual's)")
    parser.add_argument("--level", choices=["instruction_level", "prompt_level", "final_reward"],
                        default="instruction_level", help="the quality the ratio is taken at")
    parser.add_argument("--generator-cost", type=float, default=1.0, help="seconds (or units) per generated token")
    parser.add_argument("--reward-cost", type=float, default=1.0, help="seconds (or units) per reward token read")
    parser.add_argument("--subsets", type=int, default=200, help="random N-subsets per prompt below N_max")
    parser.add_argument("--bootstrap", type=int, default=1000, help="resamples of the prompts for the intervals")
    parser.add_argument("--weights", default="",
                        help="one weight per reward of the collection, W,W,...: its rewards combined anew (e.g. 0,1: "
                             "the second reward alone); default: the collection's --reward-weights")
    parser.add_argument("--held-out-splits", type=int, default=0, metavar="K",
                        help="held-out selection: K random halvings of the prompts, the best point (largest ratio) "
                             "chosen on one half and its ratio taken on the other; median and 2.5-97.5%% range over "
                             "the K splits, drawn from --seed (default 0: not run)")
    parser.add_argument("--more-samples", nargs="+", action="append", metavar="PATH",
                        help="counterfactual JSONs of the same prompts under another --seed, one per --counterfactual "
                             "in order: each prompt's completions pooled (N_max their sum); repeat for more")
    args = parse(parser, argv)
    if args.held_out_splits < 0:
        fail(f"--held-out-splits {args.held_out_splits}: a count of splits, 0 or more")
    prompts, data = load_all(args.counterfactual, _floats(args.weights) or None, args.more_samples)
    n_max = min(len(p.rewards.final) for p in prompts)
    taus = _taus(args.taus) or data.get("taus") or sorted(prompts[0].rewards.partial)
    needed = sorted({t for tau in taus for t in _in_turn(tau)})
    missing = [t for t in needed if any(t not in p.rewards.partial for p in prompts)]
    if missing:
        fail(f"{', '.join(args.counterfactual)}: no partial rewards at tau {missing} (it has {sorted(prompts[0].rewards.partial)})")
    result = frontier(prompts, [int(s) for s in _floats(args.sizes)] or [n_max], taus,
                      _floats(args.alphas) or data.get("alphas") or [0.75], args.level,
                      (args.generator_cost, args.reward_cost), args.subsets, args.bootstrap, args.seed,
                      args.held_out_splits)
    report(result, args.level)
    write_json(args.json, {"counterfactual": args.counterfactual, "more_samples": args.more_samples,
                           "reward_weights": _floats(args.weights) or data.get("reward_weights"), **result}, args)
    write_png(args.plot, draw(result, args.level))
    return 0


def report(result: dict, level: str) -> None:
    print(f"{result['prompts']} prompts, N_max {result['n_max']}; quality: {level}")
    print("Best-of-K:  K  compute  prompt  instruction")
    for c in result["best_of_k"]:
        print(f"          {c['k']:>3} {c['compute']:>8.0f}  {c['prompt_level']:.3f}   {c['instruction_level']:.3f}")
    print("sbon:  N      tau alpha  compute  prompt  instruction  ratio at equal quality [95%]   same N: score, ratio")
    for p in result["sbon"]:
        bound = ">=" if p["above_curve"] else "  "
        print(f"    {p['n']:>4} {_tau(p['tau']):>8} {p['alpha']:.3f} {p['compute']:>8.0f}  {p['prompt_level']:.3f}   "
              f"{p['instruction_level']:.3f}      {bound}{p['ratio']:.2f}x [{p['ratio_low']:.2f}, {p['ratio_high']:.2f}]"
              f"   {p['normalized_score']:6.2f}, {p['same_n_ratio']:.2f}x")
    held = result.get("held_out")
    if held:
        top = held["headline"]
        print(f"headline, the best of {len(result['sbon'])} points on all {result['prompts']} prompts: N {top['n']}, "
              f"tau {_tau(top['tau'])}, alpha {top['alpha']}: {top['ratio']:.2f}x [{top['ratio_low']:.2f}, "
              f"{top['ratio_high']:.2f}] (bootstrap of that point, fixed)")
        print(f"held out, the best point chosen on {held['select_prompts']} prompts and scored on the other "
              f"{held['measure_prompts']}: {held['ratio_median']:.2f}x [{held['ratio_low']:.2f}, {held['ratio_high']:.2f}] "
              f"(median [2.5%, 97.5%] over {held['splits']} splits; the chosen point's own half gave "
              f"{held['in_sample_median']:.2f}x; above the curve in {held['above_curve_splits']})")
        print("  chosen: " + ", ".join(f"N {c['n']} tau {_tau(c['tau'])} alpha {c['alpha']} ({c['splits']})"
                                       for c in held["chosen"][:5]))


if __name__ == "__main__":
    sys.exit(main())
