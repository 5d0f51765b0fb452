"""Reading committed output: what a reader of a build may read, and only that.

Every reader of a build (DPO training, expert iteration, evaluation, benchmarks) reads it through
``OutputReader.read_committed`` / ``committed_parts``: the pair files of the shards whose commit
marker exists and matches them, never by listing the output; ``BuildRead`` accounts for what a
read left out (``partial_read_line``). The layout and the commit protocol that makes a marker mean
"committed" are pipeline.data.store's, whose ``OutputStore`` (the one writer) is an OutputReader
too: a resume reads the markers the same way.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.layout import PENDING_PREFIX, TMP_PREFIX, marker_name, part_name, pending_name, side_name
from pipeline.data.lease import LEASE_NAME
from pipeline.data.schema import REJECT_SCHEMA
from pipeline.data.storage import filesystem, is_remote, join
from pipeline.errors import CorruptMarker, IncompleteBuild, OutputConflict

MARKER_KEYS = ("shard", "config_hash", "input_fingerprint", "rows", "sha256", "bytes", "rejects", "quarantine")
"""What every commit marker this project writes holds (pipeline.data.store.OutputStore.commit_shard)."""


PAIR_FILE_PREFIXES = ("train-", "part-")
"""Top-level Parquet files named so hold pairs: a build's (``train-NNNNN``, part_name; ``part-NNNNN``
in builds of the older layout), and by the same convention a user's own pairs directory."""


def read_parquet(fs, path: str) -> pa.Table:
    """One Parquet file of ``fs``, read with no Python object in Arrow's hands.

    Given a Python file, Arrow reads it on its own IO threads (the footer, and read_table's
    pre-buffering), which may still hold buffers of that file after the read returns; the last one
    freed while the interpreter exits (a job that ends right after the read, a user error found
    there) calls into Python from that thread and aborts the process ("terminate called without an
    active exception", exit 134). So the bytes are read here and copied into memory Arrow owns."""
    native = pa.BufferOutputStream()
    with fs.open(path, "rb") as f:
        native.write(f.read())
    return pq.read_table(pa.BufferReader(native.getvalue()))


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


@dataclass
class BuildRead:
    """What one reader of a build gets from its reader (OutputReader.read_committed): the pair files
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


class OutputReader:
    """The committed state of an output, read: its markers, the pair files they commit, its
    manifest. Creates nothing and changes nothing."""

    def __init__(self, uri: str, storage_options: dict | None = None):
        self.uri = uri.rstrip("/")
        self.storage_options = storage_options or {}
        self.fs, self.root = filesystem(self.uri, self.storage_options)
        self.remote = is_remote(uri)
        if self.fs.isfile(self.root):
            raise OutputConflict(f"{self.uri}: is a file; the output must be a directory or an s3:// prefix")

    @staticmethod
    def open_build(uri: str, storage_options: dict | None = None) -> "OutputReader | None":
        """The reader of the build at ``uri``; None where ``uri`` is no build (is_build: nothing
        there, a file, or a user's own pairs directory). Creates nothing."""
        fs, path = filesystem(uri, storage_options)
        if not fs.isdir(path) or not is_build(fs, path):
            return None
        return OutputReader(uri, storage_options)

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

    def _top_names(self) -> set[str]:
        """The names of the files at the root (one listing)."""
        return {path.rsplit("/", 1)[1] for path in self._ls(self.root)}

    def _interrupted(self, shard: int, marker: dict, names: set[str]) -> bool:
        """Whether the shard's commit stopped between its marker and the rename of its pair file:
        the pair file is missing and its pending one is there (such a shard is not committed yet).
        ``names``: the root's file names (``_top_names``)."""
        return (self.pair_file(shard, marker) == part_name(shard) and part_name(shard) not in names
                and pending_name(shard) in names)

    @staticmethod
    def pair_file(shard: int, marker: dict) -> str:
        """The pair file a marker commits (relative to the root): the name it records, so that an
        output of the older layout (``part-NNNNN.parquet``) is read too."""
        return marker.get("part") or part_name(shard)

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
        pairs = read_parquet(self.fs, join(self.root, part_name(shard)))
        reject_path = join(self.root, "_rejects", side_name(shard))
        rejects = REJECT_SCHEMA.empty_table()
        if self.fs.exists(reject_path):
            rejects = read_parquet(self.fs, reject_path)
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
