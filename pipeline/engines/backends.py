"""The backend registry: one record per engine backend (``hf``, ``vllm``), and the engine contract.

Config (models.backend / models.reward_backend choices, which strategies a backend serves), the actor
factory (which settings an engine takes, the GPUs it spans) and the strategy registry
(which backends serve a strategy) all read BACKENDS; nothing else lists backends.

A backend declares what it serves:

- ``sessions``: the Engine protocol's open / extend / close, which coordinator-side strategies drive
  (best_of_n, sbon);
- ``search``: SearchEngine.search, which runs a model-side strategy's search function wholly inside
  the engine's process (ults, aded, sla, dsbd), with a drafter for those that draft.

A strategy runs on a backend when the backend serves what the strategy needs (``Strategy.needs``).

Adding a backend = one engine module in pipeline/engines (a class satisfying Engine, or SearchEngine
when it serves ``search``, with a ``from_pretrained``; a reward scorer if it scores too) and one record
below; tests/test_backends.py then runs the contract against it where it can run.

This module imports no engine: the loaders are dotted paths, imported when an actor loads a model.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from pipeline.decoding.domain import RowState
from pipeline.decoding.sampling import SamplingParams
from pipeline.errors import ConfigError

SESSIONS, SEARCH = "sessions", "search"


@runtime_checkable
class Engine(Protocol):
    """What a generator engine is to its GeneratorActor (actors/generator.py), and through it to the
    coordinator: the Generator protocol (pipeline.decoding.domain.Generator) over sessions that keep
    their rows (and KV cache) in the engine between calls, plus counters and shutdown."""

    sessions: dict
    """The open sessions, by id (the actor's timeline counts them)."""
    continuous_batching: bool
    """True: concurrent calls share one continuously batched step loop (the actor may call it from
    several threads at once); False: calls must come one at a time (the actor serializes them)."""

    def open(self, session: str, prompts: list[list[int]], num_samples: int, seeds: list[int],
             sampling: SamplingParams) -> None: ...

    def extend(self, session: str, until: int, keep: list[int] | None = None) -> list[RowState]: ...

    def close(self, session: str) -> dict: ...

    def stats(self) -> dict:
        """At least generated_tokens, forward_passes and open_sessions."""

    def shutdown(self) -> None:
        """Free the engine's processes and memory; it serves nothing afterwards."""


@runtime_checkable
class SearchEngine(Engine, Protocol):
    """An engine that also runs model-side strategies: ``search(fn, ...)`` calls the strategy's
    search function ``fn(host, prompts, num_samples, seeds, sampling, params)`` with the engine's own
    host (pipeline.engines.adapters.HFSearchHost for HF) and returns its SearchOutputs."""

    drafter: Any
    """A Drafter for the strategies that draft (dsbd), set by the GeneratorActor; None: ADED drafts."""

    def search(self, search, prompts: list[list[int]], num_samples: int, seeds: list[int],
               sampling: SamplingParams, params) -> list: ...


@dataclass(frozen=True)
class EngineOptions:
    """Everything an engine may load with; each backend's engine takes what applies to it
    (``from_options``)."""

    device: str = "cpu"
    """models.device (the HF engine; vLLM picks its own)."""
    dtype: str = "float32"
    num_threads: int = 1
    """CPU threads of the model (the actor's runtime.<role>.num_cpus)."""
    continuous_batching: bool = False
    """runtime.continuous_batching: concurrent calls share one continuous batch."""
    speculative: Any = None
    """models.speculative when enabled (pipeline.decoding.speculative.SpeculativeDecoding), else None."""
    prepack: bool = True
    """models.cpu_prepack (HF on CPU)."""
    load: dict | None = None
    """``from_pretrained`` keywords (models.hf's, for this role)."""
    settings: dict | None = None
    """The backend's own engine keywords (``Backend.settings``: models.vllm / models.reward_vllm)."""
    batch_size: int = 32
    """Sequences per reward-model forward pass (runtime.reward_batch_size; reward scorers only)."""
    kv_cache_memory: Any = None
    """runtime.kv_cache_memory: the HF generator's KV cache budget (pipeline.engines.backends.parse_memory)."""
    bound_heap: bool = False
    kv_rows: int | None = None
    """runtime.rows_in_flight: the rows the HF generator's compiled decode attention serves in one
    step (its largest row bucket, pipeline.engines.attention_kernel); None: MAX_ROWS."""
    """runtime.bound_heap: glibc heap tuning for the actor's process (HF engines)."""
    reward_pass_tokens: int | None = None
    """runtime.reward_pass_tokens: padded tokens per reward forward pass (None: the device's default)."""
    reward_cache_bytes: int | None = None
    """The HF scorer's streaming sessions' block pool, in bytes (runtime.reward_cache_mb);
    None: the device's default (pipeline.engines.kv_cache)."""


@dataclass(frozen=True)
class Backend:
    name: str
    """models.backend / models.reward_backend."""
    summary: str
    """One line for help texts and errors."""
    serves: frozenset[str]
    """SESSIONS, SEARCH: what its generator engine serves (see the module docstring)."""
    generator: str
    """``module:Class`` of its generator engine; ``Class.from_options(model, EngineOptions)`` loads it."""
    reward: str
    """``module:Class`` of its reward scorer, loaded the same way."""
    settings: str | None = None
    """The models.* mapping of engine keywords for this backend: ``vllm`` for the generator and
    ``reward_vllm`` for the reward model (actors.factory.engine_settings); None: models.hf applies."""
    sliding_window: bool = True
    """Its generator engine holds models with sliding-window attention layers; the HF engine's paged
    KV cache does not, and the plan refuses such a generator on it (pipeline.preflight.check_models)."""
    engine_keys: Callable[[], set[str] | None] | None = None
    """The keyword names its engine settings (``settings``) take, or None where its engine is not
    installed here; the plan checks every models.<settings> key against them (``check_settings``)."""
    kv_capacity: bool = False
    """Its generator engine answers Generator.capacity (the rows its paged KV pool holds), which
    memory-budget speculative rejection's ``initial_candidates: auto`` reads."""
    reward_channel: bool = False
    """Its generator engine reads a Reward Transformer generator's reward channel in its decoding
    passes (Generator.open ``rewards``; RowState.reward), which speculative rejection's
    ``partial_reward: generator`` ranks by."""
    spans_gpus: bool = False
    """Its engine may span several GPUs inside one actor (tensor/pipeline parallel), so the actor asks
    Ray for as many (actors.factory.actor_resources)."""

    def load_generator(self, model: str, options: EngineOptions) -> Engine:
        """Its generator engine over ``model`` (a directory or Hub id)."""
        return _load(self.generator).from_options(model, options)

    def load_reward(self, model: str, options: EngineOptions):
        """Its reward scorer over the sequence-classification model ``model``."""
        return _load(self.reward).from_options(model, options)

    def check_settings(self, key: str, settings: dict) -> None:
        """``models.<key>``: every key one its engine takes (where the engine is installed here, to ask);
        ConfigError naming the key, with the closest known one, otherwise."""
        known = self.engine_keys() if self.engine_keys is not None else None
        for name in settings:
            if known is not None and name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigError(f"models.{key}.{name}: not a {self.name} engine argument{hint}")

    def role_settings_key(self, role: str) -> str | None:
        """The models.* key holding ``role``'s engine keywords on this backend (None: none)."""
        if self.settings is None:
            return None
        return self.settings if role == "generator" else f"reward_{self.settings}" if role == "reward" else None


def _vllm_engine_keys() -> set[str] | None:
    """The keyword arguments ``vllm.LLM`` takes (its own and ``EngineArgs``' fields); None where vLLM
    is not installed here."""
    try:
        import vllm
    except ImportError:
        return None
    return ({f.name for f in dataclasses.fields(vllm.EngineArgs)}
            | set(inspect.signature(vllm.LLM.__init__).parameters) - {"self", "kwargs"})


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("hf", "Hugging Face transformers: every strategy, KV rows of the step loop",
            frozenset({SESSIONS, SEARCH}), "pipeline.engines.hf:HFEngine", "pipeline.engines.rewards:RewardScorer",
            sliding_window=False, kv_capacity=True, reward_channel=True),
    Backend("vllm", "vLLM: continuous batching and paged attention; coordinator-side strategies",
            frozenset({SESSIONS}), "pipeline.engines.vllm_engine:VLLMEngine",
            "pipeline.engines.vllm_reward:VLLMRewardScorer", settings="vllm", engine_keys=_vllm_engine_keys,
            spans_gpus=True),
)}


