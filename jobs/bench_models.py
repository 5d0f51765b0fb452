"""Trained bench models: a review grammar with a known quality signal, and small Llama models
trained on it, so that reward-correlation and speed figures mean something.

    python -m jobs.bench_models --output DIR [--seed 0]

The corpus. Each review answers a prompt such as "Write a review of the blender." and is a few
sentences long. A hidden reviewer skill q = u^2, u ~ U(0, 1), drives every sentence: with probability q a
sentence is a specific, on-topic remark about an aspect of the asked product (with a reason,
again with probability q), otherwise it is filler, off-topic (an aspect of another product), rude
or a contradiction of the review's sentiment. The closing line agrees with the sentiment with
probability q. Each sentence template has fixed points (``POINTS``), and the quality label of a
text is the mean of its sentences' points: a function of the text alone, so a prefix has a
label too. Because one skill drives the whole review, early sentences predict the final quality
imperfectly but clearly, the way partial rewards of real reward models do (paper section 4,
Figure 2). The skill is skewed towards low values so that excellent reviews are rare: the best of
64 samples is then clearly better than the best of 16, as with real policies and reward models
(the paper's Best-of-25 reaches 89 of Best-of-100's normalized score); with a uniform skill the
best of 16 was already within 2% of the best of 64, which leaves nothing for any method to win.

The models (all Llama, one shared byte-level BPE tokenizer with the chat template of the random
tiny models):
- ``generator``: LlamaForCausalLM of 1.2M parameters (hidden 192, 3 layers, 8 heads, 4 KV heads),
  trained on prompt + review + EOS for 400 steps of 16 reviews. Small on purpose: the build must
  fit 10 minutes on 2 shared CPU cores, and a 2.7M-parameter model given the same time (100
  steps) still wrote word salad; this one writes on-topic reviews whose quality varies as the
  grammar's does;
- ``draft``: a 0.3M-parameter LlamaForCausalLM trained alongside the generator on the same
  batches, with a distillation term (KL to the generator's detached next-token distribution),
  for the speculative-decoding methods (DSBD);
- ``reward``: LlamaForSequenceClassification (one label) regressed (MSE) on the quality labels
  of full reviews and of reviews cut at a random word (label: the complete sentences so far),
  on the text exactly as pipeline.engines.rewards.RewardScorer formats it. Its corpus has a
  uniform skill, so that it has seen excellent reviews often enough to rank them.

DIR/prompts.jsonl holds the benchmark prompts (every product x request pair); DIR/bench.json
records the settings, the sizes, the final losses and the build time, and makes a rebuild with
the same settings a no-op.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from jobs.cli import exits_on_interrupt

log = logging.getLogger(__name__)

PRODUCTS = {
    "the blender": ["motor", "blade", "jar", "lid"],
    "the headphones": ["sound", "cushion", "cable", "battery"],
    "the coffee maker": ["carafe", "filter", "heater", "timer"],
    "the camera": ["lens", "sensor", "grip", "screen"],
    "the jacket": ["zipper", "lining", "hood", "sleeve"],
    "the lamp": ["bulb", "switch", "base", "shade"],
    "the keyboard": ["keys", "backlight", "stand", "frame"],
    "the vacuum": ["brush", "hose", "bag", "wheel"],
}
ASKS = ["Write a review of {p}.", "Tell me what you think of {p}.", "Review {p} for me.", "How good is {p}?"]
PRAISE = ["works well", "feels solid", "is very good", "holds up nicely", "is quiet", "is easy to clean"]
BLAME = ["broke quickly", "feels cheap", "is very bad", "stopped working", "is too loud", "is hard to clean"]
REASON_GOOD = ["even after a month of daily use", "which saves me time every morning", "unlike my old one"]
REASON_BAD = ["after only a week", "which wastes my time every morning", "just like my old one"]
FILLER = ["It is okay I guess.", "Not much to say.", "It is a thing.", "Well, it exists."]
RUDE = ["Whatever, do not ask me.", "This review is pointless.", "Who even cares."]
CLOSE = {True: ["I would recommend it.", "I would buy it again."], False: ["I would return it.", "I would not buy it again."]}
POINTS = {"reasoned": 3.0, "specific": 2.0, "filler": 0.0, "off_topic": -2.0, "contradiction": -2.0,
          "rude": -3.0, "close": 1.0, "close_contradiction": -2.0}


def bench_prompts() -> list[str]:
    return [ask.format(p=p) for p in PRODUCTS for ask in ASKS]


def _opinion(rng: random.Random, aspect: str, positive: bool, reasoned: bool) -> str:
    words = PRAISE if positive else BLAME
    text = f"The {aspect} {rng.choice(words)}"
    if reasoned:
        text += " " + rng.choice(REASON_GOOD if positive else REASON_BAD)
    return text + "."


def sample_review(rng: random.Random, product: str, skill_power: float = 2.0) -> tuple[str, list[float]]:
    """One review of ``product`` and the points of each of its sentences. The reviewer skill is
    u ** skill_power: 2 (the policy's corpus) makes excellent reviews rare, 1 is uniform."""
    skill = rng.random() ** skill_power
    positive = rng.random() < 0.5
    sentences, points = [], []
    for _ in range(rng.randint(3, 8)):
        if rng.random() < skill:
            reasoned = rng.random() < skill
            sentences.append(_opinion(rng, rng.choice(PRODUCTS[product]), positive, reasoned))
            points.append(POINTS["reasoned" if reasoned else "specific"])
            continue
        kind = rng.choice(["filler", "off_topic", "rude", "contradiction"])
        if kind == "filler":
            sentences.append(rng.choice(FILLER))
        elif kind == "rude":
            sentences.append(rng.choice(RUDE))
        elif kind == "off_topic":
            other = rng.choice([p for p in PRODUCTS if p != product])
            sentences.append(_opinion(rng, rng.choice(PRODUCTS[other]), positive, False))
        else:
            sentences.append(_opinion(rng, rng.choice(PRODUCTS[product]), not positive, False))
        points.append(POINTS[kind])
    agrees = rng.random() < skill
    sentences.append(rng.choice(CLOSE[positive if agrees else not positive]))
    points.append(POINTS["close" if agrees else "close_contradiction"])
    return " ".join(sentences), points


def quality(points: list[float]) -> float:
    """The label: mean points of the complete sentences (0 for an empty text)."""
    return sum(points) / len(points) if points else 0.0


def review_corpus(seed: int, size: int, skill_power: float = 2.0) -> list[dict]:
    """``size`` rows of {prompt, response, points}, deterministic for ``seed``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        product = rng.choice(list(PRODUCTS))
        response, points = sample_review(rng, product, skill_power)
        rows.append({"prompt": rng.choice(ASKS).format(p=product), "response": response, "points": points})
    return rows


def cut_at_word(rng: random.Random, response: str, points: list[float]) -> tuple[str, float]:
    """A random word-boundary prefix of ``response`` and the quality of its complete sentences."""
    words = response.split(" ")
    keep = rng.randint(1, len(words))
    prefix = " ".join(words[:keep])
    complete = sum(1 for w in words[:keep] if w.endswith((".", "?")))
    return prefix, quality(points[:complete])


@dataclass
class BenchSettings:
    seed: int = 0
    corpus_size: int = 20000
    vocab_size: int = 1024
    generator_steps: int = 400
    reward_steps: int = 300
    batch_size: int = 16
    learning_rate: float = 3e-3
    generator_hidden: int = 192
    generator_layers: int = 3
    draft_hidden: int = 96
    draft_layers: int = 2
    reward_hidden: int = 128
    reward_layers: int = 3
    threads: int = 1


def _lr(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def _pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask


def train_policy_and_draft(generator, draft, tok, rows: list[dict], s: BenchSettings, progress) -> dict:
    """Next-token training of the generator; the draft learns from the same batches, half from the
    data and half from the generator's (detached) distribution."""
    seqs = []
    for r in rows:
        prompt = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                         add_generation_prompt=True)
        seqs.append(tok(prompt + r["response"], add_special_tokens=False).input_ids + [tok.eos_token_id])
    rng = random.Random(s.seed)
    opt_g = torch.optim.AdamW(generator.parameters(), lr=s.learning_rate, weight_decay=0.01)
    opt_d = torch.optim.AdamW(draft.parameters(), lr=s.learning_rate, weight_decay=0.01)
    generator.train(), draft.train()
    losses = {}
    for step in range(s.generator_steps):
        ids, mask = _pad(rng.sample(seqs, s.batch_size), tok.pad_token_id)  # [B, L]
        labels = ids.masked_fill(mask == 0, -100)
        for opt in (opt_g, opt_d):
            for group in opt.param_groups:
                group["lr"] = _lr(step, s.generator_steps, s.learning_rate)
        out = generator(input_ids=ids, attention_mask=mask, labels=labels)
        opt_g.zero_grad(), out.loss.backward(), opt_g.step()
        d = draft(input_ids=ids, attention_mask=mask, labels=labels)
        valid = mask[:, 1:].bool()  # positions whose next token is real
        teacher = F.log_softmax(out.logits[:, :-1][valid].detach(), -1)  # [T, V]
        student = F.log_softmax(d.logits[:, :-1][valid], -1)
        kl = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
        loss = 0.5 * d.loss + 0.5 * kl
        opt_d.zero_grad(), loss.backward(), opt_d.step()
        losses = {"generator_loss": round(out.loss.item(), 4), "draft_loss": round(d.loss.item(), 4),
                  "draft_kl": round(kl.item(), 4)}
        progress.set_postfix(losses, refresh=False)
        progress.update(1)
    generator.eval(), draft.eval()
    return losses


