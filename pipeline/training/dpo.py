"""The DPO handoff: the build job's pairs Parquet in, a DPO-trained policy out.

The pairs are read exactly as the output contract promises (`load_dataset("parquet")`, TRL's
standard or conversational format, no conversion) and handed to TRL's DPOTrainer. This module trains only the
policy; setting 2 of the SLA paper runs it before training the reward channel on the same pairs
(pipeline.training.reward_channel).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import InputError
from pipeline.data.storage import is_remote, join, list_files
from pipeline.data.writer import LEASE_NAME, CorruptMarker, IncompleteBuild, OutputStore

log = logging.getLogger(__name__)

PAIR_COLUMNS = ("prompt", "chosen", "rejected")
# Logged by DPOTrainer per step; we hand back the last value of each.
_DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected")


PAIR_FILE_PREFIXES = ("train-", "part-")
"""Top-level Parquet files named so hold pairs: a build's (``train-NNNNN``; ``part-NNNNN`` in builds
of the older layout) or a user's own pairs directory."""


def is_pair_file(name: str) -> bool:
    """Whether a top-level file name is a pair file (PAIR_FILE_PREFIXES, ``.parquet``)."""
    return name.startswith(PAIR_FILE_PREFIXES) and name.endswith(".parquet")


BUILD_FILES = ("_markers", "_manifest.json", "_SUCCESS", LEASE_NAME)
"""What only a build_dataset output holds beside its part files: a directory with any of them is a
build, and is read through its output store (committed shards only)."""


def is_build(fs, path: str) -> bool:
    """Whether directory ``path`` of ``fs`` is a build_dataset output. A user's own pairs directory
    (train-*.parquet or part-*.parquet, and nothing of ours) is not, and is read as it always was;
    a build, even one killed before it wrote anything but markers, is, so a leftover pair file with
    no marker can never slip in through a directory listing."""
    return any(fs.exists(join(path, name)) for name in BUILD_FILES)


@dataclass
class PairFiles:
    """The Parquet files a load reads, and what of a build it left out (for the one line a job prints)."""

    files: list[str]
    """Paths of ``fs``, in order."""
    builds: list[dict] = field(default_factory=list)
    """One record per build read: uri, finished (has _SUCCESS), shards read, shards committed
    (markers), pairs committed (the markers' row counts), shards skipped (marker but no matching part
    file) and leftovers (part files with no marker)."""


def _build_parts(uri: str, storage_options: dict, allow_partial: bool, wanted) -> tuple[list[str], dict]:
    """The committed part files of the build at ``uri`` that ``wanted`` (a path -> bool) keeps.

    Raises IncompleteBuild without _SUCCESS, or when a committed shard's part file no longer matches
    its marker (damaged after the build), unless ``allow_partial``."""
    store = OutputStore(uri, storage_options)
    try:
        parts = [p for p in store.committed_parts(allow_partial=allow_partial) if wanted(p)]
        markers = {join(store.root, store.pair_file(shard, marker)): marker for shard, marker in store.iter_markers()}
    except CorruptMarker as exc:  # names the marker; a reader cannot trust the shard it stands for
        raise InputError(str(exc)) from None
    markers = {path: m for path, m in markers.items() if wanted(path)}
    skipped = sorted(int(m["shard"]) for path, m in markers.items() if path not in parts)
    listed = [p for p in store.fs.ls(store.root, detail=False) if is_pair_file(p.rsplit("/", 1)[1])]
    leftovers = sorted(p.rsplit("/", 1)[1] for p in listed if p not in markers and wanted(p))
    finished = store.succeeded()
    if skipped and not allow_partial:
        raise IncompleteBuild(f"{uri}: shard(s) {', '.join(map(str, skipped))} no longer match their commit markers "
                              "(changed after the build); rerun the build to redo them, or pass --allow-partial "
                              "to read the other shards")
    record = {"uri": uri, "finished": finished, "shards_read": len(parts), "shards_committed": len(markers),
              "pairs_committed": sum(int(m.get("rows", 0)) for m in markers.values()), "skipped": skipped,
              "leftovers": leftovers}
    return parts, record


