"""The one factory that chooses local (in-process) or Ray execution for the workers.

On Ray each actor sits behind a RemoteProxy (actors.remote), a stable slot the coordinator holds,
which replaces a dead or hung actor with one started the same way (same placement-group bundle).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.faults import parse_faults, with_faults
from pipeline.config import Config
from pipeline.coordinator import Serialized

from actors.remote import RemoteProxy
from pipeline.methods import method

AWS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
           "AWS_DEFAULT_REGION", "AWS_REGION")
# storage_options keys (s3fs) and the AWS variables that carry the same setting to a worker.
STORAGE_ENV = {"key": "AWS_ACCESS_KEY_ID", "secret": "AWS_SECRET_ACCESS_KEY", "token": "AWS_SESSION_TOKEN",
               "endpoint_url": "AWS_ENDPOINT_URL"}


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
            "actor_restarts": self.restarts(),
        }

    def restarts(self) -> int:
        return sum(getattr(w, "restarts", 0) for w in self.generators + self.scorers)


def _draft_model(config: Config) -> str | None:
    """The draft model to load, only for strategies that draft (their registry record's uses_draft).
    None when models.draft is empty: the strategy then drafts with ADED (pipeline.decoding.dsbd.search)."""
    if not method(config.strategy.name).uses_draft:
        return None
    return config.models.draft or None


def ray_runtime_env(storage_options: dict | None = None) -> dict:
    """Environment the Ray workers need for s3://: the AWS_* variables of the driver, plus the
    endpoint and credentials of ``data.storage_options`` (which win)."""
    env = {k: os.environ[k] for k in AWS_ENV if k in os.environ}
    for key, var in STORAGE_ENV.items():
        if (storage_options or {}).get(key):
            env[var] = str(storage_options[key])
    return {"env_vars": env} if env else {}


def start_workers(config: Config) -> Workers:
    m, rt = config.models, config.runtime
    draft = _draft_model(config)
    draft_actors = bool(draft) and rt.draft_placement == "actor" and not rt.local
    faults = parse_faults(rt.faults)
    from actors.generator import GeneratorActor
    from actors.reward import RewardActor

    generator_cls = with_faults(GeneratorActor, "generator", faults)
    reward_cls = with_faults(RewardActor, "reward", faults)
    gen_args = (m.generator, m.device, m.dtype, max(1, int(rt.generator.num_cpus)))
    gen_kwargs = {"draft": None if draft_actors else draft, "backend": m.backend}
    rew_args = (m.reward, m.device, m.dtype, max(1, int(rt.reward.num_cpus)), rt.reward_batch_size)
    if rt.local:
        gens = [generator_cls(*gen_args, **gen_kwargs) for _ in range(rt.generator_actors)]
        rewards = [reward_cls(*rew_args) for _ in range(rt.reward_actors)]
        return Workers([Serialized(g) for g in gens], [Serialized(r) for r in rewards])

    import ray

    runtime_env = ray_runtime_env(config.data.storage_options)
    if not ray.is_initialized():
        # With no cluster to attach to, the local one we start listens on loopback only.
        # address="local": never attach to whatever cluster a stale address file points at.
        local = {} if os.environ.get("RAY_ADDRESS") else {"address": "local", "_node_ip_address": "127.0.0.1"}
        ray.init(runtime_env=runtime_env or None, **local)
    resources = [rt.generator] * rt.generator_actors + [rt.reward] * rt.reward_actors
    if draft_actors:
        resources += [rt.draft] * rt.generator_actors
    group = None
    if rt.placement_strategy:
        from ray.util.placement_group import placement_group

        bundles = [{"CPU": r.num_cpus, **({"GPU": r.num_gpus} if r.num_gpus else {})} for r in resources]
        group = placement_group(bundles, strategy=rt.placement_strategy)
        ray.get(group.ready(), timeout=rt.call_timeout_s)

    def spawner(cls, args, res, bundle: int, kwargs: dict | None = None) -> Callable[[], Any]:
        options: dict = {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus, "max_restarts": 0,
                         "runtime_env": runtime_env or None}
        if group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)
        remote_cls = ray.remote(cls).options(**options)
        return lambda: remote_cls.remote(*args, **(kwargs or {}))

    drafts: dict[int, Any] = {}  # generator index -> its current DraftActor (placement "actor")

    def generator_spawner(i: int) -> Callable[[], Any]:
        spawn = spawner(generator_cls, gen_args, rt.generator, i, gen_kwargs)
        if not draft_actors:
            return spawn
        from actors.draft import DraftActor

        spawn_draft = spawner(DraftActor, (draft, m.device, m.dtype, max(1, int(rt.draft.num_cpus))), rt.draft,
                              rt.generator_actors + rt.reward_actors + i)

        def spawn_pair():
            # A replaced generator gets a fresh draft actor too: the old one may be what failed.
            if i in drafts:
                ray.kill(drafts[i], no_restart=True)
            drafts[i] = spawn_draft()
            return spawner(generator_cls, gen_args, rt.generator, i, {**gen_kwargs, "draft_actor": drafts[i]})()

        return spawn_pair

    gens = [RemoteProxy(spawn=generator_spawner(i), name=f"generator {i}", timeout_s=rt.call_timeout_s)
            for i in range(rt.generator_actors)]
    rewards = [RemoteProxy(spawn=spawner(reward_cls, rew_args, rt.reward, rt.generator_actors + i),
                           name=f"reward {i}", timeout_s=rt.call_timeout_s) for i in range(rt.reward_actors)]
    proxies = gens + rewards
    # Surface model-loading errors now, not on the first call.
    ray.get([p.handle.stats.remote() for p in proxies])

    def shutdown():
        for handle in [p.handle for p in proxies] + list(drafts.values()):
            ray.kill(handle)
        if group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(group)

    return Workers(gens, rewards, [p.handle for p in proxies] + list(drafts.values()), shutdown)
