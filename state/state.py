"""State: commit / restore / sync of training state, Horovod-style, with handlers by type.

* ``commit()`` snapshots every value to host memory, may hand a copy to the
  durable checkpoint writer, then runs one small collective in which all ranks
  check that they are all committing and learn whether any rank has a pending
  membership change; if so, every rank raises :class:`MembershipChanged` at
  this same commit, after the snapshot is complete.
* ``restore()`` puts the last commit back (local; no communication).
* ``on_failure(exc)`` (called by the elastic loop when a collective failed)
  notes whether this rank's live state is whole (``exc.live_state_consistent``);
  nothing is rolled back yet.
* ``sync()`` first agrees, in one allgather of four integers per rank, on the
  root and the mode (:mod:`state.recovery`): continue from the newest *live*
  state of a rank whose state is whole (no rollback: a failure at a step
  boundary loses at most the step in flight), roll back to the newest commit
  when no rank's live state can be trusted, or start fresh (resuming from the
  newest durable checkpoint, if enabled) when no rank holds state yet. Then
  the root's values go to every rank (a joiner gets everything it needs), and
  every rank commits locally.
* ``register_reset_callbacks`` adds callbacks run after the ring is re-formed.

Attributes are read and assigned as plain attributes: ``state.epoch += 1``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import torch

import elastic_ring as er
from elastic_ring.collectives import join as _join
from elastic_ring.core import timeline
from elastic_ring.core.log import get_logger

from . import membership
from .checkpoints.config import default_checkpointing
from .checkpoints.policy import StateOrder
from .durable import Durable, set_resume_listener  # noqa: F401  (set_resume_listener: the worker runtime's)
from .errors import TrainingStopped
from .handlers import OptimizerHandler, handler_for
from .recovery import CONSISTENT, DIRTY, Mode, RankStatus, SyncDecision, decide_sync, failure_trust
from .samplers.sampler import ElasticSampler
from .samplers.stream import ElasticStream
from .step_link import StepLink, is_distributed_optimizer

#: The positions a State links to its optimizer's steps and re-cuts at every re-form.
_POSITIONS = (ElasticSampler, ElasticStream)

_log = get_logger(__name__)

def _on_joined_commit_answer(values: list[int]) -> None:
    """On a rank waiting in ``er.join()`` that answered the others' ``State.commit`` agreement: raise what they
    raise (``TrainingStopped`` / ``MembershipChanged``), so the joined rank leaves for the next ring with them
    instead of learning of it from a torn-down connection. (It persists nothing: the ranks with data do.)"""
    changed, _persist, stop = (list(values) + [0, 0, 0])[:3]  # (a 4th value, the persist's number, is not its)
    if changed or stop:
        membership.clear_membership_change()
        if stop:
            raise TrainingStopped("the job was asked to stop (at a commit of the ranks with data)")
        raise er.MembershipChanged("the ring's membership changes at a commit of the ranks with data")


_join.add_answer_listener("State.commit", _on_joined_commit_answer)


class State(Durable):
    def __init__(self, **values: Any) -> None:
        object.__setattr__(self, "_handlers", {})
        object.__setattr__(self, "_snapshot", None)
        object.__setattr__(self, "_reset_callbacks", [])
        object.__setattr__(self, "_commits", 0)
        object.__setattr__(self, "_holds", False)         # completed a sync: holds the job's state
        object.__setattr__(self, "_trust", CONSISTENT)    # how the live state came out of the last failure
        object.__setattr__(self, "_base", (0, 0, 0))      # (version, commits, applied steps) at the last sync
        object.__setattr__(self, "_commit_version", 0)
        object.__setattr__(self, "_commit_round", 0)       # the ring's round when the last commit was taken
        object.__setattr__(self, "_lineage", 0)           # resumes from a checkpoint behind this state (policy.StateOrder)
        object.__setattr__(self, "_checkpoint", None)
        object.__setattr__(self, "_writer", None)
        object.__setattr__(self, "_last_persist", time.monotonic())
        object.__setattr__(self, "resumed_from", None)
        object.__setattr__(self, "_link", None)
        for name, value in values.items():
            setattr(self, name, value)
        self._relink()
        default = default_checkpointing()  # the worker runtime's (state.checkpoints.config.set_default_checkpointing)
        if default is not None:
            self._use_checkpointing(default)

    # ------------------------------------------------------------ attributes
    def __getattr__(self, name: str) -> Any:
        handlers = object.__getattribute__(self, "_handlers")
        if name in handlers:
            return handlers[name].value
        raise AttributeError(f"this state has no value {name!r}; it holds {sorted(handlers)}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name == "resumed_from":
            raise AttributeError(f"state value names may not start with '_' or be 'resumed_from': {name!r}")
        previous = self._handlers.get(name)
        if previous is not None and isinstance(previous.value, _POSITIONS) and previous.value is not value:
            previous.value._held_by_state = False  # (a sampler iterated outside every State warns: see data.shard)
        if isinstance(value, _POSITIONS):
            value._held_by_state = True
        self._handlers[name] = handler_for(value)

    # ------------------------------------------------------------ the step link
    def _relink(self) -> None:
        """Link the state's DistributedOptimizer when it holds exactly one (step boundaries), with its sampler
        when it holds exactly one ElasticSampler (:mod:`state.step_link`); unlink when that no longer holds."""
        values = [h.value for h in self._handlers.values()]
        optimizers = [v for v in values if is_distributed_optimizer(v)]
        samplers = [v for v in values if isinstance(v, _POSITIONS)]
        modules = [v for v in values if isinstance(v, torch.nn.Module)]
        if len(optimizers) == 1 and len(samplers) > 1:
            names = sorted(n for n, h in self._handlers.items() if isinstance(h.value, _POSITIONS))
            raise ValueError(
                f"this State holds {len(samplers)} sampler positions ({', '.join(names)}) and one DistributedOptimizer: "
                "the optimizer's steps advance the one position its training batches come from, and the state could "
                "not tell which (with two, a failure would re-train or skip rows). Keep only the training "
                "sampler / dataset shard in the State; a validation shard or evaluation sampler stays outside it (a "
                "failure then restarts its evaluation epoch, which trains nothing), or give it a State of its own")
        sampler = samplers[0] if len(samplers) == 1 else None
        wants_global = [s for s in samplers if s.global_batch_size is not None]
        if wants_global and (len(optimizers) != 1 or sampler is None):
            raise ValueError(
                f"ElasticSampler(global_batch_size={wants_global[0].global_batch_size}) needs its State to hold "
                f"exactly one DistributedOptimizer and one ElasticSampler (it holds {len(optimizers)} and "
                f"{len(samplers)}): the optimizer accumulates the micro-batches of each global step"
            )
        link = self._link
        if link is not None and len(optimizers) == 1 and link.matches(optimizers[0], sampler, modules):
            return
        if link is not None:
            link.close()
            object.__setattr__(self, "_link", None)
        if len(optimizers) == 1:
            object.__setattr__(self, "_link", StepLink(optimizers[0], sampler, modules, self._boundary_commit))

    @property
    def step_linked(self) -> bool:
        """True when the sampler advances with the optimizer's apply (see :mod:`state.step_link`)."""
        return self._link is not None and self._link.sampler is not None

    def _boundary_commit(self) -> None:
        """At a step boundary the ring agreed on (a driver notice waits): the commit's agreement, then
        MembershipChanged or TrainingStopped on every rank. The state is snapshotted only when the notices
        ask for a durable write (a drain, a stop): a join's re-form hands over the live state, not a copy."""
        with timeline.span("boundary", "state", step=self._applied()):
            changed, persist, stop, persist_id = self._agree_notices()
            if not (changed or stop or persist):
                return
            if persist or stop:  # every rank agreed on the same flags: commit counts stay equal
                self._take_commit()
            self._act_on_notices(changed, persist, stop, persist_id)

    @property
    def names(self) -> list[str]:
        return sorted(self._handlers)

    @property
    def commits(self) -> int:
        """Number of commits made by this process."""
        return self._commits

    # ------------------------------------------------------------ versions
    def _applied(self) -> int:
        """Optimizer steps applied in this process (DistributedOptimizer counts them)."""
        return sum(int(getattr(h.value, "applied_steps", 0)) for h in self._handlers.values()
                   if isinstance(h, OptimizerHandler))

    @property
    def version(self) -> int:
        """How far the live state got: +1 per applied optimizer step and per commit (see :mod:`state.recovery`)."""
        version, commits, applied = self._base
        return version + (self._commits - commits) + (self._applied() - applied)

    def _rebase(self, version: int) -> None:
        object.__setattr__(self, "_base", (version, self._commits, self._applied()))

    # ------------------------------------------------------------ commit / restore
    def _save(self) -> None:
        object.__setattr__(self, "_snapshot", {n: h.snapshot() for n, h in self._handlers.items()})

    def commit(self) -> None:
        """Snapshot the state, persist it if due, and check for a membership change."""
        with timeline.span("commit", "state", commit=self._commits + 1):
            self._take_commit()
            self._maybe_persist()
            self._check_notices(just_committed=True)

    def _take_commit(self) -> None:
        """Snapshot the state as the next commit (local)."""
        self._save()
        object.__setattr__(self, "_commits", self._commits + 1)
        object.__setattr__(self, "_commit_version", self.version)
        object.__setattr__(self, "_commit_round", er.round_id() if er.is_initialized() else 0)

    @property
    def commit_order(self) -> StateOrder:
        """Where the last commit stands in the job's history: (lineage, round, version); a durable checkpoint of it
        carries this order, and the newest checkpoint is the one with the newest order (``policy.order_key``)."""
        return StateOrder(self._lineage, self._commit_round, self._commit_version)

    def check_membership(self) -> None:
        """One small collective: raise :class:`MembershipChanged` on every rank if any rank has a
        pending change, or :class:`TrainingStopped` if the job must stop; when a durable write is asked, the
        live state is committed first (every rank agreed on it: commit counts stay equal) and written."""
        self._check_notices(just_committed=False)

    def _check_notices(self, just_committed: bool) -> None:
        changed, persist, stop, persist_id = self._agree_notices()
        if changed or stop or persist:
            if (persist or stop) and not just_committed:
                self._take_commit()  # the write holds the live state, as the driver's number says
            self._act_on_notices(changed, persist, stop, persist_id)

    def _agree_notices(self) -> tuple[int, int, int, int]:
        """The one collective in which every rank learns the notices of any rank: (changed, persist, stop, and
        the driver's number of the persist it asked for: a rank whose own notice has not arrived yet still tags
        the write with it)."""
        if not er.is_initialized():
            return 0, 0, 0, 0
        notice = membership.pending()
        try:
            changed, persist, stop, persist_id = er.agree_max(
                "State.commit", [int(notice.change), int(notice.persist), int(notice.stop), notice.persist_id])
        except er.CommError as exc:
            exc.live_state_consistent = True  # the commit is complete: the state is whole
            raise
        return changed, persist, stop, persist_id

    def _act_on_notices(self, changed: int, persist: int, stop: int, persist_id: int = 0) -> None:
        """Consume the notices and write the last commit durably if asked; then raise on every rank, unless the
        notice asked for the write alone (the driver's just-in-time write before a preemption deadline: the ring
        trains on). A driver's write (a drain's) goes to the writer without waiting for it: the ring re-forms at
        once, and the leaving rank 0 flushes it before it leaves."""
        persist_by = membership.persist_by()
        membership.clear_membership_change(persist_id)
        if stop:
            self._persist_for_stop()
            raise TrainingStopped("the job was asked to stop; this commit is the last")
        if persist:
            self._persist_asked(persist_id, persist_by)
        if changed:
            raise er.MembershipChanged("the ring's membership changes at this commit")

    @property
    def committed(self) -> bool:
        """True once this process holds a commit (its own, or one received by ``sync``)."""
        return self._snapshot is not None

    def restore(self) -> None:
        """Put back the last commit (local; no communication)."""
        with timeline.span("restore", "state"):
            if self._snapshot is None:
                raise RuntimeError("restore() before any commit or sync: there is nothing to restore to")
            for name, handler in self._handlers.items():
                handler.restore(self._snapshot[name])
            self._clear_grads()
            self._rebase(self._commit_version)

    def on_failure(self, exc: BaseException) -> None:
        """A collective failed: note whether this rank's live state is whole. The next :meth:`sync`
        decides, with every rank, whether the ring continues from a live state or rolls back."""
        if self._holds and self._trust == CONSISTENT:  # the first failure since the last sync tells
            trust = failure_trust(self.step_linked, bool(getattr(exc, "live_state_consistent", False)),
                                  bool(getattr(exc, "inside_apply", False)))
            object.__setattr__(self, "_trust", trust)
            if trust == DIRTY:
                _log.warning("a collective failed where this rank's live state may be half-updated (%s); the ring "
                             "continues from a whole one, or rolls back to the last commit",
                             "inside the optimizer's own step" if getattr(exc, "inside_apply", False) else
                             "a collective of the training function, and its batch bookkeeping is not linked to a "
                             "DistributedOptimizer")

    def _clear_grads(self) -> None:
        """Gradients of a step that did not complete must not leak into the next one."""
        for handler in self._handlers.values():
            if isinstance(handler.value, torch.nn.Module):
                for p in handler.value.parameters():
                    p.grad = None

    # ------------------------------------------------------------ sync / reset
    def _statuses(self) -> list[RankStatus]:
        mine = RankStatus(self._holds, self._trust, self.version, self._commit_version)
        rows = er.allgather(torch.tensor([mine.as_row()], dtype=torch.int64), name="State.sync status")
        return [RankStatus.from_row(row) for row in rows.tolist()]

    def sync(self, root_rank: int | None = None) -> None:
        """Give every rank the job's state: the newest whole live state, the newest commit, or (on a job's
        first sync) the initial or resumed state; ``root_rank`` forces the root. Then commit locally."""
        with timeline.span("sync", "state"):
            self._relink()
            self._fit_samplers()
            statuses = self._statuses()
            if root_rank is None:
                decision = decide_sync(statuses)
            else:
                decision = SyncDecision(root_rank, Mode.LIVE if statuses[root_rank].holds else Mode.FRESH)
            root = decision.root
            timeline.instant("sync_decision", "state", mode=decision.mode.value, root=root)
            if er.rank() == root:
                if decision.mode is Mode.ROLLBACK:
                    self.restore()
                elif decision.mode is Mode.FRESH and self._checkpoint is not None:
                    self._resume()
            names, lineage = er.broadcast_object((self.names, self._lineage), root, name="State.sync names")
            object.__setattr__(self, "_lineage", lineage)
            if names != self.names:
                raise ValueError(f"rank {er.rank()} holds state values {self.names}, root holds {names}; "
                                 "build the same TorchState on every rank")
            tree = er.broadcast_tree({n: h.to_tree() for n, h in self._handlers.items()} if er.rank() == root else None,
                                     root, name="State.sync")
            if er.rank() != root:
                for name, handler in self._handlers.items():
                    handler.load_tree(tree[name])
            self._clear_grads()  # gradients are never state: a step in flight is redone from scratch
            status = statuses[root]
            version = {Mode.LIVE: status.version, Mode.ROLLBACK: status.commit_version, Mode.FRESH: 0}[decision.mode]
            for handler in self._handlers.values():  # every rank's optimizer now counts from the same step id
                if isinstance(handler, OptimizerHandler) and hasattr(handler.value, "_set_applied_steps"):
                    handler.value._set_applied_steps(version)
            self._rebase(version)
            object.__setattr__(self, "_holds", True)
            object.__setattr__(self, "_trust", CONSISTENT)
            self._save()
            object.__setattr__(self, "_commit_version", version)
            object.__setattr__(self, "_commit_round", er.round_id())
            if decision.mode is not Mode.FRESH and (decision.mode is Mode.ROLLBACK or statuses != [status] * len(statuses)):
                _log.info("synced from rank %d (%s state, version %d)", root, decision.mode.value, version)

    def _fit_samplers(self) -> None:
        """Cut every sampler for the current ring. A re-form does it in on_reset; this catches a sampler built
        before the ring existed (a ring formed lazily by ``er.size()`` before ``@er.elastic.run``)."""
        if not er.is_initialized():
            return
        rank, world = er.rank(), er.size()
        for handler in self._handlers.values():
            sampler = handler.value
            if isinstance(sampler, _POSITIONS) and (sampler._rank, sampler._world) != (rank, world):
                sampler.reset(rank, world)  # a linked sampler's re-partition sizes the optimizer's next step

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Callbacks run after every re-forming of the ring (e.g. rescale the LR to the new size)."""
        for cb in callbacks:
            if not callable(cb):
                raise TypeError(f"reset callback {cb!r} is not callable")
            self._reset_callbacks.append(cb)

    def on_reset(self) -> None:
        """Called by the elastic loop after the ring is re-formed."""
        for handler in self._handlers.values():
            if isinstance(handler.value, _POSITIONS):
                handler.value.reset()  # a linked sampler's re-partition sizes the optimizer's next step
        for cb in self._reset_callbacks:
            cb()
