"""The build: prompts in, chosen/rejected Parquet shards, _rejects/ and _manifest.json out.

Input rows are cut into shards of ``data.shard_size`` consecutive rows; shard k owns rows
[k * shard_size, (k + 1) * shard_size) and commits as part-k. The driver never holds the whole
input: planning reads it once, shard by shard (every row validated, every shard fingerprinted,
every prompt's first row recorded on disk for duplicate detection, rows counted; the models and
engines checked by pipeline.preflight), so every input error surfaces before a cluster starts; the run reads it again, shard by shard, skips committed
shards, and hands the prompts of whole pending shards to the coordinator a window at a time
(``WINDOW_ROUNDS``), formatting them as it goes. A shard commits (pipeline.data.store: data,
then marker) as soon as its last prompt is done, and its rejects commit with it. An output built
with another config is refused (OutputConflict) unless overwritten; one that a live build writes
(its lease) is refused (OutputLocked) from planning to the end. At the end every marker is
checked against its files and the config hash, the manifest is recomputed from all of them (so it describes what is
on disk whether the run resumed or not), the run report is written, and _SUCCESS last.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from pipeline.config import Config
from pipeline.coordinator import Coordinator
from pipeline.data.pairs import select_pair
from pipeline.data.chat import PromptFormatter, Reject
from pipeline.data.prompts import FirstRows, validate
from pipeline.data.readers import PromptSource, hub_dataset_id
from pipeline.data.storage import access_errors, check_access
from pipeline.data.schema import ExtraColumns
from pipeline.data.store import OutputStore, check_location, fingerprint, part_name
from pipeline.errors import BatchFailed, InputError, ShardFailed
from pipeline.preflight import check_models, check_reward_columns, max_prompt_tokens
from pipeline.provenance import build_identity, config_hash
from pipeline.strategies import Strategy, lookup

log = logging.getLogger(__name__)



@dataclass
class _Shard:
    index: int
    fingerprint: str = ""
    """sha256 of the shard's input rows (pipeline.data.store.fingerprint)."""
    expected: int = 0
    """Prompts of this shard sent to the coordinator."""
    too_long: int = 0
    """Valid prompts that formatting rejected (longer than data.max_prompt_tokens)."""
    pairs: list[dict] = field(default_factory=list)
    rejects: list[dict] = field(default_factory=list)
    quarantine: list[dict] = field(default_factory=list)
    stats: Counter = field(default_factory=Counter)
    done: int = 0


def _reject_row(r: Reject, stage: str, generated: int = 0, bon: int = 0) -> dict:
    return {"source_row": r.source_row, "prompt_id": r.prompt_id, "reason": r.reason, "value": r.value,
            "stage": stage, "generated_tokens": generated, "bon_equivalent_tokens": bon}


def output_schema(config: Config, extra: ExtraColumns):
    """The pair files' one schema: TRL's ``data.output_format`` and the input's other columns."""
    from pipeline.data.schema import PAIR_SCHEMAS

    return extra.schema(PAIR_SCHEMAS[config.data.output_format])


WINDOW_ROUNDS = 64
"""The coordinator is handed the prompts of whole pending shards a window at a time: at least this
many times the prompts its generators hold in flight (generator actors x batches_in_flight x
prompts_per_batch). The driver holds one window, and the next one, read and formatted while the
window's last batches finish; never the whole input. Coordinator.run takes a list of prompts, so the
generators drain at the end of each window: one in-flight batch's lifetime, about 1/64 of a window
at this size (a window of 64 x in-flight prompts takes about 64 batch lifetimes)."""


