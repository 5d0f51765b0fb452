"""Prompt sources: the input formats, read a bounded piece at a time.

Sources: JSONL (``.jsonl``, or ``.json``: one object per line, or one JSON array of objects),
Parquet (a file, a directory of files, or a glob) or a directory written by ``save_to_disk`` (a
Dataset's, or a DatasetDict's: its split ``data.split``); local paths or s3:// URIs through
fsspec/s3fs. A directory input reads its files of those formats and names each file it skips, with
the reason (hidden, side file, other format). A Hugging Face Hub dataset is named
``hf://datasets/ORG/NAME`` (the form of HF's own fsspec paths; a local path is always a path, even
"org/name"), with ``data.subset`` (its config name), ``data.split`` and ``data.revision``: it is read
with ``datasets.load_dataset(..., streaming=True)`` (see ``_open_hub_dataset`` for why streaming).

A missing or unreadable file raises InputError (one line naming the file, and the line for
JSONL); the job turns it into exit code 2. What a row holds is not judged here: the raw values go
to validation (pipeline.data.prompts), which turns every unusable one into a Reject.

Inputs of any size: ``PromptSource`` reads the prompt column a bounded piece at a time (a JSONL
line, a Parquet record batch, an Arrow record batch of a saved dataset, a batch of a streamed Hub
dataset) and hands it out shard by shard.

Other columns: ``PromptSource(..., extra_columns=...)`` also reads the input's other columns (all
of them, or the names given) with each prompt; ``records`` and ``shard_records`` hand them out as a
dict per row (a JSONL row without a key has no entry for it). They reach a reward function and
the output (data.extra_columns).
"""

from __future__ import annotations

import itertools
import json
import re
from contextlib import contextmanager
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.storage import filesystem, join, list_files
from pipeline.errors import InputError


SUFFIXES = (".jsonl", ".json", ".parquet")


def skip_reason(rel: str, suffixes: tuple[str, ...]) -> str | None:
    """Why a directory input does not read the file at ``rel`` (its path inside the directory), or
    None when it reads it: hidden entries (a dot-file, or anything under a dot-directory such as
    .ipynb_checkpoints/: editor and tool copies, never meant as input) and underscore-prefixed ones
    (_rejects/, _markers/: our own side files) are skipped before their format is looked at; so is
    a file of another format."""
    parts = rel.split("/")
    if any(p.startswith(".") for p in parts):
        return "hidden file"
    if any(p.startswith("_") for p in parts):
        return "side file (name starts with _)"
    if not rel.endswith(suffixes):
        return f"other format, not {'/'.join(suffixes)}"
    return None


def _files(uri: str, storage_options: dict, suffixes: tuple[str, ...]) -> tuple[Any, list[str], dict[str, str]]:
    """(filesystem, the files to read, {path inside the directory: why it is skipped}); a directory
    input skips what it cannot or should not read, and says so by name, rather than fail on it."""
    skipped: dict[str, str] = {}

    def wanted(rel: str) -> bool:
        reason = skip_reason(rel, suffixes)
        if reason is not None:
            skipped[rel] = reason
        return reason is None

    try:
        fs, _, files = list_files(uri, storage_options, wanted)
    except FileNotFoundError:
        raise InputError(f"{uri}: no such file") from None
    if not files:
        found = f" (skipped: {_skipped_text(skipped)})" if skipped else ""
        raise InputError(f"{uri}: no {'/'.join(suffixes)} files found{found}")
    return fs, files, skipped


def _skipped_text(skipped: dict[str, str], most: int = 5) -> str:
    shown = [f"{name} ({reason})" for name, reason in itertools.islice(sorted(skipped.items()), most)]
    return ", ".join(shown) + (f" and {len(skipped) - most} more" if len(skipped) > most else "")


HUB_DATASETS = "hf://datasets/"
"""Prefix of a Hugging Face Hub dataset as data.prompts: hf://datasets/ORG/NAME."""


def hub_dataset_id(uri: str) -> str | None:
    """ORG/NAME (or a legacy NAME) of ``hf://datasets/ORG/NAME``; None for every other input,
    including a file inside a Hub repo (hf://datasets/ORG/NAME/data/x.parquet, read as a file through
    fsspec like an s3:// one). A local path is never taken for a Hub id."""
    if not uri.startswith(HUB_DATASETS):
        return None
    repo = uri[len(HUB_DATASETS):].strip("/")
    parts = repo.split("/")
    if len(parts) > 2:
        return None
    if not all(parts):
        raise InputError(f"data.prompts: {uri}: no dataset id (expected hf://datasets/ORG/NAME)")
    if "@" in repo:
        raise InputError(f"data.prompts: {uri}: give the revision as data.revision, not after @")
    return repo


