"""The real reward model's training workflow, steps 4-6 of jobs.fetch_models (their outputs and
reports: pipeline.training.real_models' docstring): the generator's own samples, the judge's
verdicts on them, the frozen bottom layers' states, and the Bradley-Terry reward model trained on
them (pipeline.training.reward_model) and evaluated on held-out prompts
(pipeline.training.reward_evaluation)."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pipeline.errors import FetchError
from pipeline.training.cached_steps import load_instructions, load_prompts, sample_cached, skip, stamp, write_atomic

log = logging.getLogger(__name__)
COMMITTED = "committed model"
"""``reward_source`` of a reward model assembled from the committed artifact (the fast path)."""


@dataclass
class RewardSettings:
    """The reward model's settings; a field with a "help" in its metadata is a flag of
    jobs.fetch_models (jobs.cli.add_settings_flags)."""

    prompts: str = field(default="configs/prompts/ifeval-train.jsonl", metadata={
        "help": "training prompts (JSONL with IFEval's columns: prompt, instruction_id_list, kwargs)"})
    """Training prompts: JSONL rows with "prompt", "instruction_id_list" and "kwargs" (IFEval's columns)."""
    eval_prompts: str = field(default="configs/prompts/ifeval-eval.jsonl", metadata={
        "help": "held-out prompts, same columns, none shared with --prompts"})
    """Held-out prompts: agreement, correlations and accuracy are measured on their samples only."""
    samples_per_prompt: int = field(default=8, metadata={"help": "responses sampled per training prompt (>= 2)"})
    """Responses sampled per training prompt."""
    eval_samples_per_prompt: int = field(default=8, metadata={
        "help": "responses sampled per held-out prompt (>= 2)"})
    """Responses sampled per held-out prompt (the per-prompt correlations need several longer than tau)."""
    sampling_dtype: str = field(default="bfloat16", metadata={
        "help": "the generator's dtype while it samples (bfloat16: 1.8x faster on AMX CPUs)",
        "choices": ("float32", "bfloat16", "float16")})
    """The generator's dtype while it samples (pipeline.engines.hf.HFEngine, models.dtype's values):
    "bfloat16" decodes 1.8x faster on this project's CPUs (AMX; docs/benchmarks.md, "bfloat16 sampling")."""
    max_new_tokens: int = field(default=128, metadata={"help": "token cap of the training samples"})
    """Token cap of the training samples."""
    eval_max_new_tokens: int = field(default=256, metadata={
        "help": "token cap of the held-out samples (above the largest tau)"})
    """Token cap of the held-out samples (above the largest tau)."""
    temperature: float = 1.0
    seed: int = field(default=0, metadata={"help": "seed of the samples and the training"})
    rows_per_batch: int = 128
    """Generator rows decoded together."""
    taus: list[int] = field(default_factory=lambda: [16, 32, 64, 128])
    """Decision tokens of the held-out partial-vs-final correlations."""
    train_taus: list[int] = field(default_factory=lambda: [32, 64], metadata={
        "help": "cuts (tokens) of the training prefix pairs"})
    """Cuts of the training prefix pairs."""
    lora_layers: int = field(default=8, metadata={
        "help": "top decoder layers with LoRA factors (the ones below are frozen); every layer with --lora-rank 0 "
                "is a full fine-tune of the projections"})
    """Top decoder layers with LoRA factors; the layers below them are frozen and run once per text."""
    lora_rank: int = field(default=8, metadata={
        "help": "rank of the LoRA factors (0: train the --lora-layers layers' projections in full; an artifact of "
                "about 14 MB per layer)"})
    """Rank of the LoRA factors; 0 trains the top layers' projections in full (full-rank updates,
    about 14 MB of float32 per layer in the artifact instead of about 0.3 MB)."""
    lora_alpha: float = 16.0
    """LoRA's alpha (jobs.fetch_models sets it to twice --lora-rank)."""
    epochs: int = field(default=2, metadata={"help": "reward model training epochs"})
    learning_rate: float = field(default=1e-3, metadata={"help": "reward model learning rate"})
    prefix_weight: float = field(default=0.5, metadata={
        "help": "weight of the prefix pairs' loss against the final pairs'"})
    """Weight of the prefix pairs' Bradley-Terry loss against the final pairs' (reward_model docstring)."""
    distill_weight: float = field(default=1.0, metadata={
        "help": "weight of the loss teaching partial rewards to rank as final ones"})
    """Weight of the partial-ranks-as-final loss (pipeline.training.reward_model.rank_distillation_loss)."""
    mc_weight: float = field(default=0.0, metadata={
        "help": "weight of TCRM's Monte Carlo term: each cut's reward regressed on the final reward"})
    """Weight of TCRM's Monte Carlo term (pipeline.training.reward_model.value_consistency_loss)."""
    td_weight: float = field(default=0.0, metadata={
        "help": "weight of TCRM's temporal-difference term: each cut's reward regressed on the next cut's"})
    """Weight of TCRM's temporal-difference term (pipeline.training.reward_model.value_consistency_loss)."""
    bf16: bool = field(default=True, metadata={
        "help": "train under bfloat16 autocast (fast on CPUs with AVX512-BF16)"})
    """Training passes under bfloat16 autocast (pipeline.training.reward_model.TrainingSettings.bf16):
    about 1.6x faster on this project's CPUs (AVX512-BF16); --no-bf16 where a CPU lacks it."""
    prompts_per_step: int = 4
    head_l2: float = 1e-2
    """l2 of the linear probe that starts the score head."""
    validation_every: int = 8
    """Every validation_every-th training prompt is held out of training, to pick the epoch."""

    def __post_init__(self):
        for name in ("samples_per_prompt", "eval_samples_per_prompt", "max_new_tokens", "eval_max_new_tokens",
                     "rows_per_batch", "lora_layers", "epochs", "prompts_per_step"):
            if getattr(self, name) < 1:
                raise FetchError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("samples_per_prompt", "eval_samples_per_prompt"):
            if getattr(self, name) < 2:
                raise FetchError(f"{name} must be >= 2 to make pairs, got {getattr(self, name)}")
        if self.sampling_dtype not in ("float32", "bfloat16", "float16"):
            raise FetchError(f"sampling_dtype must be float32, bfloat16 or float16, got {self.sampling_dtype!r}")
        if self.lora_rank < 0:
            raise FetchError(f"lora_rank must be >= 0 (0: full rank), got {self.lora_rank}")
        if self.validation_every < 2:
            raise FetchError(f"validation_every must be >= 2, got {self.validation_every}")
        for name in ("prefix_weight", "distill_weight", "mc_weight", "td_weight"):
            if getattr(self, name) < 0:
                raise FetchError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise FetchError(f"learning_rate must be > 0, got {self.learning_rate}")



SAMPLING_KEYS = ("prompts", "eval_prompts", "samples_per_prompt", "eval_samples_per_prompt", "sampling_dtype",
                 "max_new_tokens", "eval_max_new_tokens", "temperature", "seed", "rows_per_batch")
"""The settings the samples depend on: only these (and the generator) make steps 4-6 start over;
the others retrain on the same samples (and the same bottom states, unless lora_layers or
train_taus changed)."""


def judge_description() -> str:
    from importlib.metadata import version

    return f"IFEval strict (lm-eval {version('lm_eval')} instructions_registry)"


def build_reward_model(generator: Path, output: Path, settings: RewardSettings, progress: bool = True) -> dict:
    """Steps 4-6 (module docstring); returns the report (read back when step 6 is skipped)."""
    data, reward = output / "reward-data", output / "reward"
    wanted = asdict(settings)
    stamp(data, reward, {"generator": str(generator), **{k: wanted[k] for k in SAMPLING_KEYS}}, "sampling settings")
    if (reward / "report.json").exists():
        report = json.loads((reward / "report.json").read_text())
        if report.get("reward_source") == "trained" and report.get("settings") == wanted:
            skip(reward)
            return report
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(str(generator)).num_hidden_layers
    if settings.lora_layers > layers:  # before any sampling
        raise FetchError(f"--lora-layers: at most the generator's {layers} layers, got {settings.lora_layers}")
    start, seconds = time.perf_counter(), {}
    caps = {"train": settings.max_new_tokens, "eval": settings.eval_max_new_tokens}
    counts = {"train": settings.samples_per_prompt, "eval": settings.eval_samples_per_prompt}
    files = {"train": settings.prompts, "eval": settings.eval_prompts}
    instructions = {split: load_instructions(files[split]) for split in files}
    engine = None
    splits = {}
    for split in ("train", "eval"):
        path = data / f"samples-{split}.jsonl"
        if not path.exists() and engine is None:
            from pipeline.engines.hf import HFEngine

            engine = HFEngine.from_pretrained(str(generator), dtype=settings.sampling_dtype)
        if engine is not None:
            prompts = load_prompts(files[split], engine.tokenizer, caps[split])
            if split == "eval":
                _check_disjoint(splits["train"][0], prompts, settings)
        t, cached = time.perf_counter(), path.exists()
        samples = sample_cached(path, engine, prompts if engine is not None else None, caps[split],
                           replace(settings, samples_per_prompt=counts[split]), progress)
        seconds[f"sample_{split}"] = _sampling_seconds(data, split, None if cached else time.perf_counter() - t)
        t = time.perf_counter()
        judgements = _judged(data / f"judged-{split}.jsonl", samples, instructions[split], files[split])
        seconds[f"judge_{split}"] = round(time.perf_counter() - t, 1)
        splits[split] = (samples, judgements)
    if engine is None:
        _check_disjoint(splits["train"][0], splits["eval"][0], settings)
    del engine
    return _train_and_evaluate(generator, data, reward, splits, settings, seconds, start, progress)


def lora_scale(rank: int, alpha: float) -> float:
    """LoRA's alpha / rank (1 for rank 0: full-rank updates merge as they are)."""
    return alpha / rank if rank else 1.0


def _adapter(settings: RewardSettings) -> str:
    if settings.lora_rank == 0:
        return "full-rank updates"
    return f"LoRA (rank {settings.lora_rank}, alpha {settings.lora_alpha})"


def _sampling_seconds(data: Path, split: str, seconds: float | None) -> float | None:
    """The seconds step 4 took for ``split``: recorded in DATA/sampling-seconds.json when it ran
    (``seconds``), read back from there when its samples were cached (None if never recorded)."""
    record = data / "sampling-seconds.json"
    known = json.loads(record.read_text()) if record.exists() else {}
    if seconds is not None:
        known[split] = round(seconds, 1)
        write_atomic(record, json.dumps(known))
    return known.get(split)


def _check_disjoint(train: list, held: list, settings: RewardSettings) -> None:
    overlap = {p.prompt_id for p in train} & {p.prompt_id for p in held}
    if overlap:
        raise FetchError(f"{settings.eval_prompts}: {len(overlap)} held-out prompts are also in {settings.prompts}")



def _judged(path: Path, samples: list, instructions: dict, prompt_file: str):
    """The judge's verdict on every sample (pipeline.training.judged_samples.judge_samples), cached
    as one JSON line per sample: the instructions' ids and whether each was followed."""
    from pipeline.training.judged_samples import Judgement, judge_samples

    missing = {s.prompt_id for s in samples} - set(instructions)
    if missing:
        raise FetchError(f"{prompt_file}: {len(missing)} sampled prompts are not in the file (samples of another file?)")
    if path.exists():
        skip(path)
        return [Judgement(json.loads(line)["followed"]) for line in path.read_text().splitlines()]
    log.info("judging %d samples -> %s", len(samples), path)
    judgements = judge_samples(samples, instructions)
    write_atomic(path, "".join(json.dumps({"prompt_id": s.prompt_id, "sample": s.sample,
                                            "instruction_id_list": instructions[s.prompt_id][0],
                                            "followed": j.followed}) + "\n" for s, j in zip(samples, judgements)))
    return judgements


def _bottom_states(path: Path, model, groups: list, pad_id: int, key: dict, progress: bool) -> None:
    """Fills the groups' bottom states (pipeline.training.reward_model.bottom_states), cached in
    ``path`` with the settings they depend on (``key``) and the texts' lengths as a check."""
    import torch
    from tqdm import tqdm

    from pipeline.training.reward_model import bottom_states

    lengths = [[len(t.token_ids) for t in g.texts] for g in groups]
    if path.exists():
        cached = torch.load(path)
        if cached["key"] == key and cached["lengths"] == lengths:
            skip(path)
            for g, head, states in zip(groups, cached["heads"], cached["states"]):
                g.head_states, g.states = head, states
            return
    with tqdm(total=len(groups), desc="bottom layers", disable=not progress) as bar:
        bottom_states(model, groups, pad_id, bar)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    torch.save({"key": key, "lengths": lengths, "heads": [g.head_states for g in groups],
                "states": [g.states for g in groups]}, tmp)
    os.replace(tmp, path)


def _train_and_evaluate(generator: Path, data: Path, reward: Path, splits: dict, settings: RewardSettings,
                        seconds: dict, start: float, progress: bool) -> dict:
    from safetensors.torch import save_file

    from pipeline.engines.rewards import RewardScorer
    from pipeline.training.judged_samples import preference_pairs
    from pipeline.training.lora import LORA_TARGETS, save_reward_model
    from pipeline.training.reward_evaluation import (best_of_n_accuracy, pairwise_agreement, partial_final_correlations,
                                                     partial_rewards)

    train, judged = splits["train"]
    fractions = [j.fraction for j in judged]
    train_pairs = preference_pairs([s.prompt_id for s in train], fractions, 0.0)
    if not train_pairs:
        raise FetchError(f"{settings.prompts}: no preference pairs (the judge gives every sample of each prompt "
                         "the same fraction of instructions followed)")
    model, groups, fit, val, training = _train(generator, data, train, fractions, settings, seconds, progress)
    factors = model.factors()
    scale = lora_scale(settings.lora_rank, settings.lora_alpha)
    tmp = reward.with_name(f"{reward.name}.building")
    save_reward_model(generator, factors, scale, tmp)

    t = time.perf_counter()
    scorer = RewardScorer.from_pretrained(str(tmp))
    check, scorer_diff = _check_saved(scorer, model, val or fit, train)
    held, held_judged = splits["eval"]
    final = scorer.score([s.prompt for s in held], [s.text for s in held])
    held_pairs = preference_pairs([s.prompt_id for s in held], [j.fraction for j in held_judged], 0.0)
    partial = partial_rewards(scorer, held, settings.taus, scorer.tokenizer)
    seconds["evaluate"] = round(time.perf_counter() - t, 1)
    first = model.first_top_layer
    frozen = f"layers 0..{first - 1} frozen" if first else "no layer frozen"
    report = {
        "reward_source": "trained",
        "judge": judge_description(),
        "generator": str(generator),
        "model": {"about": f"LlamaForSequenceClassification from the generator: {frozen}, {_adapter(settings)} on "
                           f"{', '.join(LORA_TARGETS)} of layers {first}..{first + settings.lora_layers - 1}, "
                           "score head trained, merged",
                  "trainable_parameters": sum(v.numel() for v in factors.values())},
        "settings": asdict(settings),
        "train_prompts": len(groups),
        "train_samples": len(train),
        "train_samples_ended_with_eos": sum(s.eos for s in train),
        "train_prompts_with_pairs": len({train[c].prompt_id for c, _ in train_pairs}),
        "train_pairs": len(train_pairs),
        "training_prompts": training.pop("trained_prompts"),
        "training_pairs": training.pop("training_pairs"),
        "training_prefix_pairs": training.pop("training_prefix_pairs"),
        "validation_prompts": len(val),
        "training": training,
        "train_ifeval_accuracy": best_of_n_accuracy(train, judged, fractions)["random_sample"],
        "heldout_prompts": len({s.prompt_id for s in held}),
        "heldout_samples": len(held),
        "heldout_samples_ended_with_eos": sum(s.eos for s in held),
        "heldout_pairs": len(held_pairs),
        "heldout_agreement": round(pairwise_agreement(final, held_pairs), 4),
        # What the agreement is made of: pairs whose two responses ended alike (both with EOS, or
        # both at the cap) against finished-vs-cut pairs, and two text-blind rules for reference.
        "heldout_agreement_detail": _agreement_detail(held, final, held_pairs),
        # IFEval strict accuracy of the held-out samples: a random sample (every sample counted),
        # the reward model's best of each prompt's samples, and the judge's own best and worst.
        "heldout_ifeval_accuracy": best_of_n_accuracy(held, held_judged, final),
        # The saved directory, loaded as RewardScorer, against the training-time model's scores.
        "scorer_vs_features_max_abs_diff": scorer_diff,
        "scorer_checked_texts": len(check),
        "partial_final_correlation": partial_final_correlations(held, final, partial),
        "seconds": seconds,
        "build_seconds": round(time.perf_counter() - start, 1),
    }
    weights = data / "reward-lora.safetensors"
    tmp_weights = weights.with_name(f".{weights.name}.{uuid.uuid4().hex[:8]}")
    save_file({k: v.contiguous() for k, v in factors.items()}, str(tmp_weights),
              metadata={"settings": json.dumps(asdict(settings), sort_keys=True)})
    os.replace(tmp_weights, weights)
    (tmp / "report.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(reward, ignore_errors=True)
    tmp.rename(reward)
    return report


def _train(generator: Path, data: Path, train: list, fractions: list[float], settings: RewardSettings,
           seconds: dict, progress: bool) -> tuple:
    """Step 6's training: the split model, its bottom states (cached), every validation_every-th
    training prompt held out to pick the epoch, and Bradley-Terry training on the others.
    Returns (model, the training prompts' text groups, the groups trained on, the validation
    groups, the training history); ``seconds`` gets bottom_states and train."""
    from pipeline.engines.hf import load_tokenizer
    from pipeline.training.lora import split_reward_model
    from pipeline.training.reward_model import TrainingSettings, reward_texts, train_reward_model

    tokenizer = load_tokenizer(str(generator))
    t = time.perf_counter()
    model = split_reward_model(generator, settings.lora_layers, settings.lora_rank, settings.lora_alpha, settings.seed)
    groups = reward_texts(tokenizer, train, settings.train_taus)
    _bottom_states(data / "states-train.pt", model, groups, int(tokenizer.pad_token_id),
                   {"lora_layers": settings.lora_layers, "train_taus": settings.train_taus}, progress)
    seconds["bottom_states"] = round(time.perf_counter() - t, 1)
    val = [g for k, g in enumerate(groups) if k % settings.validation_every == settings.validation_every - 1]
    fit = [g for k, g in enumerate(groups) if k % settings.validation_every != settings.validation_every - 1]
    training = train_reward_model(model, fit, val, train, fractions, TrainingSettings(
        epochs=settings.epochs, learning_rate=settings.learning_rate, prefix_weight=settings.prefix_weight,
        distill_weight=settings.distill_weight, mc_weight=settings.mc_weight, td_weight=settings.td_weight,
        bf16=settings.bf16,
        prompts_per_step=settings.prompts_per_step, head_l2=settings.head_l2, seed=settings.seed), progress)
    seconds["train"] = training.pop("seconds")
    return model, groups, fit, val, training


def _check_saved(scorer, model, groups: list, train: list) -> tuple[list, float]:
    """The saved directory, read as RewardScorer reads it (``scorer``), against the training-time
    (split) model on the final texts of the first 16 ``groups`` (the validation prompts, or the
    first training prompts when there are none): (the texts checked as (sample, score), the
    largest difference); RuntimeError when it is 1e-3 or more."""
    import torch

    from pipeline.training.reward_model import top_scores

    with torch.no_grad():
        check = [(t_.sample, float(v)) for g in groups[:16] for t_, v in zip(g.texts, top_scores(model, g))
                 if t_.tau == 0]
    saved = scorer.score([train[i].prompt for i, _ in check], [train[i].text for i, _ in check])
    scorer_diff = max((abs(a - b) for (_, a), b in zip(check, saved)), default=0.0)
    if not scorer_diff < 1e-3:
        raise RuntimeError(f"the saved reward model scores differ from training by {scorer_diff} (> 1e-3)")
    return check, scorer_diff


def _agreement_detail(held: list, rewards: list[float], pairs: list[tuple[int, int]]) -> dict:
    from pipeline.training.reward_evaluation import pairwise_agreement as agreement

    alike = [(c, r) for c, r in pairs if held[c].eos == held[r].eos]
    mixed = [(c, r) for c, r in pairs if held[c].eos != held[r].eos]

    def rounded(value: float) -> float | None:
        return round(value, 4) if math.isfinite(value) else None  # NaN: no such pairs

    return {"pairs_ending_alike": len(alike), "agreement_ending_alike": rounded(agreement(rewards, alike)),
            "pairs_finished_vs_cut": len(mixed), "agreement_finished_vs_cut": rounded(agreement(rewards, mixed)),
            "baseline_finished_first": rounded(agreement([float(s.eos) for s in held], pairs)),
            "baseline_shorter_first": rounded(agreement([-len(s.token_ids) for s in held], pairs))}


def format_report(report: dict, reward: Path) -> str:
    if report.get("reward_source") == COMMITTED:
        updates = "full-rank updates" if report["settings"]["lora_rank"] == 0 else "LoRA factors"
        source = (f"the generator + the committed {updates} and head {report['artifact']} (its GGUF sha256 "
                  "matches; --retrain trains one here)")
    else:
        source = "trained here (steps 4-6)"
    accuracy = report["heldout_ifeval_accuracy"]
    lines = [f"reward model: {reward}",
             f"  source: {source}",
             f"  judge: {report['judge']}",
             f"  {report['model']['about']}",
             f"  training pairs: {report['training_pairs']} final + {report['training_prefix_pairs']} prefix (from "
             f"{report['train_samples']} samples of {report['train_prompts']} prompts, {report['validation_prompts']} "
             f"of them for validation; best epoch {report['training']['best_epoch']})",
             f"  held-out agreement with the judge: {report['heldout_agreement']:.3f} "
             f"({report['heldout_pairs']} pairs, {report['heldout_prompts']} prompts)",
             "  of which: pairs ending alike {agreement_ending_alike} ({pairs_ending_alike}), finished vs cut "
             "{agreement_finished_vs_cut} ({pairs_finished_vs_cut}); rules: finished first {baseline_finished_first}, "
             "shorter first {baseline_shorter_first}".format(**report["heldout_agreement_detail"]),
             "  held-out IFEval strict accuracy (prompt / instruction level): " + ", ".join(
                 f"{name.replace('_', ' ')} {v['prompt_level_strict']} / {v['instruction_level_strict']}"
                 for name, v in accuracy.items()),
             "  partial vs final reward on held-out responses (appendix D):",
             f"  {'tau':>5} {'n':>5} {'pearson':>8} {'kendall':>8} {'per-prompt pearson':>19} {'kendall':>8}"]
    for tau, c in report["partial_final_correlation"].items():
        cells = [c["pearson"], c["kendall"], c["per_prompt_pearson"], c["per_prompt_kendall"]]
        p, k, pp, pk = ("-" if v is None else f"{v:.3f}" for v in cells)
        lines.append(f"  {tau:>5} {c['responses_longer_than_tau']:>5} {p:>8} {k:>8} {pp:>19} {pk:>8}")
    return "\n".join(lines)
