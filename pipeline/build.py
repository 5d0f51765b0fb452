"""The build: prompts in, chosen/rejected Parquet shards, _rejects/ and _manifest.json out.

Input rows are cut into shards of ``data.shard_size`` consecutive rows; shard k owns rows
[k * shard_size, (k + 1) * shard_size) and commits as part-k. Prompts of all pending shards run
through the coordinator together, and a shard commits as soon as its last prompt is done.
Committed shards are skipped on a rerun. The manifest is recomputed from every committed shard,
so it describes what is on disk whether the run resumed or not.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

from tqdm.auto import tqdm
from transformers import AutoConfig

from pipeline.config import Config, ConfigError
from pipeline.coordinator import Coordinator
from pipeline.data.pairs import select_pair
from pipeline.data.prompts import PromptFormatter, Reject, read_raw_rows, validate
from pipeline.data.writer import OutputStore
from pipeline.decoding.sampling import SamplingParams
from pipeline.engines.hf import load_tokenizer


@dataclass
class _Shard:
    index: int
    expected: int = 0
    """Prompts of this shard sent to the coordinator."""
    pairs: list[dict] = field(default_factory=list)
    rejects: list[dict] = field(default_factory=list)
    done: int = 0


def _reject_row(r: Reject, stage: str, generated: int = 0, bon: int = 0) -> dict:
    return {"source_row": r.source_row, "prompt_id": r.prompt_id, "reason": r.reason, "value": r.value,
            "stage": stage, "generated_tokens": generated, "bon_equivalent_tokens": bon}


def sampling_params(config: Config) -> SamplingParams:
    s = config.sampling
    return SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)


@dataclass
class BuildPlan:
    """Everything decided before any model runs: input read and validated, prompts formatted,
    shards assigned. Building it surfaces every input error before a cluster starts."""

    config: Config
    store: OutputStore
    prompts_in: int
    num_shards: int
    pending: dict[int, _Shard]
    prompts: list
    origin: dict
    """prompt_id -> (shard, source_row, truncated)."""
    started: float


def plan_build(config: Config) -> BuildPlan:
    start = time.perf_counter()
    data = config.data
    values = read_raw_rows(data.prompts, data.prompt_column, data.storage_options)
    rows, input_rejects = validate(values, data.prompt_column)
    store = OutputStore(data.output, data.storage_options)
    num_shards = max(1, math.ceil(len(values) / data.shard_size))
    pending = {k: _Shard(k) for k in range(num_shards) if not store.is_committed(k)}

    try:
        tokenizer = load_tokenizer(config.models.generator)
        model_config = AutoConfig.from_pretrained(config.models.generator)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"models.generator: cannot load {config.models.generator!r} "
                          f"({str(exc).splitlines()[0]})") from None
    # A strategy may need more of its models than loading them checks (SLA: a trained reward channel).
    check_models = getattr(config.strategy.params, "check_models", None)
    if check_models is not None:
        check_models(config.models)
    context = getattr(model_config, "max_position_embeddings", None)
    context = int(context or tokenizer.model_max_length)
    max_prompt = data.max_prompt_tokens or context - config.sampling.max_new_tokens
    formatter = PromptFormatter(tokenizer, max_prompt, data.overlength, config.sampling.chat_template)

    for r in input_rejects:
        if r.source_row // data.shard_size in pending:
            pending[r.source_row // data.shard_size].rejects.append(_reject_row(r, "input"))
    prompts, origin = [], {}
    for row in rows:
        shard = pending.get(row.source_row // data.shard_size)
        if shard is None:
            continue
        prompt, reject, truncated = formatter.prepare(row)
        if reject is not None:
            shard.rejects.append(_reject_row(reject, "input"))
            continue
        prompts.append(prompt)
        origin[prompt.prompt_id] = (shard, row.source_row, truncated)
        shard.expected += 1
    return BuildPlan(config, store, len(values), num_shards, pending, prompts, origin, start)


def run_build(plan: BuildPlan, workers, progress: bool = True) -> dict:
    """Generate, pair and commit every pending shard of the plan; returns the manifest."""
    config, store, pending, origin = plan.config, plan.store, plan.pending, plan.origin
    for shard in [s for s in pending.values() if s.expected == 0]:
        store.commit_shard(shard.index, [], shard.rejects)

    coordinator = Coordinator(config.strategy.name, config.strategy.params, sampling_params(config),
                              config.sampling.num_samples, config.seed, workers.generators, workers.scorers,
                              config.runtime.prompts_per_batch, config.runtime.batches_in_flight)
    bar = tqdm(total=len(plan.prompts), unit="prompt", desc=f"build {config.strategy.name}", disable=not progress,
               dynamic_ncols=True)
    pairs_made = tokens = bon_tokens = 0
    for result in coordinator.run(plan.prompts):
        shard, source_row, truncated = origin[result.prompt.prompt_id]
        pair, reason = select_pair(result, config.strategy.name)
        if pair is None:
            shard.rejects.append(_reject_row(Reject(source_row, reason, result.prompt.raw_prompt[:1000],
                                                    result.prompt.prompt_id), "pairing",
                                             result.generated_tokens, result.bon_equivalent_tokens))
        else:
            pair.update(prompt_truncated=truncated, source_row=source_row)
            shard.pairs.append(pair)
            pairs_made += 1
        shard.done += 1
        tokens += result.generated_tokens
        bon_tokens += result.bon_equivalent_tokens
        bar.update(1)
        bar.set_postfix(pairs=pairs_made, tokens_saved=bon_tokens - tokens)
        if shard.done == shard.expected:
            shard.pairs.sort(key=lambda p: p["source_row"])
            shard.rejects.sort(key=lambda r: r["source_row"])
            store.commit_shard(shard.index, shard.pairs, shard.rejects)
    bar.close()
    unfinished = [s.index for s in pending.values() if s.done != s.expected]
    if unfinished:
        raise RuntimeError(f"shards {unfinished} did not receive all their prompts")

    manifest = summarize(store, plan.num_shards, plan.prompts_in)
    manifest.update(wall_seconds=round(time.perf_counter() - plan.started, 3), config=config.to_dict(),
                    shards_written=sorted(pending),
                    shards_skipped=sorted(set(range(plan.num_shards)) - set(pending)),
                    prompts_truncated=sum(1 for _, _, t in origin.values() if t), run_stats=workers.stats(),
                    pairs_this_run=pairs_made)
    # The rate of this run only: resumed shards cost it nothing.
    manifest["pairs_per_minute"] = round(pairs_made / max(manifest["wall_seconds"], 1e-9) * 60, 2)
    store.write_manifest(manifest)
    return manifest


def summarize(store: OutputStore, num_shards: int, prompts_in: int) -> dict:
    """Totals over every committed shard, read back from the files themselves."""
    pairs = rejected = generated = bon = 0
    reasons: Counter = Counter()
    for k in range(num_shards):
        part, rejects = store.read_shard(k)
        pairs += part.num_rows
        rejected += rejects.num_rows
        generated += sum(part.column("generated_tokens").to_pylist()) + sum(rejects.column("generated_tokens").to_pylist())
        bon += sum(part.column("bon_equivalent_tokens").to_pylist()) + sum(rejects.column("bon_equivalent_tokens").to_pylist())
        reasons.update(reason.split(" (")[0] for reason in rejects.column("reason").to_pylist())
    if pairs + rejected != prompts_in:
        raise RuntimeError(f"row count mismatch: {prompts_in} input rows but {pairs} pairs + {rejected} rejects")
    return {"prompts_in": prompts_in, "prompts_rejected": rejected, "pairs": pairs, "generated_tokens": generated,
            "bon_equivalent_tokens": bon, "tokens_saved": bon - generated, "reject_reasons": dict(reasons),
            "shards": num_shards}


def format_summary(manifest: dict) -> str:
    lines = [
        f"prompts        {manifest['prompts_in']}",
        f"pairs          {manifest['pairs']}",
        f"rejected rows  {manifest['prompts_rejected']}" + (
            f"  ({', '.join(f'{k}: {v}' for k, v in sorted(manifest['reject_reasons'].items()))})"
            if manifest["reject_reasons"] else ""),
        f"tokens generated       {manifest['generated_tokens']}",
        f"Best-of-N would need   {manifest['bon_equivalent_tokens']}"
        + (f"  (saved {1 - manifest['generated_tokens'] / manifest['bon_equivalent_tokens']:.1%})"
           if manifest["bon_equivalent_tokens"] else ""),
        f"wall time      {manifest['wall_seconds']:.1f}s",
        f"pairs/minute   {manifest['pairs_per_minute']}",
    ]
    return "\n".join(lines)

