"""Expert iteration's rounds judged: each round's policy on the held-out IFEval prompts and on
IFBench's judged subset, beside its length and the build's reward model's score of the same
responses.

    python -m benchmarks.ei_rounds --schedule OUT [--config configs/real.yaml]
        [--reward .cache/real-models/reward] [--eval-prompts configs/prompts/ifeval-eval.jsonl]
        [--eval-samples 8] [--eval-max-new-tokens 256] [--data benchmarks/results/ei-rounds]
        [--ifbench-prompts configs/prompts/ifbench-test.jsonl [--ifbench-samples 4]]
        [--resamples 10000] [--against DIR2] [--json FILE] [--plot FILE.png]
    python -m benchmarks.ei_rounds --replay [--data DIR] [--ifbench-prompts FILE] [--against DIR2] [--json FILE]
        [--plot FILE.png]

OUT is a ``bon-expert-iteration --dpo`` output (its progress.json names the current schedule). The
policies are the schedule's starting generator and the model after each finished round. Each one
writes ``--eval-samples`` responses per held-out prompt with the config's sampling and the same row
seeds (pipeline.decoding.sampling.row_seed, as benchmarks.dpo_loop), judged by IFEval's strict
checkers (pipeline.judge) and scored by ``--reward`` (pipeline.engines.rewards.RewardScorer). Every
policy's responses, verdicts and scores are kept in DATA/policy-K.json.gz (reused while the model,
the prompts and the settings are the same) and the schedule's record in DATA/schedule.json, so
``--replay`` recomputes every figure from DATA alone, with no model.

The figures, per policy: prompt- and instruction-level accuracy with a 95% bootstrap interval over
prompts, the same on the instructions a one-word reply fails (benchmarks.dpo_loop.beyond_brevity),
the mean response length in tokens, the reward model's mean score with its interval; per round, the
gain over the starting policy (paired bootstrap, pipeline.judge.accuracy_gain), on the IFEval prompts
also resampled by base task (``gain_over_start_by_base_task``: the 64 held-out prompts are 32 base
tasks, two prompts each, so resampling prompts gives too narrow an interval), the last round over
the first, and a flag where the reward model's mean score rises while the judge's prompt level falls
(over-optimization of the reward model).

The second judge, IFBench (pipeline.judge; prompts no one here wrote or chose:
jobs.make_ifbench_prompts): with ``--ifbench-prompts``, the same figures under ``ifbench`` in the
JSON, from ``--ifbench-samples`` responses per prompt (kept in DATA/policy-K-ifbench.json.gz), each
printed with the subset's size (e.g. "203 of 294 prompts"). ``--replay`` reports them where DATA
holds them for every policy, judged against ``--ifbench-prompts`` (default IFBENCH_PROMPTS).

Two arms (the loop beside its control): ``--against DIR2`` names another arm's DATA (the
same layout, e.g. benchmarks/results/ei-rounds-bon: the same rounds with Best-of-N pairs at the same
build compute, or another --training-seed). For each policy both arms hold (start, round 1, ...) and
each judge both judged it on (IFEval; IFBench where both hold policy-K-ifbench.json.gz): this arm's
prompt- and instruction-level accuracy minus DIR2's, with a paired bootstrap interval
(accuracy_gain, DIR2's responses as "before") that resamples base tasks on the IFEval prompts
(jobs.make_ifeval_prompts.base_task) and prompts on IFBench's; both arms' mean response length; and
both arms' build compute: the generated tokens of the build whose pairs trained the policy (round k
trains on round k-1's build, in each schedule.json) and of every build up to it. One line each,
under ``against`` in the JSON. Arms judged on other prompt files or sample counts (their settings'
prompts_sha256 and samples) are refused: one line, exit 2.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import sys
import time
from pathlib import Path

from benchmarks import bench_parser, fail, parse, write_json, write_png
from benchmarks.dpo_loop import brief_reply_passes, beyond_brevity, gains, judged_samples, print_gains

DATA = "benchmarks/results/ei-rounds"
IFBENCH_PROMPTS = "configs/prompts/ifbench-test.jsonl"


def parse_args(argv: list[str] | None):
    parser = bench_parser("benchmarks.ei_rounds", __doc__, config="configs/real.yaml",
                          reward=dict(default=".cache/real-models/reward",
                                      help="the reward model that scores every policy's responses (the build's)"),
                          set=dict(default=[], help="config overrides (sampling, seed, chat template)"),
                          json=None, plot=None)
    parser.add_argument("--schedule", help="a bon-expert-iteration --output directory (its current schedule)")
    parser.add_argument("--replay", action="store_true", help="the figures from --data alone: no model is loaded")
    parser.add_argument("--data", default=DATA, help="where each policy's judged responses are kept (compressed)")
    parser.add_argument("--eval-prompts", default="configs/prompts/ifeval-eval.jsonl")
    parser.add_argument("--eval-samples", type=int, default=8, help="responses per held-out prompt and policy")
    parser.add_argument("--eval-max-new-tokens", type=int, default=256)
    parser.add_argument("--ifbench-prompts", default=None,
                        help=f"also judge every policy on IFBench's subset (e.g. {IFBENCH_PROMPTS}, written by "
                             "python -m jobs.make_ifbench_prompts)")
    parser.add_argument("--ifbench-samples", type=int, default=4, help="responses per IFBench prompt and policy")
    parser.add_argument("--resamples", type=int, default=10000, help="bootstrap resamples of the held-out prompts")
    parser.add_argument("--policies", nargs="+", default=None, metavar="NAME",
                        help="with --schedule: judge only these of its policies (start, round-1, round-2, ...; "
                             "start is always judged, since every gain is over it), e.g. the last round first "
                             "when judging time is short (DATA's schedule.json then lists only these for --replay, until a "
                             "run without --policies); the default is every finished round")
    parser.add_argument("--against", default=None,
                        help="another arm's --data (e.g. benchmarks/results/ei-rounds-bon): each policy of this arm "
                             "against the same policy of that one")
    args = parse(parser, argv)
    if bool(args.schedule) == args.replay:
        fail("give --schedule OUT (evaluate its rounds) or --replay (the figures from --data)")
    if args.policies and args.replay:
        fail("--policies: with --schedule only (--replay reads the policies --data holds)")
    return args


def chosen_policies(policies: list[tuple[str, str]], names: list[str] | None, out: str) -> list[tuple[str, str]]:
    """The schedule's policies that --policies names (start always), in round order; one line and exit
    2 for a name the schedule has no finished policy for."""
    if not names:
        return policies
    wanted = {name.replace("-", " ") for name in names} | {"start"}
    unknown = wanted - {name for name, _ in policies}
    if unknown:
        fail(f"--policies: {out} has no finished policy {', '.join(sorted(unknown))} (it has: "
             f"{', '.join(name.replace(' ', '-') for name, _ in policies)})")
    return [(name, model) for name, model in policies if name in wanted]


def policy_file(data: Path, name: str, judge: str = "IFEval") -> Path:
    """Where a policy's judged responses are kept in DATA ("round 2": policy-round-2.json.gz on the
    IFEval prompts, policy-round-2-ifbench.json.gz on IFBench's)."""
    return data / f"policy-{name.replace(' ', '-')}{'-ifbench' if judge == 'IFBench' else ''}.json.gz"


