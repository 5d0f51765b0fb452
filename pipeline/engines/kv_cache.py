"""The KV cache manager: one per model, in the spirit of vLLM v1's KV cache manager. Every layer's
keys and values live in a pool of fixed-size blocks allocated once, sized by a memory budget
(runtime.kv_cache_memory); every row holds a block table, the blocks its tokens are in, in order.

    kv = KVCache(model, device, budget)        # nothing allocated yet: the pool comes at first use
    rows = kv.admit(batch, sources)            # a prefilled RowBatch's rows: their blocks, or None
    with kv.stepping(rows, tokens) as inputs:  # one token for each of those rows: the caller's
        out = model(**inputs)                  # forward pass (the model runner's)
    kv.release(rows[:2])                       # pruned or finished: their blocks go back
    batch = kv.take(rows[2:])                  # back out as a RowBatch (speculative decoding)
    out = kv.feed(rows, chunks)                # several tokens per row (the reward model's sessions)
    kv.truncate(rows, keep)                    # rows cut back (a shared block is copied first)

Blocks (``BlockPool``, which the KV manager KVCache composes with its rows). ``block_size`` tokens of every layer's
keys and values; a block is taken when a row's next token starts one (a step's ``grow``) and given
back when the last row holding it is released.
Free blocks are handed out lowest first: on a CPU, where the pool is ``torch.empty`` (its pages are
not resident until written), the memory a build touches then follows the blocks it holds at its
peak, not the budget. No buffer grows during a build, and a row's keys and values never move.

Sharing. ``admit`` writes a prompt's whole blocks once and gives them to each of its samples
(reference counts); each sample copies only the prompt's last, partial block, which it goes on
writing. Pruning, finishing and closing drop references; a block is free at zero.

Admission and preemption. ``admit`` returns None when the rows' blocks, plus a watermark of
WATERMARK of the pool (vLLM's), do not fit in the free blocks: the step loop keeps the session
waiting until rows leave. ``needed`` says how many blocks the next step takes; when that is more than
are free, the step loop preempts the newest sessions (``release``, then a recompute of their KV
from their tokens when blocks free up: pipeline.engines.model_runner). No step ever runs out.

Attention reads the blocks in place: one kernel call per layer per step, for every stepping row,
whatever the model's attention implementation (``paged_attention``). The keys and values are one
[1, H, blocks * block_size, D] tensor per layer. The kernel is the pool's AttentionKernel
(pipeline.engines.attention_kernel): compiled flex_attention for a few static row buckets, compiled
and checked against the gather at the pool's allocation, with its block tables on the device,
written by row (``_sync``, a step's new blocks); where it does not compile or disagrees, every step
gathers the rows' blocks for SDPA (slower, same result) and ``stats`` says why. A pool takes the
size its budget gives (no cap on blocks): nothing per step is as wide as the pool.

Failure atomicity: a step, a feed or an admission that raises (an out-of-memory in the forward)
gives back every block it took and leaves its rows as they were.

A chunked ``feed`` (several tokens per row: the reward model's streaming sessions, a pool of their
own, pipeline.engines.rewards) gathers each row's blocks per layer for SDPA with a causal mask, since
it comes once per decision token, not every step; such a pool (``decode=False``) compiles nothing.
``truncate`` cuts rows back; a kept block that another row shares is copied first (copy on write).

Only models whose cache layers are all full attention use the manager (``KVCache.supports``); the
plan refuses sliding-window generators on the HF backend (pipeline.preflight.check_models).
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from pipeline.errors import KVBudgetError
from pipeline.engines.attention_kernel import (KERNEL_ENV, MAX_ROWS, AttentionKernel, HostRows, Step,
                                               gather_attention, gathers)
from pipeline.engines.rows import RowBatch, _cache_of, _GrowingLayer, _new_cache, timed_forward
from pipeline.engines.tree import cache_argument

log = logging.getLogger(__name__)

BLOCK_SIZE = 128
"""Tokens per block. flex_attention's sparse blocks are 128 by default, and on our CPU 128-token
pages attend 1.2x slower than contiguous SDPA where 32-token pages take 1.4x (docs/benchmarks.md)."""
WATERMARK = 0.01
"""The share of the pool an admission leaves free (vLLM's watermark), so a newly admitted session
is not the first to be preempted at its next step."""
CPU_BUDGET_SHARE = 0.25
"""runtime.kv_cache_memory "auto" on a CPU: this share of the memory available at the first admission."""
CUDA_BUDGET_SHARE = 0.8
"""runtime.kv_cache_memory "auto" on a GPU: this share of the device memory free after the weights."""


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV pool on ``device``: the GPU's free memory (the weights are loaded), or
    the host's MemAvailable."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def budget_bytes(memory, device: torch.device, usable: int | None = None) -> int:
    """The pool's bytes for runtime.kv_cache_memory ``memory`` (``parse_memory``'s result) on ``device``;
    "auto" (None) at most ``usable``, what the rows could ever use (MAX_ROWS rows of a toy model's
    whole context are far less than a share of memory, and a pool of many GB of address space makes
    the process's forks fail)."""
    if isinstance(memory, int):
        return memory
    if memory is None:
        share = CUDA_BUDGET_SHARE if device.type == "cuda" else CPU_BUDGET_SHARE
        return int(min(share * available_memory(device), usable or float("inf")))
    return int(memory * available_memory(device))


# -- the host heap -------------------------------------------------------------------------------

M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # glibc's mallopt parameters (malloc.h)
HEAP_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": (M_MMAP_THRESHOLD, 4 << 20), "MALLOC_ARENA_MAX": (M_ARENA_MAX, 2)}
"""What ``bound_heap`` sets, each unless its environment variable is set (runtime.bound_heap, off
by default: it slowed an unrelated matmul loop by 11-14% with 614,700 minor page faults, and the
paged pool no longer frees KV-sized buffers, which is what it was for)."""


def _glibc(function: str):
    """glibc's ``function`` through ctypes; None where there is no glibc."""
    import ctypes

    try:
        return getattr(ctypes.CDLL("libc.so.6"), function)
    except (OSError, AttributeError):
        return None


def bound_heap() -> bool:
    """Apply HEAP_SETTINGS through glibc's ``mallopt`` (process-wide, for the process's life; False
    where there is no glibc). Only when runtime.bound_heap asks for it."""
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    for name, (param, value) in HEAP_SETTINGS.items():
        if name not in os.environ:
            mallopt(param, value)
    return True


TRIM_INTERVAL_S = 5.0
"""``trim_heap`` returns free heap pages at most once every this many seconds."""
_last_trim = [0.0]


def trim_heap() -> bool:
    """Return the heap's free pages to the system (glibc's ``malloc_trim``), at most once every
    TRIM_INTERVAL_S seconds; the engines call it when a session closes. False where there is no
    glibc or it is too soon."""
    import time

    now = time.monotonic()
    if now - _last_trim[0] < TRIM_INTERVAL_S:
        return False
    _last_trim[0] = now
    malloc_trim = _glibc("malloc_trim")
    return malloc_trim is not None and bool(malloc_trim(0))


# -- attention over the blocks -------------------------------------------------------------------

PAGED_ATTENTION = "bon_paged"
"""The attention implementation a step runs under (registered with transformers' AttentionInterface;
no mask function, so transformers builds no mask and the step hands its own metadata)."""


@dataclass
class _StepCall:
    """One decoding step's attention: the pool's kernel (pipeline.engines.attention_kernel) and the
    step's metadata."""

    kernel: AttentionKernel | None
    step: Step

    def attend(self, query, key, value, scale):
        if self.kernel is None:
            return gather_attention(query, key, value, self.step.tables.rows(), self.step.lengths,
                                    self.step.tables.block_size, scale)
        return self.kernel.attend(query, key, value, self.step, scale)


@dataclass
class _FeedCall:
    """One chunked feed's attention (several tokens per row: the reward model's streaming rows): each
    row's blocks gathered, then SDPA with each query attending its row's places up to its own
    (``queries`` [n, C]; a padding query's is 0). It comes once per decision token, not every step."""

    tables: np.ndarray  # [n, MB]
    lengths: np.ndarray  # [n]
    queries: np.ndarray  # [n, C]
    block_size: int

    def attend(self, query, key, value, scale):
        return gather_attention(query, key, value, self.tables, self.lengths, self.block_size, scale, self.queries)


def paged_attention(module, query, key, value, attention_mask, paged=None, scaling=None, **kwargs):
    """Attention of one pass's rows over their blocks: ``query`` [n, Hq, C, D] (the rows; C is 1 but
    in a chunked feed), ``key``/``value`` [1, Hkv, T, D] the pool's whole layer (no copy), ``paged``
    the pass's _StepCall or _FeedCall. Returns [n, C, Hq, D]."""
    out = paged.attend(query, key, value, scaling)
    return out.transpose(1, 2), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PAGED_ATTENTION, paged_attention)


