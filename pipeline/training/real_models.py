"""The real models' workflows: a reward model trained on the generator's own samples with IFEval's
checkers as the judge (pipeline.training.real_reward, steps 4-6), or the committed one merged into
the generator (this module: the fast path, and the committed artifact's format), and a draft model
distilled from the generator (pipeline.training.real_draft, steps 7-8); what they share (prompt
files, cached outputs) is pipeline.training.cached_steps. ``bon-fetch-models`` (jobs.fetch_models)
fetches and converts the generator (its steps 1-3) and runs these steps after them, numbered as that
job numbers them.

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
import os
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path

from pipeline.errors import FetchError
from pipeline.training.cached_steps import skip, write_atomic
from pipeline.training.real_reward import COMMITTED, RewardSettings, build_reward_model, lora_scale

log = logging.getLogger(__name__)


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
    recorded = _recorded(committed["settings"])
    changed = sorted(k for k, v in asdict(settings).items() if recorded.get(k) != v)
    if changed:
        return f"settings differ from the committed reward model's: {', '.join(changed)}"
    weights = artifact_weights(artifact)
    if not weights.exists():
        return f"{weights}: no such file"
    if sha256_file(weights) != committed["weights_sha256"]:
        return f"{weights}: its sha256 is not the one {artifact} records"
    return None


def _recorded(settings: dict) -> dict:
    """Settings as an artifact or report recorded them, with any setting added since at its
    default (a new setting's default keeps the behaviour the record was made with)."""
    return {**asdict(RewardSettings()), **settings}


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
                and _recorded(report.get("settings") or {}) == asdict(settings)):
            skip(reward)
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
    write_atomic(path, json.dumps(committed, indent=1) + "\n")
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
