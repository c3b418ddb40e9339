"""Reported checkpoints uploaded in the background: ``report(metrics, checkpoint=...)`` returns at once on rank 0,
while the other ranks go on to their next collective (a synchronous upload of gigabytes would outlast their
collective timeout and re-form the ring at every report).

:meth:`ReportedUploads.submit` copies the reported directory into a private local snapshot (under
``tempfile.gettempdir()``: ``TMPDIR``), so the caller may delete or reuse its directory as soon as it returns,
then one thread uploads the snapshots, one at a time, with :meth:`ReportedCheckpoints.save`. At most one
snapshot waits behind the upload in flight: a newer report replaces the waiting one (the older is skipped, never
queued: slow storage cannot fill the local disk), as the state's checkpoint writer does; the next event counts
it in ``superseded``. An upload failing with a transient storage error is retried with backoff for
``retry_budget_s`` after its first error (:func:`~state.checkpoint_errors.is_transient`).

Every upload ends in an event passed to the listener of :func:`~state.set_checkpoint_listener` (the worker
forwards it to the driver's ``Result.events``): ``{"kind": "reported_checkpoint_written", "uri" (the files' URL),
"seq", "bytes", "seconds", "attempts", "superseded"}`` or ``{"kind": "checkpoint_failed", "reported": True,
"uri" (the location), "seq": None, "error", "attempts", "transient", "retried_s", "consecutive_failures"}``.
:func:`~state.flush_checkpoints` (which the worker calls when ``fn`` returns, at a stop and at a drain) waits
for them too, writing a transiently failed last upload again until its deadline. After
``max_consecutive_failures`` failed uploads in a row, the next :meth:`submit` raises with the cause.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field

from elastic_ring.core.log import get_logger

from . import checkpoint_writer
from .checkpoint_errors import CheckpointError, is_transient
from .checkpoint_errors import describe as _describe
from .checkpoint_policy import (
    DEFAULT_MAX_CONSECUTIVE_FAILURES, DEFAULT_WRITE_RETRY_S, WRITE_RETRY_FIRST_S, WRITE_RETRY_MAX_S, backoff_delay,
    check_retry_budget,
)
from .reported_checkpoints import ReportedCheckpoints, _local_files

_log = get_logger(__name__)


@dataclass
class _Upload:
    snapshot: str                      # the private local copy (removed once uploaded, failed for good, or skipped)
    metrics: dict
    nbytes: int
    deadline: float | None = None      # a flush's deadline for its retries (None: retry_budget_s)
    superseded: int = 0
    started: float = field(default_factory=time.monotonic)


class ReportedUploads:
    """Uploads into ``store`` from a background thread (module docstring)."""

    def __init__(self, store: ReportedCheckpoints, *, retry_budget_s: float = DEFAULT_WRITE_RETRY_S,
                 max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES) -> None:
        if isinstance(max_consecutive_failures, bool) or not isinstance(max_consecutive_failures, int) \
                or max_consecutive_failures < 1:
            raise ValueError(f"max_consecutive_failures={max_consecutive_failures!r} must be an int >= 1")
        self.store = store
        self.retry_budget_s = check_retry_budget(retry_budget_s)
        self.max_consecutive_failures = max_consecutive_failures
        self._cond = threading.Condition()
        self._waiting: _Upload | None = None
        self._busy = False
        self._retry: _Upload | None = None      # the last upload, if it failed transiently (flush writes it again)
        self._last_error: BaseException | None = None
        self.consecutive_failures = 0
        self.written: list[str] = []             # files URLs, oldest first
        self.events: list[dict] = []

    # ------------------------------------------------------------ caller
    def submit(self, directory: str, metrics: dict | None = None) -> None:
        """Snapshot local ``directory`` now and upload it in the background. Raises ``ValueError`` for a directory
        that cannot be a checkpoint, :class:`CheckpointError` when the snapshot cannot be made or after
        ``max_consecutive_failures`` failed uploads in a row."""
        with self._cond:
            failures, error = self.consecutive_failures, self._last_error
        if failures >= self.max_consecutive_failures:
            raise CheckpointError(f"{failures} reported checkpoint uploads in a row to {self.store.uri} failed; the "
                                  f"last: {_describe(error)}. Training stops rather than go on without them: fix the "
                                  "cause (space, permissions, credentials) or use another location, then run again "
                                  "to resume from the newest valid one") from error
        upload = self._snapshot(directory, metrics or {})
        with self._cond:
            if self._waiting is not None:  # slow storage: the older one is skipped, never queued
                upload.superseded = self._waiting.superseded + 1
                _log.warning("reported checkpoint upload to %s is slower than the reports: a waiting one is skipped "
                             "for the newer one", self.store.uri)
                _discard(self._waiting)
            self._waiting = upload
            self._start_if_idle()

    def _snapshot(self, directory: str, metrics: dict) -> _Upload:
        files = _local_files(directory)  # ValueError: not a directory, links, too many files
        snapshot = tempfile.mkdtemp(prefix="er-reported-")
        nbytes = 0
        try:
            for rel in files:
                target = os.path.join(snapshot, *rel.split("/"))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copyfile(os.path.join(directory, *rel.split("/")), target)
                nbytes += os.path.getsize(target)
        except OSError as exc:
            shutil.rmtree(snapshot, ignore_errors=True)
            raise CheckpointError(f"report(checkpoint=...) could not copy {directory} into a local snapshot under "
                                  f"{tempfile.gettempdir()} (the upload runs from it, so that the directory may be "
                                  f"reused at once): {_describe(exc)}; free space there or set TMPDIR") from exc
        return _Upload(snapshot, dict(metrics), nbytes)

    def _start_if_idle(self) -> None:
        """(with the lock) Start the thread for the waiting upload unless one is running."""
        if self._busy or self._waiting is None:
            return
        if self._retry is not None:  # a newer one replaces the failed one kept for a flush
            _discard(self._retry)
        upload, self._waiting = self._waiting, None  # in flight from now on: a newer one waits behind it
        self._busy, self._retry = True, None
        try:
            threading.Thread(target=self._run, args=(upload,), name="elastic-ring-reported-upload",
                             daemon=True).start()
        except BaseException:  # no thread (resources exhausted): nothing in flight, the snapshot removed
            self._busy = False
            _discard(upload)
            raise

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._busy or self._waiting is not None

    def flush(self, timeout_s: float | None) -> str | None:
        """Wait for the upload in flight and the waiting one; a last upload that failed transiently is written
        again, retried until the deadline. Returns the newest files URL written (None if none); raises
        :class:`CheckpointError` if the last upload failed or uploads are still running at the deadline."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            if self._retry is not None and not self._busy and self._waiting is None:
                _log.warning("flush: uploading the failed reported checkpoint again to %s until the deadline",
                             self.store.uri)
                self._waiting, self._retry = self._retry, None
                self._waiting.deadline = deadline if deadline is not None else time.monotonic() + self.retry_budget_s
                self._start_if_idle()
            while self._busy or self._waiting is not None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise CheckpointError(f"reported checkpoint uploads to {self.store.uri} did not finish within "
                                          f"{timeout_s:.1f} s (storage slow or hanging?); the newest uploaded: "
                                          f"{self.written[-1] if self.written else 'none by this process'}")
                self._cond.wait(0.5 if remaining is None else min(0.5, remaining))
            if self._last_error is not None:
                raise CheckpointError(f"the last reported checkpoint upload to {self.store.uri} failed: "
                                      f"{_describe(self._last_error)}") from self._last_error
            return self.written[-1] if self.written else None

    # ------------------------------------------------------------ upload thread
    def _run(self, upload: _Upload) -> None:
        try:
            while True:
                self._upload(upload)  # (never raises: every failure becomes an event)
                with self._cond:
                    upload, self._waiting = self._waiting, None
                    if upload is None:  # idle, under the lock a submit takes: it starts the next thread
                        self._busy = False
                        self._cond.notify_all()
                        return
        except BaseException:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
            raise

    def _upload(self, upload: _Upload) -> None:
        started, attempts, first_failure = time.monotonic(), 0, None
        keep = False
        try:
            while True:
                attempts += 1
                try:
                    seq, url = self.store.save(upload.snapshot, upload.metrics)
                    break
                except Exception as exc:  # retried while transient and within the budget; else it failed
                    now = time.monotonic()
                    first_failure = now if first_failure is None else first_failure
                    limit = (first_failure + self.retry_budget_s if upload.deadline is None
                             else upload.deadline - WRITE_RETRY_FIRST_S)
                    delay = min(backoff_delay(attempts, WRITE_RETRY_FIRST_S, WRITE_RETRY_MAX_S), limit - now)
                    transient = is_transient(exc)
                    with self._cond:
                        newer = self._waiting is not None
                    if not transient or delay < WRITE_RETRY_FIRST_S or newer:  # a newer one replaces a retry
                        keep = transient and not newer
                        self._failed(upload, exc, attempts, transient, now - first_failure, keep)
                        return
                    _log.warning("reported checkpoint upload to %s, attempt %d, failed (%s); retrying in %.1f s",
                                 self.store.uri, attempts, _describe(exc), delay)
                    time.sleep(delay)
            with self._cond:
                self.written.append(url)
                self.consecutive_failures, self._last_error = 0, None
            _log.info("reported checkpoint %d written to %s%s", seq, url,
                      f" (attempt {attempts})" if attempts > 1 else "")
            self._emit({"kind": "reported_checkpoint_written", "uri": url, "seq": seq, "bytes": upload.nbytes,
                        "seconds": round(time.monotonic() - started, 3), "attempts": attempts,
                        "superseded": upload.superseded})
        except BaseException as exc:  # of any class: an event and flush()'s error, never a silent thread death
            self._failed(upload, exc, max(attempts, 1), False, 0.0, False)
        finally:
            if not keep:
                _discard(upload)

    def _failed(self, upload: _Upload, exc: BaseException, attempts: int, transient: bool, retried_s: float,
                keep: bool) -> None:
        with self._cond:
            self.consecutive_failures += 1
            self._last_error = exc
            self._retry = upload if keep else None
            failures = self.consecutive_failures
        _log.error("reported checkpoint upload %d in a row to %s failed after %d attempt(s): %s", failures,
                   self.store.uri, attempts, _describe(exc))
        self._emit({"kind": "checkpoint_failed", "reported": True, "uri": self.store.uri, "seq": None,
                    "error": _describe(exc), "attempts": attempts, "transient": transient,
                    "retried_s": round(retried_s, 3), "consecutive_failures": failures})

    def _emit(self, event: dict) -> None:
        with self._cond:
            self.events.append(event)
            del self.events[:-100]
        listener = checkpoint_writer._listener
        if listener is None:
            return
        try:
            listener(dict(event))
        except Exception as exc:  # the upload itself is done (or failed, and said so in the log)
            _log.error("the checkpoint event listener raised %s on %s: %s", type(exc).__name__, event["kind"], exc)