def _saved_dataset_dir(uri: str, storage_options: dict, split: str) -> tuple[Any, str, str | None] | None:
    """(filesystem, the directory of the saved Dataset to read, its split name or None) when ``uri``
    is a ``save_to_disk`` directory: a Dataset's (state.json) or a DatasetDict's (dataset_dict.json:
    its split ``split``, InputError naming data.split when it has none such); None for other inputs."""
    fs, path = filesystem(uri, storage_options)
    if not fs.isdir(path):
        return None
    if fs.exists(join(path, "dataset_dict.json")):
        try:
            splits = json.loads(fs.cat_file(join(path, "dataset_dict.json")))["splits"]
        except (ValueError, KeyError, TypeError) as exc:
            raise InputError(f"{join(uri, 'dataset_dict.json')}: unreadable saved DatasetDict ({exc})") from None
        if split not in splits:
            raise InputError(f"data.split: {uri} has no split {split!r} (splits: {', '.join(splits)})")
        return fs, join(path, split), split
    if fs.exists(join(path, "state.json")) or fs.exists(join(path, "dataset_info.json")):
        return fs, path, None
    return None


def _saved_dataset_files(fs, path: str, uri: str, column: str) -> tuple[list[str], dict]:
    """(the Arrow files of the saved Dataset at ``path``, in row order; its state.json), after
    checking that it has the prompt column (the first file's schema, or dataset_info.json's
    features when it has no file). The files are read through fsspec as Arrow streams, one record
    batch at a time, locally and on s3:// alike: ``load_from_disk`` would copy a remote dataset
    whole to a local temporary directory first, and its memory map would keep the pages it touched
    resident."""
    state_path = join(path, "state.json")
    try:
        state = json.loads(fs.cat_file(state_path))
        files = [join(path, f["filename"]) for f in state["_data_files"]]
    except FileNotFoundError:
        raise InputError(f"{uri}: unreadable saved dataset (no {state_path})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{state_path}: unreadable saved dataset state ({type(exc).__name__}: {exc})") from None
    try:
        if files:
            with fs.open(files[0], "rb") as f:
                names = pa.ipc.open_stream(f).schema.names
        else:
            names = list(json.loads(fs.cat_file(join(path, "dataset_info.json"))).get("features") or {})
    except FileNotFoundError as exc:
        raise InputError(f"{uri}: unreadable saved dataset (missing {exc.filename or exc})") from None
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise InputError(f"{files[0] if files else path}: unreadable saved dataset file ({exc})") from None
    if column not in names:
        raise InputError(_no_column(uri, column, names))
    return files, state


def _open_hub_dataset(uri: str, dataset_id: str, subset: str | None, split: str, revision: str | None,
                      column: str) -> tuple[Any, dict]:
    """(the split as a datasets.IterableDataset, its provenance) of a Hub dataset, or InputError
    naming the key at fault (data.prompts: no such dataset; data.subset, data.split, data.revision,
    data.prompt_column: none such in it).

    This is ``datasets.load_dataset(dataset_id, name=subset, split=split, revision=revision,
    streaming=True)`` in its two steps (``load_dataset_builder``, then ``as_streaming_dataset``), so
    that the builder's hash, the commit its data files are pinned to, is recorded: both reads of a
    build (plan, run) read that commit, and a resume at another one fails its shard fingerprints
    rather than mixing two versions. Offline (HF_HUB_OFFLINE=1), datasets reads its own cache of a
    dataset loaded before (HF_DATASETS_CACHE), whatever the revision asks for: the commit recorded
    is then the cached copy's, and a commit id in data.revision that differs from it is refused.

    Why streaming: it reads a batch at a time, so the driver's memory stays flat and nothing of the
    dataset is copied to its disk (a non-streaming load downloads every file of the split and
    writes an Arrow copy before the first row is read, on what is often a small head node); the
    rows come in the same order on every read, which is all the shard fingerprints need. The cost:
    each read goes to the Hub again (planning, the run, a resume)."""
    import datasets

    try:
        with _datasets_errors_only():
            builder = datasets.load_dataset_builder(dataset_id, name=subset, revision=revision)
    except Exception as exc:  # noqa: BLE001 - a dataset that cannot be opened is a user input error
        raise InputError(_hub_error(uri, exc)) from None
    commit = builder.hash
    if revision and _is_commit(revision) and _is_commit(commit) and commit != revision:
        raise InputError(f"data.revision: {uri}: commit {revision} asked for, but the copy found is commit "
                         f"{commit} (offline: only the cached copy can be read)")
    splits = list(builder.info.splits or ())
    if splits and split not in splits:
        raise InputError(f"data.split: {uri} has no split {split!r} (splits: {', '.join(splits)})")
    try:
        with _datasets_errors_only():
            dataset = builder.as_streaming_dataset(split=split)
    except (ValueError, KeyError) as exc:
        raise InputError(f"data.split: {uri}: cannot read split {split!r} ({_first_line(exc)})") from None
    except Exception as exc:  # noqa: BLE001 - files that cannot be listed or reached
        raise InputError(_hub_error(uri, exc)) from None
    if dataset.features is not None and column not in dataset.features:
        raise InputError(_no_column(uri, column, list(dataset.features)))
    provenance = {"kind": "hub", "dataset": dataset_id, "subset": builder.config.name, "split": split,
                  "revision": revision, "commit": commit}
    return dataset, provenance


