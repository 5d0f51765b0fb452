"""The real models' training workflow: a reward model trained on the generator's own samples with
IFEval's checkers as the judge (or the committed one, merged into the generator), and a draft model
distilled from the generator. ``bon-fetch-models`` (jobs.fetch_models) fetches and converts the
generator (its steps 1-3) and runs these steps after them, numbered as that job numbers them.

Each step is skipped when its output exists and is complete, and each output is written under a
temporary name and renamed into place, so an interrupted run leaves nothing that looks complete:
4. DIR/reward-data/samples-{train,eval}.jsonl: --samples-per-prompt complete responses per prompt
   of --prompts (training) and --eval-samples-per-prompt of --eval-prompts (held out; longer cap,
   so that a partial reward at tau = 128 is not the final one), sampled from the generator (in
   --sampling-dtype) at temperature 1 with per-row seeds. The
   prompt files have IFEval's columns: prompt, instruction_id_list, kwargs (and key);
5. DIR/reward-data/judged-{train,eval}.jsonl: the judge's verdict on every sample, per
   instruction (pipeline.judge.check, IFEval strict);
6. DIR/reward-data/states-train.pt: the frozen bottom layers' states of every training text (each
   sample whole and cut at --train-taus), and DIR/reward: the Bradley-Terry reward model
   (pipeline.training.reward_model: LoRA on the top --lora-layers layers plus the score head,
   merged), an AutoModelForSequenceClassification directory that RewardScorer and vLLM load, with
   report.json: the judge, the training pairs and history, the held-out agreement with the judge,
   the partial-vs-final reward correlations at tau = 16, 32, 64, 128 (the speculative-rejection
   paper's appendix D), the held-out samples' IFEval accuracy, and each step's seconds.
DIR/reward-data/settings.json records the sampling settings (SAMPLING_KEYS); a run with other
sampling settings redoes steps 4-6, one with other training settings retrains on the same samples.
With --draft (`make real-draft`), two more steps:
7. DIR/draft-data/samples-{train,eval}.jsonl: --draft-samples-per-prompt responses per training
   prompt and one per held-out prompt (temperature 1, at most 128 tokens, seeded rows);
8. DIR/draft: a draft model sharing the generator's tokenizer: the generator's first
   --draft-layers layers, distilled on those samples (pipeline.training.draft: forward KL to the
   generator's distribution), with report.json: the held-out acceptance probability of speculative
   sampling, greedy agreement and KL. About 13 minutes on 2 CPU cores; `models.draft` of a DSBD
   build, and `benchmarks.dsbd --models DIR`.

The fast path (``reward_model``, the default): the trained reward model is the generator's network
plus LoRA factors and a head (about 2.6 MB), so the model trained here once is committed
(artifacts/real-reward-model.json, with the GGUF's sha256, the settings, the weights' sha256 and the
training report, and artifacts/real-reward-model.safetensors). When the extracted GGUF has that
sha256, the settings are the committed ones and the weights are the recorded ones, steps 4-6 are
replaced by merging the committed factors into the generator (seconds instead of about an hour on
2 cores); DIR/reward/report.json is then the committed training report, marked
``"reward_source": "committed model"``. Otherwise, or with --retrain, steps 4-6 run.
--committed-only fails (one line, exit 2) instead of training; --save-artifact FILE.json writes the
trained model in the committed format (FILE.json and FILE.safetensors, to refresh the committed one).
A user error (a bad prompt file, settings out of range, an artifact that does not fit under
--committed-only) is a FetchError: one line, and the job exits 2.
"""

from __future__ import annotations

import hashlib
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

log = logging.getLogger(__name__)
COMMITTED = "committed model"
"""``reward_source`` of a reward model assembled from the committed artifact (the fast path)."""


