"""The adapters that present a Hugging Face generator engine to the decoding algorithms, each
through the small Protocol its algorithm declares, and the per-engine state those algorithms
keep (tri-gram matrices, empirical priors, fitted beliefs).

    host = HFSearchHost(engine)      # engine.search_host: one per HFEngine
    host.tree_target()               # ADED's TreeVerifier            (TreeTarget)
    host.forest_target()             # DSBD's ForestTarget             (TreeSession)
    host.node_expander()             # ULTS's NodeExpander             (PathCacheExpander)
    host.self_rewarding_lm()         # SLA's SelfRewardingLM           (SelfRewardDecoder)
    host.remember(key, make)         # per-engine state, made once

A model-side method (pipeline.methods record with ``search``) receives the host, never the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import DynamicCache

from pipeline.decoding.tree import TokenTree
from pipeline.engines.reward_transformer import CHANNEL_WEIGHTS, RewardTransformer
from pipeline.engines.rows import left_pad
from pipeline.engines.tree import TreeVerification, commit_paths, verify_tree
from pipeline.engines.trigram import load_trigram


class HFSearchHost:
    """One HFEngine as every model-side method's host (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.eos_ids: set[int] = engine.eos_ids
        self.device = engine.device
        self.vocab_size = int(engine.model.config.vocab_size)
        self._state: dict[tuple, Any] = {}

    @property
    def drafter(self):
        """The engine's configured draft model (a Drafter), or None (DSBD then drafts with ADED)."""
        return self.engine.drafter

    def remember(self, key: tuple, make: Callable[[], Any]) -> Any:
        if key not in self._state:
            self._state[key] = make()
        return self._state[key]

    def load_trigram(self, path: str, top_t: int = 12):
        return load_trigram(path, top_t)

    def decode(self, token_lists: list[list[int]]) -> list[str]:
        return self.engine.tokenizer.batch_decode(token_lists, skip_special_tokens=True)

    def tree_target(self) -> TreeTarget:
        return TreeTarget(self.engine.model, self.device, self.engine.pad_id)

    def forest_target(self) -> TreeSession:
        return TreeSession(self.engine.model, self.device)

    def node_expander(self) -> PathCacheExpander:
        return PathCacheExpander(self.engine.model, self.device)

    def self_rewarding_lm(self) -> SelfRewardDecoder:
        """ValueError when the model has no trained reward channel."""
        return SelfRewardDecoder(self.engine)


class TreeTarget:
    """A batch of decoding rows verified tree by tree: the target side of ADED (and any drafter that
    returns a TokenTree per row). Thin state around pipeline.engines.tree (verify_tree, commit_paths).

        target = TreeTarget(model, device)
        logits = target.open(prompts, num_samples)   # [R, V]: prefill once per prompt, fan out to rows
        logits = target.verify(trees)                # [R, N, V]: one forward pass over every row's tree
        target.commit(sources)                       # keep (row, path) per surviving row

    Rows are indexed by their position in the current batch; commit may drop rows (finished ones).
    """

    def __init__(self, model, device: str | torch.device = "cpu", pad_id: int = 0):
        self.model = model
        self.device = torch.device(device)
        self.pad_id = pad_id
        self.cache: DynamicCache | None = None
        self.attention_mask: torch.Tensor | None = None  # [R, L]
        self.next_position: torch.Tensor | None = None  # [R]
        self._last: TreeVerification | None = None
        self.forward_passes = 0

    @torch.inference_mode()
    def open(self, prompts: list[list[int]], num_samples: int) -> torch.Tensor:
        """Prefill the left-padded prompts once, then repeat each for its num_samples rows. [R, V]."""
        ids, mask, position_ids = left_pad(prompts, self.pad_id, self.device)
        self.cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.forward_passes += 1
        self.cache.batch_repeat_interleave(num_samples)
        self.attention_mask = mask.repeat_interleave(num_samples, 0)
        self.next_position = mask.sum(-1).repeat_interleave(num_samples, 0)
        return out.logits[:, -1].repeat_interleave(num_samples, 0)  # [R, V]

    def verify(self, trees: list[TokenTree]) -> torch.Tensor:
        """Next-token logits after every node of every row's tree, one forward pass: [R, N, V]."""
        self._last = verify_tree(self.model, self.cache, self.attention_mask, self.next_position, trees)
        self.forward_passes += 1
        return self._last.logits

    def commit(self, sources: list[tuple[int, list[int]]]) -> None:
        """Cut the cache to the accepted path of each surviving row (rows not listed are dropped)."""
        if not sources:
            self.cache = None
            return
        self.attention_mask, self.next_position = commit_paths(self.cache, self._last, sources)

    def select(self, keep: list[int]) -> None:
        """Keep batch positions ``keep`` (between verifications, e.g. rows that ended at the first token)."""
        if not keep:
            self.cache = None
            return
        index = torch.tensor(keep, device=self.device)
        self.cache.batch_select_indices(index)
        self.attention_mask = self.attention_mask[index]
        self.next_position = self.next_position[index]


