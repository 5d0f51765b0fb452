"""pipeline.training.reward_model (with lora, judged_samples, reward_evaluation) on the tiny models:
LoRA and its merge, the split (frozen bottom, LoRA top) model against the merged directory
RewardScorer reads, the shared-head bottom states, the training texts and pairs, and Bradley-Terry
training that has to learn what the judge sees."""

from __future__ import annotations

import pytest
import torch

from pipeline.training import judged_samples, reward_evaluation
from pipeline.training import lora as surgery
from pipeline.training import reward_model as rm

PROMPTS = ["Write a review of the lamp.", "Describe how the blender works.", "Tell me if the camera is good."]


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from pipeline.engines.hf import load_tokenizer

    return load_tokenizer(str(tiny_models["generator"]))


def _samples(tokenizer, responses: dict[str, list[str]]) -> list[judged_samples.Sample]:
    from pipeline.data.chat import prompt_id

    out = []
    for prompt, texts in responses.items():
        for k, text in enumerate(texts):
            ids = tokenizer(text, add_special_tokens=False).input_ids
            out.append(judged_samples.Sample(prompt, prompt_id(prompt), k, ids,
                                             tokenizer.decode(ids, skip_special_tokens=True), eos=True))
    return out


def _random_samples(tokenizer, seed: int, lengths=(9, 14, 22)) -> list[judged_samples.Sample]:
    gen = torch.Generator().manual_seed(seed)
    texts = {p: [tokenizer.decode(torch.randint(10, 500, (n,), generator=gen).tolist(), skip_special_tokens=True)
                 for n in lengths] for p in PROMPTS[:2]}
    return _samples(tokenizer, texts)


def test_lora_linear_is_its_base_plus_the_merged_update():
    gen = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(12, 7, bias=False)
    lora = surgery.LoRALinear(base, rank=3, alpha=6.0, generator=gen)
    x = torch.randn(5, 12, generator=gen)
    assert torch.equal(lora(x), base(x))  # B starts at zero: the model starts as the base
    with torch.no_grad():
        lora.lora_B.normal_(generator=gen)
    merged = torch.nn.Linear(12, 7, bias=False)
    with torch.no_grad():
        merged.weight.copy_(base.weight + 2.0 * lora.lora_B @ lora.lora_A)
    assert not torch.allclose(lora(x), base(x))
    torch.testing.assert_close(lora(x), merged(x), rtol=1e-5, atol=1e-5)
    assert [p for p in lora.parameters() if p.requires_grad] == [lora.lora_A, lora.lora_B]


def test_reward_texts_share_the_head_and_cut_each_sample_at_tau(tokenizer, scorer):
    """Every text's tokens are RewardScorer.encode's (the tiny reward model shares the tokenizer)."""
    samples = _random_samples(tokenizer, 1)
    groups = rm.reward_texts(tokenizer, samples, [8, 16])
    assert [g.prompt_id for g in groups] == [samples[0].prompt_id, samples[3].prompt_id]
    for g in groups:
        lengths = {t.sample: len(samples[t.sample].token_ids) for t in g.texts}
        assert sorted((t.sample, t.tau) for t in g.texts) == sorted(
            [(i, 0) for i in lengths] + [(i, tau) for i in lengths for tau in (8, 16) if lengths[i] > tau])
        for t in g.texts:
            s = samples[t.sample]
            response = s.text if t.tau == 0 else tokenizer.decode(s.token_ids[:t.tau], skip_special_tokens=True)
            assert t.token_ids == scorer.encode(s.prompt, response)
            assert t.token_ids[:len(g.head)] == g.head and len(t.token_ids) > len(g.head)
        own = [t.token_ids[len(g.head)] for t in g.texts]
        assert len(set(own)) > 1  # the head is the longest common prefix


