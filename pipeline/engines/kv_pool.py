"""KVPool: the HF engine's one KV manager for continuous batching, a pool of row slots allocated
once per engine (as vLLM v1's KV cache manager is one per engine), addressed by slot.

Every layer's keys and values live in one buffer each, [S, H, C, D]: S slots (rows), C columns. A
session's rows enter the pool once, when they first join the step loop (``admit``: their prefilled
KV is written into free slots, the only copy a row's KV ever gets), and stay in their slots until
they finish or are pruned (``release``: the slots are free again, nothing moves). A step
(``step``) is one forward pass with a per-row write column: every stepping row writes its new
token's key and value at its own next column, so rows of any lengths share a pass without padding
them to one length and without moving a surviving row. Under sdpa or eager attention (the
defaults) only the stepping rows go through the model: for the attention their queries are
scattered into their slots' places, which reads the pool's keys and values where they are
(``_pool_attention``), so the slots between them that do not step (free ones, a session waiting
to be scored) cost only their share of the attention, and no key or value is ever copied. Under
other attention implementations the pass runs over slots [0, high), high being one past the
highest slot in use, and the rows that do not step ride along: they write a placeholder at their
next column, which the mask hides and their next real token overwrites. Free slots are taken
lowest first, so the rows in use stay packed at the front.

    pool = KVPool(model, device)
    slots = pool.admit(batch)                 # a prefilled RowBatch's rows -> free slots
    logits = pool.step(slots, tokens)         # one token for each of those rows, one forward pass
    pool.release(slots[:2])                   # pruned or finished: free again
    batch = pool.take(slots[2:])              # back out as a RowBatch (speculative decoding)

Shapes stay stable: the buffers are allocated once, and grow (one copy of every slot, rare) only
when a build needs more rows or columns than they hold, to a whole number of ``COLUMN_BLOCK``
columns and ``SLOT_BLOCK`` rows. The attention mask [S, C] marks each slot's real tokens; position ids
count real tokens only, so a row's logits match an unpadded run (up to float rounding).

Only models whose cache layers are all full attention use the pool (``KVPool.supports``); others
(sliding-window layers) keep the step loop's row-batch path.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from pipeline.engines.rows import RowBatch, _cache_of, _GrowingLayer, _new_cache, timed_forward

COLUMN_BLOCK = 64
"""Columns are allocated in blocks of this many."""
WIDTH_BLOCK = 16
"""A step attends over a whole number of blocks of this many columns (``KVPool._width``)."""
SLOT_BLOCK = 16
"""Slots are allocated in blocks of this many: a pool grows to the rows in use plus the new ones,
rounded up (no doubling: the step loop's rows in flight are bounded by runtime.rows_in_flight, and
a pool twice that size would hold memory no row uses)."""
M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # glibc's mallopt parameters (malloc.h)
HEAP_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": (M_MMAP_THRESHOLD, 4 << 20), "MALLOC_ARENA_MAX": (M_ARENA_MAX, 2)}
"""What ``bound_heap`` sets, each unless its environment variable is set: buffers of 4 MiB or more
are mapped and unmapped (returned to the system when freed), and the process's threads share two
heaps. glibc's defaults raise the map threshold to the size of each large freed buffer (so KV-sized
buffers end up in the heap, whose freed space is kept) and give every thread a heap of its own; a
long build's memory then grew with its length (docs/benchmarks.md, "Generator memory")."""


def _glibc(function: str):
    """glibc's ``function`` through ctypes; None where there is no glibc."""
    import ctypes

    try:
        return getattr(ctypes.CDLL("libc.so.6"), function)
    except (OSError, AttributeError):
        return None


