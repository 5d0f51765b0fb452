"""Plan-time checks: everything about the models and engines a build can be refused for, checked on
the driver before any worker or cluster starts (pipeline.build.plan_build calls them), so that every
user error surfaces as one line (ConfigError) and exit code 2 while nothing is running.

- ``check_models``: every model the build loads exists, reads, and is the kind its role needs
  (``_model_config``: a causal LM, a one-label sequence classifier), its tokenizer loads, each reward
  of ``models.reward`` (``check_reward``), then the strategy's own checks through its registry record
  (with MODEL_FILES, the model-file readers); returns the tokenizer and the context to fit;
- ``check_engines``: the device and engine settings can be had (GPUs asked for, vLLM keywords,
  the attention implementation);
- ``max_prompt_tokens``: a prompt and its response fit the model's context.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import logging
import os

from transformers import AutoConfig

from pipeline.config import Config, ConfigError
from pipeline.engines.backends import BACKENDS, backend
from pipeline.engines.hf import TOKENIZER_KEYS, load_tokenizer
from pipeline.engines.rewards import is_reward_function, load_reward_function
from pipeline.strategies import Strategy, lookup

log = logging.getLogger(__name__)

class _ModelFiles:
    """The model-file readers the strategy registry's plan-time checks take (pipeline.strategies.ModelFiles)."""

    @staticmethod
    def has_reward_channel(path: str) -> bool:
        from pipeline.engines.reward_transformer import has_reward_channel

        return has_reward_channel(path)

    @staticmethod
    def has_trained_channel(path: str) -> bool:
        from pipeline.engines.reward_transformer import has_trained_channel

        return has_trained_channel(path)

    @staticmethod
    def load_trigram(path: str):
        from pipeline.engines.trigram import load_trigram

        return load_trigram(path)


MODEL_FILES = _ModelFiles()

def _model_config(key: str, path: str, kind: str, load: dict | None = None):
    """The AutoConfig of ``models.<key>``, refused (ConfigError, one line) when it cannot be read or
    is not the ``kind`` of model the role loads: "causal" (AutoModelForCausalLM) or "reward"
    (AutoModelForSequenceClassification with one label). Reading config.json is cheap, so every
    model is checked here, at plan time, rather than when an actor loads its weights after the
    cluster has started. Only what loading would surely refuse or silently get wrong is refused:
    a model type the Auto class cannot load, or a checkpoint saved with another kind of head (its
    weights would load under a random head). ``load``: models.hf's keywords for this model, of which
    the config takes the revision and trust_remote_code."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)

    if not path:
        raise ConfigError(f"models.{key}: not set (a model directory or hub id)")
    if "://" not in path and (os.path.isabs(path) or path.startswith(".")) and not os.path.isdir(path):
        raise ConfigError(f"models.{key}: {path!r}: no such model directory")
    try:
        model_config = AutoConfig.from_pretrained(path, **{k: v for k, v in (load or {}).items() if k in TOKENIZER_KEYS})
    except (OSError, ValueError) as exc:
        raise ConfigError(f"models.{key}: cannot load {path!r} ({str(exc).strip().splitlines()[0]})") from None
    model_type = getattr(model_config, "model_type", "")
    saved_as = ", ".join(model_config.architectures or []) or model_type
    if kind == "causal":
        heads = [a for a in model_config.architectures or [] if a.endswith(("ForSequenceClassification",
                                                                               "ForTokenClassification"))]
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (heads and heads == model_config.architectures):
            raise ConfigError(f"models.{key}: {path!r} is a {saved_as}, not a causal language model "
                              "(AutoModelForCausalLM)")
    else:
        heads = [a for a in model_config.architectures or [] if a.endswith("ForSequenceClassification")]
        if model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES or (model_config.architectures
                                                                                 and not heads):
            raise ConfigError(f"models.{key}: {path!r} is a {saved_as}, not a sequence classifier "
                              "(AutoModelForSequenceClassification) with one output label")
        if model_config.num_labels != 1:
            raise ConfigError(f"models.{key}: {path!r} has {model_config.num_labels} output labels; a reward "
                              "model has one")
    return model_config


def _context(model_config) -> int | None:
    value = getattr(model_config, "max_position_embeddings", None)
    return int(value) if value else None


def check_models(config: Config, record: Strategy | None = None) -> tuple:
    """Plan time, before any worker or cluster starts: every model the build will load (the generator,
    the reward model, and the draft model for strategies whose registry record drafts) exists, reads,
    and is the kind of model its role needs; then the strategy's own checks (SLA: a trained reward
    channel). Returns (the generator's tokenizer, the context every prompt plus response must fit:
    the generator's, and the draft model's when it is shorter, since the draft reads the same tokens).
    ``record``: the strategy's registry record, as the plan looked it up (None: looked up here)."""
    models = config.models
    record = record or lookup(config.strategy.name)
    check_engines(config, record)
    load = functools.partial(plan_load_kwargs, config)
    generator = _model_config("generator", models.generator, "causal", load("generator"))
    if _slides(generator) and not backend(models.backend).sliding_window:
        raise ConfigError(f"models.generator: {models.generator!r} has sliding-window attention layers, which the "
                          f"{models.backend} engine's paged KV cache does not hold; use models.backend: vllm")
    try:
        tokenizer = load_tokenizer(models.generator, load("generator"))
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"models.generator: cannot load the tokenizer of {models.generator!r} "
                          f"({str(exc).strip().splitlines()[0]})") from None
    for key, spec in reward_keys(models):
        check_reward(spec, load("reward"), key)
    contexts = [_context(generator) or int(tokenizer.model_max_length)]
    if record.uses_draft and models.draft:
        contexts.append(_context(_model_config("draft", models.draft, "causal", load("draft"))) or contexts[0])
    if record.check_models is not None:
        record.check_models(config.strategy.params, models, MODEL_FILES)
    return tokenizer, min(contexts)


