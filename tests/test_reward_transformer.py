"""Reward Transformer: channel maths, save/load, engine loading, Bradley-Terry training, and the
Done-when path: our own build's pairs -> BT and DPO training -> `sla` as a build strategy."""

from __future__ import annotations

import argparse
import json

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from jobs.build_dataset import main as build_main
from jobs.cli import add_channel_objective_flags
from jobs.train_reward_transformer import main as train_main
from pipeline.engines.hf import HFEngine, load_tokenizer
from pipeline.engines.reward_transformer import RewardTransformer, has_reward_channel, has_trained_channel
from pipeline.errors import InputError
from pipeline.training.reward_channel import (OBJECTIVES, EncodedPair, bradley_terry_loss, channel_scores,
                                              encode_pairs, evaluate_channel, response_rewards, tcrm_loss,
                                              train_reward_channel)
from tests.conftest import GOOD_PROMPTS, write_jsonl


def test_channel_follows_eq14_and_reads_policy_and_reward_states(tiny_models):
    """Eq. 14 and the head recomputed from the channel's weights with plain tensor ops (not its own
    modules): h_r^1 = Norm(FFN_0(h_p^0)), h_r^{j+1} = Norm(h_r^j + FFN_j([h_p^j : h_r^j])), FFN(x) =
    silu(W RMSNorm(x)), reward = w . [h_p^L : h_r^L] + b."""
    import torch.nn.functional as F

    rt = RewardTransformer.from_pretrained(str(tiny_models["generator"]), hidden_size=16)
    assert not rt.channel_config.trained and not has_reward_channel(str(tiny_models["generator"]))
    with torch.no_grad():  # a random head so that both halves of [h_p : h_r] matter
        rt.channel.head.weight.normal_()
    ids = torch.tensor([[1, 7, 8, 9, 10]])
    out = rt(input_ids=ids, with_rewards=True)
    hs = rt.policy(input_ids=ids, output_hidden_states=True).hidden_states  # L + 1 states, [1, T, d]
    eps = rt.channel_config.rms_norm_eps

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def ffn(block, x):
        return F.silu(rms(x, block.norm.weight) @ block.linear.weight.T)

    ch = rt.channel
    h_r = rms(ffn(ch.blocks[0], hs[0]), ch.norms[0].weight)
    for j in range(1, len(hs) - 1):
        h_r = rms(h_r + ffn(ch.blocks[j], torch.cat([hs[j], h_r], -1)), ch.norms[j].weight)
    expected = torch.cat([hs[-1], h_r], -1) @ ch.head.weight[0] + ch.head.bias  # [1, T]
    torch.testing.assert_close(out.rewards, expected)
    assert len(ch.blocks) == len(hs) - 1 == rt.config.num_hidden_layers
    # The head reads the policy state and the reward state: either half changes the reward.
    d = rt.config.hidden_size
    for half in (slice(0, d), slice(d, None)):
        with torch.no_grad():
            saved = ch.head.weight[:, half].clone()
            ch.head.weight[:, half] = 0
            moved = rt(input_ids=ids, with_rewards=True).rewards
            ch.head.weight[:, half] = saved
        assert not torch.allclose(moved, expected)
    # A prefix's reward does not depend on later tokens (causal), and token_rewards agrees.
    torch.testing.assert_close(rt.token_rewards(ids[:, :3], torch.ones(1, 3, dtype=torch.long)), expected[:, :3])
    # The policy channel is the unchanged model.
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_models["generator"]))
    torch.testing.assert_close(out.logits, plain(input_ids=ids).logits)


