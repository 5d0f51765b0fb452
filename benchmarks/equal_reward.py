"""Speculative rejection against Best-of-K at equal reward, live through the build job, on seeds and
prompts that chose nothing: the check that the replayed frontier can fail.

    python -m benchmarks.equal_reward [--config configs/real.yaml] [--reward DIR]
        [--prompts configs/prompts/ifbench-test.jsonl] [--skip 0] [--num-prompts 96]
        [--seeds 301 302 303] [--k-max 32] [--set KEY=VALUE ...] [--sbon-set KEY=VALUE ...]
        [--bootstrap 2000] [--output out/bench/equal-reward] [--json FILE]
    python -m benchmarks.equal_reward --replay FILE [--json FILE]

For each seed, two builds through ``jobs.build_dataset`` on the same prompts (rows ``--skip`` ..
``--skip + --num-prompts`` of ``--prompts``) with ``seed`` set to the seed: speculative rejection
(sbon) at the point ``--sbon-set`` names (N, decision tokens, alpha: fixed before the run), and
Best-of-``--k-max`` with ``data.candidate_scores``, which lists every candidate's reward and tokens
by sample index. Every build's row seeds derive from (seed, prompt, sample index)
(pipeline.decoding.sampling.row_seed), so Best-of-K's candidates are the first K of Best-of-K_max's:
Best-of-K for every K up to K_max is read off that one build (tests/test_build.py checks this against
a Best-of-K build's own choice). Where a row's logits depend on the rows beside it in a step
(continuous batching), a candidate may differ slightly from a separate Best-of-K build's.

Each prompt paired in both builds of a seed is one record (committed with ``--json``): sbon's chosen
reward and generated tokens, Best-of-K_max's candidate rewards and tokens, and the prompt's tokens:
the generator's prefill (the pair's prompt_token_ids, read once per prompt) and what the reward model
reads of the prompt (pipeline.data.chat.reward_prompt_tokens, read once per prompt by a streaming
reward session, as benchmarks.frontier counts it). Compute per prompt, in tokens: the generator's
generated tokens plus its prefill, and the reward model's reads (each generated token once, and the
prompt's head once); a token of prefill counts as one decoded token, as frontier's defaults do.

Over the prompts (each prompt's mean over the seeds that paired it):

- Best-of-K's curve, K = 1 .. K_max: mean chosen reward (the best of the first K), generated tokens
  and compute;
- K*, where the curve reaches sbon's mean chosen reward (linear between the two K around it); above
  the curve no K* is claimed and Best-of-K_max's cost over sbon's is a lower bound on the ratios;
  below Best-of-1 it is an upper bound;
- sbon's ratios at equal reward: Best-of-K*'s generated tokens and compute over sbon's;
- at equal compute: Best-of-K's reward at sbon's compute (linear between K) less sbon's reward;
- for each, a percentile bootstrap interval over prompts (``--bootstrap`` resamples of the prompts,
  each with all its seeds), with the share of resamples whose K* is above the curve.
Each seed's point figures and each build's run time (``_report.json``'s run_seconds) are beside it.
Prompts either build left unpaired (a reject) are counted, not compared. The builds' outputs stay
under OUTPUT/seed-S/NAME with their reports (NAME.run.json, with the command line); a rerun with the
same command line reuses a finished build, so seeds can be added later. ``--replay FILE`` recomputes
every figure from a JSON's records, no model.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

from benchmarks import bench_parser, fail, job_argv, parse, read_prompts, run_job, write_json, write_prompts

LEVEL = 0.95
"""The intervals' coverage."""
BON_SHARD = 16
"""Prompts per output shard of the Best-of-K_max build."""


def parse_args(argv: list[str] | None):
    parser = bench_parser("benchmarks.equal_reward", __doc__, config="configs/real.yaml",
                          reward=dict(help="models.reward: a model directory or module:function (default: the "
                                           "config's)"),
                          prompts=dict(default="configs/prompts/ifbench-test.jsonl", help="JSONL prompts"),
                          num_prompts=96, set=dict(default=[], help="passed to every build"),
                          output="out/bench/equal-reward", json=None)
    parser.add_argument("--skip", type=int, default=0, help="prompt rows to skip before the first one used")
    parser.add_argument("--seeds", type=int, nargs="+", default=[301, 302, 303], help="the builds' seeds, two builds each")
    parser.add_argument("--k-max", type=int, default=32, help="Best-of-K's largest K: the Best-of-N build's N")
    parser.add_argument("--sbon-set", dest="sbon_sets", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to the sbon build only (its point: N, decision tokens, alpha)")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples of the prompts")
    parser.add_argument("--replay", metavar="FILE", help="recompute every figure from this JSON's records; no build")
    parser.add_argument("--allow-partial", action="store_true",
                        help="read an unfinished build's committed shards instead of running it (figures on the "
                             "prompts both builds have committed, said so)")
    args = parse(parser, argv)
    if args.k_max < 2:
        fail(f"--k-max: at least 2, got {args.k_max}")
    if args.bootstrap < 100:
        fail(f"--bootstrap: at least 100 resamples, got {args.bootstrap}")
    return args


