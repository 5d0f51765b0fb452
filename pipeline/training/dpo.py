"""The DPO handoff: the build job's pairs Parquet in, a DPO-trained policy out.

The pairs are read exactly as the output contract promises (`load_dataset("parquet")`, TRL's
standard or conversational format, no conversion) and handed to TRL's DPOTrainer. This module trains only the
policy; setting 2 of the SLA paper runs it before training the reward channel on the same pairs
(pipeline.training.reward_channel).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.prompts import InputError
from pipeline.data.storage import is_remote, list_files

PAIR_COLUMNS = ("prompt", "chosen", "rejected")
# Logged by DPOTrainer per step; we hand back the last value of each.
_DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected")


def _pair_files(uri: str, storage_options: dict) -> list[str]:
    """The Parquet files at `uri` that hold pairs, as URIs datasets can open."""
    try:
        # Only the committed shards: _rejects/ and markers sit beside them under the same prefix.
        fs, path, files = list_files(uri, storage_options,
                                     lambda rel: "/" not in rel and rel.startswith("part-") and rel.endswith(".parquet"))
    except FileNotFoundError:
        raise InputError(f"{uri}: no such file or directory") from None
    if not files:
        raise InputError(f"{uri}: no part-*.parquet files found")
    kept = []
    for f in sorted(files):
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
    return [fs.unstrip_protocol(f) for f in kept] if is_remote(uri) else kept


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


TOKEN_ID_COLUMNS = ("prompt_token_ids", "chosen_token_ids", "rejected_token_ids")


def load_pairs(uri: str, storage_options: dict | None = None, token_ids: bool = False):
    """The pairs at `uri` (a directory/prefix of part-*.parquet, one Parquet file, or a glob; local
    or s3://) as a `datasets.Dataset` with exactly the columns prompt, chosen and rejected (and,
    with ``token_ids``, the build's TOKEN_ID_COLUMNS when the files have them).

    Raises InputError, with a one-line message naming the URI, when there are no files, a required
    column is missing, the files cannot be read, or there are no rows.
    """
    import datasets

    storage_options = dict(storage_options or {})
    files = _pair_files(uri, storage_options)
    try:
        # A copy: datasets adds its own keys (e.g. "hf") to the mapping it is given, which s3fs
        # would then reject on the caller's next use of it.
        ds = datasets.load_dataset("parquet", data_files=files, split="train",
                                   storage_options=dict(storage_options) or None)
    except Exception as exc:  # noqa: BLE001 - e.g. shards with clashing schemas: a user input error
        raise InputError(f"{uri}: unreadable Parquet ({_one_line(exc)})") from None
    # Extra columns (scores, ids) would ride through TRL's preprocessing for nothing.
    extra = [c for c in TOKEN_ID_COLUMNS if token_ids and c in ds.column_names]
    return ds.select_columns(list(PAIR_COLUMNS) + extra)


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
