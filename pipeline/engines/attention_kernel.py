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
blocks spread over the pool, with random lengths across block boundaries and null rows among them.
Where a bucket does not compile (no C++ compiler, an inductor error) or disagrees beyond float
tolerance, the pool gathers for every step; one warning line says why, and ``stats()`` (the
generator's section of a build's ``_report.json``) records the kernel in use and the reason. A
runtime error inside a step (an out-of-memory) never switches the kernel off: it is the step's
caller's (pipeline.engines.step_loop).

Why static buckets: with the row count dynamic (torch.compile's automatic dynamic shapes, the
previous design), inductor's CPU flex template returned wrong attention for 8-token blocks on an
AVX2 CPU (errors of 29 to 540 on random K/V; docs/design.md has the reproducer), and on CUDA
decoding fell back to the general kernel. Nothing here changes torch's configuration beyond its
own calls: each pool compiles its own copy of the call (its own code object, so dynamo's
per-function recompile limit counts its buckets only), and the steps run under
``torch.compiler.set_stance("fail_on_recompile")`` (scoped to the step) so a guard that would
recompile during a build gathers that call instead (counted).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import types
from dataclasses import dataclass

import numpy as np
import torch

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
against 1.18 ms), so 1, 16, 256, 4,096: three compiles for 128 rows in flight instead of five, each
seconds of warm-up. On CUDA (not measured here): 1, 4, 16, 64, ..., at most 4x null rows."""
MAX_ROWS = 1024
"""The most rows one step's kernel call serves when the pool is not told (``max_rows``); a step
with a higher slot gathers (counted in ``stats``)."""
INDEX_BYTES = 64 << 20
"""The most bytes of the partial blocks' index (``kv_indices``: [rows, pool blocks] int32, which
inductor's CPU template wants as wide as the pool and materializes once) a pool's kernel may take:
its largest bucket is cut to fit (4,096 blocks: 1,024 rows). A pool of millions of tiny blocks (a
toy model at a default budget) keeps small buckets and gathers the steps past them."""
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
"""The largest absolute difference from the gather the self-check accepts, per dtype (others: 5e-2,
half precision); the check's keys, values and queries are standard normal."""


def gathers() -> bool:
    """Whether BON_KV_KERNEL asks every pool to gather."""
    return os.environ.get(KERNEL_ENV, "").strip().lower() == "gather"


def row_buckets(max_rows: int, device: str = "cpu") -> list[int]:
    """The static row counts a pool's kernel is compiled for on ``device`` (a device type): powers of
    its BUCKET_BASE from 1 up to the first at or above ``max_rows``."""
    sizes, base = [1], BUCKET_BASE.get(device, 4)
    while sizes[-1] < max_rows:
        sizes.append(sizes[-1] * base)
    return sizes


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


_copies = itertools.count()


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


def _own_flex(options: dict):
    """A compiled flex_attention call of its own: a fresh code object, so that dynamo's cache entries
    and recompile limit are this pool's alone. ``options``: ``kernel_options``."""
    from torch.nn.attention.flex_attention import flex_attention

    def call(query, key, value, block_mask, scale):
        return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True,
                              kernel_options=options or None)

    code = call.__code__.replace(co_name=f"paged_flex_{next(_copies)}")
    own = types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)
    return torch.compile(own, dynamic=False)


