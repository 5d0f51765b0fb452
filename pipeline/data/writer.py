"""Output: one Parquet part file per input shard, a _rejects/ part per shard, and _manifest.json.

A part file appears whole or not at all: locally it is written to a temp file in the same
directory and renamed with os.replace; on S3 a single PUT of the final key is atomic. A rerun
into the same output skips shards whose part file exists (resume). Rejects are written before
the part file, so a committed shard always has its rejects.
"""

from __future__ import annotations

import json
import os
import uuid

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
])

REJECT_SCHEMA = pa.schema([
    ("source_row", pa.int64()),
    ("prompt_id", pa.string()),
    ("reason", pa.string()),
    ("value", pa.string()),
    ("stage", pa.string()),
    ("generated_tokens", pa.int64()),
    ("bon_equivalent_tokens", pa.int64()),
])


def part_name(shard: int) -> str:
    return f"part-{shard:05d}.parquet"


class OutputStore:
    def __init__(self, uri: str, storage_options: dict | None = None):
        self.uri = uri.rstrip("/")
        self.storage_options = storage_options or {}
        self.fs, self.root = filesystem(self.uri, self.storage_options)
        self.remote = is_remote(uri)
        self.fs.makedirs(self.root, exist_ok=True)

    def is_committed(self, shard: int) -> bool:
        return self.fs.exists(join(self.root, part_name(shard)))

    def read_manifest(self) -> dict | None:
        path = join(self.root, "_manifest.json")
        if not self.fs.exists(path):
            return None
        with self.fs.open(path, "r") as f:
            return json.load(f)

    def commit_shard(self, shard: int, pairs: list[dict], rejects: list[dict]) -> None:
        self._write_table(join(self.root, "_rejects", part_name(shard)), pa.Table.from_pylist(rejects, REJECT_SCHEMA))
        self._write_table(join(self.root, part_name(shard)), pa.Table.from_pylist(pairs, PAIR_SCHEMA))

    def read_shard(self, shard: int) -> tuple[pa.Table, pa.Table]:
        with self.fs.open(join(self.root, part_name(shard)), "rb") as f:
            pairs = pq.read_table(f)
        reject_path = join(self.root, "_rejects", part_name(shard))
        rejects = REJECT_SCHEMA.empty_table()
        if self.fs.exists(reject_path):
            with self.fs.open(reject_path, "rb") as f:
                rejects = pq.read_table(f)
        return pairs, rejects

    def write_manifest(self, manifest: dict) -> None:
        self._write_bytes(join(self.root, "_manifest.json"), json.dumps(manifest, indent=2, sort_keys=True).encode())

    def _write_table(self, path: str, table: pa.Table) -> None:
        sink = pa.BufferOutputStream()
        # An empty table goes out with no row group at all: a 0-row row group makes
        # datasets.load_dataset("parquet") fail for the whole directory.
        with pq.ParquetWriter(sink, table.schema) as writer:
            if table.num_rows:
                writer.write_table(table)
        self._write_bytes(path, sink.getvalue().to_pybytes())

    def _write_bytes(self, path: str, payload: bytes) -> None:
        parent = path.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        if self.remote:
            with self.fs.open(path, "wb") as f:  # one PUT: the key appears whole or not at all
                f.write(payload)
            return
        tmp = join(parent, f".tmp-{uuid.uuid4().hex}-{path.rsplit('/', 1)[1]}")
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
