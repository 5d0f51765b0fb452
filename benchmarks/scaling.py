"""Throughput with 1 and 2 generator actors on one Ray cluster, and where the actors' time goes.

    python -m benchmarks.scaling [--generator DIR --reward DIR] [--device cpu|cuda] [--actors 1,2]
        [--prompts 24] [--num-samples 4] [--max-new-tokens 32] [--strategy sbon] [--json FILE]

Each actor count runs the same prompts through the real coordinator and Ray actors. All setups
are loaded first (model loading is outside the timed span) and warmed up; timed runs then
alternate between them (--repeats rounds) and the fastest run of each is kept. Inside every generator actor, hooks
time each top-level model forward pass (synchronised on CUDA) and each engine call. Reported per
actor count:
- throughput: prompts/s and generated tokens/s, and the ratio against 1 actor (same run);
- forward share: forward-pass seconds / (actors x wall seconds): the fraction of the generator
  actors' wall time spent in model forward passes. The rest is coordination and transfer: waiting
  for the reward model and the driver, Ray calls, sampling and KV-cache bookkeeping. Target: >= 0.85
  with 2 actors on hardware where each actor has its own device;
- busy share: engine-call seconds / (actors x wall), which separates idle waiting (1 - busy) from
  work inside the engine that is not a forward pass (busy - forward).

On a small shared CPU machine actors compete for the same cores, so the figures there describe
contention more than the design; they are reported as measured. With no model flags, tiny models
are built in a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def _instrument(actor, device: str) -> None:
    """Runs inside a GeneratorActor (via __ray_call__): time forward passes and engine calls."""
    import time

    import torch

    engine = actor.engine
    actor.bench = {"forward_s": 0.0, "forwards": 0, "busy_s": 0.0}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def before(module, args, kwargs):
        sync()
        actor.bench_start = time.perf_counter()

    def after(module, args, kwargs, output):
        sync()
        actor.bench["forward_s"] += time.perf_counter() - actor.bench_start
        actor.bench["forwards"] += 1

    engine.model.register_forward_pre_hook(before, with_kwargs=True)
    engine.model.register_forward_hook(after, with_kwargs=True)
    for name in ("open", "extend", "close", "search"):
        method = getattr(engine, name)

        def timed(*args, _method=method, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                actor.bench["busy_s"] += time.perf_counter() - start

        setattr(engine, name, timed)


def _read(actor, reset: bool) -> dict:
    figures = dict(actor.bench)
    if reset:
        actor.bench = {"forward_s": 0.0, "forwards": 0, "busy_s": 0.0}
    return figures


class Setup:
    """One actor count's workers, instrumented, with a coordinator over them."""

    def __init__(self, config, actors: int):
        import ray

        from actors import start_workers
        from pipeline.build import sampling_params
        from pipeline.coordinator import Coordinator

        config.runtime.generator_actors = actors
        self.actors = actors
        self.workers = start_workers(config)
        self.handles = [g.handle for g in self.workers.generators]
        ray.get([h.__ray_call__.remote(_instrument, config.models.device) for h in self.handles])
        self.coordinator = Coordinator(config.strategy.name, config.strategy.params, sampling_params(config),
                                       config.sampling.num_samples, config.seed, self.workers.generators,
                                       self.workers.scorers, config.runtime.prompts_per_batch,
                                       config.runtime.batches_in_flight)

    def run(self, prompts) -> dict:
        import ray

        ray.get([h.__ray_call__.remote(_read, True) for h in self.handles])
        start = time.perf_counter()
        results = list(self.coordinator.run(prompts))
        wall = time.perf_counter() - start
        per_actor = ray.get([h.__ray_call__.remote(_read, False) for h in self.handles])
        tokens = sum(r.generated_tokens for r in results)
        forward = sum(a["forward_s"] for a in per_actor)
        busy = sum(a["busy_s"] for a in per_actor)
        return {"generator_actors": self.actors, "prompts": len(results), "wall_seconds": round(wall, 3),
                "prompts_per_second": round(len(results) / wall, 3), "tokens_per_second": round(tokens / wall, 1),
                "generated_tokens": tokens, "forward_share": round(forward / (self.actors * wall), 3),
                "busy_share": round(busy / (self.actors * wall), 3),
                "per_actor": [{k: round(v, 3) for k, v in a.items()} for a in per_actor]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generator", help="generator model directory (default: tiny models)")
    parser.add_argument("--reward", help="reward model directory (default: tiny models)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--actors", default="1,2", help="generator actor counts to compare")
    parser.add_argument("--reward-actors", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per actor count, alternating; best kept")
    parser.add_argument("--strategy", default="sbon")
    parser.add_argument("--prompts-per-batch", type=int, default=4)
    parser.add_argument("--num-gpus", type=float, default=None, help="GPUs per actor (default: 1 on cuda, else 0)")
    parser.add_argument("--json", default="out/bench/scaling.json")
    args = parser.parse_args(argv)

    import ray

    from pipeline.config import config_from_dict
    from pipeline.data.prompts import PromptFormatter, PromptRow

    counts = [int(n) for n in args.actors.split(",")]
    tmp = tempfile.TemporaryDirectory()
    if not (args.generator and args.reward):
        from jobs.make_tiny_models import make_tiny_models

        tiny = make_tiny_models(tmp.name)
        args.generator, args.reward = args.generator or str(tiny["generator"]), args.reward or str(tiny["reward"])
    gpus = args.num_gpus if args.num_gpus is not None else (1.0 if args.device.startswith("cuda") else 0.0)
    config = config_from_dict({
        "models": {"generator": args.generator, "reward": args.reward, "device": args.device},
        "strategy": {"name": args.strategy},
        "sampling": {"num_samples": args.num_samples, "max_new_tokens": args.max_new_tokens},
        "runtime": {"generator": {"num_cpus": 1, "num_gpus": gpus}, "reward": {"num_cpus": 1, "num_gpus": gpus},
                    "reward_actors": args.reward_actors, "prompts_per_batch": args.prompts_per_batch},
    })
    from pipeline.engines.hf import load_tokenizer

    formatter = PromptFormatter(load_tokenizer(args.generator), 256)
    topics = ["lamp", "battery", "blender", "camera", "app", "delivery", "kettle", "phone"]
    prompts = [formatter.prepare(PromptRow(i, f"Write review {i} of the {topics[i % len(topics)]}."))[0]
               for i in range(args.prompts)]
    if not ray.is_initialized():
        # Logical CPUs for every actor, even where the machine has fewer cores: contention is measured.
        ray.init(address="local", num_cpus=sum(counts) + len(counts) * args.reward_actors, _node_ip_address="127.0.0.1",
                 include_dashboard=False, log_to_driver=False)
    setups = [Setup(config, n) for n in counts]  # all loaded first: runs alternate, noise hits all alike
    try:
        for setup in setups:  # warm-up
            setup.run(prompts[:config.runtime.prompts_per_batch * setup.actors])
        best: dict[int, dict] = {}
        for _ in range(args.repeats):
            for setup in setups:
                run = setup.run(prompts)
                if run["prompts_per_second"] > best.get(setup.actors, {}).get("prompts_per_second", 0):
                    best[setup.actors] = run
    finally:
        for setup in setups:
            setup.workers.shutdown()
    runs = [best[n] for n in counts]
    base = runs[0]
    for run in runs:
        run["throughput_ratio_vs_first"] = round(run["prompts_per_second"] / base["prompts_per_second"], 3)
    result = {"device": args.device, "strategy": args.strategy, "num_samples": args.num_samples,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "cpu_count": os.cpu_count(),
              "load_average": os.getloadavg(), "runs": runs,
              "forward_share_target": 0.85}
    for run in runs:
        print(f"{run['generator_actors']} generator actor(s): {run['prompts_per_second']:.2f} prompts/s, "
              f"{run['tokens_per_second']:.0f} tokens/s (x{run['throughput_ratio_vs_first']:.2f}), "
              f"forward share {run['forward_share']:.1%}, busy share {run['busy_share']:.1%}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    ray.shutdown()
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