# --- figures -----------------------------------------------------------------------------------


def records_arrays(records: list[dict], k_max: int) -> dict[str, np.ndarray]:
    """Per prompt (the mean over its seeds' records): Best-of-K's reward, generated tokens and compute
    at K = 1 .. k_max (columns), sbon's reward, tokens and compute, and the prompt's tokens."""
    by_prompt: dict[str, list[dict]] = {}
    for r in records:
        by_prompt.setdefault(r["prompt_id"], []).append(r)
    rows = []
    for pid in sorted(by_prompt):
        per_seed = []
        for r in by_prompt[pid]:
            finite = [s for s in r["candidate_scores"][:k_max] if s is not None and math.isfinite(s)]
            # a failed candidate (non-finite reward; never chosen) counts as the prompt's worst one
            scores = np.array([s if s is not None and math.isfinite(s) else min(finite)
                               for s in r["candidate_scores"][:k_max]], dtype=float)
            tokens = np.cumsum(np.array(r["candidate_tokens"][:k_max], dtype=float))
            prompt = r["prompt_tokens"] + r["reward_prompt_tokens"]
            per_seed.append((np.maximum.accumulate(scores), tokens, 2 * tokens + prompt, r["sbon_reward"],
                             r["sbon_tokens"], 2 * r["sbon_tokens"] + prompt, prompt))
        rows.append([np.mean(np.array(column), axis=0) for column in zip(*per_seed)])
    names = ("bon_reward", "bon_tokens", "bon_compute", "sbon_reward", "sbon_tokens", "sbon_compute", "prompt")
    return {name: np.array(column) for name, column in zip(names, zip(*rows))}


def crossing(curve: np.ndarray, target: float) -> tuple[float, str]:
    """K (1-based, fractional) where the ascending ``curve`` (at K = 1 ..) first reaches ``target``:
    linear between K-1 and K; (1, "below") under the curve's start, (K_max, "above") over its end."""
    if target <= curve[0]:
        return 1.0, "below" if target < curve[0] else "within"
    for k in range(1, len(curve)):
        if curve[k] >= target:
            share = (target - curve[k - 1]) / (curve[k] - curve[k - 1])
            return k + share, "within"
    return float(len(curve)), "above"


def at(curve: np.ndarray, k: float) -> float:
    """``curve`` (at K = 1 ..) at the fractional K ``k``, linear between integers."""
    lo = min(int(math.floor(k)), len(curve))
    if lo >= len(curve) or k == lo:
        return float(curve[lo - 1])
    return float(curve[lo - 1] + (k - lo) * (curve[lo] - curve[lo - 1]))


def figures(a: dict[str, np.ndarray], index: np.ndarray | None = None) -> dict:
    """The point figures over the prompts ``index`` (all without it)."""
    index = np.arange(len(a["sbon_reward"])) if index is None else index
    mean = {k: v[index].mean(axis=0) for k, v in a.items()}
    k_star, where = crossing(mean["bon_reward"], float(mean["sbon_reward"]))
    compute = mean["bon_compute"]
    # Best-of-K's reward at sbon's compute: the curves are linear between the same integers
    k_eq, compute_where = crossing(compute, float(mean["sbon_compute"]))
    return {"sbon_reward": float(mean["sbon_reward"]), "k_star": k_star, "k_star_is": where,
            "tokens_ratio": at(mean["bon_tokens"], k_star) / float(mean["sbon_tokens"]),
            "compute_ratio": at(compute, k_star) / float(mean["sbon_compute"]),
            "k_at_sbon_compute": k_eq, "k_at_sbon_compute_is": compute_where,
            "reward_gain_at_equal_compute": float(mean["sbon_reward"]) - at(mean["bon_reward"], k_eq)}


