"""The paged KV cache's attention: one decoding step's rows attending their blocks in place, for one
pool (pipeline.engines.kv_cache), in the spirit of vLLM v1's attention backends: the kernel owns its
device-side metadata (block tables, per-row block counts), the KV manager tells it which rows changed.

    kernel = AttentionKernel(keys, values, heads, block_size, row_blocks, max_rows)   # one pool
    kernel.warm_up()                    # compile each row bucket, check each against the gather
    kernel.write_rows(handles, tables)  # rows whose block tables changed (admitted, grown, cut)
    step = kernel.step(handles, lengths, tables)   # the step's metadata: O(rows), not O(pool)
    out = kernel.attend(query, keys, values, step, scale)

The kernel is torch's ``flex_attention``, compiled. Each row of the pool has a *slot* (its handle in
the KV manager), and a step runs the kernel over the slots ``[0, bucket)`` where ``bucket`` is the
smallest of a few static sizes (powers of BUCKET_BASE up to ``max_rows``) above the highest
stepping slot; slots that do not step attend no block (a null row: no work, output unused). So
every call has a static shape: inductor builds each bucket once, at ``warm_up`` (never during a
build), and on CUDA flex_attention takes its decoding kernel, which it uses for a static batch only
(torch/_inductor/kernel/flex/flex_decoding.py). On CPU the pool keeps inductor's general template,
whose work follows each row's own blocks; the CPU decoding template spans the whole pool once rows
differ in length (``kernel_options``). The metadata lives on the device and is written by
slot: a step writes its rows' block counts (n values), a new block one table entry, an admission
its rows' tables; nothing per step grows with the pool's block count.

The BlockMask (``BlockMask.from_kv_blocks``): each stepping row's whole blocks are "full" blocks
(``full_kv_indices``: its block table, ``row_blocks`` wide), its last, partial block the one
"partial" block, masked past the row's length (``mask_mod``). Inductor's CPU template asserts that
``kv_indices`` is as wide as the pool (pool tokens / block size); since only its first column is
read (one partial block per row), it is a stride-0 view (``expand``) of one column, no memory.

Checked before trusted: ``warm_up`` runs every bucket's compiled kernel against the gather path
(each row's blocks gathered, then SDPA: the reference) on random keys and values written into
blocks of the pool, over what steps run: deterministic cases (rows as wide as a block table gets,
``row_blocks``, at the bucket's first and last slots, with the pool's first and last blocks as
whole and as partial blocks; short rows at those ends) beside random ones (random slots, widths up
to the table's, lengths across block boundaries, null rows among them). Where a bucket does not
compile (no C++ compiler, an inductor error, torch.compile running the call eagerly) or disagrees
beyond float tolerance, the pool gathers for every step; one warning line says why, and ``stats()``
(the generator's section of a build's ``_report.json``) records the kernel in use and the reason. A
runtime error inside a step (an out-of-memory) never switches the kernel off: it is the step's
caller's (pipeline.engines.step_loop).

Trusted only where checked: inductor's C++ code depends on the CPU's vector ISA (ATen's capability,
which ``ATEN_CPU_CAPABILITY`` sets) and on the thread count, and its on-disk FX graph cache keys the
thread count but not the ISA (torch 2.13), so a kernel written by an AVX2 process was loaded, wrong,
by an AVX-512 one. Each compile carries ``compile_key`` (device, capability, ISA, threads) into
inductor's own cache key (a no-op post-grad pass whose ``uuid`` is the key: ``_CacheKey``), so a
cache entry another capability or thread count wrote is never loaded. When the thread count changes
under a pool, the pool's next step compiles and checks the kernel for the new count, once (a kernel
per key, kept), instead of gathering every step.

Why static buckets: with the row count dynamic (torch.compile's automatic dynamic shapes, the
previous design), inductor's CPU flex template returned wrong attention for 8-token blocks on an
AVX2 CPU (errors of 29 to 540 on random K/V; docs/design.md has the reproducer), and on CUDA
decoding fell back to the general kernel.

Nothing process-wide, not even for the length of a step: each pool compiles its own copy of the call
(its own code object per key, so dynamo's per-function cache and recompile limit are its own) with
its own backend (``_PoolBackend``: inductor, which compiles only while the pool checks). A guard that
fails during a build (anything that would recompile: the checked code no longer applies) reaches
that backend, which hands dynamo a call that refuses to run; the step gathers instead (counted, with
the reason). No stance, dynamo or inductor setting is changed; the only patch is the cache-key pass,
inside inductor's own compile (``compile_fx``'s ``config_patches``, undone by inductor on return).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import types
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.engines.rows import timed_warm_up
from pipeline.errors import UncheckedKernel

log = logging.getLogger(__name__)

KERNEL_ENV = "BON_KV_KERNEL"
"""Set to ``gather`` to make every pool gather its rows' blocks for SDPA rather than compile
flex_attention: a diagnostic switch (and the rest of the test suite's setting: each new pool shape
costs a compile per bucket, seconds each on a CPU; the kernel's own tests run the compiled kernel)."""
BUCKET_BASE = {"cpu": 16}
"""Row buckets are powers of this, per device type (others: 4), up to the pool's ``max_rows``: few
compiles per pool (inside dynamo's default recompile limit of 8 per function). On CPU a null row
costs little in the general template (measured, 978 blocks of 128 tokens, SmolLM2-135M's heads: one
row 0.60 ms per layer in a 256-row bucket against 0.22-0.41 ms in 1- to 64-row ones, 8 rows 1.39
against 1.18 ms), so 1, 16, 256, then the pool's ``max_rows``: three compiles for 128 rows in flight
(1, 16, 128) instead of five, each seconds of warm-up. On CUDA (not measured here): 1, 4, 16, 64,
..., at most 4x null rows."""
MAX_ROWS = 1024
"""The most rows one step's kernel call serves when the pool is not told (``max_rows``); a step
with a higher slot gathers (counted in ``stats``)."""
INDEX_BYTES = 64 << 20
"""The most bytes of the partial blocks' index (``kv_indices``: [rows, pool blocks] int32, which
inductor's CPU template wants as wide as the pool and materializes once) a pool's kernel may take:
its largest bucket is cut to what fits, INDEX_BYTES / (4 x pool blocks) rows (4,096 rows at 4,096
blocks, 1,024 at 16,384, 256 at 65,536). A pool so cut says so in one line at its allocation; its
steps past the cut gather (counted, with the reason, in ``stats``)."""
CHECK_TOKENS = 1 << 15
"""The most row-tokens (rows x the widest row's tokens) one random case of the self-check gathers for
its reference; the deterministic cases hold two rows, each at most a whole block table."""
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
"""The largest absolute difference from the gather the self-check accepts, per dtype (others: 5e-2,
half precision); the check's keys, values and queries are standard normal."""


def gathers() -> bool:
    """Whether BON_KV_KERNEL asks every pool to gather."""
    return os.environ.get(KERNEL_ENV, "").strip().lower() == "gather"


def row_buckets(max_rows: int, device: str = "cpu") -> list[int]:
    """The static row counts a pool's kernel is compiled for on ``device`` (a device type): powers of
    its BUCKET_BASE from 1 below ``max_rows``, then ``max_rows`` itself (the rows the pool is
    configured for, runtime.rows_in_flight: no bucket wider than they need, so no partial-block
    index wider than they need)."""
    sizes, base = [1], BUCKET_BASE.get(device, 4)
    while sizes[-1] * base < max_rows:
        sizes.append(sizes[-1] * base)
    return sizes + [max_rows] if max_rows > 1 else sizes


def gather_attention(query, key, value, tables: np.ndarray, lengths: np.ndarray, block_size: int, scale,
                     queries: np.ndarray | None = None) -> torch.Tensor:
    """The reference: each row's blocks gathered from the pool (``key``/``value`` [1, Hkv, T, D]) into
    contiguous keys and values, then SDPA. ``query`` [n, Hq, C, D]; ``tables`` [n, MB] and
    ``lengths`` [n] (tokens each row attends, the new ones included); ``queries`` [n, C] each query's
    logical place in its row (a chunked feed: causal), None for one query per row (a step)."""
    width = int(lengths.max())
    logical = np.arange(width)[None, :]
    valid = logical < lengths[:, None]
    blocks = np.take_along_axis(tables, np.where(valid, logical, 0) // block_size, axis=1).astype(np.int64)
    places = torch.from_numpy(blocks * block_size + np.where(valid, logical, 0) % block_size).to(query.device)
    if queries is None:
        allowed = valid[:, None, None, :]  # [n, 1, 1, W]
    else:
        allowed = (valid[:, None, :] & (logical[:, None, :] <= queries[:, :, None]))[:, None]  # [n, 1, C, W]
    keys = key[0][:, places].transpose(0, 1)  # [n, Hkv, W, D]
    values = value[0][:, places].transpose(0, 1)
    return torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=torch.from_numpy(allowed).to(query.device), scale=scale, enable_gqa=True)


@dataclass
class Step:
    """One step's attention metadata: the stepping rows' slots (handles) and what the gather needs.
    ``bucket``: the kernel's row count for this step; 0: this step gathers."""

    slots: torch.Tensor  # [n] int64, on the device
    tables: HostRows  # the rows' host block tables (read only by the gather)
    lengths: np.ndarray  # [n] tokens each row attends, the new one included
    bucket: int
    fell_back: bool = False
    """A layer's kernel call refused to run (a failed guard): this step's layers gather (counted once)."""


_copies = itertools.count()


def compile_key(device: torch.device) -> tuple:
    """What the compiled kernel's code depends on beyond its inputs' shapes: on CPU, ATen's CPU
    capability (``torch.backends.cpu.get_cpu_capability()``, which ``ATEN_CPU_CAPABILITY`` sets),
    the vector ISA inductor picks (it reads the same variable), and the thread count (inductor's C++
    loops are specialized on it, and dynamo guards on it); elsewhere the device type and the thread
    count (the guard). Picking the ISA costs milliseconds: this is read at a compile, not per step."""
    if device.type != "cpu":
        return (device.type, torch.get_num_threads())
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return ("cpu", torch.backends.cpu.get_cpu_capability(), str(pick_vec_isa()), torch.get_num_threads())


def kernel_options(device: torch.device, block_size: int) -> dict:
    """flex_attention's kernel options for a pool: on CPU, a PARTITION_SIZE that is not a multiple of
    the block size, which keeps inductor on its general CPU template.

    With a static row count and one query per row, inductor's CPU template picks its decoding variant
    where the pool's tokens over the bucket's rows reach 512 (torch/_inductor/codegen/
    cpp_flex_attention_template.py, ``choose_flex_template``; PARTITION_SIZE a multiple of the KV
    block size). That variant splits each row's keys into partitions of PARTITION_SIZE tokens, but as
    soon as two rows attend different numbers of blocks (rows of different lengths, or a null row:
    every real step) it spans the whole pool instead: rows x heads x (pool tokens / PARTITION_SIZE)
    partitions, each zero-filled, with a scratch buffer that large allocated per call. Measured
    (``benchmarks.paged_attention``; docs/benchmarks.md, "The CPU template"): 8 rows of mixed lengths
    in a 978-block pool, 50 ms per layer against 1.1 ms with the general template; it made speculative
    rejection, whose pruned steps fall into small buckets, twice as slow. PARTITION_SIZE is read by
    the decoding variant only (for 1-token blocks every size is a multiple). On CUDA inductor's own
    choice stands (its decoding kernel for a static row count)."""
    return {"PARTITION_SIZE": block_size + 1} if device.type == "cpu" else {}


def _refuse(*args):
    raise UncheckedKernel("the checked kernel's guards failed; a new compile would run unchecked")


def _cache_key_pass(key: tuple):
    """A post-grad pass that changes nothing and whose ``uuid`` is ``key``: inductor's FX graph and
    AOTAutograd caches hash custom passes' uuids into their keys (torch/_inductor/codecache.py,
    ``FxGraphHashDetails``), so a compile carrying it loads only what a compile with the same key
    wrote."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _CacheKey(CustomGraphPass):
        def __call__(self, graph) -> None:
            return None

        def uuid(self):
            return ("bon-paged-attention", key)

    return _CacheKey()


class _PoolBackend:
    """One pool's torch.compile backend for one ``compile_key``: inductor's ``compile_fx`` with the key
    in inductor's cache key (``_cache_key_pass``, beside any custom passes already configured), while
    the pool checks (``checking``); outside it, a compile dynamo asks for (a guard failed during a
    step) gets ``_refuse``: nothing unchecked runs. ``compiles``: the graphs inductor built for it."""

    def __init__(self, key: tuple):
        self.key, self.checking, self.compiles, self.refused = key, False, 0, 0

    def __call__(self, graph, example_inputs):
        if not self.checking:
            self.refused += 1
            return _refuse
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx
        from torch._inductor.custom_graph_pass import get_custom_graph_passes

        passes = [*get_custom_graph_passes(config.post_grad_custom_pre_pass), _cache_key_pass(self.key)]
        compiled = compile_fx(graph, example_inputs, config_patches={"post_grad_custom_pre_pass": passes})
        self.compiles += 1
        return compiled


def _own_flex(options: dict, backend):
    """A compiled flex_attention call of its own: a fresh code object, so that dynamo's cache entries
    and recompile limit are this call's alone, compiled by ``backend`` (a _PoolBackend).
    ``options``: ``kernel_options``."""
    from torch.nn.attention.flex_attention import flex_attention

    def call(query, key, value, block_mask, scale):
        return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True,
                              kernel_options=options or None)

    code = call.__code__.replace(co_name=f"paged_flex_{next(_copies)}")
    own = types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)
    return torch.compile(own, backend=backend, dynamic=False)


REFUSED = "a checked kernel's guard failed (it would have compiled anew, unchecked)"
PAST_BUCKETS = "rows past the largest row bucket ({} rows)"


class AttentionKernel:
    """The decode attention of one pool (see the module docstring)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, heads: int, block_size: int, row_blocks: int,
                 max_rows: int = MAX_ROWS):
        """``keys``/``values``: one layer of the pool, [1, Hkv, NB * bs, D] (every layer has its shape);
        ``heads``: query heads; ``row_blocks``: the most blocks a row holds (its table's width);
        ``max_rows``: the rows a step serves (runtime.rows_in_flight), the largest bucket's unless the
        pool is too wide for it (INDEX_BYTES)."""
        self.keys, self.values, self.heads, self.block_size = keys, values, heads, block_size
        self.device = keys.device
        self.num_blocks = keys.shape[2] // block_size
        self.row_blocks = row_blocks
        fit = INDEX_BYTES // (4 * self.num_blocks)
        wanted = row_buckets(max(1, max_rows), self.device.type)
        self.buckets = [b for b in wanted if b < fit] + ([fit] if fit <= wanted[-1] else []) if fit >= 1 else [1]
        self.cut = ("" if self.buckets[-1] >= wanted[-1] else
                    f"a pool of {self.num_blocks} blocks keeps the kernel for steps of up to {self.buckets[-1]} "
                    f"rows, not {wanted[-1]}: its partial-block index ({self.buckets[-1]} x {self.num_blocks} "
                    f"int32) is capped at INDEX_BYTES ({INDEX_BYTES >> 20} MiB); steps of more rows gather")
        """Why the largest bucket is below ``max_rows`` ("" when it is not)."""
        self._too_wide = fit < 1
        self.kernel = "gather"
        """What steps run: "flex_attention" (compiled, checked) or "gather"."""
        self.reason = "not warmed up"
        """Why the pool gathers ("" when it runs the kernel)."""
        self.compiles = 0
        """Graphs inductor compiled for this pool (a bucket per key checked; at warm_up, and once more
        per bucket after the thread count changes)."""
        self.rechecks = 0
        """Times the kernel was compiled and checked again for a changed thread count."""
        self.warm_up_seconds = 0.0
        """Seconds spent compiling and checking (all keys)."""
        self.check_error = 0.0
        """The largest difference from the gather over the self-check's cases."""
        self.gathered_steps = 0
        """Steps gathered although the kernel is on: rows past the largest bucket, or a failed guard
        (each step counted once, whatever its layers)."""
        self.gathered_reasons: dict[str, int] = {}
        """``gathered_steps`` by reason."""
        capacity = self.buckets[-1]
        i32 = dict(dtype=torch.int32, device=self.device)
        self._tables = torch.zeros((capacity, row_blocks), **i32)  # [C, MB] each slot's block table
        self._whole = torch.zeros(capacity, **i32)  # [C] whole blocks a slot attends this step (0: not stepping)
        self._partial = torch.zeros(capacity, **i32)  # [C] 1 when it attends a partial last block
        self._last = torch.zeros(capacity, **i32)  # [C] that block
        self._filled = torch.zeros(capacity, **i32)  # [C] tokens of it attended
        self._masks: dict[int, object] = {}
        self._flex = None
        self._checked: dict[tuple, tuple] = {}  # compile_key -> (compiled call, its backend), each checked
        self._threads = torch.get_num_threads()  # the thread count of the kernel in use
        self.options = kernel_options(self.device, block_size)
        """flex_attention's kernel options (``kernel_options``; {}: inductor's own template choice)."""

    # -- metadata --------------------------------------------------------------------------------

    def write_rows(self, slots: np.ndarray, tables: np.ndarray) -> None:
        """Rows whose block tables changed (``tables`` [k, MB], host): their device copies."""
        inside = slots < self._tables.shape[0]
        if inside.any():
            index = torch.from_numpy(slots[inside].astype(np.int64)).to(self.device)
            self._tables.index_copy_(0, index, torch.from_numpy(tables[inside]).to(self.device))

    def write_blocks(self, slots: np.ndarray, columns: np.ndarray, blocks: np.ndarray) -> None:
        """New blocks (a step's): ``blocks[i]`` at column ``columns[i]`` of slot ``slots[i]``'s table."""
        inside = slots < self._tables.shape[0]
        if inside.any():
            flat = slots[inside].astype(np.int64) * self.row_blocks + columns[inside]
            self._tables.view(-1).index_copy_(0, torch.from_numpy(flat).to(self.device),
                                               torch.from_numpy(blocks[inside].astype(np.int32)).to(self.device))

    def step(self, slots: np.ndarray, lengths: np.ndarray, tables: np.ndarray) -> Step:
        """The metadata of a step of rows ``slots`` attending ``lengths`` tokens each (the new one
        included); ``tables``: the manager's host tables (read at the rows only). Where the thread
        count changed since the kernel in use was checked, the kernel for the new count first
        (compiled and checked once, ``warm_up``)."""
        if self.kernel != "gather" and torch.get_num_threads() != self._threads:
            log.info("KV cache: the thread count changed from %d to %d; the kernel is compiled and checked for "
                     "%d threads", self._threads, torch.get_num_threads(), torch.get_num_threads())
            self.warm_up()
        top = int(slots.max()) + 1 if len(slots) else 1
        bucket = next((b for b in self.buckets if b >= top), 0) if self.kernel != "gather" else 0
        if not bucket and self.kernel != "gather":
            self._gathered(PAST_BUCKETS.format(self.buckets[-1]))
        return self._metadata(slots, lengths, tables, bucket)

    def _metadata(self, slots: np.ndarray, lengths: np.ndarray, tables: np.ndarray, bucket: int) -> Step:
        bs = self.block_size
        index = torch.from_numpy(slots.astype(np.int64)).to(self.device)
        if bucket:
            whole, fill = lengths // bs, lengths % bs
            last = tables[slots, np.minimum(whole, self.row_blocks - 1)]
            packed = torch.from_numpy(np.stack([whole, (fill > 0), last, fill]).astype(np.int32)).to(self.device)
            self._whole[:bucket].zero_()
            self._partial[:bucket].zero_()
            for target, values in zip((self._whole, self._partial, self._last, self._filled), packed):
                target.index_copy_(0, index, values)
        return Step(index, HostRows(tables, slots, bs), lengths, bucket)

    def _gathered(self, reason: str) -> None:
        self.gathered_steps += 1
        self.gathered_reasons[reason] = self.gathered_reasons.get(reason, 0) + 1

    def _mask(self, bucket: int):
        """The BlockMask of the slots ``[0, bucket)``: views of the device metadata, made once."""
        if bucket not in self._masks:
            from torch.nn.attention.flex_attention import BlockMask

            bs, filled = self.block_size, self._filled

            def mask_mod(b, h, q, kv):  # the partial block only: its places up to the row's length
                return kv % bs < filled[b]

            self._masks[bucket] = BlockMask.from_kv_blocks(
                self._partial[:bucket, None, None], self._last[:bucket, None, None, None].expand(
                    bucket, 1, 1, self.num_blocks),
                self._whole[:bucket, None, None], self._tables[:bucket, None, None, :], BLOCK_SIZE=(128, bs),
                mask_mod=mask_mod, seq_lengths=(1, self.num_blocks * bs), compute_q_blocks=False)
        return self._masks[bucket]

    # -- attention -------------------------------------------------------------------------------

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, step: Step, scale) -> torch.Tensor:
        """Attention of the step's rows (``query`` [n, Hq, 1, D], in the step's order) over their blocks
        of this layer (``key``/``value`` [1, Hkv, T, D]); [n, Hq, 1, D]."""
        if step.bucket and not step.fell_back:
            try:
                return self._kernel_call(query, key, value, step, scale)
            except UncheckedKernel:  # the step's other layers gather too; counted once
                step.fell_back = True
                self._gathered(REFUSED)
        return gather_attention(query, key, value, step.tables.rows(), step.lengths, self.block_size, scale)

    def _kernel_call(self, query, key, value, step: Step, scale) -> torch.Tensor:
        padded = query.new_zeros((step.bucket, *query.shape[1:])).index_copy_(0, step.slots, query)
        return self._flex(padded, key, value, self._mask(step.bucket), scale).index_select(0, step.slots)

    # -- compile and check -----------------------------------------------------------------------

    @torch.inference_mode()
    def warm_up(self) -> None:
        """The kernel for the current ``compile_key``: the one already checked for it, or compiled for
        every bucket and checked against the gather (module docstring); on a failure or a mismatch the
        pool gathers, with one warning line. Safe with rows live in the pool (after a thread count
        change): the scratch blocks and the device tables are put back as they were."""
        if gathers():
            self.reason = f"{KERNEL_ENV}=gather"
            return
        if self._too_wide:
            self._off(f"a pool of {self.num_blocks} blocks is too wide for the kernel's block index "
                      f"(INDEX_BYTES {INDEX_BYTES >> 20} MiB)")
            return
        with timed_warm_up():  # the actor's timeline counts it apart (pipeline.observability)
            self._warm_up()

    def _warm_up(self) -> None:
        started = time.perf_counter()
        key = compile_key(self.device)  # the first costs seconds (inductor's ISA probe): warm-up time
        self._threads = key[-1]
        if key in self._checked:
            self._flex = self._checked[key][0]
            return
        if self.cut and not self._checked:
            log.warning("KV cache: %s (counted in kv_kernel_gathered_steps)", self.cut)
        backend = _PoolBackend(key)
        flex = _own_flex(self.options, backend)
        self.rechecks += bool(self._checked)
        rng = np.random.default_rng(0)
        kept = self._keep_metadata()
        try:
            with scratch_blocks(self.keys, self.values, self.block_size, self.row_blocks, rng) as blocks:
                for bucket in self.buckets:
                    before = backend.compiles
                    backend.checking = True
                    try:
                        error = self._check(flex, bucket, blocks, rng)
                    except Exception as exc:  # noqa: BLE001 - no compiler, none for this shape: gather
                        self._off(f"flex_attention does not compile for {bucket} rows ({type(exc).__name__}: "
                                  f"{_first_line(exc)})")
                        return
                    finally:
                        backend.checking = False
                        self.compiles += backend.compiles - before
                    if _compiled(flex) and backend.compiles == before:  # dynamo ran it eagerly (a stance)
                        self._off(f"flex_attention was not compiled for {bucket} rows (torch.compile ran it "
                                  "eagerly)")
                        return
                    self.check_error = max(self.check_error, error)
                    if not error <= TOLERANCE.get(self.keys.dtype, 5e-2):
                        self._off(f"compiled flex_attention differs from the gather by {error:.3g} at {bucket} rows "
                                  f"(blocks of {self.block_size} tokens, {self.num_blocks}-block pool, "
                                  f"{self.keys.dtype}, {_describe(key)})")
                        return
        finally:
            self._restore_metadata(kept)
            self.warm_up_seconds += time.perf_counter() - started
        self._checked[key] = (flex, backend)
        self._flex, self.kernel, self.reason = flex, "flex_attention", ""
        log.info("KV cache: flex_attention compiled and checked for %s rows (pool of %d blocks of %d tokens, %s) in "
                 "%.1f s, largest difference from the gather %.2g", "/".join(map(str, self.buckets)),
                 self.num_blocks, self.block_size, _describe(key), time.perf_counter() - started, self.check_error)

    def _off(self, reason: str) -> None:
        self.kernel, self.reason, self._masks, self._flex = "gather", reason, {}, None
        log.warning("KV cache: %s; this pool gathers its rows' blocks for SDPA instead (slower)", reason)

    def _keep_metadata(self) -> list[torch.Tensor]:
        return [t.clone() for t in (self._tables, self._whole, self._partial, self._last, self._filled)]

    def _restore_metadata(self, kept: list[torch.Tensor]) -> None:
        for target, saved in zip((self._tables, self._whole, self._partial, self._last, self._filled), kept):
            target.copy_(saved)

    def _check(self, flex, bucket: int, blocks: np.ndarray, rng) -> float:
        """Compile the bucket (its first call, with ``flex``) and return the kernel's largest difference
        from the gather over ``_cases``."""
        error, dim = 0.0, self.keys.shape[3]
        for slots, tables, lengths in check_cases(bucket, blocks, self.block_size, self.row_blocks,
                                                  self.num_blocks, rng):
            self.write_rows(np.arange(bucket), tables)
            step = self._metadata(slots.astype(np.int64), lengths.astype(np.int64), tables, bucket)
            generator = torch.Generator(device="cpu").manual_seed(int(rng.integers(1 << 30)))
            query = torch.randn((len(slots), self.heads, 1, dim), generator=generator)
            query = query.to(self.keys.dtype).to(self.device)
            padded = query.new_zeros((bucket, *query.shape[1:])).index_copy_(0, step.slots, query)
            out = flex(padded, self.keys, self.values, self._mask(bucket), dim ** -0.5).index_select(0, step.slots)
            expected = gather_attention(query, self.keys, self.values, tables[slots], step.lengths, self.block_size,
                                        dim ** -0.5)
            error = max(error, float((out.float() - expected.float()).abs().max()))
        return error

    def stats(self) -> dict:
        return {"kv_kernel": self.kernel, "kv_kernel_reason": self.reason, "kv_kernel_buckets": self.buckets,
                "kv_kernel_cut": self.cut, "kv_kernel_compiles": self.compiles, "kv_kernel_rechecks": self.rechecks,
                "kv_kernel_warm_up_s": round(self.warm_up_seconds, 2), "kv_kernel_check_error": self.check_error,
                "kv_kernel_gathered_steps": self.gathered_steps,
                "kv_kernel_gathered_reasons": dict(self.gathered_reasons)}


