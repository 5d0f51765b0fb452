"""Output and its commit protocol: exactly-once shards on top of at-least-once execution.

Layout of an output directory or s3:// prefix:

    part-NNNNN.parquet            pairs of input shard NNNNN (one fixed name per shard)
    _rejects/part-NNNNN.parquet   every input row of the shard that has no pair, with its reason
    _quarantine/part-NNNNN.parquet  candidates with a non-finite reward (never used in a pair)
    _markers/part-NNNNN.json      the commit record: row counts, sha256 of each file, the shard's
                                  input fingerprint and the config hash
    _manifest.json, _report.json  totals over all committed shards / this run's figures
    _SUCCESS                      written last, only after every marker was checked against its files

Commit of one shard: the side files, then the part file, then the marker. Every file appears
whole or not at all: locally it is written to a temp file in the same directory and renamed with
os.replace; on S3 one PUT of the final key is atomic. A shard is committed when its marker exists
and matches the config and input; a part file without a marker (a run killed between the two
writes) is redone, and temp files left by a killed run (``.tmp-*``) are ignored and removed.
Ray may run a batch twice (retries are at-least-once); the marker makes the output exactly-once.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
import uuid
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.storage import filesystem, is_remote, join

PAIR_SCHEMA = pa.schema([
    ("prompt_id", pa.string()),
    ("prompt", pa.string()),
    ("chosen", pa.string()),
    ("rejected", pa.string()),
    ("chosen_score", pa.float64()),
    ("rejected_score", pa.float64()),
    ("strategy", pa.string()),
    ("num_candidates", pa.int64()),
    ("generated_tokens", pa.int64()),
    ("bon_equivalent_tokens", pa.int64()),
    ("rejected_is_partial", pa.bool_()),
    ("chosen_sample", pa.int64()),
    ("rejected_sample", pa.int64()),
    ("stopped_early", pa.int64()),
    ("failed_candidates", pa.int64()),
    ("raw_prompt", pa.string()),
    ("prompt_truncated", pa.bool_()),
    ("source_row", pa.int64()),
    ("prompt_token_ids", pa.list_(pa.int64())),
    ("chosen_token_ids", pa.list_(pa.int64())),
    ("rejected_token_ids", pa.list_(pa.int64())),
])

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
"""TRL's conversational format: a list of {"role", "content"} messages."""
CONVERSATIONAL_PAIR_SCHEMA = pa.schema([
    field.with_type(MESSAGES) if field.name in ("prompt", "chosen", "rejected") else field for field in PAIR_SCHEMA])
PAIR_SCHEMAS = {"standard": PAIR_SCHEMA, "conversational": CONVERSATIONAL_PAIR_SCHEMA}

REJECT_SCHEMA = pa.schema([
    ("source_row", pa.int64()),
    ("prompt_id", pa.string()),
    ("reason", pa.string()),
    ("value", pa.string()),
    ("stage", pa.string()),
    ("generated_tokens", pa.int64()),
    ("bon_equivalent_tokens", pa.int64()),
])

# Candidates with a non-finite reward; score is its repr (nan, inf or -inf).
QUARANTINE_SCHEMA = pa.schema([
    ("source_row", pa.int64()),
    ("prompt_id", pa.string()),
    ("sample", pa.int64()),
    ("score", pa.string()),
    ("stopped_early", pa.bool_()),
    ("text", pa.string()),
])

SIDE_DIRS = ("_rejects", "_quarantine")
OWN_FILES = ("_manifest.json", "_report.json", "_SUCCESS")
TMP_PREFIX = ".tmp-"


class OutputConflict(Exception):
    """The output holds shards of a different build (config or input): a user error."""


class IncompleteBuild(Exception):
    """A reader asked for a build that has no ``_SUCCESS`` (still running, killed or failed): a user
    error, one line; ``allow_partial`` reads its committed shards instead."""


def part_name(shard: int) -> str:
    return f"part-{shard:05d}.parquet"


def marker_name(shard: int) -> str:
    return f"part-{shard:05d}.json"


def fingerprint(values: list) -> str:
    """sha256 of a shard's raw input values, in order: the marker's input fingerprint."""
    digest = hashlib.sha256()
    for value in values:
        digest.update(json.dumps(value, sort_keys=True, default=repr).encode())
        digest.update(b"\n")
    return digest.hexdigest()


