"""Cluster scale by simulation: can one driver keep 64 generators and 16 reward models busy?

    python -m benchmarks.cluster_sim [--generators 64] [--rewards 16] [--num-prompts 20000]
        [--strategy sbon] [--num-samples 32] [--max-new-tokens 256] [--decision-token 32]
        [--rejection-rate 0.875] [--prompts-per-batch 4] [--batches-in-flight 2]
        [--decode-ms 22] [--decode-row-us 40] [--prefill-ms 60] [--reward-ms 25] [--reward-token-us 4]
        [--time-scale 0.05] [--json FILE]

What is real: the build (pipeline.build.plan_build / run_build: input read and validated, shards
planned, pairs selected, every shard committed with its marker, the manifest verified), the
Coordinator (pipeline.coordinator: batches in flight per generator, round-robin reward models,
failover machinery), the method's driver-side code (speculative rejection's decision tokens,
streaming reward sessions, pruning), the actor handles (actors.factory.local_generator and
local_scorer: timed, one call at a time, as ``runtime.local`` builds them) and the actors' timelines.

What is simulated: the models. A generator actor's forward pass is a sleep of an 8B generator's
decode step on one GPU (``--decode-ms`` per step plus ``--decode-row-us`` per live row; a prefill
``--prefill-ms`` per batch), a reward actor's a sleep of an 8B reward model's prefill
(``--reward-ms`` per call plus ``--reward-token-us`` per token read). The defaults are assumptions
for one H100 per actor in bfloat16, not measurements. Every sleep is multiplied by ``--time-scale``
so that 20,000 prompts finish in minutes; the driver's own work is not scaled, so a small scale
makes the driver's share look larger than it would be (the figures are conservative). Tokens are
drawn per row from its seed: a response length (EOS) and a hidden quality that the partial and
final rewards reveal with noise, so speculative rejection has something to rank.

The actors are threads of this process (80 Ray actor processes do not fit a small machine); each
is serialized as an actor would be. Reported (JSON with --json):

- ``generator_utilization``: the generators' busy time (inside their calls) / (generators x
  run_seconds): the share of the run the driver kept them supplied with work; the rest is waiting
  for rewards, for work, or on calls in transit. ``generator_forward_share``: the simulated forward
  passes alone over the same; the difference is the simulated actors' own Python (bookkeeping the
  rows, and the interpreter lock shared by about 200 threads of one process, which separate actor
  processes would not share). ``reward_utilization`` likewise for the reward models;
- ``driver_cpu_seconds_per_1000_prompts``: CPU seconds of this process during the run, outside
  the simulated actors' calls (the driver: coordinator, method code, pairing, commit), per 1,000
  prompts; ``driver_cpu_share``, the same seconds over the run's wall time (1.0: one core
  saturated: one Python driver can go no faster); ``driver_cpu_plan_seconds``, planning (reading
  and validating the input, tokenizing the prompts, imports on first use) before the run;
- ``lost`` and ``duplicated``: input rows missing from, or repeated in, the committed output
  (pairs plus rejects), read back from the Parquet files;
- with ``--sweep 8,16,32,64``: the same figures per generator count, which shows where one driver
  saturates (utilization falls while driver CPU per second approaches 1.0).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import bench_parser, parse, write_json
from pipeline.decoding.domain import RowState
from pipeline.observability import ActorTimeline

EOS_SHARE = 0.5
"""Share of rows that end with EOS before max_new_tokens (at a length drawn uniformly)."""


class Cost:
    """The simulated forward passes: sleeps of a GPU deployment's cost, scaled."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.lock = threading.Lock()
        self.actor_cpu = 0.0
        """CPU seconds spent inside the simulated actors' calls (not the driver's)."""

    def sleep(self, timeline: ActorTimeline, seconds: float, passes: int = 1) -> None:
        """Stand for ``passes`` forward passes of ``seconds`` in all, timed as the actor's forward."""
        scaled = seconds * self.args.time_scale
        time.sleep(scaled)
        timeline.forward.seconds += scaled
        timeline.forward.passes += passes

    def charge(self, cpu_start: float) -> None:
        with self.lock:
            self.actor_cpu += time.thread_time() - cpu_start


