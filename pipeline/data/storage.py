"""One place that turns a URI (local path or s3://) into an fsspec filesystem and a path.

s3:// credentials and endpoint come from the standard AWS_* environment variables, or from the
``storage_options`` config mapping (passed straight to s3fs).
"""

from __future__ import annotations

import fsspec


def filesystem(uri: str, storage_options: dict | None = None):
    """(filesystem, path) for a URI; s3fs caches are cleared so listings are fresh."""
    fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    if hasattr(fs, "invalidate_cache"):
        fs.invalidate_cache()
    return fs, path


def list_files(uri: str, storage_options: dict | None, in_directory) -> tuple[object, str, list[str]]:
    """(filesystem, path, files) for a glob, a single file, or a directory whose files (paths
    relative to it) pass ``in_directory``. Raises FileNotFoundError when nothing is there."""
    fs, path = filesystem(uri, storage_options)
    if any(ch in path for ch in "*?["):
        files = sorted(fs.glob(path))
    elif fs.isdir(path):
        root = path.rstrip("/") + "/"
        files = sorted(f for f in fs.find(path) if in_directory(f[len(root):]))
    elif fs.exists(path):
        files = [path]
    else:
        raise FileNotFoundError(uri)
    return fs, path, files


def join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")