def summarize(records: list[dict], k_max: int, resamples: int, seed: int = 0) -> dict:
    """Every figure over the records' prompts: the curve, the point figures and their bootstrap intervals."""
    a = records_arrays(records, k_max)
    n = len(a["sbon_reward"])
    point = figures(a)
    rng = np.random.default_rng(seed)
    draws = [figures(a, rng.integers(0, n, n)) for _ in range(resamples)]
    lo, hi = 100 * (1 - LEVEL) / 2, 100 * (1 + LEVEL) / 2
    intervals = {key: [float(np.percentile([d[key] for d in draws], lo)), float(np.percentile([d[key] for d in draws], hi))]
                 for key in ("sbon_reward", "k_star", "tokens_ratio", "compute_ratio", "reward_gain_at_equal_compute")}
    curve = {"k": list(range(1, k_max + 1)), **{key: [float(v) for v in a[key].mean(axis=0)]
                                                 for key in ("bon_reward", "bon_tokens", "bon_compute")}}
    return {"prompts": n, "records": len(records), "curve": curve, **point,
            "sbon_tokens": float(a["sbon_tokens"].mean()), "sbon_compute": float(a["sbon_compute"].mean()),
            "prompt_tokens": float(a["prompt"].mean()), "intervals": intervals, "level": LEVEL,
            "resamples": resamples,
            "share_above": sum(d["k_star_is"] == "above" for d in draws) / resamples,
            "share_below": sum(d["k_star_is"] == "below" for d in draws) / resamples}


# --- builds ------------------------------------------------------------------------------------


def kept_build(name: str, seed: int, argv: list[str], output: Path) -> dict:
    """The build's run report: kept beside its output (NAME.run.json, with the command line that made
    it) and reused while the build finished with the same command line (a rerun's own report would
    time a build that did nothing); otherwise the build runs afresh."""
    from jobs.expert_iteration import finished

    kept = output.with_name(f"{output.name}.run.json")
    if kept.exists() and finished(output):
        record = json.loads(kept.read_text())
        if record["argv"] == argv:
            print(f"== {name}, seed {seed}: reused {output}", flush=True)
            return record["report"]
    report = run_job(f"{name}, seed {seed}", argv, output)
    kept.write_text(json.dumps({"argv": argv, "report": report}, indent=2) + "\n")
    return report


def reward_readers(args) -> list:
    """The tokenizers of the reward models the builds score with (a reward function reads none)."""
    from benchmarks.frontier import _tokenizer
    from pipeline.config import load_config
    from pipeline.engines.rewards import is_reward_function

    specs = [args.reward] if args.reward else load_config(args.config, args.overrides).models.rewards
    return [_tokenizer(spec) for spec in specs if spec and not is_reward_function(spec)]


def one_seed(args, seed: int, prompts: Path, readers: list) -> tuple[dict, list[dict]]:
    """sbon and Best-of-K_max on ``prompts`` with ``seed``: the builds' figures and one record per
    prompt both paired."""
    from benchmarks.real_sbon import read_pairs
    from jobs.expert_iteration import finished
    from pipeline.data.chat import reward_prompt_tokens

    shared = [f"seed={seed}", *([f"models.reward={args.reward}", "models.reward_weights=null"] if args.reward else []),
              *args.overrides]
    bon = f"best_of_{args.k_max}"
    builds = {}
    # Best-of-K_max, the longer build, commits every BON_SHARD prompts: a stopped run resumes with little lost
    for name, strategy, sets in (("sbon", "sbon", args.sbon_sets),
                                 (bon, "best_of_n", [f"sampling.num_samples={args.k_max}", "data.candidate_scores=true",
                                                     f"data.shard_size={BON_SHARD}"])):
        output = Path(args.output) / f"seed-{seed}" / name
        argv = job_argv(args.config, strategy, prompts, output, shared + sets, overwrite=False)
        if args.allow_partial and not finished(output):
            pairs = read_pairs(output, allow_partial=True)
            print(f"== {name}, seed {seed}: unfinished, {len(pairs)} pairs committed so far (--allow-partial)", flush=True)
            builds[name] = {"report": None, "pairs": pairs}
        else:
            builds[name] = {"report": kept_build(name, seed, argv, output), "pairs": read_pairs(output)}
    sbon, best = builds["sbon"]["pairs"], builds[bon]["pairs"]
    records = []
    for pid in sorted(set(sbon) & set(best), key=lambda p: best[p]["source_row"]):
        s, b = sbon[pid], best[pid]
        records.append({"seed": seed, "prompt_id": pid, "source_row": b["source_row"],
                        "prompt_tokens": len(b["prompt_token_ids"]),
                        "reward_prompt_tokens": sum(reward_prompt_tokens(t, b["raw_prompt"]) for t in readers),
                        "sbon_reward": s["chosen_score"], "sbon_tokens": s["generated_tokens"],
                        "sbon_stopped_early": s["stopped_early"],
                        "candidate_scores": b["candidate_scores"], "candidate_tokens": b["candidate_tokens"]})
    if not records:
        fail(f"seed {seed}: no prompt paired in both builds")
    result = {"seed": seed, "unpaired": {name: len(prompts_in(prompts)) - len(b["pairs"]) for name, b in builds.items()},
              "builds": {name: ({k: b["report"][k] for k in ("run_seconds", "generated_tokens", "pairs")}
                                if b["report"] else {"unfinished": True, "pairs": len(b["pairs"])})
                         for name, b in builds.items()}}
    return result, records


