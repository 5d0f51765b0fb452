"""Output and its commit protocol: exactly-once shards on top of at-least-once execution.

Layout of an output directory or s3:// prefix:

    train-NNNNN.parquet           pairs of input shard NNNNN (one fixed name per shard)
    _rejects/part-NNNNN.parquet   every input row of the shard that has no pair, with its reason
    _quarantine/part-NNNNN.parquet  candidates with a non-finite reward (never used in a pair)
    _markers/part-NNNNN.json      the commit record: row counts, sha256 of each file, the shard's
                                  input fingerprint and the config hash
    README.md                     the dataset card (pipeline.data.card): YAML ``configs:`` naming the
                                  committed files, for ``datasets.load_dataset(OUT)``
    _manifest.json, _report.json  totals over all committed shards / this run's figures
    _SUCCESS                      written last, only after every marker was checked against its files

Why ``train-``: ``datasets.load_dataset("parquet", data_dir=OUT)`` reads no card; it picks files by
split keyword in their names (datasets' ``**/{keyword}[-._ 0-9]*`` patterns, train/test/validation
and their synonyms) and, when no name has one, reads every file under OUT (``_SUCCESS`` and the
JSON files included). Pair files named ``train-*`` make it read exactly them as the train split;
every other name here (``part-*`` side files and markers, ``_manifest.json``, ...) holds no split
keyword, so nothing else matches. ``load_dataset(OUT)`` reads the card instead (``write_card``).
Outputs of the older layout (pair files ``part-NNNNN.parquet``; their markers name them) are still
read through their markers; a build does not resume one (OutputConflict: rebuild with --overwrite).

The card is kept current while a build runs: written when it starts (``prepare``) and again after a
commit at most every CARD_INTERVAL_S, naming only shards committed when it was written, so a killed
build's card never names an uncommitted file; the build writes the full card (columns, counts,
provenance) before ``_SUCCESS``. A README.md this pipeline did not write is the user's: it is left
as it is, no card is written, and one line says so.

Commit of one shard: the side files, then the part file, then the marker. Every file appears
whole or not at all: locally it is written to a temp file in the same directory and renamed with
os.replace; on S3 one PUT of the final key is atomic. A shard is committed when its marker exists
and matches the config and input; a part file without a marker (a run killed between the two
writes) is redone, and temp files left by a killed run (``.tmp-*``) are ignored and removed. A
pending pair file (``.pending-*``) whose marker exists is completed by the next run (renamed, or, on
S3, where a rename is a copy then a delete and a kill may fall between the two, deleted beside its
copied pair file: ``_finish_commit``); one whose marker does not is removed (``prepare``).
Ray may run a batch twice (retries are at-least-once); the marker makes the output exactly-once.
Every reader of a build (training, expert iteration, evaluation) reads it through its reader
(pipeline.data.reader: ``OutputReader.read_committed`` / ``committed_parts``): committed shards only,
never by listing it.

One writer per output: a build holds ``_lease.json`` from planning to its end (pipeline.data.lease).
Everything else in the output is read or changed only while the lease is held, so a build never
sees another live build's temp files. The pair columns and the extra-column schema are
pipeline.data.schema's.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import time
import uuid
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data import card
from pipeline.data.layout import TMP_PREFIX, marker_name, part_name, pending_name, side_name
from pipeline.data.lease import LEASE_TMP_PREFIX, Lease, lease_file
from pipeline.data.reader import OutputReader
from pipeline.data.schema import PAIR_SCHEMAS, QUARANTINE_SCHEMA, REJECT_SCHEMA, ExtraColumns
from pipeline.data.storage import is_remote, join
from pipeline.errors import OutputConflict

log = logging.getLogger(__name__)

SIDE_DIRS = ("_rejects", "_quarantine")
OWN_FILES = ("_manifest.json", "_report.json", "_SUCCESS")
IDENTITY_KEYS_ORDER = ("models.generator", "models.reward", "models.draft", "output schema")


_OUR_NAMES = re.compile(r"^(train-\d{5,}\.parquet|\.pending-train-\d{5,}\.parquet)$")
_OUR_SIDE_NAMES = re.compile(r"^part-\d{5,}\.parquet$")


def _identity_changes(built: dict | None, now: dict) -> list[str]:
    """What differs between the identity a marker records and this build's, one clause per key:
    "models.reward: module sha256 ab12.. -> cd34..". A marker with none is an older build's."""
    if built is None:
        return ["no build identity recorded (an older version of this pipeline built it)"]
    changes = []
    for key in sorted(set(built) | set(now), key=lambda k: (IDENTITY_KEYS_ORDER + (k,)).index(k)):
        if built.get(key) != now.get(key):
            changes.append(f"{key}: {_short(built.get(key))} -> {_short(now.get(key))}")
    return changes