def _slides(model_config) -> bool:
    """Whether a model's config gives it sliding-window attention layers (Mistral, Gemma 2/3, ...)."""
    types = getattr(model_config, "layer_types", None)
    if types:
        return any("sliding" in str(t) for t in types)
    return bool(getattr(model_config, "sliding_window", None)) and bool(getattr(model_config, "use_sliding_window", True))


def plan_load_kwargs(config: Config, role: str) -> dict:
    """The keywords plan time reads ``role``'s config and tokenizer with: the ones its engine loads
    with, so that both see the same revision. models.hf's, and for a model on vLLM its
    models.vllm / models.reward_vllm revision, tokenizer_revision and trust_remote_code over them."""
    load = config.models.hf.load_kwargs(role)
    settings = config.models.vllm_settings(role)
    if settings:
        revision = settings.get("tokenizer_revision") or settings.get("revision")
        if revision:
            load["revision"] = revision
        if "trust_remote_code" in settings:
            load["trust_remote_code"] = bool(settings["trust_remote_code"])
    return load


def check_engines(config: Config, record: Strategy | None = None) -> None:
    """Plan time: the device and engine settings can be had and are ones the engines take.

    - models.device cuda: in-process (runtime.local) this process must see a GPU; on Ray each actor
      that loads a model must ask for GPUs (runtime.<role>.num_gpus > 0), since Ray hides every GPU
      from an actor that asked for none, unless its backend's engine asks for its own (vLLM:
      Backend.spans_gpus, actors.factory.actor_resources).
    - a backend's engine settings (models.vllm / models.reward_vllm, Backend.role_settings_key):
      noted when the role runs on another backend; every key one its engine takes (Backend.check_settings:
      for vLLM a ``vllm.EngineArgs`` field, where vLLM is installed on the driver; on a driver without it
      the actor reports a bad key when it starts);
    - models.hf.attn_implementation: one transformers knows (or a Hub kernel, ``org/repo``).

    ``record``: the strategy's registry record (None: looked up here)."""
    import torch

    models, rt = config.models, config.runtime
    if models.device.startswith("cuda"):
        if rt.local and not torch.cuda.is_available():
            raise ConfigError(f"models.device: {models.device}, but this process sees no GPU (torch.cuda.is_available() "
                              "is false); use models.device cpu, or run on a GPU machine")
        # Each role whose actors load a model, and whether its engine asks Ray for GPUs of its own.
        roles = [("generator", backend(models.backend).spans_gpus)]
        if not all(is_reward_function(spec) for spec in models.rewards):
            roles.append(("reward", backend(models.reward_backend).spans_gpus))
        if (record or lookup(config.strategy.name)).uses_draft and models.draft and rt.draft_placement == "actor":
            roles.append(("draft", False))  # a draft model loads as pipeline.engines.draft.HFDrafter
        for role, own_gpus in roles:
            if not rt.local and not own_gpus and getattr(rt, role).num_gpus <= 0:
                raise ConfigError(f"models.device: {models.device}, but runtime.{role}.num_gpus is 0: Ray gives an "
                                  f"actor that asks for no GPU none; set runtime.{role}.num_gpus (e.g. 1, or 0.5 to share)")
    for role, name in (("generator", models.backend), ("reward", models.reward_backend)):
        used = backend(name).role_settings_key(role)
        for key in dict.fromkeys(b.role_settings_key(role) for b in BACKENDS.values() if b.role_settings_key(role)):
            settings = getattr(models, key)
            if settings and key != used:
                log.info(f"note: models.{key} is set but the {'generator' if role == 'generator' else 'reward model'} "
                         f"runs on backend {name}; it is not used")
            elif settings:
                backend(name).check_settings(key, settings)
    attn = models.hf.attn_implementation
    if attn and "/" not in attn:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
        if attn not in known and attn.split("|")[-1] not in known:
            raise ConfigError(f"models.hf.attn_implementation: {attn!r}: expected one of {', '.join(known)} "
                              "(or a Hub kernel org/repo)")