def backend(name: str, key: str = "models.backend") -> Backend:
    """The record of backend ``name``; ConfigError naming ``key`` and the choices otherwise."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ConfigError(f"{key}: expected {' or '.join(BACKENDS)}, got {name!r}") from None


def _load(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def parse_memory(value) -> float | int | None:
    """runtime.kv_cache_memory as the manager takes it: None ("auto": a default per device), a
    fraction in (0, 1] of the memory free after the weights, or a byte count ("4GB", "512MB",
    "2GiB", "65536B", or a number over 1: GB). Raises ValueError with the accepted forms."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
        return None
    if isinstance(value, bool):
        raise ValueError(f"expected auto, a fraction in (0, 1] or a size such as 4GB, got {value!r}")
    if isinstance(value, (int, float)):
        if 0 < value <= 1:
            return float(value)
        if value > 1:
            return int(value * 2**30)
        raise ValueError(f"expected auto, a fraction in (0, 1] or a size such as 4GB, got {value!r}")
    text = str(value).strip().upper().replace(" ", "")
    for suffix, scale in (("GIB", 2**30), ("MIB", 2**20), ("GB", 2**30), ("MB", 2**20), ("G", 2**30), ("M", 2**20), ("B", 1)):
        if text.endswith(suffix):
            try:
                amount = float(text[: -len(suffix)])
            except ValueError:
                break
            if amount > 0:
                return int(amount * scale)
            break
    else:
        try:
            return parse_memory(float(text))
        except ValueError:
            pass
    raise ValueError(f"expected auto, a fraction in (0, 1] or a size such as 4GB, got {value!r}")
