"""What the real models' steps share (pipeline.training.real_reward, real_draft and real_models;
jobs.fetch_models): reading the prompt files, and outputs cached on disk: each is skipped when it
exists and is complete, and written under a temporary name and renamed into place, so an
interrupted run leaves nothing that looks complete."""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path

from pipeline.errors import FetchError

log = logging.getLogger(__name__)


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


def prompt_token_ids(data: Path, split: str, tokenizer, sampled: set[str]) -> dict[str, list[int]]:
    """prompt_id -> the token ids the generator sampled ``split``'s responses after (the prompt
    file that DIR/reward-data/settings.json names, formatted as the sampling formatted it); a
    FetchError when that file lacks any of the ``sampled`` prompt ids."""
    settings = data / "settings.json"
    if not settings.exists():
        raise FetchError(f"{settings}: no such file (it names the prompt files)")
    recorded = json.loads(settings.read_text())
    key = "prompts" if split == "train" else "eval_prompts"
    cap = recorded["max_new_tokens" if split == "train" else "eval_max_new_tokens"]
    prompts = {p.prompt_id: list(p.token_ids) for p in load_prompts(recorded[key], tokenizer, cap)}
    missing = sampled - set(prompts)
    if missing:
        raise FetchError(f"{settings}: its {split} prompt file lacks {len(missing)} sampled prompts")
    return prompts


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



class _LogLines:
    """Stands in for a tqdm bar where there is none (stderr not a terminal, or --no-progress): a
    log line per ``update`` (a batch of prompts sampled)."""

    def __init__(self, what: str, total: int):
        self.what, self.total, self.done = what, total, 0

    def update(self, n: int) -> None:
        self.done += n
        log.info("%s: %d/%d prompts", self.what, self.done, self.total)


def sample_cached(path: Path, engine, prompts: list, cap: int, settings, progress: bool):
    """The samples cached at ``path`` (one JSON line each), else ``settings.samples_per_prompt``
    samples of each prompt up to ``cap`` tokens (pipeline.training.judged_samples.sample_responses),
    written there."""
    from tqdm import tqdm

    from pipeline.training.judged_samples import Sample, sample_responses

    if path.exists():
        skip(path)
        return [Sample(**json.loads(line)) for line in path.read_text().splitlines()]
    with tqdm(total=len(prompts), desc=f"sampling {path.stem}", disable=not progress) as bar:
        samples = sample_responses(engine, prompts, settings.samples_per_prompt, cap, settings.temperature,
                                   settings.seed, settings.rows_per_batch,
                                   bar if progress else _LogLines(f"sampling {path.stem}", len(prompts)))
    write_atomic(path, "".join(json.dumps(asdict(s)) + "\n" for s in samples))
    return samples



def stamp(data: Path, model: Path, settings: dict, what: str) -> None:
    """``data``/settings.json records the settings its files were made with: other settings remove
    ``data`` and the ``model`` built from it, and the new settings are recorded."""
    stamp = data / "settings.json"
    if stamp.exists() and json.loads(stamp.read_text()) != settings:
        log.info("%s changed: rebuilding %s and %s", what, data, model)
        shutil.rmtree(data), shutil.rmtree(model, ignore_errors=True)
    data.mkdir(parents=True, exist_ok=True)
    if not stamp.exists():
        write_atomic(stamp, json.dumps(settings, indent=2))


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


def skip(path: Path) -> Path:
    """Log that the output at ``path`` exists (its step is skipped); returns it."""
    log.info("skip: %s exists", path)
    return path
