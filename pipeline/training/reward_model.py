"""A Bradley-Terry reward model fine-tuned from the policy's own network, on pairs of responses the
policy itself sampled, labelled by the judge (IFEval's checkers, pipeline.judge).

Model: LlamaForSequenceClassification initialised from the policy, its bottom L - K decoder layers
frozen, its top K layers with LoRA factors and its score head trained (pipeline.training.lora). The
reward of prompt x and response y is read at the last token of the chat-formatted conversation,
as LlamaForSequenceClassification pools and pipeline.engines.rewards.RewardScorer reads it. The
data: the policy's samples and the judge's verdicts (pipeline.training.judged_samples).

Loss (Bradley-Terry, as in Ouyang et al., 2022, eq. 1): for a pair (y_w, y_l) of one prompt's
responses whose judge fractions differ (y_w follows more of the prompt's instructions),

    L = -log sigmoid(r(x, y_w) - r(x, y_l))
        + prefix_weight * mean_tau -log sigmoid(r(x, y_w[:tau]) - r(x, y_l[:tau]))

where y[:tau] is the response's first tau tokens (a response of at most tau tokens is its final
text) and the prefix pairs keep the final judgement: partial rewards are trained to rank as the
final ones will, which is what speculative rejection needs of them ("Accelerating Best-of-N via
Speculative Rejection", section 4: rank at the decision token tau by the partial reward). An
optional third term (``distill_weight``, rank_distillation_loss) teaches every two cut responses
to rank as the model's own final rewards rank them, judge tie or not.
TCRM's two regularizers (``mc_weight``, ``td_weight``; value_consistency_loss) regress every
cut's score on the final score and on the next cut's, so that a partial reward estimates the
final reward to come rather than only its order.

Cost on CPU: the frozen bottom layers run once per training text (``bottom_states``), and only the
top K layers run per epoch. Every text of a prompt (its final responses and their prefixes,
each with the chat template's tail after it) starts with the same tokens: the template head and
the prompt. That shared head runs once, its KV cache is expanded to the texts, and only each
text's own tokens run after it, in the bottom pass and in every training pass alike. A prefix
text is a text of its own: the template's tail after a cut response is not in the full text, so
its states at the tail cannot be read off the full text's; the bottom pass keeps the full text's
cache up to the cut and runs the tail (and any token the re-encoded cut changed) after it.

Evaluation on prompts the model never saw: pipeline.training.reward_evaluation.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pipeline.engines.rewards import common_prefix
from pipeline.training.judged_samples import Sample, preference_pairs
from pipeline.training.lora import SplitRewardModel
from pipeline.training.reward_evaluation import pairwise_agreement, partial_final_correlations, rounded

log = logging.getLogger(__name__)


def fit_head(features: torch.Tensor, pairs: list[tuple[int, int]], l2: float, steps: int = 200) -> torch.Tensor:
    """The Bradley-Terry linear head w ([H], in raw feature space) for features [N, H] and pairs:
    full-batch L-BFGS on standardized features (deterministic), l2 penalty on w; the training
    below starts its score head from it (a linear probe first, then fine-tuning)."""
    if not pairs:
        raise ValueError("no preference pairs to train on: every response scored the same")
    x = features.double()
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    z = (x - mean) / std  # [N, H]
    chosen, rejected = torch.tensor([c for c, _ in pairs]), torch.tensor([r for _, r in pairs])
    diff = z[chosen] - z[rejected]  # [P, H]
    w = torch.zeros(z.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=steps, history_size=20, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-9, tolerance_change=1e-12)

    def closure():
        opt.zero_grad()
        loss = F.softplus(-(diff @ w)).mean() + l2 * (w @ w)
        loss.backward()
        return loss

    opt.step(closure)
    return (w.detach() / std).float()


# -- training texts and the bottom layers' states -----------------------------------------------

@dataclass
class RewardText:
    """One text the reward model reads: a sample's response, whole (tau 0) or cut at tau tokens."""

    sample: int
    tau: int
    token_ids: list[int]
    """The reward model's tokens for it (RewardScorer.encode)."""


