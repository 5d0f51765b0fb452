"""Config schema: dataclasses, YAML load, ``--set dotted.key=value`` overrides, validation.

No I/O beyond reading the YAML file itself. Every field is documented where it is declared.
Unknown keys are rejected with a message that names the key, so a typo never silently
falls back to a default.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from pipeline.decoding.speculative import SpeculativeDecoding
from pipeline.engines.backends import backend, parse_memory
from pipeline.errors import ConfigError
from pipeline.strategies import STRATEGIES, lookup

log = logging.getLogger(__name__)
__all__ = ["Config", "ConfigError", "config_from_dict", "load_config"]


@dataclass
class HFLoadConfig:
    """How the HF backend loads every model (generator, reward model, draft): passed to
    ``from_pretrained`` of the model and its tokenizer."""

    revision: str | dict | None = None
    """A branch, tag or commit of the Hub repos: one for every model, or a mapping by role
    ({generator: ..., reward: ..., draft: ...}; a role left out loads the default branch)."""
    attn_implementation: str | None = None
    """eager, sdpa, flash_attention_2, ... (null: transformers' default for the model)."""
    trust_remote_code: bool = False
    """Run the model repo's own Python code (needed by some architectures). Never on unless set."""
    kwargs: dict = field(default_factory=dict)
    """Any other ``from_pretrained`` keyword (e.g. {low_cpu_mem_usage: true}); not one of the keys
    above, nor dtype (models.dtype)."""

    ROLES = ("generator", "reward", "draft")

    def __post_init__(self):
        if isinstance(self.revision, dict):
            unknown = sorted(set(self.revision) - set(self.ROLES))
            if unknown:
                raise ConfigError(f"models.hf.revision.{unknown[0]}: unknown role (known: {', '.join(self.ROLES)})")
            for role, rev in self.revision.items():
                if not isinstance(rev, str) or not rev:
                    raise ConfigError(f"models.hf.revision.{role}: expected a branch, tag or commit, got {rev!r}")
        reserved = sorted({"revision", "attn_implementation", "trust_remote_code", "dtype", "torch_dtype"}
                          & set(self.kwargs))
        if reserved:
            raise ConfigError(f"models.hf.kwargs.{reserved[0]}: set it as models.hf.{reserved[0]} "
                              f"(dtype: models.dtype), not in kwargs")

    def revision_of(self, role: str) -> str | None:
        return self.revision.get(role) if isinstance(self.revision, dict) else self.revision

    def load_kwargs(self, role: str) -> dict:
        """``from_pretrained`` keywords for the model of ``role`` (generator, reward or draft)."""
        out = dict(self.kwargs)
        if self.revision_of(role):
            out["revision"] = self.revision_of(role)
        if self.attn_implementation:
            out["attn_implementation"] = self.attn_implementation
        if self.trust_remote_code:
            out["trust_remote_code"] = True
        return out


@dataclass
class ModelsConfig:
    generator: str = ""
    """Policy model: an HF model directory or hub id (AutoModelForCausalLM)."""
    reward: str | list = ""
    """Reward model: an HF model directory or hub id (AutoModelForSequenceClassification, 1 label),
    or a Python reward function ``module:function`` with the signature of TRL's GRPOTrainer reward
    functions (prompts, completions, the input's other columns and ``partial`` as keyword lists; one
    float per completion), e.g. ``pipeline.judge:ifeval_reward`` (IFEval's instruction checkers).
    A list of them is a composite reward: the score is sum_k reward_weights[k] * reward_k, raw (no
    per-prompt standardization), and speculative rejection decides on it; a component with no score
    for a prefix leaves the decision to the others (pipeline.engines.rewards.CompositeScorer). The
    output keeps each reward's score for chosen and rejected (chosen_scores, rejected_scores)."""
    reward_weights: list | None = None
    """One weight per reward of models.reward, in its order (TRL's reward_weights); null: 1 each."""
    draft: str | None = None
    """Draft model for speculative methods (unused by best_of_n and sbon); empty: dsbd drafts with ADED."""
    dtype: str = "float32"
    """Torch dtype for all models: float32, bfloat16, float16, or auto (the dtype the checkpoint
    was saved in, from its config)."""
    device: str = "cpu"
    """Torch device inside each actor: cpu, cuda, cuda:0, ..."""
    backend: str = "hf"
    """Generator backend (pipeline.engines.backends): hf (every strategy) or vllm (the strategies that
    drive sessions from the coordinator: best_of_n and sbon; `make install-vllm` on CPU,
    `pip install .[vllm]` on GPU)."""
    reward_backend: str = "hf"
    """Reward-model backend: hf, or vllm (vLLM's pooling runner with prefix caching, for a
    sequence-classification reward model; any generator backend). A reward function
    (``module:function``) runs in the reward actor whatever this says."""
    hf: HFLoadConfig = field(default_factory=HFLoadConfig)
    """HF backend loading settings (revision, attn_implementation, trust_remote_code, kwargs)."""
    vllm: dict = field(default_factory=dict)
    """Keyword arguments for the generator's ``vllm.LLM`` (backend vllm): tensor_parallel_size,
    pipeline_parallel_size, max_model_len, gpu_memory_utilization, max_num_seqs, enforce_eager,
    quantization, revision, trust_remote_code, ... any ``vllm.EngineArgs`` field (checked at plan time
    where vLLM is installed). Each generator actor asks Ray for tensor_parallel_size x
    pipeline_parallel_size GPUs (at least runtime.generator.num_gpus) on cuda."""
    reward_vllm: dict = field(default_factory=dict)
    """The same for the reward model's ``vllm.LLM`` (reward_backend vllm)."""
    cpu_prepack: bool = True
    """CPU, float32, HF models (generator, reward, draft): each linear layer's weight is reordered once
    at load for oneDNN (pipeline.engines.hf.PackedLinear): passes over a few rows (speculative and tree
    decoding's verification) cost about one row's, and a layer's output for a row does not depend on
    the rows beside it.
    false: PyTorch's default linear. No effect on GPU, other dtypes or the vLLM backend."""
    speculative: SpeculativeDecoding = field(default_factory=SpeculativeDecoding)
    """Speculative decoding of the rows that go on decoding (best_of_n, sbon): num_speculative_tokens
    > 0 turns it on (pipeline.decoding.speculative.SpeculativeDecoding). Output distribution unchanged."""

    def __post_init__(self):
        self._check_rewards()
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ConfigError(f"models.dtype: expected float32, bfloat16, float16 or auto, got {self.dtype!r}")
        for key in ("backend", "reward_backend"):
            backend(getattr(self, key), f"models.{key}")
        for key in ("vllm", "reward_vllm"):
            for name, value in getattr(self, key).items():
                if name in ("model", "tokenizer", "runner", "task", "convert"):
                    raise ConfigError(f"models.{key}.{name}: set by the pipeline (models.generator / models.reward "
                                      f"and the role), not here")
                if name in ("tensor_parallel_size", "pipeline_parallel_size") and (
                        not isinstance(value, int) or isinstance(value, bool) or value < 1):
                    raise ConfigError(f"models.{key}.{name}: expected an integer >= 1, got {value!r}")

    def _check_rewards(self) -> None:
        if isinstance(self.reward, list):
            if not self.reward:
                raise ConfigError("models.reward: an empty list; give one reward or several")
            for i, spec in enumerate(self.reward):
                if not isinstance(spec, str) or not spec.strip():
                    raise ConfigError(f"models.reward[{i}]: expected a model directory, Hub id or module:function, "
                                      f"got {spec!r}")
            repeated = sorted({s for s in self.reward if self.reward.count(s) > 1})
            if repeated:
                raise ConfigError(f"models.reward: {repeated[0]!r} is listed twice; weight it once instead")
        if self.reward_weights is None:
            return
        for i, weight in enumerate(self.reward_weights):
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise ConfigError(f"models.reward_weights[{i}]: expected a number, got {weight!r}")
        if len(self.reward_weights) != len(self.rewards):
            raise ConfigError(f"models.reward_weights: {len(self.reward_weights)} weights for "
                              f"{len(self.rewards)} reward(s) in models.reward; give one per reward "
                              "(models.reward_weights=null: 1 each)")
        if not any(self.reward_weights):
            raise ConfigError("models.reward_weights: every weight is 0, so every response would score 0")
        self.reward_weights = [float(w) for w in self.reward_weights]

    @property
    def rewards(self) -> list[str]:
        """models.reward as a list (one entry for a single reward)."""
        return list(self.reward) if isinstance(self.reward, list) else [self.reward]

    @property
    def weights(self) -> list[float]:
        """models.reward_weights, or 1 for each reward."""
        return list(self.reward_weights) if self.reward_weights is not None else [1.0] * len(self.rewards)

    def vllm_settings(self, role: str) -> dict | None:
        """``role``'s ``vllm.LLM`` keywords (generator: vllm; reward: reward_vllm) where that role runs
        on vLLM; None where it runs on the HF engine."""
        name = self.backend if role == "generator" else self.reward_backend if role == "reward" else "hf"
        key = backend(name).role_settings_key(role)
        return None if key is None else getattr(self, key)

    def engine_gpus(self, role: str) -> int:
        """GPUs one vLLM engine of ``role`` (generator or reward) spans: tensor_parallel_size x
        pipeline_parallel_size of its settings (1 without them)."""
        settings = self.vllm if role == "generator" else self.reward_vllm
        return int(settings.get("tensor_parallel_size", 1)) * int(settings.get("pipeline_parallel_size", 1))


@dataclass
class SamplingConfig:
    num_samples: int = 8
    """N: candidates sampled per prompt."""
    max_new_tokens: int = 64
    """Length cap of every response, in generated tokens."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_k: int = 0
    """Keep the k most likely tokens (0 disables)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 disables)."""
    chat_template: str = "auto"
    """auto: wrap prompts in the tokenizer's chat template when it has one; never: raw text."""

    def __post_init__(self):
        if self.num_samples < 2:
            raise ConfigError(f"sampling.num_samples: need at least 2 candidates for a pair, got {self.num_samples}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"sampling.max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"sampling.temperature: must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"sampling.top_k: must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling.top_p: must be in (0, 1], got {self.top_p}")
        if self.chat_template not in ("auto", "never"):
            raise ConfigError(f"sampling.chat_template: expected auto or never, got {self.chat_template!r}")


@dataclass
class DataConfig:
    prompts: str = ""
    """Prompt input: JSONL, Parquet (file, directory or glob) or a ``save_to_disk`` directory (a
    Dataset's, or a DatasetDict's: see split), local or s3://; or a Hugging Face Hub dataset,
    hf://datasets/ORG/NAME (streamed with datasets.load_dataset; see split, subset, revision)."""
    split: str = "train"
    """Split to read: of a Hub dataset, or of a saved DatasetDict directory. Other inputs have no
    splits and take only the default."""
    subset: str | None = None
    """A Hub dataset's subset (its config name: load_dataset's ``name``); null: its default."""
    revision: str | None = None
    """A Hub dataset's branch, tag or commit; null: its default branch. The commit read is recorded
    with the build (PromptSource.provenance)."""
    output: str = ""
    """Output directory or s3:// prefix for part-NNNNN.parquet, _manifest.json and _rejects/."""
    prompt_column: str = "prompt"
    """Column (JSONL key) that holds the prompt: a string, or a conversation (a list of
    {"role", "content"} messages, system turns included, ending with a user turn)."""
    output_format: str = "standard"
    """Pairs as TRL's standard format (prompt, chosen and rejected strings; the prompt with the chat
    template applied) or its conversational format (prompt = the list of messages, chosen and
    rejected = [{"role": "assistant", "content": ...}]); DPOTrainer reads both as they are."""
    shard_size: int = 64
    """Prompts per output shard; one part file per shard."""
    overlength: str = "truncate"
    """Prompts longer than max_prompt_tokens: truncate (keep the last tokens) or reject."""
    max_prompt_tokens: int | None = None
    """Prompt token limit; default: the generator's context length minus max_new_tokens."""
    storage_options: dict = field(default_factory=dict)
    """fsspec/s3fs options for s3:// URIs (endpoint_url, key, secret, ...); AWS_* env vars also work."""
    min_margin: float = 0.0
    """A pair needs chosen_score - rejected_score > min_margin (and > 0), final rewards only;
    otherwise the prompt is rejected with the reason "margin below min_margin"."""
    extra_columns: list[str] | None = None
    """The input's other columns carried with each prompt: to a reward function (as keyword lists)
    and into the output beside each pair. null: every other column (those whose names the output
    already uses are left out, with a note); [] none; a list: those columns."""
    rejected: str = "complete"
    """The pair's rejected response: complete (a finished response with a final reward, for every
    strategy; speculative rejection keeps its lowest-ranked candidate running to supply one) or any
    (also a response stopped early, scored by its partial reward: DPO may then learn that finished
    beats truncated)."""
    candidate_scores: bool = False
    """Each pair row also lists every candidate of its prompt, by sample index: candidate_scores
    (final reward; for one stopped early, its partial reward; NaN if failed), candidate_tokens and
    candidate_stopped_early. Best-of-K for every K up to N is then the best of the first K."""

    def __post_init__(self):
        if not self.split:
            raise ConfigError("data.split: must name a split (e.g. train)")
        for key in ("subset", "revision"):
            # With no data.prompts here (a job that takes its input elsewhere), PromptSource checks.
            if getattr(self, key) is not None and self.prompts and not self.prompts.startswith("hf://datasets/"):
                raise ConfigError(f"data.{key}: applies to a Hub dataset (data.prompts hf://datasets/ORG/NAME) "
                                  f"only, not to {self.prompts}")
        if self.extra_columns is not None and not all(isinstance(c, str) and c for c in self.extra_columns):
            raise ConfigError(f"data.extra_columns: expected a list of column names (or null), got {self.extra_columns!r}")
        if not isinstance(self.candidate_scores, bool):
            raise ConfigError(f"data.candidate_scores: expected true or false, got {self.candidate_scores!r}")
        if self.rejected not in ("complete", "any"):
            raise ConfigError(f"data.rejected: expected complete or any, got {self.rejected!r}")
        if self.min_margin < 0:
            raise ConfigError(f"data.min_margin: must be >= 0, got {self.min_margin}")
        if self.shard_size < 1:
            raise ConfigError(f"data.shard_size: must be >= 1, got {self.shard_size}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ConfigError(f"data.max_prompt_tokens: must be >= 1 (or null: the context minus max_new_tokens), "
                              f"got {self.max_prompt_tokens}")
        if self.output_format not in ("standard", "conversational"):
            raise ConfigError(f"data.output_format: expected standard or conversational, got {self.output_format!r}")
        if self.overlength not in ("truncate", "reject"):
            raise ConfigError(f"data.overlength: expected truncate or reject, got {self.overlength!r}")


@dataclass
class ActorResources:
    num_cpus: float = 1
    """CPUs reserved per actor (also its torch thread count)."""
    num_gpus: float = 0
    """GPUs (or a fraction) per actor."""


@dataclass
class RuntimeConfig:
    generator_actors: int | list = 1
    """Number of GeneratorActor replicas: an int, or a range [min, max] (as Ray Data's
    concurrency=(min, max)): the build starts min and, while the run goes on, adds one more whenever a
    live node has room for it (a node joined, an autoscaler added one), up to max; outside the
    placement group, if there is one. Either way a slot whose node is lost and that no node has room
    to replace is given up after actors.remote.ROOM_WAIT_S: the pool shrinks, and the build fails
    only when no generator is left."""
    reward_actors: int = 1
    """Number of RewardActor replicas."""
    generator: ActorResources = field(default_factory=ActorResources)
    """Resources of each GeneratorActor."""
    reward: ActorResources = field(default_factory=ActorResources)
    """Resources of each RewardActor."""
    draft_placement: str = "colocated"
    """Where the draft model (models.draft) runs for strategies that draft (dsbd): colocated (inside
    each GeneratorActor's process, on its device) or actor (one DraftActor per generator)."""
    draft: ActorResources = field(default_factory=ActorResources)
    """Resources of each DraftActor (placement actor): num_gpus 1 for its own GPU, a fraction to share."""
    prompts_per_batch: int = 2
    """Prompts decoded together in one engine batch (rows = prompts_per_batch * num_samples): one
    session, scored together at each decision token. With continuous batching, batches share the
    generator's steps anyway, and small batches let rows_in_flight admit work in small steps."""
    batches_in_flight: int = 16
    """Batches in flight per generator actor, so one generates while another is being scored; with
    rows_in_flight, the most batches a generator takes at once (and, with continuous batching, the
    calls a Ray generator actor serves at once)."""
    rows_in_flight: int = 128
    """The most candidate rows a generator actor decodes at once: it takes a new batch whenever the
    batch's rows fit beside the live rows of its batches (opened, minus those pruned, finished or
    closed), up to batches_in_flight batches; a batch larger than this runs alone. The HF engine's KV
    pool is sized by it. With continuous_batching, the rows that speculative rejection frees at a
    decision token are refilled by the next prompts as soon as a batch fits (small batches,
    prompts_per_batch, refill in small steps). 0: batches_in_flight alone decides."""
    continuous_batching: bool = True
    """The generator takes its batches' calls concurrently and decodes the rows of every batch in one
    continuous batch. HF: one forward pass per step over the live rows of every batch being extended
    (the step loop, pipeline/engines/step_loop.py); each batch still reaches its decision tokens on
    its own schedule. vLLM: a request per row for its whole response, pruned rows aborted, every
    batch's rows in one vLLM engine (pipeline/engines/vllm_engine.py); candidates are then those of
    Best-of-N for the same seeds. false: one call at a time, each batch decoded alone (HF: the same
    step loop, one batch in it at a time; vLLM: rounds of LLM.generate). Reproducibility on HF: rows
    sample from their own seeded streams, so the same seed and the same batch composition give
    identical candidates; but a row's logits depend slightly on which rows share its forward pass
    (padding and kernel choice: up to ~1.3e-4 measured on a real model), so when batches share
    steps differently (timing, other batches in flight) a sampled token may rarely differ, and the
    response diverges from there; the distribution of candidates is the same. Called
    merged_decoding before; that key is still read, with a warning."""
    reward_batch_size: int = 32
    """Sequences per reward-model forward pass."""
    reward_pass_tokens: int = 0
    """The most padded tokens in one reward-model forward pass, beside reward_batch_size's
    sequences (HF reward models). 0: the device's default (1,024 on a CPU, 65,536 on a GPU:
    pipeline.engines.rewards.BATCH_TOKENS)."""
    kv_cache_memory: Any = "auto"
    """The HF generator's KV cache (pipeline.engines.kv_cache): a pool of 128-token blocks allocated
    once at this size. A size ("24GB", "512MB"; a bare number is GB), a fraction in (0, 1] of the
    memory free once the weights are loaded, or auto: 0.8 of a GPU's free memory, 0.25 of a CPU
    host's available memory (on a CPU the pool's pages become resident only as blocks are used).
    Rows are admitted by free blocks and preempted (recomputed later) when blocks run out."""
    bound_heap: bool = False
    """glibc heap tuning (map threshold 4 MiB, two arenas) in the HF actors' processes; off by
    default, since it slowed other work in the process (docs/benchmarks.md)."""
    reward_cache_mb: int = 512
    """The block pool, in MiB, of an HF reward actor's streaming sessions (strategy.streaming_rewards;
    pipeline.engines.rewards): a prompt's KV is held once for all its samples, each row's own tokens
    in blocks of 16. When it runs out, the sessions scored least recently give their blocks back
    first, and their rows are read in full at their next score (the same scores, more reward
    compute). 0: no cache, every row read in full. 512 rather than 128: sbon on SmolLM2-135M's
    reward model (16 prompts, N 32) filled 128 and read 16% fewer tokens with 512 (docs/benchmarks.md);
    the pool's pages become resident only as blocks are used."""
    local: bool = False
    """Run in-process without Ray (tests, debugging)."""
    call_timeout_s: float = 900.0
    """Seconds one actor call may run, counted from when the actor starts it (time queued behind
    the actor's other calls does not count: actors.remote), before the actor is presumed hung: it
    is killed, replaced, and its batches are resubmitted."""
    max_attempts: int = 3
    """Attempts per batch when actors die or hang; past this the build fails naming the shard."""
    lease_timeout_s: float = 120.0
    """One writer per output (pipeline.data.lease, _lease.json): another build's lease is taken to be
    a dead build's and taken over (with a line saying whose) once it has stayed unchanged this long,
    as this build watches it on its own clock; the larger of this value and the one the holder
    recorded in its lease is used. The holder refreshes its own every lease_timeout_s / 12 seconds
    (10 s at the default) and writes nothing once its last refresh is older than half of it."""
    placement_strategy: str = ""
    """Ray placement group for all actors (one bundle each): PACK, SPREAD, STRICT_PACK, STRICT_SPREAD;
    empty: no placement group (Ray places actors by their resources)."""
    faults: list = field(default_factory=list)
    """Test hook: fault plan the actors read (see actors/faults.py), e.g.
    [{actor: generator, method: extend, call: 2, action: exit, times: 1, state_dir: /tmp/f}]."""

    @property
    def generator_range(self) -> tuple[int, int]:
        """(min, max) generator actors: both runtime.generator_actors when it is an int. ConfigError,
        naming the key, for anything but an int or a list of two ints."""
        value = self.generator_actors
        if isinstance(value, int) and not isinstance(value, bool):
            return value, value
        if (isinstance(value, (list, tuple)) and len(value) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
            return value[0], value[1]
        raise ConfigError(f"runtime.generator_actors: expected an int or a range [min, max] of two ints, got {value!r}")

    def __post_init__(self):
        if self.draft_placement not in ("colocated", "actor"):
            raise ConfigError(f"runtime.draft_placement: expected colocated or actor, got {self.draft_placement!r}")
        low, high = self.generator_range
        if isinstance(self.generator_actors, int) and low < 1:
            raise ConfigError(f"runtime.generator_actors: must be >= 1, got {low}")
        if low < 1 or high < low:
            raise ConfigError(f"runtime.generator_actors: a range [min, max] needs 1 <= min <= max, got "
                              f"{self.generator_actors}")
        for key in ("reward_actors", "prompts_per_batch", "batches_in_flight", "reward_batch_size",
                    "max_attempts"):
            if getattr(self, key) < 1:
                raise ConfigError(f"runtime.{key}: must be >= 1, got {getattr(self, key)}")
        if self.rows_in_flight < 0:
            raise ConfigError(f"runtime.rows_in_flight: must be >= 0 (0: no row limit), got {self.rows_in_flight}")
        if self.reward_pass_tokens < 0:
            raise ConfigError(f"runtime.reward_pass_tokens: must be >= 0 (0: the device's default), "
                              f"got {self.reward_pass_tokens}")
        try:
            parse_memory(self.kv_cache_memory)
        except ValueError as exc:
            raise ConfigError(f"runtime.kv_cache_memory: {exc}") from None
        if self.reward_cache_mb < 0:
            raise ConfigError(f"runtime.reward_cache_mb: must be >= 0 (0: keep no cache), "
                              f"got {self.reward_cache_mb}")
        if self.lease_timeout_s <= 0:
            raise ConfigError(f"runtime.lease_timeout_s: must be > 0, got {self.lease_timeout_s}")
        if self.call_timeout_s <= 0:
            raise ConfigError(f"runtime.call_timeout_s: must be > 0, got {self.call_timeout_s}")
        if self.placement_strategy not in ("", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ConfigError(f"runtime.placement_strategy: expected PACK, SPREAD, STRICT_PACK, STRICT_SPREAD or "
                              f"empty, got {self.placement_strategy!r}")


@dataclass
class StrategyConfig:
    name: str = "sbon"
    """Decoding method: a name (or alias) in the method registry, pipeline.strategies."""
    params: Any = None
    """The method's own parameters (its record's params dataclass); written flat in YAML."""

    def __post_init__(self):
        cls = lookup(self.name).params
        if self.params is None or isinstance(self.params, dict):
            self.params = _build(cls, self.params or {}, "strategy")
        elif not isinstance(self.params, cls):
            raise ConfigError(f"strategy: parameters of type {type(self.params).__name__} do not belong to {self.name!r}")


@dataclass
class Config:
    models: ModelsConfig = field(default_factory=ModelsConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    seed: int = 0
    """Base seed: each candidate's sampler is seeded from (seed, prompt_id, sample index)."""

    def __post_init__(self):
        # Loading checks each value as it is read (_coerce); this also covers a Config built in code.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            # Strategy parameters are written flat under strategy: in YAML, so they are named so.
            check_finite(value.params if f.name == "strategy" else value, f.name)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        params = out["strategy"].pop("params") or {}
        out["strategy"].update(params)
        return out


def _build(cls, raw: dict, where: str):
    """Build dataclass ``cls`` from a mapping, recursing into nested dataclasses."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            raise ConfigError(f"{where}.{key}: unknown key (known: {', '.join(sorted(names))})")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value or {}, f"{where}.{key}")
        else:
            kwargs[key] = _coerce(value, hint, f"{where}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _coerce(value, hint, where: str):
    """Check (and lightly coerce int -> float) a scalar against its annotation."""
    if value is None:
        if type(None) in typing.get_args(hint) or hint is Any:
            return None
        raise ConfigError(f"{where}: may not be null")
    allowed = typing.get_args(hint) or (hint,)
    allowed = tuple(typing.get_origin(a) or a for a in allowed if a is not type(None))
    if Any in allowed:
        return value
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and bool not in allowed:
        raise ConfigError(f"{where}: expected {_names(allowed)}, got a boolean")
    if not isinstance(value, allowed):
        shown = "[redacted]" if "storage_options" in where else repr(value)  # may hold a credential
        raise ConfigError(f"{where}: expected {_names(allowed)}, got {type(value).__name__} {shown}")
    check_finite(value, where)
    return value


def check_finite(value, where: str) -> None:
    """ConfigError naming the key when ``value`` is, or holds (in a list, tuple, mapping or
    dataclass), a NaN or infinite float. Every comparison with NaN is false, so a range check
    such as ``temperature < 0`` lets it through, and it would then poison every row (YAML spells
    them .nan and .inf); no key of ours means anything by them."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: must be a finite number, got {value}")
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_finite(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_finite(item, f"{where}.{key}")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            check_finite(getattr(value, f.name), f"{where}.{f.name}")


def _names(types) -> str:
    return " or ".join(t.__name__ for t in types)


RENAMED_KEYS = {("runtime", "merged_decoding"): "continuous_batching"}
"""Keys renamed since a release: (section, old name) -> new name. The old name is still read, with a
warning; both at once must agree."""


def _renamed(raw: dict) -> dict:
    """``raw`` with every old key of RENAMED_KEYS moved to its new name (a warning line each)."""
    for (section, old), new in RENAMED_KEYS.items():
        node = raw.get(section)
        if not isinstance(node, dict) or old not in node:
            continue
        node = raw[section] = dict(node)
        value = node.pop(old)
        if new in node and node[new] != value:
            raise ConfigError(f"{section}.{old}: renamed {section}.{new}, and both are set, differently; "
                              f"keep {section}.{new}")
        node.setdefault(new, value)
        log.warning(f"{section}.{old} is renamed {section}.{new}; read as {section}.{new}: {value}")
    return raw


def config_from_dict(raw: dict) -> Config:
    raw = _renamed(dict(raw or {}))
    strategy = dict(raw.pop("strategy", None) or {})
    name = strategy.pop("name", StrategyConfig.name)
    # StrategyConfig checks the name and builds the parameter dataclass from the flat mapping.
    strategy_config = StrategyConfig(name=name, params=strategy)
    cfg = _build(Config, raw, "config")
    cfg.strategy = strategy_config
    # Strategy parameters that depend on the sampling settings (speculative rejection's
    # initial_candidates >= num_samples) are checked here, at plan time, not mid-build.
    check_sampling = getattr(strategy_config.params, "check_sampling", None)
    if check_sampling is not None:
        check_sampling(cfg.sampling)
    check_backend = getattr(strategy_config.params, "check_backend", None)
    if check_backend is not None:
        check_backend(backend(cfg.models.backend))
    if cfg.models.backend not in lookup(name).backends:
        served = sorted(n for n, m in STRATEGIES.items() if cfg.models.backend in m.backends)
        others = [b for b in lookup(name).backends]
        raise ConfigError(f"models.backend: {cfg.models.backend} serves {', '.join(served)} only, "
                          f"not strategy {name!r}; use backend {' or '.join(others)}")
    return cfg


def apply_override(raw: dict, dotted: str) -> None:
    """Apply one ``dotted.key=value`` override to a raw (YAML) mapping; the value is parsed as YAML."""
    if "=" not in dotted:
        raise ConfigError(f"--set {dotted!r}: expected dotted.key=value")
    key, text = dotted.split("=", 1)
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {part!r} is not a mapping")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError as exc:  # its message quotes the text, which may hold a credential
        where = getattr(exc, "problem_mark", None)
        at = f" at column {where.column + 1}" if where is not None else ""
        problem = getattr(exc, "problem", None) or "parse error"
        raise ConfigError(f"--set {key.strip()}: the value is not valid YAML ({problem}{at})") from None


def switch_strategy(raw: dict, name: str) -> list[str]:
    """Point ``raw`` at strategy ``name``, keeping only the parameters it knows; returns the dropped
    keys (the YAML may hold another strategy's parameters, e.g. ``--strategy best_of_n`` on an sbon
    config)."""
    current = dict(raw.get("strategy") or {})
    known = {f.name for f in dataclasses.fields(lookup(name).params)}
    dropped = sorted(k for k in current if k != "name" and k not in known)
    raw["strategy"] = {"name": name, **{k: v for k, v in current.items() if k in known}}
    return dropped


def load_config(path: str | None, overrides: list[str] = (), strategy: str | None = None) -> Config:
    """Load YAML from ``path`` (or defaults), switch to ``strategy`` if given (dropping parameters it
    does not take, with a note on stderr), apply ``--set`` overrides in order, validate."""
    raw: dict = {}
    if path:
        try:
            with open(path) as f:
                raw = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: invalid YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
    if strategy is not None:
        dropped = switch_strategy(raw, strategy)
        if dropped:
            log.info(f"note: strategy {strategy!r} does not take {', '.join(dropped)}; ignored")
    for item in overrides:
        apply_override(raw, item)
    return config_from_dict(raw)


@dataclass(frozen=True)
class KeyDoc:
    """One config key as ``--help-config`` shows it."""

    key: str
    """Dotted path, as in YAML and ``--set`` (strategy parameters: strategy.<name>)."""
    type: str
    default: Any
    doc: str


_SOURCE_LOCK = threading.Lock()
"""ast.parse is not thread-safe in CPython 3.11 ("AST constructor recursion depth mismatch" when two
threads parse at once: two builds started together in one process)."""


def field_docs(cls) -> dict[str, str]:
    """The docstring written under each field of dataclass ``cls`` (and its bases), by field name:
    Python keeps no attribute docstrings at run time, so they are read from the class's source
    (once per class)."""
    with _SOURCE_LOCK:
        return dict(_field_docs(cls))


@functools.cache
def _field_docs(cls) -> dict[str, str]:
    import ast
    import inspect
    import textwrap

    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _type_name(hint) -> str:
    if hint is Any:
        return "any"
    args = typing.get_args(hint)
    if args:
        origin = typing.get_origin(hint)
        if origin in (typing.Union, getattr(__import__("types"), "UnionType", typing.Union)):
            return " | ".join("null" if a is type(None) else _type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    return {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "dict": "mapping",
            "list": "list"}.get(getattr(hint, "__name__", str(hint)), getattr(hint, "__name__", str(hint)))


def key_docs(cls=None, prefix: str = "") -> list[KeyDoc]:
    """Every config key under dataclass ``cls`` (default: the whole Config, then each strategy's
    parameters under strategy.*), with type, default and docstring, in declaration order: what
    ``--help-config`` prints. Generated from the dataclasses, so it never drifts from them."""
    out: list[KeyDoc] = []
    top = cls is None
    cls = cls or Config
    hints, docs, instance = typing.get_type_hints(cls), field_docs(cls), cls() if cls is not StrategyConfig else None
    for f in dataclasses.fields(cls):
        hint, key = hints[f.name], f"{prefix}{f.name}"
        if cls is StrategyConfig and f.name == "params":
            continue
        if dataclasses.is_dataclass(hint):
            out += key_docs(hint, key + ".")
            continue
        default = getattr(instance, f.name) if instance is not None else f.default
        out.append(KeyDoc(key, _type_name(hint), default, docs.get(f.name, "")))
    if top:
        for record in STRATEGIES.values():
            params = key_docs(record.params, "strategy.")
            names = " / ".join((record.name, *record.aliases))
            out += [dataclasses.replace(p, doc=f"[{names}] {p.doc}") for p in params]
    return out


def format_key_docs(docs: list[KeyDoc], width: int = 100) -> str:
    """``--help-config``'s text: per key a line ``key (type, default: X)`` and its docstring, indented."""
    import textwrap

    lines = []
    for d in docs:
        default = json_default(d.default)
        lines.append(f"{d.key} ({d.type}, default: {default})")
        for paragraph in _paragraphs(d.doc or "(undocumented)"):
            lines += textwrap.wrap(paragraph, width, initial_indent="    ", subsequent_indent="      "
                                   if paragraph.startswith("- ") else "    ")
    return "\n".join(lines)


def _paragraphs(doc: str) -> list[str]:
    """A docstring's paragraphs (blank-line separated; a line starting "- " begins a list item), each
    joined into one line for rewrapping."""
    out: list[str] = []
    for block in doc.split("\n\n"):
        for line in block.splitlines():
            if line.lstrip().startswith("- ") or not out or out[-1] == "":
                out.append(line.strip())
            else:
                out[-1] += " " + line.strip()
        out.append("")
    return out[:-1]


def json_default(value) -> str:
    """A default as YAML would spell it (null, true, [], {}, 1.0, text)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip().removesuffix("...").strip()