def _short(value) -> str:
    text = "(none)" if value is None else str(value)
    return re.sub(r"\b([0-9a-f]{12})[0-9a-f]{20,}\b", r"\1..", text)



def check_location(output: str, prompts: str) -> None:
    """Refuse an output that is the input, lies inside the input directory, or holds the input:
    the build would read its own output as prompts, or ``--overwrite`` would delete the input.
    Local paths are compared resolved (symlinks, ``..``), s3:// URIs as bucket/prefix; a glob input
    stands for its directory (recursively only with ``**``)."""
    if not output or not prompts:
        return
    out_scheme, out = _location(output)
    in_scheme, source = _location(prompts)
    if out_scheme != in_scheme:
        return
    glob_at = min((source.find(ch) for ch in "*?[" if ch in source), default=-1)
    recursive = True
    if glob_at >= 0:
        recursive = "**" in source
        source = source[:glob_at].rsplit("/", 1)[0]
    if out == source:
        where = "is the input"
    elif recursive and out.startswith(source.rstrip("/") + "/"):
        where = "is inside the input"
    elif source.startswith(out.rstrip("/") + "/"):
        where = "holds the input"
    else:
        return
    raise OutputConflict(f"data.output: {output} {where} ({prompts}); choose another --output")


def _location(uri: str) -> tuple[str, str]:
    if is_remote(uri):
        scheme, rest = uri.split("://", 1)
        return scheme, rest.strip("/")
    path = uri[len("file://"):] if uri.startswith("file://") else uri
    return "file", os.path.realpath(path)


def fingerprint(values: list) -> str:
    """sha256 of a shard's raw input values, in order: the marker's input fingerprint."""
    digest = hashlib.sha256()
    for value in values:
        digest.update(json.dumps(value, sort_keys=True, default=repr).encode())
        digest.update(b"\n")
    return digest.hexdigest()



