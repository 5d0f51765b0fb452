"""RowBatch: rows of sequences over a causal LM that share one KV cache, the one row-batch type
every engine and adapter builds on (HFEngine sessions, ADED's and DSBD's tree targets, SLA's
self-rewarding decoder, ULTS's path-cache expander, the draft model, the streaming reward scorer).

Rows of different lengths are left-padded so the last column is every row's last token; the
attention mask hides the padding, and position ids come from ``next_position``, which counts real
tokens only, so a row's logits match an unpadded run. ``attention_mask.sum(-1) == next_position``
always holds: every attended column is one real token.

    rows, out = RowBatch.prefill(model, prompts, pad_id, device, logits_to_keep=1)
    rows.fan_out(num_samples)                     # prompt p -> rows p * n .. p * n + n - 1
    out = rows.feed(tokens[:, None])              # one token per row; [B, 1]
    rows.select([0, 0, 2])                        # keep / drop / reorder / repeat rows
    both = RowBatch.concat([rows, other])         # the rows of several batches as one
    kept, moved = both.split([[0, 1], [2]])       # and back apart, into new batches
    logits = rows.verify(trees)                   # a token tree per row, one forward pass
    rows.commit([(0, [0, 1]), (2, [])])           # cut the cache to the accepted paths

Extra model kwargs (``logits_to_keep=1``, ``with_rewards=True``) pass through to the model; the
model's output comes back as it is, so each user reads the logits, rewards or hidden states it
needs. Tensors are replaced, never written where a tensor handed out can see (the KV cache grows
in place, but only into spare columns past its current length: ``_GrowingLayer``), so a
``snapshot`` stays valid while the batch moves on.

Every forward pass is timed into the ``ForwardClock`` active in the calling context (an actor
activates its own for the length of each call, ``forward_clock``), whichever batch ran it: the
engine's, an adapter's, a co-located draft model's. Without an active clock nothing is timed.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from pipeline.decoding.tree import TokenTree
from pipeline.engines.tree import TreeVerification, cache_argument, commit_paths, verify_tree

KV = tuple[torch.Tensor, torch.Tensor]  # (keys, values) of one layer, each [H, n, D] or [B, H, n, D]


class ForwardClock:
    """Model forward passes run while this clock was active (``forward_clock``).

    ``seconds``: the time inside the passes. On CPU, wall seconds (time.time). On CUDA, each pass
    records a start and an end event on the current stream, and the device time between them is
    read only when ``seconds`` is read (which then waits for those passes), so timing never stalls
    the host between passes."""

    def __init__(self, seconds: float = 0.0, passes: int = 0):
        self._seconds = seconds
        self.passes = passes
        """Forward passes timed."""
        self.warm_up_seconds = 0.0
        """Wall seconds of compiled kernels' warm-ups (compile and check, ``timed_warm_up``): work of
        the calls that is neither a forward pass nor sampling and bookkeeping."""
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def seconds(self) -> float:
        pending, self._pending = self._pending, []
        for start, end in pending:
            end.synchronize()
            self._seconds += start.elapsed_time(end) / 1000  # milliseconds
        return self._seconds

    @seconds.setter
    def seconds(self, value: float) -> None:
        self._seconds = value


# Dynamic scope, like torch.inference_mode: each thread (each Ray actor call, each in-process
# coordinator thread) sees the clock its own caller activated, or None.
_ACTIVE_CLOCK: ContextVar[ForwardClock | None] = ContextVar("forward_clock", default=None)


@contextmanager
def forward_clock(clock: ForwardClock) -> Iterator[ForwardClock]:
    """Time every forward pass run inside this block, in this context, into ``clock``."""
    token = _ACTIVE_CLOCK.set(clock)
    try:
        yield clock
    finally:
        _ACTIVE_CLOCK.reset(token)


@contextmanager
def timed_forward(device: torch.device) -> Iterator[None]:
    """One model forward pass (on ``device``), timed into the active clock if there is one."""
    clock = _ACTIVE_CLOCK.get()
    if clock is None:
        yield
        return
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.current_stream(device)
        start.record(stream)
        yield
        end.record(stream)
        clock._pending.append((start, end))
    else:
        start = time.time()
        yield
        clock._seconds += time.time() - start
    clock.passes += 1


@contextmanager
def timed_warm_up() -> Iterator[None]:
    """A compiled kernel's warm-up (its compile and check, pipeline.engines.attention_kernel), timed
    into the active clock's ``warm_up_seconds`` if there is one."""
    clock = _ACTIVE_CLOCK.get()
    start = time.time()
    try:
        yield
    finally:
        if clock is not None:
            clock.warm_up_seconds += time.time() - start


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids), each [P, W]: prompts left-padded so the last
    column is every prompt's last token; position ids count real tokens only."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    return input_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