def _pair_files(uri: str, storage_options: dict, allow_partial: bool = False) -> PairFiles:
    """The Parquet files at `uri` that hold pairs (paths of the returned filesystem), after the
    footer and column checks. A build (is_build) contributes only its committed shards."""
    try:
        # Top-level part files only: _rejects/ and _quarantine/ sit beside them under the same prefix.
        fs, path, files = list_files(uri, storage_options,
                                     lambda rel: "/" not in rel and is_pair_file(rel))
    except FileNotFoundError:
        raise InputError(f"{uri}: no such file or directory") from None
    # A glob or a single file inside a build reads through that build's store too (of what it names).
    directories = [path] if fs.isdir(path) else sorted({f.rsplit("/", 1)[0] for f in files})
    result = PairFiles([])
    named = set(files)
    for directory in directories:
        in_dir = [f for f in files if f.rsplit("/", 1)[0] == directory.rstrip("/")]
        if not is_build(fs, directory):
            result.files += in_dir
            continue
        build_uri = fs.unstrip_protocol(directory) if is_remote(uri) else directory
        parts, record = _build_parts(build_uri, storage_options, allow_partial, named.__contains__)
        result.files += parts
        result.builds.append(record)
    if not files:
        raise InputError(f"{uri}: no train-*.parquet or part-*.parquet files found")
    kept = []
    for f in result.files:
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
    result.files = [fs.unstrip_protocol(f) for f in kept] if is_remote(uri) else kept
    return result


def partial_read_line(uri: str, pairs: int, builds: list[dict]) -> str | None:
    """The one line a job prints when it read less than a finished build (None when it did not):
    how many shards and pairs it read out of how many the build has committed (its markers), and
    what it left out."""
    notes = []
    for b in builds:
        if b["finished"] and not b["skipped"] and not b["leftovers"]:
            continue
        state = "finished" if b["finished"] else "unfinished (no _SUCCESS)"
        note = (f"{b['uri']}: {state} build: read {b['shards_read']} of its {b['shards_committed']} committed shards "
                f"({b['pairs_committed']} pairs committed)")
        if b["skipped"]:
            note += f", skipped shard(s) {', '.join(map(str, b['skipped']))} (part file missing or not matching its marker)"
        if b["leftovers"]:
            note += f", ignored {len(b['leftovers'])} part file(s) with no commit marker"
        notes.append(note)
    if not notes:
        return None
    return f"warning: {'; '.join(notes)}; {pairs} pairs loaded from {uri}"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


TOKEN_ID_COLUMNS = ("prompt_token_ids", "chosen_token_ids", "rejected_token_ids")


def load_pairs(uri: str, storage_options: dict | None = None, token_ids: bool = False,
               allow_partial: bool = False, say: Callable[[str], None] | None = None):
    """The pairs at `uri` (a directory/prefix of train-*.parquet or part-*.parquet, one Parquet file, or a glob; local
    or s3://) as a `datasets.Dataset` with exactly the columns prompt, chosen and rejected (and,
    with ``token_ids``, the build's TOKEN_ID_COLUMNS when the files have them).

    A build_dataset output (a directory holding any of BUILD_FILES: is_build) is read through its OutputStore, committed shards only: a part file with no marker (a
    killed build's leftover) is never read, and a build with no ``_SUCCESS`` raises IncompleteBuild
    (one line), so training never runs on half a build unnoticed. ``allow_partial`` reads its
    committed shards instead, and ``say`` (default: stderr) gets one line with how many shards and
    pairs were read out of how many the build committed; this lives here, not in each job, so no job
    that passes --allow-partial can forget to say it. A user's own pairs (a file, a glob or a
    directory with none of the build's files) are read as they are.

    Raises InputError, with a one-line message naming the URI, when there are no files, a required
    column is missing, the files cannot be read, or there are no rows.
    """
    import datasets

    storage_options = dict(storage_options or {})
    found = _pair_files(uri, storage_options, allow_partial)
    try:
        # A copy: datasets adds its own keys (e.g. "hf") to the mapping it is given, which s3fs
        # would then reject on the caller's next use of it.
        ds = datasets.load_dataset("parquet", data_files=found.files, split="train",
                                   storage_options=dict(storage_options) or None)
    except Exception as exc:  # noqa: BLE001 - e.g. shards with clashing schemas: a user input error
        raise InputError(f"{uri}: unreadable Parquet ({_one_line(exc)})") from None
    line = partial_read_line(uri, len(ds), found.builds)
    if line:
        (say or _stderr)(line)
    # Extra columns (scores, ids) would ride through TRL's preprocessing for nothing.
    extra = [c for c in TOKEN_ID_COLUMNS if token_ids and c in ds.column_names]
    return ds.select_columns(list(PAIR_COLUMNS) + extra)


def _stderr(line: str) -> None:
    log.info("%s", line)


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
