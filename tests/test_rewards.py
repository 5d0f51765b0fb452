"""Reward scoring: chat-template formatting, batching, and non-finite scores."""

import math

import torch

from pipeline.engines.rewards import RewardScorer


def test_chat_template_is_used_when_present(scorer):
    text = scorer.format("Hi there", "Hello!")
    assert text == "<s><|user|>Hi there\n<|assistant|>Hello!\n"


def test_batched_scores_match_one_by_one(scorer):
    prompts = ["Write a review of the lamp.", "Explain why", "Tell me if the camera is good in low light."]
    responses = ["It works great.", "", "The camera works well and I would keep it, it is fine."]
    batched = scorer.score(prompts, responses)
    single = [scorer.score([p], [r])[0] for p, r in zip(prompts, responses)]
    assert all(math.isfinite(s) for s in batched)
    for a, b in zip(batched, single):
        assert abs(a - b) < 1e-4
    assert len(set(round(s, 6) for s in batched)) == 3


def test_non_finite_scores_are_nan_never_zero(tiny_models):
    poisoned = RewardScorer.from_pretrained(str(tiny_models["reward"]))
    with torch.no_grad():
        poisoned.model.score.weight.fill_(float("inf"))
        poisoned.model.score.weight[0, 0] = float("-inf")  # inf - inf = nan for every input
    scores = poisoned.score(["a", "b"], ["x", "y"])
    assert all(math.isnan(s) for s in scores)
