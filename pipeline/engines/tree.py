"""Tree-attention verification: score a token tree (or forest) per row in ONE forward pass, then
cut the KV cache back to the accepted path(s).

Shared by speculative decoding, DSBD (forest-based parallel decoding, DSBD section 3.3) and
ADED. The idea is SpecInfer's (Miao et al. 2023) topology-aware causal mask: every draft node is
one input position; a node attends to the row's committed context and to its own ancestors, and
its position id is (next position of the row) + (its depth), so its logits equal those of
running its branch alone.

Terms
-----
- *row*: one sequence of a batch with a KV cache, held the way pipeline.engines.rows.RowBatch
  holds them: ``cache`` (a ``transformers.DynamicCache``, every layer ``[B, H, L, D]``), ``attention_mask``
  ``[B, L]`` (1 = real token, 0 = padding; padding may be on the left and, after a cut, also in
  gaps) and ``next_position`` ``[B]`` (the position id the next token of each row gets; it counts
  real tokens only).
- *committed context*: what is in the row's cache. The root-level nodes of a tree continue it:
  a node with parent -1 is the token right after the cached ones. (If a caller holds a sampled
  token that is not yet in the cache, as HFEngine sessions do with ``last_token``, that token is
  the tree's root node.)
- *tree*: ``TokenTree(tokens, parents)`` with ``parents[i] < i`` (topological order) and -1 for
  root-level nodes; several root-level nodes make a forest. Rows may have different node counts.

API
---
``verify_tree(model, cache, attention_mask, next_position, trees) -> TreeVerification``
    One forward pass. Returns ``logits`` ``[B, N, V]`` (N = most nodes of any row): the
    next-token logits AFTER each node, i.e. ``logits[b, i]`` is the target's distribution for the
    child of node i of row b. Positions ``i >= len(trees[b].tokens)`` are padding (garbage).
    The cache now holds ``L + N`` positions per row (all nodes); it is not usable for decoding
    until ``commit_paths`` cuts it.
``commit_paths(cache, verification, sources) -> (attention_mask, next_position)``
    ``sources`` is a list of ``(row, path)``: output row j continues input row ``row`` with the
    nodes ``path`` (a root-to-node chain of node indices of that row's tree, possibly empty =
    nothing accepted). The cache is rebuilt in place to one row per source (rows may be
    dropped, kept, or repeated: one input row can yield several output rows, as DSBD beams do),
    holding the row's old context plus its path's keys/values. Paths of different lengths are
    right-padded to the longest one with attention-mask 0, so a gap may sit between a row's
    context and its next tokens; position ids stay exact because they come from
    ``next_position`` (old next position + path length), never from the mask. The returned
    ``attention_mask`` ``[B', L + max_path]`` and ``next_position`` ``[B']`` replace the old
    ones, and ordinary decoding (a 2D mask plus explicit position ids) continues from them.
``cache_argument(model, cache) -> dict``
    The keyword that hands ``model`` its KV cache: ``cache`` where its forward takes that name
    (transformers 5.24 renamed ``past_key_values``; the old name warns, and goes in 5.40), else
    ``past_key_values`` (older releases, the vLLM venv's, remote-code models). Every engine call
    that passes a cache goes through it.
``tree_inputs(trees, attention_mask, next_position, dtype)`` builds the forward inputs (token
    ids, position ids, the 4D additive mask ``[B, 1, N, L + N]``) and is exposed for callers
    that run the model themselves.
``RowBatch.verify`` and ``RowBatch.commit`` (pipeline.engines.rows) call these two on a batch's
    (cache, attention_mask, next_position), for decoders that verify tree after tree (DSBD's
    ForestTarget and ADED's TreeVerifier, through pipeline.engines.adapters).

The mask is additive float (0 = attend, dtype min = masked), which the eager and SDPA attention
implementations both take as-is (transformers returns a 4D mask unchanged). Flash-attention
kernels take no custom masks, so a model loaded with them cannot verify trees. Only plain
(non-sliding-window) cache layers can be cut.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from pipeline.decoding.tree import TokenTree


def cache_argument(model, cache) -> dict:
    """``{keyword: cache}`` for ``model``'s forward (see the module docstring). A wrapper whose forward
    names neither keyword (the Reward Transformer passes ``**kwargs`` on) is asked through its
    ``policy``."""
    while True:
        names = _forward_parameters(type(model))
        if "cache" in names:
            return {"cache": cache}
        inner = getattr(model, "policy", None)
        if "past_key_values" in names or inner is None:
            return {"past_key_values": cache}
        model = inner


@functools.cache
def _forward_parameters(cls) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


@dataclass
class TreeInputs:
    input_ids: torch.Tensor  # [B, N] long; padding nodes hold token 0
    position_ids: torch.Tensor  # [B, N] long
    attention_mask: torch.Tensor  # [B, 1, N, L + N] additive float
    num_nodes: list[int]  # real nodes per row


@dataclass
class TreeVerification:
    logits: torch.Tensor  # [B, N, V]: logits[b, i] = next-token logits after node i of row b
    trees: list[TokenTree]
    attention_mask: torch.Tensor  # [B, L] the rows' 2D mask before the tree was added
    next_position: torch.Tensor  # [B] before the tree was added
    past_length: int  # L: cache positions before the tree


def tree_inputs(trees: list[TokenTree], attention_mask: torch.Tensor, next_position: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> TreeInputs:
    """Token ids, position ids and the 4D tree mask for one forward pass over ``trees``."""
    batch, past = attention_mask.shape
    if len(trees) != batch:
        raise ValueError(f"{len(trees)} trees for a batch of {batch} rows")
    device = attention_mask.device
    width = max(1, max(len(t.tokens) for t in trees))
    input_ids = torch.zeros((batch, width), dtype=torch.long)
    depth = torch.zeros((batch, width), dtype=torch.long)
    allowed = torch.zeros((batch, width, width), dtype=torch.bool)  # node i may attend to node j
    for b, tree in enumerate(trees):
        n = len(tree.tokens)
        input_ids[b, :n] = torch.tensor(tree.tokens, dtype=torch.long)
        depth[b, :n] = torch.tensor(tree.depths(), dtype=torch.long)
        for i, p in enumerate(tree.parents):
            allowed[b, i, i] = True
            if p >= 0:
                allowed[b, i] |= allowed[b, p]  # ancestors of the parent, and the parent itself
        allowed[b, range(n, width), range(n, width)] = True  # padding nodes see only themselves (no NaN rows)
    context = attention_mask.bool()[:, None, :].expand(batch, width, past).clone()  # [B, N, L]
    for b, tree in enumerate(trees):
        context[b, len(tree.tokens):] = False
    visible = torch.cat([context, allowed.to(device)], dim=-1)  # [B, N, L + N]
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)
    position_ids = next_position[:, None].to(device) + depth.to(device)  # [B, N]
    return TreeInputs(input_ids.to(device), position_ids, mask[:, None], [len(t.tokens) for t in trees])


@torch.inference_mode()
def verify_tree(model, cache, attention_mask: torch.Tensor, next_position: torch.Tensor,
                trees: list[TokenTree]) -> TreeVerification:
    """One target forward pass over every row's tree; see the module docstring."""
    past = cache.get_seq_length()
    if past != attention_mask.shape[1]:
        raise ValueError(f"cache holds {past} positions but the attention mask has {attention_mask.shape[1]}")
    inputs = tree_inputs(trees, attention_mask, next_position, dtype=model.dtype)
    out = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask, position_ids=inputs.position_ids,
                use_cache=True, **cache_argument(model, cache))
    return TreeVerification(out.logits, trees, attention_mask, next_position, past)


