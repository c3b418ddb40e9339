"""The background writer's requests (:mod:`~state.checkpoints.background`): where the two kinds of write differ
(:class:`Policy`: :data:`STATE`, :data:`REPORTED`), one write (:class:`Job`), and a request waiting for the writer
(its tags and retry deadline, inherited by a request that replaces it)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

Source = Callable[[], "tuple[Any, dict]"]

@dataclass(frozen=True)
class Policy:
    """Where the background writes of the two kinds differ (each as it always was)."""

    noun: str                   # one write, in messages and logs
    nouns: str
    written_kind: str           # the event of a write that landed
    last_failed: str            # how flush() names a failed last write ({uri}: the location)
    thread_name: str
    newer_ends_retries: bool    # a newer request waiting ends the retries of a failing write (else it waits)
    newest_of_process: bool     # flush_checkpoints() may return this writer's newest URI
    flush_all_at_exit: bool     # the exit flushes it even when idle (a failed last write is retried), or only busy
    failed_fields: dict = field(default_factory=dict)  # fields every checkpoint_failed event carries


STATE = Policy("checkpoint write", "checkpoint writes", "checkpoint_written", "the last checkpoint write failed",
               "elastic-ring-checkpoint-writer", newer_ends_retries=False, newest_of_process=True,
               flush_all_at_exit=False)
#: A failed upload's event names no number (the number it claimed was discarded), as it always did.
REPORTED = Policy("reported checkpoint upload", "reported checkpoint uploads", "reported_checkpoint_written",
                  "the last reported checkpoint upload to {uri} failed", "elastic-ring-reported-upload",
                  newer_ends_retries=True, newest_of_process=False, flush_all_at_exit=True,
                  failed_fields={"reported": True, "seq": None})


@dataclass
class Job:
    """One write: ``write()`` (in the writer thread) returns (URI written, seq, the pruning's error or None)."""

    write: Callable[[], "tuple[str, int | None, str | None]"]
    nbytes: int
    fields: dict = field(default_factory=dict)            # the job's own event fields (the state's ``commits``)
    discard: Callable[[], None] = lambda: None             # frees what it holds: written, failed for good, replaced
    superseded: int = 0                                    # requests it replaced, skipped for it
    retry_until: float | None = None                       # retry transient failures until then (None: the budget)


@dataclass
class _Request:
    owner: threading.Thread | None    # the thread that must start it (None: any thread)
    source: Source | None = None      # the state's: read and copied when it starts
    job: Job | None = None            # prepared
    superseded: int = 0
    tags: dict = field(default_factory=dict)  # repeated in its events ({"persist": n}); inherited by a replacement
    retry_until: float | None = None  # retry transient failures until then (this process's monotonic clock)

    def as_job(self, job: Job) -> Job:
        """``job`` carrying this request's tags, superseded count and retry deadline."""
        job.fields.update(self.tags)
        job.superseded = self.superseded
        if self.retry_until is not None:
            job.retry_until = self.retry_until if job.retry_until is None else min(job.retry_until, self.retry_until)
        return job


def inherit(newer: _Request, older: _Request) -> None:
    """``newer`` replaces ``older``: it answers ``older``'s tags too (the newest persist number) and keeps the
    earlier of their retry deadlines."""
    tags = {**older.tags, **newer.tags}
    if "persist" in older.tags or "persist" in newer.tags:
        tags["persist"] = max(older.tags.get("persist", 0), newer.tags.get("persist", 0))
    newer.tags = tags
    deadlines = [d for d in (older.retry_until, newer.retry_until) if d is not None]
    newer.retry_until = min(deadlines) if deadlines else None
