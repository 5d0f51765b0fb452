"""Bradley-Terry training of the Reward Transformer's reward channel on the build's pairs, and
the token-level reward metrics of the SLA paper ("Streaming Looking Ahead with Token-level
Self-reward", section 4.3 and 5.3).

Loss (Eq. 17): for a pair (tau^w, tau^l) of responses to one prompt,

    L = -log sigmoid( mean_t R'(tau^w_<=t) - mean_t R'(tau^l_<=t) )

where R'(tau_<=t) is the channel's reward after response token t (prompt tokens excluded) and
the means run over the T_w and T_l response tokens. The policy is frozen by default (setting 1 of
the paper: only the channel learns); setting 2 first runs DPO on the policy with the same pairs
(pipeline.training.dpo) and then trains the channel on the updated policy. Adam with a cosine
schedule, as in section 5 (the paper: 3 epochs at 5e-5).

With ``objective="tcrm"`` the loss is TCRM's instead (tcrm_loss): Bradley-Terry on the last
token's R', and every earlier R' regressed on the last one's (Monte Carlo) and on the next
token's (temporal difference), so the channel's reward after a prefix estimates the final reward.

Metrics on a held-out split:
- pairwise accuracy: the fraction of pairs whose chosen response gets the higher sequence score
  (the mean token reward of Eq. 17);
- AuTRC (section 5.3): at each fraction f of the trajectory (f = 1/20 .. 1), the agreement of
  the token-level rewards with the final label, i.e. the fraction of pairs whose chosen prefix
  (the first ceil(f T_w) tokens) gets a higher R' than the rejected prefix at the same fraction;
  AuTRC is the area under that curve over f in [0, 1] (the mean over the grid).
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from pipeline.errors import InputError
from pipeline.engines.reward_transformer import RewardTransformer

log = logging.getLogger(__name__)

AUTRC_POINTS = 20


@dataclass
class EncodedPair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def encode_pairs(pairs, tokenizer, max_length: int = 512) -> list[EncodedPair]:
    """Token ids of each pair: the build's own ids (prompt_token_ids, chosen_token_ids,
    rejected_token_ids: what the generator conditioned on and sampled, so exactly what SLA scores)
    when the pairs have them; otherwise the text, tokenized (``prompt`` is the text the generator
    saw, chat template already applied, so without adding special tokens again). Responses are cut
    to fit ``max_length`` with their prompt; a pair with an empty response is skipped."""
    add_special = not bool(getattr(tokenizer, "chat_template", None))
    out = []
    for row in pairs:
        chosen_text, rejected_text = _text(row["chosen"]), _text(row["rejected"])
        if _own_ids(row, tokenizer, chosen_text, rejected_text):
            prompt, chosen, rejected = row["prompt_token_ids"], row["chosen_token_ids"], row["rejected_token_ids"]
        else:
            prompt_text = row["prompt"]
            if not isinstance(prompt_text, str):  # TRL's conversational format
                prompt_text = tokenizer.apply_chat_template(prompt_text, tokenize=False, add_generation_prompt=True)
            prompt = tokenizer(prompt_text, add_special_tokens=add_special).input_ids
            chosen = tokenizer(chosen_text, add_special_tokens=False).input_ids
            rejected = tokenizer(rejected_text, add_special_tokens=False).input_ids
        prompt = list(prompt)[-(max_length // 2):]
        budget = max_length - len(prompt)
        chosen, rejected = list(chosen)[:budget], list(rejected)[:budget]
        if chosen and rejected:
            out.append(EncodedPair(prompt, chosen, rejected))
    return out


def _text(response) -> str:
    """A response in TRL's standard (a string) or conversational ([{"role": "assistant", ...}]) format."""
    return response if isinstance(response, str) else "".join(m["content"] for m in response)


def _own_ids(row: dict, tokenizer, chosen_text: str, rejected_text: str) -> bool:
    """The row carries the build's token ids, and they are this tokenizer's (they decode to the
    texts): pairs built with another generator's tokenizer are tokenized from their text instead."""
    ids = [row.get(c) for c in ("prompt_token_ids", "chosen_token_ids", "rejected_token_ids")]
    if any(i is None for i in ids):
        return False
    decode = tokenizer.batch_decode([ids[1], ids[2]], skip_special_tokens=True)
    return decode == [chosen_text, rejected_text]