def commit_paths(cache, verification: TreeVerification, sources: list[tuple[int, list[int]]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut the cache to one row per ``(row, path)`` source; returns (attention_mask, next_position)."""
    past, trees = verification.past_length, verification.trees
    mask, next_position = verification.attention_mask, verification.next_position
    device = mask.device
    for row, path in sources:
        if not 0 <= row < len(trees):
            raise ValueError(f"source row {row} is not in the batch of {len(trees)}")
        tree = trees[row]
        if path and tree.path_to(path[-1]) != list(path):
            raise ValueError(f"row {row}: {list(path)} is not a root-to-node path of its tree")
    longest = max((len(p) for _, p in sources), default=0)
    rows = torch.tensor([r for r, _ in sources], dtype=torch.long, device=device)  # [B']
    # Cache positions each output row keeps: its context, then its path's nodes, then padding.
    index = torch.arange(past + longest, device=device).repeat(len(sources), 1)  # [B', L + P]
    tail = torch.ones((len(sources), longest), dtype=mask.dtype, device=device)
    for j, (_, path) in enumerate(sources):
        index[j, past:past + len(path)] = past + torch.tensor(path, dtype=torch.long, device=device)
        index[j, past + len(path):] = past  # any valid position; it is masked out
        tail[j, len(path):] = 0
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
            raise ValueError(f"cannot cut a {type(layer).__name__} cache layer along a tree path")
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        gather = index[:, None, :, None]  # [B', 1, L + P, 1]
        keys, values = layer.keys[rows], layer.values[rows]  # [B', H, L + N, D]
        shape = (keys.shape[0], keys.shape[1], index.shape[1], keys.shape[3])
        layer.keys = keys.gather(2, gather.expand(shape))
        layer.values = values.gather(2, gather.expand(shape))
    new_mask = torch.cat([mask[rows], tail], dim=1)  # [B', L + P]
    lengths = torch.tensor([len(p) for _, p in sources], dtype=next_position.dtype, device=device)
    return new_mask, next_position.to(device)[rows] + lengths