def _round_up(count: int, block: int) -> int:
    """``count`` rounded up to a whole number of ``block``."""
    return -(-count // block) * block


def bound_heap() -> bool:
    """Apply HEAP_SETTINGS through glibc's ``mallopt`` (process-wide; False where there is no glibc)."""
    import os

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
    """Return the heap's free pages to the system (glibc's ``malloc_trim``, which also releases free
    pages inside the heap, not only at its top), at most once every TRIM_INTERVAL_S seconds. The
    engines call it when a session closes: allocations under the map threshold (tokenizer output,
    small activations, bookkeeping) fragment the heap, and a long build's resident memory otherwise
    creeps up with its length. False where there is no glibc or it is too soon."""
    import time

    now = time.monotonic()
    if now - _last_trim[0] < TRIM_INTERVAL_S:
        return False
    _last_trim[0] = now
    malloc_trim = _glibc("malloc_trim")
    return malloc_trim is not None and bool(malloc_trim(0))


POOL_ATTENTION = "bon_kv_pool"
"""The attention implementation a pool step runs under (registered with transformers'
AttentionInterface; no mask function, so transformers builds no mask and the pool passes its own)."""
SCATTER_BASES = ("sdpa", "eager")
"""Attention implementations a pool step can run its stepping rows alone under (``_pool_attention``
wraps them); under any other (flash-attention, paged kernels) the step runs over the whole slot
range, the other rows riding along."""


def _pool_attention(module, query, key, value, attention_mask, pool=None, **kwargs):
    """Attention of one pool step whose linear layers ran over the stepping rows alone: ``query``
    [n, Hq, 1, D] of those rows, ``key``/``value`` [R, Hkv, W, D] views of the slot range the pool
    layer returned. The queries are scattered into their slots' places, the model's own attention
    function (``pool.base``) runs over the range with the pool's mask, and the stepping rows' outputs
    come back [n, 1, Hq, D]. The range is cut into ``runs`` of the stepping rows' slots (a gap of a
    slot or two bridged), one attention call each, so rows that do not step (a session waiting for
    its rewards, freed slots) cost nothing but the bridged gaps. No key or value is copied."""
    rows, runs, mask, base = pool
    if base == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as attention
    else:  # the model's own eager function, in its modeling module
        attention = sys.modules[type(module).__module__].eager_attention_forward
    full = query.new_zeros((key.shape[0], *query.shape[1:]))  # [R, Hq, 1, D]
    full[rows] = query
    if len(runs) == 1:
        out, _ = attention(module, full, key, value, mask, **kwargs)
        return out[rows], None
    out = query.new_zeros((key.shape[0], query.shape[2], query.shape[1], query.shape[3]))  # [R, 1, Hq, D]
    for a, b in runs:
        out[a:b] = attention(module, full[a:b], key[a:b], value[a:b], mask[a:b], **kwargs)[0]
    return out[rows], None


RUN_GAP = 2
"""Slots that do not step between two stepping ones, up to this many, are attended over (their
output dropped) rather than cutting the attention in two calls."""


def step_runs(positions: np.ndarray, gap: int = RUN_GAP) -> list[tuple[int, int]]:
    """The stepping rows' positions in the slot range (sorted or not) as runs [a, b): consecutive
    positions, with gaps of at most ``gap`` positions bridged."""
    ordered = np.unique(positions)
    runs: list[list[int]] = []
    for p in ordered.tolist():
        if runs and p - runs[-1][1] <= gap:
            runs[-1][1] = p + 1
        else:
            runs.append([p, p + 1])
    return [(a, b) for a, b in runs]


def _register_pool_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(POOL_ATTENTION, _pool_attention)


class _PoolLayer(DynamicLayer):
    """One pool layer as transformers sees it during one step: ``update`` writes each stepping row's
    new key and value at its slot's write column and returns columns [0, width) of the slot range
    [lo, hi) as views of the pool's buffers (no copy)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, columns: torch.Tensor,
                 span: tuple[int, int], width: int):
        super().__init__()
        self.keys, self.values = keys, values  # [S, H, C, D] the pool's buffers
        self.slots, self.columns = slots, columns  # [n], [n]: where the pass's rows write
        self.span, self.width = span, width
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys[self.slots, :, self.columns] = key_states[:, :, 0]  # [n, H, D]
        self.values[self.slots, :, self.columns] = value_states[:, :, 0]
        lo, hi = self.span
        return self.keys[lo:hi, :, :self.width], self.values[lo:hi, :, :self.width]

    def get_seq_length(self) -> int:
        return self.width - 1  # the mask's columns before this step's one query

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.width, 0


class KVPool:
    """Row slots of one model's KV cache (see the module docstring)."""

    def __init__(self, model, device: torch.device, counted_by: tuple = ()):
        _register_pool_attention()
        self.model, self.device, self.counted_by = model, device, counted_by
        self.keys: list[torch.Tensor] = []  # per layer [S, H, C, D]
        self.values: list[torch.Tensor] = []
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=device)  # [S, C] 1 = a real token
        self.length = torch.zeros(0, dtype=torch.long, device=device)  # [S] columns written (the next write's column)
        self.host_length = np.zeros(0, dtype=np.int64)
        """``length`` as the host knows it (kept in step with it), so a step needs no read from the device."""
        self.position = torch.zeros(0, dtype=torch.long, device=device)  # [S] position id of the next token
        self.free: list[int] = []  # free slots, kept sorted
        self.used: set[int] = set()
        self._released: list[int] = []  # released by callers outside the loop, freed at the next gap
        self._lock = threading.Lock()
        self.forward_passes = 0
        self.grown = 0
        """Times the buffers were reallocated (rows or columns ran out)."""

    @staticmethod
    def supports(model) -> bool:
        """Whether every cache layer of ``model`` is full attention (the pool holds no sliding window)."""
        return all(isinstance(layer, _GrowingLayer) for layer in _new_cache(model).layers)

    @property
    def slots(self) -> int:
        return len(self.length)

    @property
    def columns(self) -> int:
        return self.mask.shape[1]

    def nbytes(self) -> int:
        """Bytes the pool's buffers hold (keys and values of every layer)."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    # -- slots ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def admit(self, batch: RowBatch, columns_needed: int, sources: list[int] | None = None) -> list[int]:
        """Write rows of ``batch`` (a prefilled RowBatch, no tree pending) into free slots, lowest
        first: their keys, values, attention mask and next positions. ``sources``: the batch row each
        new row copies (a prompt's row, once per sample: the fanned-out copy is never made; one
        layer at a time is gathered); None: every batch row, once. ``columns_needed``: the most
        columns any of these rows will hold (its cached tokens plus those still to decode; one more
        is kept free for the placeholder of a riding row). Returns the slots, aligned with the rows."""
        self.collect()
        layers = batch.cache.layers
        rows = len(sources) if sources is not None else len(batch.next_position)
        width = batch.attention_mask.shape[1]
        self._reserve(rows, max(columns_needed, width) + 1, layers[0].keys)
        slots = self.free[:rows]
        del self.free[:rows]
        self.used.update(slots)
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        source = None if sources is None else torch.tensor(sources, dtype=torch.long, device=self.device)

        def rows_of(tensor: torch.Tensor) -> torch.Tensor:
            return tensor if source is None else tensor.index_select(0, source)

        for pool_keys, pool_values, layer in zip(self.keys, self.values, layers):
            pool_keys[:, :, :width].index_copy_(0, index, rows_of(layer.keys))  # [rows, H, width, D] into the slots
            pool_values[:, :, :width].index_copy_(0, index, rows_of(layer.values))
        self.mask[index] = 0
        self.mask[:, :width].index_copy_(0, index, rows_of(batch.attention_mask).to(self.mask.dtype))
        self.length[index] = width
        self.host_length[slots] = width
        self.position[index] = rows_of(batch.next_position).to(self.position.dtype)
        return slots

    def release(self, slots: list[int]) -> None:
        """Free ``slots`` (any thread; they are freed at the next ``collect``, between two steps)."""
        with self._lock:
            self._released.extend(slots)

    @torch.inference_mode()
    def collect(self) -> None:
        """Free the slots released since the last call (the step loop's driver, between two steps)."""
        with self._lock:
            released, self._released = self._released, []
        if released:
            gone = sorted(self.used.intersection(released))
            self.used -= set(gone)
            self.free = sorted(self.free + gone)
            index = torch.tensor(gone, dtype=torch.long, device=self.device)
            self.length[index] = 0  # a free slot rides along writing at column 0
            self.host_length[gone] = 0
            self.mask[index] = 0

    @torch.inference_mode()
    def take(self, slots: list[int]) -> RowBatch:
        """The rows in ``slots`` as a RowBatch of their own (a copy), and the slots freed: for model
        work that needs rows of its own (speculative decoding's draft-and-verify steps)."""
        self.collect()
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        width = int(self.host_length[slots].max())
        layers = [(k[index, :, :width], v[index, :, :width]) for k, v in zip(self.keys, self.values)]
        batch = RowBatch(self.model, _cache_of(self.model, layers), self.mask[index, :width].clone(),
                         self.position[index].clone(), self.counted_by)
        self.release(slots)
        self.collect()
        return batch

    def _reserve(self, rows: int, columns: int, like: torch.Tensor) -> None:
        """Room for ``rows`` more rows of ``columns`` columns: the buffers are allocated on first use
        and reallocated (every slot copied once) only when they are too small."""
        slots = self.slots if len(self.free) >= rows else _round_up(len(self.used) + rows, SLOT_BLOCK)
        width = max(self.columns, _round_up(columns, COLUMN_BLOCK))
        if slots == self.slots and width == self.columns:
            return
        batch, heads, _, dim = like.shape
        old_slots, old_width = self.slots, self.columns

        def grown(old: torch.Tensor | None) -> torch.Tensor:
            buffer = torch.zeros((slots, heads, width, dim), dtype=like.dtype, device=self.device)
            if old is not None and old_slots:
                buffer[:old_slots, :, :old_width].copy_(old)
            return buffer

        if not self.keys:
            layers = len(_new_cache(self.model).layers)
            self.keys, self.values = [None] * layers, [None] * layers
        for i in range(len(self.keys)):  # one layer at a time: the old buffers go as the new ones come
            self.keys[i] = grown(self.keys[i])
            self.values[i] = grown(self.values[i])
        mask = torch.zeros((slots, width), dtype=torch.long, device=self.device)
        mask[:old_slots, :old_width] = self.mask
        self.mask = mask
        self.length = torch.cat([self.length, torch.zeros(slots - old_slots, dtype=torch.long, device=self.device)])
        self.host_length = np.concatenate([self.host_length, np.zeros(slots - old_slots, dtype=np.int64)])
        self.position = torch.cat([self.position, torch.zeros(slots - old_slots, dtype=torch.long,
                                                              device=self.device)])
        self.free = sorted(self.free + list(range(old_slots, slots)))
        self.grown += old_slots > 0

    # -- a decoding step ------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, slots: list[int], tokens: torch.Tensor, **model_kwargs):
        """One forward pass feeding ``tokens`` [n] to the rows in ``slots`` (n of them, in that
        order). Under sdpa or eager attention only those rows go through the model; their attention
        runs over the slot range they span (``_pool_attention``), the rows between them that do not
        step (free slots, a session waiting for its rewards) costing only their share of it. Under
        any other attention the pass runs over slots [0, high), the others riding along on a
        placeholder token the mask hides. Returns the model output for the stepping rows, in order.
        Nothing is read back from the device: the host keeps its own copy of the rows' lengths."""
        self.collect()
        host = np.asarray(slots, dtype=np.int64)
        index = torch.from_numpy(host).to(self.device)  # [n]
        base = self.model.config._attn_implementation or "eager"
        if base in SCATTER_BASES:
            out = self._scatter_step(host, index, tokens, base, **model_kwargs)
        else:
            out = self._ride_step(index, tokens, **model_kwargs)
        self._advance(host, index)
        return out

    def _scatter_step(self, host: np.ndarray, index: torch.Tensor, tokens: torch.Tensor, base: str, **model_kwargs):
        lo, hi = int(host.min()), int(host.max()) + 1
        columns = self.length[index]  # [n] each row writes at its next column
        width = self._width(int(self.host_length[host].max()))
        self.mask[index, columns] = 1
        mask = self.mask[lo:hi, :width].bool()  # [R, width]
        mask[:, 0] |= ~mask.any(-1)  # a free slot in the span: no row of all -inf (its output is dropped)
        mask = mask[:, None, None, :]  # [R, 1, 1, width]
        if base == "eager":  # eager adds its mask
            mask = torch.zeros(mask.shape, dtype=self.keys[0].dtype, device=self.device).masked_fill_(
                ~mask, torch.finfo(self.keys[0].dtype).min)
        cache = DynamicCache()
        cache.layers = [_PoolLayer(k, v, index, columns, (lo, hi), width) for k, v in zip(self.keys, self.values)]
        config = self.model.config
        configured, config._attn_implementation = config._attn_implementation, POOL_ATTENTION
        try:
            with timed_forward(self.device):
                out = self.model(input_ids=tokens.to(torch.long)[:, None], position_ids=self.position[index, None],
                                 past_key_values=cache, use_cache=True,
                                 pool=(index - lo, step_runs(host - lo), mask, base),
                                 **model_kwargs)
        finally:
            config._attn_implementation = configured
        return out

    def _ride_step(self, index: torch.Tensor, tokens: torch.Tensor, **model_kwargs):
        high = max(self.used) + 1
        rows = torch.arange(high, device=self.device)
        ids = torch.zeros(high, dtype=torch.long, device=self.device).index_copy_(0, index, tokens.to(torch.long))
        columns = self.length[:high]  # [high] each row writes at its next column
        width = self._width(int(self.host_length[:high].max()))
        self.mask[rows, columns] = 1  # riding rows too, for this pass: their placeholder attends to itself
        cache = DynamicCache()
        cache.layers = [_PoolLayer(k, v, rows, columns, (0, high), width) for k, v in zip(self.keys, self.values)]
        with timed_forward(self.device):
            out = self.model(input_ids=ids[:, None], attention_mask=self.mask[:high, :width],
                             position_ids=self.position[:high, None], past_key_values=cache, use_cache=True,
                             **model_kwargs)
        stepped = torch.zeros(high, dtype=self.mask.dtype, device=self.device)
        stepped[index] = 1
        self.mask[rows, columns] = stepped  # the riding rows' placeholders hidden again
        out.logits = out.logits[index]
        return out

    def _width(self, last: int) -> int:
        """The columns a step attends over, ``last`` being the highest column it writes: rounded up to
        a whole number of WIDTH_BLOCK columns (the mask hides the ones past each row's length), so
        the attention's shapes change once every WIDTH_BLOCK steps, not at every step (an attention
        kernel that plans per shape, as cuDNN's does, plans that much less often)."""
        if last >= self.columns:
            raise RuntimeError(f"KV pool: a row needs column {last} but the pool has {self.columns} "
                               "(admit was told fewer columns than the row decodes)")
        return min(self.columns, _round_up(last + 1, WIDTH_BLOCK))

    def _advance(self, host: np.ndarray, index: torch.Tensor) -> None:
        self.length[index] += 1
        self.host_length[host] += 1
        self.position[index] += 1
        self.forward_passes += 1
        for owner in self.counted_by:
            owner.forward_passes += 1