@dataclass
class PromptTexts:
    """The texts of one prompt's samples, sharing ``head`` (their common first tokens)."""

    prompt_id: str
    head: list[int]
    texts: list[RewardText]
    head_states: torch.Tensor | None = None
    """[len(head), H]: the bottom layers' output on the head (bottom_states)."""
    states: list[torch.Tensor] = field(default_factory=list)
    """Per text: [len(token_ids) - len(head), H], the bottom layers' output on its own tokens."""


def reward_token_ids(tokenizer, prompt: str | list[dict], response: str) -> list[int]:
    """RewardScorer.encode without a model: the conversation through the chat template, contents
    encoded as plain text (pipeline.data.chat.encode_chat); without a template, the text with
    the tokenizer's special tokens."""
    from pipeline.data.chat import encode_chat, encode_text

    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if tokenizer.chat_template:
        return encode_chat(tokenizer, turns + [{"role": "assistant", "content": response}],
                           add_generation_prompt=False)[1]
    text = prompt + response if isinstance(prompt, str) else "\n\n".join(m["content"] for m in turns) + "\n\n" + response
    return encode_text(tokenizer, text, add_special_tokens=True)


def prefix_text(tokenizer, sample: Sample, tau: int) -> str:
    """The response's first tau tokens as text, decoded as pipeline.training.reward_evaluation.partial_rewards
    and the engines decode a partial response."""
    return tokenizer.decode(sample.token_ids[:tau], skip_special_tokens=True)


def reward_texts(tokenizer, samples: list[Sample], taus: list[int]) -> list[PromptTexts]:
    """Per prompt (in order of first appearance): every sample's final text and, for each tau
    below its length, its prefix text; ``head`` is the texts' common first tokens, leaving every
    text at least one token of its own."""
    groups: dict[str, PromptTexts] = {}
    for i, s in enumerate(samples):
        group = groups.setdefault(s.prompt_id, PromptTexts(s.prompt_id, [], []))
        group.texts.append(RewardText(i, 0, reward_token_ids(tokenizer, s.prompt, s.text)))
        for tau in taus:
            if len(s.token_ids) > tau:
                group.texts.append(RewardText(i, tau, reward_token_ids(tokenizer, s.prompt, prefix_text(tokenizer, s, tau))))
    for group in groups.values():
        head = group.texts[0].token_ids[:-1]
        for t in group.texts[1:]:
            head = head[:min(common_prefix(head, t.token_ids), len(t.token_ids) - 1)]
        group.head = head
    return list(groups.values())


def _kinds(group: PromptTexts) -> list[list[int]]:
    """Text indices of a group by tau: texts of one kind have similar lengths, so a batch per kind
    pads little."""
    kinds: dict[int, list[int]] = {}
    for k, t in enumerate(group.texts):
        kinds.setdefault(t.tau, []).append(k)
    return list(kinds.values())


def _padded(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    ids = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)  # [B, S], right-padded
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
    return ids


