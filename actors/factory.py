"""The one factory that chooses local (in-process) or Ray execution for the workers, and assembles
the chain of handles through which a strategy reaches an engine.

The chain, outermost first; each layer is one class that writes out every call it passes on (no
attribute forwarding), so a reader can follow a call down:

1. row counting (pipeline.coordinator._CountedRows): one per batch, only with runtime.rows_in_flight;
   reports the batch's live rows to the coordinator's admission.
2. the role handle (GeneratorHandle / ScorerHandle, here): the Generator calls (open, extend,
   close, search, stats) or the Scorer calls (score, open, extend, close, stats). The
   coordinator asks it for ``pinned()`` per batch (a generator) or per streaming session (a
   scorer): the same handle bound to the actor that holds the session, so that after a replacement
   the session's calls fail over (WorkerFailure, the batch rerun) instead of reaching an actor that
   never saw it.
3. timing: the slot's CallLedger (pipeline.observability) gives each work call a CallTiming, and
   totals the round trips; ``Workers.stats()["actor_time"]`` says where the actors' time went.
   Handles on bare engines (tests) have no ledger: their calls carry none.
4. transport: RemoteProxy / PinnedActor (actors.remote): a Ray call under the call clock and
   runtime.call_timeout_s, a dead or hung actor replaced by one started the same way (same
   placement-group bundle); or InProcess (here): a direct call, one at a time under a lock unless
   the worker takes concurrent calls.
5. the actor (GeneratorActor / RewardActor): the call inside the actor's timeline.
6. the engine.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.faults import parse_faults, with_faults
from actors.remote import (CONCURRENCY_GROUPS, ROOM_NOTICE_S, ROOM_WAIT_S, RemoteProxy, SecretEnv, cluster_capacity,
                           room_for, with_call_clock)
from pipeline.config import ActorResources, Config, ConfigError, RuntimeConfig
from pipeline.decoding.domain import RowState, SearchOutput
from pipeline.decoding.sampling import SamplingParams
from pipeline.errors import WorkerFailure
from pipeline.observability import CallLedger, kernel_note
from pipeline.strategies import lookup

log = logging.getLogger(__name__)

# The AWS settings that are not secret: a worker sees the same endpoint and region as the driver.
# Credentials never travel with an actor: Ray keeps each actor's runtime_env in its state API and
# logs it in plain text (runtime_env_agent.log). The workers read and write no storage (the driver
# reads the prompts and commits the output), so they need none; anything that does reach S3 on a
# node uses that node's own AWS environment (an instance role, or a Kubernetes Secret as AWS_*).
AWS_ENV = ("AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_REGION")
# vLLM settings that hold on every node alike (not VLLM_HOST_IP, core lists and such): the KV cache
# size in GiB of each engine on vLLM's CPU backend, instead of a fraction of the node's memory.
VLLM_ENV = ("VLLM_CPU_KVCACHE_SPACE",)
# glibc malloc tuning, the same on every node: a long HF build's generator RSS grows far past its KV
# cache when freed KV buffers stay in glibc's heap (its mmap threshold rises to their size); a fixed
# MALLOC_MMAP_THRESHOLD_ returns them to the system (docs/benchmarks.md, "Generator memory").
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")
# Hugging Face and cache settings that are not secret: where models and datasets are cached, offline
# modes, the Hub endpoint, download tuning. Every HF_* variable but the tokens counts (HF_HUB_*,
# HF_XET_*, ...), and these others besides.
HF_ENV = ("HUGGINGFACE_HUB_CACHE", "HUGGINGFACE_ASSETS_CACHE", "TRANSFORMERS_CACHE", "TRANSFORMERS_OFFLINE",
          "TORCH_HOME", "XDG_CACHE_HOME", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
# Hugging Face tokens: a gated model (Llama) needs one on every node that loads it. They reach a Ray
# actor as a constructor argument (actors.remote.SecretEnv), never through its runtime_env.
HF_SECRET_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
# storage_options keys (s3fs) that are not secret, and the AWS variable that carries each to a worker.
STORAGE_ENV = {"endpoint_url": "AWS_ENDPOINT_URL"}


class InProcess:
    """The transport to a worker in the driver's process: a direct call, one at a time under a lock
    (as an actor that serves one call at a time takes them) unless ``concurrent`` (a generator with
    continuous batching takes the coordinator's threads at once). There is no other actor to
    reach, so it is its own pinned view, and it is never restarted."""

    restarts = 0
    lost = None

    def __init__(self, worker: Any, concurrent: bool = False):
        self.worker = worker
        self._one_at_a_time = contextlib.nullcontext() if concurrent else threading.Lock()

    def call(self, method: str, *args, **kwargs) -> Any:
        with self._one_at_a_time:
            return getattr(self.worker, method)(*args, **kwargs)

    def pinned(self) -> InProcess:
        return self

    def glance(self, method: str) -> Any:
        """A read-only call that does not wait for the work under way (the progress line's KV use)."""
        return getattr(self.worker, method)()


def _glance(transport: Any, method: str) -> Any:
    """``transport.glance(method)``, or None: a transport without glances, or one that fails (a
    restarting actor). Never raises: the caller only reports it."""
    try:
        return transport.glance(method)
    except Exception:  # noqa: BLE001 - a progress figure is never worth failing a build
        return None


class _Handle:
    """What both role handles are made of: a transport (InProcess, RemoteProxy or PinnedActor) and
    the slot's CallLedger, None for a worker that takes no timing (a bare engine)."""

    def __init__(self, transport: Any, ledger: CallLedger | None = None):
        self.transport = transport
        self.ledger = ledger

    @property
    def restarts(self) -> int:
        """Replacement actors the slot has started (0 in-process)."""
        return self.transport.restarts

    @property
    def lost(self) -> str | None:
        """Why the slot was given up (a lost node whose actor no other node had room for), or None."""
        return getattr(self.transport, "lost", None)

    def pinned(self):
        """This handle bound to the actor its transport reaches now, timed into the same ledger;
        the handle itself where that is the only actor (in-process)."""
        transport = self.transport.pinned()
        return self if transport is self.transport else type(self)(transport, self.ledger)

    def stats(self) -> dict:
        return self.transport.call("stats")

    def _work(self, method: str, *args, **kwargs) -> Any:
        """A work call: through the ledger, which adds its CallTiming, when there is one."""
        if self.ledger is None:
            return self.transport.call(method, *args, **kwargs)
        return self.ledger.call(self.transport.call, method, *args, **kwargs)


class GeneratorHandle(_Handle):
    """A generator slot as the coordinator holds it (the Generator protocol)."""

    def open(self, session: str, prompts: list[list[int]], num_samples: int, seeds: list[int],
             sampling: SamplingParams, rewards: bool = False) -> None:
        asked = {"rewards": True} if rewards else {}  # only when asked: see Generator.open
        return self._work("open", session, prompts, num_samples, seeds, sampling, **asked)

    def extend(self, session: str, until: int, keep: list[int] | None = None) -> list[RowState]:
        return self._work("extend", session, until=until, keep=keep)

    def close(self, session: str) -> dict:
        return self._work("close", session)

    def capacity(self, prompts: list[list[int]], until: int) -> int:
        return self._work("capacity", prompts, until)

    def search(self, search: Callable[..., list[SearchOutput]], prompts: list[list[int]], num_samples: int,
               seeds: list[int], sampling: SamplingParams, params: object) -> list[SearchOutput]:
        return self._work("search", search, prompts, num_samples, seeds, sampling, params)


class ScorerHandle(_Handle):
    """A reward slot as the coordinator holds it (the Scorer protocol, with streaming sessions)."""

    def score(self, prompts: list, responses: list[str], finished: list[bool] | None = None,
              columns: list[dict] | None = None) -> list[float]:
        return self._work("score", prompts, responses, finished=finished, columns=columns)

    def open(self, session: str, prompts: list, num_samples: int, columns: list[dict] | None = None) -> None:
        return self._work("open", session, prompts, num_samples, columns=columns)

    def extend(self, session: str, rows: list[int], responses: list[str],
               finished: list[bool] | None = None) -> list[float]:
        return self._work("extend", session, rows, responses, finished=finished)

    def close(self, session: str) -> dict:
        return self._work("close", session)


def local_generator(worker: Any, concurrent: bool = False, timed: bool = True) -> GeneratorHandle:
    """A handle on an in-process generator: an actor (GeneratorActor, or a simulation of one; ``timed``:
    its work calls take a CallTiming) or a bare engine (``timed`` false). ``concurrent``: calls are
    not serialized (an engine or actor with continuous batching)."""
    return GeneratorHandle(InProcess(worker, concurrent), CallLedger() if timed else None)


def local_scorer(worker: Any, timed: bool = True) -> ScorerHandle:
    """A handle on an in-process reward worker, one call at a time (see local_generator)."""
    return ScorerHandle(InProcess(worker), CallLedger() if timed else None)


@dataclass
class Workers:
    """A build's workers: the handles the coordinator takes, and how to end them."""

    generators: list[GeneratorHandle]
    scorers: list[ScorerHandle]
    handles: list[Any] = field(default_factory=list)
    """The Ray actor handles started (generators, rewards, draft actors); empty in-process."""
    shutdown: Callable[[], None] = lambda: None

    def stats(self) -> dict:
        """Totals over the actors: tokens and forward passes, restarts, and ``actor_time``, where the
        actors' wall time went per role (``actor_time_of``; absent for workers that keep no timeline).
        The figures are the current actors': an actor replaced after a fault took its own with it."""
        gen = [g.stats() for g in self.generators]
        rew = [s.stats() for s in self.scorers]
        stats = {
            "generated_tokens": sum(s["generated_tokens"] for s in gen),
            "generator_forward_passes": sum(s["forward_passes"] for s in gen),
            "reward_forward_passes": sum(s["forward_passes"] for s in rew),
            "reward_tokens_read": sum(int(s.get("tokens_read", 0)) for s in rew),
            "actor_restarts": self.restarts(),
        }
        roles = {"generator": actor_time_of(gen, self.generators), "reward": actor_time_of(rew, self.scorers)}
        if any(roles.values()):
            stats["actor_time"] = {role: times for role, times in roles.items() if times}
        kv = [{k: v for k, v in s.items() if k.startswith("kv_")} for s in gen]
        if any(kv):  # each HF generator's KV cache (pipeline.engines.kv_cache.KVCache.stats)
            stats["generator_kv"] = kv
        reward_kv = [{k: v for k, v in s.items() if k.startswith("kv_")} for s in rew]
        if any(reward_kv):  # each HF reward scorer's streaming pool (pipeline.engines.rewards)
            stats["reward_kv"] = reward_kv
        return stats

    def kv_use(self) -> dict | None:
        """The generators' KV caches now, summed (blocks used and total, bytes total, preemptions),
        read beside the work under way; None where no generator has a paged cache or none answers."""
        seen = [kv for kv in (_glance(g.transport, "kv_use") for g in self.generators) if kv]
        if not seen:
            return None
        return {**{key: sum(kv[key] for kv in seen)
                   for key in ("kv_blocks_used", "kv_blocks_total", "kv_bytes_total", "kv_preemptions")},
                "kv_kernel_note": kernel_note(seen)}

    def restarts(self) -> int:
        return sum(w.restarts for w in self.generators + self.scorers)


def actor_time_of(stats: list[dict], workers: list[Any]) -> dict | None:
    """One role's time: ``per_actor`` (each actor's timeline, pipeline.observability.ActorTimeline,
    plus what its driver-side ledger saw) and the same figures summed over the role's actors:

    - ``span_seconds`` and ``breakdown_seconds``: the actor's span and the parts it splits into
      (they sum to the span);
    - ``busy_seconds`` (inside its calls), ``queued_seconds``, ``calls``, ``forward_passes``;
    - ``round_trip_seconds``: the driver's round trips of those calls (sent to result received);
    - ``ray_transit_seconds``: round trips minus the calls' durations (``call_seconds``; busy
      seconds unless calls overlap) minus queued seconds: Ray's whole share of the
      calls, both legs, including legs that overlapped other work on the actor (``ray_calls`` in the
      breakdown counts only the actor's idle time).

    None when no actor of the role keeps a timeline (workers built by hand)."""
    actors = []
    for s, worker in zip(stats, workers):
        if "time" not in s:
            continue
        actor = dict(s["time"])
        if worker.ledger is not None:
            round_trips = worker.ledger.round_trip_seconds
            actor.update(round_trip_seconds=round_trips,
                         ray_transit_seconds=round_trips - actor["call_seconds"] - actor["queued_seconds"])
        actors.append(actor)
    if not actors:
        return None
    total = {key: sum(a[key] for a in actors) for key in actors[0] if key != "breakdown_seconds"
             and all(key in a for a in actors)}
    total["breakdown_seconds"] = {k: sum(a["breakdown_seconds"][k] for a in actors)
                                  for k in actors[0]["breakdown_seconds"]}
    return {**total, "per_actor": actors}


def _draft_model(config: Config) -> str | None:
    """The draft model to load, only for strategies that draft (their registry record's uses_draft).
    None when models.draft is empty: the strategy then drafts with ADED (pipeline.decoding.dsbd.search)."""
    if not lookup(config.strategy.name).uses_draft:
        return None
    return config.models.draft or None


def hf_env() -> dict[str, str]:
    """The driver's Hugging Face and cache settings that are not secret (every ``HF_*`` variable but
    HF_SECRET_ENV, and HF_ENV)."""
    return {k: v for k, v in os.environ.items()
            if (k.startswith("HF_") and k not in HF_SECRET_ENV) or k in HF_ENV}


def secret_env() -> SecretEnv:
    """The driver's Hugging Face tokens (HF_SECRET_ENV), for the actors (actors.remote.SecretEnv)."""
    return SecretEnv({k: os.environ[k] for k in HF_SECRET_ENV if os.environ.get(k)})


def ray_runtime_env(storage_options: dict | None = None) -> dict:
    """Environment the Ray workers get: the driver's non-secret AWS settings (AWS_ENV) and
    ``data.storage_options``' endpoint (which wins), its Hugging Face and cache settings (hf_env:
    HF_HOME, HF_HUB_OFFLINE, HF_ENDPOINT, ...), its VLLM_ENV and MALLOC_ENV. Never a key, secret or token: see
    AWS_ENV; the Hugging Face token goes as an actor argument (secret_env)."""
    env = {k: os.environ[k] for k in AWS_ENV + VLLM_ENV + MALLOC_ENV if k in os.environ}
    env.update(hf_env())
    for key, var in STORAGE_ENV.items():
        if (storage_options or {}).get(key):
            env[var] = str(storage_options[key])
    return {"env_vars": env} if env else {}


def engine_settings(config: Config, role: str) -> dict | None:
    """``vllm.LLM`` keywords of ``role``'s engine (generator: models.vllm; reward: models.reward_vllm),
    None where that role does not run on vLLM. An engine that spans several GPUs inside one Ray actor
    gets ``distributed_executor_backend: mp`` unless the config names one: vLLM's Ray executor would
    ask Ray for GPUs the actor already holds and wait for them forever."""
    m = config.models
    if m.vllm_settings(role) is None:
        return None
    settings = dict(m.vllm_settings(role))
    if m.engine_gpus(role) > 1:
        settings.setdefault("distributed_executor_backend", "mp")
    return settings


def uses_gpu(config: Config, role: str) -> bool:
    """Whether ``role``'s actors (generator, reward, draft) run their model on a GPU: models.device
    cuda, or (vLLM, which picks its own device) GPUs reserved for them."""
    resources = getattr(config.runtime, role)
    return config.models.device.startswith("cuda") or resources.num_gpus > 0


def actor_resources(config: Config, role: str) -> ActorResources:
    """What one ``role`` actor asks Ray for: runtime.<role>, with at least the GPUs its vLLM engine
    spans (tensor_parallel_size x pipeline_parallel_size) when it runs on vLLM on a GPU."""
    resources = getattr(config.runtime, role)
    if engine_settings(config, role) is None or not uses_gpu(config, role):
        return resources
    return ActorResources(num_cpus=resources.num_cpus,
                          num_gpus=max(resources.num_gpus, config.models.engine_gpus(role)))


@dataclass
class _ActorPlan:
    """How each actor kind is started: the same classes and arguments in-process and on Ray."""

    generator_cls: type
    """GeneratorActor, wrapped by the fault plan (actors.faults) when it names generators."""
    generator_args: tuple
    generator_kwargs: dict
    reward_cls: type
    """RewardActor, wrapped by the fault plan when it names rewards."""
    reward_args: tuple
    reward_kwargs: dict
    generator_resources: ActorResources
    """What each generator actor asks Ray for (actor_resources: GPUs for its vLLM engine's parallelism)."""
    reward_resources: ActorResources
    draft_actor_args: tuple | None
    """DraftActor arguments when the draft model runs in its own actors (runtime.draft_placement
    actor, on Ray); None when it runs inside each generator, or when there is none."""


def _plan_actors(config: Config) -> _ActorPlan:
    """The actor classes (with the fault plan) and arguments that ``config`` asks for."""
    m, rt = config.models, config.runtime
    draft = _draft_model(config)
    draft_actors = bool(draft) and rt.draft_placement == "actor" and not rt.local
    faults = parse_faults(rt.faults)
    from actors.generator import GeneratorActor
    from actors.reward import RewardActor

    return _ActorPlan(
        generator_cls=with_faults(GeneratorActor, "generator", faults),
        generator_args=(m.generator, m.device, m.dtype, max(1, int(rt.generator.num_cpus))),
        generator_kwargs={"draft": None if draft_actors else draft, "backend": m.backend,
                          "continuous_batching": rt.continuous_batching, "prepack": m.cpu_prepack,
                          "speculative": m.speculative if m.speculative.enabled else None,
                          "load": m.hf.load_kwargs("generator"), "draft_load": m.hf.load_kwargs("draft"),
                          "vllm": engine_settings(config, "generator"),
                          "kv_cache_memory": rt.kv_cache_memory, "heap": rt.bound_heap,
                          "kv_rows": rt.rows_in_flight or None},
        reward_cls=with_faults(RewardActor, "reward", faults),
        reward_args=(m.rewards, m.device, m.dtype, max(1, int(rt.reward.num_cpus)), rt.reward_batch_size,
                     m.cpu_prepack),
        reward_kwargs={"load": m.hf.load_kwargs("reward"), "backend": m.reward_backend,
                       "vllm": engine_settings(config, "reward"), "cache_mb": rt.reward_cache_mb,
                       "weights": m.reward_weights, "pass_tokens": rt.reward_pass_tokens, "heap": rt.bound_heap},
        generator_resources=actor_resources(config, "generator"),
        reward_resources=actor_resources(config, "reward"),
        draft_actor_args=(draft, m.device, m.dtype, max(1, int(rt.draft.num_cpus)), m.cpu_prepack,
                          m.hf.load_kwargs("draft"))
        if draft_actors else None)


def start_workers(config: Config) -> Workers:
    """The generators and reward models: in-process (runtime.local), or as Ray actors, each behind a
    RemoteProxy that replaces it when it dies or hangs."""
    plan = _plan_actors(config)
    if config.runtime.local:
        return _start_local(plan, config.runtime)
    return _start_ray(plan, config)


def _start_local(plan: _ActorPlan, rt: RuntimeConfig) -> Workers:
    """In the driver's process, each worker serialized (one call at a time, as an actor would be),
    except a generator with continuous batching, which takes the coordinator's threads at once."""
    # In-process there is no node to join: a range starts its max.
    gens = [plan.generator_cls(*plan.generator_args, **plan.generator_kwargs) for _ in range(rt.generator_range[1])]
    rewards = [plan.reward_cls(*plan.reward_args, **plan.reward_kwargs) for _ in range(rt.reward_actors)]
    continuous = plan.generator_kwargs["continuous_batching"]
    return Workers([local_generator(g, concurrent=continuous) for g in gens], [local_scorer(r) for r in rewards],
                   shutdown=functools.partial(_shutdown_local, gens + rewards))


def _shutdown_local(workers: list) -> None:
    """Free the in-process workers' engines (generators', and reward models' on vLLM): a vLLM
    engine's processes and KV cache would otherwise stay until the driver exits."""
    for worker in workers:
        worker.shutdown()


def _start_ray(plan: _ActorPlan, config: Config) -> Workers:
    """Ray actors, one bundle each when there is a placement group: generators, rewards, then the
    draft actors."""
    import ray

    rt = config.runtime
    started_here = _attach_ray()
    _check_capacity(plan, rt, grows=not started_here)
    group = _reserve_placement_group(rt, plan)
    place = _RayPlacement(ray_runtime_env(config.data.storage_options), group, secret_env())
    drafts: dict[int, Any] = {}  # generator index -> its current DraftActor (placement "actor")
    low, high = rt.generator_range
    gens = [RemoteProxy(spawn=_generator_spawner(plan, rt, place, i, drafts), name=f"generator {i}",
                        timeout_s=rt.call_timeout_s, request=_request(plan.generator_resources),
                        bundle=(group, i) if group is not None else None)
            for i in range(low)]
    rewards = [RemoteProxy(spawn=place.spawner(plan.reward_cls, plan.reward_args, plan.reward_resources,
                                               low + i, plan.reward_kwargs),
                           name=f"reward {i}", timeout_s=rt.call_timeout_s, request=_request(plan.reward_resources),
                           bundle=(group, low + i) if group is not None else None)
               for i in range(rt.reward_actors)]
    proxies = gens + rewards
    # Surface model-loading errors now, not on the first call; an actor no node takes within
    # ROOM_WAIT_S is a one-line error, not a wait for ever.
    try:
        for proxy in proxies:
            proxy.await_start()
    except WorkerFailure as exc:
        _shutdown_ray(proxies, drafts, group)
        raise ConfigError(f"{exc}; lower runtime.<role>.num_cpus / num_gpus or the actor counts") from None
    generators = [GeneratorHandle(g, CallLedger()) for g in gens]
    grower = None
    if high > low:
        grower = _Grower(functools.partial(_generator_spawner, plan, rt, place, drafts=drafts, in_group=False),
                         rt, generators, proxies, _request(plan.generator_resources))
        grower.start()
    return Workers(generators, [ScorerHandle(r, CallLedger()) for r in rewards],
                   [p.handle for p in proxies] + list(drafts.values()),
                   functools.partial(_shutdown_ray, proxies, drafts, place.group, grower))


class _Grower(threading.Thread):
    """runtime.generator_actors as a range [min, max]: while the build runs, start one more generator
    whenever a live node has room for it, up to max, and hand it to the coordinator by appending it
    to the workers' generator list (pipeline.coordinator._Admission reads the list as it is). The
    new actors are outside the placement group: its bundles were reserved for min."""

    POLL_S = 2.0
    """How often the cluster's free resources are read."""

    def __init__(self, spawner: Callable[..., Callable[[], Any]], rt: RuntimeConfig, generators: list,
                 proxies: list[RemoteProxy], request: dict[str, float]):
        super().__init__(name="generator-grower", daemon=True)
        self._spawner, self._rt, self._generators, self._proxies = spawner, rt, generators, proxies
        self._request = request
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        import ray

        low, high = self._rt.generator_range
        while not self._stopped.wait(self.POLL_S) and len(self._generators) < high:
            if not _room_for(self._request):
                continue
            i = len(self._generators)
            proxy = RemoteProxy(spawn=self._spawner(i=i), name=f"generator {i}", timeout_s=self._rt.call_timeout_s,
                                request=self._request)
            self._proxies.append(proxy)  # the shutdown kills it, started or not
            try:
                proxy.await_start()
            except Exception as exc:  # noqa: BLE001 - the room went elsewhere, or it failed to load: try later
                if not self._stopped.is_set():
                    log.warning(f"generator {i}: not added ({exc}); the pool stays at {i}")
                ray.kill(proxy.handle, no_restart=True)
                self._proxies.remove(proxy)
                continue
            if self._stopped.is_set():
                return
            self._generators.append(GeneratorHandle(proxy, CallLedger()))
            log.info(f"generator {i} added (runtime.generator_actors [{low}, {high}]: a node had room for it); "
                     f"{len(self._generators)} generators")


def _room_for(request: dict[str, float]) -> bool:
    """actors.remote.room_for, False where Ray's per-node view cannot be read (then no growth)."""
    try:
        return room_for(request)
    except Exception:  # noqa: BLE001
        return False


def _attach_ray() -> bool:
    """Join the cluster RAY_ADDRESS names, or start a local one, unless Ray is already up; True when
    this call started the cluster (it then has this machine's resources and cannot grow).

    The workers' environment (ray_runtime_env) goes with each actor, not here: under ``ray job
    submit --runtime-env-json`` the job's runtime_env already holds the variables the driver sees,
    and ray.init refuses a second copy of any of them ("Failed to merge the Job's runtime env ...
    because of a conflict"). An actor's own env_vars are merged with the job's, key by key."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
        return False
    # With no cluster to attach to we start a local one. Its dashboard (the Jobs API) listens on
    # 127.0.0.1 (ray.init's default), but Ray binds its gRPC servers (GCS, raylet, workers, agents)
    # to every interface and advertises the node's address whatever _node_ip_address says (Ray
    # 2.60 resolves 127.0.0.1 to it), so a token guards them: ray.init turns token authentication
    # on for a new local cluster unless RAY_AUTH_MODE says otherwise (Ray 2.59 on; with Ray
    # 2.52-2.58 export RAY_AUTH_MODE=token before the build). Setting it here would be too late:
    # the driver's Ray core has read its mode by now and would connect without the token.
    # address="local": never attach to whatever cluster a stale address file points at.
    ray.init(address="local", _node_ip_address="127.0.0.1")
    return True


def _request(resources: ActorResources) -> dict[str, float]:
    """The Ray resources one actor asks for, as Ray names them."""
    return {"CPU": resources.num_cpus, **({"GPU": resources.num_gpus} if resources.num_gpus else {})}


def _check_capacity(plan: _ActorPlan, rt: RuntimeConfig, grows: bool) -> None:
    """Before any actor starts: refuse (ConfigError, one line, exit 2) actors the cluster's live nodes
    could never hold (pipeline.preflight.check_placement) on a cluster that cannot grow (``grows``
    false: the build started it); on one an autoscaler may grow, say so on the progress line, and
    the actors' start waits ROOM_WAIT_S for room (RemoteProxy.await_start)."""
    import ray

    from pipeline.preflight import check_placement

    requests = [("runtime.generator", rt.generator_range[0], _request(plan.generator_resources)),
                ("runtime.reward", rt.reward_actors, _request(plan.reward_resources))]
    if plan.draft_actor_args is not None:
        requests.append(("runtime.draft", rt.generator_range[0], _request(rt.draft)))
    reason = check_placement(requests, [n["Resources"] for n in ray.nodes() if n.get("Alive")], rt.placement_strategy)
    if reason is None:
        return
    if not grows:
        raise ConfigError(f"{reason} (a local cluster this build started; it cannot grow)")
    log.warning(f"{reason}; waiting up to {ROOM_WAIT_S:g} s for the cluster to grow (an autoscaler)")


def _reserve_placement_group(rt: RuntimeConfig, plan: _ActorPlan):
    """runtime.placement_strategy's group, ready before any actor starts: one bundle per generator,
    reward and draft actor, in that order. None without a placement strategy."""
    if not rt.placement_strategy:
        return None
    import ray
    from ray.util.placement_group import placement_group

    generators = rt.generator_range[0]
    resources = [plan.generator_resources] * generators + [plan.reward_resources] * rt.reward_actors
    if plan.draft_actor_args is not None:
        resources += [rt.draft] * generators
    group = placement_group([_request(r) for r in resources], strategy=rt.placement_strategy)
    ready, _ = ray.wait([group.ready()], timeout=ROOM_NOTICE_S)
    if not ready:
        log.warning(f"runtime.placement_strategy {rt.placement_strategy}: the placement group is not placed yet; "
                    f"waiting up to {ROOM_WAIT_S:g} s (the cluster has {cluster_capacity()})")
        ready, _ = ray.wait([group.ready()], timeout=ROOM_WAIT_S)
    if not ready:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)
        raise ConfigError(f"runtime.placement_strategy {rt.placement_strategy}: no placement of its "
                          f"{len(resources)} bundles within {ROOM_WAIT_S:g} s; the cluster has {cluster_capacity()}")
    return group


@dataclass
class _RayPlacement:
    """Where the Ray actors start: the environment every worker gets, and the placement group (if any)."""

    runtime_env: dict
    group: Any = None
    secrets: SecretEnv | None = None
    """The driver's Hugging Face token, given to every actor (secret_env); None: none."""

    def spawner(self, cls: type, args: tuple, resources: ActorResources, bundle: int | None,
                kwargs: dict | None = None, max_concurrency: int = 1) -> Callable[..., Any]:
        """A function that starts a fresh ``cls`` actor with these options in bundle ``bundle`` (None:
        outside the group) at each
        call (keyword arguments it is given join ``kwargs``): a RemoteProxy's spawn. ``max_concurrency``
        > 1: a threaded actor that runs that many calls at once."""
        import ray

        # concurrency_groups: the call clock (actors.remote.with_call_clock) answers beside the work
        # calls, so a call's timeout runs from its start on the actor, not from its send.
        options: dict = {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus, "max_restarts": 0,
                         "runtime_env": self.runtime_env or None}
        if max_concurrency > 1:
            options["max_concurrency"] = max_concurrency
        if self.group is not None and bundle is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self.group,
                                                                              placement_group_bundle_index=bundle)
        remote_cls = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(with_call_clock(cls)).options(**options)
        secrets = {"secret_env": self.secrets} if self.secrets else {}
        return lambda **extra: remote_cls.remote(*args, **(kwargs or {}), **secrets, **extra)


