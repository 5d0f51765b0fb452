"""Prompt validation: which input rows are usable prompts, and why each other row is not.

A row whose prompt is missing, neither a string nor a well-formed conversation (TRL's
conversational format, pipeline.data.chat), blank, or a duplicate of an earlier prompt is never
skipped silently: it becomes a Reject with its reason and its input row number. ``FirstRows``
remembers, on disk, the first row of every prompt id, so that duplicates are found across the
whole input (read by pipeline.data.readers) while the driver holds one shard.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
from typing import Any

from pipeline.data.chat import PromptRow, Reject, conversation_text, prompt_id
from pipeline.data.readers import NOT_AN_OBJECT


ROLES = ("system", "user", "assistant")


def conversation_problem(value: list) -> str | None:
    """Why a list is not a usable conversation (None when it is): each message a mapping with a
    role in ROLES and string content, at least one non-blank, the last one a user turn."""
    if not value:
        return "empty conversation"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"message {i} is not a mapping ({type(message).__name__})"
        if message.get("role") not in ROLES:
            return f"message {i} has role {message.get('role')!r} (expected one of {', '.join(ROLES)})"
        if not isinstance(message.get("content"), str):
            return f"message {i} has no string content"
    if value[-1]["role"] != "user":
        return f"the last message is a {value[-1]['role']} turn, not a user turn"
    if not any(m["content"].strip() for m in value):
        return "every message is blank"
    return None


def _problem(value: Any, column: str) -> str | None:
    """Why a raw value is not a usable prompt (None when it is), duplicates aside."""
    if value is NOT_AN_OBJECT:
        return "row is not a JSON object"
    if value is None:
        return f"missing prompt (no {column!r} value)"
    if isinstance(value, list) and conversation_problem(value):
        return f"malformed conversation ({conversation_problem(value)})"
    if not isinstance(value, (str, list)):
        return f"prompt is not a string or a conversation ({type(value).__name__})"
    if isinstance(value, str) and not value.strip():
        return "blank prompt"
    return None


class _FirstRowsInMemory:
    """FirstRows' contract over a dict: for inputs that fit in memory."""

    def __init__(self):
        self._first: dict[str, int] = {}

    def claim(self, entries: list[tuple[str, int]]) -> list[int]:
        return [self._first.setdefault(pid, row) for pid, row in entries]


class FirstRows:
    """prompt_id -> the first input row holding that prompt, for an input of any size, on disk.

    ``claim`` records each (prompt_id, row) whose id has no earlier row and returns, for every
    entry, the first row of its id: the entry's own row when it is the first, else the row it
    duplicates. Claims must come in input order; claiming a row again (the build reads its input
    twice: to plan, then to run) returns the same answer, since the first row is already there.

    Why SQLite in a temporary directory: duplicates must be found across the whole input, and the
    answer must be exact (a reject names the row it repeats, the same row an in-memory dict would
    name, on a first run and on a resume). A dict of every id grows with the row count (about
    100 bytes a row in CPython); a Bloom filter is bounded but has false positives; an external sort
    costs another pass and loses the input order. An SQLite table keyed by the id (its 16 hex digits
    as a signed 64-bit integer, the table's rowid) is exact, is in the standard library, answers a
    shard's ids in one indexed query, and its page cache is bounded (SQLite's default, about 2 MiB)
    however large the table grows (about 25 bytes a row on disk, in the system's temporary
    directory; removed by ``close``).
    """

    QUERY_IDS = 500
    """Ids per SELECT (SQLite limits the parameters of one statement)."""

    def __init__(self):
        self._dir = tempfile.TemporaryDirectory(prefix="bon-first-rows-")
        # One thread at a time uses it (the driver's main loop), not always the one that made it.
        self._db = sqlite3.connect(os.path.join(self._dir.name, "first_rows.sqlite"), isolation_level=None,
                                   check_same_thread=False)
        # Scratch data, rebuilt by every run: no journal, no fsync.
        self._db.execute("PRAGMA journal_mode=OFF")
        self._db.execute("PRAGMA synchronous=OFF")
        self._db.execute("CREATE TABLE first_row (id INTEGER PRIMARY KEY, row INTEGER NOT NULL)")

    @staticmethod
    def _key(pid: str) -> int:
        return int(pid, 16) - (1 << 63)

    def claim(self, entries: list[tuple[str, int]]) -> list[int]:
        keys = [self._key(pid) for pid, _ in entries]
        self._db.execute("BEGIN")
        self._db.executemany("INSERT OR IGNORE INTO first_row VALUES (?, ?)",
                             zip(keys, (row for _, row in entries)))
        self._db.execute("COMMIT")
        first: dict[int, int] = {}
        for i in range(0, len(keys), self.QUERY_IDS):
            part = keys[i:i + self.QUERY_IDS]
            first.update(self._db.execute(
                f"SELECT id, row FROM first_row WHERE id IN ({','.join('?' * len(part))})", part))
        return [first[k] for k in keys]

    def close(self) -> None:
        self._db.close()
        self._dir.cleanup()


def validate(values: list[Any], column: str, start: int = 0, first_rows: FirstRows | None = None,
             columns: list[dict] | None = None) -> tuple[list[PromptRow], list[Reject]]:
    """Split raw values into usable prompt rows and rejects (missing, neither a string nor a
    conversation, malformed conversation, blank, duplicate). ``values`` are rows ``start``, ``start``
    + 1, ...; ``first_rows`` remembers the prompts of earlier calls (default: these values alone);
    ``columns``: each value's other columns, kept on its PromptRow."""
    rows, rejects, candidates = [], [], []
    for i, value in enumerate(values, start=start):
        problem = _problem(value, column)
        if problem is None:
            candidates.append((i, value, prompt_id(value)))
        elif value is NOT_AN_OBJECT or value is None:
            rejects.append(Reject(i, problem, repr(value)))
        else:
            rejects.append(Reject(i, problem, repr(value)[:1000]))
    first_rows = first_rows or _FirstRowsInMemory()
    for (i, value, pid), first in zip(candidates, first_rows.claim([(pid, i) for i, _, pid in candidates])):
        if first == i:
            rows.append(PromptRow(i, value, columns[i - start] if columns is not None else {}))
        else:
            shown = value if isinstance(value, str) else conversation_text(value)
            rejects.append(Reject(i, f"duplicate prompt (same as row {first})", shown[:1000], pid))
    rejects.sort(key=lambda r: r.source_row)
    return rows, rejects


def read_prompt_file(path: str, column: str = "prompt") -> tuple[list[PromptRow], list[Reject]]:
    """A whole prompt file (``PromptSource``, every other column kept on its rows) validated in one
    piece: its usable rows and its rejects. Raises InputError when it cannot be read."""
    from pipeline.data.readers import PromptSource

    records = list(PromptSource(path, column, extra_columns=None).records())
    return validate([v for v, _ in records], column, columns=[c for _, c in records])