class TreeSession:
    """One growing batch of rows over a causal LM for tree-verifying decoders (DSBD, speculative
    decoding, beam sampling): each row's cache holds its sequence except the last token, which the
    caller passes as the root of the row's next tree (pipeline.decoding.dsbd.ForestTarget)."""

    def __init__(self, model, device: str | torch.device = "cpu"):
        self.model = model
        self.device = torch.device(device)
        self.forward_passes = 0
        self._verification: TreeVerification | None = None

    @torch.inference_mode()
    def open(self, prompt: list[int]) -> None:
        self.cache = DynamicCache(config=self.model.config)
        context = torch.tensor([prompt[:-1]], dtype=torch.long, device=self.device)  # [1, L]
        self.attention_mask = torch.ones_like(context)
        self.next_position = torch.tensor([context.shape[1]], device=self.device)
        if context.shape[1]:
            self.model(input_ids=context, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
            self.forward_passes += 1

    def verify(self, trees: list[TokenTree]) -> torch.Tensor:
        """Log-probs [B, N, V] (float32) after every node of every row's tree, from one forward pass."""
        self._verification = verify_tree(self.model, self.cache, self.attention_mask, self.next_position, trees)
        self.forward_passes += 1
        return self._verification.logits.float().log_softmax(-1)

    def commit(self, sources: list[tuple[int, list[int]]]) -> None:
        if self._verification is None:
            raise ValueError("commit needs a verify first")
        self.attention_mask, self.next_position = commit_paths(self.cache, self._verification, sources)
        self._verification = None


@dataclass
class TreeBatch:
    """Rows of a search tree batch: KV cache, mask and positions, and what the last fed token gave."""

    cache: DynamicCache
    attention_mask: torch.Tensor  # [B, L] 1 = real token, 0 = left padding
    next_position: torch.Tensor  # [B]
    logits: torch.Tensor  # [B, V] next-token logits
    rewards: torch.Tensor  # [B] R' of each row's sequence so far


class SelfRewardDecoder:
    """The SelfRewardingLM protocol of pipeline.decoding.sla over an HFEngine whose model is a
    trained RewardTransformer: one forward pass gives each row's next-token logits and its reward."""

    def __init__(self, engine):
        model = engine.model
        if not isinstance(model, RewardTransformer) or not model.channel_config.trained:
            raise ValueError("strategy 'sla' needs a generator with a trained reward channel "
                             f"({CHANNEL_WEIGHTS}); train one with python -m jobs.train_reward_transformer")
        self.engine = engine
        self.model = model
        self.eos_ids = engine.eos_ids
        self.device = engine.device
        self.forward_passes = 0

    def _forward(self, batch: TreeBatch, input_ids: torch.Tensor, position_ids: torch.Tensor) -> None:
        out = self.model(input_ids=input_ids, attention_mask=batch.attention_mask, position_ids=position_ids,
                         past_key_values=batch.cache, use_cache=True, logits_to_keep=1, with_rewards=True)
        self.forward_passes += 1
        self.engine.forward_passes += 1
        batch.logits = out.logits[:, -1, :].float()  # [B, V]
        batch.rewards = out.rewards[:, -1].float()  # [B]

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> TreeBatch:
        input_ids, mask, position_ids = left_pad(prompts, self.engine.pad_id, self.device)
        batch = TreeBatch(DynamicCache(config=self.model.config), mask, mask.sum(-1), None, None)
        self._forward(batch, input_ids, position_ids)
        return batch

    @torch.inference_mode()
    def feed(self, batch: TreeBatch, tokens: torch.Tensor) -> None:
        ones = torch.ones((len(tokens), 1), dtype=batch.attention_mask.dtype, device=self.device)
        batch.attention_mask = torch.cat([batch.attention_mask, ones], dim=1)  # [B, L + 1]
        self._forward(batch, tokens.to(self.device)[:, None], batch.next_position[:, None])
        batch.next_position = batch.next_position + 1
        self.engine.generated_tokens += len(tokens)

    def select(self, batch: TreeBatch, index: list[int]) -> None:
        """Keep, drop, reorder or repeat rows (repeats fan a node out into its children)."""
        if not index:
            batch.cache = DynamicCache()
            batch.attention_mask = batch.attention_mask[:0]
            batch.next_position, batch.logits, batch.rewards = (t[:0] for t in (batch.next_position, batch.logits,
                                                                                 batch.rewards))
            return
        idx = torch.tensor(index, device=self.device)
        batch.cache.batch_select_indices(idx)
        batch.attention_mask = batch.attention_mask[idx]
        batch.next_position = batch.next_position[idx]
        batch.logits = batch.logits[idx]
        batch.rewards = batch.rewards[idx]

    def decode(self, token_lists: list[list[int]]) -> list[str]:
        return self.engine.tokenizer.batch_decode(token_lists, skip_special_tokens=True)


class PathCacheExpander:
    """KV reuse along the paths of a search tree (used by ULTS and its beam-search baseline).

    Every expanded node keeps the key/value entries of its own token, one per layer; the prompt (the
    root) keeps the prompt's. To expand a batch of nodes at different depths of different trees, each
    row's cache is the prompt's entries followed by those of the nodes on its path, left-padded to a
    common length, and the forward pass feeds one token per row: the node's own. So an expansion costs
    one token of compute however deep the node is, instead of re-running the prefix (the ULTS authors'
    code does), and many nodes share one forward pass.

        expander = PathCacheExpander(model, device)
        logprobs = expander.roots(prompts)                      # [P, V] after each prompt
        logprobs = expander.expand([(tree, node, parent, tok)])  # [B, V] after each node's path

    Entries are stored unpadded and per node, so memory is one token's KV per expanded node.
    Implements pipeline.decoding.ults.NodeExpander.
    """

    def __init__(self, model, device: str | torch.device = "cpu"):
        self.model = model
        self.device = torch.device(device)
        self.entries: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        """(tree, node) -> per layer (keys [kv_heads, n, head_dim], values): n = prompt length at the root, else 1."""
        self.parent: dict[tuple[int, int], int] = {}
        self.forward_passes = 0

    @torch.inference_mode()
    def roots(self, prompts: list[list[int]]) -> torch.Tensor:
        """Prefill each prompt alone (no padding in the stored entries); [P, V] log-probabilities."""
        rows = []
        for tree, prompt in enumerate(prompts):
            ids = torch.tensor([prompt], device=self.device)
            cache = DynamicCache(config=self.model.config)
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            self.forward_passes += 1
            self.entries[(tree, 0)] = [(layer.keys[0], layer.values[0]) for layer in cache.layers]
            self.parent[(tree, 0)] = -1
            rows.append(out.logits[0, -1].float().log_softmax(-1))
        return torch.stack(rows)

    def _path(self, tree: int, node: int) -> list[int]:
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parent[(tree, node)]
        return nodes[::-1]  # root first

    @torch.inference_mode()
    def expand(self, items: list[tuple[int, int, int, int]]) -> torch.Tensor:
        """items: (tree, node, parent, token); the parent must be expanded already."""
        paths = []
        for tree, node, parent, _ in items:
            self.parent[(tree, node)] = parent
            paths.append(self._path(tree, parent))
        per_row = [[self.entries[(tree, n)] for n in path] for (tree, *_), path in zip(items, paths)]
        lengths = [sum(e[0][0].shape[1] for e in entries) for entries in per_row]
        width = max(lengths)
        layers = len(per_row[0][0])
        cache_data = []
        for layer in range(layers):
            keys, values = [], []
            for entries, length in zip(per_row, lengths):
                k = torch.cat([e[layer][0] for e in entries], dim=1)  # [kv_heads, length, head_dim]
                v = torch.cat([e[layer][1] for e in entries], dim=1)
                pad = width - length  # left padding, hidden by the attention mask
                keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
                values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
            cache_data.append((torch.stack(keys), torch.stack(values)))  # [B, kv_heads, width, head_dim]
        cache = DynamicCache(ddp_cache_data=cache_data, config=self.model.config)
        mask = torch.zeros((len(items), width + 1), dtype=torch.long, device=self.device)
        for i, length in enumerate(lengths):
            mask[i, width - length:] = 1
        tokens = torch.tensor([[tok] for *_, tok in items], device=self.device)  # [B, 1]
        positions = torch.tensor([[length] for length in lengths], device=self.device)  # [B, 1]
        out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True)
        self.forward_passes += 1
        for i, (tree, node, _, _) in enumerate(items):
            self.entries[(tree, node)] = [(layer.keys[i, :, -1:].clone(), layer.values[i, :, -1:].clone())
                                          for layer in cache.layers]
        return out.logits[:, -1].float().log_softmax(-1)  # [B, V]

    def release(self, tree: int) -> None:
        for key in [k for k in self.entries if k[0] == tree]:
            del self.entries[key]
        for key in [k for k in self.parent if k[0] == tree]:
            del self.parent[key]
