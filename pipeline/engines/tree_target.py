"""A batch of decoding rows verified tree by tree: the target side of ADED (and any drafter that
returns a TokenTree per row). Thin state around pipeline.engines.tree (verify_tree, commit_paths).

    target = TreeTarget(model, device)
    logits = target.open(prompts, num_samples)   # [R, V]: prefill once per prompt, fan out to rows
    logits = target.verify(trees)                # [R, N, V]: one forward pass over every row's tree
    target.commit(sources)                       # keep (row, path) per surviving row

Rows are indexed by their position in the current batch; commit may drop rows (finished ones).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from pipeline.engines.hf import left_pad
from pipeline.engines.tree import TokenTree, TreeVerification, commit_paths, verify_tree


class TreeTarget:
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
