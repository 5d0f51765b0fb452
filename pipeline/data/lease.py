"""The output's write lease, ``_lease.json``: one writer per output (see Lease).

A build holds it from planning to its end. It is created atomically (a hard link locally, a
conditional PUT on S3), refreshed by a heartbeat thread with a compare-and-swap, and taken over only
once it is stale (or its process is gone, on the same host). Stale means unchanged for the larger of
the two builds' timeouts, as the taker sees it on its own monotonic clock (or as S3's own clock dates
the version): the heartbeat times written in the lease come from the holder's clock and are never
compared with the taker's to decide a takeover, only to refuse at once a lease that looks live. The
holder writes nothing once its own last heartbeat is older than half its timeout and cannot be
renewed. Everything else in the output is read or changed only while the lease is held, so a build
never sees another live build's temp files."""

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

SAFE_FRACTION = 0.5
"""The holder writes only while its own last successful heartbeat is younger than this fraction of
its timeout (by its monotonic clock): a taker needs the lease unchanged for the whole timeout, so the
rest is the margin for a write under way when the holder stalls."""

LIVE_BEATS = 3
"""A lease whose recorded heartbeat is within this many of its heartbeat intervals of our clock
(either side) looks live and is refused at once; any other is watched (Lease.acquire)."""


class Lease:
    """The output's write lease, ``_lease.json``: owner id, host, pid, start and heartbeat times,
    timeout and heartbeat interval, and the config hash of the build that holds it.

    Acquired once, atomically (``_LeaseFile.create``). A daemon thread rewrites it every
    ``heartbeat_s`` with a compare-and-swap on the version this holder last wrote, so a holder that
    was taken over finds out at its next beat. ``check`` (called before every write of the output)
    raises OutputLocked once the lease is lost, and also once this holder's own last successful
    heartbeat is older than half its timeout by its monotonic clock and a heartbeat written then
    and there fails: a holder stalled past the timeout (SIGSTOP, a GC pause, a suspended VM) finds
    out before its next write, whether or not its heartbeat thread has run since.

    Taking over, ``acquire`` judges with the larger of the two timeouts (its own and the one the
    holder recorded) and never by comparing the holder's heartbeat time with its own clock:
    - a holder provably dead (same host and pid namespace, pid gone) is taken over at once;
    - a lease whose heartbeat looks recent by our clock (within three of its heartbeat intervals)
      is refused at once, which is the safe direction under skew;
    - any other lease is watched, with a line saying so, for the timeout on this host's monotonic
      clock (less what S3's own clock says it has already been unchanged): a change means its
      holder is alive and the output is refused; none means it is stale, and it is taken over with
      a compare-and-swap on the version watched, and one line on stderr says whose it was.
    The thread holds the lease weakly: a plan that is dropped without running stops beating, and
    its lease goes stale instead of blocking the output for the life of the process.

    Not covered: a write already past ``check`` when its process stalls for more than half the
    timeout still lands (the output's files carry no fencing token)."""

    def __init__(self, file: "_LeaseFile", uri: str, config_hash: str, timeout_s: float, heartbeat_s: float):
        self.file, self.uri, self.config_hash = file, uri, config_hash
        self.timeout_s, self.heartbeat_s = timeout_s, heartbeat_s
        self.owner = uuid.uuid4().hex
        self.host, self.pid, self.pid_namespace = socket.gethostname(), os.getpid(), _pid_namespace()
        self.started = time.time()
        self.lost: str | None = None
        """Why the lease is no longer this build's (then every write of the output is refused)."""
        self._tag = None  # the version this holder last wrote (its bytes locally, its ETag on S3)
        self._last_beat = 0.0  # time.monotonic() when the last successful write of it began
        self._seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def _payload(self) -> bytes:
        self._seq += 1  # every version differs, whatever the clock says
        return json.dumps({"owner": self.owner, "host": self.host, "pid": self.pid, "started": self.started,
                           "heartbeat": time.time(), "seq": self._seq, "heartbeat_s": self.heartbeat_s,
                           "timeout_s": self.timeout_s, "pid_namespace": self.pid_namespace,
                           "config_hash": self.config_hash}, sort_keys=True).encode()

    def acquire(self) -> None:
        """Take the lease, or raise OutputLocked naming the live build that holds it (see Lease)."""
        for _ in range(8):  # each retry means another build changed the lease between two of our steps
            began = time.monotonic()
            tag = self.file.create(self._payload())
            if tag is not None:
                self._hold(tag, began)
                return
            found = self.file.read()
            if found is None:  # released in between: try to create it again
                continue
            content, current, unchanged = found
            holder = _parse_lease(content)
            if holder is None:
                raise OutputLocked(f"{self.file.uri}: unreadable lease file; if no build is writing "
                                   f"{self.uri}, delete it and rerun")
            who = f"host {holder['host']}, pid {holder['pid']}"
            timeout = max(self.timeout_s, holder["timeout_s"] or 0.0)
            age = time.time() - holder["heartbeat"]  # by two clocks: only ever a reason to refuse
            # Its pid means something here only on this host, in this pid namespace (containers
            # that share a hostname each have their own).
            dead = ((holder["host"], holder.get("pid_namespace")) == (self.host, self.pid_namespace)
                    and not _process_alive(holder["pid"]))
            if dead:
                why = "its process is gone"
            else:
                beats = holder["heartbeat_s"] or timeout / 12
                if abs(age) <= min(LIVE_BEATS * beats, timeout):
                    raise OutputLocked(f"{self.uri}: another build is writing to it ({who}, heartbeat "
                                       f"{_ago(age)}); wait for it to finish or use another --output (a lease "
                                       f"is taken over once it stays unchanged for {_s(timeout)})")
                wait = timeout - unchanged
                if wait > 0:
                    said = (f"has written no heartbeat for {age:.0f}s" if age >= 0
                            else f"has a heartbeat {-age:.0f}s ahead of this host's clock")
                    log.warning(f"{self.uri}: the build holding its lease ({who}) {said}; waiting {_s(wait)} "
                                f"for it to go stale (taken over if its lease stays unchanged that long)")
                    seen = self._watch(current, wait)
                    if seen is not _UNCHANGED:
                        if seen is None:  # released while we watched
                            continue
                        now = _parse_lease(seen[0]) or holder
                        raise OutputLocked(f"{self.uri}: another build is writing to it (host {now['host']}, "
                                           f"pid {now['pid']}: its lease changed while this build watched it); "
                                           "wait for it to finish or use another --output")
                why = f"unchanged for the {_s(timeout)} timeout"
            began = time.monotonic()
            tag = self.file.replace(self._payload(), current)
            if tag is None:
                continue
            log.warning(f"{self.uri}: took over the lease of a stopped build ({who}, last heartbeat "
                        f"{_ago(age)}: {why})")
            self._hold(tag, began)
            return
        raise OutputLocked(f"{self.uri}: could not take the output's lease (other builds keep changing it)")

    def _watch(self, tag, seconds: float):
        """Read the lease until ``seconds`` have passed on this host's monotonic clock: _UNCHANGED if
        it stayed at version ``tag``, else what was found (None: it is gone)."""
        deadline = time.monotonic() + seconds
        poll = min(max(seconds / 20, 0.02), 2.0)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return _UNCHANGED
            time.sleep(min(poll, left))
            found = self.file.read()
            if found is None:  # perhaps a holder's refresh in flight (a local one renames it away)
                time.sleep(0.05)
                found = self.file.read()
            if found is None or found[1] != tag:
                return found

    def _hold(self, tag, began: float) -> None:
        self._tag, self._last_beat = tag, began
        self._start_heartbeat()

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
            began = time.monotonic()
            try:
                tag = self.file.refresh(self._payload(), self._tag)
            except OSError as exc:  # storage hiccup: the next beat retries, unless others may take it by now
                if time.monotonic() - self._last_beat > self.timeout_s:
                    self.lost = f"no heartbeat written for {self.timeout_s:.0f}s ({exc})"
                return
            if tag is None:
                found = self.file.read()
                holder = _parse_lease(found[0]) if found else None
                self.lost = (f"taken over by host {holder['host']}, pid {holder['pid']}" if holder
                             else "its lease file was removed")
                return
            self._tag, self._last_beat = tag, began

    def check(self) -> None:
        """Raise OutputLocked unless this build may write the output now: it holds the lease, and its
        last successful heartbeat is younger than half its timeout (an older one is renewed here
        first, with the same compare-and-swap as the thread's, so a holder that stalled while no
        build took over goes on)."""
        if not self.lost and self._tag is not None and self._silent() > SAFE_FRACTION * self.timeout_s:
            self.beat()
        if self.lost:
            raise OutputLocked(f"{self.uri}: this build lost its lease ({self.lost}); another build may be "
                               "writing to it: nothing more is written")
        if self._tag is None:
            raise OutputLocked(f"{self.uri}: this build does not hold the output's lease")
        silent = self._silent()
        if silent > SAFE_FRACTION * self.timeout_s:
            raise OutputLocked(f"{self.uri}: this build's lease was last refreshed {_s(silent)} ago (over half "
                               f"its {_s(self.timeout_s)} timeout), so another build may take it over: nothing "
                               "more is written")

    def _silent(self) -> float:
        return time.monotonic() - self._last_beat

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