@contextmanager
def _datasets_errors_only():
    """datasets' own warnings off while a Hub dataset opens (offline: "Using the latest cached
    version ..."): a user error stays one line, and what was read is in the provenance."""
    from datasets.utils import logging as datasets_logging

    level = datasets_logging.get_verbosity()
    datasets_logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets_logging.set_verbosity(level)


def _is_commit(revision: str | None) -> bool:
    return bool(revision) and re.fullmatch(r"[0-9a-f]{40}", revision) is not None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _hub_error(uri: str, exc: BaseException) -> str:
    """The one-line message for a Hub dataset that cannot be opened, naming the key at fault."""
    text = _first_line(exc)
    key = ("data.revision" if "revision" in text.lower() else "data.subset" if "config" in text.lower()
           else "data.prompts")
    return f"{key}: {uri}: {text} ({type(exc).__name__})"


def _no_column(uri: str, column: str, names: list[str]) -> str:
    return f"data.prompt_column: {uri}: no column {column!r} (columns: {', '.join(names)})"


READ_BATCH_ROWS = 4096
"""Rows per Parquet / Arrow record batch read: the most column values the reader holds beyond a shard."""


class PromptSource:
    """The prompt column of an input, in input order, read a bounded piece at a time.

    Opening it checks what can be checked without reading the rows (the files exist; the saved
    dataset or the Hub dataset, its split and subset exist and have the column); reading raises
    InputError naming the file (and the line of a JSONL file) where the input turns out to be
    unreadable. It can be read more than once (the build reads it to plan, and again to run),
    always from the same files (of a Hub dataset: at the same commit).
    """

    def __init__(self, uri: str, column: str, storage_options: dict | None = None,
                 extra_columns: list[str] | None | bool = False, *, split: str = "train",
                 subset: str | None = None, revision: str | None = None):
        """``extra_columns``: False reads the prompt column alone; None every other column too; a
        list those columns (a name no row has: InputError, naming it). ``split``: the split of a
        Hub dataset or a saved DatasetDict (an input without splits takes only the default,
        "train"); ``subset`` and ``revision``: a Hub dataset's config name and branch, tag or commit
        (data.split, data.subset, data.revision)."""
        self.uri, self.column = uri, column
        self.extra = _ExtraColumns(column, extra_columns)
        self.storage_options = storage_options or {}
        self.fs, self.files, self._arrow_files, self._hub = None, [], [], None
        self.skipped: dict[str, str] = {}
        """Files of a directory input that are not read, by path inside it, with the reason
        (skip_reason); the build records them in its manifest."""
        self.provenance: dict = {"kind": "files", "uri": uri}
        """What was read, for the manifest: kind (files, saved_dataset or hub) and uri; a saved
        dataset's split and datasets fingerprint; a Hub dataset's id, subset, split, the revision
        asked for and the commit read."""
        dataset_id = hub_dataset_id(uri)
        if dataset_id is not None:
            self._hub, self.provenance = _open_hub_dataset(uri, dataset_id, subset, split, revision, column)
            return
        for key, value in (("subset", subset), ("revision", revision)):
            if value is not None:
                raise InputError(f"data.{key}: applies to a Hub dataset ({HUB_DATASETS}ORG/NAME) only, "
                                 f"not to {uri}")
        saved = _saved_dataset_dir(uri, self.storage_options, split)
        if saved is not None:
            self.fs, path, split_dir = saved
            self._arrow_files, state = _saved_dataset_files(self.fs, path, uri, column)
            if split_dir is None and split not in ("train", state.get("_split")):
                raise InputError(f"data.split: {uri} is a saved Dataset, not a DatasetDict: it has no split "
                                 f"{split!r} (leave data.split at train)")
            self.provenance = {"kind": "saved_dataset", "uri": uri, "split": split_dir,
                               "fingerprint": state.get("_fingerprint")}
            return
        if split != "train":
            raise InputError(f"data.split: {uri} has no splits (JSONL or Parquet); data.split applies to a "
                             f"saved DatasetDict or a Hub dataset (leave it at train)")
        self.fs, self.files, self.skipped = _files(uri, self.storage_options, SUFFIXES)
        for f in self.files:
            if not f.endswith(SUFFIXES):
                raise InputError(f"{f}: unsupported input format (expected .jsonl, .json or .parquet)")

    def values(self) -> Iterator[Any]:
        """The column's values in input order (None where a JSONL row lacks the key)."""
        return (value for value, _ in self.records())

    def records(self) -> Iterator[tuple[Any, dict]]:
        """(the prompt column's value, the row's other columns read) in input order."""
        if self._hub is not None:
            yield from _read_hub(self._hub, self.uri, self.column, self.extra)
        for path in self._arrow_files:
            yield from _read_arrow_stream(self.fs, path, self.column, self.extra)
        for f in self.files:
            yield from (_read_jsonl(self.fs, f, self.column, self.extra) if f.endswith((".jsonl", ".json"))
                        else _read_parquet(self.fs, f, self.column, self.extra))
        self.extra.check(self.uri)

    def skipped_note(self) -> str | None:
        """One line naming the files of a directory input that were not read; None when none was."""
        if not self.skipped:
            return None
        return f"note: {self.uri}: {len(self.skipped)} file(s) not read: {_skipped_text(self.skipped)}"

    def shards(self, shard_size: int) -> Iterator[tuple[int, list[Any]]]:
        """(k, the values of rows [k * shard_size, (k + 1) * shard_size)) in order; an empty input is
        one empty shard 0 (the build commits it like any other)."""
        for k, values, _ in self.shard_records(shard_size):
            yield k, values

    def shard_records(self, shard_size: int) -> Iterator[tuple[int, list[Any], list[dict]]]:
        """As ``shards``, with each row's other columns: (k, values, their columns)."""
        records = self.records()
        for k in itertools.count():
            chunk = list(itertools.islice(records, shard_size))
            if chunk or k == 0:
                yield k, [v for v, _ in chunk], [c for _, c in chunk]
            if len(chunk) < shard_size:
                return


