"""Rows of sequences over a causal LM that share one KV cache.

Every batch of rows in the engines starts here: prompts are left-padded so the last column is
every prompt's last token, the attention mask hides the padding, and position ids count real
tokens only, so a row's logits match an unpadded run.
"""

from __future__ import annotations

import torch


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