def _discard(upload: _Upload) -> None:
    shutil.rmtree(upload.snapshot, ignore_errors=True)


# ---------------------------------------------------------------- this process's uploaders
_lock = threading.Lock()
_uploads: dict[tuple, ReportedUploads] = {}


def uploads_for(uri: str, keep_last: int, *, run_id: str | None, signing_key: bytes | None,
                lease_generation: int | None,
                max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES) -> ReportedUploads:
    """This process's uploader for the location and run (one per location, run, key and lease generation)."""
    key = (uri, keep_last, run_id, signing_key, lease_generation, max_consecutive_failures)
    with _lock:
        uploads = _uploads.get(key)
        if uploads is None:
            store = ReportedCheckpoints(uri, keep_last, run_id=run_id, signing_key=signing_key,
                                        lease_generation=lease_generation)
            uploads = _uploads[key] = ReportedUploads(store, max_consecutive_failures=max_consecutive_failures)
        return uploads


def flush_reported(timeout_s: float | None) -> list[CheckpointError]:
    """Flush every uploader of this process within ``timeout_s`` seconds in all; the errors, one per uploader
    whose last upload failed or did not finish (an empty list: all written)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    errors = []
    with _lock:
        uploaders = list(_uploads.values())
    for uploads in uploaders:
        try:
            uploads.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except CheckpointError as exc:
            errors.append(exc)
    return errors


checkpoint_writer.register_flush_hook(flush_reported)