def read_raw_rows(uri: str, column: str, storage_options: dict | None = None) -> list[Any]:
    """The prompt column's values in input order (None where a JSONL row lacks the key), all at
    once: for inputs that fit in memory (evaluation prompts); the build reads a PromptSource."""
    return list(PromptSource(uri, column, storage_options).values())


class _ExtraColumns:
    """Which other columns to read with the prompt (PromptSource ``extra_columns``), and the check
    that every column asked for by name exists somewhere in the input."""

    def __init__(self, column: str, wanted: list[str] | None | bool):
        self.column, self.wanted = column, wanted
        self.seen: set[str] = set()

    def names(self, available: list[str]) -> list[str]:
        if self.wanted is False:
            return []
        names = [n for n in available if n != self.column and (self.wanted is None or n in self.wanted)]
        self.seen.update(names)
        return names

    def of(self, record: dict) -> dict:
        if self.wanted is False:
            return {}
        return {k: record[k] for k in self.names(list(record))}

    def check(self, uri: str) -> None:
        missing = [n for n in self.wanted or () if n not in self.seen]
        if missing:
            raise InputError(f"{uri}: no column {missing[0]!r} (data.extra_columns)")


def _batch_records(batch: pa.RecordBatch, column: str, extra: list[str]) -> Iterator[tuple[Any, dict]]:
    values = batch.column(column).to_pylist()
    others = {name: batch.column(name).to_pylist() for name in extra}
    for i, value in enumerate(values):
        yield value, {name: others[name][i] for name in extra}


def _read_arrow_stream(fs, path: str, column: str, extra: _ExtraColumns) -> Iterator[tuple[Any, dict]]:
    """A saved dataset's Arrow file (an Arrow IPC stream), one record batch at a time."""
    try:
        with fs.open(path, "rb") as f:
            for batch in pa.ipc.open_stream(f):
                yield from _batch_records(batch, column, extra.names(batch.schema.names))
    except FileNotFoundError:
        raise InputError(f"{path}: no such file (listed in the saved dataset's state.json)") from None
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{path}: unreadable saved dataset file ({exc})") from None