class _BlockLayer(DynamicLayer):
    """One layer of the pool as transformers sees it during one step: ``update`` writes each
    stepping row's new keys and values at their tokens' places in its blocks and returns the layer's
    whole pool (a view, no copy). ``written``: which of the step's [n * C] query tokens are real (a
    chunked feed's padding is not written); None: all."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, places: torch.Tensor, seen: int,
                 written: torch.Tensor | None = None):
        super().__init__()
        self.keys, self.values = keys, values  # [1, H, T, D]
        self.places, self.seen, self.written = places, seen, written
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        for pool, states in ((self.keys, key_states), (self.values, value_states)):
            n, heads, count, dim = states.shape
            flat = states[:, :, 0] if count == 1 else states.transpose(0, 1).reshape(heads, n * count, dim)
            if count == 1:
                flat = flat.transpose(0, 1)  # [H, n, D]
            if self.written is not None:
                flat = flat.index_select(1, self.written)
            pool[0].index_copy_(1, self.places, flat)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0


def unsupported_layers(model) -> list:
    """``model``'s cache layers that are not full attention (sliding-window, chunked, ...)."""
    return [layer for layer in _new_cache(model).layers if not isinstance(layer, _GrowingLayer)]


@dataclass
class _Rows:
    """Host bookkeeping of the rows (handles index it), vLLM v1's block table: grown by doubling
    (host memory only); a new row takes the lowest spare handle (its slot in the kernel's buckets)."""

    length: np.ndarray  # [R] tokens held (the next write's logical place)
    position: np.ndarray  # [R] position id of the next token
    tables: np.ndarray  # [R, MB] block ids, in logical order (the first ceil(length / bs) are real)
    live: np.ndarray  # [R] bool: the handle is in use
    spare: list = field(default_factory=list)  # free handles, highest first (pop: the lowest)

    def new(self, count: int) -> list[int]:
        while len(self.spare) < count:
            old = len(self.length)
            new = max(16, 2 * old)
            self.length = np.concatenate([self.length, np.zeros(new - old, np.int64)])
            self.position = np.concatenate([self.position, np.zeros(new - old, np.int64)])
            self.live = np.concatenate([self.live, np.zeros(new - old, bool)])
            self.tables = np.concatenate([self.tables, np.zeros((new - old, self.tables.shape[1]), np.int32)])
            self.spare.extend(range(old, new))
            self.spare.sort(reverse=True)
        handles = [self.spare.pop() for _ in range(count)]
        self.live[handles] = True
        return handles

    def retire(self, handles: list[int]) -> None:
        self.live[handles] = False
        self.length[handles] = 0
        self.spare.extend(handles)
        self.spare.sort(reverse=True)


