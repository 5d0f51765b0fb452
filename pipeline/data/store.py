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
Every reader of a build (training, expert iteration, evaluation) reads it through its store
(``OutputStore.read_committed`` / ``committed_parts``): committed shards only, never by listing it.

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
from dataclasses import dataclass
from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data import card
from pipeline.data.layout import PENDING_PREFIX, marker_name, part_name, pending_name, side_name
from pipeline.data.lease import LEASE_NAME, LEASE_TMP_PREFIX, Lease, lease_file
from pipeline.data.schema import PAIR_SCHEMAS, QUARANTINE_SCHEMA, REJECT_SCHEMA, ExtraColumns
from pipeline.data.storage import filesystem, is_remote, join
from pipeline.errors import CorruptMarker, IncompleteBuild, OutputConflict

log = logging.getLogger(__name__)

SIDE_DIRS = ("_rejects", "_quarantine")
OWN_FILES = ("_manifest.json", "_report.json", "_SUCCESS")
TMP_PREFIX = ".tmp-"
IDENTITY_KEYS_ORDER = ("models.generator", "models.reward", "models.draft", "output schema")
MARKER_KEYS = ("shard", "config_hash", "input_fingerprint", "rows", "sha256", "bytes", "rejects", "quarantine")


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


PAIR_FILE_PREFIXES = ("train-", "part-")
"""Top-level Parquet files named so hold pairs: a build's (``train-NNNNN``, part_name; ``part-NNNNN``
in builds of the older layout), and by the same convention a user's own pairs directory."""


def is_pair_file(name: str) -> bool:
    """Whether a top-level file name is a pair file's (PAIR_FILE_PREFIXES, ``.parquet``); a temp
    file (``.tmp-*``) never is."""
    return name.startswith(PAIR_FILE_PREFIXES) and name.endswith(".parquet")


BUILD_FILES = ("_markers", "_manifest.json", "_SUCCESS", LEASE_NAME)
"""What only a build's output holds beside its pair files: a directory with any of them is a build,
read through its store (committed shards only), even one killed before it wrote anything but a lease."""


def is_build(fs, path: str) -> bool:
    """Whether directory ``path`` of ``fs`` is a build's output (BUILD_FILES). A user's own pairs
    directory (pair files and nothing of ours) is not: it is read by listing it, as it always was."""
    return any(fs.exists(join(path, name)) for name in BUILD_FILES)


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


@dataclass
class BuildRead:
    """What one reader of a build gets from its store (OutputStore.read_committed): the pair files
    it may read, and what of the build it left out, for the one line a job prints when it read less
    than a finished build (partial_read_line)."""

    uri: str
    parts: list[str]
    """The committed shards' pair files, in shard order, as paths of the store's filesystem."""
    finished: bool
    """The build has ``_SUCCESS``."""
    shards_committed: int
    """Commit markers (of the files the reader asked for)."""
    pairs_committed: int
    """The row counts those markers record."""
    skipped: list[int]
    """Shards with a marker whose pair file is missing or no longer matches it (changed after the build)."""
    leftovers: list[str]
    """Names of pair files with no marker: a killed build's, or strays; never read."""

    def note(self) -> str | None:
        """This build's clause of the partial-read line; None when the read was the whole finished build."""
        if self.finished and not self.skipped and not self.leftovers:
            return None
        state = "finished" if self.finished else "unfinished (no _SUCCESS)"
        note = (f"{self.uri}: {state} build: read {len(self.parts)} of its {self.shards_committed} committed shards "
                f"({self.pairs_committed} pairs committed)")
        if self.skipped:
            note += (f", skipped shard(s) {', '.join(map(str, self.skipped))} (part file missing or not matching "
                     "its marker)")
        if self.leftovers:
            note += f", ignored {len(self.leftovers)} part file(s) with no commit marker"
        return note


def partial_read_line(uri: str, pairs: int, reads: list[BuildRead]) -> str | None:
    """The one line a job prints when it read less than whole finished builds (None when it did
    not): per build, how many shards and pairs it read out of how many the build committed, and
    what it left out; then the pairs loaded from ``uri``."""
    notes = [note for note in (read.note() for read in reads) if note]
    if not notes:
        return None
    return f"warning: {'; '.join(notes)}; {pairs} pairs loaded from {uri}"