def _run_after_head(part, head_cache, inputs: torch.Tensor, lengths: list[int], head_len: int):
    """``part`` (a LlamaModel) on right-padded ``inputs`` ([B, S] ids or [B, S, H] states) after a
    head of ``head_len`` positions whose KV cache (one row) is expanded to the B rows: its output
    (``last_hidden_state`` [B, S, H], ``cache``)."""
    from transformers import DynamicCache

    rows = len(lengths)
    cache = DynamicCache([(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in head_cache])
    mask = torch.zeros(rows, head_len + inputs.shape[1], dtype=torch.long)
    for r, n in enumerate(lengths):
        mask[r, :head_len + n] = 1
    key = "input_ids" if inputs.dim() == 2 else "inputs_embeds"
    return part(**{key: inputs}, attention_mask=mask, cache=cache, use_cache=True)


def _head_pass(part, inputs: torch.Tensor):
    """``part`` on one head ([1, n] ids or [1, n, H] states): (states [1, n, H], its KV per layer)."""
    key = "input_ids" if inputs.dim() == 2 else "inputs_embeds"
    out = part(**{key: inputs}, use_cache=True)
    return out.last_hidden_state, [(layer.keys, layer.values) for layer in out.cache.layers]


@torch.inference_mode()
def bottom_states(model: SplitRewardModel, groups: list[PromptTexts], pad_id: int, progress=None) -> None:
    """Fills each group's ``head_states`` and ``states``. The frozen bottom layers run once on the
    head, then on the final texts after it (one batch, the head's cache expanded); a cut text
    shares its first tokens with its sample's final text (all of them but the template's tail,
    unless decoding and re-encoding the cut moved a token boundary), so it keeps the final text's
    cache and states up to the tokens they share (the other cached positions masked out, as
    pipeline.engines.rows.RowBatch.truncate does) and runs only its remaining tokens, at their
    true positions. With no frozen layer (``top_layers`` all of them: a full fine-tune), the states
    are the token embeddings."""
    from transformers import DynamicCache

    if not len(model.bottom.layers):  # every layer trains (a full fine-tune): the states are the embeddings
        for group in groups:
            group.head_states = model.bottom.embed_tokens(torch.tensor(group.head))
            group.states = [model.bottom.embed_tokens(torch.tensor(t.token_ids[len(group.head):])) for t in group.texts]
            if progress is not None:
                progress.update(1)
        return
    for group in groups:
        head = len(group.head)
        head_out, head_cache = _head_pass(model.bottom, torch.tensor([group.head]))
        group.head_states = head_out[0].clone()
        group.states = [None] * len(group.texts)
        finals = [k for k, t in enumerate(group.texts) if t.tau == 0]
        tails = [group.texts[k].token_ids[head:] for k in finals]
        out = _run_after_head(model.bottom, head_cache, _padded(tails, pad_id), list(map(len, tails)), head)
        for r, k in enumerate(finals):
            group.states[k] = out.last_hidden_state[r, :len(tails[r])].clone()
        final_kv = [(layer.keys, layer.values) for layer in out.cache.layers]  # each [F, heads, C, D]
        row_of = {group.texts[k].sample: r for r, k in enumerate(finals)}
        for kind in _kinds(group):
            if group.texts[kind[0]].tau == 0:
                continue
            rows = [row_of[group.texts[k].sample] for k in kind]
            ids = [group.texts[k].token_ids for k in kind]
            keep = [min(common_prefix(i, group.texts[finals[r]].token_ids), len(i) - 1) for i, r in zip(ids, rows)]
            rest = [i[n:] for i, n in zip(ids, keep)]
            cached = final_kv[0][0].shape[2]
            width = max(map(len, rest))
            mask = torch.zeros(len(kind), cached + width, dtype=torch.long)
            for r, (n, tail) in enumerate(zip(keep, rest)):
                mask[r, :n] = 1
                mask[r, cached:cached + len(tail)] = 1
            positions = torch.tensor(keep)[:, None] + torch.arange(width)  # [B, S]
            cache = DynamicCache([(k[rows], v[rows]) for k, v in final_kv])
            new = model.bottom(input_ids=_padded(rest, pad_id), attention_mask=mask, position_ids=positions,
                               cache=cache, use_cache=True).last_hidden_state
            for r, k in enumerate(kind):
                shared = group.states[finals[rows[r]]][:keep[r] - head]
                group.states[k] = torch.cat([shared, new[r, :len(rest[r])]])
        if progress is not None:
            progress.update(1)


def top_features(model: SplitRewardModel, group: PromptTexts, texts: list[int] | None = None) -> torch.Tensor:
    """The top layers' final state at the last token of each of the group's texts (all, or the
    indices ``texts``) from their bottom states: [len(texts), H], what the score head reads."""
    wanted = set(range(len(group.texts)) if texts is None else texts)
    head_out, head_cache = _head_pass(model.top, group.head_states[None])
    last = {}
    for kind in _kinds(group):
        kind = [k for k in kind if k in wanted]
        if not kind:
            continue
        states = [group.states[k] for k in kind]
        lengths = [len(s) for s in states]
        batch = torch.zeros(len(kind), max(lengths), states[0].shape[-1])
        for r, s in enumerate(states):
            batch[r, :len(s)] = s
        out = _run_after_head(model.top, head_cache, batch, lengths, len(group.head)).last_hidden_state  # [B, S, H]
        for r, k in enumerate(kind):
            last[k] = out[r, lengths[r] - 1]
    return torch.stack([last[k] for k in (range(len(group.texts)) if texts is None else texts)])


def top_scores(model: SplitRewardModel, group: PromptTexts) -> torch.Tensor:
    """The reward of each of the group's texts from its bottom states: [len(texts)] (differentiable
    in the LoRA factors and the head)."""
    return model.score(top_features(model, group))[:, 0]


# -- Bradley-Terry training ----------------------------------------------------------------------

@dataclass
class TrainingSettings:
    epochs: int = 3
    learning_rate: float = 1e-3
    prefix_weight: float = 0.5
    """Weight of the prefix pairs' loss (mean over taus) against the final pairs' loss."""
    distill_weight: float = 0.0
    """Weight of rank_distillation_loss (partial rewards taught to rank as the final ones do)."""
    mc_weight: float = 0.0
    """Weight of TCRM's Monte Carlo term (value_consistency_loss): cut scores toward the final score."""
    td_weight: float = 0.0
    """Weight of TCRM's temporal-difference term (value_consistency_loss): each cut toward the next."""
    prompts_per_step: int = 4
    """Prompts whose losses make one optimizer step."""
    head_l2: float = 1e-2
    """l2 of the linear probe that initialises the score head (fit_head)."""
    bf16: bool = False
    """Training passes under bfloat16 autocast (parameters stay float32; the probe, validation and
    the saved model are float32): about 1.6x faster on CPUs with AVX512-BF16, far slower without."""
    seed: int = 0


def group_pairs(group: PromptTexts, fractions: list[float]) -> dict[int, list[tuple[int, int]]]:
    """tau -> (chosen, rejected) text-index pairs of the group, tau 0 being the final texts: every
    two samples whose judge fractions differ, the higher chosen; at tau > 0 each text is the
    sample cut at tau (its final text when it has at most tau tokens), pairs of two final texts
    left out (they are tau 0's)."""
    final = {t.sample: k for k, t in enumerate(group.texts) if t.tau == 0}
    taus = sorted({t.tau for t in group.texts if t.tau})
    cut = {(t.sample, t.tau): k for k, t in enumerate(group.texts) if t.tau}
    samples = sorted(final)
    out: dict[int, list[tuple[int, int]]] = {}
    for a, i in enumerate(samples):
        for j in samples[a + 1:]:
            if fractions[i] == fractions[j]:
                continue
            c, r = (i, j) if fractions[i] > fractions[j] else (j, i)
            out.setdefault(0, []).append((final[c], final[r]))
            for tau in taus:
                if (c, tau) in cut or (r, tau) in cut:
                    out.setdefault(tau, []).append((cut.get((c, tau), final[c]), cut.get((r, tau), final[r])))
    return out


def cut_pairs(group: PromptTexts) -> list[tuple[int, int, int, int]]:
    """(cut text i, cut text j, final text i, final text j) for every two samples of the group and
    every tau at which at least one of them is cut (the other's final text standing in), whatever
    the judge says of them: the pairs on which partial rewards are taught to rank as final ones."""
    final = {t.sample: k for k, t in enumerate(group.texts) if t.tau == 0}
    cut = {(t.sample, t.tau): k for k, t in enumerate(group.texts) if t.tau}
    samples = sorted(final)
    out = []
    for tau in sorted({t.tau for t in group.texts if t.tau}):
        for a, i in enumerate(samples):
            for j in samples[a + 1:]:
                if (i, tau) in cut or (j, tau) in cut:
                    out.append((cut.get((i, tau), final[i]), cut.get((j, tau), final[j]), final[i], final[j]))
    return out


def rank_distillation_loss(scores: torch.Tensor, pairs: list[tuple[int, int, int, int]]) -> torch.Tensor:
    """Cross-entropy of the partial rewards' Bradley-Terry preference against the final rewards'
    (a fixed target): sigma(r_i^final - r_j^final) log sigma(r_i^tau - r_j^tau) + the converse,
    averaged over ``pairs`` (cut_pairs). Zero gradient into the final rewards."""
    ci, cj, fi, fj = (torch.tensor(v) for v in zip(*pairs))
    target = torch.sigmoid(scores[fi] - scores[fj]).detach()
    return F.binary_cross_entropy_with_logits(scores[ci] - scores[cj], target)


def value_chains(group: PromptTexts) -> list[list[int]]:
    """Per sample with at least one cut: its text indices in order of length, the cuts by tau and
    its final text last (the prefixes that TCRM's terms tie together)."""
    chains: dict[int, list[tuple[int, int]]] = {}
    for k, t in enumerate(group.texts):
        chains.setdefault(t.sample, []).append((t.tau or math.inf, k))
    return [[k for _, k in sorted(c)] for c in chains.values() if len(c) > 1]


def value_consistency_loss(scores: torch.Tensor, chains: list[list[int]], mc_weight: float,
                           td_weight: float) -> torch.Tensor:
    """TCRM's two regularizers ("Reward Models Are Secretly Value Functions: Temporally Coherent
    Reward Modeling", Nikulkov 2026, arXiv 2604.22981; the issue's item 2), at the cuts we score
    instead of at every token:

        mc_weight * mean_cuts (r(y[:tau]) - sg r(y))^2                 (Monte Carlo: toward the final)
      + td_weight * mean_cuts (r(y[:tau_k]) - sg r(y[:tau_k+1]))^2     (temporal difference: toward the next cut,
                                                                        the final text after the last one)

    sg is stop-gradient: the final score is learnt from the Bradley-Terry term only, and each
    prefix regresses to the value after it, so the partial reward becomes the expected final
    reward given the prefix. ``chains``: value_chains."""
    loss = scores.new_zeros(())
    if not chains:
        return loss
    cut = torch.tensor([k for c in chains for k in c[:-1]])
    if mc_weight:
        final = torch.tensor([c[-1] for c in chains for _ in c[:-1]])
        loss = loss + mc_weight * (scores[cut] - scores[final].detach()).pow(2).mean()
    if td_weight:
        following = torch.tensor([k for c in chains for k in c[1:]])
        loss = loss + td_weight * (scores[cut] - scores[following].detach()).pow(2).mean()
    return loss


def bradley_terry_loss(scores: torch.Tensor, pairs: dict[int, list[tuple[int, int]]], prefix_weight: float):
    """-log sigmoid(s_w - s_l) averaged over the final pairs, plus ``prefix_weight`` times the mean
    over taus of the same over that tau's prefix pairs (module docstring)."""

    def bt(p):
        c, r = torch.tensor([a for a, _ in p]), torch.tensor([b for _, b in p])
        return F.softplus(-(scores[c] - scores[r])).mean()

    loss = bt(pairs[0])
    prefix = [bt(p) for tau, p in pairs.items() if tau]
    if prefix and prefix_weight:
        loss = loss + prefix_weight * torch.stack(prefix).mean()
    return loss


def validate(model: SplitRewardModel, groups: list[PromptTexts], samples: list[Sample], fractions: list[float],
             taus: list[int]) -> dict:
    """Training-time figures on ``groups`` (validation prompts): final-pair agreement with the
    judge, prefix-pair agreement per tau, partial-vs-final correlations per tau; and the scores."""
    with torch.no_grad():
        scores = [top_scores(model, g).tolist() for g in groups]
    final, partial = {}, {tau: {} for tau in taus}
    for g, s in zip(groups, scores):
        for t, v in zip(g.texts, s):
            (final if t.tau == 0 else partial[t.tau])[t.sample] = v
    index = sorted(final)
    position = {i: n for n, i in enumerate(index)}
    kept = [samples[i] for i in index]
    pairs = preference_pairs([s.prompt_id for s in kept], [fractions[i] for i in index], 0.0)
    prefix_agreement = {}
    for tau in taus:
        agree = []
        for g, s in zip(groups, scores):
            agree += [1.0 if s[c] > s[r] else 0.5 if s[c] == s[r] else 0.0
                      for c, r in group_pairs(g, fractions).get(tau, [])]
        prefix_agreement[str(tau)] = rounded(sum(agree) / len(agree)) if agree else None
    correlation = partial_final_correlations(
        kept, [final[i] for i in index], {tau: {position[i]: v for i, v in p.items()} for tau, p in partial.items()})
    return {"pairs": len(pairs), "agreement": rounded(pairwise_agreement([final[i] for i in index], pairs)),
            "prefix_agreement": prefix_agreement,
            "per_prompt_kendall": {tau: c["per_prompt_kendall"] for tau, c in correlation.items()},
            "final_scores": {i: final[i] for i in index}}


def train_reward_model(model: SplitRewardModel, train: list[PromptTexts], val: list[PromptTexts],
                       samples: list[Sample], fractions: list[float], settings: TrainingSettings,
                       progress: bool = True) -> dict:
    """Bradley-Terry training of ``model``'s LoRA factors and head on the ``train`` groups (their
    bottom states filled), from a linear probe; the epoch whose validation agreement with the
    judge is best (ties: the later) is kept. Returns the history: validation figures per epoch
    (epoch 0: the linear probe on the frozen network) and seconds."""
    from tqdm import tqdm

    taus = sorted({t.tau for g in train + val for t in g.texts if t.tau})
    trainable = [(g, group_pairs(g, fractions)) for g in train]
    trainable = [(g, p) for g, p in trainable if p]
    if not trainable:
        raise ValueError("no preference pairs to train on: every sample of every prompt has the same judge fraction")
    start = time.perf_counter()
    with torch.no_grad():  # the linear probe: the head on the frozen network's final states
        features, index = [], {}
        for g, _ in trainable:
            finals = [k for k, t in enumerate(g.texts) if t.tau == 0]
            for k, f in zip(finals, top_features(model, g, finals)):
                index[g.texts[k].sample] = len(features)
                features.append(f)
        features = torch.stack(features)
        probe_pairs = [(index[g.texts[c].sample], index[g.texts[r].sample]) for g, p in trainable for c, r in p[0]]
        model.score.weight.copy_(fit_head(features, probe_pairs, settings.head_l2)[None])
    history = [{"epoch": 0, **_without_scores(validate(model, val, samples, fractions, taus))}]
    best, best_factors = history[0], model.factors()
    params = model.parameters()
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=settings.learning_rate, weight_decay=0.0)
    order = torch.Generator().manual_seed(settings.seed)
    for epoch in range(1, settings.epochs + 1):
        model.top.train()
        shuffled = [trainable[i] for i in torch.randperm(len(trainable), generator=order).tolist()]
        losses = []
        bar = tqdm(total=len(shuffled), desc=f"reward model epoch {epoch}", disable=not progress)
        for step in range(0, len(shuffled), settings.prompts_per_step):
            chunk = shuffled[step:step + settings.prompts_per_step]
            optimizer.zero_grad()
            total = 0.0
            for g, pairs in chunk:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
                    scores = top_scores(model, g).float()
                loss = bradley_terry_loss(scores, pairs, settings.prefix_weight)
                cuts = cut_pairs(g)
                if settings.distill_weight and cuts:
                    loss = loss + settings.distill_weight * rank_distillation_loss(scores, cuts)
                if settings.mc_weight or settings.td_weight:
                    loss = loss + value_consistency_loss(scores, value_chains(g), settings.mc_weight,
                                                         settings.td_weight)
                loss = loss / len(chunk)
                loss.backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            losses.append(total)
            bar.update(len(chunk))
        bar.close()
        model.top.eval()
        figures = {"epoch": epoch, "train_loss": rounded(sum(losses) / len(losses)),
                   **_without_scores(validate(model, val, samples, fractions, taus))}
        history.append(figures)
        log.info(f"epoch {epoch}: {figures}")
        if (figures["agreement"] or 0) >= (best["agreement"] or 0):
            best, best_factors = figures, model.factors()
    for p in params:
        p.requires_grad_(False)
    model.load_factors(best_factors)
    return {"history": history, "best_epoch": best["epoch"], "trained_prompts": len(trainable),
            "training_pairs": sum(len(p[0]) for _, p in trainable),
            "training_prefix_pairs": sum(len(v) for _, p in trainable for tau, v in p.items() if tau),
            "seconds": round(time.perf_counter() - start, 1)}


def _without_scores(figures: dict) -> dict:
    return {k: v for k, v in figures.items() if k != "final_scores"}