@dataclass
class BuildPlan:
    """Everything decided before any model runs: input read once and validated, shards fingerprinted
    and counted, committed shards found. Building it surfaces every input error before a cluster
    starts; it holds no input rows (the run reads the input again, shard by shard)."""

    config: Config
    store: OutputStore
    prompts_in: int
    num_shards: int
    pending: list[int]
    """The shards to build, in order (the others are committed)."""
    rows_to_run: int
    """Valid, distinct prompts of the pending shards (those formatting rejects, too long, included)."""
    source: PromptSource
    fingerprints: list[str]
    """Shard k's input fingerprint (pipeline.data.store.fingerprint), for every shard."""
    first_rows: FirstRows
    """Every prompt's first input row, for duplicate detection (on disk; closed by run_build)."""
    formatter: PromptFormatter
    started: float
    """When planning began (time.perf_counter): the start of the run's wall time and startup."""
    config_hash: str = ""
    extra: ExtraColumns = field(default_factory=ExtraColumns)
    """The input's other columns the output keeps beside each pair (data.extra_columns)."""
    identity: dict = field(default_factory=dict)
    """What built it beside the config (pipeline.provenance.build_identity), recorded in every marker."""
    models_provenance: dict | None = None
    """Each model's provenance (pipeline.provenance.models_provenance), computed once at plan time."""
    strategy: Strategy | None = None
    """The strategy's registry record, looked up once at plan time (config.strategy.name)."""


def plan_build(config: Config, overwrite: bool = False) -> BuildPlan:
    """Read and validate the input shard by shard, check the output (OutputConflict when it holds
    another build, unless ``overwrite``), and find the shards still to build."""
    start = time.perf_counter()
    data = config.data
    build_hash = config_hash(config)
    for uri in (data.prompts, data.output):  # s3:// without (valid) credentials: one line, naming the URI
        if hub_dataset_id(uri) is None:  # a Hub dataset is opened by datasets (PromptSource), not fsspec
            check_access(uri, data.storage_options)
    strategy = lookup(config.strategy.name)
    tokenizer, context = check_models(config, strategy)
    formatter = PromptFormatter(tokenizer, max_prompt_tokens(config, context), data.overlength,
                                config.sampling.chat_template)

    with access_errors(data.prompts):
        source = PromptSource(data.prompts, data.prompt_column, data.storage_options, data.extra_columns,
                              split=data.split, subset=data.subset, revision=data.revision)
    if source.skipped_note():  # the manifest lists them too (input_files_skipped)
        log.info("%s", source.skipped_note())
    first_rows = FirstRows()
    store = None
    try:
        check_location(data.output, data.prompts)  # before the input is read: it may be our own output
        fingerprints, valid, prompts_in, extra = [], [], 0, ExtraColumns(data.candidate_scores)
        for k, values, columns in source.shard_records(data.shard_size):
            fingerprints.append(_fingerprint(values, columns))
            extra.add(columns)
            rows, _ = validate(values, data.prompt_column, prompts_in, first_rows)
            valid.append(len(rows))
            prompts_in += len(values)
        extra.finish()
        check_reward_columns(config, set(extra.types) | extra.left_out)  # before any model loads
        if extra.left_out:
            log.info(f"note: {data.prompts}: column(s) {', '.join(sorted(extra.left_out))} not kept in the output "
                  "(the pair columns have those names)")
        num_shards = len(fingerprints)
        identity, found = build_identity(config, extra, strategy.uses_draft)
        store = OutputStore(data.output, data.storage_options)
        # One writer per output: the lease comes before anything in it is read or changed, and
        # run_build releases it (OutputLocked, one line, when a live build holds it).
        lease_timeout = config.runtime.lease_timeout_s
        store.acquire_lease(build_hash, timeout_s=lease_timeout, heartbeat_s=lease_timeout / 12)
        committed = set() if overwrite else store.committed({k: (fp, build_hash) for k, fp in enumerate(fingerprints)},
                                                            identity)
        store.prepare(overwrite=overwrite)
    except BaseException:
        first_rows.close()
        if store is not None:
            store.release_lease()
        raise
    pending = [k for k in range(num_shards) if k not in committed]
    return BuildPlan(config, store, prompts_in, num_shards, pending, sum(valid[k] for k in pending), source,
                     fingerprints, first_rows, formatter, start, build_hash, extra, identity, found, strategy)


