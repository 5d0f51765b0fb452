"""Speculative rejection against Best-of-K at equal reward, live through the build job, on seeds no
collection used (issue 62, item 3): the check that the replay's frontier can fail.

    python -m benchmarks.equal_reward [--config configs/real.yaml] [--reward DIR]
        [--prompts configs/prompts/ifeval-eval.jsonl] [--skip 0] [--num-prompts 16]
        [--seeds 101 102] [--sizes 24 32] [--set KEY=VALUE ...] [--sbon-set KEY=VALUE ...]
        [--output out/bench/equal-reward] [--json FILE]

For each seed: Best-of-K through ``jobs.build_dataset`` at each K of ``--sizes``, then speculative
rejection (sbon) at the point ``--sbon-set`` names (e.g. N 64, decision tokens 16, 32 and 64, alpha
0.5), all on the same prompts (rows ``--skip`` .. ``--skip + --num-prompts`` of ``--prompts``) with
``seed`` set to the seed. Every build's row seeds derive from (seed, prompt, sample index)
(pipeline.decoding.sampling.row_seed), so Best-of-K's candidates are the first K of Best-of-K+1's.
Per seed, over the prompts every build paired:

- each build's mean chosen reward, run time (``_report.json``'s run_seconds: first batch to last
  shard, startup left out) and generated tokens;
- K*, where Best-of-K's mean chosen reward reaches sbon's: linear in K between the two sizes that
  bracket it (``match``); outside the sizes no K* is claimed ("below" or "above" them; above, the
  largest K's cost over sbon's is a lower bound on the ratios);
- Best-of-K*'s run time and tokens, linear in K between the same two builds, and sbon's ratios:
  Best-of-K* / sbon.
Over the seeds: each seed's ratios, their mean and their range (the spread). The prompts used are
written to OUTPUT/prompts.jsonl; the builds' outputs stay
under OUTPUT/seed-S/NAME, each with its run report and command line (NAME.run.json); a rerun with
the same command line reuses a finished build and its report.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from benchmarks import bench_parser, fail, job_argv, parse, read_prompts, run_job, write_json, write_prompts


def parse_args(argv: list[str] | None):
    parser = bench_parser("benchmarks.equal_reward", __doc__, config="configs/real.yaml",
                          reward=dict(help="models.reward: a model directory or module:function (default: the "
                                           "config's)"),
                          prompts=dict(default="configs/prompts/ifeval-eval.jsonl", help="JSONL prompts"),
                          num_prompts=16, set=dict(default=[], help="passed to every build"),
                          output="out/bench/equal-reward", json=None)
    parser.add_argument("--skip", type=int, default=0, help="prompt rows to skip before the first one used")
    parser.add_argument("--seeds", type=int, nargs="+", default=[101, 102], help="the builds' seeds, one run each")
    parser.add_argument("--sizes", type=int, nargs="+", default=[24, 32], help="Best-of-K's K, at least two")
    parser.add_argument("--sbon-set", dest="sbon_sets", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to the sbon build only (its point: N, decision tokens, alpha)")
    args = parse(parser, argv)
    if len(set(args.sizes)) < 2 or min(args.sizes) < 1:
        fail(f"--sizes: at least two distinct K >= 1, got {args.sizes}")
    args.sizes = sorted(set(args.sizes))
    return args


def match(sizes: list[int], rewards: list[float], target: float) -> tuple[float | None, str]:
    """K where Best-of-K's mean chosen reward (``rewards`` at ``sizes``, ascending K) reaches
    ``target``: linear between the first two adjacent sizes whose rewards bracket it. (None,
    "below"/"above") where no pair brackets it: target under every reward, or over every one."""
    for (k0, r0), (k1, r1) in zip(zip(sizes, rewards), zip(sizes[1:], rewards[1:])):
        if min(r0, r1) <= target <= max(r0, r1):
            return (float(k0) if r1 == r0 else k0 + (target - r0) / (r1 - r0) * (k1 - k0)), "within"
    return None, "below" if target < min(rewards) else "above"


def at(sizes: list[int], values: list[float], k: float) -> float:
    """``values`` (at ``sizes``) at K ``k``, linear between the two sizes around it."""
    for k0, k1, v0, v1 in zip(sizes, sizes[1:], values, values[1:]):
        if k0 <= k <= k1:
            return v0 + (k - k0) / (k1 - k0) * (v1 - v0)
    raise ValueError(f"K {k} outside {sizes}")


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


def one_seed(args, seed: int, prompts: Path) -> dict:
    """Best-of-K at each size and sbon on ``prompts`` with ``seed``: their reports, rewards and sbon's ratios."""
    from benchmarks.real_sbon import read_pairs

    shared = [f"seed={seed}", *([f"models.reward={args.reward}", "models.reward_weights=null"] if args.reward else []),
              *args.overrides]
    builds = {}
    for name, strategy, sets in ([(f"best_of_{k}", "best_of_n", [f"sampling.num_samples={k}"]) for k in args.sizes]
                                 + [("sbon", "sbon", args.sbon_sets)]):
        output = Path(args.output) / f"seed-{seed}" / name
        argv = job_argv(args.config, strategy, prompts, output, shared + sets, overwrite=False)
        builds[name] = {"report": kept_build(name, seed, argv, output), "pairs": read_pairs(output)}
    common = sorted(set.intersection(*(set(b["pairs"]) for b in builds.values())))
    if not common:
        fail(f"seed {seed}: no prompt paired in every build")
    figures = {}
    for name, b in builds.items():
        figures[name] = {"mean_chosen_reward": sum(b["pairs"][p]["chosen_score"] for p in common) / len(common),
                         "run_seconds": b["report"]["run_seconds"], "generated_tokens": b["report"]["generated_tokens"],
                         "pairs": len(b["pairs"])}
    bon = [figures[f"best_of_{k}"] for k in args.sizes]
    k_star, where = match(args.sizes, [b["mean_chosen_reward"] for b in bon], figures["sbon"]["mean_chosen_reward"])
    result = {"seed": seed, "compared_prompts": len(common), "builds": figures, "k_star": k_star, "k_star_is": where}
    if k_star is not None:
        for key in ("run_seconds", "generated_tokens"):
            equal = at(args.sizes, [b[key] for b in bon], k_star)
            result[f"best_of_k_star_{key}"] = equal
            result[f"{key}_ratio"] = equal / figures["sbon"][key]
    elif where == "above":  # Best-of-K at sbon's reward costs more than the largest K: a lower bound
        for key in ("run_seconds", "generated_tokens"):
            result[f"{key}_ratio_at_least"] = bon[-1][key] / figures["sbon"][key]
    return result