@pytest.mark.parametrize("rank, top_layers", [(4, 1), (0, 1), (0, "all")])
def test_split_model_scores_equal_the_merged_directory_read_by_reward_scorer(tiny_models, tokenizer, tmp_path,
                                                                             rank, top_layers):
    """The training-time model (bottom states with a shared head, then the LoRA top, or the
    full-rank top at rank 0; every layer at rank 0 is a full fine-tune, the bottom only the
    embeddings) and the saved, merged AutoModelForSequenceClassification give the same reward to
    every text."""
    from transformers import AutoConfig

    from pipeline.engines.rewards import RewardScorer

    generator = tiny_models["generator"]
    layers = AutoConfig.from_pretrained(generator).num_hidden_layers
    top_layers = layers if top_layers == "all" else top_layers
    model = surgery.split_reward_model(generator, top_layers=top_layers, rank=rank, alpha=8.0, seed=0)
    assert len(model.bottom.layers) == layers - top_layers and model.first_top_layer == layers - top_layers
    update = "lora_B" if rank else "delta"  # zero at start: the part that makes the model differ
    assert all(isinstance(m, surgery.FullLinear if rank == 0 else surgery.LoRALinear) for m in model.lora.values())
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.lora.values():
            getattr(m, update).normal_(0, 0.2, generator=gen)
        model.score.weight.normal_(0, 1, generator=gen)
    samples = _random_samples(tokenizer, 2)
    groups = rm.reward_texts(tokenizer, samples, [8, 16])
    rm.bottom_states(model, groups, tokenizer.pad_token_id)
    with torch.no_grad():
        split = [v for g in groups for v in rm.top_scores(model, g).tolist()]
        # The shared head and the final texts' caches change nothing: every text's states equal
        # the bottom layers run on it alone (cut texts included, tails and all).
        for g in groups:
            assert sum(t.tau > 0 for t in g.texts) >= 2
            for k, t in enumerate(g.texts):
                alone = model.bottom(input_ids=torch.tensor([t.token_ids])).last_hidden_state[0]
                torch.testing.assert_close(torch.cat([g.head_states, g.states[k]]), alone, rtol=1e-4, atol=1e-4)
    surgery.save_reward_model(generator, model.factors(), 2.0 if rank else 1.0, tmp_path / "reward")
    scorer = RewardScorer.from_pretrained(str(tmp_path / "reward"))
    texts = [(samples[t.sample].prompt, samples[t.sample].text if t.tau == 0 else
              rm.prefix_text(tokenizer, samples[t.sample], t.tau)) for g in groups for t in g.texts]
    read = scorer.score([p for p, _ in texts], [r for _, r in texts])
    assert read == pytest.approx(split, abs=1e-4)
    assert len({round(v, 3) for v in read}) == len(read)  # the texts are told apart: the check has teeth
    # Without the merge (the plain generator with the same head) the scores differ: the update matters.
    surgery.save_reward_model(generator, {k: torch.zeros_like(v) if k.endswith(update) else v
                                     for k, v in model.factors().items()}, 2.0, tmp_path / "no-lora")
    plain = RewardScorer.from_pretrained(str(tmp_path / "no-lora")).score([p for p, _ in texts], [r for _, r in texts])
    assert max(abs(a - b) for a, b in zip(plain, split)) > 1e-2


def test_group_pairs_order_by_the_judge_and_keep_the_final_label_at_each_cut():
    texts = [rm.RewardText(0, 0, [1]), rm.RewardText(1, 0, [1]), rm.RewardText(2, 0, [1]),
             rm.RewardText(0, 8, [1]), rm.RewardText(1, 8, [1]), rm.RewardText(1, 16, [1])]
    group = rm.PromptTexts("p", [], texts)
    fractions = [0.5, 1.0, 0.5]
    pairs = rm.group_pairs(group, fractions)
    assert pairs[0] == [(1, 0), (1, 2)]  # samples 0 and 2 tie: no pair
    assert pairs[8] == [(4, 3), (4, 2)]  # sample 2 has no cut at 8 (too short): its final text stands in
    assert pairs[16] == [(5, 0), (5, 2)]  # samples 0 and 2 are shorter than 16: their final texts
    scores = torch.tensor([0.0, 2.0, 0.0, 0.0, 1.0, 3.0], requires_grad=True)
    loss = rm.bradley_terry_loss(scores, pairs, prefix_weight=0.5)
    final = torch.nn.functional.softplus(torch.tensor([-2.0, -2.0])).mean()
    prefix = (torch.nn.functional.softplus(torch.tensor([-1.0, -1.0])).mean()
              + torch.nn.functional.softplus(torch.tensor(-3.0))) / 2
    torch.testing.assert_close(loss, final + 0.5 * prefix)
    assert rm.group_pairs(group, [1.0, 1.0, 1.0]) == {}