def _fingerprint(values: list, columns: list[dict]) -> str:
    """A shard's input fingerprint: its prompts, and its other columns when it carries any (so a
    build with no other columns keeps the fingerprints of the builds before data.extra_columns)."""
    return fingerprint([[v, c] for v, c in zip(values, columns)] if any(columns) else values)


def _pending_shards(plan: BuildPlan) -> Iterator[tuple[_Shard, list[tuple]]]:
    """Each pending shard in order, read, validated and formatted when asked for: (the shard, with
    its input rejects; its prompts as (PromptInput, source row, truncated))."""
    data = plan.config.data
    pending = set(plan.pending)
    for k, values, columns in plan.source.shard_records(data.shard_size):
        if k not in pending:
            continue
        if _fingerprint(values, columns) != plan.fingerprints[k]:
            raise InputError(f"{data.prompts}: changed while the build ran (the rows of shard {k} are not those "
                             "planned); committed shards are kept, a rerun resumes")
        shard = _Shard(k, plan.fingerprints[k])
        rows, rejects = validate(values, data.prompt_column, k * data.shard_size, plan.first_rows, columns)
        shard.rejects = [_reject_row(r, "input") for r in rejects]
        prompts = []
        for row in rows:
            prompt, reject, truncated = plan.formatter.prepare(row)
            if reject is not None:
                shard.rejects.append(_reject_row(reject, "input"))
                shard.too_long += 1
            else:
                prompts.append((prompt, row.source_row, truncated))
        shard.expected = len(prompts)
        yield shard, prompts


def _windows(shards: Iterator[tuple[_Shard, list[tuple]]], size: int) -> Iterator[list[tuple[_Shard, list[tuple]]]]:
    """Whole shards, grouped until their prompts number at least ``size``."""
    window, prompts = [], 0
    for shard, shard_prompts in shards:
        window.append((shard, shard_prompts))
        prompts += len(shard_prompts)
        if prompts >= size:
            yield window
            window, prompts = [], 0
    if window:
        yield window


def _record(shard: _Shard, result, source_row: int) -> None:
    """Shard statistics of one prompt's candidates; non-finite rewards are quarantined, and reward
    statistics are taken over the finite final rewards only."""
    stats = shard.stats
    stats["candidates"] += len(result.candidates)
    stats["generated_tokens"] += result.generated_tokens
    stats["bon_equivalent_tokens"] += result.bon_equivalent_tokens
    for c in result.candidates:
        if c.failed:
            shard.quarantine.append({"source_row": source_row, "prompt_id": result.prompt.prompt_id,
                                     "sample": c.sample, "score": repr(float(c.score)),
                                     "stopped_early": c.stopped_early, "text": c.text})
        elif c.completed and not c.stopped_early:
            stats["reward_count"] += 1
            stats["reward_sum"] += c.score
            stats["reward_sum_sq"] += c.score * c.score
            stats["reward_min"] = min(stats.get("reward_min", c.score), c.score)
            stats["reward_max"] = max(stats.get("reward_max", c.score), c.score)
    stats["quarantined"] = len(shard.quarantine)


def run_build(plan: BuildPlan, workers, progress: bool = True) -> dict:
    """Generate, pair and commit every pending shard of the plan, reading the input again shard by
    shard; verify every marker, write the manifest, the run report and _SUCCESS; returns the manifest."""
    try:
        return _run(plan, workers, progress)
    finally:
        plan.first_rows.close()
        plan.store.release_lease()


def _run(plan: BuildPlan, workers, progress: bool) -> dict:
    run = _BuildRun(plan, workers, progress)
    try:
        run.run_windows()
    except BatchFailed as exc:
        raise ShardFailed(run.failed_shards(exc)) from None
    finally:
        run.bars.close()
    run.sync_restarts()
    return run.finish()