def _batch(pairs: list[EncodedPair], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """Chosen rows then rejected rows, right-padded: (input_ids [2B, T], mask [2B, T], response spans)."""
    seqs = [p.prompt + p.chosen for p in pairs] + [p.prompt + p.rejected for p in pairs]
    spans = [(len(p.prompt), len(p.prompt) + len(p.chosen)) for p in pairs] + \
            [(len(p.prompt), len(p.prompt) + len(p.rejected)) for p in pairs]
    ids, mask = _right_padded(seqs, pad_id)
    return ids.to(device), mask.to(device), spans


def _right_padded(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, T], attention mask [B, T]) of token lists, padded on the right."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask


def response_rewards(model: RewardTransformer, pairs: list[EncodedPair], pad_id: int, train_policy: bool = False
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """R' after every response token: one [T_w] tensor per chosen, one [T_l] per rejected response."""
    device = next(model.parameters()).device
    ids, mask, spans = _batch(pairs, pad_id, device)
    rewards = model.token_rewards(ids, mask, train_policy=train_policy).float()  # [2B, T]
    # R'(tau_<=t) is read at token t itself: the hidden state there has seen the prefix through t.
    per_row = [rewards[i, start:end] for i, (start, end) in enumerate(spans)]
    return per_row[:len(pairs)], per_row[len(pairs):]


def bradley_terry_loss(chosen: list[torch.Tensor], rejected: list[torch.Tensor]) -> torch.Tensor:
    """Eq. 17 over a batch: -mean log sigmoid(mean R'(chosen) - mean R'(rejected))."""
    margin = torch.stack([c.mean() for c in chosen]) - torch.stack([r.mean() for r in rejected])  # [B]
    return -F.logsigmoid(margin).mean()


OBJECTIVES = ("sla", "tcrm")
"""The channel's training objectives: "sla", Eq. 17 (bradley_terry_loss); "tcrm", tcrm_loss."""


def tcrm_loss(chosen: list[torch.Tensor], rejected: list[torch.Tensor], mc_weight: float = 1.0,
              td_weight: float = 1.0) -> torch.Tensor:
    """TCRM ("Reward Models Are Secretly Value Functions: Temporally Coherent Reward Modeling",
    Nikulkov 2026, arXiv 2604.22981) on the channel: Bradley-Terry on the last token's R', plus

        mc_weight * mean_t (R'_t - sg R'_T)^2 + td_weight * mean_t (R'_t - sg R'_t+1)^2

    over every response token t < T of both responses (sg: stop-gradient), so that R' after any
    prefix estimates the final reward: what speculative rejection's cut at tau reads."""
    margin = torch.stack([c[-1] for c in chosen]) - torch.stack([r[-1] for r in rejected])
    rows = [row for row in chosen + rejected if len(row) > 1]
    loss = -F.logsigmoid(margin).mean()
    if rows and mc_weight:
        loss = loss + mc_weight * torch.cat([(row[:-1] - row[-1].detach()).pow(2) for row in rows]).mean()
    if rows and td_weight:
        loss = loss + td_weight * torch.cat([(row[:-1] - row[1:].detach()).pow(2) for row in rows]).mean()
    return loss


def channel_loss(chosen: list[torch.Tensor], rejected: list[torch.Tensor], objective: str = "sla",
                 mc_weight: float = 1.0, td_weight: float = 1.0) -> torch.Tensor:
    """The training loss of ``objective`` (OBJECTIVES)."""
    if objective == "tcrm":
        return tcrm_loss(chosen, rejected, mc_weight, td_weight)
    if objective == "sla":
        return bradley_terry_loss(chosen, rejected)
    raise InputError(f"objective: unknown reward channel objective {objective!r}; choose from {', '.join(OBJECTIVES)}")


@torch.no_grad()
def evaluate_channel(model: RewardTransformer, pairs: list[EncodedPair], pad_id: int, batch_size: int = 8,
                     points: int = AUTRC_POINTS) -> dict:
    """Held-out pairwise accuracy, AuTRC and its curve (see the module docstring)."""
    model.eval()
    fractions = [(i + 1) / points for i in range(points)]
    agree = [0] * points
    correct, loss_sum = 0, 0.0
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        chosen, rejected = response_rewards(model, chunk, pad_id)
        loss_sum += float(bradley_terry_loss(chosen, rejected)) * len(chunk)
        for c, r in zip(chosen, rejected):
            correct += int(c.mean() > r.mean())
            for j, f in enumerate(fractions):
                agree[j] += int(c[math.ceil(f * len(c)) - 1] > r[math.ceil(f * len(r)) - 1])
    n = max(len(pairs), 1)
    curve = [a / n for a in agree]
    return {"eval_pairs": len(pairs), "eval_loss": loss_sum / n, "pairwise_accuracy": correct / n,
            "autrc": sum(curve) / points, "autrc_curve": curve, "autrc_fractions": fractions}


@torch.no_grad()
def channel_scores(model: RewardTransformer, responses: list[tuple[list[int], list[int]]], taus: list[int],
                   pad_id: int, batch_size: int = 16) -> tuple[list[float], dict[int, dict[int, float]]]:
    """The channel as a reward of (prompt ids, response ids) pairs, what a decoding pass reads:
    the final reward R' at each response's last token, and tau -> {index: R' after the response's
    first tau tokens} for every response longer than tau (pipeline.training.reward_evaluation's
    partial_rewards shape, so the same figures apply)."""
    model.eval()
    device = next(model.parameters()).device
    final: list[float] = []
    partial: dict[int, dict[int, float]] = {tau: {} for tau in taus}
    for start in range(0, len(responses), batch_size):
        chunk = responses[start:start + batch_size]
        ids, mask = _right_padded([p + r for p, r in chunk], pad_id)
        rewards = model.token_rewards(ids.to(device), mask.to(device)).float().cpu()  # [B, T]
        for i, (p, r) in enumerate(chunk):
            final.append(rewards[i, len(p) + len(r) - 1].item())
            for tau in taus:
                if len(r) > tau:
                    partial[tau][start + i] = rewards[i, len(p) + tau - 1].item()
    return final, partial


def judged_pair_rows(data: Path, split: str, tokenizer) -> list[dict]:
    """The judge's preference pairs of ``split``'s samples (preference_pairs, margin 0) as pair rows
    with the generator's own token ids, the columns pipeline.training.reward_channel.encode_pairs
    reads: prompt (the formatted text), chosen, rejected, prompt_token_ids, chosen_token_ids,
    rejected_token_ids."""
    from pipeline.training.cached_steps import prompt_token_ids
    from pipeline.training.judged_samples import preference_pairs, read_judged

    samples, fractions = read_judged(data, split)
    prompts = prompt_token_ids(data, split, tokenizer, {s.prompt_id for s in samples})
    rows = []
    for c, r in preference_pairs([s.prompt_id for s in samples], fractions, 0.0):
        ids = prompts[samples[c].prompt_id]
        rows.append({"prompt": tokenizer.decode(ids), "chosen": samples[c].text, "rejected": samples[r].text,
                     "prompt_token_ids": ids, "chosen_token_ids": samples[c].token_ids,
                     "rejected_token_ids": samples[r].token_ids})
    return rows


def split_pairs(pairs: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, held-out): a seeded shuffle; at least one item on each side when there are two."""
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    n_eval = min(len(pairs) - 1, max(1, round(eval_fraction * len(pairs)))) if eval_fraction > 0 else 0
    return [pairs[i] for i in order[n_eval:]], [pairs[i] for i in order[:n_eval]]


def train_reward_channel(model: RewardTransformer, train: list[EncodedPair], pad_id: int, *, epochs: int = 3,
                         batch_size: int = 8, learning_rate: float = 5e-5, max_steps: int | None = None,
                         train_policy: bool = False, seed: int = 0, progress: bool = True, objective: str = "sla",
                         mc_weight: float = 1.0, td_weight: float = 1.0) -> dict:
    """``objective``'s loss (channel_loss: Eq. 17 by default) with Adam and a cosine schedule;
    only the channel learns unless ``train_policy``.
    Returns train_loss (mean over the last epoch), first_loss and steps; marks the channel trained."""
    if not train:
        raise ValueError("no training pairs")
    channel_loss([torch.zeros(1)], [torch.zeros(1)], objective)  # an unknown objective fails before any step
    torch.manual_seed(seed)
    for p in model.policy.parameters():
        p.requires_grad_(train_policy)
    params = [p for p in model.parameters() if p.requires_grad]
    steps_per_epoch = math.ceil(len(train) / batch_size)
    total = steps_per_epoch * epochs if max_steps is None else min(max_steps, steps_per_epoch * epochs)
    optimizer = torch.optim.Adam(params, lr=learning_rate)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    rng = random.Random(seed)
    step, losses, first = 0, [], None
    bar = tqdm(total=total, desc=f"reward channel ({objective})", unit="step", disable=not progress)
    model.train()
    while step < total:
        order = list(range(len(train)))
        rng.shuffle(order)
        losses = []
        for start in range(0, len(order), batch_size):
            if step >= total:
                break
            chunk = [train[i] for i in order[start:start + batch_size]]
            chosen, rejected = response_rewards(model, chunk, pad_id, train_policy=train_policy)
            loss = channel_loss(chosen, rejected, objective, mc_weight, td_weight)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            first = losses[0] if first is None else first
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    bar.close()
    model.eval()
    model.channel.config.trained = True
    return {"train_loss": sum(losses) / len(losses), "first_loss": first, "steps": step, "train_pairs": len(train)}


def train_reward_transformer(pairs, model: str, output: str, *, dpo: bool = False, hidden_size: int = 256,
                             kind: str = "channel", epochs: int = 3, batch_size: int = 8, learning_rate: float = 5e-5,
                             max_steps: int | None = None, eval_fraction: float = 0.2, max_length: int = 512,
                             dpo_steps: int = 10, dpo_learning_rate: float = 5e-6, beta: float = 0.1, seed: int = 0,
                             device: str = "cpu", progress: bool = True, objective: str = "sla",
                             mc_weight: float = 1.0, td_weight: float = 1.0) -> dict:
    """The whole recipe: `pairs` (a Dataset with prompt/chosen/rejected) and a starting model (an
    HF causal LM or a Reward Transformer directory) in, a trained Reward Transformer directory at
    `output` out. With `dpo`, TRL's DPOTrainer first updates the policy on the training split
    (setting 2); the channel then learns on the updated, frozen policy. Returns the metrics, with
    pairs_dropped_empty: the pairs left out for an empty chosen or rejected response (a note says so)."""
    from pipeline.engines.hf import load_tokenizer

    tokenizer = load_tokenizer(model)
    usable = [i for i, row in enumerate(pairs) if row["chosen"] and row["rejected"]]
    if len(usable) < 2:
        raise InputError(f"need at least 2 pairs with non-empty chosen and rejected, got {len(usable)}")
    train_rows, held_rows = split_pairs(usable, eval_fraction, seed)
    train = encode_pairs(pairs.select(train_rows), tokenizer, max_length)
    held_out = encode_pairs(pairs.select(held_rows), tokenizer, max_length)
    # A response with no text (or no token) has nothing to score: such a pair is left out, and said.
    dropped = len(pairs) - len(train) - len(held_out)
    if dropped:
        log.info("note: %d of %d pairs left out: an empty chosen or rejected response (pairs_dropped_empty in "
                 "training_metrics.json)", dropped, len(pairs))
    metrics: dict = {"pairs_dropped_empty": dropped}
    policy_source = model
    if dpo:
        from pipeline.training.dpo import train_dpo

        # The same split: DPO never sees the held-out pairs the channel is scored on.
        dpo_metrics = train_dpo(pairs.select(train_rows), model, output, max_steps=dpo_steps, batch_size=batch_size,
                                learning_rate=dpo_learning_rate, beta=beta, max_length=max_length, seed=seed,
                                progress=progress)
        metrics.update({f"dpo_{k}": v for k, v in dpo_metrics.items()})
        policy_source = output
    rt = RewardTransformer.from_pretrained(policy_source, device=device, hidden_size=hidden_size, kind=kind)
    if dpo or rt.channel_config.kind != kind:
        # A DPO-updated policy gets a fresh channel: the old one read different hidden states.
        rt = RewardTransformer.wrap(rt.policy, hidden_size=hidden_size, kind=kind, seed=seed)
    metrics.update(train_reward_channel(rt, train, tokenizer.pad_token_id, epochs=epochs, batch_size=batch_size,
                                        learning_rate=learning_rate, max_steps=max_steps, seed=seed,
                                        progress=progress, objective=objective, mc_weight=mc_weight,
                                        td_weight=td_weight))
    metrics.update(evaluate_channel(rt, held_out, tokenizer.pad_token_id, batch_size))
    rt.save_pretrained(output, tokenizer)
    return metrics
