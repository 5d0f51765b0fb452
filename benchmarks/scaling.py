"""Throughput with 1 and 2 generator actors on one Ray cluster, and where the actors' time goes.

    python -m benchmarks.scaling [--models tiny|DIR] [--generator DIR --reward DIR] [--device cpu|cuda]
        [--actors 1,2] [--num-prompts 48] [--num-samples 4] [--max-new-tokens 48] [--strategy sbon] [--json FILE]

Each actor count runs the same prompts through the real coordinator and Ray actors, the coordinator
built as a build builds it (Coordinator.from_config: the same admission policy, runtime.* settings). All setups
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
contention more than the design; they are reported as measured.
"""

from __future__ import annotations

import time

from benchmarks import bench_parser, fail, model_dirs, parse, ratio_table, side_by_side, write_json


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
        from pipeline.coordinator import Coordinator

        config.runtime.generator_actors = actors
        self.actors = actors
        self.workers = start_workers(config)
        self.handles = self.workers.handles[:actors]  # Ray actor handles: the generators' first
        ray.get([h.__ray_call__.remote(_instrument, config.models.device) for h in self.handles])
        self.coordinator = Coordinator.from_config(config, self.workers.generators, self.workers.scorers)

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
    parser = bench_parser("benchmarks.scaling", __doc__, models="tiny", generator=None, reward=None, device="cpu",
                          num_prompts=48, num_samples=4, max_new_tokens=48, repeats=3, json="out/bench/scaling.json")
    parser.add_argument("--actors", default="1,2", help="generator actor counts to compare")
    parser.add_argument("--reward-actors", type=int, default=1)
    parser.add_argument("--strategy", default="sbon")
    parser.add_argument("--prompts-per-batch", type=int, default=4)
    parser.add_argument("--num-gpus", type=float, default=None, help="GPUs per actor (default: 1 on cuda, else 0)")
    args = parse(parser, argv)

    import ray

    from pipeline.config import ConfigError, config_from_dict
    from pipeline.data.chat import PromptFormatter, PromptRow
    from pipeline.engines.hf import load_tokenizer

    counts = [int(n) for n in args.actors.split(",")]
    models = model_dirs(args.models, generator=args.generator, reward=args.reward)
    gpus = args.num_gpus if args.num_gpus is not None else (1.0 if args.device.startswith("cuda") else 0.0)
    try:
        config = config_from_dict({
            "models": {**models, "device": args.device},
            "strategy": {"name": args.strategy},
            "sampling": {"num_samples": args.num_samples, "max_new_tokens": args.max_new_tokens},
            "runtime": {"generator": {"num_cpus": 1, "num_gpus": gpus}, "reward": {"num_cpus": 1, "num_gpus": gpus},
                        "reward_actors": args.reward_actors, "prompts_per_batch": args.prompts_per_batch},
        })
    except ConfigError as e:
        fail(str(e))
    formatter = PromptFormatter(load_tokenizer(models["generator"]), 256)
    topics = ["lamp", "battery", "blender", "camera", "app", "delivery", "kettle", "phone"]
    prompts = [formatter.prepare(PromptRow(i, f"Write review {i} of the {topics[i % len(topics)]}."))[0]
               for i in range(args.num_prompts)]
    if not ray.is_initialized():
        # Logical CPUs for every actor, even where the machine has fewer cores: contention is measured.
        ray.init(address="local", num_cpus=sum(counts) + len(counts) * args.reward_actors, _node_ip_address="127.0.0.1",
                 include_dashboard=False, log_to_driver=False)
    setups = {f"{n} generator actor(s)": Setup(config, n) for n in counts}  # all loaded first: runs alternate
    try:
        for setup in setups.values():  # warm-up
            setup.run(prompts[:config.runtime.prompts_per_batch * setup.actors])
        runs = side_by_side({name: (lambda s=setup: s.run(prompts)) for name, setup in setups.items()}, args.repeats)
    finally:
        for setup in setups.values():
            setup.workers.shutdown()
        ray.shutdown()
    best = {name: max((r.value for r in each), key=lambda v: v["prompts_per_second"]) for name, each in runs.items()}
    ratios = ratio_table({name: v["prompts_per_second"] for name, v in best.items()}, next(iter(best)),
                         "prompts/s", higher_is_better=True)
    for name, run in best.items():
        run["throughput_ratio_vs_first"] = ratios[name]
        print(f"{name}: {run['tokens_per_second']:.0f} tokens/s, forward share {run['forward_share']:.1%}, "
              f"busy share {run['busy_share']:.1%}")
    write_json(args.json, {"device": args.device, "strategy": args.strategy, "num_samples": args.num_samples,
                           "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "runs": list(best.values()),
                           "forward_share_target": 0.85}, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
