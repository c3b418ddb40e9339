"""The one background writer of checkpoints, for both kinds: training never waits, at most one write in flight.

The state's checkpoints (``State`` submits its last commit) and the reported ones (``report(checkpoint=...)``,
:mod:`~state.checkpoints.uploads`) use it; a :class:`Policy` (:data:`STATE`, :data:`REPORTED`) says where they
differ. A request made while a write is in flight waits, and a newer one replaces it: the newest is always the one
written, and slow storage makes the writer skip requests, never queue them (counted in ``superseded``).

* A request of the state (:meth:`BackgroundWriter.submit`, ``source() -> (tree, meta)``) reads live training
  state: it runs in the thread that made it once the writer is idle (at once, or at that thread's next ``poll()``
  / ``flush()``), its tree copied into the writer's host buffers (reused: one copy of the state at most).
* A prepared request (:meth:`BackgroundWriter.submit_job`: a reported checkpoint's snapshot) may start in any
  thread, the writer's own too, as soon as the write before it ends; a replaced one is discarded.

* A request of the state that must not wait for that thread (:meth:`BackgroundWriter.submit_copy`: the commit a
  driver asked to be written durably, e.g. at a preemption notice, while the thread goes to re-form the ring) is a
  private copy of the tree, prepared at once: it starts as soon as the writer is idle, in any thread.

A request may carry *tags* (``{"persist": n}``: the driver's number for the write it asked for) that its events
repeat; a request that replaces a waiting one inherits the replaced one's tags (a newer state written instead of
the one asked for still answers that request) and its retry deadline.

A write that fails with a transient storage error (:func:`~state.checkpoints.faults.is_transient`) is retried
with backoff for ``retry_budget_s`` after its first error, or until the request's own deadline (``retry_until``:
a drain's deadline); slowness alone is never a failure. Every write ends in
an event for the listener of :func:`~state.checkpoints.hooks.set_checkpoint_listener`; ``flush()`` (always with a
deadline) writes a transiently failed last write again until then; :meth:`BackgroundWriter.check` raises after
``max_consecutive_failures`` failed writes in a row. See docs/checkpoints.md ("The writer").
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.utils._pytree as pytree

from elastic_ring.core.log import get_logger

from ..errors import CheckpointError
from ..snapshot import SnapshotBuffer, copy_tree
from . import hooks
from .config import DEFAULT_MAX_CONSECUTIVE_FAILURES
from .faults import (
    DEFAULT_WRITE_RETRY_S, WRITE_RETRY_FIRST_S, WRITE_RETRY_MAX_S, backoff_delay, check_retry_budget, describe,
    is_transient,
)
from .hooks import DEFAULT_FLUSH_TIMEOUT_S
from .requests import REPORTED, STATE, Job, Policy, Source, _Request, inherit  # noqa: F401  (REPORTED: for uploads.py)
from .sequenced import CheckpointPruneError

_log = get_logger(__name__)

#: A write in flight this long is logged as slow by ``check()`` (once per write; it is not a failure).
SLOW_WRITE_WARN_S = 120.0

class BackgroundWriter:
    """Writes ``store``'s checkpoints in a thread. ``retry_budget_s``: how long a write failing with
    transient storage errors is retried after its first one (0: never); ``max_consecutive_failures``:
    failed writes in a row after which :meth:`check` raises; ``policy``: :data:`STATE` or :data:`REPORTED`."""

    def __init__(self, store: Any, max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES, *,
                 retry_budget_s: float = DEFAULT_WRITE_RETRY_S, policy: Policy = STATE) -> None:
        if isinstance(max_consecutive_failures, bool) or not isinstance(max_consecutive_failures, int) \
                or max_consecutive_failures < 1:
            raise ValueError(f"max_consecutive_failures={max_consecutive_failures!r} must be an int >= 1")
        self.store, self.policy = store, policy
        self.max_consecutive_failures = max_consecutive_failures
        self.retry_budget_s = check_retry_budget(retry_budget_s)
        self._cond = threading.Condition()
        self._buffer = SnapshotBuffer()  # the state's trees are copied here (one copy, reused)
        self._waiting: _Request | None = None
        self._busy = False
        self._thread: threading.Thread | None = None
        self._last_ok: bool | None = None
        self._last_error: BaseException | None = None
        self._listener_error: BaseException | None = None
        self._retry: Job | None = None    # the last write, if it failed transiently (flush writes it again)
        self._in_flight: dict = {}        # the write in flight: started, attempts, last error, warned
        self._failing_since: float | None = None  # the first failed attempt of the current run of failures
        self._skipped = 0                 # requests skipped for writes that then failed: counted at the next success
        self.consecutive_failures = 0
        self.written: list[str] = []
        self.last_written_at = 0.0
        self.events: list[dict] = []
        hooks.register(self)

    # ------------------------------------------------------------ the submitting thread
    @property
    def busy(self) -> bool:
        return self._busy

    def submit(self, source: Source, *, tags: dict | None = None, retry_until: float | None = None) -> None:
        """Ask for a write of ``source()``, a (tree, meta) pair of live state; starts at once if idle (in this
        thread), else replaces the waiting request. ``tags`` / ``retry_until``: see the module docstring."""
        if not callable(source):
            raise TypeError(f"submit expects a function returning (tree, meta), got {type(source).__name__}")
        self._enqueue(_Request(threading.current_thread(), source=source, tags=dict(tags or {}),
                               retry_until=retry_until))
        self.poll()

    def submit_copy(self, tree: Any, meta: dict, *, tags: dict | None = None,
                    retry_until: float | None = None) -> None:
        """Ask for a write of a private copy of ``tree`` (taken now, in this thread) that any thread may start:
        it never waits for this thread's next commit or flush (a driver's persist request at a step boundary,
        after which the thread re-forms the ring). Starts at once if idle, else replaces the waiting request."""
        if self._can_start_here():
            self.submit(lambda: (tree, meta), tags=tags, retry_until=retry_until)  # idle: the usual buffer copy
            return
        self._enqueue(_Request(None, job=self._state_job(copy_tree(tree), dict(meta), nbytes=None),
                               tags=dict(tags or {}), retry_until=retry_until))
        self.poll()

    def submit_job(self, job: Job) -> None:
        """Ask for a write of the prepared ``job``; starts at once if idle, else replaces the waiting request."""
        self._enqueue(_Request(None, job=job))
        self.poll()

    def _can_start_here(self) -> bool:
        with self._cond:
            return not self._busy and (self._waiting is None or self._startable(self._waiting))

    def _enqueue(self, request: _Request) -> None:
        with self._cond:
            replaced, self._waiting = self._waiting, request
            if replaced is not None:  # slow storage: the older request is skipped, never queued
                request.superseded = replaced.superseded + 1
                inherit(request, replaced)
        if replaced is not None:
            _log.info("%s to %s is slower than the requests: a waiting one is skipped for the newer one",
                      self.policy.noun, self.store.uri)
            if replaced.job is not None:
                replaced.job.discard()

    def poll(self) -> bool:
        """Start the waiting request if the writer is idle and this thread may start it; True if started."""
        with self._cond:
            if self._busy or self._waiting is None or not self._startable(self._waiting):
                return False  # a request of a thread still committing into its buffers: that thread starts it
            request, self._waiting = self._waiting, None
            self._busy, retry, self._retry = True, self._retry, None
        if retry is not None:
            retry.discard()  # a newer write replaces the failed one kept for a flush
        try:
            job = request.job if request.job is not None else self._copy(request.source)
        except BaseException as exc:  # a bad source or an uncopyable value: an event, like a failed write
            self._failed(exc, None, None, attempts=1, transient=False, retried_s=0.0, fields=request.tags)
            self._finish()
            if not isinstance(exc, Exception):
                raise
            return False
        self._start(request.as_job(job), None)
        return True

    def _copy(self, source: Source) -> Job:
        """The state's request as a job: its tree copied into this writer's host buffers (in this thread)."""
        tree, meta = source()
        return self._state_job(self._buffer.take(tree), dict(meta), self._buffer.nbytes)

    def _state_job(self, tree: Any, meta: dict, nbytes: int | None) -> Job:
        """A job that saves ``tree`` with ``meta`` as a state checkpoint (``nbytes``: its size, None to count it)."""
        if nbytes is None:
            nbytes = sum(x.numel() * x.element_size() for x in _tensors(tree))

        def write() -> tuple[str, int | None, str | None]:
            try:
                uri, prune_error = self.store.save(tree, meta), None
            except CheckpointPruneError as exc:  # written and verified; the pruning is reported with the event
                _log.error("%s", exc)
                uri, prune_error = exc.uri, str(exc)
            return uri, _seq_of(uri), prune_error

        fields = {"commits": meta.get("commits")}
        if meta.get("order") is not None:
            fields["order"] = meta["order"]
        return Job(write, nbytes, fields)

    def _startable(self, request: _Request) -> bool:
        owner = request.owner
        return owner is None or owner is threading.current_thread() or not owner.is_alive()

    def _start(self, job: Job, deadline: float | None) -> None:
        """Write ``job`` in a new thread (the caller set ``_busy``); retries end at ``deadline`` if given."""
        thread = threading.Thread(target=self._run, args=(job, deadline), name=self.policy.thread_name, daemon=True)
        with self._cond:
            self._thread = thread
            self._in_flight = {"started": time.monotonic(), "attempts": 1, "error": None, "warned": False}
        try:
            thread.start()
        except BaseException as exc:  # no thread (resources exhausted): a failed write, not a stuck writer
            self._failed(exc, job, None, attempts=1, transient=False, retried_s=0.0)
            job.discard()
            self._finish()
            raise

    def check(self) -> None:
        """Raise :class:`CheckpointError` after ``max_consecutive_failures`` failed writes in a row, or if
        the event listener raised. Logs a write in flight for over :data:`SLOW_WRITE_WARN_S` (slow storage
        is not a failure)."""
        with self._cond:
            listener_error, self._listener_error = self._listener_error, None
            failures, error = self.consecutive_failures, self._last_error
            failing_s = 0.0 if self._failing_since is None else time.monotonic() - self._failing_since
            flight = self._in_flight if self._busy else {}
            slow = flight and not flight["warned"] and time.monotonic() - flight["started"] > SLOW_WRITE_WARN_S
            if slow:
                flight["warned"] = True
        if slow:
            _log.warning("a %s to %s has been in flight for %.0f s (attempt %d): storage slow or hanging? Training "
                         "goes on; newer requests replace each other until it ends", self.policy.noun, self.store.uri,
                         time.monotonic() - flight["started"], flight["attempts"])
        if listener_error is not None:
            raise CheckpointError(f"the checkpoint event listener raised {type(listener_error).__name__}: "
                                  f"{listener_error}") from listener_error
        if failures >= self.max_consecutive_failures:
            retried = (f"each write was retried for up to {self.retry_budget_s:g} s, and writes have failed for "
                       f"{failing_s:.0f} s" if is_transient(error) else "this error is not retried: it does not go "
                       "away by itself")
            raise CheckpointError(
                f"{failures} {self.policy.nouns} in a row to {self.store.uri} failed; the last: {describe(error)} "
                f"({retried}). Training stops rather than go on without durable checkpoints: fix the cause (space, "
                "permissions, credentials, values that cannot be saved), or set another checkpoint_uri, then run "
                "again to resume from the newest valid checkpoint "
                f"({self.written[-1] if self.written else 'none written by this run'})") from error

    def flush(self, timeout_s: float | None = DEFAULT_FLUSH_TIMEOUT_S) -> str | None:
        """Write what is waiting and wait for it; return the newest URI written (None if none).

        If the last write failed with a transient error, it is written again, retried with backoff until
        the deadline (``retry_budget_s`` when ``timeout_s`` is None). Raises :class:`CheckpointError` if
        the last write failed, or if a write is still in flight after ``timeout_s`` seconds (None: no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        retried = False
        while True:
            self.poll()
            with self._cond:
                if not self._busy and self._waiting is None:
                    job = self._retry if self._last_ok is False and not retried else None
                    if job is None or _remaining(deadline) == 0:
                        break
                    self._retry, self._busy, retried = None, True, True
                else:
                    job = None
                    if not self._busy and self._startable(self._waiting):
                        continue
                    remaining = _remaining(deadline)
                    if remaining == 0:
                        raise CheckpointError(self._late_message(timeout_s))
                    self._cond.wait(0.5 if remaining is None else min(0.5, remaining))
            if job is not None:
                _log.warning("flush: writing the failed %s to %s again, retrying until the deadline",
                             self.policy.noun, self.store.uri)
                self._start(job, deadline if deadline is not None else time.monotonic() + self.retry_budget_s)
        with self._cond:
            if self._last_ok is False:
                raise CheckpointError(f"{self.policy.last_failed.format(uri=self.store.uri)}: "
                                      f"{describe(self._last_error)}") from self._last_error
            return self.written[-1] if self.written else None

    def _late_message(self, timeout_s: float | None) -> str:
        newest = self.written[-1] if self.written else "none yet"
        flight, now = self._in_flight, time.monotonic()
        doing = ""
        if self._busy and flight:
            doing = f"; the write in flight started {now - flight['started']:.1f} s ago, attempt {flight['attempts']}"
            if flight["error"] is not None:
                doing += f", retrying after {flight['error']}"
        within = "no limit" if timeout_s is None else f"{timeout_s:.1f} s"
        return (f"{self.policy.nouns} to {self.store.uri} did not finish within {within} (storage slow or hanging?)"
                f"{doing}; the newest written: {newest}")

    # ------------------------------------------------------------ the writer thread
    def _run(self, job: Job, deadline: float | None) -> None:
        try:
            while True:
                self._write(job, deadline)  # (never raises: every failure becomes an event)
                with self._cond:  # a prepared request that waited starts here, at once
                    request = self._waiting
                    if request is None or request.job is None:  # idle, under the lock a submit takes: it starts it
                        self._busy = False
                        self._cond.notify_all()
                        return
                    self._waiting, retry, self._retry = None, self._retry, None
                    job, deadline = request.as_job(request.job), None
                    self._in_flight = {"started": time.monotonic(), "attempts": 1, "error": None, "warned": False}
                if retry is not None:
                    retry.discard()
        except BaseException:
            self._finish()
            raise

    def _write(self, job: Job, deadline: float | None) -> None:
        started, attempts, first_failure, seq, keep = time.monotonic(), 0, None, None, False
        deadline = job.retry_until if deadline is None else deadline
        try:
            while True:
                attempts += 1
                with self._cond:
                    self._in_flight["attempts"] = attempts
                try:
                    uri, seq, prune_error = job.write()
                    break
                except Exception as exc:  # retried if transient and within budget; else the write failed
                    seq = getattr(exc, "seq", None)
                    now = time.monotonic()
                    first_failure = now if first_failure is None else first_failure
                    # a flush's deadline: the last attempt starts early enough to end before it on a failing disk
                    limit = first_failure + self.retry_budget_s if deadline is None else deadline - WRITE_RETRY_FIRST_S
                    delay = min(backoff_delay(attempts, WRITE_RETRY_FIRST_S, WRITE_RETRY_MAX_S), limit - now)
                    transient = is_transient(exc)
                    with self._cond:
                        newer = self.policy.newer_ends_retries and self._waiting is not None
                    if not transient or delay < WRITE_RETRY_FIRST_S or newer:  # not worth it, budget spent, replaced
                        keep = transient and not newer
                        self._failed(exc, job, seq, attempts=attempts, transient=transient,
                                     retried_s=now - first_failure, keep=keep, first_failure=first_failure)
                        return
                    with self._cond:
                        self._in_flight["error"] = describe(exc)
                    _log.warning("%s to %s, attempt %d, failed (%s); retrying in %.1f s (for %.1f s more)",
                                 self.policy.noun, self.store.uri, attempts, describe(exc), delay, limit - now)
                    time.sleep(delay)
            with self._cond:
                self.written.append(uri)
                self.last_written_at = time.monotonic()
                self.consecutive_failures, self._last_ok, self._last_error = 0, True, None
                self._failing_since, superseded, self._skipped = None, job.superseded + self._skipped, 0
            _log.info("%s landed: %s%s", self.policy.noun, uri, f" (attempt {attempts})" if attempts > 1 else "")
            self._emit({"kind": self.policy.written_kind, "uri": uri, "seq": seq, **job.fields, "bytes": job.nbytes,
                        "seconds": round(time.monotonic() - started, 3), "attempts": attempts,
                        "superseded": superseded, "consecutive_failures": 0, "prune_error": prune_error})
        except BaseException as exc:  # every error, of any class, becomes an event and flush()'s error
            self._failed(exc, job, seq, attempts=max(attempts, 1), transient=False,
                         retried_s=0.0 if first_failure is None else time.monotonic() - first_failure)
        finally:
            if not keep:
                job.discard()

    def _finish(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def _failed(self, exc: BaseException, job: Job | None, seq: int | None, *, attempts: int, transient: bool,
                retried_s: float, keep: bool = False, first_failure: float | None = None,
                fields: dict | None = None) -> None:
        with self._cond:
            self.consecutive_failures += 1
            self._last_ok, self._last_error = False, exc
            self._retry = job if keep else None
            if job is not None:  # what it replaced was skipped: the next write that lands counts it
                self._skipped, job.superseded = self._skipped + job.superseded, 0
            if self._failing_since is None:
                self._failing_since = time.monotonic() if first_failure is None else first_failure
            failures, failing_s = self.consecutive_failures, time.monotonic() - self._failing_since
        message = describe(exc)
        _log.error("%s %d in a row to %s failed after %d attempt(s) over %.1f s: %s", self.policy.noun, failures,
                   self.store.uri, attempts, retried_s, message)
        self._emit({"kind": "checkpoint_failed", "uri": self.store.uri, "seq": seq,
                    **(job.fields if job is not None else fields or {}), "error": message, "attempts": attempts,
                    "transient": transient, "retried_s": round(retried_s, 3), "failing_s": round(failing_s, 3),
                    "consecutive_failures": failures, **self.policy.failed_fields})

    def _emit(self, event: dict) -> None:
        with self._cond:
            self.events.append(event)
            del self.events[:-100]
        listener = hooks.listener()
        if listener is None:
            return
        try:
            listener(dict(event))
        except BaseException as exc:  # of any class (a sys.exit too): reported at the next check()
            _log.error("the checkpoint event listener raised %s: %s", type(exc).__name__, exc)
            with self._cond:
                self._listener_error = exc


def _tensors(tree: Any) -> list:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _seq_of(uri: str) -> int | None:
    tail = uri.rstrip("/").rsplit("ckpt-", 1)[-1]
    return int(tail) if tail.isdigit() else None