def summary(seeds: list[dict]) -> dict:
    """Each ratio over the seeds that reached a K*: mean, min and max; and how many did not."""
    out = {"seeds": len(seeds), "seeds_without_k_star": [s["seed"] for s in seeds if s["k_star"] is None]}
    for key in ("run_seconds_ratio", "generated_tokens_ratio", "k_star"):
        values = [s[key] for s in seeds if s.get(key) is not None]
        out[key] = ({"mean": sum(values) / len(values), "min": min(values), "max": max(values), "values": values}
                    if values else None)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = read_prompts(args.prompts, args.skip + args.num_prompts, exactly=True)[args.skip:]
    results = []
    Path(args.output).mkdir(parents=True, exist_ok=True)
    prompts = write_prompts(rows, Path(args.output) / "prompts.jsonl")
    for seed in args.seeds:
        results.append(one_seed(args, seed, prompts))
        r = results[-1]
        for name, b in r["builds"].items():
            print(f"seed {seed} {name:<12} mean chosen reward {b['mean_chosen_reward']:.4f}, run "
                  f"{b['run_seconds']:.1f}s, {b['generated_tokens']} tokens, {b['pairs']} pairs", flush=True)
        if r["k_star"] is None:
            print(f"seed {seed}: sbon's reward is {r['k_star_is']} every Best-of-K's: no K* within {args.sizes}"
                  + (f"; against Best-of-{args.sizes[-1]}, at least {r['run_seconds_ratio_at_least']:.2f}x run time, "
                     f"{r['generated_tokens_ratio_at_least']:.2f}x generated tokens" if r["k_star_is"] == "above" else ""))
        else:
            print(f"seed {seed}: equal reward at K* {r['k_star']:.1f}: Best-of-K* / sbon run time "
                  f"{r['run_seconds_ratio']:.2f}x, generated tokens {r['generated_tokens_ratio']:.2f}x", flush=True)
    total = summary(results)
    for key, name in (("run_seconds_ratio", "run time"), ("generated_tokens_ratio", "generated tokens"),
                      ("k_star", "K*")):
        s = total[key]
        if s:
            print(f"{name}: mean {s['mean']:.2f} over {len(s['values'])} seeds, range [{s['min']:.2f}, {s['max']:.2f}]")
    if total["seeds_without_k_star"]:
        print(f"no K* within {args.sizes} for seeds {total['seeds_without_k_star']}")
    write_json(args.json, {"prompts_file": args.prompts, "skip": args.skip, "prompts": len(rows), "sizes": args.sizes,
                           "sbon_sets": args.sbon_sets, "overrides": args.overrides, "reward": args.reward,
                           "per_seed": results, "summary": total}, args)
    return 0 if all(math.isfinite(r["builds"]["sbon"]["mean_chosen_reward"]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
