"""The one factory that chooses local (in-process) or Ray execution for the workers."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from pipeline.config import Config
from pipeline.coordinator import Serialized

AWS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
           "AWS_DEFAULT_REGION", "AWS_REGION")


class RemoteProxy:
    """Blocking method calls on a Ray actor handle, so algorithm code sees a plain object.
    Each coordinator thread blocks on its own call; many calls are in flight at once."""

    def __init__(self, handle: Any):
        self._handle = handle

    def __getattr__(self, name: str):
        import ray

        method = getattr(self._handle, name)
        return lambda *args, **kwargs: ray.get(method.remote(*args, **kwargs))


@dataclass
class Workers:
    generators: list[Any]
    scorers: list[Any]
    handles: list[Any] = field(default_factory=list)
    shutdown: Callable[[], None] = lambda: None

    def stats(self) -> dict:
        gen = [g.stats() for g in self.generators]
        return {
            "generated_tokens": sum(s["generated_tokens"] for s in gen),
            "generator_forward_passes": sum(s["forward_passes"] for s in gen),
            "reward_forward_passes": sum(s.stats()["forward_passes"] for s in self.scorers),
        }


def ray_runtime_env() -> dict:
    """Environment the Ray workers need: the AWS_* variables for s3:// and thread caps."""
    env = {k: os.environ[k] for k in AWS_ENV if k in os.environ}
    return {"env_vars": env} if env else {}


def start_workers(config: Config) -> Workers:
    m, rt = config.models, config.runtime
    if rt.local:
        from actors.generator import GeneratorActor
        from actors.reward import RewardActor

        gens = [GeneratorActor(m.generator, m.device, m.dtype, int(rt.generator.num_cpus), m.backend)
                for _ in range(rt.generator_actors)]
        rewards = [RewardActor(m.reward, m.device, m.dtype, int(rt.reward.num_cpus), rt.reward_batch_size)
                   for _ in range(rt.reward_actors)]
        return Workers([Serialized(g) for g in gens], [Serialized(r) for r in rewards])

    import ray

    from actors.generator import GeneratorActor
    from actors.reward import RewardActor

    if not ray.is_initialized():
        # With no cluster to attach to, the local one we start listens on loopback only.
        local = {} if os.environ.get("RAY_ADDRESS") else {"_node_ip_address": "127.0.0.1"}
        ray.init(runtime_env=ray_runtime_env() or None, **local)
    gen_cls = ray.remote(num_cpus=rt.generator.num_cpus, num_gpus=rt.generator.num_gpus, max_restarts=0)(GeneratorActor)
    rew_cls = ray.remote(num_cpus=rt.reward.num_cpus, num_gpus=rt.reward.num_gpus, max_restarts=0)(RewardActor)
    gens = [gen_cls.remote(m.generator, m.device, m.dtype, max(1, int(rt.generator.num_cpus)), m.backend)
            for _ in range(rt.generator_actors)]
    rewards = [rew_cls.remote(m.reward, m.device, m.dtype, max(1, int(rt.reward.num_cpus)), rt.reward_batch_size)
               for _ in range(rt.reward_actors)]
    handles = gens + rewards
    # Surface model-loading errors now, not on the first call.
    ray.get([h.stats.remote() for h in handles])

    def shutdown():
        for h in handles:
            ray.kill(h)

    return Workers([RemoteProxy(g) for g in gens], [RemoteProxy(r) for r in rewards], handles, shutdown)
