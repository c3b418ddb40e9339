"""The durable checkpoints of a :class:`~state.State` (a part of it: ``State`` inherits these methods).

Only rank 0 writes, in the background (:class:`~state.checkpoints.background.BackgroundWriter`): every
``every_n_commits`` commits and/or every ``every_s`` seconds, when the driver asks (a drain: the commit is handed to
the writer, tagged with the driver's number, and the ring does not wait for it), and at a stop (written before the
ring ends). Every checkpoint carries the state's order (``StateOrder``: lineage, round, version), so the newest is
the newest state; a state that resumes from one continues its lineage (``lineage + 1``).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import elastic_ring as er
from elastic_ring.core.log import get_logger

from .checkpoints import hooks
from .checkpoints.background import DEFAULT_FLUSH_TIMEOUT_S, BackgroundWriter
from .checkpoints.config import CheckpointConfig
from .checkpoints.faults import backoff_delay, describe, is_transient
from .checkpoints.policy import StateOrder
from .checkpoints.store import CheckpointStore
from .errors import CheckpointError

_log = get_logger(__name__)

#: How long resuming reads the location again after transient storage errors (a listing that fails for a while).
RESUME_RETRY_S = 30.0

#: Called with the checkpoint's info when a State resumes from one (the worker
#: runtime forwards it to the driver's result.events).
_resume_listener: Callable[[dict], None] | None = None


def set_resume_listener(listener: Callable[[dict], None] | None) -> None:
    """Call ``listener(info)`` whenever a State of this process resumes from a checkpoint."""
    global _resume_listener
    _resume_listener = listener


class Durable:
    """``State``'s durable checkpoints (its attributes ``_checkpoint``, ``_writer``, ``_last_persist``,
    ``_snapshot``, ``_commits``, ``_lineage``, ``_handlers`` are the State's own)."""

    _checkpoint: CheckpointConfig | None
    _writer: BackgroundWriter | None
    _snapshot: Any
    _commits: int
    _handlers: dict
    names: list[str]
    commit_order: StateOrder

    def enable_checkpoints(self, uri: str, every_n_commits: int | None = None, every_s: float | None = None,
                           keep_last: int = 3, *, run_id: str | None = None, trusted: bool = False,
                           max_consecutive_failures: int = 3, signing_key: bytes | None = None) -> None:
        """Persist every ``every_n_commits`` commits and/or every ``every_s`` seconds to ``uri``
        (an absolute path or fsspec URL); keep the newest ``keep_last``. Only rank 0 writes, in the
        background. See :class:`CheckpointConfig` for ``run_id``, ``trusted``, ``max_consecutive_failures``
        and ``signing_key``."""
        self._use_checkpointing(CheckpointConfig(
            uri=uri, every_n_commits=every_n_commits, every_s=every_s, keep_last=keep_last, run_id=run_id,
            trusted=trusted, max_consecutive_failures=max_consecutive_failures, signing_key=signing_key))

    def _use_checkpointing(self, config: CheckpointConfig) -> None:
        # fenced by the lease's generation (before the claim, before the manifest, after it), as reported ones are
        store = CheckpointStore(config.uri, keep_last=config.keep_last, run_id=config.run_id, trusted=config.trusted,
                                signing_key=config.signing_key, lease_generation=config.lease_generation)
        object.__setattr__(self, "_checkpoint", config)
        object.__setattr__(self, "_writer", BackgroundWriter(store, config.max_consecutive_failures))

    @property
    def checkpoint_store(self) -> CheckpointStore | None:
        return self._writer.store if self._writer is not None else None

    def _persist_source(self) -> tuple[dict, dict]:
        """The last commit and its meta (its state's order among them), read by the writer when it starts a write
        (in this thread)."""
        return self._snapshot, {"commits": self._commits, "names": self.names, "order": self.commit_order.as_list()}

    def _maybe_persist(self) -> None:
        config = self._checkpoint
        if config is None or not er.is_initialized() or er.rank() != 0:
            return
        self._writer.check()  # raises after repeated failed writes, with the cause
        self._writer.poll()   # a write asked for while the previous one was in flight starts now, with this commit
        now = time.monotonic()
        due = (config.every_n_commits is not None and self._commits % config.every_n_commits == 0) or (
            config.every_s is not None and now - self._last_persist >= config.every_s)
        if due:
            object.__setattr__(self, "_last_persist", now)
            self._writer.submit(self._persist_source)

    def persist_now(self, timeout_s: float | None = DEFAULT_FLUSH_TIMEOUT_S) -> str | None:
        """Write the last commit durably now and wait for it (e.g. before a planned shutdown); rank 0 only.
        Raises :class:`CheckpointError` if it fails or is not done within ``timeout_s`` seconds."""
        if self._writer is None or self._snapshot is None or (er.is_initialized() and er.rank() != 0):
            return None
        self._writer.submit(self._persist_source)
        return self._writer.flush(timeout_s)

    def _resume(self) -> None:
        loaded = self._load_latest()
        if loaded is None:
            return
        tree, info = loaded
        for name, handler in self._handlers.items():
            handler.load_tree(tree[name])
        info = {**info, "epoch": tree.get("epoch"), "step": tree.get("step")}  # when the state keeps them
        object.__setattr__(self, "resumed_from", info)
        order = StateOrder.parse((info.get("meta") or {}).get("order"))
        object.__setattr__(self, "_lineage", (order.lineage if order is not None else 0) + 1)  # newer than it
        _log.info("resumed from checkpoint %s at epoch %s, step %s (commit %s)", info["uri"], info["epoch"],
                  info["step"], info["meta"].get("commits"))
        if _resume_listener is not None:
            _resume_listener(info)

    def _load_latest(self) -> Any:
        """The newest valid checkpoint; a listing or a read failing with a transient storage error (a blip of the
        storage) is tried again with backoff for :data:`RESUME_RETRY_S` before it ends the resume."""
        started, attempt = time.monotonic(), 0
        while True:
            attempt += 1
            try:
                return self._writer.store.load_latest(expected_names=self.names)
            except (OSError, CheckpointError) as exc:
                delay = backoff_delay(attempt, 0.5, 4.0)
                if not is_transient(exc) or time.monotonic() - started + delay > RESUME_RETRY_S:
                    raise
                _log.warning("reading the newest checkpoint at %s failed (%s); trying again in %.1f s",
                             self._writer.store.uri, describe(exc), delay)
                time.sleep(delay)

    def _persist_for_stop(self) -> None:
        if self._writer is None:
            _log.warning("asked to persist this commit, but no checkpoint_uri is set; continuing without")
            return
        try:
            uri = self.persist_now()
        except CheckpointError as exc:  # a checkpoint_failed event already says so; the final flush reports it
            _log.error("the durable write of this commit (asked for by the driver) failed: %s; a stop's final "
                       "flush reports it in the run's result", exc)
            uri = None
        if uri is not None:
            _log.info("persisted %s", uri)

    def _persist_asked(self, persist_id: int, persist_by: float | None) -> None:
        """Hand the last commit to the writer for the driver's request ``persist_id`` (rank 0; no wait). Its
        events carry the number, so the driver knows this commit was saved; a transient failure is retried until
        ``persist_by`` (the drain's deadline on this process's clock)."""
        if self._writer is None:
            _log.warning("asked to persist this commit, but no checkpoint_uri is set; continuing without")
            return
        if er.is_initialized() and er.rank() != 0:
            return
        tree, meta = self._persist_source()
        tags = {"persist": persist_id} if persist_id else {}
        self._writer.submit_copy(tree, meta, tags=tags, retry_until=persist_by)
        listener = hooks.listener()
        if listener is not None and persist_id:
            try:  # a courtesy to the driver (the write's own events carry the number): never the loop's error
                listener({"kind": "persist_started", "persist": persist_id, "order": meta["order"],
                          "commits": meta["commits"]})
            except Exception as exc:  # noqa: BLE001 - logged; the write goes on
                _log.warning("could not tell the driver that write %d started: %s: %s", persist_id,
                             type(exc).__name__, exc)
