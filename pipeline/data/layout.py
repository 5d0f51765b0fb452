"""The names of a shard's files in an output (the layout is pipeline.data.store's docstring): one
place, which the store's commit protocol and the dataset card (pipeline.data.card) both read."""

from __future__ import annotations

TMP_PREFIX = ".tmp-"
"""A file being written locally waits under ``.tmp-<uuid>-<its name>`` until it is renamed whole;
one left by a killed run is ignored by readers and removed by the next build."""

PENDING_PREFIX = ".pending-"
"""A pair file waits under ``.pending-<its name>`` until its marker is written, then is renamed to
its name (the commit point). Hidden names are read by neither ``load_dataset`` form."""


def part_name(shard: int) -> str:
    """The pair file of ``shard``: its name holds the split (see pipeline.data.store's docstring)."""
    return f"train-{shard:05d}.parquet"


def side_name(shard: int) -> str:
    """The shard's file under ``_rejects/`` and ``_quarantine/``: no split keyword in its name."""
    return f"part-{shard:05d}.parquet"


def marker_name(shard: int) -> str:
    return f"part-{shard:05d}.json"


def pending_name(shard: int) -> str:
    """Where shard ``shard``'s pair file waits for its marker (PENDING_PREFIX)."""
    return PENDING_PREFIX + part_name(shard)
