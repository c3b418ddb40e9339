"""Reported checkpoints uploaded in the background: ``report(metrics, checkpoint=...)`` returns at once on rank 0,
while the other ranks go on to their next collective (a synchronous upload of gigabytes would outlast their
collective timeout and re-form the ring at every report).

:meth:`ReportedUploads.submit` copies the reported directory into a private local snapshot (under
``tempfile.gettempdir()``: ``TMPDIR``), so the caller may delete or reuse its directory as soon as it returns,
then hands it to the one :class:`~state.checkpoints.background.BackgroundWriter` (policy ``REPORTED``), which
uploads the snapshots one at a time with :meth:`ReportedCheckpoints.save`. At most one snapshot waits behind the
upload in flight: a newer report replaces the waiting one (the older is skipped and removed, never queued: slow
storage cannot fill the local disk). An upload failing with a transient storage error is retried with backoff for
``retry_budget_s`` after its first error, unless a newer one waits.

Every upload ends in an event passed to the listener of
:func:`~state.checkpoints.hooks.set_checkpoint_listener` (the worker forwards it to the driver's
``Result.events``): ``{"kind": "reported_checkpoint_written", "uri" (the files' URL), "seq", "bytes", "seconds",
"attempts", "superseded"}`` or ``{"kind": "checkpoint_failed", "reported": True, "uri" (the location), "seq": None,
"error", "attempts", "transient", "retried_s", "consecutive_failures"}``. :func:`~state.flush_checkpoints` (which
the worker calls when ``fn`` returns, at a stop and at a drain) waits for them too, writing a transiently failed last
upload again until its deadline. After ``max_consecutive_failures`` failed uploads in a row, the next
:meth:`ReportedUploads.submit` raises with the cause.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

from ..errors import CheckpointError
from ._local_files import local_files
from .background import REPORTED, BackgroundWriter, Job
from .config import DEFAULT_MAX_CONSECUTIVE_FAILURES
from .faults import DEFAULT_WRITE_RETRY_S, describe
from .reported import ReportedCheckpoints


class ReportedUploads:
    """Uploads into ``store`` from a background thread (module docstring); ``writer`` is its
    :class:`~state.checkpoints.background.BackgroundWriter` (``written``, ``events``, ``consecutive_failures``)."""

    def __init__(self, store: ReportedCheckpoints, *, retry_budget_s: float = DEFAULT_WRITE_RETRY_S,
                 max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES) -> None:
        self.store = store
        self.writer = BackgroundWriter(store, max_consecutive_failures, retry_budget_s=retry_budget_s, policy=REPORTED)

    def submit(self, directory: str, metrics: dict | None = None) -> None:
        """Snapshot local ``directory`` now and upload it in the background. Raises ``ValueError`` for a directory
        that cannot be a checkpoint, :class:`CheckpointError` when the snapshot cannot be made or after
        ``max_consecutive_failures`` failed uploads in a row."""
        self.writer.check()
        self.writer.submit_job(self._snapshot(directory, metrics or {}))

    def _snapshot(self, directory: str, metrics: dict) -> Job:
        files = local_files(directory)  # ValueError: not a directory, links, too many files
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
                                  f"reused at once): {describe(exc)}; free space there or set TMPDIR") from exc
        metrics = dict(metrics)

        def write() -> tuple[str, int, None]:
            seq, url = self.store.save(snapshot, metrics)
            return url, seq, None

        return Job(write, nbytes, discard=lambda: shutil.rmtree(snapshot, ignore_errors=True))

    def flush(self, timeout_s: float | None) -> str | None:
        """Wait for the upload in flight and the waiting one; a last upload that failed transiently is written
        again, retried until the deadline. Returns the newest files URL written (None if none); raises
        :class:`CheckpointError` if the last upload failed or uploads are still running at the deadline."""
        return self.writer.flush(timeout_s)


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