class OutputStore(OutputReader):
    """The output's one writer (it holds the lease) and its commit protocol; it reads the
    output's committed state as any OutputReader does (pipeline.data.reader)."""

    LEASE_TIMEOUT_S = 120.0
    """A lease whose heartbeat is older than this belongs to a dead build and is taken over."""
    LEASE_HEARTBEAT_S = 10.0
    """How often the holder rewrites its lease's heartbeat (well under the timeout)."""
    CARD_INTERVAL_S = 30.0
    """While a build runs, its card is rewritten after a commit at most this often: one small write
    per interval, however many shards commit (the card lists them, so a rewrite per commit would
    cost writes quadratic in the shards)."""

    def __init__(self, uri: str, storage_options: dict | None = None, create: bool = True):
        """The store of the output at ``uri``; ``create`` makes its directory (a build's)."""
        super().__init__(uri, storage_options)
        self.lease: Lease | None = None
        self._found: dict[int, dict] = {}  # the committed shards' markers, as committed() found them
        self.card_shards: dict[int, dict] | None = None
        """The markers of the shards the card names (from ``prepare`` on, the committed ones); None
        while this store keeps no card."""
        self.card_blocked: str | None = None
        """Why no card is written (a README.md of the user's is in the way)."""
        self._card_written_at = 0.0
        if create:
            self.fs.makedirs(self.root, exist_ok=True)

    # -- the lease ---------------------------------------------------------------------------

    def acquire_lease(self, config_hash: str, timeout_s: float | None = None, heartbeat_s: float | None = None) -> None:
        """Become the output's one writer (Lease), before anything in it is read or changed; raises
        OutputLocked when a live build holds it."""
        timeout_s = timeout_s or self.LEASE_TIMEOUT_S
        lease = Lease(lease_file(self.fs, self.root, self.uri, self.remote), self.uri, config_hash, timeout_s,
                      heartbeat_s or min(self.LEASE_HEARTBEAT_S, timeout_s / 12))
        lease.acquire()
        self.lease = lease

    def release_lease(self) -> None:
        """Let the next build in (idempotent; a build calls it in a ``finally``)."""
        if self.lease is not None:
            self.lease.release()

    def committed(self, expected: dict[int, tuple[str, str]], identity: dict | None = None) -> set[int]:
        """Shards already committed. ``expected`` maps shard -> (input fingerprint, config hash) of
        this build, ``identity`` what computes its samples and rewards (pipeline.provenance.build_identity:
        each model's weights sha256 or Hub commit, the reward function's code, the output schema);
        a marker that disagrees raises OutputConflict (one line naming what changed). A shard whose
        files are missing or do not match its marker (size and sha256: damaged after its commit) is
        not committed: it is rebuilt, and one line on stderr says so. A commit interrupted after its
        marker (the pair file still under its pending name) is completed here, under the lease."""
        done = set()
        self._found = {}
        names = self._top_names()
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
            if self.pair_file(shard, marker) != part_name(shard):
                raise OutputConflict(f"{self.uri}: was written by an older version of this pipeline (pair files "
                                     f"{self.pair_file(shard, marker)}, now {part_name(shard)}); rebuild it with "
                                     "--overwrite, or use another --output")
            if identity is not None:
                changes = _identity_changes(marker.get("identity"), identity)
                if changes:
                    raise OutputConflict(f"{self.uri}: shard {shard} was built differently ({'; '.join(changes)}); a "
                                         "resume would mix the two: use --overwrite to rebuild it, or another --output")
            self._finish_commit(shard, marker, names)
            damage = self._damage(shard, marker)
            if damage is None:
                done.add(shard)
                self._found[shard] = marker
            else:
                log.warning(f"{join(self.uri, damage)}; shard {shard} is rebuilt")
        return done

    def _finish_commit(self, shard: int, marker: dict, names: set[str]) -> None:
        """Complete a commit that stopped after its marker, where the shard's pending file is still
        there. Either the rename never began (``_interrupted``: no pair file) or, on S3, where a
        rename is a copy then a delete, it stopped between the two (both files there). A pair file
        that matches its marker is the commit done: the pending file is deleted. Otherwise a
        pending file that matches the marker is renamed to the pair file's name; one that matches
        neither is left for the shard's rebuild to overwrite. ``names``: the root's file names
        (``_top_names``)."""
        pending, name = pending_name(shard), part_name(shard)
        if pending not in names or self.pair_file(shard, marker) != name:
            return
        if name in names and self._file_damage(name, marker) is None:
            self._delete(pending)
        elif self._file_damage(pending, marker) is None:
            self._rename(pending, name)

    def _rename(self, source: str, target: str) -> None:
        """Rename ``source`` to ``target`` (relative to the root): atomic locally (os.replace); on
        S3 a server-side copy (the target key appears whole) and a delete."""
        if self.lease is not None:
            self.lease.check()
        self.fs.mv(join(self.root, source), join(self.root, target))

    def _delete(self, name: str) -> None:
        """Delete ``name`` (relative to the root), as the output's writer."""
        if self.lease is not None:
            self.lease.check()
        self.fs.rm(join(self.root, name))

    def _files(self, shard: int, marker: dict) -> list[tuple[str, dict]]:
        """(path relative to the root, its record in the marker) of the shard's three files."""
        return [(self.pair_file(shard, marker), marker)] + [(f"{d}/{side_name(shard)}", marker[d.strip("_")])
                                                            for d in SIDE_DIRS]

    def _damage(self, shard: int, marker: dict) -> str | None:
        """The first of the shard's files that is missing or is not the one its marker records, as
        "relative path: what is wrong"; None if all match."""
        for rel, record in self._files(shard, marker):
            wrong = self._file_damage(rel, record)
            if wrong is not None:
                return wrong
        return None

    # -- writing -----------------------------------------------------------------------------

    def prepare(self, overwrite: bool = False) -> None:
        """Before a run, with the lease held: remove temp files (with the lease ours, only a dead
        build can have left them) and the old _SUCCESS (this run rewrites it). With ``overwrite``,
        remove the earlier build: what its markers say it wrote (each shard's part, rejects and
        quarantine files, then the marker) and our root files; any other file, even one named
        ``part-*``, is the user's and stays. Then the card names the shards committed so far (none
        after ``overwrite``: our card is removed), and is kept current from here on."""
        if self.lease is None:
            raise RuntimeError(f"{self.uri}: prepare() needs the output's lease (acquire_lease first)")
        self.lease.check()
        self._refresh()
        doomed = [path for directory in (self.root, *(join(self.root, d) for d in (*SIDE_DIRS, "_markers")))
                  for path in self._ls(directory) if path.rsplit("/", 1)[1].startswith(TMP_PREFIX)]
        doomed += self._unclaimed(overwrite)
        doomed.append(join(self.root, "_SUCCESS"))
        # Another build's lease attempt may be in flight: only a lease temp file older than the
        # lease timeout is a killed process's leftover.
        doomed += [entry["name"] for entry in self._ls(self.root, detail=True)
                   if entry["name"].rsplit("/", 1)[1].startswith(LEASE_TMP_PREFIX)
                   and time.time() - _mtime(entry) > self.lease.timeout_s]
        if overwrite:
            for shard, marker in self.iter_markers():  # a marker goes after its files: a rerun finds them
                doomed += [join(self.root, rel) for rel, _ in self._files(shard, marker)]
                doomed.append(join(self.root, "_markers", marker_name(shard)))
            doomed += [join(self.root, name) for name in OWN_FILES]
        for path in doomed:
            try:
                self.fs.rm(path)
            except FileNotFoundError:
                pass
        self._refresh()
        self.card_shards = {} if overwrite else dict(self._found)
        card.check_slot(self)
        card.write_progress(self)

    def _unclaimed(self, overwrite: bool) -> list[str]:
        """Files of this project's naming that no marker claims (all of them with ``overwrite``,
        whose markers go too): pair files ``train-NNNNN.parquet`` and their pending names, and
        ``part-NNNNN.parquet`` under ``_rejects/`` and ``_quarantine/``, left by a killed build of an
        older version or by a build with more shards. A top-level ``part-*`` file stays: outputs of
        the older layout named their pair files so, and so may a user."""
        claimed = set()
        if not overwrite:
            for shard, marker in self.iter_markers():
                claimed.update(join(self.root, rel) for rel, _ in self._files(shard, marker))
                claimed.add(join(self.root, pending_name(shard)))  # an interrupted commit's (committed() finishes it)
        found = [p for p in self._ls(self.root) if _OUR_NAMES.match(p.rsplit("/", 1)[1])]
        found += [p for d in SIDE_DIRS for p in self._ls(join(self.root, d)) if _OUR_SIDE_NAMES.match(p.rsplit("/", 1)[1])]
        return [p for p in found if p not in claimed]

    def commit_shard(self, shard: int, pairs: list[dict], rejects: list[dict], input_fingerprint: str,
                     config_hash: str, stats: dict | None = None, quarantine: list[dict] | None = None,
                     output_format: str = "standard", extra: ExtraColumns | None = None,
                     identity: dict | None = None) -> dict:
        """Write the shard's side files, its pair file under its pending name (pairs in TRL's
        ``output_format``, then the ``extra`` columns), its marker (with ``identity``, the build's:
        see ``committed``), then rename the pair file to its name: the commit point. Until then
        neither ``load_dataset`` form sees the pairs (the pending name is hidden), and once the pair
        file has its name its marker is there: both read exactly the committed pairs after any kill."""
        name, side = part_name(shard), side_name(shard)
        marker = {"shard": shard, "part": name, "input_fingerprint": input_fingerprint, "config_hash": config_hash,
                  "stats": stats or {}, "committed_at": time.time()}
        if identity is not None:
            marker["identity"] = identity
        for key, directory, rows, schema in (("rejects", "_rejects", rejects, REJECT_SCHEMA),
                                             ("quarantine", "_quarantine", quarantine or [], QUARANTINE_SCHEMA)):
            payload = _parquet_bytes(pa.Table.from_pylist(rows, schema))
            self._write_bytes(join(self.root, directory, side), payload)
            marker[key] = {"rows": len(rows), "sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload)}
        schema = PAIR_SCHEMAS[output_format] if extra is None else extra.schema(PAIR_SCHEMAS[output_format])
        payload = _parquet_bytes(pa.Table.from_pylist(pairs, schema))
        self._write_bytes(join(self.root, pending_name(shard)), payload)
        marker.update(rows=len(pairs), sha256=hashlib.sha256(payload).hexdigest(), bytes=len(payload))
        self._write_bytes(join(self.root, "_markers", marker_name(shard)), json.dumps(marker, sort_keys=True).encode())
        self._rename(pending_name(shard), name)
        if self.card_shards is not None:
            self.card_shards[shard] = marker
            if time.time() - self._card_written_at >= self.CARD_INTERVAL_S:
                card.write_progress(self)
        return marker

    def verify(self, num_shards: int, config_hash: str | None = None, identity: dict | None = None,
               schema: pa.Schema | None = None) -> Iterator[tuple[int, dict]]:
        """Check the marker of every shard 0 .. num_shards - 1 against its files (sha256 and row
        count) and, given ``config_hash`` and ``identity``, against the build's config and identity,
        and given ``schema``, every pair file's schema against it (one schema per output), in shard
        order, yielding (shard, marker) as each passes; markers are read a chunk at a time
        (iter_markers). Raises RuntimeError naming the first shard whose files fail, OutputConflict
        for a shard another config, identity or schema wrote: consume it all before declaring the
        output complete."""
        expected = 0
        for shard, marker in itertools.chain(self.iter_markers(), [(num_shards, None)]):
            if shard >= num_shards and expected == num_shards:
                return
            if shard != expected:
                missing = min(expected, num_shards)
                raise RuntimeError(f"shard {missing}: no commit marker ({join(self.uri, '_markers', marker_name(missing))})")
            expected += 1
            if config_hash is not None and marker["config_hash"] != config_hash:
                raise OutputConflict(f"{self.uri}: shard {shard} was written by a build with another config (hash "
                                     f"{marker['config_hash'][:12]}, this build {config_hash[:12]}): two builds wrote "
                                     "this output; rebuild it with --overwrite")
            changes = _identity_changes(marker.get("identity"), identity) if identity is not None else []
            if changes:
                raise OutputConflict(f"{self.uri}: shard {shard} was built differently "
                                     f"({'; '.join(changes)}): two builds "
                                     "wrote this output; rebuild it with --overwrite")
            for rel, record in self._files(shard, marker):
                with self.fs.open(join(self.root, rel), "rb") as f:
                    payload = f.read()
                if hashlib.sha256(payload).hexdigest() != record["sha256"]:
                    raise RuntimeError(f"shard {shard}: {rel} does not match its commit marker (sha256)")
                parquet = pq.ParquetFile(pa.BufferReader(payload))
                rows = parquet.metadata.num_rows
                if rows != record["rows"]:
                    raise RuntimeError(f"shard {shard}: {rel} has {rows} rows, its marker says {record['rows']}")
                if schema is not None and record is marker and not parquet.schema_arrow.equals(schema):
                    found = {f.name: str(f.type) for f in parquet.schema_arrow}
                    differ = [n for n in dict.fromkeys([*found, *schema.names])
                              if found.get(n) != (str(schema.field(n).type) if n in schema.names else None)]
                    raise OutputConflict(f"{self.uri}: {rel} has another schema than this build's (column(s) "
                                         f"{', '.join(differ)}): one output holds one schema; rebuild it with "
                                         "--overwrite")
            yield shard, marker

    def write_json(self, name: str, content: dict) -> None:
        self._write_bytes(join(self.root, name), json.dumps(content, indent=2, sort_keys=True).encode())

    def write_manifest(self, manifest: dict) -> None:
        self.write_json("_manifest.json", manifest)

    def write_success(self, content: dict) -> None:
        self.write_json("_SUCCESS", content)

    def _write_bytes(self, path: str, payload: bytes) -> None:
        if self.lease is not None:  # a build that lost its lease writes nothing more
            self.lease.check()
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


def _mtime(entry: dict) -> float:
    """A listing entry's modification time in seconds (fsspec's local "mtime"; S3 has none of these
    files)."""
    value = entry.get("mtime", entry.get("LastModified", 0))
    return value.timestamp() if hasattr(value, "timestamp") else float(value or 0)


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    # An empty table goes out with no row group at all: a 0-row row group makes
    # datasets.load_dataset("parquet") fail for the whole directory.
    with pq.ParquetWriter(sink, table.schema) as writer:
        if table.num_rows:
            writer.write_table(table)
    return sink.getvalue().to_pybytes()