class _BuildRun:
    """One run of a plan's pending shards: the counters its steps share, and the steps. A window of
    shards starts (start_window), each prompt's result is recorded into its shard (record_result),
    a shard commits once its last prompt is in (commit_shard), a batch retried after a fault is
    logged (on_retry), and at the end the manifest, run report, dataset card and _SUCCESS are
    written (finish)."""

    def __init__(self, plan: BuildPlan, workers, progress: bool):
        from pipeline.observability import BuildMetrics, ProgressBars, ShardLog

        self.plan, self.workers, self.config = plan, workers, plan.config
        self.metrics = BuildMetrics(started=plan.started)
        progress = progress and sys.stderr.isatty()  # elsewhere (ray job submit, CI, a file): a log line per shard
        self.bars = ProgressBars(plan.rows_to_run, self.config.strategy.name, enabled=progress)
        self.shard_log = ShardLog(len(plan.pending), plan.rows_to_run, bars=progress)
        self.origin: dict[str, tuple[_Shard, int, bool]] = {}
        """prompt_id -> (shard, source_row, truncated), for the prompts of the windows being run."""
        # Startup (planning, cluster, actors, model loads) ends here: the workers are up, and the first
        # batches go out as soon as the first window is read and the coordinator is asked for results.
        self.run_started = self.last_commit = time.perf_counter()
        self.quarantined = self.truncated_prompts = self.prompts_run = 0
        self.pairs_made = self.tokens = self.bon_tokens = 0
        self.coordinator = Coordinator.from_config(self.config, workers.generators, workers.scorers,
                                                   on_retry=self.on_retry)
        runtime = self.config.runtime
        generators = max(len(workers.generators), runtime.generator_range[1])
        self.in_flight = generators * runtime.batches_in_flight * runtime.prompts_per_batch
        """Prompts the generators hold in flight at once: as many as runtime.generator_actors' largest
        count (a range's max) may hold, so that generators started on capacity that joins find work
        before a window ends."""

    def run_windows(self) -> None:
        """Every pending shard, a window at a time (see WINDOW_ROUNDS); the next window is read while
        the last batches of the one before finish."""
        windows = _windows(_pending_shards(self.plan), WINDOW_ROUNDS * self.in_flight)
        window = next(windows, [])
        while window:
            prompts = self.start_window(window)
            ahead = None  # the next window once read ([]: the input is done)
            for done, result in enumerate(self.coordinator.run(prompts), start=1):
                self.record_result(result)
                if ahead is None and done >= len(prompts) - self.in_flight:
                    # Every batch of the window is out: read the next window while they finish.
                    ahead = next(windows, [])
            self.prompts_run += len(prompts)
            unfinished = [shard.index for shard, _ in window if shard.done != shard.expected]
            if unfinished:
                raise RuntimeError(f"shards {unfinished} did not receive all their prompts")
            window = ahead if ahead is not None else next(windows, [])

    def start_window(self, window: list[tuple[_Shard, list[tuple]]]) -> list:
        """The window's prompts, in input order; its shards with nothing to run commit now."""
        prompts = []
        for shard, shard_prompts in window:
            for prompt, source_row, truncated in shard_prompts:
                self.origin[prompt.prompt_id] = (shard, source_row, truncated)
                prompts.append(prompt)
                self.truncated_prompts += truncated
            if shard.too_long:  # planning counted them in the bars' total; formatting rejected them
                for bar in (self.bars.prompts, self.bars.pairs):
                    bar.total -= shard.too_long
                    bar.refresh()
            if shard.expected == 0:
                self.commit_shard(shard)
        return prompts

    def record_result(self, result) -> None:
        """One prompt's candidates: its pair (or reject) into its shard, the counters and progress
        updated; the shard commits if this was its last prompt."""
        data = self.config.data
        shard, source_row, truncated = self.origin.pop(result.prompt.prompt_id)
        _record(shard, result, source_row)
        pair, reason = select_pair(result, self.config.strategy.name, data.min_margin, data.output_format,
                                   data.rejected, data.candidate_scores)
        if pair is None:
            shard.rejects.append(_reject_row(Reject(source_row, reason, result.prompt.raw_prompt[:1000],
                                                    result.prompt.prompt_id), "pairing",
                                             result.generated_tokens, result.bon_equivalent_tokens))
        else:
            pair.update(prompt_truncated=truncated, source_row=source_row,
                        **self.plan.extra.values(result.prompt.columns))
            shard.pairs.append(pair)
            self.pairs_made += 1
        shard.done += 1
        self.tokens += result.generated_tokens
        self.bon_tokens += result.bon_equivalent_tokens
        self.metrics.prompt_done(pair is not None, result.generated_tokens, result.bon_equivalent_tokens)
        self.bars.update(pair is not None, result.bon_equivalent_tokens - result.generated_tokens)
        self.shard_log.prompt_done(pair is not None)
        if shard.done == shard.expected:
            self.commit_shard(shard)

    def commit_shard(self, shard: _Shard) -> None:
        """Write the shard's pairs, rejects and quarantine, then its marker (OutputStore.commit_shard)."""
        shard.pairs.sort(key=lambda p: p["source_row"])
        shard.rejects.sort(key=lambda r: r["source_row"])
        shard.stats.update(pairs=len(shard.pairs), rejects=len(shard.rejects))
        self.plan.store.commit_shard(shard.index, shard.pairs, shard.rejects, shard.fingerprint,
                                     self.plan.config_hash, dict(shard.stats), shard.quarantine,
                                     self.config.data.output_format, self.plan.extra, self.plan.identity)
        self.quarantined += len(shard.quarantine)
        self.metrics.shard_committed()
        kv_use = getattr(self.workers, "kv_use", None)  # the generators' KV caches (HF engine), for the line
        self.shard_log.shard_committed(shard.index, len(shard.pairs), len(shard.rejects), kv_use() if kv_use else None)
        self.last_commit = time.perf_counter()

    def sync_restarts(self) -> None:
        """The metrics' actor restarts caught up with the workers'."""
        self.metrics.actor_restarted(self.workers.restarts() - self.metrics.totals["actor_restarts"])

    def on_retry(self, failure: BatchFailed) -> None:
        """The coordinator reruns a batch after a fault: say which shards it holds."""
        shards = sorted({self.origin[pid][0].index for pid in failure.prompt_ids})
        self.sync_restarts()
        log.warning(f"{failure.cause}; actor replaced (or already), shard(s) {shards} batch resubmitted "
                    f"(attempt {failure.attempts + 1} of {self.config.runtime.max_attempts})")

    def failed_shards(self, failure: BatchFailed) -> str:
        """ShardFailed's message for a batch out of attempts."""
        shards = sorted({self.origin[pid][0].index for pid in failure.prompt_ids})
        return (f"shard(s) {', '.join(part_name(k) for k in shards)} failed after {failure.attempts} "
                f"attempts: {failure.cause}; committed shards are kept, a rerun resumes")

    def finish(self) -> dict:
        """Every marker checked, then the manifest (recomputed from all of them), the run report, the
        dataset card and _SUCCESS last; returns the manifest."""
        from pipeline.data.card import write_card
        from pipeline.observability import pairs_per_hour
        from pipeline.provenance import provenance, redacted_config

        plan, store = self.plan, self.plan.store
        # _SUCCESS only after every marker is checked: summarize reads them all through verify.
        # verify also checks every marker's config hash: shards of another config never get _SUCCESS.
        checked = store.verify(plan.num_shards, plan.config_hash, plan.identity, output_schema(self.config, plan.extra))
        manifest = summarize(store, checked, plan.num_shards, plan.prompts_in)
        wall = time.perf_counter() - plan.started
        run_stats = self._run_stats()
        written = set(plan.pending)
        manifest.update(wall_seconds=round(wall, 3), startup_seconds=round(self.run_started - plan.started, 3),
                        run_seconds=round(self.last_commit - self.run_started, 3), config=redacted_config(self.config),
                        config_hash=plan.config_hash, identity=plan.identity, shards_written=list(plan.pending),
                        shards_skipped=[k for k in range(plan.num_shards) if k not in written],
                        prompts_truncated=self.truncated_prompts, run_stats=run_stats, pairs_this_run=self.pairs_made,
                        input=plan.source.provenance, input_files_skipped=dict(plan.source.skipped),
                        extra_columns=plan.extra.describe(), extra_columns_left_out=sorted(plan.extra.left_out))
        # The rate of this run only: resumed shards cost it nothing. One definition for every figure.
        self.metrics.set_rate(wall)
        manifest["pairs_per_minute"] = round(pairs_per_hour(self.pairs_made, wall) / 60, 2)
        report = self._report(manifest, wall, run_stats)
        manifest["report"] = "_report.json"
        manifest["provenance"] = provenance(self.config, models=plan.models_provenance)  # the models' from plan time
        # README.md, the dataset card that datasets.load_dataset(OUT) reads (None: a user's README is in the way).
        manifest["dataset_card"] = "README.md" if write_card(store, manifest) else None
        store.write_manifest(manifest)
        store.write_json("_report.json", report)
        store.write_success({"shards": plan.num_shards, "pairs": manifest["pairs"], "config_hash": plan.config_hash})
        return manifest

    def _run_stats(self) -> dict:
        """The workers' totals (Workers.stats), their actor times rounded."""
        from pipeline.observability import round_seconds

        run_stats = self.workers.stats()
        if "actor_time" in run_stats:
            run_stats["actor_time"] = round_seconds(run_stats["actor_time"])
        return run_stats

    def _report(self, manifest: dict, wall: float, run_stats: dict) -> dict:
        """The run report (_report.json): this run's figures, where the manifest describes the output."""
        from pipeline.observability import pairs_per_hour

        pairs, tokens, bon_tokens, plan = self.pairs_made, self.tokens, self.bon_tokens, self.plan
        return {
            "pairs": pairs, "prompts": self.prompts_run, "wall_seconds": round(wall, 3),
            # wall = startup (planning, cluster, actors, model loads: up to the first batch dispatched)
            # + run (to the last shard committed) + the final checks and the manifest.
            "startup_seconds": manifest["startup_seconds"], "run_seconds": manifest["run_seconds"],
            # Where each role's actors spent their span (actors.factory.actor_time_of); None for
            # workers that keep no timeline.
            "actor_time": run_stats.get("actor_time"),
            # Each HF generator actor's KV cache: blocks total and peak, bytes at peak, prompt bytes
            # shared, preemptions (pipeline.engines.kv_cache); None on other engines.
            "generator_kv": run_stats.get("generator_kv"),
            # Each HF reward actor's streaming pool, the same figures (pipeline.engines.rewards).
            "reward_kv": run_stats.get("reward_kv"),
            "pairs_per_hour": pairs_per_hour(pairs, wall),
            "generated_tokens": tokens, "bon_equivalent_tokens": bon_tokens, "tokens_saved": bon_tokens - tokens,
            "tokens_per_pair": round(tokens / pairs, 2) if pairs else None,
            "actor_restarts": self.metrics.totals["actor_restarts"], "batch_retries": self.coordinator.retries,
            "shards_written": len(plan.pending), "shards_skipped": plan.num_shards - len(plan.pending),
            "quarantined_candidates": self.quarantined,
            "metrics": dict(self.metrics.totals),
        }


