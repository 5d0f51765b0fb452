"""The real draft model's workflow, steps 7-8 of jobs.fetch_models (--draft; their outputs and
report: pipeline.training.real_models' docstring): the generator's first layers, distilled on its own
samples (pipeline.training.draft)."""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pipeline.errors import FetchError
from pipeline.training.cached_steps import load_prompts, sample_cached, skip, stamp

log = logging.getLogger(__name__)


@dataclass
class DraftSettings:
    """The draft model's settings; a field with a "help" in its metadata is a flag of
    jobs.fetch_models, named --draft-FIELD (jobs.cli.add_settings_flags)."""

    layers: int = field(default=4, metadata={"help": "with --draft: the generator's first layers kept in the draft"})
    """Decoder layers kept from the generator."""
    samples_per_prompt: int = field(default=2, metadata={
        "help": "with --draft: samples per training prompt to distill on"})
    max_new_tokens: int = 128
    temperature: float = 1.0
    seed: int = 0
    epochs: int = field(default=2, metadata={"help": "with --draft: distillation epochs"})
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
    stamp(data, draft_dir, {k: wanted[k] for k in ("generator", "prompts", "eval_prompts", "samples_per_prompt",
                                                    "max_new_tokens", "temperature", "seed")},
           "draft sampling settings")
    if (draft_dir / "report.json").exists():
        report = json.loads((draft_dir / "report.json").read_text())
        if report.get("settings") == wanted:
            skip(draft_dir)
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
        samples = sample_cached(data / f"samples-{split}.jsonl", engine, splits[split], settings.max_new_tokens,
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