def test_self_reward_decoder_equals_a_full_forward_pass(tiny_models):
    """SLA's SelfRewardingLM (left-padded prefill, select with repeats and drops, token feeds on the
    KV cache) gives each row the logits and token reward of one full pass over its sequence."""
    from pipeline.engines.adapters import SelfRewardDecoder

    tok = load_tokenizer(str(tiny_models["generator"]))
    rt = RewardTransformer.from_pretrained(str(tiny_models["generator"]), hidden_size=16)
    rt.channel.config.trained = True
    decoder = SelfRewardDecoder(HFEngine(rt, tok))
    seqs = [[1, 7, 8, 9, 10, 11], [1, 20, 21]]  # different lengths: the second is left-padded
    batch = decoder.prefill(seqs)
    steps = [([0, 0, 1], [30, 31, 32]), ([2, 0], [40, 41]), ([1, 1, 0], [50, 51, 52])]
    for index, tokens in steps:
        decoder.select(batch, index)
        seqs = [list(seqs[i]) for i in index]
        decoder.feed(batch, torch.tensor(tokens))
        seqs = [s + [t] for s, t in zip(seqs, tokens)]
        for row, seq in enumerate(seqs):
            full = rt(input_ids=torch.tensor([seq]), with_rewards=True)
            torch.testing.assert_close(batch.logits[row], full.logits[0, -1].float(), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(batch.rewards[row], full.rewards[0, -1].float(), atol=1e-4, rtol=1e-4)


def synthetic_pairs(tokenizer, n=16):
    """Chosen responses say 'great', rejected ones 'badly': learnable from token identity."""
    subjects = ["the lamp", "the battery", "the app", "the camera"]
    pairs = []
    for i in range(n):
        s = subjects[i % 4]
        prompt = tokenizer(f"<s><|user|>Write a review of {s}.\n<|assistant|>", add_special_tokens=False).input_ids
        pairs.append(EncodedPair(prompt, tokenizer(f"{s} works great", add_special_tokens=False).input_ids,
                                 tokenizer(f"{s} works badly", add_special_tokens=False).input_ids))
    return pairs


def test_bradley_terry_trains_channel_only_and_round_trips(tiny_models, tmp_path):
    tok = load_tokenizer(str(tiny_models["generator"]))
    rt = RewardTransformer.from_pretrained(str(tiny_models["generator"]), hidden_size=32)
    policy_before = {k: v.clone() for k, v in rt.policy.state_dict().items()}
    pairs = synthetic_pairs(tok)
    before = evaluate_channel(rt, pairs, tok.pad_token_id)
    metrics = train_reward_channel(rt, pairs, tok.pad_token_id, epochs=15, batch_size=8, learning_rate=3e-3,
                                   progress=False)
    after = evaluate_channel(rt, pairs, tok.pad_token_id)
    assert metrics["train_loss"] < metrics["first_loss"] and after["eval_loss"] < before["eval_loss"]
    assert after["pairwise_accuracy"] == 1.0
    # The responses share every token but the last, so the token-level rewards can only agree with
    # the label at the end of the trajectory: the curve is 0 before and 1 at f = 1.
    assert after["autrc_curve"][-1] == 1.0 and after["autrc_curve"][0] == 0.0
    assert all(torch.equal(v, rt.policy.state_dict()[k]) for k, v in policy_before.items())

    rt.save_pretrained(str(tmp_path / "rt"), tok)
    assert has_trained_channel(str(tmp_path / "rt"))
    loaded = RewardTransformer.from_pretrained(str(tmp_path / "rt"))
    ids = torch.tensor([pairs[0].prompt + pairs[0].chosen])
    a, b = rt(input_ids=ids, with_rewards=True), loaded(input_ids=ids, with_rewards=True)
    torch.testing.assert_close(a.rewards, b.rewards)
    torch.testing.assert_close(a.logits, b.logits)
    assert loaded.channel_config.hidden_size == 32 and loaded.channel_config.trained


def test_bradley_terry_loss_is_eq17():
    chosen = [torch.tensor([1.0, 3.0]), torch.tensor([0.0])]
    rejected = [torch.tensor([0.0, 0.0, 3.0]), torch.tensor([2.0])]
    margins = torch.tensor([2.0 - 1.0, 0.0 - 2.0])
    torch.testing.assert_close(bradley_terry_loss(chosen, rejected), -torch.nn.functional.logsigmoid(margins).mean())


def test_tcrm_loss_is_bradley_terry_at_the_end_plus_value_regressions():
    chosen = [torch.tensor([1.0, 3.0], requires_grad=True), torch.tensor([0.0], requires_grad=True)]
    rejected = [torch.tensor([0.0, 0.0, 3.0], requires_grad=True), torch.tensor([2.0], requires_grad=True)]
    bt = -torch.nn.functional.logsigmoid(torch.tensor([3.0 - 3.0, 0.0 - 2.0])).mean()
    mc = ((1.0 - 3.0) ** 2 + (0.0 - 3.0) ** 2 + (0.0 - 3.0) ** 2) / 3  # one-token responses have no earlier token
    td = ((1.0 - 3.0) ** 2 + (0.0 - 0.0) ** 2 + (0.0 - 3.0) ** 2) / 3
    loss = tcrm_loss(chosen, rejected, mc_weight=0.5, td_weight=2.0)
    torch.testing.assert_close(loss, bt + 0.5 * mc + 2.0 * td)
    loss.backward()
    assert chosen[0].grad[0] < 0 and rejected[0].grad[0] < 0 and rejected[0].grad[1] < 0  # toward what follows
    assert chosen[0].grad[1] < 0 < rejected[0].grad[2]  # the last token: Bradley-Terry's gradient only
    # The jobs' --objective choices (spelt out there to keep --help fast) are the objectives.
    parser = argparse.ArgumentParser()
    add_channel_objective_flags(parser)
    assert tuple(next(a for a in parser._actions if a.dest == "objective").choices) == OBJECTIVES


def test_tcrm_brings_every_prefix_reward_to_the_final_one(tiny_models):
    """Responses that differ from their first token: after TCRM training the channel's reward
    after each prefix is nearer the final reward than after Eq. 17's training, and both order
    every pair at the end."""
    tok = load_tokenizer(str(tiny_models["generator"]))
    subjects = ["the lamp", "the battery", "the app", "the camera"]
    pairs = []
    for i in range(16):
        s = subjects[i % 4]
        prompt = tok(f"<s><|user|>Write a review of {s}.\n<|assistant|>", add_special_tokens=False).input_ids
        pairs.append(EncodedPair(prompt, tok(f"great, {s} works", add_special_tokens=False).input_ids,
                                 tok(f"badly, {s} works", add_special_tokens=False).input_ids))
    gaps = {}
    for objective in OBJECTIVES:
        rt = RewardTransformer.from_pretrained(str(tiny_models["generator"]), hidden_size=32)
        train_reward_channel(rt, pairs, tok.pad_token_id, epochs=15, batch_size=8, learning_rate=3e-3,
                             progress=False, objective=objective)
        with torch.no_grad():
            chosen, rejected = response_rewards(rt, pairs, tok.pad_token_id)
        assert all(c[-1] > r[-1] for c, r in zip(chosen, rejected)), objective
        gaps[objective] = torch.cat([(row[:-1] - row[-1]).abs() for row in chosen + rejected]).mean().item()
    assert gaps["tcrm"] < 0.5 * gaps["sla"], gaps


def test_the_channel_objective_is_checked(tiny_models, tmp_path, capsys):
    tok = load_tokenizer(str(tiny_models["generator"]))
    rt = RewardTransformer.from_pretrained(str(tiny_models["generator"]), hidden_size=8)
    with pytest.raises(InputError, match="objective: unknown reward channel objective 'value'"):
        train_reward_channel(rt, synthetic_pairs(tok, 2), tok.pad_token_id, max_steps=1, progress=False,
                             objective="value")
    assert train_main(["--pairs", str(tmp_path / "none"), "--generator", str(tiny_models["generator"]),
                       "--output", str(tmp_path / "rt"), "--objective", "tcrm", "--td-weight", "-1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("--td-weight must be >= 0, got -1.0")


def test_a_channel_trains_on_reward_data_and_is_scored_held_out(tiny_models, tmp_path, capsys):
    """--pairs DIR/reward-data trains on the judge's pairs of the generator's own samples, with the
    token ids it sampled after the formatted prompt; benchmarks.reward_heldout --channel then reads
    R' on the held-out samples exactly as channel_scores does."""
    from benchmarks import reward_heldout
    from pipeline.training.cached_steps import load_prompts
    from pipeline.training.reward_channel import judged_pair_rows

    tok = load_tokenizer(str(tiny_models["generator"]))
    data = tmp_path / "reward-data"
    data.mkdir()
    texts = ["the lamp works great and I keep it on", "no no it is bad", "the lamp is good", "no the lamp no"]
    for split in ("train", "eval"):
        file = write_jsonl(tmp_path / f"{split}.jsonl", [{"prompt": f"Review the {t} ({split})."}
                                                          for t in ("lamp", "battery", "camera")])
        prompts = load_prompts(str(file), tok, 16)
        samples, judged = [], []
        for p in prompts:
            for k, t in enumerate(texts):
                ids = tok(t, add_special_tokens=False).input_ids
                samples.append({"prompt": p.reward_input, "prompt_id": p.prompt_id, "sample": k, "eos": True,
                                "token_ids": ids, "text": tok.decode(ids, skip_special_tokens=True)})
                judged.append({"prompt_id": p.prompt_id, "sample": k, "followed": ["no" not in t.split(), True]})
        write_jsonl(data / f"samples-{split}.jsonl", samples)
        write_jsonl(data / f"judged-{split}.jsonl", judged)
    (data / "settings.json").write_text(json.dumps({"prompts": str(tmp_path / "train.jsonl"), "max_new_tokens": 16,
                                                    "eval_prompts": str(tmp_path / "eval.jsonl"),
                                                    "eval_max_new_tokens": 16}))
    rows = judged_pair_rows(data, "train", tok)
    assert len(rows) == 3 * 4 and all("no" in r["rejected"].split() for r in rows)
    encoded = encode_pairs(rows, tok)
    first = load_prompts(str(tmp_path / "train.jsonl"), tok, 16)[0]
    assert encoded[0].prompt == list(first.token_ids) and encoded[0].chosen == rows[0]["chosen_token_ids"]

    out = tmp_path / "rt"
    assert train_main(["--pairs", str(data), "--generator", str(tiny_models["generator"]), "--output", str(out),
                       "--objective", "tcrm", "--hidden-size", "8", "--max-steps", "3", "--batch-size", "4",
                       "--no-progress"]) == 0
    assert "train_pairs: 10" in capsys.readouterr().out  # 12 pairs, 0.2 of them held out of training
    figures_file = tmp_path / "figures.json"
    assert reward_heldout.main(["--data", str(data), "--channel", str(out), "--taus", "2", "3",
                                "--json", str(figures_file)]) == 0
    got = json.loads(figures_file.read_text())["rewards"][f"channel {out}"]
    samples = [json.loads(line) for line in (data / "samples-eval.jsonl").read_text().splitlines()]
    ids = {p.prompt_id: list(p.token_ids) for p in load_prompts(str(tmp_path / "eval.jsonl"), tok, 16)}
    rt = RewardTransformer.from_pretrained(str(out))
    final, partial = channel_scores(rt, [(ids[s["prompt_id"]], s["token_ids"]) for s in samples], [2, 3],
                                    tok.pad_token_id)
    with torch.no_grad():  # one response alone, unpadded: R' after its second token and at its end
        one = rt.token_rewards(torch.tensor([ids[samples[1]["prompt_id"]] + samples[1]["token_ids"]]),
                               torch.ones(1, len(ids[samples[1]["prompt_id"]]) + len(samples[1]["token_ids"]),
                                          dtype=torch.long))[0]
    prompt_len = len(ids[samples[1]["prompt_id"]])
    assert partial[2][1] == pytest.approx(one[prompt_len + 1].item(), abs=1e-5)
    assert final[1] == pytest.approx(one[-1].item(), abs=1e-5)
    pairs = [(c, r) for c in range(12) for r in range(12) if c // 4 == r // 4 and "no" not in texts[c % 4].split()
             and "no" in texts[r % 4].split()]
    agree = sum(1.0 if final[c] > final[r] else 0.5 if final[c] == final[r] else 0.0 for c, r in pairs) / len(pairs)
    assert got["pairs"] == len(pairs) == 12 and got["agreement"] == pytest.approx(agree, abs=1e-4)
    assert got["prefix_agreement"]["2"]["pairs"] == 12  # every response is longer than 2 tokens
    with pytest.raises(SystemExit):
        reward_heldout.main(["--data", str(data), "--channel", str(tiny_models["generator"])])
    assert "has no trained reward channel" in capsys.readouterr().err


def build(tiny_models, prompts, output, generator, *extra):
    return build_main(["--config", "configs/demo.yaml", "--prompts", str(prompts), "--output", str(output),
                       "--set", f"models.generator={generator}", "--set", f"models.reward={tiny_models['reward']}",
                       "--set", "runtime.local=true", "--max-new-tokens", "12", "--num-samples", "4",
                       "--no-progress", *extra])


@pytest.fixture(scope="module")
def own_pairs(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rt-build")
    prompts = write_jsonl(tmp / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS])
    assert build(tiny_models, prompts, tmp / "pairs", tiny_models["generator"], "--strategy", "best_of_n") == 0
    return tmp, prompts


def test_own_pairs_train_bt_and_dpo_then_sla_builds(own_pairs, tiny_models, capsys):
    tmp, prompts = own_pairs
    common = ["--pairs", str(tmp / "pairs"), "--generator", str(tiny_models["generator"]), "--epochs", "2",
              "--batch-size", "2", "--hidden-size", "16", "--learning-rate", "1e-3", "--no-progress"]
    assert train_main([*common, "--output", str(tmp / "rt")]) == 0
    out = capsys.readouterr().out
    for key in ("train_loss:", "pairwise_accuracy:", "autrc:", "eval_pairs:"):
        assert key in out
    metrics = json.loads((tmp / "rt" / "training_metrics.json").read_text())
    assert metrics["train_pairs"] + metrics["eval_pairs"] == len(GOOD_PROMPTS)
    frozen = AutoModelForCausalLM.from_pretrained(tmp / "rt").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_models["generator"]).state_dict()
    assert all(torch.equal(frozen[k], initial[k]) for k in initial)

    assert train_main([*common, "--output", str(tmp / "rt-dpo"), "--dpo", "--dpo-steps", "2",
                       "--dpo-learning-rate", "1e-3"]) == 0
    assert "dpo_train_loss:" in capsys.readouterr().out
    updated = AutoModelForCausalLM.from_pretrained(tmp / "rt-dpo").state_dict()
    assert any(not torch.equal(updated[k], initial[k]) for k in initial)
    assert has_trained_channel(str(tmp / "rt-dpo"))

    engine = HFEngine.from_pretrained(str(tmp / "rt"))
    assert isinstance(engine.model, RewardTransformer)

    # sla as a build_dataset strategy, on the trained Reward Transformer.
    assert build(tiny_models, prompts, tmp / "sla", tmp / "rt-dpo", "--strategy", "sla",
                 "--set", "strategy.step_size=4") == 0
    manifest = json.loads((tmp / "sla" / "_manifest.json").read_text())
    assert manifest["pairs"] + manifest["prompts_rejected"] == len(GOOD_PROMPTS) and manifest["pairs"] >= 4
    rows = pq.read_table(tmp / "sla" / "train-00000.parquet").to_pylist()
    assert all(r["strategy"] == "sla" and r["num_candidates"] == 4 for r in rows)
    # The searches explore what they do not keep: with k = 2 every committed action had a decoded
    # sibling, and the first step fills d = 2 levels, so each prompt's 4 searches decode at least
    # twice what its chosen and rejected responses hold (tokens the generator sampled, no EOS).
    kept = sum(len(r["chosen_token_ids"]) + len(r["rejected_token_ids"]) for r in rows)
    assert sum(r["generated_tokens"] for r in rows) >= 2 * kept > 0
    assert manifest["config"]["strategy"] == {"name": "sla", "search_depth": 2, "search_width": 2, "step_size": 4}


def test_the_channel_trains_on_the_token_ids_the_generator_sampled(own_pairs, tiny_models):
    """SLA scores the ids the generator sampled; decoding them and tokenizing the text again gives
    other ids (BPE merges across sampled tokens), so training reads the build's ids."""
    from pipeline.training.dpo import load_pairs
    from pipeline.training.reward_channel import encode_pairs

    tmp, _ = own_pairs
    pairs = load_pairs(str(tmp / "pairs"), token_ids=True)
    tok = load_tokenizer(str(tiny_models["generator"]))
    encoded = encode_pairs(pairs, tok)
    assert len(encoded) == len(pairs)
    for row, enc in zip(pairs, encoded):
        assert (enc.prompt, enc.chosen, enc.rejected) == (row["prompt_token_ids"], row["chosen_token_ids"],
                                                          row["rejected_token_ids"])
        assert tok.decode(enc.chosen, skip_special_tokens=True) == row["chosen"]
    retokenized = [tok(r["chosen"], add_special_tokens=False).input_ids for r in pairs]
    assert any(ids != row["chosen_token_ids"] for ids, row in zip(retokenized, pairs))
    # Without the id columns (pairs from elsewhere) the text is tokenized.
    text_only = encode_pairs(load_pairs(str(tmp / "pairs")), tok)
    assert [e.chosen for e in text_only] == retokenized


def test_sla_build_on_a_plain_model_is_a_config_error(own_pairs, tiny_models, tmp_path, capsys):
    _, prompts = own_pairs
    assert build(tiny_models, prompts, tmp_path / "o", tiny_models["generator"], "--strategy", "sla") == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: models.generator:") and "trained reward channel" in errors[0]