class BlockPool:
    """The memory of one model's KV cache, as vLLM v1's BlockPool: every layer's keys and values in
    fixed-size blocks allocated once, the blocks' reference counts and the free list (lowest block
    first). It knows blocks, not rows; the KV manager (KVCache) keeps the rows' tables on it."""

    def __init__(self, block_size: int, device: torch.device):
        self.block_size, self.device = block_size, device
        self.keys: list[torch.Tensor] = []  # per layer [1, H, NB * bs, D]
        self.values: list[torch.Tensor] = []
        self.num_blocks = 0
        self.block_bytes = 0
        self.refs = np.zeros(0, dtype=np.int32)  # [NB] rows holding each block
        self._free: list[int] = []  # a heap of the blocks given back, all below _fresh
        self._fresh = 0  # blocks from here on were never taken (free): a pool of millions costs no list
        self.peak_blocks = 0

    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    @property
    def free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - self._fresh

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    def nbytes(self) -> int:
        """Bytes of the pool's buffers (every block, used or not)."""
        return self.num_blocks * self.block_bytes

    def held_bytes(self) -> int:
        """Bytes of the blocks rows hold now (a shared block once)."""
        return self.used_blocks * self.block_bytes

    def allocate(self, layers: int, heads: int, dim: int, dtype: torch.dtype, total: int) -> None:
        """The pool, once: as many blocks as ``total`` bytes hold (at least one; no other cap)."""
        bs = self.block_size
        self.block_bytes = 2 * layers * heads * bs * dim * torch.empty((), dtype=dtype).element_size()
        self.num_blocks = int(max(1, total // self.block_bytes))
        # torch.empty: blocks are zeroed as they are taken (on a CPU, untouched pages stay out of memory).
        try:
            for _ in range(layers):
                self.keys.append(torch.empty((1, heads, self.num_blocks * bs, dim), dtype=dtype, device=self.device))
                self.values.append(torch.empty((1, heads, self.num_blocks * bs, dim), dtype=dtype, device=self.device))
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            self.keys, self.values, self.num_blocks = [], [], 0
            raise KVBudgetError(f"KV cache: cannot allocate {total / 2**30:.2f} GiB for the pool "
                                f"({type(exc).__name__}); lower runtime.kv_cache_memory") from None
        self.refs = np.zeros(self.num_blocks, dtype=np.int32)
        self._free, self._fresh = [], 0

    def take(self, count: int) -> list[int]:
        """``count`` free blocks, lowest first, zeroed, each held once."""
        if count > self.free_blocks:
            raise KVBudgetError(f"KV cache: {count} blocks asked, {self.free_blocks} free (a caller's check "
                                "missed it; this is a bug)")
        given_back = min(count, len(self._free))  # every block given back is below every fresh one
        blocks = [heapq.heappop(self._free) for _ in range(given_back)]
        blocks += range(self._fresh, self._fresh + count - given_back)
        self._fresh += count - given_back
        self.refs[blocks] = 1
        if blocks:  # places past a row's length are masked; garbage there (a NaN) must not reach a score
            places = self.places_of(blocks)
            for tensor in self.keys + self.values:
                tensor[0].index_fill_(1, places, 0)
        self.peak_blocks = max(self.peak_blocks, self.used_blocks)
        return blocks

    def drop(self, blocks) -> None:
        """One reference less to each of ``blocks``; a block is free at zero."""
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                heapq.heappush(self._free, int(block))

    def places_of(self, blocks: list[int]) -> torch.Tensor:
        """The pool places (token indices) of ``blocks``, in order: [len(blocks) * bs] on the device."""
        bs = self.block_size
        index = (np.asarray(blocks, dtype=np.int64)[:, None] * bs + np.arange(bs)).reshape(-1)
        return torch.from_numpy(index).to(self.device)

    def blocks_for(self, lengths: list[int], samples: list[int]) -> int:
        """Blocks an admission takes: per prompt (``lengths`` tokens, ``samples`` rows), its whole
        blocks once and its partial block once per row."""
        bs = self.block_size
        return sum(length // bs + (s if length % bs else 0) for length, s in zip(lengths, samples))

    def rows_that_fit(self, lengths: list[int], tokens: int) -> int:
        """Rows per prompt the whole pool holds with ``tokens`` generated tokens each (KVCache's)."""
        bs = self.block_size
        shared = sum(length // bs for length in lengths)
        per_row = sum(-(-(length + tokens) // bs) - length // bs for length in lengths)
        room = (1 - WATERMARK) * self.num_blocks - shared
        return max(0, int(room // max(per_row, 1)))

    def room_for(self, need: int) -> bool:
        """Whether ``need`` blocks are free, beside a watermark of WATERMARK of the pool (vLLM's) while
        any block is in use."""
        watermark = WATERMARK * self.num_blocks if self.used_blocks else 0
        return need + watermark <= self.free_blocks


class KVCache:
    """One model's KV cache manager (see the module docstring): it composes a BlockPool (the blocks)
    and, for a decoding pool, an AttentionKernel (the steps' attention), and keeps the rows: their
    block tables, admission (a prompt's whole blocks shared), release, truncation (copy on write), a
    row's blocks taken back out, and the model inputs of a decoding step (``stepping``) or a chunked
    feed (``feeding``) for the caller's forward pass. When and whom to admit or preempt is the
    scheduler's (pipeline.engines.step_loop and the model runner's residency)."""

    def __init__(self, model, device: torch.device, memory=None, block_size: int | None = None,
                 counted_by: tuple = (), decode: bool = True, max_rows: int = MAX_ROWS):
        """``memory``: runtime.kv_cache_memory as ``parse_memory`` returns it (None: a default per
        device); the pool is allocated at the first admission, after the weights are in memory.
        ``decode``: whether rows will ``step`` (the attention kernel is compiled and checked at the
        allocation); a pool only ever fed chunks (the reward model's) compiles nothing.
        ``max_rows``: the most rows a step's compiled kernel serves (its largest row bucket)."""
        _register()
        self.model, self.device, self.memory = model, device, memory
        self.block_size = block_size or BLOCK_SIZE
        self.decode, self.max_rows = decode, max_rows
        self.pool = BlockPool(self.block_size, device)
        self.kernel: AttentionKernel | None = None
        """The decoding steps' attention (pipeline.engines.attention_kernel), made at the allocation of a
        ``decode`` pool; None: every pass gathers (a chunked feed always does)."""
        self.row_blocks = 0
        """A row's block table's width: the model's context in blocks (a row past it is refused)."""
        self.counted_by = counted_by
        self._rows = _Rows(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 0), np.int32),
                           np.zeros(0, bool))
        self._released: list[int] = []  # released by callers outside the loop, freed at the next collect
        self._lock = threading.Lock()
        self.forward_passes = 0
        self.shared_bytes = 0
        """Bytes a prompt's shared blocks saved: (samples - 1) x its whole blocks, summed over admissions."""
        self.preemptions = 0
        """Sessions preempted for blocks (counted by the model runner)."""
        self.passes = PagedPasses(self)

    # -- the passes (PagedPasses) ---------------------------------------------------------------

    stepping = property(lambda self: self.passes.stepping)
    step = property(lambda self: self.passes.step)
    feeding = property(lambda self: self.passes.feeding)
    feed = property(lambda self: self.passes.feed)
    truncate = property(lambda self: self.passes.truncate)
    take = property(lambda self: self.passes.take)
    blocks_to_extend = property(lambda self: self.passes.blocks_to_extend)

    # -- the pool's figures ----------------------------------------------------------------------

    allocated = property(lambda self: self.pool.allocated)
    num_blocks = property(lambda self: self.pool.num_blocks)
    block_bytes = property(lambda self: self.pool.block_bytes)
    free_blocks = property(lambda self: self.pool.free_blocks)
    used_blocks = property(lambda self: self.pool.used_blocks)
    peak_blocks = property(lambda self: self.pool.peak_blocks)
    refs = property(lambda self: self.pool.refs)
    keys = property(lambda self: self.pool.keys)
    values = property(lambda self: self.pool.values)

    def nbytes(self) -> int:
        return self.pool.nbytes()

    def held_bytes(self) -> int:
        return self.pool.held_bytes()

    def _allocate_for_model(self) -> None:
        """The pool before any admission, shaped from the model's config (``rows_that_fit`` needs it)."""
        config = getattr(self.model.config, "get_text_config", lambda: self.model.config)()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self._allocate(torch.empty((1, kv_heads, 0, dim), dtype=next(self.model.parameters()).dtype, device="meta"))

    def _allocate(self, like: torch.Tensor) -> None:
        """The pool, once, shaped like ``like`` (a layer's keys), sized by the budget; then the
        decoding kernel, compiled and checked."""
        _, heads, _, dim = like.shape
        bs, layers = self.block_size, len(_new_cache(self.model).layers)
        config = getattr(self.model.config, "get_text_config", lambda: self.model.config)()
        context = getattr(config, "max_position_embeddings", None) or 1 << 20
        usable = MAX_ROWS * (-(-context // bs) + 1) * 2 * layers * heads * bs * dim * like.element_size()
        self.pool.allocate(layers, heads, dim, like.dtype, budget_bytes(self.memory, self.device, usable))
        self.row_blocks = int(min(self.num_blocks, -(-context // bs) + 1))
        self._rows.tables = np.zeros((len(self._rows.length), self.row_blocks), dtype=np.int32)
        if self.decode:
            self.kernel = AttentionKernel(self.keys[0], self.values[0], config.num_attention_heads, bs,
                                          self.row_blocks, self.max_rows)
            self.kernel.warm_up()
        log.info("KV cache: %d blocks of %d tokens, %.2f GiB", self.num_blocks, bs, self.nbytes() / 2**30)

    def room_for(self, need: int) -> bool:
        """Whether ``need`` blocks fit now, with the watermark while any block is in use."""
        self.collect()
        return not self.allocated or self.pool.room_for(need)

    def rows_that_fit(self, lengths: list[int], tokens: int) -> int:
        """Rows per prompt that the pool holds, each prompt (of ``lengths`` tokens) with that many
        rows of ``tokens`` generated tokens: its whole blocks once, each row's own blocks, less the
        watermark. The whole pool, not the blocks free at the moment: the answer depends on the
        budget, never on timing, so a resumed build sizes a batch as the first run did. 0 when not
        one row per prompt fits. Allocates the pool if no admission has."""
        if not self.allocated:
            self._allocate_for_model()
        return self.pool.rows_that_fit(lengths, tokens)

    @staticmethod
    def supports(model) -> bool:
        """Whether every cache layer of ``model`` is full attention (the pool holds no sliding window)."""
        return not unsupported_layers(model)

    def live_tokens(self) -> int:
        """Tokens the live rows hold (a shared prompt's tokens once per row)."""
        rows = self._rows
        return int(rows.length[rows.live].sum())

    def stats(self) -> dict:
        return {"kv_blocks_total": self.num_blocks, "kv_blocks_used": self.used_blocks,
                "kv_blocks_peak": self.peak_blocks, "kv_block_size": self.block_size,
                "kv_bytes_total": self.nbytes(), "kv_bytes_peak": self.peak_blocks * self.block_bytes,
                "kv_prompt_bytes_shared": self.shared_bytes, "kv_preemptions": self.preemptions,
                **(self.kernel.stats() if self.kernel is not None else
                   {"kv_kernel": "gather", "kv_kernel_reason": "chunked feeds only" if not self.decode else
                    "not allocated yet" if not self.allocated else "no kernel"})}

    def _check_width(self, length: int) -> None:
        """A row of ``length`` tokens fits its block table (the model's context), or ValueError."""
        if -(-length // self.block_size) > self.row_blocks:
            raise ValueError(f"KV cache: a row of {length} tokens is longer than the model's context "
                             f"({self.row_blocks} blocks of {self.block_size} tokens); shorten the prompts "
                             "or max_new_tokens")

    def _sync(self, handles) -> None:
        """The kernel's device copy of rows ``handles``' block tables, after a change other than a
        step's new block (an admission, a truncation, a feed)."""
        if self.kernel is not None and len(handles):
            handles = np.asarray(handles, dtype=np.int64)
            self.kernel.write_rows(handles, self._rows.tables[handles])

    def blocks_for(self, lengths: list[int], samples: list[int]) -> int:
        return self.pool.blocks_for(lengths, samples)

    def fits(self, lengths: list[int], samples: list[int]) -> bool:
        """Whether an admission of prompts of ``lengths`` tokens, ``samples`` rows each, fits now
        (``blocks_for``, plus the watermark while any block is in use)."""
        self.collect()
        if not self.allocated:
            return True
        return self.pool.room_for(self.blocks_for(lengths, samples))

    @torch.inference_mode()
    def admit(self, batch: RowBatch, sources: list[int] | None = None) -> list[int] | None:
        """Rows of ``batch`` (a prefilled RowBatch, no tree pending) into blocks: ``sources`` is the
        batch row each new row continues (a prompt's row, once per sample: its whole blocks are
        written once and shared); None: every batch row, once. Returns the rows' handles, aligned
        with ``sources``; None, with nothing taken, when the blocks plus the watermark do not fit."""
        self.collect()
        layers = batch.cache.layers
        if not self.allocated:
            self._allocate(layers[0].keys)
        sources = list(range(len(batch.next_position))) if sources is None else list(sources)
        mask = batch.attention_mask.bool().cpu().numpy()  # [P, W]
        columns = [np.flatnonzero(m) for m in mask]  # each prompt row's real tokens, in order
        used = sorted(set(sources))
        samples = {p: sources.count(p) for p in used}
        need = self.blocks_for([len(columns[p]) for p in used], [samples[p] for p in used])
        if need > self.num_blocks or not self.pool.room_for(need):
            if need > self.num_blocks:
                raise KVBudgetError(f"KV cache: {len(sources)} rows need {need} blocks of {self.block_size} "
                                    f"tokens but the pool has {self.num_blocks} "
                                    f"({self.nbytes() / 2**30:.2f} GiB); raise runtime.kv_cache_memory")
            return None
        bs = self.block_size
        self._check_width(max(len(columns[p]) for p in used))
        width = mask.shape[1]
        handles = self._rows.new(len(sources))
        rows = self._rows
        src: list[np.ndarray] = []
        dst: list[np.ndarray] = []
        whole: dict[int, list[int]] = {}
        for p in used:
            count = len(columns[p]) // bs
            whole[p] = self.pool.take(count)
            self.pool.refs[whole[p]] = samples[p]
            self.shared_bytes += (samples[p] - 1) * count * self.block_bytes
            if count:
                src.append(p * width + columns[p][:count * bs])
                dst.append(self.pool.places_of(whole[p]).cpu().numpy())
        for handle, p in zip(handles, sources):
            length = len(columns[p])
            table = list(whole[p])
            if length % bs:
                (tail,) = self.pool.take(1)
                table.append(tail)
                src.append(p * width + columns[p][len(whole[p]) * bs:])
                dst.append(tail * bs + np.arange(length % bs))
            rows.tables[handle, :len(table)] = table
            rows.length[handle] = length
            rows.position[handle] = int(batch.next_position[p])
        try:
            if src:
                source = torch.from_numpy(np.concatenate(src)).to(self.device)
                target = torch.from_numpy(np.concatenate(dst)).to(self.device)
                for pool_keys, pool_values, layer in zip(self.pool.keys, self.pool.values, layers):
                    heads, dim = layer.keys.shape[1], layer.keys.shape[3]
                    flat_k = layer.keys.transpose(0, 1).reshape(heads, -1, dim)  # [H, P * W, D]
                    flat_v = layer.values.transpose(0, 1).reshape(heads, -1, dim)
                    pool_keys[0].index_copy_(1, target, flat_k.index_select(1, source))
                    pool_values[0].index_copy_(1, target, flat_v.index_select(1, source))
            self._sync(handles)
        except BaseException:  # an out-of-memory in the copy: every block goes back
            self.release(handles)
            self.collect()
            raise
        return handles

    def release(self, handles: list[int]) -> None:
        """Free ``handles``' blocks (any thread; they are freed at the next ``collect``, between two steps)."""
        with self._lock:
            self._released.extend(handles)

    def collect(self) -> None:
        """Free the rows released since the last call (the step loop's driver, between two steps)."""
        with self._lock:
            released, self._released = self._released, []
        rows = self._rows
        gone = [h for h in dict.fromkeys(released) if rows.live[h]]
        for handle in gone:
            self.pool.drop(rows.tables[handle, :-(-int(rows.length[handle]) // self.block_size)])
        rows.retire(gone)

    def needed(self, handles: list[int]) -> int:
        """Blocks the next step of ``handles`` takes: one for each row whose next token starts a block."""
        self.collect()
        return int((self._rows.length[handles] % self.block_size == 0).sum()) if handles else 0

    # -- rows for chunked feeds (the reward model's streaming rows) ----------------------------

    def open_rows(self, count: int) -> list[int]:
        """``count`` new rows holding no token (a chunked ``feed`` writes their first)."""
        self.collect()
        if not self.allocated:
            self._allocate_for_model()
        handles = self._rows.new(count)
        self._rows.length[handles] = 0
        self._rows.position[handles] = 0
        return handles

    def length(self, handle: int) -> int:
        """Tokens row ``handle`` holds."""
        return int(self._rows.length[handle])



class _Cut:
    """A chunked feed's cut of its rows back to the tokens they keep (``PagedPasses.feeding``), undone
    unless the feed completes: the blocks past each cut stay held until ``commit``; a kept last block
    another row shares is copied (copy on write), one the row owns is saved, since the feed writes
    past the cut in it. ``taken``: the blocks the feed took (its copies, then its new blocks)."""

    def __init__(self, kv: "KVCache", handles: list[int]):
        self.kv, self.handles = kv, handles
        self.tables = kv._rows.tables[handles].copy()  # [n, MB]: the rows' tables before
        self.taken: list[int] = []
        self.saved: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # (places, every layer's keys, values there)
        self.dropped: list[int] = []  # references the rows give up at the commit

    def back_to(self, starts: np.ndarray, held: np.ndarray) -> None:
        pool, rows, bs = self.kv.pool, self.kv._rows, self.kv.block_size
        layers = pool.keys + pool.values
        for handle, start, length in zip(self.handles, starts, held):
            if start == length:
                continue
            self.dropped += rows.tables[handle, -(-int(start) // bs):-(-int(length) // bs)].tolist()
            if not start % bs:
                continue
            block = int(rows.tables[handle, start // bs])
            places = pool.places_of([block])
            if pool.refs[block] > 1:
                (own,) = pool.take(1)
                self.taken.append(own)
                target = pool.places_of([own])
                for tensor in layers:
                    tensor[0].index_copy_(1, target, tensor[0].index_select(1, places))
                rows.tables[handle, start // bs] = own
                self.dropped.append(block)
            else:
                self.saved.append((places, [tensor[0].index_select(1, places) for tensor in layers]))

    def undo(self) -> None:
        """The rows' blocks, tables and kept keys and values as before; the blocks taken go back."""
        self.kv.pool.drop(self.taken)
        self.kv._rows.tables[self.handles] = self.tables
        for places, tensors in self.saved:
            for tensor, was in zip(self.kv.pool.keys + self.kv.pool.values, tensors):
                tensor[0].index_copy_(1, places, was)
        self.kv._sync(self.handles)

    def commit(self) -> None:
        self.kv.pool.drop(self.dropped)


class PagedPasses:
    """The model inputs of one KV manager's passes over its blocks, in the spirit of vLLM v1's model
    runner input preparation: a decoding step (``stepping``: one token per row, attention by the
    manager's AttentionKernel), a chunked feed (``feeding``: several tokens per row, gathered), and
    the row edits that go with them (``truncate``: copy on write; ``take``: rows out into a RowBatch
    of their own). Each pass takes its blocks before the forward and gives them back if it raises;
    the rows advance after it. KVCache hands these through (``kv.stepping`` is ``kv.passes.stepping``)."""

    def __init__(self, kv: "KVCache"):
        self.kv = kv

    @contextmanager
    def stepping(self, handles: list[int], tokens: torch.Tensor) -> Iterator[dict]:
        """The model inputs of one decoding step feeding ``tokens`` [n] to the rows ``handles`` (in
        that order), for the caller's forward pass (the model runner owns the model): each row's new
        key and value go to its next place (a new block when it starts one; ``needed`` says how many
        must be free), and attention reads every row's blocks in place. The rows advance when the
        block exits without an error; when it raises (an out-of-memory in the forward), the blocks the
        step took go back and the rows stay as they were.

        The host work is O(rows): the rows' lengths and places, their new blocks, and the kernel's
        per-row metadata (pipeline.engines.attention_kernel), never a table as wide as the pool.

            with kv.stepping(handles, tokens) as inputs:
                logits = model(**inputs, logits_to_keep=1).logits
        """
        self.kv.collect()
        rows, bs = self.kv._rows, self.kv.block_size
        handles = np.asarray(handles, dtype=np.int64)
        lengths = rows.length[handles]
        starting, taken = self._grow(handles, lengths)
        try:
            places = rows.tables[handles, lengths // bs].astype(np.int64) * bs + lengths % bs
            position = torch.from_numpy(rows.position[handles]).to(self.kv.device)
            call = self._step_call(handles, lengths + 1)
            with self._inputs(call, tokens[:, None], position[:, None], torch.from_numpy(places).to(self.kv.device),
                              int(lengths.max())) as inputs:
                yield inputs
        except BaseException:
            self.kv.pool.drop(taken)  # the rows did not advance: their new blocks go back
            raise
        rows.length[handles] += 1
        rows.position[handles] += 1
        self._count()

    @torch.inference_mode()
    def step(self, handles: list[int], tokens: torch.Tensor, **model_kwargs):
        """``stepping`` with the pool's model: its output, aligned with ``handles``."""
        with self.stepping(handles, tokens) as inputs, timed_forward(self.kv.device):
            return self.kv.model(**inputs, **model_kwargs)

    def _grow(self, handles: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """A new block for each row whose next token starts one: (those rows, their blocks)."""
        bs = self.kv.block_size
        starting = handles[lengths % bs == 0]
        if len(starting) > self.kv.free_blocks:
            raise KVBudgetError(f"KV cache: the step needs {len(starting)} new blocks, {self.kv.free_blocks} are free "
                                "(the step loop preempts before a step; this is a bug)")
        if not len(starting):
            return starting, []
        columns = self.kv._rows.length[starting] // bs
        if int(columns.max()) >= self.kv.row_blocks:
            self.kv._check_width(int(self.kv._rows.length[starting].max()) + 1)
        blocks = self.kv.pool.take(len(starting))
        self.kv._rows.tables[starting, columns] = blocks
        if self.kv.kernel is not None:
            self.kv.kernel.write_blocks(starting, columns, np.asarray(blocks))
        return starting, blocks

    def _step_call(self, handles: np.ndarray, lengths: np.ndarray) -> _StepCall:
        """The step's attention: each row attends ``lengths`` tokens (the one this step writes included)."""
        if self.kv.kernel is not None:
            return _StepCall(self.kv.kernel, self.kv.kernel.step(handles, lengths, self.kv._rows.tables))
        index = torch.from_numpy(handles).to(self.kv.device)
        return _StepCall(None, Step(index, HostRows(self.kv._rows.tables, handles, self.kv.block_size), lengths, 0))

    def _count(self) -> None:
        self.kv.forward_passes += 1
        for owner in self.kv.counted_by:
            owner.forward_passes += 1

    @contextmanager
    def _inputs(self, step, input_ids: torch.Tensor, position: torch.Tensor, places: torch.Tensor,
                seen: int, written: torch.Tensor | None = None) -> Iterator[dict]:
        """The model's keyword arguments over ``input_ids`` [n, C] at ``position`` [n, C], each written
        token's key and value going to ``places`` (``written``: which of the n * C are; None: all),
        attention as ``step`` (a _StepCall or _FeedCall) says (the model's attention implementation is
        PAGED_ATTENTION meanwhile)."""
        cache = DynamicCache()
        cache.layers = [_BlockLayer(k, v, places, seen, written) for k, v in zip(self.kv.pool.keys, self.kv.pool.values)]
        config = self.kv.model.config
        configured, config._attn_implementation = config._attn_implementation, PAGED_ATTENTION
        try:
            yield {"input_ids": input_ids.to(torch.long), "position_ids": position,
                   **cache_argument(self.kv.model, cache), "use_cache": True, "paged": step}
        finally:
            config._attn_implementation = configured

    @contextmanager
    def feeding(self, handles: list[int], chunks: list[list[int]], pad_id: int = 0,
                keep: list[int] | None = None) -> Iterator[dict]:
        """The model inputs of one forward pass appending ``chunks[i]`` (one token or more) to row
        ``handles[i]``, for the caller's forward pass, the chunks left-padded so column -1 is every
        row's last token (as RowBatch.feed_padded). ``keep``: each row first cut back to its first
        ``keep[i]`` tokens (as ``truncate``, a kept shared block copied first); None: nothing cut.
        Each new token's key and value go to its place in the row's blocks (new ones taken as it
        fills them; ``blocks_to_extend`` says how many must be free), and each token attends its
        row's places up to its own, gathered per layer (a chunked feed comes at a decision token, not
        every step).

        Atomic, the cut included: the rows are cut and advance only when the block exits without an
        error. Until then the blocks past each cut stay held and a kept last block the row owns is
        saved, so when the block raises, every row holds the tokens, blocks and keys it held before
        (the reward sessions' cached ids stay true, pipeline.engines.rewards)."""
        self.kv.collect()
        rows, bs = self.kv._rows, self.kv.block_size
        counts = np.array([len(c) for c in chunks], dtype=np.int64)
        if len(chunks) != len(handles) or not len(chunks) or counts.min() < 1:
            raise ValueError("KV cache: feed takes one chunk of at least one token per row")
        held = rows.length[handles].copy()
        starts = held.copy() if keep is None else np.asarray(keep, dtype=np.int64)
        for kept, length in zip(starts, held):
            if not 0 <= kept <= length:
                raise ValueError(f"KV cache: cannot keep {kept} tokens of a row that holds {length}")
        need = self.blocks_to_extend(handles, starts.tolist(), counts.tolist())
        if need > self.kv.free_blocks:
            raise KVBudgetError(f"KV cache: the feed needs {need} new blocks, {self.kv.free_blocks} are free "
                                "(the caller makes room first; this is a bug)")
        self.kv._check_width(int((starts + counts).max()))
        cut = _Cut(self.kv, handles)
        try:
            cut.back_to(starts, held)
            for handle, start, count in zip(handles, starts, counts):
                first, last = -(-int(start) // bs), -(-int(start + count) // bs)
                blocks = self.kv.pool.take(last - first)
                cut.taken += blocks
                rows.tables[handle, first:last] = blocks
            self.kv._sync(handles)
            width = int(counts.max())
            column = np.arange(width)[None, :]
            pad = (width - counts)[:, None]
            real = column >= pad  # [n, C]
            logical = np.where(real, starts[:, None] + column - pad, 0)  # each query's place in its row
            tables = rows.tables[handles]
            places = np.take_along_axis(tables, logical // bs, axis=1).astype(np.int64) * bs + logical % bs
            input_ids = np.full((len(handles), width), pad_id, dtype=np.int64)
            for i, chunk in enumerate(chunks):
                input_ids[i, width - len(chunk):] = chunk
            first_position = rows.position[handles] - (held - starts)  # the cut's tokens are not counted
            position = np.where(real, first_position[:, None] + column - pad, 0)
            call = _FeedCall(tables, starts + counts, logical, bs)

            def to(array):
                return torch.from_numpy(np.ascontiguousarray(array)).to(self.kv.device)

            with self._inputs(call, to(input_ids), to(position), to(places[real]), int((starts + counts).max()),
                              written=to(np.flatnonzero(real))) as inputs:
                yield inputs
        except BaseException:
            cut.undo()  # the rows did not advance and are not cut
            raise
        cut.commit()
        rows.position[handles] += starts - held + counts
        rows.length[handles] = starts + counts
        self._count()

    @torch.inference_mode()
    def feed(self, handles: list[int], chunks: list[list[int]], pad_id: int = 0, keep: list[int] | None = None,
             **model_kwargs):
        """``feeding`` with the pool's model: its output, [n, C] aligned with ``handles`` and the padded chunks."""
        with self.feeding(handles, chunks, pad_id, keep) as inputs, timed_forward(self.kv.device):
            return self.kv.model(**inputs, **model_kwargs)

    def blocks_to_extend(self, handles: list[int], keep: list[int], counts: list[int]) -> int:
        """At most the blocks that ``truncate(handles, keep)`` then a ``feed`` of ``counts`` tokens per
        row take: each row's new blocks, and a copy of a shared block a truncation ends inside. The
        blocks the truncation gives back are not counted."""
        self.kv.collect()
        rows, bs = self.kv._rows, self.kv.block_size
        need = 0
        for handle, kept, count in zip(handles, keep, counts):
            need += -(-(kept + count) // bs) - -(-kept // bs)
            if kept < rows.length[handle] and kept % bs and self.kv.pool.refs[rows.tables[handle, kept // bs]] > 1:
                need += 1
        return need

    @torch.inference_mode()
    def truncate(self, handles: list[int], keep: list[int]) -> None:
        """Row ``handles[i]`` keeps its first ``keep[i]`` tokens; the blocks past them go back. A kept
        last block that another row shares (a prompt's whole block) is copied first, so the row's next
        tokens never write where another row reads (copy on write: one block, ``blocks_to_extend``
        counts it)."""
        self.kv.collect()
        rows, bs = self.kv._rows, self.kv.block_size
        for handle, kept in zip(handles, keep):
            length = int(rows.length[handle])
            if not 0 <= kept <= length:
                raise ValueError(f"KV cache: cannot keep {kept} tokens of a row that holds {length}")
            if kept == length:
                continue
            self.kv.pool.drop(rows.tables[handle, -(-kept // bs):-(-length // bs)])
            shared = int(rows.tables[handle, kept // bs]) if kept % bs else -1
            if shared >= 0 and self.kv.pool.refs[shared] > 1:
                if not self.kv.pool.free_blocks:
                    raise KVBudgetError("KV cache: a truncation's copy on write needs a free block, none is "
                                        "(the caller makes room first; this is a bug)")
                (own,) = self.kv.pool.take(1)
                source, target = self.kv.pool.places_of([shared]), self.kv.pool.places_of([own])
                for tensor in self.kv.pool.keys + self.kv.pool.values:
                    tensor[0].index_copy_(1, target, tensor[0].index_select(1, source))
                self.kv.pool.drop([shared])
                rows.tables[handle, kept // bs] = own
            rows.position[handle] -= length - kept
            rows.length[handle] = kept
        self.kv._sync(handles)

    @torch.inference_mode()
    def take(self, handles: list[int]) -> RowBatch:
        """The rows in ``handles`` as a RowBatch of their own (a copy, left-padded), and their blocks
        freed: for model work that needs rows of its own (speculative decoding's draft-and-verify steps)."""
        self.kv.collect()
        rows, bs = self.kv._rows, self.kv.block_size
        lengths = rows.length[handles]
        width = int(lengths.max())
        places = np.zeros((len(handles), width), dtype=np.int64)
        mask = np.zeros((len(handles), width), dtype=np.int64)
        for i, (handle, length) in enumerate(zip(handles, lengths)):
            logical = np.arange(length)
            places[i, width - length:] = rows.tables[handle, logical // bs].astype(np.int64) * bs + logical % bs
            mask[i, width - length:] = 1
        index = torch.from_numpy(places.reshape(-1)).to(self.kv.device)
        layers = []
        for keys, values in zip(self.kv.pool.keys, self.kv.pool.values):
            heads, dim = keys.shape[1], keys.shape[3]
            layers.append(tuple(t[0].index_select(1, index).view(heads, len(handles), width, dim).transpose(0, 1)
                                .contiguous() for t in (keys, values)))
        batch = RowBatch(self.kv.model, _cache_of(self.kv.model, layers), torch.from_numpy(mask).to(self.kv.device),
                         torch.from_numpy(rows.position[handles].copy()).to(self.kv.device), self.kv.counted_by)
        self.kv.release(handles)
        self.kv.collect()
        return batch
