"""The paged KV cache's compiled attention kernel (pipeline.engines.attention_kernel, issue 67): its
self-check covers what steps run (every bucket, rows as wide as a block table gets, the pool's ends),
so kernels wrong only there are caught; nothing process-wide is set by a step (no stance: another
thread's compiles are untouched); a thread count change recompiles and checks once instead of
gathering every step; a kernel is compiled for (and loaded from inductor's cache by) its CPU
capability and thread count only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import pipeline.engines.kv_cache as kv_cache
from pipeline.decoding.sampling import SamplingParams
from pipeline.engines import attention_kernel
from pipeline.engines.attention_kernel import AttentionKernel
from pipeline.engines.hf import HFEngine
from pipeline.engines.kv_cache import KVCache
from pipeline.engines.rows import RowBatch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _compiled_kernel(flex_kernel):
    """Pools here compile flex_attention, as in a build (conftest turns it off for the rest)."""


# -- kernels wrong only somewhere: injected, the check must catch them ------------------------------


def _exact(options, backend=None):
    """An exact kernel without a compile (these tests are about the check, not inductor): each row's
    blocks as the BlockMask lists them (its whole blocks, then its partial one, filled as far as its
    ``mask_mod`` reads), gathered, then SDPA. Eager flex_attention is no reference here: it applies
    ``mask_mod`` densely and ignores the mask's block lists."""
    def call(query, key, value, mask, scale):
        bs = mask.BLOCK_SIZE[1]
        closure = dict(zip(mask.mask_mod.__code__.co_freevars, (c.cell_contents for c in mask.mask_mod.__closure__)))
        whole, partial = mask.full_kv_num_blocks[:, 0, 0], mask.kv_num_blocks[:, 0, 0]
        lengths = (whole * bs + partial * closure["filled"][:len(whole)]).numpy()
        tables = torch.cat([mask.full_kv_indices[:, 0, 0], mask.kv_indices[:, 0, 0, :1]], 1).numpy().copy()
        for row in range(len(tables)):  # the partial block right after the whole ones
            tables[row, int(whole[row])] = int(mask.kv_indices[row, 0, 0, 0])
        out = torch.zeros_like(query)
        rows = np.flatnonzero(lengths)
        if len(rows):
            out[rows] = attention_kernel.gather_attention(query[rows], key, value, tables[rows], lengths[rows], bs,
                                                          scale)
        return out

    return call