def _read_hub(dataset, uri: str, column: str, extra: _ExtraColumns) -> Iterator[tuple[Any, dict]]:
    """A streamed Hub dataset split (``_open_hub_dataset``), READ_BATCH_ROWS rows at a time, as
    Arrow: the values are those of the files, as a Parquet or saved-dataset input gives them (no
    feature decoding). A split whose features datasets could not tell before reading is checked for
    the column on its first batch."""
    try:
        for table in dataset.with_format("arrow").iter(batch_size=READ_BATCH_ROWS):
            if column not in table.column_names:
                raise InputError(_no_column(uri, column, table.column_names))
            others = extra.names(table.column_names)
            for batch in table.select([column, *others]).to_batches():
                yield from _batch_records(batch, column, others)
    except (pa.ArrowException, OSError) as exc:  # ConnectionError is an OSError
        raise InputError(f"{uri}: reading the Hub dataset failed ({type(exc).__name__}: {_first_line(exc)})") from None


def _read_jsonl(fs, path: str, column: str, extra: _ExtraColumns) -> Iterator[tuple[Any, dict]]:
    """A JSONL file's column, a line at a time; a ``.json`` file that holds one JSON array (of row
    objects) is read as those rows. When no row of the file has the column (a wrong
    data.prompt_column) the file fails, naming the column, as a Parquet file without it does,
    rather than every row becoming a reject; a file where only some rows lack it rejects those."""
    seen = _ColumnSeen(column, extra)
    try:
        with fs.open(path, "rb") as f:
            if path.endswith(".json") and _starts_with_array(f):
                yield from (seen.value(record) for record in _json_array(f, path))
            else:
                for number, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                        raise InputError(f"{path}:{number}: malformed JSON line ({exc})") from None
                    yield seen.value(record)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    seen.check(path)


class _ColumnSeen:
    """Whether any object row of a JSON file has the prompt column (InputError from ``check`` when
    none does)."""

    def __init__(self, column: str, extra: _ExtraColumns):
        self.column, self.extra, self.objects, self.found, self.first_keys = column, extra, 0, False, None

    def value(self, record: Any) -> tuple[Any, dict]:
        if not isinstance(record, dict):
            return NOT_AN_OBJECT, {}
        self.objects += 1
        if self.first_keys is None:
            self.first_keys = list(record)
        self.found = self.found or self.column in record
        return record.get(self.column), self.extra.of(record)

    def check(self, path: str) -> None:
        if self.objects and not self.found:
            keys = ", ".join(self.first_keys[:10]) or "none"
            raise InputError(f"{path}: no row has the column {self.column!r} (data.prompt_column; "
                             f"keys of the first row: {keys})")


def _starts_with_array(f) -> bool:
    """Whether the file's first non-blank byte opens a JSON array (the file is rewound)."""
    head = f.read(4096)
    while head and not head.strip() and len(head) < (1 << 20):
        more = f.read(4096)
        if not more:
            break
        head += more
    f.seek(0)
    return head.lstrip()[:1] == b"["


def _json_array(f, path: str) -> list:
    """The elements of a file holding one JSON array, read whole: JSON arrays have no line
    structure to stream by (JSONL is the format for inputs larger than memory)."""
    try:
        records = json.loads(f.read())
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 JSON ({exc})") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{exc.lineno}: malformed JSON ({exc.msg}, column {exc.colno})") from None
    return records  # a list: the text opens with "["


def _read_parquet(fs, path: str, column: str, extra: _ExtraColumns) -> Iterator[tuple[Any, dict]]:
    """One record batch of the prompt column at a time (a row group's column chunk is the unit
    Parquet reads: the file's writer sets the peak)."""
    try:
        with fs.open(path, "rb") as f:
            parquet = pq.ParquetFile(f)
            names = parquet.schema_arrow.names
            if column not in names:
                raise InputError(f"{path}: no column {column!r} (columns: {', '.join(names)})")
            others = extra.names(names)
            for batch in parquet.iter_batches(batch_size=READ_BATCH_ROWS, columns=[column, *others]):
                yield from _batch_records(batch, column, others)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{path}: unreadable Parquet file ({exc})") from None


class _NotAnObject:
    def __repr__(self):
        return "<JSON line is not an object>"


NOT_AN_OBJECT = _NotAnObject()
"""The value of a JSON row that is not an object (validation rejects it: pipeline.data.prompts)."""