class AttentionKernel:
    """The decode attention of one pool (see the module docstring)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, heads: int, block_size: int, row_blocks: int,
                 max_rows: int = MAX_ROWS):
        """``keys``/``values``: one layer of the pool, [1, Hkv, NB * bs, D] (every layer has its shape);
        ``heads``: query heads; ``row_blocks``: the most blocks a row holds (its table's width)."""
        self.keys, self.values, self.heads, self.block_size = keys, values, heads, block_size
        self.device = keys.device
        self.num_blocks = keys.shape[2] // block_size
        self.row_blocks = row_blocks
        fit = INDEX_BYTES // (4 * self.num_blocks)
        self.buckets = [b for b in row_buckets(max(1, max_rows), self.device.type) if b <= fit] or [1]
        self._too_wide = fit < 1
        self.kernel = "gather"
        """What steps run: "flex_attention" (compiled, checked) or "gather"."""
        self.reason = "not warmed up"
        """Why the pool gathers ("" when it runs the kernel)."""
        self.compiles = 0
        """Buckets compiled (at warm_up)."""
        self.warm_up_seconds = 0.0
        self.check_error = 0.0
        """The largest difference from the gather over the self-check's buckets."""
        self.gathered_steps = 0
        """Steps gathered although the kernel is on: a slot past the largest bucket, or a call that
        would have recompiled."""
        capacity = self.buckets[-1]
        i32 = dict(dtype=torch.int32, device=self.device)
        self._tables = torch.zeros((capacity, row_blocks), **i32)  # [C, MB] each slot's block table
        self._whole = torch.zeros(capacity, **i32)  # [C] whole blocks a slot attends this step (0: not stepping)
        self._partial = torch.zeros(capacity, **i32)  # [C] 1 when it attends a partial last block
        self._last = torch.zeros(capacity, **i32)  # [C] that block
        self._filled = torch.zeros(capacity, **i32)  # [C] tokens of it attended
        self._masks: dict[int, object] = {}
        self._flex = None
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
        included); ``tables``: the manager's host tables (read at the rows only)."""
        bs = self.block_size
        top = int(slots.max()) + 1 if len(slots) else 1
        bucket = next((b for b in self.buckets if b >= top), 0) if self.kernel != "gather" else 0
        if not bucket and self.kernel != "gather":
            self.gathered_steps += 1
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
        if step.bucket:
            padded = query.new_zeros((step.bucket, *query.shape[1:])).index_copy_(0, step.slots, query)
            try:
                out = self._flex(padded, key, value, self._mask(step.bucket), scale)
                return out.index_select(0, step.slots)
            except RuntimeError as exc:
                if "fail_on_recompile" not in str(exc):
                    raise  # the step's error (an out-of-memory): its caller's, the kernel stays on
                self.gathered_steps += 1
        return gather_attention(query, key, value, step.tables.rows(), step.lengths, self.block_size, scale)

    # -- compile and check -----------------------------------------------------------------------

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile the kernel for every bucket and check each against the gather (module docstring);
        on a failure or a mismatch the pool gathers, with one warning line."""
        if gathers():
            self.reason = f"{KERNEL_ENV}=gather"
            return
        if self._too_wide:
            self._off(f"a pool of {self.num_blocks} blocks is too wide for the kernel's block index "
                      f"(INDEX_BYTES {INDEX_BYTES >> 20} MiB)")
            return
        started = time.perf_counter()
        self._flex = _own_flex(self.options)
        self.kernel, self.reason = "flex_attention", ""
        rng = np.random.default_rng(0)
        written = self._scratch_blocks(rng)
        try:
            for bucket in self.buckets:
                try:
                    error = self._check(bucket, written, rng)
                except Exception as exc:  # noqa: BLE001 - no compiler, none for this shape: gather
                    self._off(f"flex_attention does not compile for {bucket} rows ({type(exc).__name__}: "
                              f"{_first_line(exc)})")
                    return
                self.compiles += 1
                self.check_error = max(self.check_error, error)
                if not error <= TOLERANCE.get(self.keys.dtype, 5e-2):
                    self._off(f"compiled flex_attention differs from the gather by {error:.3g} at {bucket} rows "
                              f"(blocks of {self.block_size} tokens, {self.keys.dtype}, {self.device.type})")
                    return
        finally:
            for tensor in (self.keys, self.values):  # the scratch blocks go back as they were taken: zeroed
                tensor[0].index_fill_(1, written, 0)
            self._whole.zero_()
            self._partial.zero_()
            self.warm_up_seconds = time.perf_counter() - started
        log.info("KV cache: flex_attention compiled and checked for %s rows (pool of %d blocks of %d tokens) in "
                 "%.1f s, largest difference from the gather %.2g", "/".join(map(str, self.buckets)),
                 self.num_blocks, self.block_size, self.warm_up_seconds, self.check_error)

    def _off(self, reason: str) -> None:
        self.kernel, self.reason, self._masks = "gather", reason, {}
        log.warning("KV cache: %s; this pool gathers its rows' blocks for SDPA instead (slower)", reason)

    def _scratch_blocks(self, rng) -> torch.Tensor:
        """Places of the blocks the check writes random keys and values into: up to 2 * row_blocks
        blocks spread over the pool, the first and the last among them. Their places, [k * bs]."""
        count = min(self.num_blocks, max(8, 2 * min(self.row_blocks, 8)))
        chosen = np.unique(np.concatenate([[0, self.num_blocks - 1], rng.choice(self.num_blocks, count, replace=False)]))
        self._check_blocks = chosen.astype(np.int32)
        places = torch.from_numpy((chosen[:, None] * self.block_size + np.arange(self.block_size)).reshape(-1))
        places = places.to(self.device)
        generator = torch.Generator(device="cpu").manual_seed(0)
        for tensor in (self.keys, self.values):
            noise = torch.randn((tensor.shape[1], len(places), tensor.shape[3]), generator=generator)
            tensor[0].index_copy_(1, places, noise.to(tensor.dtype).to(self.device))
        return places

    def _check(self, bucket: int, written, rng) -> float:
        """Compile the bucket (a first call) and return the kernel's largest difference from the gather
        over two random steps: rows at random slots (the others null), random tables over the scratch
        blocks, random lengths across block boundaries."""
        error = 0.0
        for _ in range(2):
            n = int(rng.integers(1, bucket + 1))
            slots = np.sort(rng.choice(bucket, n, replace=False)).astype(np.int64)
            width = min(self.row_blocks, 4)
            tables = np.zeros((bucket, self.row_blocks), dtype=np.int32)
            tables[:, :width] = [rng.choice(self._check_blocks, width, replace=False) for _ in range(bucket)]
            lengths = rng.integers(1, width * self.block_size + 1, n)
            self.write_rows(np.arange(bucket), tables)
            step = self.step(slots, lengths, tables)
            generator = torch.Generator(device="cpu").manual_seed(int(rng.integers(1 << 30)))
            dim = self.keys.shape[3]
            query = torch.randn((n, self.heads, 1, dim), generator=generator).to(self.keys.dtype).to(self.device)
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                out = self.attend(query, self.keys, self.values, step, dim ** -0.5)
            expected = gather_attention(query, self.keys, self.values, tables[slots], lengths, self.block_size,
                                        dim ** -0.5)
            error = max(error, float((out.float() - expected.float()).abs().max()))
        return error

    def stats(self) -> dict:
        return {"kv_kernel": self.kernel, "kv_kernel_reason": self.reason, "kv_kernel_buckets": self.buckets,
                "kv_kernel_compiles": self.compiles, "kv_kernel_warm_up_s": round(self.warm_up_seconds, 2),
                "kv_kernel_check_error": self.check_error, "kv_kernel_gathered_steps": self.gathered_steps}


class HostRows:
    """The stepping rows' host block tables, read lazily (only a gather reads them: O(rows x row width))."""

    def __init__(self, tables: np.ndarray, slots: np.ndarray, block_size: int):
        self.tables, self.slots, self.block_size = tables, slots, block_size

    def rows(self) -> np.ndarray:
        return self.tables[self.slots]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