class OutputStore:
    LEASE_TIMEOUT_S = 120.0
    """A lease whose heartbeat is older than this belongs to a dead build and is taken over."""
    LEASE_HEARTBEAT_S = 10.0
    """How often the holder rewrites its lease's heartbeat (well under the timeout)."""
    CARD_INTERVAL_S = 30.0
    """While a build runs, its card is rewritten after a commit at most this often: one small write
    per interval, however many shards commit (the card lists them, so a rewrite per commit would
    cost writes quadratic in the shards)."""

    def __init__(self, uri: str, storage_options: dict | None = None, create: bool = True):
        """The store of the output at ``uri``; ``create`` makes its directory (a build's), a reader's
        store (open_build) creates nothing."""
        self.uri = uri.rstrip("/")
        self.storage_options = storage_options or {}
        self.fs, self.root = filesystem(self.uri, self.storage_options)
        self.remote = is_remote(uri)
        self.lease: Lease | None = None
        self._found: dict[int, dict] = {}  # the committed shards' markers, as committed() found them
        self.card_shards: dict[int, dict] | None = None
        """The markers of the shards the card names (from ``prepare`` on, the committed ones); None
        while this store keeps no card."""
        self.card_blocked: str | None = None
        """Why no card is written (a README.md of the user's is in the way)."""
        self._card_written_at = 0.0
        if self.fs.isfile(self.root):
            raise OutputConflict(f"{self.uri}: is a file; the output must be a directory or an s3:// prefix")
        if create:
            self.fs.makedirs(self.root, exist_ok=True)

    @classmethod
    def open_build(cls, uri: str, storage_options: dict | None = None) -> "OutputStore | None":
        """The store of the build at ``uri``, for reading it; None where ``uri`` is no build (is_build:
        nothing there, a file, or a user's own pairs directory). Creates nothing."""
        fs, path = filesystem(uri, storage_options)
        if not fs.isdir(path) or not is_build(fs, path):
            return None
        return cls(uri, storage_options, create=False)

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
                marker = self._parse_marker(path, contents[path])
                yield marker["shard"], marker

    def _parse_marker(self, path: str, content: bytes) -> dict:
        """A marker this project wrote, or CorruptMarker (one line naming the file)."""
        name = path.rsplit("/", 1)[1]
        try:
            marker = json.loads(content)
            if not isinstance(marker, dict):
                raise ValueError("not a JSON object")
            missing = [key for key in MARKER_KEYS if key not in marker]
            if missing:
                raise ValueError(f"no {', '.join(missing)}")
            if not isinstance(marker["shard"], int) or marker_name(marker["shard"]) != name:
                raise ValueError(f"its shard {marker['shard']!r} does not match its name")
        except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise CorruptMarker(f"{join(self.uri, '_markers', name)}: unreadable commit marker "
                                f"({str(exc).splitlines()[0][:120]}); delete it (its shard is then rebuilt) "
                                "or use another --output") from None
        return marker

    def markers(self) -> dict[int, dict]:
        """Every readable commit marker, by shard (all in memory: for tests and small outputs)."""
        return dict(self.iter_markers())

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

    def _top_names(self) -> set[str]:
        """The names of the files at the root (one listing)."""
        return {path.rsplit("/", 1)[1] for path in self._ls(self.root)}

    def _interrupted(self, shard: int, marker: dict, names: set[str]) -> bool:
        """Whether the shard's commit stopped between its marker and the rename of its pair file:
        the pair file is missing and its pending one is there (such a shard is not committed yet).
        ``names``: the root's file names (``_top_names``)."""
        return (self.pair_file(shard, marker) == part_name(shard) and part_name(shard) not in names
                and pending_name(shard) in names)

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

    @staticmethod
    def pair_file(shard: int, marker: dict) -> str:
        """The pair file a marker commits (relative to the root): the name it records, so that an
        output of the older layout (``part-NNNNN.parquet``) is read too."""
        return marker.get("part") or part_name(shard)

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

    def _file_damage(self, rel: str, record: dict) -> str | None:
        """Whether file ``rel`` (relative to the root) is missing or is not the one ``record`` (its
        marker's entry) describes: size, then sha256, read in blocks; None if it matches."""
        digest, size = hashlib.sha256(), 0
        try:
            with self.fs.open(join(self.root, rel), "rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
                    size += len(block)
        except FileNotFoundError:
            return f"{rel}: missing, though its commit marker exists"
        if size != record["bytes"] or digest.hexdigest() != record["sha256"]:
            return f"{rel}: does not match its commit marker ({'size' if size != record['bytes'] else 'sha256'})"
        return None

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
        reject_path = join(self.root, "_rejects", side_name(shard))
        rejects = REJECT_SCHEMA.empty_table()
        if self.fs.exists(reject_path):
            with self.fs.open(reject_path, "rb") as f:
                rejects = pq.read_table(f)
        return pairs, rejects

    def read_committed(self, allow_partial: bool = False, wanted: Callable[[str], bool] | None = None) -> BuildRead:
        """What a reader of this build may read: the pair files of the shards whose commit marker
        exists and whose pair file matches it (size and sha256), in shard order, and an account of
        what it left out (BuildRead). ``wanted`` (a path of ``self.fs`` -> bool) narrows the read to
        the files a reader named (a glob, one file). A pair file with no marker (a killed run's
        leftover) and a temp file are never returned.

        Raises IncompleteBuild without ``_SUCCESS``, or when a committed shard's pair file no longer
        matches its marker (changed after the build), unless ``allow_partial``: then the committed
        shards that match are returned, and the caller says how many it read (partial_read_line).
        CorruptMarker names a marker this project did not write. This is the one way a job reads a
        build's pairs; committed_parts is its short form."""
        wanted = wanted or (lambda path: True)
        finished = self.succeeded()
        if not finished and not allow_partial:
            raise IncompleteBuild(f"{self.uri}: not a finished build (no _SUCCESS); wait for it to finish, "
                                  "or pass --allow-partial to read its committed shards only")
        committed = {}  # pair file path -> (shard, marker)
        interrupted = []
        names = self._top_names()
        for shard, marker in self.iter_markers():
            path = join(self.root, self.pair_file(shard, marker))
            if not wanted(path):
                continue
            if self._interrupted(shard, marker, names):  # killed between its marker and its rename
                interrupted.append(pending_name(shard))
            else:
                committed[path] = (shard, marker)
        damaged = {path for path, (shard, marker) in committed.items()
                   if self._file_damage(self.pair_file(shard, marker), marker) is not None}
        parts = [path for path in committed if path not in damaged]
        skipped = sorted(committed[path][0] for path in damaged)
        if skipped and not allow_partial:
            raise IncompleteBuild(f"{self.uri}: shard(s) {', '.join(map(str, skipped))} no longer match their commit "
                                  "markers (changed after the build); rerun the build to redo them, or pass "
                                  "--allow-partial to read the other shards")
        # Pair files no marker commits: a killed build's (under their pending name, or an older
        # version's under their own), or strays; never read, but counted.
        leftovers = sorted({path.rsplit("/", 1)[1] for path in self._ls(self.root)
                            if is_pair_file(path.rsplit("/", 1)[1].removeprefix(PENDING_PREFIX))
                            and path not in committed and wanted(path.replace(PENDING_PREFIX, ""))} | set(interrupted))
        return BuildRead(self.uri, parts, finished, len(committed),
                         sum(int(marker.get("rows", 0)) for _, marker in committed.values()), skipped, leftovers)

    def committed_parts(self, allow_partial: bool = False) -> list[str]:
        """The pair files a reader of this build may read (read_committed's parts, same refusals),
        for a caller that needs no account of what was left out."""
        return self.read_committed(allow_partial).parts

    def succeeded(self) -> bool:
        self._refresh()
        return self.fs.exists(join(self.root, "_SUCCESS"))

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