class _Row:
    def __init__(self, seed: int, max_new_tokens: int):
        rng = random.Random(seed)
        self.seed = seed
        self.length = rng.randint(1, max_new_tokens) if rng.random() < EOS_SHARE else max_new_tokens
        self.quality = rng.gauss(0.0, 1.0)
        self.tokens: list[int] = []

    def state(self, row: int) -> RowState:
        n = len(self.tokens)
        return RowState(row, list(self.tokens), f"response {self.seed} of {n} tokens", n >= self.length)


class SimGenerator:
    """The Generator protocol (sessions open / extend / close) over simulated forward passes."""

    def __init__(self, cost: Cost):
        self.cost = cost
        self.sessions: dict[str, dict[int, _Row]] = {}
        self.timeline = ActorTimeline(lambda: len(self.sessions), "sampling_and_bookkeeping", "waiting_for_rewards")
        self.generated_tokens = self.forward_passes = 0

    def open(self, session, prompts, num_samples, seeds, sampling, timing=None) -> None:
        with self.timeline.call(timing):
            cpu = time.thread_time()
            self.sessions[session] = {i: _Row(seed, sampling.max_new_tokens) for i, seed in enumerate(seeds)}
            self.cost.sleep(self.timeline, self.cost.args.prefill_ms / 1e3)
            self.cost.charge(cpu)

    def extend(self, session, until, keep=None, timing=None) -> list[RowState]:
        with self.timeline.call(timing):
            cpu = time.thread_time()
            rows = self.sessions[session]
            if keep is not None:
                for row in set(rows) - set(keep):
                    del rows[row]
            # One sleep for the call's decode steps: step s decodes the rows still short of their
            # target then (the same cost as stepping, without a Python loop per simulated step).
            targets = sorted(min(until, r.length) - len(r.tokens) for r in rows.values())
            targets = [t for t in targets if t > 0]
            seconds, done, steps = 0.0, 0, 0
            for i, target in enumerate(targets):  # rows i.. are live for steps done..target
                live = len(targets) - i
                seconds += (target - done) * (self.cost.args.decode_ms / 1e3 + self.cost.args.decode_row_us / 1e6 * live)
                steps += target - done
                done = target
            for r in rows.values():
                r.tokens.extend(range(len(r.tokens), min(until, r.length)))
            self.generated_tokens += sum(targets)
            self.forward_passes += steps
            self.cost.charge(cpu)
            if steps:
                self.cost.sleep(self.timeline, seconds, steps)
            cpu = time.thread_time()
            states = [rows[i].state(i) for i in sorted(rows)]
            self.cost.charge(cpu)
            return states

    def close(self, session, timing=None) -> dict:
        with self.timeline.call(timing):
            rows = self.sessions.pop(session)
            return {"generated_tokens": sum(len(r.tokens) for r in rows.values()), "forward_passes": 0}

    def search(self, *args, **kwargs):
        raise NotImplementedError("the simulation serves the driver-side strategies (best_of_n, sbon)")

    def stats(self) -> dict:
        return {"generated_tokens": self.generated_tokens, "forward_passes": self.forward_passes,
                "time": self.timeline.stats()}