def prompts_in(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


def report(figures_: dict, per_seed: list[dict]) -> None:
    """The lines a reader needs: the point figures and their intervals."""
    f, iv = figures_, figures_["intervals"]
    level = f"{100 * f['level']:.0f}%"
    for s in per_seed:
        b = s["builds"]
        line = ", ".join(f"{name} unfinished, {v['pairs']} pairs committed" if v.get("unfinished") else
                         f"{name} {v['run_seconds']:.1f}s run, {v['generated_tokens']} tokens, {v['pairs']} pairs"
                         for name, v in b.items())
        print(f"seed {s['seed']}: {line}; K* {s['k_star']:.1f} ({s['k_star_is']}), tokens ratio "
              f"{s['tokens_ratio']:.2f}x, compute ratio {s['compute_ratio']:.2f}x")
    print(f"{f['prompts']} prompts, {f['records']} records; sbon's mean chosen reward {f['sbon_reward']:.4f}, "
          f"{f['sbon_tokens']:.0f} generated tokens and {f['sbon_compute']:.0f} compute per prompt "
          f"({f['prompt_tokens']:.0f} of it the prompt)")
    claim = {"within": "", "above": " (above Best-of-K_max: a lower bound)", "below": " (below Best-of-1: an upper bound)"}
    print(f"equal reward at K* {f['k_star']:.1f}{claim[f['k_star_is']]} [{iv['k_star'][0]:.1f}, {iv['k_star'][1]:.1f}]: "
          f"Best-of-K* / sbon generated tokens {f['tokens_ratio']:.2f}x [{iv['tokens_ratio'][0]:.2f}, "
          f"{iv['tokens_ratio'][1]:.2f}], compute {f['compute_ratio']:.2f}x [{iv['compute_ratio'][0]:.2f}, "
          f"{iv['compute_ratio'][1]:.2f}] ({level}, {f['resamples']} resamples of the prompts; K* above the curve "
          f"in {100 * f['share_above']:.1f}% of them)")
    print(f"at sbon's compute (Best-of-{f['k_at_sbon_compute']:.1f}): sbon's reward less Best-of-K's "
          f"{f['reward_gain_at_equal_compute']:+.4f} [{iv['reward_gain_at_equal_compute'][0]:+.4f}, "
          f"{iv['reward_gain_at_equal_compute'][1]:+.4f}]")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replay:
        try:
            kept = json.loads(Path(args.replay).read_text())
            records, per_seed_in, settings = kept["records"], kept["per_seed"], kept["settings"]
        except (OSError, ValueError, KeyError) as exc:
            fail(f"{args.replay}: not an equal_reward JSON with records ({exc})")
        k_max = settings["k_max"]
    else:
        rows = read_prompts(args.prompts, args.skip + args.num_prompts, exactly=True)[args.skip:]
        Path(args.output).mkdir(parents=True, exist_ok=True)
        prompts = write_prompts(rows, Path(args.output) / "prompts.jsonl")
        readers = reward_readers(args)
        k_max, records, per_seed_in = args.k_max, [], []
        for seed in args.seeds:
            result, found = one_seed(args, seed, prompts, readers)
            per_seed_in.append(result)
            records += found
        settings = {"prompts_file": args.prompts, "skip": args.skip, "prompts": len(rows), "k_max": k_max,
                    "sbon_sets": args.sbon_sets, "overrides": args.overrides, "reward": args.reward,
                    "seeds": args.seeds, "bootstrap": args.bootstrap}
    per_seed = [{**s, **figures(records_arrays([r for r in records if r["seed"] == s["seed"]], k_max))}
                for s in per_seed_in]
    total = summarize(records, k_max, settings["bootstrap"])
    report(total, per_seed)
    write_json(args.json, {"settings": settings, "summary": total, "per_seed": per_seed, "records": records}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