def read_json_gz(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()))


def write_json_gz(path: Path, record: dict) -> None:
    """Whole or not at all; the same record gives the same bytes (no time in the gzip header)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_bytes(gzip.compress(json.dumps(record, separators=(",", ":")).encode(), mtime=0))
    tmp.replace(path)


def schedule_policies(out: Path) -> tuple[list[tuple[str, str]], dict]:
    """The starting generator and each finished round's model of OUT's current schedule (name, path),
    and the schedule's record with each round's training metrics; one line and exit 2 otherwise."""
    try:
        progress = json.loads((out / "progress.json").read_text())
        sid = progress["current"]
        schedule = progress["schedules"][sid]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        fail(f"--schedule {out}: no bon-expert-iteration progress.json with a current schedule "
             f"({type(exc).__name__}: {exc})")
    policies = [("start", schedule["generator"])]
    record = {"schedule": sid, "key": schedule["key"], "rounds": {}}
    for r in sorted(schedule["rounds"], key=int):
        model = out / f"schedule-{sid}" / f"round-{int(r):02d}" / "model"
        metrics = model / "training_metrics.json"
        if "train" not in schedule["rounds"][r] or not metrics.exists():
            break  # an unfinished round, and every round after it
        policies.append((f"round {int(r) + 1}", str(model)))
        record["rounds"][r] = {**schedule["rounds"][r], "training_metrics": json.loads(metrics.read_text()),
                               "pairs": pair_figures(model.parent / "pairs")}
    if len(policies) == 1:
        fail(f"--schedule {out}: schedule {sid} has no finished round yet")
    return policies, record


def pair_figures(pairs: Path) -> dict:
    """A round's pairs: their count, the mean reward of chosen and rejected, and their mean length in
    characters (what DPO's preference leans on besides the content)."""
    from benchmarks.real_sbon import read_pairs
    from pipeline.judge import completion_text

    rows = list(read_pairs(pairs).values())
    mean = lambda key: sum(key(r) for r in rows) / len(rows)  # noqa: E731
    return {"pairs": len(rows), "mean_chosen_reward": mean(lambda r: r["chosen_score"]),
            "mean_rejected_reward": mean(lambda r: r["rejected_score"]),
            "mean_chosen_chars": mean(lambda r: len(completion_text(r["chosen"]))),
            "mean_rejected_chars": mean(lambda r: len(completion_text(r["rejected"])))}


def evaluate(name: str, model: str, args, config, rows: list, judge: str = "IFEval") -> dict:
    """``name``'s responses on the held-out prompts (``rows``: the IFEval prompts, or with ``judge``
    "IFBench" IFBench's), judged and scored, as kept in DATA."""
    from jobs.expert_iteration import model_stamp
    from pipeline.coordinator import sampling_params
    from pipeline.engines.rewards import RewardScorer

    prompts, n = ((args.ifbench_prompts, args.ifbench_samples) if judge == "IFBench"
                  else (args.eval_prompts, args.eval_samples))
    sampling = dataclasses.replace(sampling_params(config), max_new_tokens=args.eval_max_new_tokens)
    settings = {"model_stamp": model_stamp(model), "reward_stamp": model_stamp(args.reward),
                "prompts_sha256": hashlib.sha256(Path(prompts).read_bytes()).hexdigest(),
                "samples": n, "sampling": dataclasses.asdict(sampling), "seed": config.seed,
                "chat_template": config.sampling.chat_template}
    path = policy_file(Path(args.data), name, judge)
    if path.exists():
        kept = read_json_gz(path)
        if kept.get("settings") == json.loads(json.dumps(settings)):
            print(f"{name}: reused {path}", flush=True)
            return kept
    start = time.perf_counter()
    result = judged_samples(model, prompts, n, sampling, config.seed, config.sampling.chat_template, texts=True)
    generated = time.perf_counter() - start
    scorer = RewardScorer.from_pretrained(args.reward)
    flat = scorer.score([rows[i // n].prompt for i in range(len(rows) * n)], [t for ts in result["texts"] for t in ts])
    record = {"policy": name, "model": model, "settings": settings, **result,
              "reward_scores": [flat[i * n:(i + 1) * n] for i in range(len(rows))],
              "seconds": {"generate_and_judge": round(generated, 1),
                          "reward": round(time.perf_counter() - start - generated, 1)}}
    write_json_gz(path, record)
    print(f"{name} ({judge}): {result['responses']} responses in {record['seconds']['generate_and_judge']}s, scored in "
          f"{record['seconds']['reward']}s: {path}", flush=True)
    return record


def intervals(verdicts: list, scores: list, tokens: list, resamples: int, seed: int) -> dict:
    """Prompt and instruction level, the mean reward and the mean length, each with a 95% percentile
    bootstrap interval over prompts (a prompt's responses drawn together)."""
    import numpy as np

    per = np.array([[sum(map(all, v)), len(v), sum(map(sum, v)), sum(map(len, v)), sum(s), len(s), sum(t)]
                    for v, s, t in zip(verdicts, scores, tokens)], dtype=float)
    draws = per[np.random.default_rng(seed).integers(0, len(per), size=(resamples, len(per)))].sum(axis=1)
    total = per.sum(axis=0)
    out = {}
    for key, hit, of in (("prompt_level_strict", 0, 1), ("instruction_level_strict", 2, 3), ("mean_reward", 4, 5),
                         ("mean_tokens", 6, 5)):
        values = draws[:, hit] / draws[:, of]
        out[key] = {"value": float(total[hit] / total[of]), "low": float(np.quantile(values, 0.025)),
                    "high": float(np.quantile(values, 0.975))}
    return out


def reward_gain(before: list, after: list, resamples: int, seed: int) -> dict:
    """The mean reward's change, paired by prompt, with its 95% bootstrap interval."""
    import numpy as np

    b = np.array([sum(s) / len(s) for s in before])
    a = np.array([sum(s) / len(s) for s in after])
    draws = np.random.default_rng(seed).integers(0, len(b), size=(resamples, len(b)))
    deltas = a[draws].mean(axis=1) - b[draws].mean(axis=1)
    return {"gain": float(a.mean() - b.mean()), "low": float(np.quantile(deltas, 0.025)),
            "high": float(np.quantile(deltas, 0.975))}


def base_task_groups(prompt_file: str) -> list:
    """Per held-out prompt, its base task (jobs.make_ifeval_prompts.base_task), the unit a bootstrap
    resamples: prompts on one base task are not independent. A prompt on none is a group of its own."""
    from benchmarks.dpo_loop import held_out_rows
    from jobs.make_ifeval_prompts import base_task

    return [(isinstance(row.prompt, str) and base_task(row.prompt)) or f"prompt {i}"
            for i, row in enumerate(held_out_rows(prompt_file))]


def figures_of(policies: list[dict], brief: list, resamples: int, seed: int, groups: list | None = None) -> dict:
    """Every figure of the module docstring from the kept records, in round order; with ``groups``
    (one label per prompt), each round's gain over the start also resampled by group."""
    from pipeline.judge import accuracy_gain

    rows = []
    for p in policies:
        hard, _ = beyond_brevity(p["verdicts"], brief)
        rows.append({"policy": p["policy"], "responses": p["responses"],
                     **intervals(p["verdicts"], p["reward_scores"], p["tokens"], resamples, seed),
                     "beyond_brevity": {k: v["value"] for k, v in intervals(
                         hard, [s for i, s in enumerate(p["reward_scores"]) if not all(brief[i])],
                         [t for i, t in enumerate(p["tokens"]) if not all(brief[i])], resamples, seed).items()
                         if k.endswith("_strict")}})
    start = policies[0]
    for row, p in zip(rows[1:], policies[1:]):
        row["gain_over_start"] = gains(start["verdicts"], p["verdicts"], brief, resamples, seed)
        if groups is not None:
            row["gain_over_start_by_base_task"] = accuracy_gain(start["verdicts"], p["verdicts"], resamples=resamples,
                                                                seed=seed, groups=groups)
        row["reward_gain_over_start"] = reward_gain(start["reward_scores"], p["reward_scores"], resamples, seed)
    for previous, row in zip(rows, rows[1:]):
        up = row["mean_reward"]["value"] - previous["mean_reward"]["value"]
        judge = row["prompt_level_strict"]["value"] - previous["prompt_level_strict"]["value"]
        row["over_optimization"] = up > 0 and judge < 0  # the reward model's score up, the judge's down
    figures = {"policies": rows}
    if len(policies) > 2:
        figures["last_over_first_round"] = gains(policies[1]["verdicts"], policies[-1]["verdicts"], brief, resamples,
                                                 seed)
    figures["length_ratio_last_to_start"] = rows[-1]["mean_tokens"]["value"] / rows[0]["mean_tokens"]["value"]
    return figures


def print_figures(figures: dict, schedule: dict) -> None:
    """The table, the gains and the length ratio; with ``figures["ifbench"]``, the same on IFBench's
    subset, its size in every title."""
    print_judge_figures(figures, schedule)
    if "ifbench" in figures:
        from pipeline.judge import ifbench_subset_text

        bench = figures["ifbench"]
        print(f"\nIFBench, {bench['prompts']} prompts of {bench['prompts_file']} ({ifbench_subset_text()}):")
        print_judge_figures(figures["ifbench"], {"rounds": {}}, " (IFBench)")


def print_judge_figures(figures: dict, schedule: dict, judge: str = "") -> None:
    print(f"{'policy':<9} {'prompt-level [95%]':>20} {'instruction-level [95%]':>24} {'tokens':>7} "
          f"{'RM score [95%]':>22}  pairs  DPO loss")
    for row in figures["policies"]:
        p, i, t, s = (row[k] for k in ("prompt_level_strict", "instruction_level_strict", "mean_tokens", "mean_reward"))
        r = str(int(row["policy"].split()[-1]) - 1) if row["policy"] != "start" else None
        build = schedule["rounds"].get(r, {}) if r else {}
        loss = build.get("training_metrics", {}).get("dpo_train_loss")
        pairs = build.get("pairs")
        print(f"{row['policy']:<9} {100 * p['value']:6.1f} [{100 * p['low']:4.1f}, {100 * p['high']:4.1f}] "
              f"{100 * i['value']:10.1f} [{100 * i['low']:4.1f}, {100 * i['high']:4.1f}] {t['value']:7.1f} "
              f"{s['value']:8.3f} [{s['low']:.3f}, {s['high']:.3f}]  {build.get('build', {}).get('pairs', ''):>5}  "
              + (f"{loss:.4f}" if loss is not None else "") + ("  over-optimization: RM up, judge down"
                                                              if row.get("over_optimization") else ""))
        if pairs:
            print(f"{'':<9} its pairs: chosen reward {pairs['mean_chosen_reward']:.3f}, rejected "
                  f"{pairs['mean_rejected_reward']:.3f}; {pairs['mean_chosen_chars']:.0f} against "
                  f"{pairs['mean_rejected_chars']:.0f} characters")
    for row in figures["policies"][1:]:
        print_gains(f"{row['policy']} over start{judge}", row["gain_over_start"])
        if "gain_over_start_by_base_task" in row:
            g = row["gain_over_start_by_base_task"]
            print(f"{row['policy']} over start{judge}, resampling the {g['groups']} base tasks: "
                  + ", ".join(f"{name} {100 * g[key]['gain']:+.1f} [{100 * g[key]['low']:+.1f}, "
                              f"{100 * g[key]['high']:+.1f}]" for key, name in (
                                  ("prompt_level_strict", "prompt-level"),
                                  ("instruction_level_strict", "instruction-level"))))
        g = row["reward_gain_over_start"]
        print(f"{row['policy']} over start{judge}: reward model's mean score {g['gain']:+.3f} "
              f"[{g['low']:+.3f}, {g['high']:+.3f}]")
    if "last_over_first_round" in figures:
        print_gains(f"{figures['policies'][-1]['policy']} over round 1{judge}", figures["last_over_first_round"])
    print(f"mean length, last policy / start{judge}: {figures['length_ratio_last_to_start']:.2f}")


def read_arm(data: Path) -> dict:
    """Another arm's DATA (--against): its schedule record, a name (its builds' strategy), and its
    kept records by judge and policy (IFBench's where it holds them); one line and exit 2 when DATA
    holds no run of this benchmark."""
    try:
        schedule = json.loads((data / "schedule.json").read_text())
        ifeval = {name: read_json_gz(policy_file(data, name)) for name in schedule["policies"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        fail(f"--against {data}: does not hold a run of this benchmark ({type(exc).__name__}: {exc})")
    bench = {name: read_json_gz(path) for name in schedule["policies"]
             if (path := policy_file(data, name, "IFBench")).exists()}
    return arm(data, schedule, ifeval, bench)


def arm(data: Path, schedule: dict, ifeval: dict, bench: dict) -> dict:
    """An arm as arms_compared takes it: its DATA, schedule record, name (its builds' strategy) and
    records by judge and policy."""
    return {"data": str(data), "schedule": schedule, "name": schedule.get("rounds", {}).get("0", {}).get("strategy"),
            "records": {"IFEval": ifeval, "IFBench": bench}}


def build_tokens(schedule: dict, policy: str) -> tuple[int | None, int | None]:
    """The generated tokens of the build whose pairs trained ``policy`` ("round k": round k-1's
    build) and of every build up to it; None for the start policy or a round the record lacks."""
    if policy == "start":
        return None, None
    try:
        builds = [schedule["rounds"][str(r)]["build"]["generated_tokens"] for r in range(int(policy.split()[-1]))]
    except (KeyError, TypeError):
        return None, None
    return builds[-1], sum(builds)


def mean_tokens(record: dict) -> float:
    """A policy's mean response length in tokens, over every response."""
    return sum(map(sum, record["tokens"])) / sum(map(len, record["tokens"]))


def arms_compared(ours: dict, theirs: dict, groups: list, resamples: int, seed: int) -> dict:
    """Each policy of ``ours`` against the same policy of ``theirs`` (read_arm's form) on every judge
    both hold it for: accuracy_gain from theirs to ours, resampled by ``groups`` on IFEval's prompts
    and by prompt on IFBench's; both mean lengths and both builds' tokens ([ours, theirs] each).
    One line and exit 2 where the arms' responses were judged on other prompts or sample counts."""
    from pipeline.judge import accuracy_gain

    names = [ours["name"], theirs["name"]]
    if None in names or names[0] == names[1]:  # two seeds of one strategy, say: the directories name them
        names = [ours["data"], theirs["data"]]
    out = {"data": theirs["data"], "arms": names, "policies": []}
    for policy in ours["schedule"]["policies"]:
        if policy not in theirs["records"]["IFEval"]:
            continue
        tokens = [build_tokens(arm["schedule"], policy) for arm in (ours, theirs)]
        row = {"policy": policy, "build_tokens": [t[0] for t in tokens],
               "cumulative_build_tokens": [t[1] for t in tokens]}
        for judge in ("IFEval", "IFBench"):
            mine, other = ours["records"][judge].get(policy), theirs["records"][judge].get(policy)
            if mine is None or other is None:
                continue
            for key, what in (("prompts_sha256", "prompt file"), ("samples", "responses per prompt")):
                if mine["settings"].get(key) != other["settings"].get(key):
                    fail(f"--against {theirs['data']}: {policy} judged by {judge} on another {what} "
                         f"({other['settings'].get(key)} against {ours['data']}'s {mine['settings'].get(key)}): "
                         "judge both arms on the same prompts with the same samples")
            labels = groups if judge == "IFEval" else list(range(len(mine["verdicts"])))
            row[judge] = {**accuracy_gain(other["verdicts"], mine["verdicts"], resamples=resamples, seed=seed,
                                          groups=labels),
                          "mean_tokens": [mean_tokens(mine), mean_tokens(other)]}
        out["policies"].append(row)
    return out


def print_arms(against: dict) -> None:
    """One line per policy and judge: both arms' accuracy, the paired difference with its interval,
    both lengths and both builds' tokens."""
    ours, theirs = against["arms"]
    print(f"\n{ours} against {theirs} ({against['data']}), paired, the same held-out prompts and seeds:")
    for row in against["policies"]:
        tokens, total = row["build_tokens"], row["cumulative_build_tokens"]
        build = (f"build tokens {tokens[0]:,} / {tokens[1]:,} ({tokens[0] / tokens[1]:.2f}x; every round up to it "
                 f"{total[0]:,} / {total[1]:,}, {total[0] / total[1]:.2f}x)" if None not in tokens
                 else "no build before it" if row["policy"] == "start" else "build tokens not recorded")
        for judge in ("IFEval", "IFBench"):
            if judge not in row:
                continue
            g = row[judge]
            unit = f"{g['groups']} base tasks" if g["groups"] < g["prompts"] else f"{g['prompts']} prompts"
            levels = "; ".join(f"{name}: {100 * g[key]['gain']:+.1f} [{100 * g[key]['low']:+.1f}, "
                               f"{100 * g[key]['high']:+.1f}]" for key, name in (
                                   ("prompt_level_strict", "prompt level"),
                                   ("instruction_level_strict", "instruction level")))
            print(f"{row['policy']} ({judge}): {ours} {100 * g['prompt_level_strict']['after']:.1f} vs {theirs} "
                  f"{100 * g['prompt_level_strict']['before']:.1f} {levels} ({unit}); lengths "
                  f"{g['mean_tokens'][0]:.1f} / {g['mean_tokens'][1]:.1f} tokens; {build}")


def draw(figures: dict):
    def plot(plt):
        rows = figures["policies"]
        x = list(range(len(rows)))
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        for key, label in (("prompt_level_strict", "prompt level"), ("instruction_level_strict", "instruction level")):
            values = [100 * r[key]["value"] for r in rows]
            errors = [[v - 100 * r[key]["low"] for v, r in zip(values, rows)],
                      [100 * r[key]["high"] - v for v, r in zip(values, rows)]]
            axes[0].errorbar(x, values, yerr=errors, marker="o", capsize=4, label=label)
        if "ifbench" in figures:
            subset = figures["ifbench"]["subset"]
            bench = figures["ifbench"]["policies"]
            level = [r["prompt_level_strict"] for r in bench]
            values = [100 * f["value"] for f in level]
            axes[0].errorbar(x, values, yerr=[[v - 100 * f["low"] for v, f in zip(values, level)],
                                              [100 * f["high"] - v for v, f in zip(values, level)]],
                             marker="s", capsize=4,
                             label=f"IFBench prompt level ({subset['prompts']} of {subset['of_prompts']} prompts)")
        axes[0].set(title="held-out IFEval (strict), 95% interval", ylabel="%")
        axes[0].legend()
        for ax, key, title in ((axes[1], "mean_reward", "reward model's mean score"),
                               (axes[2], "mean_tokens", "mean response length (tokens)")):
            values = [r[key]["value"] for r in rows]
            ax.errorbar(x, values, yerr=[[v - r[key]["low"] for v, r in zip(values, rows)],
                                         [r[key]["high"] - v for v, r in zip(values, rows)]], marker="o", capsize=4)
            ax.set(title=title)
        for ax in axes:
            ax.set_xticks(x, [r["policy"] for r in rows])
        fig.suptitle("Expert iteration with DPO on the real models: sbon pairs, the reward model alone")
        return fig
    return plot


def main(argv: list[str] | None = None) -> int:
    from pipeline.config import ConfigError, load_config

    args = parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        fail(str(e))
    data = Path(args.data)
    brief = brief_reply_passes(args.eval_prompts)
    bench = None  # IFBench's records, one per policy
    if args.replay:
        try:
            schedule = json.loads((data / "schedule.json").read_text())
            records = [read_json_gz(policy_file(data, name)) for name in schedule["policies"]]
        except (OSError, ValueError, KeyError) as exc:
            fail(f"--replay: {data} does not hold a run of this benchmark ({type(exc).__name__}: {exc})")
        kept = [policy_file(data, name, "IFBench") for name in schedule["policies"]]
        if all(path.exists() for path in kept):
            bench = [read_json_gz(path) for path in kept]
            args.ifbench_prompts = args.ifbench_prompts or IFBENCH_PROMPTS
        elif args.ifbench_prompts:
            fail(f"--replay: {data} holds no IFBench record for every policy (run with --schedule and "
                 "--ifbench-prompts)")
    else:
        from benchmarks.dpo_loop import held_out_rows

        policies, schedule = schedule_policies(Path(args.schedule))
        policies = chosen_policies(policies, args.policies, args.schedule)
        schedule["policies"] = [name for name, _ in policies]
        rows = held_out_rows(args.eval_prompts)
        records = [evaluate(name, model, args, config, rows) for name, model in policies]
        if args.ifbench_prompts:
            rows = held_out_rows(args.ifbench_prompts)
            bench = [evaluate(name, model, args, config, rows, "IFBench") for name, model in policies]
        data.mkdir(parents=True, exist_ok=True)
        (data / "schedule.json").write_text(json.dumps(schedule, indent=2) + "\n")
    if any(len(r["verdicts"]) != len(brief) for r in records):
        fail(f"{data}: its policies were judged on other prompts than {args.eval_prompts}")
    groups = base_task_groups(args.eval_prompts)
    figures = {"schedule": schedule, "eval_prompts": args.eval_prompts,
               **figures_of(records, brief, args.resamples, config.seed, groups)}
    if bench:
        from pipeline.judge import ifbench_subset

        bench_brief = brief_reply_passes(args.ifbench_prompts)
        if any(len(r["verdicts"]) != len(bench_brief) for r in bench):
            fail(f"{data}: its policies were judged on other IFBench prompts than {args.ifbench_prompts}")
        figures["ifbench"] = {"subset": ifbench_subset(), "prompts_file": args.ifbench_prompts,
                              "prompts": len(bench_brief), **figures_of(bench, bench_brief, args.resamples, config.seed)}
    if args.against:
        ours = arm(data, schedule, dict(zip(schedule["policies"], records)), dict(zip(schedule["policies"], bench or [])))
        figures["against"] = arms_compared(ours, read_arm(Path(args.against)), groups, args.resamples, config.seed)
    print_figures(figures, schedule)
    if args.against:
        print_arms(figures["against"])
    write_json(args.json, figures, args)
    write_png(args.plot, draw(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