def train_reward(reward, scorer_format, tok, rows: list[dict], s: BenchSettings, progress) -> dict:
    """MSE regression of the one-label head on the quality labels of full and cut reviews."""
    rng = random.Random(s.seed + 1)
    opt = torch.optim.AdamW(reward.parameters(), lr=s.learning_rate, weight_decay=0.01)
    reward.train()
    loss = torch.tensor(0.0)
    for step in range(s.reward_steps):
        texts, labels = [], []
        for r in rng.sample(rows, s.batch_size):
            if rng.random() < 0.5:
                response, label = r["response"], quality(r["points"])
            else:
                response, label = cut_at_word(rng, r["response"], r["points"])
            texts.append(scorer_format(r["prompt"], response))
            labels.append(label)
        batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        for group in opt.param_groups:
            group["lr"] = _lr(step, s.reward_steps, s.learning_rate)
        pred = reward(**batch).logits[:, 0]  # [B]
        loss = F.mse_loss(pred, torch.tensor(labels))
        opt.zero_grad(), loss.backward(), opt.step()
        progress.set_postfix(reward_mse=round(loss.item(), 4), refresh=False)
        progress.update(1)
    reward.eval()
    return {"reward_mse": round(loss.item(), 4)}


@torch.no_grad()
def reward_fit(scorer, rows: list[dict]) -> dict:
    """Pearson correlation of the trained reward with the label on held-out full reviews."""
    pred = scorer.score([r["prompt"] for r in rows], [r["response"] for r in rows])
    gold = [quality(r["points"]) for r in rows]
    pred_t, gold_t = torch.tensor(pred), torch.tensor(gold)
    return {"reward_heldout_pearson": round(float(torch.corrcoef(torch.stack([pred_t, gold_t]))[0, 1]), 4)}


