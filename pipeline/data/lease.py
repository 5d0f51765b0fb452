"""The output's write lease, ``_lease.json``: one writer per output (see Lease).

A build holds it from planning to its end. It is created atomically (a hard link locally, a
conditional PUT on S3), refreshed by a heartbeat thread, and taken over only once it is stale (or
its process is gone, on the same host). Everything else in the output is read or changed only while
the lease is held, so a build never sees another live build's temp files."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from typing import Protocol

from pipeline.data.storage import join
from pipeline.errors import OutputConflict, OutputLocked

log = logging.getLogger(__name__)

LEASE_NAME = "_lease.json"
LEASE_TMP_PREFIX = ".lease-tmp-"
"""The local lease's own temp and claim files: a build that holds the lease removes ``.tmp-*``
files (a dead build's), so another build's lease attempt must not use that prefix; one of these
left by a killed process is removed once older than the lease timeout."""


class Lease:
    """The output's write lease, ``_lease.json``: owner id, host, pid, start and heartbeat times and
    the config hash of the build that holds it.

    Acquired once, atomically (``_LeaseFile.create``). A daemon thread rewrites it every
    ``heartbeat_s`` with a compare-and-swap on the version this holder last wrote, so a holder that
    was taken over finds out at its next beat; from then on ``check`` (called before every write
    of the output) raises OutputLocked. A lease whose heartbeat is older than ``timeout_s``, or
    whose process is gone on this same host, belongs to a dead build and is taken over with a
    compare-and-swap on the version read, and one line on stderr says whose it was. The thread
    holds the lease weakly: a plan that is dropped without running stops beating, and its lease
    goes stale instead of blocking the output for the life of the process."""

    def __init__(self, file: "_LeaseFile", uri: str, config_hash: str, timeout_s: float, heartbeat_s: float):
        self.file, self.uri, self.config_hash = file, uri, config_hash
        self.timeout_s, self.heartbeat_s = timeout_s, heartbeat_s
        self.owner = uuid.uuid4().hex
        self.host, self.pid, self.pid_namespace = socket.gethostname(), os.getpid(), _pid_namespace()
        self.started = time.time()
        self.lost: str | None = None
        """Why the lease is no longer this build's (then every write of the output is refused)."""
        self._tag = None  # the version this holder last wrote (its bytes locally, its ETag on S3)
        self._last_beat = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def _payload(self) -> bytes:
        return json.dumps({"owner": self.owner, "host": self.host, "pid": self.pid, "started": self.started,
                           "heartbeat": time.time(), "heartbeat_s": self.heartbeat_s,
                           "pid_namespace": self.pid_namespace,
                           "config_hash": self.config_hash}, sort_keys=True).encode()

    def acquire(self) -> None:
        """Take the lease, or raise OutputLocked naming the live build that holds it. A holder that
        has missed three heartbeats is presumed dead (a killed driver on another host, a retried
        RayJob): instead of refusing, wait until its lease is stale, say so, and take it over."""
        waited = False
        for _ in range(8):  # each retry means another build changed the lease between two of our steps
            tag = self.file.create(self._payload())
            if tag is None:
                found = self.file.read()
                if found is None:  # released in between: try to create it again
                    continue
                content, current = found
                holder = _parse_lease(content)
                if holder is None:
                    raise OutputLocked(f"{self.file.uri}: unreadable lease file; if no build is writing "
                                       f"{self.uri}, delete it and rerun")
                age = time.time() - holder["heartbeat"]
                # Its pid means something here only on this host, in this pid namespace (containers
                # that share a hostname each have their own).
                dead = ((holder["host"], holder.get("pid_namespace")) == (self.host, self.pid_namespace)
                        and not _process_alive(holder["pid"]))
                beats = holder.get("heartbeat_s")
                silent = age > 3 * (beats if isinstance(beats, (int, float)) else self.heartbeat_s)
                if age <= self.timeout_s and not dead and silent and not waited:
                    log.warning(f"{self.uri}: the build holding its lease (host {holder['host']}, pid "
                                f"{holder['pid']}) has written no heartbeat for {age:.0f}s; waiting "
                                f"{self.timeout_s - age:.0f}s for it to go stale")
                    time.sleep(self.timeout_s - age + 0.01)
                    waited = True
                    continue
                if age <= self.timeout_s and not dead:
                    raise OutputLocked(f"{self.uri}: another build is writing to it (host {holder['host']}, "
                                       f"pid {holder['pid']}, heartbeat {age:.0f}s ago); wait for it to finish "
                                       f"or use another --output (a lease is taken over after {self.timeout_s:.0f}s "
                                       "without a heartbeat)")
                tag = self.file.replace(self._payload(), current)
                if tag is None:
                    continue
                why = "its process is gone" if dead else f"older than the {self.timeout_s:.0f}s timeout"
                log.warning(f"{self.uri}: took over the lease of a stopped build (host {holder['host']}, "
                            f"pid {holder['pid']}, last heartbeat {age:.0f}s ago: {why})")
            self._tag, self._last_beat = tag, time.time()
            self._start_heartbeat()
            return
        raise OutputLocked(f"{self.uri}: could not take the output's lease (other builds keep changing it)")

    def _start_heartbeat(self) -> None:
        ref, stop, interval = weakref.ref(self), self._stop, self.heartbeat_s

        def beat() -> None:
            while not stop.wait(interval):
                lease = ref()
                if lease is None:
                    return
                lease.beat()
                del lease

        threading.Thread(target=beat, name=f"lease {self.uri}", daemon=True).start()

    def beat(self) -> None:
        """Refresh the heartbeat if the lease is still this build's; otherwise record it as lost."""
        with self._lock:
            if self._tag is None or self.lost:
                return
            try:
                tag = self.file.refresh(self._payload(), self._tag)
            except OSError as exc:  # storage hiccup: the next beat retries, unless others may take it by now
                if time.time() - self._last_beat > self.timeout_s:
                    self.lost = f"no heartbeat written for {self.timeout_s:.0f}s ({exc})"
                return
            if tag is None:
                found = self.file.read()
                holder = _parse_lease(found[0]) if found else None
                self.lost = (f"taken over by host {holder['host']}, pid {holder['pid']}" if holder
                             else "its lease file was removed")
                return
            self._tag, self._last_beat = tag, time.time()

    def check(self) -> None:
        if self.lost:
            raise OutputLocked(f"{self.uri}: this build lost its lease ({self.lost}); another build may be "
                               "writing to it: nothing more is written")
        if self._tag is None:
            raise OutputLocked(f"{self.uri}: this build does not hold the output's lease")

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still this build's (idempotent)."""
        self._stop.set()
        with self._lock:
            if self._tag is None:
                return
            tag, self._tag = self._tag, None
            if self.lost:
                return
            try:
                self.file.delete(tag)
            except OSError as exc:  # it goes stale and is taken over after the timeout
                log.warning(f"{self.file.uri}: could not release the lease ({exc})")


def _parse_lease(content: bytes) -> dict | None:
    try:
        holder = json.loads(content)
        if isinstance(holder, dict) and isinstance(holder["heartbeat"], (int, float)):
            return {**holder, "host": holder.get("host"), "pid": holder.get("pid")}
    except (ValueError, KeyError, TypeError):
        pass
    return None


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _process_alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return True  # unknown: only the heartbeat's age can tell
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class _LeaseFile(Protocol):
    """Compare-and-swap on one small file. ``tag`` is the version a caller read or wrote; every
    method that takes one acts only if the file is still at that version, and returns None (or
    False) when it is not. ``create`` returns None when the file exists."""

    uri: str

    def read(self) -> tuple[bytes, object] | None: ...
    def create(self, payload: bytes) -> object | None: ...
    def replace(self, payload: bytes, tag) -> object | None: ...
    def refresh(self, payload: bytes, tag) -> object | None: ...
    def delete(self, tag) -> bool: ...


class _LocalLeaseFile:
    """On a local (or NFS) directory; the tag is the file's bytes (each write has a new heartbeat
    time and an owner id, so no two versions are equal)."""

    def __init__(self, path: str, uri: str):
        self.path, self.uri = path, uri
        self.directory = os.path.dirname(path)

    def read(self):
        try:
            with open(self.path, "rb") as f:
                content = f.read()
        except FileNotFoundError:
            return None
        return content, content

    def _temp(self, payload: bytes) -> str:
        tmp = os.path.join(self.directory, f"{LEASE_TMP_PREFIX}{uuid.uuid4().hex}")
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def create(self, payload):
        # Written whole to a temp file, then hard-linked to the lease name: link fails if the name
        # exists (atomic like O_CREAT|O_EXCL), and a reader never sees a half-written lease.
        tmp = self._temp(payload)
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            return None
        finally:
            os.unlink(tmp)
        return payload

    def replace(self, payload, tag):
        # Claim the file by renaming it away (only one rename of a name succeeds), check that the
        # claimed file is the version read, then create ours; a claimed newer version is put back.
        claim = os.path.join(self.directory, f"{LEASE_TMP_PREFIX}claim-{uuid.uuid4().hex}")
        try:
            os.rename(self.path, claim)
        except FileNotFoundError:
            return None
        try:
            with open(claim, "rb") as f:
                if f.read() != tag:
                    try:
                        os.link(claim, self.path)
                    except FileExistsError:
                        pass
                    return None
        finally:
            os.unlink(claim)
        return self.create(payload)

    def refresh(self, payload, tag):
        # The holder's own rewrite: the file is renamed over in one step, never absent (a starting
        # build must never find the name free while its holder is alive).
        found = self.read()
        if found is None or found[1] != tag:
            return None
        os.replace(self._temp(payload), self.path)
        return payload

    def delete(self, tag):
        found = self.read()
        if found is None or found[1] != tag:
            return False
        os.unlink(self.path)
        return True


class _S3LeaseFile:
    """On S3, through S3's conditional writes: create is PUT If-None-Match "*", replace and refresh
    PUT If-Match the ETag read or written, release DELETE If-Match. The tag is the ETag."""

    def __init__(self, fs, path: str, uri: str):
        self.fs, self.uri = fs, uri
        self.bucket, self.key, _ = fs.split_path(path)

    def read(self):
        from fsspec.asyn import sync

        async def get():
            try:
                response = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self.key)
            except FileNotFoundError:
                return None
            try:  # body and ETag of one GET: the content is the version the tag names
                return await response["Body"].read(), response["ETag"]
            finally:
                response["Body"].close()

        return sync(self.fs.loop, get)

    def _put(self, payload: bytes, **condition):
        try:
            return self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=payload, **condition)["ETag"]
        except OSError as exc:
            if _precondition_failed(exc):
                return None
            raise

    def create(self, payload):
        return self._put(payload, IfNoneMatch="*")

    def replace(self, payload, tag):
        return self._put(payload, IfMatch=tag)

    refresh = replace

    def delete(self, tag):
        try:
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self.key, IfMatch=tag)
        except OSError as exc:
            if _precondition_failed(exc) or isinstance(exc, FileNotFoundError):
                return False
            raise
        return True


def _precondition_failed(exc: OSError) -> bool:
    """s3fs turns 412 into FileExistsError (If-None-Match) or OSError(EINVAL) (If-Match); S3 answers
    a conditional write racing another with 409 ConditionalRequestConflict."""
    if isinstance(exc, FileExistsError):
        return True
    code = getattr(exc.__cause__, "response", {}).get("Error", {}).get("Code")
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or (code is None and exc.errno == errno.EINVAL)



def lease_file(fs, root: str, uri: str, remote: bool) -> _LeaseFile:
    """The lease file of the output at ``root`` of ``fs`` (``uri`` for messages): local, or S3's."""
    path = join(root, LEASE_NAME)
    if not remote:
        return _LocalLeaseFile(path, join(uri, LEASE_NAME))
    if "s3" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return _S3LeaseFile(fs, path, join(uri, LEASE_NAME))
    raise OutputConflict(f"{uri}: outputs are local paths or s3:// prefixes (the write lease needs an atomic create)")