@dataclass
class RewardSettings:
    prompts: str = "configs/prompts/ifeval-train.jsonl"
    """Training prompts: JSONL rows with "prompt", "instruction_id_list" and "kwargs" (IFEval's columns)."""
    eval_prompts: str = "configs/prompts/ifeval-eval.jsonl"
    """Held-out prompts: agreement, correlations and accuracy are measured on their samples only."""
    samples_per_prompt: int = 8
    """Responses sampled per training prompt."""
    eval_samples_per_prompt: int = 8
    """Responses sampled per held-out prompt (the per-prompt correlations need several longer than tau)."""
    sampling_dtype: str = "bfloat16"
    """The generator's dtype while it samples (pipeline.engines.hf.HFEngine, models.dtype's values):
    "bfloat16" decodes 1.8x faster on this project's CPUs (AMX; docs/benchmarks.md, "bfloat16 sampling")."""
    max_new_tokens: int = 128
    """Token cap of the training samples."""
    eval_max_new_tokens: int = 256
    """Token cap of the held-out samples (above the largest tau)."""
    temperature: float = 1.0
    seed: int = 0
    rows_per_batch: int = 128
    """Generator rows decoded together."""
    taus: list[int] = field(default_factory=lambda: [16, 32, 64, 128])
    """Decision tokens of the held-out partial-vs-final correlations."""
    train_taus: list[int] = field(default_factory=lambda: [32, 64])
    """Cuts of the training prefix pairs."""
    lora_layers: int = 8
    """Top decoder layers with LoRA factors; the layers below them are frozen and run once per text."""
    lora_rank: int = 8
    """Rank of the LoRA factors; 0 trains the top layers' projections in full (full-rank updates,
    about 14 MB of float32 per layer in the artifact instead of about 0.3 MB)."""
    lora_alpha: float = 16.0
    epochs: int = 2
    learning_rate: float = 1e-3
    prefix_weight: float = 0.5
    """Weight of the prefix pairs' Bradley-Terry loss against the final pairs' (reward_model docstring)."""
    distill_weight: float = 1.0
    """Weight of the partial-ranks-as-final loss (pipeline.training.reward_model.rank_distillation_loss)."""
    bf16: bool = True
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
        if self.prefix_weight < 0 or self.learning_rate <= 0:
            raise FetchError("prefix_weight must be >= 0 and learning_rate > 0")