def make_bench_models(output: str | Path, settings: BenchSettings | None = None, progress: bool = True) -> dict[str, Path]:
    """Build (or reuse, when DIR/bench.json records the same settings) the trained bench models."""
    from tqdm import tqdm
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from jobs.make_tiny_models import build_tokenizer, llama_config
    from pipeline.engines.rewards import RewardScorer

    s = settings or BenchSettings()
    output = Path(output)
    paths = {name: output / name for name in ("generator", "draft", "reward")}
    paths["prompts"] = output / "prompts.jsonl"
    stamp = output / "bench.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("settings") == asdict(s) and all(
            (p / "config.json").exists() for n, p in paths.items() if n != "prompts"):
        return paths
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        rows = review_corpus(s.seed, s.corpus_size)
        # The reward model learns from reviews of every quality, as real reward models learn from
        # broad preference data rather than from the policy's own (mostly mediocre) samples.
        judged = review_corpus(s.seed + 1, s.corpus_size, skill_power=1.0)
        heldout = review_corpus(s.seed + 7919, 256, skill_power=1.0)
        tok = build_tokenizer(s.seed, s.vocab_size, [r["prompt"] + " " + r["response"] for r in rows[:5000]])
        torch.manual_seed(s.seed)
        generator = LlamaForCausalLM(llama_config(tok, s.generator_hidden, s.generator_layers, 8, 4))
        draft = LlamaForCausalLM(llama_config(tok, s.draft_hidden, s.draft_layers, max(1, s.draft_hidden // 32),
                                              max(1, s.draft_hidden // 64)))
        r_heads = max(2, s.reward_hidden // 32)
        reward = LlamaForSequenceClassification(llama_config(tok, s.reward_hidden, s.reward_layers, r_heads,
                                                             r_heads // 2, num_labels=1))
        scorer = RewardScorer(reward, tok)
        log.info("training the generator and the draft (%d steps), then the reward model (%d steps)",
                 s.generator_steps, s.reward_steps)
        bar = tqdm(total=s.generator_steps + s.reward_steps, desc="bench models", disable=not progress)
        report = train_policy_and_draft(generator, draft, tok, rows, s, bar)
        report.update(train_reward(reward, scorer.format, tok, judged, s, bar))
        bar.close()
        report.update(reward_fit(scorer, heldout))
        for name, model in (("generator", generator), ("draft", draft), ("reward", reward)):
            model.save_pretrained(paths[name])
            tok.save_pretrained(paths[name])
            report[f"{name}_parameters"] = sum(p.numel() for p in model.parameters())
        with open(paths["prompts"], "w") as f:
            for prompt in bench_prompts():
                f.write(json.dumps({"prompt": prompt}) + "\n")
        report["build_seconds"] = round(time.perf_counter() - start, 1)
        stamp.write_text(json.dumps({"settings": asdict(s), "report": report}, indent=2))
    finally:
        torch.set_num_threads(threads)
    return paths


@exits_on_interrupt()
def main(argv: list[str] | None = None) -> int:
    from jobs.make_tiny_models import models_cli

    return models_cli(argv, "python -m jobs.bench_models", __doc__,
                      lambda output, seed, progress: make_bench_models(output, BenchSettings(seed=seed), progress))


if __name__ == "__main__":
    raise SystemExit(main())