def test_rank_distillation_pairs_every_two_cut_samples_and_targets_the_final_order():
    texts = [rm.RewardText(0, 0, [1]), rm.RewardText(1, 0, [1]), rm.RewardText(2, 0, [1]),
             rm.RewardText(0, 8, [1]), rm.RewardText(1, 8, [1])]
    pairs = rm.cut_pairs(rm.PromptTexts("p", [], texts))
    assert pairs == [(3, 4, 0, 1), (3, 2, 0, 2), (4, 2, 1, 2)]  # judge fractions play no part
    scores = torch.tensor([2.0, -2.0, 0.0, 1.0, 1.0], requires_grad=True)
    loss = rm.rank_distillation_loss(scores, pairs)
    target = torch.sigmoid(torch.tensor([4.0, 2.0, -2.0]))
    logits = torch.tensor([0.0, 1.0, 1.0])
    torch.testing.assert_close(loss, torch.nn.functional.binary_cross_entropy_with_logits(logits, target))
    loss.backward()
    assert scores.grad[3] < 0 < scores.grad[4]  # sample 0 ranks above 1 at the end: its cut is pushed up
    assert scores.grad[0] == 0 and scores.grad[1] == 0  # the final rewards are the target, not trained here


def test_value_consistency_regresses_each_cut_on_the_final_and_on_the_next_cut():
    """TCRM's terms: sample 0 has cuts at 8 and 16, sample 1 one cut, sample 2 none (no chain)."""
    texts = [rm.RewardText(0, 0, [1]), rm.RewardText(1, 0, [1]), rm.RewardText(2, 0, [1]),
             rm.RewardText(0, 16, [1]), rm.RewardText(0, 8, [1]), rm.RewardText(1, 8, [1])]
    chains = rm.value_chains(rm.PromptTexts("p", [], texts))
    assert chains == [[4, 3, 0], [5, 1]]
    scores = torch.tensor([3.0, -1.0, 0.0, 2.0, 0.0, 1.0], requires_grad=True)
    mc = ((2.0 - 3.0) ** 2 + (0.0 - 3.0) ** 2 + (1.0 + 1.0) ** 2) / 3
    td = ((0.0 - 2.0) ** 2 + (2.0 - 3.0) ** 2 + (1.0 + 1.0) ** 2) / 3
    loss = rm.value_consistency_loss(scores, chains, mc_weight=0.5, td_weight=2.0)
    torch.testing.assert_close(loss, torch.tensor(0.5 * mc + 2.0 * td))
    loss.backward()
    assert scores.grad[0] == 0 and scores.grad[1] == 0 and scores.grad[2] == 0  # finals are targets only
    assert scores.grad[4] < 0 and scores.grad[3] < 0 and scores.grad[5] > 0  # cuts move toward what follows
    assert rm.value_consistency_loss(scores, [], 1.0, 1.0).item() == 0.0


def test_value_consistency_training_brings_partial_rewards_to_the_final_ones(tiny_models, tokenizer):
    """On the same data and seeds, TCRM's terms leave every cut's reward nearer its final reward
    than Bradley-Terry alone does, and the judge's final pairs are still ordered."""
    good = ["the lamp works great and I would keep it", "the battery lasts long and I would buy it"]
    bad = ["no no it is bad no and the lamp is bad", "no the lamp no it broke and I sent it back"]
    prompts = [f"{p} ({k})" for k in range(4) for p in PROMPTS]
    responses = {p: [good[k % 2], bad[k % 2], good[(k + 1) % 2], bad[(k + 1) % 2]] for k, p in enumerate(prompts)}
    samples = _samples(tokenizer, responses)
    fractions = [1.0 if "no" not in s.text.split() else 0.0 for s in samples]
    gaps = {}
    for weight in (0.0, 1.0):
        model = surgery.split_reward_model(tiny_models["generator"], top_layers=1, rank=4, alpha=8.0, seed=0)
        groups = rm.reward_texts(tokenizer, samples, [2, 4])
        rm.bottom_states(model, groups, tokenizer.pad_token_id)
        rm.train_reward_model(model, groups[:10], groups[10:], samples, fractions, rm.TrainingSettings(
            epochs=3, learning_rate=1e-2, prompts_per_step=2, mc_weight=weight, td_weight=weight), progress=False)
        with torch.no_grad():
            scores = [rm.top_scores(model, g) for g in groups]
        gaps[weight] = torch.cat([(s[c[:-1]] - s[c[-1]]).abs() for g, s in zip(groups, scores)
                                  for c in rm.value_chains(g)]).mean().item()
        final = [(s[g.texts.index(next(t for t in g.texts if t.sample == i and t.tau == 0))], fractions[i])
                 for g, s in zip(groups[10:], scores[10:]) for i in {t.sample for t in g.texts}]
        assert min(v for v, f in final if f == 1.0) > max(v for v, f in final if f == 0.0)
    assert gaps[1.0] < 0.5 * gaps[0.0], gaps


