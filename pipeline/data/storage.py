"""One place that turns a URI (local path or s3://) into an fsspec filesystem and a path.

s3:// credentials and endpoint come from the standard AWS_* environment variables, or from the
``storage_options`` config mapping (passed straight to s3fs). Only the driver opens storage (it reads
the prompts and commits the output), so credentials are resolved there and never sent to a Ray
worker (actors.factory.ray_runtime_env); what a build writes shows them redacted
(pipeline.provenance.redacted_config).
"""

from __future__ import annotations

from contextlib import contextmanager

import fsspec

from pipeline.errors import ConfigError, StorageAccessError


CREDENTIALS_HINT = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for a non-AWS "
                    "endpoint), or key, secret and endpoint_url in data.storage_options")


def access_error(uri: str, exc: BaseException) -> StorageAccessError | None:
    """The one-line user error for ``exc``, raised while reaching ``uri``, when it is about access
    (no or partial credentials, access denied, an endpoint that does not answer); None otherwise (a
    missing file, a bug), so that the caller re-raises it."""
    try:
        from botocore.exceptions import BotoCoreError, NoCredentialsError, PartialCredentialsError
    except ImportError:  # no s3fs installed: nothing of botocore's can be raised
        return None
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return StorageAccessError(f"{uri}: no S3 credentials ({first_line}); {CREDENTIALS_HINT}")
    if isinstance(exc, PermissionError):  # s3fs's translation of AccessDenied, InvalidAccessKeyId, ...
        return StorageAccessError(f"{uri}: access denied ({first_line}); check the credentials: {CREDENTIALS_HINT}")
    if isinstance(exc, BotoCoreError):  # EndpointConnectionError, a bad region, ...
        return StorageAccessError(f"{uri}: cannot reach the storage ({first_line})")
    return None


@contextmanager
def access_errors(uri: str):
    """Turn an access failure inside the block into StorageAccessError naming ``uri``."""
    try:
        yield
    except Exception as exc:
        error = access_error(uri, exc)
        if error is None:
            raise
        raise error from None


def check_access(uri: str, storage_options: dict | None) -> None:
    """Plan time, before any input row is read or a worker starts: one request that needs the
    credentials (the URI's metadata) to a remote URI; StorageAccessError when it is refused. A URI
    with nothing there yet (an output to create) passes: the request itself was allowed."""
    if not is_remote(uri):
        return
    with access_errors(uri):
        fs, path = filesystem(uri, storage_options)
        try:
            fs.info(path)
        except FileNotFoundError:
            pass


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