# -- steps 4-6: the reward model --------------------------------------------------------------

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
    _stamp(data, reward, {"generator": str(generator), **{k: wanted[k] for k in SAMPLING_KEYS}}, "sampling settings")
    if (reward / "report.json").exists():
        report = json.loads((reward / "report.json").read_text())
        if report.get("reward_source") == "trained" and report.get("settings") == wanted:
            _skip(reward)
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
        samples = _samples(path, engine, prompts if engine is not None else None, caps[split],
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
        _write_atomic(record, json.dumps(known))
    return known.get(split)


def _check_disjoint(train: list, held: list, settings: RewardSettings) -> None:
    overlap = {p.prompt_id for p in train} & {p.prompt_id for p in held}
    if overlap:
        raise FetchError(f"{settings.eval_prompts}: {len(overlap)} held-out prompts are also in {settings.prompts}")


class _LogLines:
    """Stands in for a tqdm bar where there is none (stderr not a terminal, or --no-progress): a
    log line per ``update`` (a batch of prompts sampled)."""

    def __init__(self, what: str, total: int):
        self.what, self.total, self.done = what, total, 0

    def update(self, n: int) -> None:
        self.done += n
        log.info("%s: %d/%d prompts", self.what, self.done, self.total)


def _samples(path: Path, engine, prompts: list, cap: int, settings, progress: bool):
    from tqdm import tqdm

    from pipeline.training.judged_samples import Sample, sample_responses

    if path.exists():
        _skip(path)
        return [Sample(**json.loads(line)) for line in path.read_text().splitlines()]
    with tqdm(total=len(prompts), desc=f"sampling {path.stem}", disable=not progress) as bar:
        samples = sample_responses(engine, prompts, settings.samples_per_prompt, cap, settings.temperature,
                                   settings.seed, settings.rows_per_batch,
                                   bar if progress else _LogLines(f"sampling {path.stem}", len(prompts)))
    _write_atomic(path, "".join(json.dumps(asdict(s)) + "\n" for s in samples))
    return samples


def _judged(path: Path, samples: list, instructions: dict, prompt_file: str):
    """The judge's verdict on every sample (pipeline.training.judged_samples.judge_samples), cached
    as one JSON line per sample: the instructions' ids and whether each was followed."""
    from pipeline.training.judged_samples import Judgement, judge_samples

    missing = {s.prompt_id for s in samples} - set(instructions)
    if missing:
        raise FetchError(f"{prompt_file}: {len(missing)} sampled prompts are not in the file (samples of another file?)")
    if path.exists():
        _skip(path)
        return [Judgement(json.loads(line)["followed"]) for line in path.read_text().splitlines()]
    log.info("judging %d samples -> %s", len(samples), path)
    judgements = judge_samples(samples, instructions)
    _write_atomic(path, "".join(json.dumps({"prompt_id": s.prompt_id, "sample": s.sample,
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
            _skip(path)
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
    import torch
    from safetensors.torch import save_file

    from pipeline.engines.hf import load_tokenizer
    from pipeline.engines.rewards import RewardScorer
    from pipeline.training.judged_samples import preference_pairs
    from pipeline.training.lora import LORA_TARGETS, save_reward_model, split_reward_model
    from pipeline.training.reward_evaluation import (best_of_n_accuracy, pairwise_agreement, partial_final_correlations,
                                                     partial_rewards)
    from pipeline.training.reward_model import TrainingSettings, reward_texts, train_reward_model

    train, judged = splits["train"]
    fractions = [j.fraction for j in judged]
    train_pairs = preference_pairs([s.prompt_id for s in train], fractions, 0.0)
    if not train_pairs:
        raise FetchError(f"{settings.prompts}: no preference pairs (the judge gives every sample of each prompt "
                         "the same fraction of instructions followed)")
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
        distill_weight=settings.distill_weight, bf16=settings.bf16,
        prompts_per_step=settings.prompts_per_step, head_l2=settings.head_l2, seed=settings.seed), progress)
    seconds["train"] = training.pop("seconds")
    factors = model.factors()
    scale = lora_scale(settings.lora_rank, settings.lora_alpha)
    tmp = reward.with_name(f"{reward.name}.building")
    save_reward_model(generator, factors, scale, tmp)

    t = time.perf_counter()
    scorer = RewardScorer.from_pretrained(str(tmp))
    # The saved directory, read as RewardScorer reads it, against the training-time (split) model
    # on the final texts of the validation prompts (of the first training prompts when there are none).
    with torch.no_grad():
        from pipeline.training.reward_model import top_scores

        check = [(t_.sample, float(v)) for g in (val or fit)[:16] for t_, v in zip(g.texts, top_scores(model, g))
                 if t_.tau == 0]
    saved = scorer.score([train[i].prompt for i, _ in check], [train[i].text for i, _ in check])
    scorer_diff = max((abs(a - b) for (_, a), b in zip(check, saved)), default=0.0)
    if not scorer_diff < 1e-3:
        raise RuntimeError(f"the saved reward model scores differ from training by {scorer_diff} (> 1e-3)")
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


# -- steps 7-8 (--draft): the distilled draft model --------------------------------------------

@dataclass
class DraftSettings:
    layers: int = 4
    """Decoder layers kept from the generator."""
    samples_per_prompt: int = 2
    max_new_tokens: int = 128
    temperature: float = 1.0
    seed: int = 0
    epochs: int = 2
    learning_rate: float = 3e-4
    batch_size: int = 8
    rows_per_batch: int = 128
    """Generator rows decoded together while sampling."""

    def __post_init__(self):
        for name in ("layers", "samples_per_prompt", "max_new_tokens", "epochs", "batch_size", "rows_per_batch"):
            if getattr(self, name) < 1:
                raise FetchError(f"draft {name} must be >= 1, got {getattr(self, name)}")


def build_draft(generator: Path, output: Path, settings: DraftSettings, prompts: str, eval_prompts: str,
                progress: bool = True) -> dict:
    """Steps 7-8 (module docstring); returns the draft's report (read back when it is complete)."""

    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(str(generator)).num_hidden_layers
    if settings.layers >= layers:  # before any sampling
        raise FetchError(f"--draft-layers: draft layers must be in 1..{layers - 1} (the generator has {layers}), "
                         f"got {settings.layers}")
    data, draft_dir = output / "draft-data", output / "draft"
    wanted = {"generator": str(generator), "prompts": prompts, "eval_prompts": eval_prompts, **asdict(settings)}
    # The samples depend on the sampling settings only: other changes retrain on the same samples.
    _stamp(data, draft_dir, {k: wanted[k] for k in ("generator", "prompts", "eval_prompts", "samples_per_prompt",
                                                    "max_new_tokens", "temperature", "seed")},
           "draft sampling settings")
    if (draft_dir / "report.json").exists():
        report = json.loads((draft_dir / "report.json").read_text())
        if report.get("settings") == wanted:
            _skip(draft_dir)
            return report
        log.info("draft settings changed: retraining %s", draft_dir)

    from pipeline.engines.hf import HFEngine
    from pipeline.training.draft import distill, evaluate_draft, truncated_copy

    start = time.perf_counter()
    engine = HFEngine.from_pretrained(str(generator), prepack=False)  # the teacher: truncated_copy copies its weights
    splits = {"train": load_prompts(prompts, engine.tokenizer, settings.max_new_tokens),
              "eval": load_prompts(eval_prompts, engine.tokenizer, settings.max_new_tokens)}
    overlap = {p.prompt_id for p in splits["train"]} & {p.prompt_id for p in splits["eval"]}
    if overlap:
        raise FetchError(f"{eval_prompts}: {len(overlap)} held-out prompts are also in {prompts}")
    sequences = {}
    for split, per_prompt in (("train", settings.samples_per_prompt), ("eval", 1)):
        ids = {p.prompt_id: p.token_ids for p in splits[split]}
        samples = _samples(data / f"samples-{split}.jsonl", engine, splits[split], settings.max_new_tokens,
                           replace(settings, samples_per_prompt=per_prompt), progress)
        sequences[split] = [(ids[s.prompt_id] + s.token_ids, len(ids[s.prompt_id])) for s in samples if s.token_ids]
    sampled = time.perf_counter() - start
    teacher, pad_id = engine.model, engine.pad_id
    draft = truncated_copy(teacher, settings.layers)
    before = evaluate_draft(draft, teacher, sequences["eval"], pad_id)
    training = distill(draft, teacher, sequences["train"], pad_id, epochs=settings.epochs,
                       batch_size=settings.batch_size, learning_rate=settings.learning_rate, seed=settings.seed,
                       progress=progress)
    after = evaluate_draft(draft, teacher, sequences["eval"], pad_id)
    parameters = sum(p.numel() for p in draft.parameters())
    report = {
        "draft": f"the generator's first {settings.layers} of {teacher.config.num_hidden_layers} layers, "
                 "distilled (forward KL) on the generator's samples",
        "generator": str(generator),
        "settings": wanted,
        "parameters": parameters,
        "generator_parameters": sum(p.numel() for p in teacher.parameters()),
        "training": training,
        "heldout_before_training": before,
        "heldout": after,
        "seconds": {"sampling": round(sampled, 1), "total": round(time.perf_counter() - start, 1)},
    }
    tmp = draft_dir.with_name(f"{draft_dir.name}.building")
    shutil.rmtree(tmp, ignore_errors=True)
    draft.save_pretrained(tmp)
    engine.tokenizer.save_pretrained(tmp)
    (tmp / "report.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(draft_dir, ignore_errors=True)
    tmp.rename(draft_dir)
    return report


def format_draft_report(report: dict, draft: Path) -> str:
    before, after = report["heldout_before_training"], report["heldout"]
    return "\n".join([
        f"draft model: {draft}",
        f"  {report['draft']} ({report['parameters'] / 1e6:.1f}M of {report['generator_parameters'] / 1e6:.1f}M "
        f"parameters; {report['training']['train_tokens']} training tokens, {report['training']['epochs']} epochs)",
        f"  held-out acceptance (sum min(p, q)) {after['acceptance']:.3f} (before training {before['acceptance']:.3f}), "
        f"greedy agreement {after['greedy_agreement']:.3f} ({before['greedy_agreement']:.3f}), "
        f"KL {after['kl']:.3f} ({before['kl']:.3f}); {after['positions']} positions",
    ])


# -- step 6 from the committed model (the fast path) -------------------------------------------

def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def artifact_weights(artifact: Path) -> Path:
    """The committed LoRA factors and head: next to ``artifact`` (its .json), as .safetensors."""
    return artifact.with_suffix(".safetensors")


def artifact_mismatch(artifact: Path, gguf_sha256: str, settings: RewardSettings) -> str | None:
    """Why the committed reward model cannot stand in for steps 4-6 here; None when it can."""
    if not artifact.exists():
        return f"{artifact}: no such file"
    committed = json.loads(artifact.read_text())
    if committed["gguf_sha256"] != gguf_sha256:
        return (f"the GGUF's sha256 is {gguf_sha256[:16]}..., the reward model was trained on "
                f"{committed['gguf_sha256'][:16]}...")
    changed = sorted(k for k, v in asdict(settings).items() if committed["settings"].get(k) != v)
    if changed:
        return f"settings differ from the committed reward model's: {', '.join(changed)}"
    weights = artifact_weights(artifact)
    if not weights.exists():
        return f"{weights}: no such file"
    if sha256_file(weights) != committed["weights_sha256"]:
        return f"{weights}: its sha256 is not the one {artifact} records"
    return None


def assemble_reward_model(generator: Path, output: Path, artifact: Path, settings: RewardSettings) -> dict:
    """DIR/reward = the generator's network with the committed LoRA factors merged in and the
    committed ``score`` head, written by the function training uses (save_reward_model), and the
    committed training report. A trained model with the same settings is kept; one assembled from
    other committed weights is replaced."""
    from safetensors.torch import load_file

    from pipeline.training.lora import save_reward_model

    reward = output / "reward"
    committed = json.loads(artifact.read_text())
    if (reward / "report.json").exists():
        report = json.loads((reward / "report.json").read_text())
        if (report.get("weights_sha256", committed["weights_sha256"]) == committed["weights_sha256"]
                and report.get("settings") == asdict(settings)):
            _skip(reward)
            return report
    tmp = reward.with_name(f"{reward.name}.building")
    trained = committed["settings"]
    save_reward_model(generator, load_file(str(artifact_weights(artifact))),
                      lora_scale(trained["lora_rank"], trained["lora_alpha"]), tmp)
    report = {"reward_source": COMMITTED, "artifact": str(artifact), "weights_sha256": committed["weights_sha256"],
              "gguf_sha256": committed["gguf_sha256"], "generator": str(generator), "settings": committed["settings"],
              **committed["report"]}
    (tmp / "report.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(reward, ignore_errors=True)
    tmp.rename(reward)
    return report


def save_artifact(output: Path, report: dict, path: Path, source: dict[str, str]) -> Path:
    """The trained reward model in the committed format: ``path`` (JSON: provenance (``source``:
    the package, the GGUF's path in it and its sha256; the settings), the weights' sha256 and the
    training report's figures) and, next to it, the LoRA factors and score head (safetensors,
    float32, as trained)."""
    from safetensors import safe_open

    weights = output / "reward-data" / "reward-lora.safetensors"
    with safe_open(str(weights), "pt") as f:
        if json.loads(f.metadata()["settings"]) != report["settings"]:
            raise FetchError(f"{weights}: written with other settings than {output / 'reward'}; rerun with --retrain")
    figures = {k: v for k, v in report.items() if k not in ("reward_source", "generator", "settings")}
    target = artifact_weights(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
    shutil.copyfile(weights, tmp)
    os.replace(tmp, target)
    committed = {"about": "the SmolLM2-135M-Instruct reward model trained by python -m jobs.fetch_models: LoRA factors "
                          "of its top layers and its score head (in " + target.name + "); the fast path merges them "
                          "into the converted GGUF's network",
                 **source, "weights": target.name, "weights_sha256": sha256_file(target),
                 "settings": report["settings"], "report": figures}
    _write_atomic(path, json.dumps(committed, indent=1) + "\n")
    return path


def reward_model(generator: Path, gguf: Path | None, output: Path, settings: RewardSettings, artifact: Path,
                 retrain: bool = False, committed_only: bool = False, save_to: Path | None = None,
                 source: dict[str, str] | None = None, progress: bool = True) -> dict:
    """Step 6 from the committed reward model when it fits (the fast path), else steps 4-6.
    ``save_to``: after training, the committed format's JSON (save_artifact), which records
    ``source`` (where the GGUF came from: package, gguf) and the GGUF's sha256.
    ``progress``: bars (else a log line per sampled batch)."""
    if gguf is None:
        why = "--generator: the committed reward model belongs to SmolLM2's GGUF"
    else:
        gguf_sha256 = sha256_file(gguf)
        why = "--retrain" if retrain else artifact_mismatch(artifact, gguf_sha256, settings)
    if why is None:
        return assemble_reward_model(generator, output, artifact, settings)
    if committed_only:
        raise FetchError(f"the committed reward model does not fit ({why}); without --committed-only "
                         "the reward model is trained here (about an hour on 2 cores)")
    log.info("training the reward model (%s)", why)
    report = build_reward_model(generator, output, settings, progress)
    if save_to is not None:
        if gguf is None:
            raise FetchError("--save-artifact: needs the SmolLM2 GGUF (not --generator)")
        log.info("wrote %s", save_artifact(output, report, save_to, {**source, "gguf_sha256": gguf_sha256}))
    return report


# -- shared by the steps: prompt files and cached outputs ---------------------------------------

def load_prompts(path: str, tokenizer, max_new_tokens: int):
    """The PromptInputs of a prompt file; any bad row is a FetchError naming the file and row."""
    from pipeline.data.chat import PromptFormatter
    from pipeline.data.prompts import validate
    from pipeline.data.readers import read_raw_rows

    rows, rejects = validate(read_raw_rows(path, "prompt"), "prompt")
    if rejects:
        raise FetchError(f"{path}: line {rejects[0].source_row + 1}: {rejects[0].reason}")
    if not rows:
        raise FetchError(f"{path}: no prompts")
    formatter = PromptFormatter(tokenizer, max(1, min(tokenizer.model_max_length, 10**6) - max_new_tokens))
    return [formatter.prepare(row)[0] for row in rows]


def load_instructions(path: str) -> dict[str, tuple[list[str], list[dict]]]:
    """prompt_id -> (instruction_id_list, kwargs) of a JSONL prompt file with IFEval's columns; a
    row without them, or with an instruction the judge does not check, is a FetchError naming the
    file and line."""
    from pipeline.data.chat import prompt_id
    from pipeline.judge import SUPPORTED

    out = {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        raise FetchError(f"{path}: no such file") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise FetchError(f"{path}: line {number}: not a JSON object") from None
        if not isinstance(row, dict):
            raise FetchError(f"{path}: line {number}: not a JSON object")
        ids, kwargs = row.get("instruction_id_list"), row.get("kwargs")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
            raise FetchError(f"{path}: line {number}: instruction_id_list must be a non-empty list of strings")
        if not isinstance(kwargs, list) or len(kwargs) != len(ids) or not all(isinstance(k, dict) for k in kwargs):
            raise FetchError(f"{path}: line {number}: kwargs must be a list of {len(ids)} objects, one per instruction")
        unknown = [i for i in ids if i not in SUPPORTED]
        if unknown:
            raise FetchError(f"{path}: line {number}: instruction {unknown[0]!r} is not checked by the judge")
        if isinstance(row.get("prompt"), str):
            out[prompt_id(row["prompt"])] = (ids, kwargs)
    return out


def _stamp(data: Path, model: Path, settings: dict, what: str) -> None:
    """``data``/settings.json records the settings its files were made with: other settings remove
    ``data`` and the ``model`` built from it, and the new settings are recorded."""
    stamp = data / "settings.json"
    if stamp.exists() and json.loads(stamp.read_text()) != settings:
        log.info("%s changed: rebuilding %s and %s", what, data, model)
        shutil.rmtree(data), shutil.rmtree(model, ignore_errors=True)
    data.mkdir(parents=True, exist_ok=True)
    if not stamp.exists():
        _write_atomic(stamp, json.dumps(settings, indent=2))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _skip(path: Path) -> Path:
    log.info("skip: %s exists", path)
    return path