class _GrowingLayer(DynamicLayer):
    """A DynamicLayer that appends in place: its keys and values are views [B, H, L, D] of buffers
    with spare columns, and ``update`` writes the new columns into them, where DynamicLayer's
    ``torch.cat`` copies the whole layer at every decoding step. When the room runs out, or
    ``keys``/``values`` were replaced from outside (``select``, ``fan_out``, ``commit``, a crop), the
    next update copies them into new buffers with room for a quarter more columns (at least 64).

    Only columns past every view handed out are written, so tensors taken earlier (a RowSnapshot)
    keep their values. It writes in place only in inference mode, where the buffers are made (an
    in-place write would break autograd's saved tensors); elsewhere it concatenates, as DynamicLayer."""

    _room: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(keys buffer, values buffer, the keys view, the values view) of the last in-place update."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> KV:
        if not torch.is_inference_mode_enabled():
            self._room = None
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self.get_seq_length(), key_states.shape[-2]
        room = self._room
        if room is None or room[2] is not self.keys or room[3] is not self.values or length + new > room[0].shape[-2]:
            keys, values = self._grow(key_states, value_states, length, length + new)
        else:
            keys, values = room[0], room[1]
        keys[:, :, length:length + new].copy_(key_states)
        values[:, :, length:length + new].copy_(value_states)
        self.keys, self.values = keys[:, :, :length + new], values[:, :, :length + new]
        self._room = (keys, values, self.keys, self.values)
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, length: int,
              needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """New buffers for ``needed`` columns and room to spare, holding the ``length`` cached ones."""
        columns = needed + max(64, needed // 4)

        def buffer(cached: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
            batch, heads, _, dim = states.shape
            grown = torch.empty((batch, heads, columns, dim), dtype=states.dtype, device=states.device)
            if length:
                grown[:, :, :length].copy_(cached)
            return grown

        return buffer(self.keys, key_states), buffer(self.values, value_states)


def _new_cache(model) -> DynamicCache:
    """An empty cache for ``model`` whose full-attention layers append in place (_GrowingLayer)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [_GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def _cache_of(model, layers: list[KV]) -> DynamicCache:
    """A cache holding ``layers`` (per layer (keys, values) [B, H, L, D]) as they are: filling it
    through ``update`` would copy every tensor once more."""
    cache = _new_cache(model)
    for layer, (keys, values) in zip(cache.layers, layers):
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return cache


@dataclass
class RowSnapshot:
    """A RowBatch's rows at one moment; ``RowBatch.gather`` restarts rows from it later (the draft
    model resumes from the beams of its last call). It holds references: RowBatch never writes
    where they can see, so later steps do not change it."""

    layers: list[KV]  # per layer (keys, values), each [B, H, L, D]
    attention_mask: torch.Tensor  # [B, L]
    next_position: torch.Tensor  # [B]


@dataclass
class RowBatch:
    """B rows over one model and one KV cache (see the module docstring)."""

    model: Any
    """A causal LM, or the base model of a reward classifier: anything that takes a KV cache
    (``cache_argument``)."""
    cache: DynamicCache
    """Every layer [B, H, L, D]; cache column j is attention-mask column j. Between ``verify`` and
    ``commit`` the tree's N nodes follow (L + N), until the commit cuts them to paths."""
    attention_mask: torch.Tensor  # [B, L] 1 = a token the row attends to; 0 = left padding, a gap
    # left by a commit of paths of different lengths, or a column truncate forgot
    next_position: torch.Tensor  # [B] position id of each row's next token (its real tokens so far)
    counted_by: tuple = ()
    """Owners whose ``forward_passes`` also count this batch's passes: a running total (an
    engine's, an adapter's) that outlives the batch."""
    forward_passes: int = 0
    """Model forward passes run on this batch."""
    verification: TreeVerification | None = None
    """The last ``verify``: its nodes sit in the cache until ``commit`` cuts them to paths."""

    # -- building a batch ----------------------------------------------------------------------

    @classmethod
    def empty(cls, model, rows: int, device, counted_by: tuple = ()) -> RowBatch:
        """``rows`` rows with nothing cached yet."""
        mask = torch.zeros((rows, 0), dtype=torch.long, device=device)  # [B, 0]
        return cls(model, _new_cache(model), mask, torch.zeros(rows, dtype=torch.long, device=device),
                   counted_by)

    @classmethod
    def prefill(cls, model, prompts: list[list[int]], pad_id: int, device, counted_by: tuple = (),
                **model_kwargs) -> tuple[RowBatch, Any]:
        """One row per prompt, all prompts fed in one left-padded forward pass: (rows, model output)."""
        rows = cls.empty(model, len(prompts), device, counted_by)
        return rows, rows.feed_padded(prompts, pad_id, **model_kwargs)

    @classmethod
    def from_entries(cls, model, rows: list[list[list[KV]]], device, counted_by: tuple = ()) -> RowBatch:
        """A batch whose row i caches the concatenation of rows[i]'s entries (each a per-layer list
        of (keys, values) [H, n, D], in sequence order), left-padded to a common length."""
        lengths = [sum(entry[0][0].shape[1] for entry in entries) for entries in rows]
        width = max(lengths)
        cache_data = []
        for layer in range(len(rows[0][0])):
            keys, values = [], []
            for entries, length in zip(rows, lengths):
                k = torch.cat([e[layer][0] for e in entries], dim=1)  # [H, length, D]
                v = torch.cat([e[layer][1] for e in entries], dim=1)
                pad = width - length  # left padding, hidden by the attention mask
                keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
                values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
            cache_data.append((torch.stack(keys), torch.stack(values)))  # [B, H, width, D]
        cache = _cache_of(model, cache_data)
        mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)  # [B, width]
        for i, length in enumerate(lengths):
            mask[i, width - length:] = 1
        return cls(model, cache, mask, torch.tensor(lengths, device=device), counted_by)

    @classmethod
    def gather(cls, model, picks: list[tuple[RowSnapshot, int]], counted_by: tuple = ()) -> RowBatch:
        """Row j is row ``picks[j][1]`` of snapshot ``picks[j][0]``; the snapshots must share one length."""
        snapshots, index = zip(*picks)

        def rows(tensors) -> torch.Tensor:  # one tensor per pick -> its picked row of each, stacked
            return torch.cat([t[r:r + 1] for t, r in zip(tensors, index)])

        layers = [(rows(s.layers[i][0] for s in snapshots), rows(s.layers[i][1] for s in snapshots))
                  for i in range(len(snapshots[0].layers))]
        return cls(model, _cache_of(model, layers), rows(s.attention_mask for s in snapshots),
                   rows(s.next_position for s in snapshots), counted_by)

    @classmethod
    def concat(cls, batches: list[RowBatch], counted_by: tuple = ()) -> RowBatch:
        """The rows of ``batches``, in order, as one batch over their (shared) model: each batch's
        cache is left-padded to the longest one with columns its attention mask hides, so a row's
        logits stay those it had in its own batch (up to float rounding). The inputs are left as
        they were; use the result instead."""
        batches = [b for b in batches if len(b.next_position)]
        if any(b.verification is not None for b in batches):
            raise ValueError("concat between verify and commit")
        if not batches:
            raise ValueError("concat needs a batch with rows")
        width = max(b.attention_mask.shape[1] for b in batches)
        pads = [width - b.attention_mask.shape[1] for b in batches]

        def cat(tensors) -> torch.Tensor:  # each [B_i, H, L_i, D] -> [sum B_i, H, width, D]
            return torch.cat([torch.nn.functional.pad(t, (0, 0, pad, 0)) for t, pad in zip(tensors, pads)])

        layers = [(cat(b.cache.layers[i].keys for b in batches), cat(b.cache.layers[i].values for b in batches))
                  for i in range(len(batches[0].cache.layers))]
        mask = torch.cat([torch.nn.functional.pad(b.attention_mask, (pad, 0)) for b, pad in zip(batches, pads)])
        return cls(batches[0].model, _cache_of(batches[0].model, layers), mask,
                   torch.cat([b.next_position for b in batches]), counted_by)

    def split(self, groups: list[list[int]]) -> list[RowBatch]:
        """One new batch per group of row positions (``concat`` backwards; a group may be empty),
        each cut to its own rows' longest cache: the leading columns that every row of the group
        hides are dropped. This batch is left as it was; use the parts instead."""
        if self.verification is not None:
            raise ValueError("split between verify and commit")
        device = self.attention_mask.device
        parts = []
        for group in groups:
            index = torch.as_tensor(group, dtype=torch.long, device=device)  # [B']
            mask = self.attention_mask[index]  # [B', L]
            if not len(group):
                parts.append(RowBatch(self.model, DynamicCache(), mask, self.next_position[index], self.counted_by))
                continue
            attended = mask.any(0).nonzero()  # columns some row of the group attends to
            start = int(attended[0]) if len(attended) else mask.shape[1]
            layers = [(layer.keys[index, :, start:], layer.values[index, :, start:]) for layer in self.cache.layers]
            parts.append(RowBatch(self.model, _cache_of(self.model, layers), mask[:, start:],
                                  self.next_position[index], self.counted_by))
        return parts

    def snapshot(self) -> RowSnapshot:
        return RowSnapshot([(layer.keys, layer.values) for layer in self.cache.layers], self.attention_mask,
                           self.next_position)

    def nbytes(self) -> int:
        """Bytes the KV cache holds, its spare columns included (each buffer counted once)."""
        storages = {}
        for layer in self.cache.layers:
            room = getattr(layer, "_room", None)
            for tensor in (layer.keys, layer.values) + (room[:2] if room else ()):
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def entries(self, row: int, last: int | None = None) -> list[KV]:
        """Per layer, copies of row ``row``'s keys and values [H, n, D] of its last ``last`` columns
        (all when None): what ``from_entries`` takes back."""
        start = -last if last else 0
        return [(layer.keys[row, :, start:].clone(), layer.values[row, :, start:].clone())
                for layer in self.cache.layers]

    # -- rows --------------------------------------------------------------------------------

    def select(self, index: list[int] | torch.Tensor) -> torch.Tensor:
        """Row j becomes old row ``index[j]`` (keep, drop, reorder, repeat); no rows left frees the
        cache. Returns ``index`` as a tensor, for the caller's own per-row state."""
        device = self.attention_mask.device
        if isinstance(index, list) and index == list(range(len(self.next_position))):
            return torch.arange(len(index), device=device)  # every row, in order: nothing moves
        index = torch.as_tensor(index, dtype=torch.long, device=device)  # [B']
        if len(index):
            self.cache.batch_select_indices(index)
        else:  # nothing left to decode: free the cache now
            self.cache = DynamicCache()
        self.attention_mask = self.attention_mask[index]
        self.next_position = self.next_position[index]
        return index

    def fan_out(self, n: int) -> None:
        """Row p becomes rows p * n .. p * n + n - 1 (a prompt prefilled once, sampled n times)."""
        self.cache.batch_repeat_interleave(n)
        self.attention_mask = self.attention_mask.repeat_interleave(n, 0)
        self.next_position = self.next_position.repeat_interleave(n, 0)

    def truncate(self, lengths: list[int]) -> None:
        """Row i keeps only its first ``lengths[i]`` tokens: the cached columns after them are
        masked out (cheaper than cutting the cache), and the next tokens fed take their positions."""
        lengths = torch.tensor(lengths, dtype=self.next_position.dtype, device=self.attention_mask.device)  # [B]
        counted = self.attention_mask.cumsum(-1)  # [B, L] tokens up to and including each column
        self.attention_mask = self.attention_mask.masked_fill(counted > lengths[:, None], 0)
        self.next_position = torch.minimum(self.next_position, lengths)

    # -- forward passes ----------------------------------------------------------------------

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **model_kwargs):
        with timed_forward(input_ids.device):
            out = self.model(input_ids=input_ids, attention_mask=self.attention_mask, position_ids=position_ids,
                             use_cache=True, **cache_argument(self.model, self.cache), **model_kwargs)
        self._count()
        return out

    def _count(self) -> None:
        self.forward_passes += 1
        for owner in self.counted_by:
            owner.forward_passes += 1

    @torch.inference_mode()
    def feed(self, tokens: torch.Tensor, **model_kwargs):
        """Append the same number T of tokens to every row, tokens [B, T]; returns the model output."""
        ones = torch.ones(tokens.shape, dtype=self.attention_mask.dtype, device=self.attention_mask.device)
        self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)  # [B, L + T]
        steps = torch.arange(tokens.shape[1], device=self.attention_mask.device)
        out = self._forward(tokens, self.next_position[:, None] + steps, **model_kwargs)  # positions [B, T]
        self.next_position = self.next_position + tokens.shape[1]
        return out

    @torch.inference_mode()
    def feed_padded(self, chunks: list[list[int]], pad_id: int, **model_kwargs):
        """Append chunks[i] to row i, chunks left-padded so column -1 is every row's last token;
        returns the model output. A prefill is this on an empty batch."""
        input_ids, chunk_mask, steps = left_pad(chunks, pad_id, self.attention_mask.device)  # [B, W]
        self.attention_mask = torch.cat([self.attention_mask, chunk_mask], dim=1)  # [B, L + W]
        out = self._forward(input_ids, steps + self.next_position[:, None] * chunk_mask, **model_kwargs)
        self.next_position = self.next_position + chunk_mask.sum(-1)
        return out

    def verify(self, trees: list[TokenTree]) -> torch.Tensor:
        """Logits [B, N, V] after every node of every row's tree, in one forward pass
        (pipeline.engines.tree.verify_tree); the nodes stay cached until ``commit``."""
        with timed_forward(self.attention_mask.device):
            self.verification = verify_tree(self.model, self.cache, self.attention_mask, self.next_position, trees)
        self._count()
        return self.verification.logits

    def commit(self, sources: list[tuple[int, list[int]]]) -> None:
        """Output row j continues row ``sources[j][0]`` of the last ``verify`` with the nodes on
        path ``sources[j][1]`` (pipeline.engines.tree.commit_paths); no sources frees the cache."""
        if self.verification is None:
            raise ValueError("commit needs a verify first")
        if sources:
            self.attention_mask, self.next_position = commit_paths(self.cache, self.verification, sources)
        else:
            self.select([])
        self.verification = None

    def commit_prefixes(self, lengths: list[int]) -> None:
        """After a ``verify`` of chains (each tree one path from its root), row i keeps the first
        ``lengths[i]`` nodes of its chain. The other nodes' columns stay in the cache, hidden by the
        attention mask (as ``truncate`` hides columns): no key or value is copied, where ``commit``
        would gather the whole cache. Rows and their order stay as they were."""
        verification = self.verification
        if verification is None:
            raise ValueError("commit_prefixes needs a verify first")
        for tree, length in zip(verification.trees, lengths):
            if not 0 <= length <= len(tree.tokens) or any(p != i - 1 for i, p in enumerate(tree.parents)):
                raise ValueError(f"commit_prefixes: {length} nodes of a tree that is not a chain of at least that many")
        device = self.attention_mask.device
        nodes = self.cache.get_seq_length() - verification.past_length
        kept = torch.tensor(lengths, dtype=self.next_position.dtype, device=device)  # [B]
        tail = (torch.arange(nodes, device=device)[None] < kept[:, None]).to(verification.attention_mask.dtype)
        self.attention_mask = torch.cat([verification.attention_mask, tail], dim=1)  # [B, L + N]
        self.next_position = verification.next_position.to(device) + kept
        self.verification = None