def summarize(store: OutputStore, markers: Iterable[tuple[int, dict]], num_shards: int, prompts_in: int) -> dict:
    """Totals over every committed shard, from the checked commit markers ((shard, marker), as
    OutputStore.verify yields them, one at a time) and the reject files."""
    pairs = rejected = generated = bon = quarantined = candidates = 0
    reward = Counter()
    low, high = math.inf, -math.inf
    reasons: Counter = Counter()
    for k, marker in markers:
        stats = marker.get("stats", {})
        pairs += marker["rows"]
        rejected += marker["rejects"]["rows"]
        generated += stats.get("generated_tokens", 0)
        bon += stats.get("bon_equivalent_tokens", 0)
        quarantined += stats.get("quarantined", 0)
        candidates += stats.get("candidates", 0)
        reward.update({key: stats.get(key, 0) for key in ("reward_count", "reward_sum", "reward_sum_sq")})
        low, high = min(low, stats.get("reward_min", math.inf)), max(high, stats.get("reward_max", -math.inf))
        if marker["rejects"]["rows"]:
            _, rejects = store.read_shard(k)
            reasons.update(reason.split(" (")[0] for reason in rejects.column("reason").to_pylist())
    if pairs + rejected != prompts_in:
        raise RuntimeError(f"row count mismatch: {prompts_in} input rows but {pairs} pairs + {rejected} rejects")
    n = reward["reward_count"]
    mean = reward["reward_sum"] / n if n else None
    rewards = {"count": n, "mean": mean, "min": low if n else None, "max": high if n else None,
               "std": math.sqrt(max(reward["reward_sum_sq"] / n - mean * mean, 0.0)) if n else None}
    return {"prompts_in": prompts_in, "prompts_rejected": rejected, "pairs": pairs, "generated_tokens": generated,
            "bon_equivalent_tokens": bon, "tokens_saved": bon - generated, "reject_reasons": dict(reasons),
            "shards": num_shards, "candidates": candidates, "candidates_quarantined": quarantined,
            "reward_stats": rewards}