def reward_keys(models) -> list[tuple[str, str]]:
    """(config key, spec) of each reward of ``models.reward``: ``models.reward`` for a single one,
    ``models.reward[i]`` in a list, so an error names the entry."""
    if isinstance(models.reward, list):
        return [(f"models.reward[{i}]", spec) for i, spec in enumerate(models.reward)]
    return [("models.reward", models.reward)]


def check_reward(reward: str, load: dict | None = None, key: str = "models.reward") -> None:
    """One reward (``key``: where the config names it): a reward function (``module:function``)
    imports and is callable; a reward model is a one-label sequence classifier whose tokenizer loads.
    ConfigError, one line, otherwise. ``load``: models.hf's keywords for the reward model."""
    if is_reward_function(reward):
        try:
            load_reward_function(reward)
        except ValueError as exc:
            raise ConfigError(f"{key}: {reward!r}: {exc}") from None
        return
    _model_config(key.removeprefix("models."), reward, "reward", load)
    try:
        load_tokenizer(reward, load)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"{key}: cannot load the tokenizer of {reward!r} "
                          f"({str(exc).strip().splitlines()[0]})") from None


SCORER_ARGUMENTS = frozenset({"prompts", "completions", "partial"})
"""What the function scorer passes a reward function besides the input's columns
(pipeline.engines.rewards.FunctionScorer)."""