def _compiled(call) -> bool:
    """Whether ``call`` is torch.compile's wrapper (a test may hand the pool a plain function)."""
    return hasattr(call, "_torchdynamo_orig_callable") or hasattr(call, "_torchdynamo_inline")


def _describe(key: tuple) -> str:
    """A compile_key in words."""
    if key[0] != "cpu":
        return f"{key[0]}, {key[-1]} threads"
    return f"cpu {key[1]} ({key[2]}), {key[3]} thread{'s' if key[3] != 1 else ''}"


@contextmanager
def scratch_blocks(keys: torch.Tensor, values: torch.Tensor, block_size: int, row_blocks: int, rng):
    """Blocks of a pool (``keys`` and ``values``: [1, kv heads, pool tokens, head dim]) that a kernel
    check writes standard normal keys and values into, for the length of the ``with`` block:
    ``row_blocks`` + 8 of them (all, in a smaller pool), the pool's first and last among them; what
    they held (nothing yet, or live rows' keys and values after a thread count change) is put back
    after. Yields their ids, [k] int32."""
    num_blocks, device = keys.shape[2] // block_size, keys.device
    count = min(num_blocks, row_blocks + 8)
    ends = [0, num_blocks - 1]
    others = rng.choice(np.arange(1, max(num_blocks - 1, 1)), max(0, min(count, num_blocks) - 2),
                        replace=False) if num_blocks > 2 else np.zeros(0, np.int64)
    chosen = np.unique(np.concatenate([ends, others])).astype(np.int64)
    places = torch.from_numpy((chosen[:, None] * block_size + np.arange(block_size)).reshape(-1))
    places = places.to(device)
    saved = [tensor[0].index_select(1, places) for tensor in (keys, values)]
    generator = torch.Generator(device="cpu").manual_seed(0)
    try:
        for tensor in (keys, values):
            noise = torch.randn((tensor.shape[1], len(places), tensor.shape[3]), generator=generator)
            tensor[0].index_copy_(1, places, noise.to(tensor.dtype).to(device))
        yield chosen.astype(np.int32)
    finally:
        for tensor, old in zip((keys, values), saved):
            tensor[0].index_copy_(1, places, old)


