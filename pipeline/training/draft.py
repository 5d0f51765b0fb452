"""A draft model for speculative decoding and DSBD, distilled from the generator on its own samples.

The draft is the generator cut to its first ``layers`` decoder layers: its embedding, those
layers, its final norm and its (tied) LM head are copied, so the draft shares the tokenizer and
the vocabulary by construction and starts from the generator's own early representations (the
self-speculative idea of Zhang et al. 2024, "Draft & Verify", and Elhoushi et al. 2024,
"LayerSkip", with the skipped layers at the end). The copied layers and the final norm are then
trained to match the generator's next-token distribution on the response tokens of the
generator's own samples: forward KL(p || q) with the generator's softmax as soft targets, on
on-policy data, which is DistillSpec's recipe (Zhou et al. 2024, "DistillSpec: Improving
Speculative Decoding via Knowledge Distillation", section 3: white-box KD on the target's
samples). The embedding and head stay frozen (they are tied: training them would move the
input embedding too), so a step costs the draft's layers and one head matmul per token.

Why this objective: with exact speculative sampling a draft token is accepted with probability
sum_x min(p(x), q(x)) = 1 - TV(p, q) (Leviathan et al. 2023, section 3.5), the figure
``evaluate_draft`` reports on held-out samples next to greedy (top-1) agreement.

The generator's final hidden states are computed once and kept (hidden-size floats per token);
each step rebuilds the teacher's logits from them with the head, so epochs after the first cost
only the draft.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F
from tqdm import tqdm


def truncated_copy(model, layers: int):
    """A new causal LM of the same class and config with only the first ``layers`` decoder layers,
    every shared weight copied from ``model`` (embedding, those layers, final norm, LM head)."""
    from transformers import AutoModelForCausalLM

    total = model.config.num_hidden_layers
    if not 1 <= layers < total:
        raise ValueError(f"draft layers must be in 1..{total - 1} (the generator has {total}), got {layers}")
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    draft = AutoModelForCausalLM.from_config(config)
    source = model.state_dict()
    state = {}
    for name, value in draft.state_dict().items():
        if name not in source:
            raise ValueError(f"draft weight {name} has no counterpart in the generator")
        state[name] = source[name].detach().clone()
    draft.load_state_dict(state)
    return draft.to(next(model.parameters()).device).eval()


def _batches(sequences: list[tuple[list[int], int]], batch_size: int, pad_id: int, device, order=None):
    """(sequence indices, input_ids, attention_mask, loss_mask) batches; loss_mask marks the positions whose next
    token is a response token (position t predicts token t + 1)."""
    order = list(range(len(sequences))) if order is None else order
    for start in range(0, len(order), batch_size):
        index = order[start:start + batch_size]
        chunk = [sequences[i] for i in index]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        loss = torch.zeros((len(chunk), width), dtype=torch.bool)
        for row, (tokens, response_start) in enumerate(chunk):
            ids[row, :len(tokens)] = torch.tensor(tokens)
            attention[row, :len(tokens)] = 1
            loss[row, response_start - 1:len(tokens) - 1] = True
        yield index, ids.to(device), attention.to(device), loss.to(device)


@torch.inference_mode()
def teacher_states(teacher, sequences: list[tuple[list[int], int]], pad_id: int, batch_size: int = 8,
                   progress: bool = False) -> list[torch.Tensor]:
    """The generator's final (normed) hidden state at every position whose next token is a
    response token: one [positions, hidden] tensor per sequence."""
    device = next(teacher.parameters()).device
    out: list[torch.Tensor | None] = [None] * len(sequences)
    bar = tqdm(total=len(sequences), desc="generator states", unit="seq", disable=not progress)
    for index, ids, attention, loss in _batches(sequences, batch_size, pad_id, device):
        hidden = teacher.base_model(input_ids=ids, attention_mask=attention).last_hidden_state
        for row, i in enumerate(index):
            out[i] = hidden[row][loss[row]].clone()
        bar.update(len(index))
    bar.close()
    return out


def _student_logits(draft, ids, attention, loss) -> torch.Tensor:
    hidden = draft.base_model(input_ids=ids, attention_mask=attention).last_hidden_state
    return draft.get_output_embeddings()(hidden[loss])  # [positions, V]


def distill(draft, teacher, train: list[tuple[list[int], int]], pad_id: int, *, epochs: int = 2,
            batch_size: int = 8, learning_rate: float = 3e-4, seed: int = 0, progress: bool = True) -> dict:
    """Forward-KL distillation of ``draft`` towards ``teacher`` on ``train`` ((token ids, index of
    the first response token) per sequence); AdamW with a cosine schedule over the draft's layers
    and final norm. Returns first/last-epoch mean losses and steps."""
    torch.manual_seed(seed)
    states = teacher_states(teacher, train, pad_id, batch_size, progress)
    head = teacher.get_output_embeddings()
    for p in draft.parameters():
        p.requires_grad_(False)
    params = [*draft.base_model.layers.parameters(), *draft.base_model.norm.parameters()]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
    total = epochs * math.ceil(len(train) / batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    rng = random.Random(seed)
    device = next(draft.parameters()).device
    draft.train()
    epoch_losses = []
    bar = tqdm(total=total, desc="distilling the draft (forward KL)", unit="step", disable=not progress)
    for _ in range(epochs):
        order = list(range(len(train)))
        rng.shuffle(order)
        losses = []
        for index, ids, attention, loss in _batches(train, batch_size, pad_id, device, order):
            with torch.no_grad():
                target = F.log_softmax(head(torch.cat([states[i] for i in index])).float(), dim=-1)
            logq = F.log_softmax(_student_logits(draft, ids, attention, loss).float(), dim=-1)
            kl = F.kl_div(logq, target, log_target=True, reduction="batchmean")
            optimizer.zero_grad()
            kl.backward()
            optimizer.step()
            schedule.step()
            losses.append(kl.item())
            bar.update(1)
            bar.set_postfix(kl=f"{losses[-1]:.3f}")
        epoch_losses.append(sum(losses) / len(losses))
    bar.close()
    draft.eval()
    for p in draft.parameters():
        p.requires_grad_(False)
    return {"steps": total, "epochs": epochs, "train_sequences": len(train),
            "train_tokens": sum(len(ids) - start for ids, start in train),
            "kl_first_epoch": round(epoch_losses[0], 4), "kl_last_epoch": round(epoch_losses[-1], 4)}


@torch.inference_mode()
def evaluate_draft(draft, teacher, sequences: list[tuple[list[int], int]], pad_id: int, batch_size: int = 8) -> dict:
    """On held-out sequences, per response position: the speculative-sampling acceptance
    probability sum_x min(p(x), q(x)) at temperature 1, greedy agreement (argmax q = argmax p),
    and KL(p || q); means over positions."""
    device = next(draft.parameters()).device
    accept = agree = kl = 0.0
    positions = 0
    for _, ids, attention, loss in _batches(sequences, batch_size, pad_id, device):
        logp = F.log_softmax(teacher(input_ids=ids, attention_mask=attention).logits[loss].float(), dim=-1)
        logq = F.log_softmax(_student_logits(draft, ids, attention, loss).float(), dim=-1)
        accept += float(torch.minimum(logp.exp(), logq.exp()).sum())
        agree += float((logp.argmax(-1) == logq.argmax(-1)).sum())
        kl += float(F.kl_div(logq, logp, log_target=True, reduction="sum"))
        positions += logp.shape[0]
    n = max(positions, 1)
    return {"positions": positions, "acceptance": round(accept / n, 4), "greedy_agreement": round(agree / n, 4),
            "kl": round(kl / n, 4)}