def check_reward_columns(config: Config, columns: set[str]) -> None:
    """Each reward function's required parameters (those with no default) are arguments the scorer
    passes or columns of the input (``columns``: the names its rows carry): ConfigError, one line,
    naming the function, the missing columns and the input, before any model loads. Otherwise a
    build would run until the first reward call, then die with a TypeError."""
    for key, spec in reward_keys(config.models):
        if not is_reward_function(spec):
            continue
        parameters = inspect.signature(load_reward_function(spec)).parameters.values()
        missing = [p.name for p in parameters if p.default is p.empty and p.name not in SCORER_ARGUMENTS | columns
                   and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if missing:
            has = ", ".join(sorted(columns)) or "none"
            raise ConfigError(f"{key}: {spec} needs the input column(s) {', '.join(missing)}, which "
                              f"{config.data.prompts} lacks (its other columns: {has})")


def max_prompt_tokens(config: Config, context: int) -> int:
    """The prompt token limit: data.max_prompt_tokens, or what the context leaves after
    max_new_tokens. Refused (ConfigError) when a prompt and its response could overrun the context:
    past it a rotary model silently decodes on positions it never saw, and a learned-position one
    fails with an IndexError mid-run."""
    new_tokens = config.sampling.max_new_tokens
    if new_tokens >= context:
        raise ConfigError(f"sampling.max_new_tokens: {new_tokens} leaves no room for a prompt in the model's "
                          f"context of {context} tokens")
    limit = config.data.max_prompt_tokens
    if limit is None:
        return context - new_tokens
    if limit + new_tokens > context:
        raise ConfigError(f"data.max_prompt_tokens: {limit} + sampling.max_new_tokens {new_tokens} = "
                          f"{limit + new_tokens} exceeds the model's context of {context} tokens; "
                          f"at most {context - new_tokens}")
    return limit


def check_placement(requests: list[tuple[str, int, dict[str, float]]], nodes: list[dict[str, float]],
                    placement_strategy: str = "") -> str | None:
    """Whether the cluster's live nodes could ever hold the build's actors; None if they could, else
    one line naming the setting and what the cluster has. ``requests``: (config key, actors, the Ray
    resources each asks for: {"CPU": 4, "GPU": 1}); ``nodes``: each live node's total resources
    (``ray.nodes()[i]["Resources"]``). Only CPUs and GPUs are compared, and only what no placement
    could meet: an actor larger than every node, the actors together larger than the cluster, and
    with STRICT_PACK, together larger than every node. A cluster that cannot grow (one the build
    started) would otherwise leave the actors pending for ever; the caller refuses it (ConfigError)
    or, on a cluster an autoscaler may grow, waits a bounded time with this line on the progress line."""
    def has(resources: dict[str, float]) -> str:
        return f"{resources.get('CPU', 0):g} CPU, {resources.get('GPU', 0):g} GPU"

    def fits(need: dict[str, float], node: dict[str, float]) -> bool:
        return all(node.get(k, 0) >= need.get(k, 0) for k in ("CPU", "GPU"))

    shape = "; ".join(has(n) for n in nodes) or "none"
    what = f"the cluster's {len(nodes)} live node(s) have {shape} (ray.nodes())"
    total = {k: sum(n.get(k, 0) for n in nodes) for k in ("CPU", "GPU")}
    needed = {k: sum(count * r.get(k, 0) for _, count, r in requests) for k in ("CPU", "GPU")}
    for key, count, need in requests:
        if count and not any(fits(need, n) for n in nodes):
            return (f"{key}: each actor asks for {has(need)}, but no node has that: {what}; lower "
                    f"{key}.num_cpus / num_gpus or run on a cluster that has such a node")
    listed = " + ".join(f"{count} x {has(r)} ({key})" for key, count, r in requests if count)
    if not fits(needed, total):
        return (f"the actors ask for {listed} = {has(needed)} in all, more than {what}; run fewer actors "
                f"(runtime.generator_actors, runtime.reward_actors) or smaller ones")
    if placement_strategy == "STRICT_PACK" and not any(fits(needed, n) for n in nodes):
        return (f"runtime.placement_strategy: STRICT_PACK puts every actor on one node, but {listed} = "
                f"{has(needed)} fits none: {what}")
    return None
