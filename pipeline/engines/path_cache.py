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

from __future__ import annotations

import torch
from transformers import DynamicCache


class PathCacheExpander:
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