class SimScorer:
    """The streaming Scorer protocol over a simulated reward model's prefill."""

    def __init__(self, cost: Cost):
        self.cost = cost
        self.sessions: dict[str, int] = {}
        self.timeline = ActorTimeline(lambda: len(self.sessions), "tokenizing_and_bookkeeping",
                                      "waiting_for_generator")
        self.forward_passes = 0

    def _score(self, responses: list[str], tokens: int) -> list[float]:
        cpu = time.thread_time()
        scores = []
        for text in responses:
            seed, n = (int(v) for v in text.split()[1::2][:2])
            quality = random.Random(seed).gauss(0.0, 1.0)
            scores.append(quality + random.Random(seed * 7919 + n).gauss(0.0, 2.0 / (1 + n / 32)))
        self.forward_passes += 1
        self.cost.charge(cpu)
        self.cost.sleep(self.timeline, self.cost.args.reward_ms / 1e3 + self.cost.args.reward_token_us / 1e6 * tokens)
        return scores

    def score(self, prompts, responses, finished=None, columns=None, timing=None) -> list[float]:
        with self.timeline.call(timing):
            return self._score(responses, sum(len(r) for r in responses) // 4 + 64 * len(responses))

    def open(self, session, prompts, num_samples, columns=None, timing=None) -> None:
        with self.timeline.call(timing):
            self.sessions[session] = 0

    def extend(self, session, rows, responses, finished=None, timing=None) -> list[float]:
        with self.timeline.call(timing):
            return self._score(responses, sum(int(r.split()[3]) for r in responses))

    def close(self, session, timing=None) -> dict:
        with self.timeline.call(timing):
            self.sessions.pop(session)
            return {"tokens_read": 0}

    def stats(self) -> dict:
        return {"forward_passes": self.forward_passes, "time": self.timeline.stats()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = bench_parser("benchmarks.cluster_sim", __doc__, num_prompts=20000,
                          strategy=dict(default="sbon", choices=["sbon", "best_of_n"]),
                          num_samples=32, max_new_tokens=256, json=None)
    parser.add_argument("--generators", type=int, default=64)
    parser.add_argument("--rewards", type=int, default=16)
    parser.add_argument("--decision-token", type=int, default=32)
    parser.add_argument("--rejection-rate", type=float, default=0.875)
    parser.add_argument("--prompts-per-batch", type=int, default=4)
    parser.add_argument("--batches-in-flight", type=int, default=2)
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--decode-ms", type=float, default=22.0, help="an 8B generator's decode step (one GPU)")
    parser.add_argument("--decode-row-us", type=float, default=40.0, help="extra per live row per step")
    parser.add_argument("--prefill-ms", type=float, default=60.0, help="a batch's prompt prefill")
    parser.add_argument("--reward-ms", type=float, default=25.0, help="an 8B reward model's call")
    parser.add_argument("--reward-token-us", type=float, default=4.0, help="extra per token read")
    parser.add_argument("--time-scale", type=float, default=0.05, help="every simulated sleep x this")
    parser.add_argument("--sweep", help="comma-separated generator counts (rewards scale with them)")
    parser.add_argument("--tokenizer", default=".cache/tiny-models/generator",
                        help="the build plans with a real tokenizer (python -m jobs.make_tiny_models)")
    return parse(parser, argv)


def simulate(args: argparse.Namespace, generators: int, rewards: int, workdir: Path) -> dict:
    """One build of ``args.num_prompts`` prompts on ``generators`` / ``rewards`` simulated actors."""
    import pyarrow.parquet as pq

    from actors.factory import Workers, local_generator, local_scorer
    from pipeline.build import plan_build, run_build
    from pipeline.config import load_config
    from pipeline.data.storage import join
    from pipeline.data.store import OutputStore, side_name

    prompts = workdir / "prompts.jsonl"
    if not prompts.exists():
        prompts.write_text("".join(json.dumps({"prompt": f"Question {i}: explain topic {i * 7919 % 100003}."}) + "\n"
                                   for i in range(args.num_prompts)))
    out = workdir / f"out-{generators}"
    overrides = {
        # Planning checks every model's kind: the simulated scorer stands in for the tiny reward model
        # beside the tokenizer's generator (jobs.make_tiny_models writes both).
        "models.generator": args.tokenizer, "models.reward": str(Path(args.tokenizer).parent / "reward"),
        "models.draft": "",
        "sampling.num_samples": args.num_samples,
        "sampling.max_new_tokens": args.max_new_tokens, "data.prompts": str(prompts), "data.output": str(out),
        "data.shard_size": args.shard_size, "runtime.prompts_per_batch": args.prompts_per_batch,
        "runtime.batches_in_flight": args.batches_in_flight, "runtime.local": "true",
        "runtime.generator_actors": generators, "runtime.reward_actors": rewards,
    }
    if args.strategy == "sbon":
        overrides.update({"strategy.decision_token": args.decision_token,
                          "strategy.rejection_rate": args.rejection_rate})
    config = load_config("configs/demo.yaml", [f"{key}={value}" for key, value in overrides.items()],
                         strategy=args.strategy)
    cost = Cost(args)
    workers = Workers([local_generator(SimGenerator(cost)) for _ in range(generators)],
                      [local_scorer(SimScorer(cost)) for _ in range(rewards)])
    cpu_start = time.process_time()
    plan = plan_build(config, overwrite=True)
    cpu_planned = time.process_time()
    manifest = run_build(plan, workers, progress=sys.stderr.isatty())
    driver_cpu = time.process_time() - cpu_planned - cost.actor_cpu
    report = json.loads((out / "_report.json").read_text())

    # Read back what a reader of the build gets: the committed shards (through the output store),
    # each with its rejects, so a stray or uncommitted file can neither hide a loss nor fake a row.
    store = OutputStore(str(out))
    seen: dict[int, int] = {}
    for part in store.committed_parts():
        shard = int(part.rsplit("/", 1)[1].split("-")[1].split(".")[0])  # train-NNNNN.parquet
        for path in (part, join(store.root, "_rejects", side_name(shard))):
            with store.fs.open(path, "rb") as f:
                for row in pq.read_table(f, columns=["source_row"]).column("source_row").to_pylist():
                    seen[row] = seen.get(row, 0) + 1
    run = report["run_seconds"]
    times = report["actor_time"]
    return {
        "generators": generators, "rewards": rewards, "prompts": args.num_prompts, "pairs": manifest["pairs"],
        "run_seconds": run, "startup_seconds": report["startup_seconds"],
        "generator_utilization": round(times["generator"]["busy_seconds"] / (generators * run), 4),
        "generator_forward_share": round(times["generator"]["breakdown_seconds"]["forward"] / (generators * run), 4),
        "reward_utilization": round(times["reward"]["busy_seconds"] / (rewards * run), 4),
        "driver_cpu_plan_seconds": round(cpu_planned - cpu_start, 2),
        "driver_cpu_seconds": round(driver_cpu, 2),
        "driver_cpu_seconds_per_1000_prompts": round(driver_cpu / args.num_prompts * 1000, 3),
        "driver_cpu_share": round(driver_cpu / run, 3),
        "lost": sum(1 for row in range(args.num_prompts) if row not in seen),
        "duplicated": sum(count - 1 for count in seen.values() if count > 1),
        "generated_tokens": report["generated_tokens"],
        "generator_breakdown_seconds": times["generator"]["breakdown_seconds"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (Path(args.tokenizer) / "tokenizer_config.json").exists():
        print(f"error: {args.tokenizer}: no tokenizer (python -m jobs.make_tiny_models --output "
              f"{Path(args.tokenizer).parent})", file=sys.stderr)
        return 2
    counts = [int(c) for c in args.sweep.split(",")] if args.sweep else [args.generators]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for generators in counts:
            rewards = max(1, round(args.rewards * generators / args.generators))
            result = simulate(args, generators, rewards, Path(tmp))
            results.append(result)
            print(f"{generators:>4} generators, {rewards:>3} reward models, {args.num_prompts} prompts: "
                  f"generator utilization {result['generator_utilization']:.3f} "
                  f"(forward passes {result['generator_forward_share']:.3f}), "
                  f"reward utilization {result['reward_utilization']:.3f}, "
                  f"driver CPU {result['driver_cpu_seconds_per_1000_prompts']:.2f} s per 1,000 prompts "
                  f"({result['driver_cpu_share']:.0%} of a core), lost {result['lost']}, "
                  f"duplicated {result['duplicated']}, run {result['run_seconds']:.1f}s", flush=True)
    write_json(args.json, {"settings": vars(args), "results": results}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