def _estimate_caveat(manifest: dict) -> str:
    """How far off the Best-of-N estimate may be: with speculative rejection's keep_lowest off it
    reads stopped rows off the best-ranked ones only (speculative_rejection.estimate_length)."""
    strategy = manifest.get("config", {}).get("strategy", {})
    if strategy.get("name") in ("sbon", "speculative_rejection") and strategy.get("keep_lowest") is False:
        return "; keep_lowest off: may run high, +22% measured at alpha 0.875, so savings are an upper bound"
    return ""


def format_summary(manifest: dict) -> str:
    from pipeline.observability import format_actor_time

    lines = [
        f"prompts        {manifest['prompts_in']}",
        f"pairs          {manifest['pairs']}",
        f"rejected rows  {manifest['prompts_rejected']}" + (
            f"  ({', '.join(f'{k}: {v}' for k, v in sorted(manifest['reject_reasons'].items()))})"
            if manifest["reject_reasons"] else ""),
        f"tokens generated       {manifest['generated_tokens']}",
        f"Best-of-N would need   {manifest['bon_equivalent_tokens']}  (estimate{_estimate_caveat(manifest)})"
        + (f"  (saved {1 - manifest['generated_tokens'] / manifest['bon_equivalent_tokens']:.1%}, estimated)"
           if manifest["bon_equivalent_tokens"] else ""),
        f"wall time      {manifest['wall_seconds']:.1f}s"
        + (f"  (startup {manifest['startup_seconds']:.1f}s, run {manifest['run_seconds']:.1f}s)"
           if "run_seconds" in manifest else ""),
        f"pairs/minute   {manifest['pairs_per_minute']}",
    ]
    for role, times in manifest.get("run_stats", {}).get("actor_time", {}).items():
        lines.append(f"{role + ' time':<15}{format_actor_time(times)}")
    if manifest.get("candidates_quarantined"):
        lines.append(f"quarantined    {manifest['candidates_quarantined']} candidates with a non-finite reward (_quarantine/)")
    return "\n".join(lines)

