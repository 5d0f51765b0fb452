"""Every exception class of the project, in one leaf module (it imports nothing of ours), so any
layer raises and catches the same classes: the pure decoding layer the same ConfigError the config
layer does, the jobs the failures the coordinator and the actors raise.

User errors (one line naming the file, row or key; the jobs exit with code 2): ConfigError,
StorageAccessError, InputError, FetchError; an output that cannot take a build or a reader's
request: OutputConflict, OutputLocked, CorruptMarker, IncompleteBuild. Worker faults: WorkerFailure (an actor died or hung;
recoverable), BatchFailed (a batch out of attempts), ShardFailed (a build's shard lost to it),
WorkersShutDown (a call after the workers were shut down; not retried)."""

from __future__ import annotations

from typing import Callable


class ConfigError(ValueError):
    """A user error in the config: the message names the key. The jobs print it as one line and
    exit with code 2."""


class StorageAccessError(ConfigError):
    """An s3:// URI that cannot be reached with the credentials and endpoint given: a user error
    (one line naming the URI, exit code 2), not the tens of lines of botocore traceback it would be."""


class InputError(Exception):
    """Unreadable or missing input: a user error with a one-line message."""


class FetchError(Exception):
    """A user-facing failure: one line, exit code 2."""


class WorkerFailure(Exception):
    """An actor behind a handle died or hung. ``recover()`` replaces it (idempotent per failure)."""

    def __init__(self, message: str, recover: Callable[[], None] = lambda: None):
        super().__init__(message)
        self.recover = recover


class BatchFailed(Exception):
    """A batch failed ``attempts`` times (or is about to be retried, when passed to on_retry)."""

    def __init__(self, prompt_ids: list[str], attempts: int, cause: BaseException):
        super().__init__(f"batch of {len(prompt_ids)} prompts failed after {attempts} attempts: {cause}")
        self.prompt_ids = prompt_ids
        self.attempts = attempts
        self.cause = cause


class ShardFailed(RuntimeError):
    """A shard's batch ran out of attempts (actors kept dying or hanging)."""


class WorkersShutDown(RuntimeError):
    """A call on a retired proxy: the workers were shut down. Not a WorkerFailure, so the
    coordinator does not retry the batch."""


class OutputConflict(Exception):
    """The output cannot take this build (another build's shards, a file, the input itself, a
    damaged marker): a user error, one line."""


class OutputLocked(OutputConflict):
    """Another live build holds the output's lease, or this build lost it: one line, exit 2."""


class CorruptMarker(OutputConflict):
    """A commit marker that is not one this project wrote (unparseable or missing fields)."""


class IncompleteBuild(Exception):
    """A reader asked for a build that has no ``_SUCCESS`` (still running, killed or failed): a user
    error, one line; ``allow_partial`` reads its committed shards instead."""


class KVBudgetError(RuntimeError):
    """The KV cache's budget (runtime.kv_cache_memory) cannot hold a session's rows, or cannot be
    allocated: one line; the engine stays usable."""


class SessionClosed(RuntimeError):
    """An engine session was closed (HFEngine.close, from another thread: a caller that gave up on
    it, a timeout) before its extend was done: that extend's own error, naming the session; the
    sessions stepping beside it go on."""


class UncheckedKernel(RuntimeError):
    """A KV pool's compiled attention was asked to compile anew outside its check (a guard failed):
    the call refuses to run code no check has seen, and the step gathers
    (pipeline.engines.attention_kernel)."""