def _generator_spawner(plan: _ActorPlan, rt: RuntimeConfig, place: _RayPlacement, i: int,
                       drafts: dict[int, Any], in_group: bool = True) -> Callable[[], Any]:
    """Generator i's spawn; with draft actors, each spawn starts a fresh DraftActor first (``drafts``).
    ``in_group`` false: outside the placement group (a generator added to a range)."""
    low = rt.generator_range[0]
    # Continuous batching: the actor takes each batch in flight's calls at once (a threaded actor).
    concurrency = rt.batches_in_flight if plan.generator_kwargs["continuous_batching"] else 1
    spawn = place.spawner(plan.generator_cls, plan.generator_args, plan.generator_resources, i if in_group else None,
                          plan.generator_kwargs, max_concurrency=concurrency)
    if plan.draft_actor_args is None:
        return spawn
    from actors.draft import DraftActor

    spawn_draft = place.spawner(DraftActor, plan.draft_actor_args, rt.draft,
                                low + rt.reward_actors + i if in_group else None)
    return functools.partial(_spawn_with_draft, i, spawn, spawn_draft, drafts)


def _spawn_with_draft(i: int, spawn_generator: Callable[..., Any], spawn_draft: Callable[[], Any],
                      drafts: dict[int, Any]) -> Any:
    """Start generator i with its own new DraftActor. A replaced generator gets a fresh draft actor
    too: the old one may be what failed."""
    import ray

    if i in drafts:
        ray.kill(drafts[i], no_restart=True)
    drafts[i] = spawn_draft()
    return spawn_generator(draft_actor=drafts[i])


def _shutdown_ray(proxies: list[RemoteProxy], drafts: dict[int, Any], group, grower: _Grower | None = None) -> None:
    """Kill every actor (the draft actors current at shutdown among them) and free the placement group.
    The proxies are retired first: a build that ends on an error still has batches in flight, and the
    actors' deaths must end them, not start replacements (actors.remote.WorkersShutDown). The grower
    (a range of generators) is stopped first, so that it adds none after."""
    import ray

    if grower is not None:
        grower.stop()
    for proxy in list(proxies):
        proxy.retire()
    for handle in [p.handle for p in list(proxies)] + list(drafts.values()):
        ray.kill(handle)
    if group is not None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)