def _wrong_where(condition):
    """A kernel off by 0.05 on the rows where ``condition(block_mask, rows, pool_blocks)`` ([B] bool) holds."""
    def make(options, backend=None):
        right = _exact(options)

        def call(query, key, value, block_mask, scale):
            out = right(query, key, value, block_mask, scale)
            rows = query.shape[0]
            wrong = condition(block_mask, rows, key.shape[2] // block_mask.BLOCK_SIZE[1])
            return out + 0.05 * wrong.to(out.dtype)[:, None, None, None]

        return call
    return make


def _long_rows(mask, rows, blocks):  # rows attending 5 whole blocks or more
    return mask.full_kv_num_blocks[:, 0, 0] >= 5


def _filled(mask) -> torch.Tensor:  # [B] tokens of each row's partial block
    closure = dict(zip(mask.mask_mod.__code__.co_freevars, (c.cell_contents for c in mask.mask_mod.__closure__)))
    return closure["filled"][:mask.kv_num_blocks.shape[0]] * mask.kv_num_blocks[:, 0, 0]


def _one_bucket(mask, rows, blocks):  # the 16-row bucket's last slot, on a row of one token
    wrong = torch.zeros(rows, dtype=torch.bool)
    if rows == 16:
        wrong[-1] = bool(mask.full_kv_num_blocks[-1, 0, 0] == 0) and bool(_filled(mask)[-1] == 1)
    return wrong


def _pool_end(mask, rows, blocks):  # a row whose partial block is the pool's last, one token in it
    return (_filled(mask) == 1) & (mask.kv_indices[:, 0, 0, 0] == blocks - 1)


def _kernel(block_size=16, blocks=64, row_blocks=20, max_rows=16):
    keys = torch.empty(1, 2, blocks * block_size, 8)
    return AttentionKernel(keys, torch.empty_like(keys), 4, block_size, row_blocks, max_rows=max_rows)


@pytest.mark.parametrize("condition", [_long_rows, _one_bucket, _pool_end])
def test_a_kernel_wrong_only_on_long_rows_at_one_bucket_or_at_the_pools_end_is_caught(monkeypatch, condition):
    """The allocation check runs deterministic cases in every bucket (rows as wide as the block table,
    at the bucket's first and last slots, with the pool's first and last blocks whole and partial)
    beside random ones, so a kernel wrong only on rows of 5 blocks or more, only on a one-token row at
    the 16-row bucket's last slot, or only where a row's partial block is the pool's last with one
    token in it is not trusted: the pool gathers and says why (the earlier check's random draws, rows
    up to 4 blocks, missed the first two). The same check trusts the exact kernel."""
    monkeypatch.setattr(attention_kernel, "_own_flex", _exact)
    exact = _kernel()
    exact.warm_up()
    assert exact.kernel == "flex_attention" and exact.check_error < 1e-5, exact.reason
    monkeypatch.setattr(attention_kernel, "_own_flex", _wrong_where(condition))
    wrong = _kernel()
    wrong.warm_up()
    assert wrong.kernel == "gather" and "differs from the gather by 0.05" in wrong.reason


def test_the_check_covers_every_bucket_the_widest_row_and_both_ends_of_the_pool(monkeypatch):
    """What the check's kernel calls see, per bucket: a row as wide as the block table, the pool's
    first and last blocks, the bucket's first and last slots; the pool's keys, values and device
    tables are as they were after it."""
    seen: dict[int, dict] = {}

    def recording(options, backend=None):
        right = _exact(options)

        def call(query, key, value, mask, scale):
            rows = seen.setdefault(query.shape[0], {"width": 0, "blocks": set(), "slots": set()})
            whole, partial = mask.full_kv_num_blocks[:, 0, 0], mask.kv_num_blocks[:, 0, 0]
            rows["width"] = max(rows["width"], int((whole + partial).max()))
            for slot in torch.nonzero(whole + partial).flatten().tolist():
                rows["slots"].add(slot)
                rows["blocks"].update(mask.full_kv_indices[slot, 0, 0, :int(whole[slot])].tolist())
                if partial[slot]:
                    rows["blocks"].add(int(mask.kv_indices[slot, 0, 0, 0]))
            return right(query, key, value, mask, scale)

        return call

    monkeypatch.setattr(attention_kernel, "_own_flex", recording)
    kernel = _kernel(blocks=64, row_blocks=30, max_rows=100)
    torch.manual_seed(1)
    kernel.keys.normal_()
    before = kernel.keys.clone()
    kernel.write_rows(np.arange(3), np.arange(90, dtype=np.int32).reshape(3, 30) % 64)
    tables = kernel._tables.clone()
    kernel.warm_up()
    assert kernel.buckets == [1, 16, 100] and sorted(seen) == kernel.buckets
    for bucket, rows in seen.items():
        assert rows["width"] == 30 and {0, 63} <= rows["blocks"] and {0, bucket - 1} <= rows["slots"], bucket
    assert torch.equal(kernel.keys, before) and torch.equal(kernel._tables, tables)


# -- nothing process-wide, and a thread count change -----------------------------------------------


def _settings() -> dict:
    return {"stance": torch._dynamo.eval_frame._stance, "dynamo": torch._dynamo.config.get_config_copy(),
            "inductor": torch._inductor.config.get_config_copy()}


def _thread_safe_kernel_funcs(monkeypatch) -> None:
    """transformers' Llama attention runs inside ``kernels``' CompileableContextVar (kernels 0.19), which
    switches to a process-global variable whenever ``torch.compiler.is_compiling()`` is true, and that
    flag is process-wide in torch 2.13: while any thread compiles, two forwards on two other threads
    race on it (``TypeError: expected an instance of Token``). Not the engine's state; these tests'
    forwards are never traced, so the plain context variable is the right one for them."""
    from kernels._internals.layer import layer

    variable = layer._ACTIVE_KERNEL_FUNCS.context_var
    monkeypatch.setattr(layer._ACTIVE_KERNEL_FUNCS, "get", variable.get)
    monkeypatch.setattr(layer._ACTIVE_KERNEL_FUNCS, "set", variable.set)
    monkeypatch.setattr(layer._ACTIVE_KERNEL_FUNCS, "reset", variable.reset)


def test_engines_stepping_on_two_threads_leave_another_threads_compiles_and_torchs_settings_alone(tiny_models,
                                                                                                  monkeypatch):
    """Two engines step on two threads (compiled kernels, 40 steps each) while a third compiles fresh
    functions and recompiles them for new shapes: it sees no error (no stance is set, not even for a
    step), torch's stance and dynamo's and inductor's configurations are what they were, and a pool
    built afterwards compiles its own kernel (one graph per bucket) and checks it."""
    engines = [HFEngine.from_pretrained(str(tiny_models["generator"]), kv_cache_memory="4MB", kv_rows=4)
               for _ in range(2)]  # each its own model: a step sets its model's attention implementation
    base = engines[0]
    prompt = base.tokenizer("Describe how the blender works").input_ids
    for engine in engines:  # the pools and their kernels first: the threads below only step
        engine.generate([prompt], 1, [0], SamplingParams(max_new_tokens=2))
        assert engine.stats()["kv_kernel"] == "flex_attention"
    _thread_safe_kernel_funcs(monkeypatch)
    settings = _settings()
    done, errors, stepping_errors, compiled = threading.Event(), [], [], [0]

    def compile_fresh():
        number = 0
        while not done.is_set():
            number += 1
            fresh = torch.compile(lambda x, k=number: x * k + 1, backend="eager")
            try:
                for size in (3, 4, 5):  # a new function, then recompiles for new shapes
                    assert float(fresh(torch.ones(size)).sum()) == size * (number + 1)
                compiled[0] += 1
            except Exception as exc:  # noqa: BLE001 - the test counts them
                errors.append(exc)

    def step(engine, seed):
        try:
            engine.generate([prompt], 4, [seed + k for k in range(4)], SamplingParams(max_new_tokens=40,
                                                                                      ignore_eos=True))
        except Exception as exc:  # noqa: BLE001 - the test names it
            stepping_errors.append(exc)

    compiler = threading.Thread(target=compile_fresh)
    compiler.start()
    steppers = [threading.Thread(target=step, args=(engine, 10 * i)) for i, engine in enumerate(engines)]
    for thread in steppers:
        thread.start()
    for thread in steppers:
        thread.join()
    done.set()
    compiler.join()
    assert not errors, f"{len(errors)} errors compiling beside the engines ({compiled[0]} compiled), the first: " \
                       f"{errors[0]!r}"
    assert compiled[0] > 0 and not stepping_errors, stepping_errors
    assert _settings() == settings
    assert all(engine.stats()["kv_kernel_gathered_steps"] == 0 for engine in engines)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    later = KVCache(base.model, base.device, memory=4 << 20, block_size=16, max_rows=4)
    batch, _ = RowBatch.prefill(base.model, [prompt], base.pad_id, base.device)
    later.admit(batch, [0])
    stats = later.stats()
    assert stats["kv_kernel"] == "flex_attention" and stats["kv_kernel_compiles"] == 2
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 2  # it did compile, not replay


def test_a_thread_count_change_recompiles_and_checks_once_and_keeps_the_kernel(engine):
    """A pool checked at one thread count, stepped at another: its next step compiles the kernel for
    the new count and checks it (once: later steps compile nothing), and every step runs the kernel
    with the gather's logits (before, every step gathered). Back at the first count, the first
    kernel is used again, with no compile."""
    threads = torch.get_num_threads()
    other = 1 if threads != 1 else 2
    prompt = engine.tokenizer("Tell me if the camera is good").input_ids
    batch, _ = RowBatch.prefill(engine.model, [prompt], engine.pad_id, engine.device)
    kv = KVCache(engine.model, engine.device, memory=4 << 20, block_size=16, max_rows=1)
    (row,) = kv.admit(batch, [0])
    assert kv.stats()["kv_kernel_compiles"] == 1
    logits = []
    try:
        torch.set_num_threads(other)
        for token in range(3, 23):
            logits.append(kv.step([row], torch.tensor([token]), logits_to_keep=1).logits[:, -1])
        stats = kv.stats()
        assert stats["kv_kernel"] == "flex_attention" and stats["kv_kernel_gathered_steps"] == 0
        assert stats["kv_kernel_compiles"] == 2 and stats["kv_kernel_rechecks"] == 1
        torch.set_num_threads(threads)
        logits.append(kv.step([row], torch.tensor([23]), logits_to_keep=1).logits[:, -1])
        assert kv.stats()["kv_kernel_compiles"] == 2 and kv.stats()["kv_kernel_gathered_steps"] == 0
    finally:
        torch.set_num_threads(threads)
    os.environ[kv_cache.KERNEL_ENV] = "gather"
    try:
        gathered = KVCache(engine.model, engine.device, memory=4 << 20, block_size=16)
        (same,) = gathered.admit(batch, [0])
        reference = [gathered.step([same], torch.tensor([t]), logits_to_keep=1).logits[:, -1] for t in range(3, 24)]
    finally:
        del os.environ[kv_cache.KERNEL_ENV]
    torch.testing.assert_close(torch.cat(logits), torch.cat(reference), atol=1e-5, rtol=1e-5)


def test_steps_past_the_largest_bucket_gather_counted_once_per_step_with_the_reason(engine, monkeypatch):
    """A step whose rows reach past the largest bucket gathers: counted once per step (not per layer
    call), with its reason in stats."""
    monkeypatch.setattr(attention_kernel, "_own_flex", _exact)
    prompt = engine.tokenizer("Hi").input_ids
    batch, _ = RowBatch.prefill(engine.model, [prompt], engine.pad_id, engine.device)
    kv = KVCache(engine.model, engine.device, memory=4 << 20, block_size=16, max_rows=1)
    handles = kv.admit(batch, [0, 0])  # slot 1: past the one-row bucket
    for token in range(3, 8):
        kv.step(handles, torch.full((2,), token), logits_to_keep=1)
    stats = kv.stats()
    assert engine.model.config.num_hidden_layers > 1
    assert stats["kv_kernel_gathered_steps"] == 5
    assert stats["kv_kernel_gathered_reasons"] == {attention_kernel.PAST_BUCKETS.format(1): 5}


def test_a_large_pool_keeps_the_kernel_for_its_rows_or_says_at_allocation_what_it_does(caplog):
    """The largest bucket is the pool's configured rows (runtime.rows_in_flight): 1,024 rows in a
    16,384-block pool fit the kernel's index; where they do not (65,536 blocks), the largest bucket
    is what fits and one line at allocation says so and why."""
    assert _kernel(blocks=16384, max_rows=1024).buckets == [1, 16, 256, 1024]
    assert _kernel(blocks=4096, max_rows=1024).buckets == [1, 16, 256, 1024]
    large = _kernel(blocks=65536, max_rows=1024)
    assert large.buckets == [1, 16, 256] and "steps of up to 256 rows, not 1024" in large.cut
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(kv_cache.KERNEL_ENV, "gather")
        large.warm_up()
    assert large.stats()["kv_kernel_cut"] == large.cut


# -- inductor's cache: keyed by the CPU capability and the thread count ------------------------------

_COMPILE_ONE = """
import json, sys, torch
from torch._dynamo.utils import counters
from pipeline.engines.attention_kernel import AttentionKernel
torch.set_num_threads(1)
keys = torch.empty(1, 2, 64 * 16, 8)
hits = []
for _ in range(int(sys.argv[1])):
    kernel = AttentionKernel(keys, torch.empty_like(keys), 4, 16, 8, max_rows=1)
    kernel.warm_up()
    assert kernel.kernel == "flex_attention", kernel.reason
    hits.append(counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"])
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "hits": hits}))
"""


@pytest.mark.slow
def test_a_kernel_another_cpu_capability_compiled_is_never_loaded_from_inductors_cache(tmp_path):
    """An AVX2 process (ATEN_CPU_CAPABILITY=avx2) and a default one at the same thread count share an
    inductor cache directory: the default one loads nothing the AVX2 one wrote (it compiles its own),
    and a second pool of its own shape does load its first pool's kernel (the cache still works)."""
    def run(pools: int, capability: str | None) -> dict:
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        env.update({"BON_KV_KERNEL": "", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)},
                   **({"ATEN_CPU_CAPABILITY": capability} if capability else {}))
        done = subprocess.run([sys.executable, "-c", _COMPILE_ONE, str(pools)], cwd=REPO, capture_output=True,
                              text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    avx2 = run(1, "avx2")
    native = run(2, None)  # the CPU's own capability
    if native["capability"] == avx2["capability"]:
        pytest.skip("this CPU's capability is AVX2 already: nothing to tell apart")
    assert native["hits"][0] == 0 and native["hits"][1] > 0, (avx2, native)


# -- where it shows: the actor's time and the progress line ----------------------------------------


def test_the_kernels_warm_up_is_a_part_of_the_generators_time_apart_from_sampling_and_bookkeeping():
    """A generator's call in which a pool compiles and checks its kernel: the report's breakdown
    counts that as ``kernel_warm_up``, not as sampling and bookkeeping (the tiny build's 29.9 s of
    "sampling_and_bookkeeping" against 0.68 s of forward passes was nearly all warm-up)."""
    import time

    from pipeline.engines.rows import timed_warm_up
    from pipeline.observability import ActorTimeline, format_actor_time

    timeline = ActorTimeline(lambda: 0, compute="sampling_and_bookkeeping", open_wait="waiting_for_rewards",
                             warm_up="kernel_warm_up")
    with timeline.call(None):
        with timed_warm_up():
            time.sleep(0.3)
        time.sleep(0.05)
    parts = timeline.stats()["breakdown_seconds"]
    assert parts["kernel_warm_up"] == pytest.approx(0.3, abs=0.05)
    assert parts["sampling_and_bookkeeping"] == pytest.approx(0.05, abs=0.04)
    assert sum(parts.values()) == pytest.approx(timeline.stats()["span_seconds"])
    assert "kernel warm up" in format_actor_time(timeline.stats())


def test_the_progress_line_says_when_a_pool_gathers_and_why():
    """The shard line's KV part names the kernels' warm-up and, where a pool gathers, for how many
    steps and why (a whole pool, or steps past its largest bucket)."""
    from pipeline.observability import ShardLog, kernel_note

    cut = _kernel(blocks=65536, max_rows=1024)
    cut.kernel, cut.reason, cut.warm_up_seconds = "flex_attention", "", 12.5
    cut._gathered(attention_kernel.PAST_BUCKETS.format(256))
    off = _kernel()
    off._off("compiled flex_attention differs from the gather by 0.86 at 1 rows")
    note = kernel_note([cut.stats(), off.stats()])
    assert note == ("kernel warm-up 12.5s; gathered 1 steps: rows past the largest row bucket (256 rows); "
                    "gathers every step: compiled flex_attention differs from the gather by 0.86 at 1 rows")
    kv = {"kv_blocks_used": 1, "kv_blocks_total": 4, "kv_bytes_total": 2**30, "kv_preemptions": 0,
          "kv_kernel_note": note}
    line = ShardLog(1, 1, bars=False).shard_committed(0, 1, 0, kv)
    assert line.endswith(f"| KV 25% of 1.00 GiB, 0 preemptions, {note}")
