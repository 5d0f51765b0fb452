"""The DPO handoff: the build job's pairs Parquet in, a DPO-trained policy out.

The pairs are read exactly as the output contract promises (`load_dataset("parquet")`, TRL's
standard or conversational format, no conversion) and handed to TRL's DPOTrainer. This module trains only the
policy; setting 2 of the SLA paper runs it before training the reward channel on the same pairs
(pipeline.training.reward_channel).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.storage import filesystem, is_remote, list_files
from pipeline.data.reader import BuildRead, OutputReader, is_build, is_pair_file, partial_read_line
from pipeline.errors import CorruptMarker
from pipeline.errors import InputError

log = logging.getLogger(__name__)

PAIR_COLUMNS = ("prompt", "chosen", "rejected")
# Logged by DPOTrainer per step; we hand back the last value of each.
_DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected")


def _pair_files(uri: str, storage_options: dict, allow_partial: bool = False) -> tuple[list[str], list[BuildRead]]:
    """The Parquet files at ``uri`` that hold pairs (paths of its filesystem, after the footer and
    column checks), and the account of each build they came from. A build (reader.is_build) is read
    through its output store, committed shards only, never listed here; a glob or a single file
    inside a build reads through that build's store too (of what it names). A user's own pairs
    directory is listed: its top-level pair files (reader.is_pair_file)."""
    fs, path = filesystem(uri, storage_options)
    try:
        if fs.isdir(path) and is_build(fs, path):
            read = _read_build(uri, storage_options, allow_partial)
            files, reads = read.parts, [read]
        else:
            files, reads = _user_files(uri, storage_options, allow_partial)
    except CorruptMarker as exc:  # names the marker; a reader cannot trust the shard it stands for
        raise InputError(str(exc)) from None
    kept = []
    for f in files:
        where = uri if f == path else f"{uri}: {f}"
        # Footers only: cheap even on S3, and they let us name the bad file ourselves.
        try:
            with fs.open(f, "rb") as fh:
                parquet = pq.ParquetFile(fh)
                meta, columns = parquet.metadata, parquet.schema_arrow.names  # top-level (conversational: lists)
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"{where}: unreadable Parquet ({_one_line(exc)})") from None
        missing = [c for c in PAIR_COLUMNS if c not in columns]
        if missing:
            raise InputError(f"{where}: missing column(s) {', '.join(missing)} (columns: {', '.join(columns)})")
        # A shard whose prompts were all rejected is a valid, empty part file. datasets reads in
        # batches of the first row group's size, which is 0 there, and fails the whole load.
        if meta.num_rows:
            kept.append(f)
    if not kept:
        raise InputError(f"{uri}: no pairs (0 rows)")
    # fsspec strips the protocol; datasets needs it back to pick the same filesystem.
    return ([fs.unstrip_protocol(f) for f in kept] if is_remote(uri) else kept), reads


def _read_build(uri: str, storage_options: dict, allow_partial: bool, wanted=None) -> BuildRead:
    """The committed part of the build at ``uri`` (OutputReader.read_committed), creating nothing."""
    store = OutputReader(uri, storage_options)
    return store.read_committed(allow_partial=allow_partial, wanted=wanted)


def _user_files(uri: str, storage_options: dict, allow_partial: bool) -> tuple[list[str], list[BuildRead]]:
    """A file, a glob, or a directory that is not a build: its top-level pair files; of a file or
    glob inside a build, only what that build's store says is committed."""
    try:
        # Top-level pair files only: a user's subdirectories are not ours to read.
        fs, path, named = list_files(uri, storage_options, lambda rel: "/" not in rel and is_pair_file(rel))
    except FileNotFoundError:
        raise InputError(f"{uri}: no such file or directory") from None
    if not named:
        raise InputError(f"{uri}: no train-*.parquet or part-*.parquet files found")
    if fs.isdir(path):
        return named, []
    files, reads = [], []
    for directory in sorted({f.rsplit("/", 1)[0] for f in named}):
        in_directory = [f for f in named if f.rsplit("/", 1)[0] == directory]
        if not is_build(fs, directory):
            files += in_directory
            continue
        read = _read_build(fs.unstrip_protocol(directory) if is_remote(uri) else directory, storage_options,
                           allow_partial, wanted=set(in_directory).__contains__)
        files += read.parts
        reads.append(read)
    return files, reads


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


TOKEN_ID_COLUMNS = ("prompt_token_ids", "chosen_token_ids", "rejected_token_ids")