class OutputStore:
    def __init__(self, uri: str, storage_options: dict | None = None):
        self.uri = uri.rstrip("/")
        self.storage_options = storage_options or {}
        self.fs, self.root = filesystem(self.uri, self.storage_options)
        self.remote = is_remote(uri)
        self.fs.makedirs(self.root, exist_ok=True)

    # -- reading the state of the output ----------------------------------------------------

    def _refresh(self) -> None:
        # s3fs caches listings; another process (a killed run, a concurrent writer) may have changed them.
        if hasattr(self.fs, "invalidate_cache"):
            self.fs.invalidate_cache()

    MARKERS_PER_READ = 1024
    """Commit markers fetched at once (one concurrent fetch on S3): the most the driver holds."""

    def iter_markers(self) -> Iterator[tuple[int, dict]]:
        """Every readable commit marker as (shard, marker), in shard order, read MARKERS_PER_READ at
        a time: an output of any number of shards is checked in bounded memory."""
        self._refresh()
        paths = sorted((p for p in self._ls(join(self.root, "_markers"))
                        if p.endswith(".json") and not p.rsplit("/", 1)[1].startswith(TMP_PREFIX)),
                       key=lambda p: (len(p), p))  # part-00009 < part-00010 < part-100000
        for i in range(0, len(paths), self.MARKERS_PER_READ):
            chunk = paths[i:i + self.MARKERS_PER_READ]
            contents = self.fs.cat(chunk)
            for path in chunk:
                marker = json.loads(contents[path])
                yield int(marker["shard"]), marker

    def markers(self) -> dict[int, dict]:
        """Every readable commit marker, by shard (all in memory: for tests and small outputs)."""
        return dict(self.iter_markers())

    def committed(self, expected: dict[int, tuple[str, str]]) -> set[int]:
        """Shards already committed. ``expected`` maps shard -> (input fingerprint, config hash) of
        this build; a marker that disagrees raises OutputConflict (one line, for the user). A marker
        whose part file is missing or has another size is not committed (the shard is redone)."""
        sizes = self._sizes()
        done = set()
        for shard, marker in self.iter_markers():
            if shard not in expected:
                raise OutputConflict(f"{self.uri}: holds shard {shard}, but this input has {len(expected)} shards "
                                     "(a different input or data.shard_size)")
            fp, config_hash = expected[shard]
            if marker["config_hash"] != config_hash:
                raise OutputConflict(f"{self.uri}: was built with a different config (hash {marker['config_hash'][:12]}, "
                                     f"now {config_hash[:12]}); use --overwrite to replace it, or another --output")
            if marker["input_fingerprint"] != fp:
                raise OutputConflict(f"{self.uri}: shard {shard} was built from different input rows; "
                                     "use --overwrite to replace it, or another --output")
            if sizes.get(part_name(shard)) == marker["bytes"]:
                done.add(shard)
        return done

    def _sizes(self) -> dict[str, int]:
        self._refresh()
        return {entry["name"].rsplit("/", 1)[1]: entry["size"]
                for entry in self._ls(self.root, detail=True) if entry["type"] == "file"}

    def _ls(self, path: str, detail: bool = False) -> list:
        try:  # an S3 "directory" with nothing under it does not exist
            return self.fs.ls(path, detail=detail)
        except FileNotFoundError:
            return []

    def read_manifest(self) -> dict | None:
        path = join(self.root, "_manifest.json")
        self._refresh()
        if not self.fs.exists(path):
            return None
        with self.fs.open(path, "r") as f:
            return json.load(f)

    def read_shard(self, shard: int) -> tuple[pa.Table, pa.Table]:
        with self.fs.open(join(self.root, part_name(shard)), "rb") as f:
            pairs = pq.read_table(f)
        reject_path = join(self.root, "_rejects", part_name(shard))
        rejects = REJECT_SCHEMA.empty_table()
        if self.fs.exists(reject_path):
            with self.fs.open(reject_path, "rb") as f:
                rejects = pq.read_table(f)
        return pairs, rejects

    def committed_parts(self, allow_partial: bool = False) -> list[str]:
        """The part files a reader of this build may read, in shard order, as paths this store's
        filesystem opens (``self.fs``): only shards whose commit marker exists and whose part file
        matches it (size and sha256 recorded by the marker). Without ``_SUCCESS`` this raises
        IncompleteBuild, unless ``allow_partial``: then the committed shards are returned and the
        caller says how many it read. A part file with no marker (a killed run's leftover) is never
        returned. This is the one way a job reads a build's pairs."""
        if not self.succeeded() and not allow_partial:
            raise IncompleteBuild(f"{self.uri}: not a finished build (no _SUCCESS); wait for it to finish, "
                                  "or pass --allow-partial to read its committed shards only")
        parts = []
        for shard, marker in self.iter_markers():
            path = join(self.root, part_name(shard))
            try:
                with self.fs.open(path, "rb") as f:
                    payload = f.read()
            except FileNotFoundError:
                continue
            if len(payload) == marker.get("bytes") and hashlib.sha256(payload).hexdigest() == marker.get("sha256"):
                parts.append(path)
        return parts

    def succeeded(self) -> bool:
        self._refresh()
        return self.fs.exists(join(self.root, "_SUCCESS"))

    # -- writing -----------------------------------------------------------------------------

    def prepare(self, overwrite: bool = False) -> None:
        """Before a run: remove temp files of killed runs and the old _SUCCESS (this run rewrites it);
        with ``overwrite``, remove every file of an earlier build (only ours: part-*, _markers/, ...)."""
        self._refresh()
        for directory in (self.root, *(join(self.root, d) for d in (*SIDE_DIRS, "_markers"))):
            for path in self._ls(directory):
                name = path.rsplit("/", 1)[1]
                ours = name.startswith("part-") or (directory == self.root and name in OWN_FILES)
                if name.startswith(TMP_PREFIX) or name == "_SUCCESS" or (overwrite and ours):
                    self.fs.rm(path)
        self._refresh()

    def commit_shard(self, shard: int, pairs: list[dict], rejects: list[dict], input_fingerprint: str,
                     config_hash: str, stats: dict | None = None, quarantine: list[dict] | None = None,
                     output_format: str = "standard") -> dict:
        """Write the shard's side files, its part file (pairs in TRL's ``output_format``), then its
        marker (the commit point)."""
        name = part_name(shard)
        marker = {"shard": shard, "part": name, "input_fingerprint": input_fingerprint, "config_hash": config_hash,
                  "stats": stats or {}, "committed_at": time.time()}
        for key, directory, rows, schema in (("rejects", "_rejects", rejects, REJECT_SCHEMA),
                                             ("quarantine", "_quarantine", quarantine or [], QUARANTINE_SCHEMA)):
            payload = _parquet_bytes(pa.Table.from_pylist(rows, schema))
            self._write_bytes(join(self.root, directory, name), payload)
            marker[key] = {"rows": len(rows), "sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload)}
        payload = _parquet_bytes(pa.Table.from_pylist(pairs, PAIR_SCHEMAS[output_format]))
        self._write_bytes(join(self.root, name), payload)
        marker.update(rows=len(pairs), sha256=hashlib.sha256(payload).hexdigest(), bytes=len(payload))
        self._write_bytes(join(self.root, "_markers", marker_name(shard)), json.dumps(marker, sort_keys=True).encode())
        return marker

    def verify(self, num_shards: int) -> Iterator[tuple[int, dict]]:
        """Check the marker of every shard 0 .. num_shards - 1 against its files (sha256 and row
        count), in shard order, yielding (shard, marker) as each passes; markers are read a chunk at
        a time (iter_markers). Raises RuntimeError naming the first shard that fails: consume it all
        before declaring the output complete."""
        expected = 0
        for shard, marker in itertools.chain(self.iter_markers(), [(num_shards, None)]):
            if shard >= num_shards and expected == num_shards:
                return
            if shard != expected:
                missing = min(expected, num_shards)
                raise RuntimeError(f"shard {missing}: no commit marker ({join(self.uri, '_markers', marker_name(missing))})")
            expected += 1
            files = [(part_name(shard), marker)] + [(f"{d}/{part_name(shard)}", marker[d.strip("_")]) for d in SIDE_DIRS]
            for rel, record in files:
                with self.fs.open(join(self.root, rel), "rb") as f:
                    payload = f.read()
                if hashlib.sha256(payload).hexdigest() != record["sha256"]:
                    raise RuntimeError(f"shard {shard}: {rel} does not match its commit marker (sha256)")
                rows = pq.ParquetFile(pa.BufferReader(payload)).metadata.num_rows
                if rows != record["rows"]:
                    raise RuntimeError(f"shard {shard}: {rel} has {rows} rows, its marker says {record['rows']}")
            yield shard, marker

    def write_json(self, name: str, content: dict) -> None:
        self._write_bytes(join(self.root, name), json.dumps(content, indent=2, sort_keys=True).encode())

    def write_manifest(self, manifest: dict) -> None:
        self.write_json("_manifest.json", manifest)

    def write_success(self, content: dict) -> None:
        self.write_json("_SUCCESS", content)

    def _write_bytes(self, path: str, payload: bytes) -> None:
        parent = path.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        if self.remote:
            with self.fs.open(path, "wb") as f:  # one PUT: the key appears whole or not at all
                f.write(payload)
            return
        tmp = join(parent, f"{TMP_PREFIX}{uuid.uuid4().hex}-{path.rsplit('/', 1)[1]}")
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    # An empty table goes out with no row group at all: a 0-row row group makes
    # datasets.load_dataset("parquet") fail for the whole directory.
    with pq.ParquetWriter(sink, table.schema) as writer:
        if table.num_rows:
            writer.write_table(table)
    return sink.getvalue().to_pybytes()