def check_cases(bucket: int, blocks: np.ndarray, block_size: int, row_blocks: int, num_blocks: int,
                rng) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """A kernel check's steps for ``bucket`` in a pool of ``num_blocks`` blocks, over the scratch
    ``blocks``, each (slots, tables [bucket, row_blocks], lengths): the deterministic ones (rows as
    wide as a block table gets at the bucket's last and first slots, the pool's last block first and
    its first block last in one, the other way round in the other, ending in a whole block and in a
    half-filled one; one token in the pool's last block at the last slot, the pool's whole first
    block at the first), then two random ones (random slots, distinct random blocks, widths up to
    the table's within CHECK_TOKENS, lengths across block boundaries)."""
    bs, width, first, last = block_size, row_blocks, 0, num_blocks - 1
    inner = blocks[(blocks != first) & (blocks != last)]
    ends = np.unique([bucket - 1, 0])[::-1]  # the last slot, then the first (one slot in a 1-row bucket)

    def tables(rows: list[list[int]]) -> np.ndarray:
        out = np.zeros((bucket, width), dtype=np.int32)
        for slot, row in zip(ends, rows):
            out[slot, :len(row)] = row
        return out

    def spanning(head: int, tail: int) -> list[int]:  # ``width`` distinct blocks from head to tail
        row = [head, *inner[:max(0, width - 2)], tail][:width] if width > 1 else [head]
        return list(dict.fromkeys(row))[:width]

    long_rows = [spanning(last, first), spanning(first, last)]
    full = [len(long_rows[0]) * bs, len(long_rows[1]) * bs - (bs // 2 if bs > 1 else 0)]
    cases = [(ends, tables(long_rows), np.array(full[:len(ends)])),
             (ends, tables([[last], [first]]), np.array([1, bs][:len(ends)]))]
    for _ in range(2):
        n = int(rng.integers(1, bucket + 1))
        slots = np.sort(rng.choice(bucket, n, replace=False)).astype(np.int64)
        widest = int(min(width, len(blocks), max(1, CHECK_TOKENS // (n * bs))))
        widths = rng.integers(1, widest + 1, n)
        table = np.zeros((bucket, width), dtype=np.int32)
        for slot, w in zip(slots, widths):
            table[slot, :w] = rng.choice(blocks, w, replace=False)
        cases.append((slots, table, np.array([rng.integers((w - 1) * bs + 1, w * bs + 1) for w in widths])))
    return cases


class HostRows:
    """The stepping rows' host block tables, read lazily (only a gather reads them: O(rows x row width))."""

    def __init__(self, tables: np.ndarray, slots: np.ndarray, block_size: int):
        self.tables, self.slots, self.block_size = tables, slots, block_size

    def rows(self) -> np.ndarray:
        return self.tables[self.slots]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