# top_layers 2: both of the tiny generator's layers, a full fine-tune with no frozen layer
@pytest.mark.parametrize("rank, learning_rate, top_layers", [(4, 1e-2, 1), (0, 1e-3, 1), (0, 1e-3, 2)])
def test_bradley_terry_training_learns_what_the_judge_sees(tiny_models, tokenizer, rank, learning_rate, top_layers):
    """The judge prefers responses without "no": after training the reward model orders held-out
    prompts' pairs by it, and the LoRA factors (or the full-rank updates, at rank 0) moved (the
    probe alone is epoch 0 in the history)."""
    good = ["the lamp works great and I would keep it", "the battery lasts long and I would buy it",
            "the camera is good and I would recommend it"]
    bad = ["no no it is bad no", "no the lamp no", "no no no"]
    prompts = [f"{p} ({k})" for k in range(6) for p in PROMPTS]
    responses = {p: [good[k % 3], bad[k % 3], good[(k + 1) % 3], bad[(k + 2) % 3]] for k, p in enumerate(prompts)}
    samples = _samples(tokenizer, responses)
    fractions = [1.0 if "no" not in s.text.split() else 0.0 for s in samples]
    model = surgery.split_reward_model(tiny_models["generator"], top_layers=top_layers, rank=rank, alpha=8.0, seed=0)
    groups = rm.reward_texts(tokenizer, samples, [2, 4])
    rm.bottom_states(model, groups, tokenizer.pad_token_id)
    before = {k: v.clone() for k, v in model.factors().items()}
    out = rm.train_reward_model(model, groups[:14], groups[14:], samples, fractions,
                                rm.TrainingSettings(epochs=4, learning_rate=learning_rate, prompts_per_step=2),
                                progress=False)
    history = out["history"]
    assert [h["epoch"] for h in history] == [0, 1, 2, 3, 4] and out["trained_prompts"] == 14
    assert out["training_pairs"] == 14 * 4
    assert history[-1]["train_loss"] < history[1]["train_loss"]
    best = history[out["best_epoch"]]
    assert best["pairs"] == 4 * 4 and best["agreement"] == 1.0 and best["prefix_agreement"]["2"] > 0.5
    moved = model.factors()
    update = "lora_B" if rank else "delta"
    assert any(k.endswith(update) for k in moved)
    assert out["best_epoch"] >= 1 and all(not torch.equal(moved[k], before[k]) for k in moved if k.endswith(update))


def test_best_of_n_accuracy_picks_by_reward_and_by_judge():
    samples = [judged_samples.Sample("p", "a", k, [1], "x", True) for k in range(3)] + \
              [judged_samples.Sample("q", "b", k, [1], "x", True) for k in range(2)]
    judgements = [judged_samples.Judgement(f) for f in ([True, False], [True, True], [False, False], [False], [True])]
    rewards = [3.0, 1.0, 0.0, 2.0, 1.0]
    out = reward_evaluation.best_of_n_accuracy(samples, judgements, rewards)
    assert out["random_sample"] == {"prompt_level_strict": 0.4, "instruction_level_strict": round(4 / 8, 4)}
    assert out["best_of_n_by_reward"] == {"prompt_level_strict": 0.0, "instruction_level_strict": round(1 / 3, 4)}
    assert out["best_of_n_by_judge"] == {"prompt_level_strict": 1.0, "instruction_level_strict": 1.0}
    assert out["worst_of_n_by_judge"] == {"prompt_level_strict": 0.0, "instruction_level_strict": 0.0}


def test_judge_samples_reads_each_prompts_instructions():
    samples = [judged_samples.Sample("Say hi.", "a", 0, [1], "hi, there", True),
               judged_samples.Sample("Say hi.", "a", 1, [1], "hi there", True)]
    instructions = {"a": (["punctuation:no_comma", "length_constraints:number_words"],
                          [{}, {"num_words": 3, "relation": "less than"}])}
    judged = judged_samples.judge_samples(samples, instructions)
    assert [j.followed for j in judged] == [[False, True], [True, True]]
    assert [j.fraction for j in judged] == [0.5, 1.0] and [j.all_followed for j in judged] == [False, True]