_UNCHANGED = object()


def _ago(age: float) -> str:
    """A heartbeat's age by our clock, as a message says it (a holder's clock may be ahead)."""
    return f"{max(age, 0.0):.0f}s ago" if age > -0.5 else f"{-age:.0f}s ahead of this host's clock"


def _s(seconds: float) -> str:
    """A timeout or a wait as a message says it: whole seconds, or tenths under 10 s (tests' timeouts)."""
    return f"{seconds:.0f}s" if seconds >= 10 or float(seconds).is_integer() else f"{seconds:.1f}s"


def _seconds(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def _parse_lease(content: bytes) -> dict | None:
    try:
        holder = json.loads(content)
        if isinstance(holder, dict) and isinstance(holder["heartbeat"], (int, float)):
            return {**holder, "host": holder.get("host"), "pid": holder.get("pid"),
                    "timeout_s": _seconds(holder.get("timeout_s")), "heartbeat_s": _seconds(holder.get("heartbeat_s"))}
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
        return True  # unknown: only watching its lease can tell
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
    False) when it is not. ``create`` returns None when the file exists. ``read`` gives the content,
    its tag, and how long that version has been there by the storage's own clock, as a lower bound
    (0 where the storage cannot say)."""

    uri: str

    def read(self) -> tuple[bytes, object, float] | None: ...
    def create(self, payload: bytes) -> object | None: ...
    def replace(self, payload: bytes, tag) -> object | None: ...
    def refresh(self, payload: bytes, tag) -> object | None: ...
    def delete(self, tag) -> bool: ...


class _LocalLeaseFile:
    """On a local (or NFS) directory; the tag is the file's bytes (each write has a new sequence
    number and an owner id, so no two versions are equal). The file's mtime is not used: on NFS it
    is another host's clock."""

    def __init__(self, path: str, uri: str):
        self.path, self.uri = path, uri
        self.directory = os.path.dirname(path)

    def read(self):
        try:
            with open(self.path, "rb") as f:
                content = f.read()
        except FileNotFoundError:
            return None
        return content, content, 0.0

    def _temp(self, payload: bytes, kind: str = "") -> str:
        tmp = os.path.join(self.directory, f"{LEASE_TMP_PREFIX}{kind}{uuid.uuid4().hex}")
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

    def _claim(self, tag) -> str | None:
        """Take the file away from its name if it is at version ``tag`` (only one rename of a name
        succeeds): the claimed file's path, or None (gone, or another version, which is put back)."""
        claim = os.path.join(self.directory, f"{LEASE_TMP_PREFIX}claim-{uuid.uuid4().hex}")
        try:
            os.rename(self.path, claim)
        except FileNotFoundError:
            return None
        with open(claim, "rb") as f:
            if f.read() == tag:
                return claim
        try:
            os.link(claim, self.path)
        except FileExistsError:
            pass
        os.unlink(claim)
        return None

    def replace(self, payload, tag):
        # Claim the version read, then link ours (written beforehand) to the name. Between the two
        # syscalls the name is free: a build starting in that instant gets the lease and this one
        # does not (one holder either way; the holder finds out at its next check).
        tmp = self._temp(payload)
        try:
            claim = self._claim(tag)
            if claim is None:
                return None
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                return None
            finally:
                os.unlink(claim)
            return payload
        finally:
            os.unlink(tmp)

    refresh = replace
    """The holder's own rewrite is the same compare-and-swap: a holder that stalled between reading
    its lease and rewriting it must not overwrite a taker's."""

    def delete(self, tag):
        claim = self._claim(tag)
        if claim is None:
            return False
        os.unlink(claim)
        return True


class _S3LeaseFile:
    """On S3, through S3's conditional writes: create is PUT If-None-Match "*", replace and refresh
    PUT If-Match the ETag read or written, release DELETE If-Match. The tag is the ETag; how long a
    version has been there is the GET's Date less its LastModified, both S3's clock (whole seconds,
    hence one less)."""

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
                return await response["Body"].read(), response["ETag"], _s3_unchanged(response)
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


def _s3_unchanged(response: dict) -> float:
    """Seconds the object has been at this version by S3's clock, at least: the response's Date less
    its LastModified (both whole seconds), less one; 0 where either is missing."""
    from email.utils import parsedate_to_datetime

    try:
        date = parsedate_to_datetime(response["ResponseMetadata"]["HTTPHeaders"]["date"])
        return max(0.0, (date - response["LastModified"]).total_seconds() - 1.0)
    except (KeyError, TypeError, ValueError):
        return 0.0


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