def load_pairs(uri: str, storage_options: dict | None = None, token_ids: bool = False,
               allow_partial: bool = False, say: Callable[[str], None] | None = None):
    """The pairs at `uri` (a directory/prefix of train-*.parquet or part-*.parquet, one Parquet file, or a glob; local
    or s3://) as a `datasets.Dataset` with exactly the columns prompt, chosen and rejected (and,
    with ``token_ids``, the build's TOKEN_ID_COLUMNS when the files have them).

    A build_dataset output (a directory holding any of reader.BUILD_FILES) is read through its
    OutputReader (read_committed), committed shards only: a pair file with no marker (a killed
    build's leftover) is never read, and a build with no ``_SUCCESS`` raises IncompleteBuild (one
    line), so training never runs on half a build unnoticed. ``allow_partial`` reads its
    committed shards instead, and ``say`` (default: stderr) gets one line with how many shards and
    pairs were read out of how many the build committed; this lives here, not in each job, so no job
    that passes --allow-partial can forget to say it. A user's own pairs (a file, a glob or a
    directory with none of the build's files) are read as they are.

    Raises InputError, with a one-line message naming the URI, when there are no files, a required
    column is missing, the files cannot be read, or there are no rows.
    """
    import datasets

    storage_options = dict(storage_options or {})
    files, reads = _pair_files(uri, storage_options, allow_partial)
    try:
        # A copy: datasets adds its own keys (e.g. "hf") to the mapping it is given, which s3fs
        # would then reject on the caller's next use of it.
        ds = datasets.load_dataset("parquet", data_files=files, split="train",
                                   storage_options=dict(storage_options) or None)
    except Exception as exc:  # noqa: BLE001 - e.g. shards with clashing schemas: a user input error
        raise InputError(f"{uri}: unreadable Parquet ({_one_line(exc)})") from None
    line = partial_read_line(uri, len(ds), reads)
    if line:
        (say or _stderr)(line)
    # Extra columns (scores, ids) would ride through TRL's preprocessing for nothing.
    extra = [c for c in TOKEN_ID_COLUMNS if token_ids and c in ds.column_names]
    return ds.select_columns(list(PAIR_COLUMNS) + extra)


def _stderr(line: str) -> None:
    log.info("%s", line)


def _step_log(max_steps: int):
    """A TrainerCallback that logs about ten progress lines over a run (step, loss, elapsed seconds):
    a round on a CPU takes an hour, and without tqdm it would otherwise be silent."""
    import time

    from transformers import TrainerCallback

    every = max(1, max_steps // 10)

    class StepLog(TrainerCallback):
        start = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and (state.global_step % every == 0 or state.global_step == max_steps):
                log.info("DPO step %d/%d: loss %.4f (%.0fs)", state.global_step, max_steps, logs["loss"],
                         time.perf_counter() - self.start)

    return StepLog()


def train_dpo(pairs, model: str, output: str, *, max_steps: int = 10, batch_size: int = 4,
              learning_rate: float = 5e-6, beta: float = 0.1, max_length: int = 512, seed: int = 0,
              eval_fraction: float = 0.0, progress: bool = True) -> dict[str, Any]:
    """Run DPO on `pairs` (a Dataset with prompt/chosen/rejected) starting from `model` (an HF
    model directory or hub id), save the policy and its tokenizer to `output`, and return metrics:
    train_loss, steps, and the last logged rewards/* and logps/* values (eval_* too when
    `eval_fraction` > 0). Runs on a GPU when there is one, else on the CPU.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    train_ds, eval_ds = pairs.select_columns(list(PAIR_COLUMNS)), None
    if eval_fraction > 0:
        split = train_ds.train_test_split(test_size=eval_fraction, seed=seed)
        train_ds, eval_ds = split["train"], split["test"]

    tokenizer = AutoTokenizer.from_pretrained(model)
    if tokenizer.pad_token is None:
        # Padding is masked out of the loss, so any existing token will do; EOS is the usual choice.
        tokenizer.pad_token = tokenizer.eos_token
    policy = AutoModelForCausalLM.from_pretrained(model)

    config = DPOConfig(
        output_dir=output,
        max_steps=max_steps,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
        learning_rate=learning_rate,
        beta=beta,
        max_length=max_length,
        seed=seed,
        # TRL turns bf16 on by default; CPUs and older GPUs either lack it or emulate it slowly,
        # and fp32 keeps tiny-model runs reproducible.
        bf16=False,
        fp16=False,
        report_to="none",
        logging_steps=1,
        # We save once, explicitly, at the end; intermediate checkpoints would only cost disk.
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=not progress,
    )
    # ref_model=None: TRL loads a frozen copy of the same checkpoint as the reference.
    trainer = DPOTrainer(model=policy, args=config, train_dataset=train_ds, eval_dataset=eval_ds,
                         processing_class=tokenizer)
    if not progress:
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # with tqdm off it would print every log line
        trainer.add_callback(_step_log(max_steps))
    result = trainer.train()

    metrics: dict[str, Any] = {"train_loss": result.training_loss, "steps": trainer.state.global_step}
    for entry in trainer.state.log_history:
        metrics.update({k: v for k, v in entry.items() if k in _DPO_METRICS})
    if eval_ds is not None:
        metrics.update(trainer.evaluate())

    # save_model goes through save_pretrained, unwrapping any accelerate/FSDP wrapper first,
    # and writes the tokenizer (processing_class) alongside.
    trainer.save_model(output)
    return metrics
