"""The drop-in's worker side: a Ray Train training function run as Ray Train v2 runs it, in processes that survive.

``TorchTrainer.fit()`` (``ray_integration.train.torch``) hands every worker :func:`run_training_function`. It runs
the user's ``train_loop_per_worker`` inside an elastic loop (``@er.elastic.run``) whose state is this module's
:class:`Session`:

* **A failure re-enters the function.** A peer lost (a collective raises ``CommError``) makes the survivors re-form
  the ring in their own processes and call the function again from the top, as Ray Train v2 calls it again after a
  restart of every worker. An exception of the function itself does the same while ``FailureConfig(max_failures)``
  allows (Ray counts both kinds against it); past that budget, or with Ray's default ``max_failures=0``, it ends the
  run (``fit()`` raises ``ray.train.WorkerGroupError``).
* **``get_checkpoint()`` after a re-entry** is the newest reported checkpoint, from this process's own copy
  (:mod:`._held`) or, for a rank without one (a joiner, a rank that reported ``checkpoint=None``), sent over the ring
  by a rank that holds it: no download. When no rank of the new ring holds it (it was only on lost ranks), it is the
  newest verified checkpoint in the run's storage (rank 0's uploads), the same on every rank.
* **``report()`` is the membership-change point.** Each report is one small collective (as Ray's is a barrier):
  every rank learns whether a checkpoint was reported and whether the driver asked for a change. A joiner (or a
  replacement) enters at the next report that carries a checkpoint: every rank re-enters the function, which resumes
  from that checkpoint. A stop or a drain acts at the next report.

The agreement that decides which checkpoint each rank resumes from runs right after every new ring forms
(:func:`elastic_ring.ring.elastic.add_reform_listener`), in whichever loop formed it: a script that runs its own
``@er.elastic.run`` loop with a ``TorchState`` inside the function (step-exact recovery) keeps it, and a joiner
entering the function meets the survivors at the same collectives.
"""

from __future__ import annotations

import inspect
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import elastic_ring as er
import state as state_pkg
from elastic_ring.core.log import get_logger
from elastic_ring.ring import elastic
from state import TrainingStopped, membership
from state.checkpoints.config import default_checkpointing
from state.checkpoints.reported import ReportedCheckpoints

from ._checkpoint import _fetch_reported, ray_checkpoint_class
from ._checkpoint import get_checkpoint as _storage_checkpoint
from ._held import HeldCheckpoints, share

_log = get_logger(__name__)

#: Ray's words when one of its own ``ray.train`` calls runs outside a Ray Train worker.
_RAY_OUTSIDE = "cannot be used outside of a Ray Train training function"
#: Seconds a stop or a drain waits for rank 0's uploads at a report before the worker leaves.
FLUSH_AT_STOP_S = 300.0


@dataclass(frozen=True)
class Options:
    """What the driver's ``TorchTrainer`` tells every worker."""

    takes_config: bool          # train_loop_per_worker takes the config (one parameter) or nothing
    max_failures: int           # FailureConfig(max_failures): exceptions of the function re-enter it this often
    max_workers: int            # the most workers the job may have (prepare_model wraps when > 1)


def takes_config(fn: Callable[..., Any]) -> bool:
    """Ray Train's rule: ``train_loop_per_worker`` takes no required parameter, or one (the config)."""
    if not callable(fn):
        raise TypeError(f"TorchTrainer train_loop_per_worker must be a function, got {type(fn).__name__}")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) > 1:
        raise ValueError(f"TorchTrainer train_loop_per_worker {getattr(fn, '__name__', fn)!r} takes "
                         f"{len(required)} required arguments ({', '.join(p.name for p in required)}); it must take "
                         "none, or one (the train_loop_config dict)")
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    return bool(required) or bool(positional)


_lock = threading.Lock()
_session: "Session | None" = None


def current() -> "Session | None":
    """The drop-in session of this process (None outside ``TorchTrainer.fit()``'s workers)."""
    return _session


class Session:
    """One worker's part in a drop-in run: its checkpoints, its report count, its failures (module docstring)."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.held = HeldCheckpoints()
        self.newest = -1            # the newest report number at which some rank passed a checkpoint
        self.reports = 0            # reports made so far (every rank the same; carried across re-entries)
        self.failures = 0           # failures of the run so far, as Ray counts them (one per failed ring)
        self.entering = True        # the training function is not running on this rank (it enters next)
        self.all_entering = True    # every rank of the current ring enters the function (no inner loop runs)
        self.warned_no_checkpoint = False  # a joiner waited at a report without a checkpoint (warned once)
        self.checkpoint: Any = None  # what get_checkpoint() returns now

    # ---------------------------------------------------------------- after every new ring
    def on_reform(self, reason: str) -> None:
        """Agree, on the new ring, on the report count, the failures and the checkpoint each entering rank
        resumes from; send it to those that lack it (module docstring)."""
        row = (self.held.index, self.newest, int(self.entering), self.failures, int(reason == "failure"),
               self.reports)
        rows = er.allgather_object(row, name="ray_integration.train resume")
        held, newest, entering, failures, failed, reports = (list(column) for column in zip(*rows))
        self.failures = max(failures) + (1 if any(failed) else 0)
        self.reports, self.newest = max(reports), max(newest)
        self.all_entering = all(entering)
        if not any(entering):
            return
        holders = [r for r, index in enumerate(held) if index == self.newest and index >= 0]
        needs = [r for r in range(len(rows)) if entering[r] and held[r] != self.newest]
        me = er.rank()
        if self.newest >= 0 and holders:
            if needs:
                target = self.held.new_directory(self.newest) if me in needs else None
                share(holders[0], self.held.directory if me == holders[0] else None, target)
                if target is not None:
                    self.held.hold(target, self.newest)
            if entering[me]:
                self._hand_out(self.held.directory)
            return
        if needs or self.newest < 0:  # nobody holds it (a fresh run, or it was only on lost ranks): the storage's
            self._from_storage(entering[me])

    def _from_storage(self, entering: bool) -> None:
        """Every entering rank resumes from the newest verified checkpoint at the run's location (the same one:
        rank 0 chooses it), or from nothing."""
        config = default_checkpointing()
        seq = None
        if er.rank() == 0 and config is not None:
            complete = ReportedCheckpoints(config.uri, signing_key=config.signing_key).complete()
            seq = complete[-1] if complete else None
        seq = er.broadcast_object(seq, 0, name="ray_integration.train resume from storage")
        if not entering:
            return
        if seq is None:
            self._hand_out(None)
            return
        found = _fetch_reported(config.uri, config.signing_key, seq, cache=True)
        if found is None:  # pruned (num_to_keep) between rank 0's choice and this read: a lost worker, replaced
            raise state_pkg.CheckpointError(
                f"reported checkpoint {seq} at {config.uri}, chosen to resume from, was gone when this rank read it "
                "(pruned meanwhile?): keep more reported checkpoints (CheckpointConfig(num_to_keep=...)) if this recurs")
        self._hand_out(found[1])
        if self.newest >= 0:
            _log.warning("the newest reported checkpoint (report %d) was held only by lost workers; resuming from "
                         "the newest one in storage (%s)", self.newest, found[1])

    def _hand_out(self, directory: str | None) -> None:
        self.held.pin(directory)
        self.checkpoint = None if directory is None else ray_checkpoint_class().from_directory(directory)

    # ---------------------------------------------------------------- report
    def report(self, directory: str | None) -> tuple[bool, tuple[int, int, int]]:
        """The report's collective. A copy of ``directory`` (this rank's checkpoint, if any) is made first and held
        once every rank agreed (as Ray registers a checkpoint once every rank reported). Returns whether some rank
        reported a checkpoint, and the driver's notices agreed on: (change, persist, stop)."""
        index = self.reports + 1
        copy = self.held.copy_in(directory, index) if directory is not None else None
        notice = membership.pending()
        try:
            has, change, persist, stop = er.agree_max("ray_integration.train.report", [
                int(copy is not None), int(notice.change), int(notice.persist), int(notice.stop)])
        except er.CommError as exc:
            self.held.discard(copy)
            exc.live_state_consistent = True  # between two steps: a state of the script's own is whole
            raise
        self.reports = index
        if has:
            self.newest = index
        if copy is not None:
            self.held.hold(copy, index)
            self._hand_out(copy)  # Ray: within an attempt, get_checkpoint() is this worker's latest checkpoint
        return bool(has), (change, persist, stop)

    def act_on_notices(self, has_checkpoint: bool, notices: tuple[int, int, int]) -> None:
        """After the report's collective: leave for a stop, re-form for a drain, or for a join at a report that
        carried a checkpoint (every rank resumes from it); else go on."""
        change, persist, stop = notices
        if change and not (stop or persist or has_checkpoint) and not self.warned_no_checkpoint:
            self.warned_no_checkpoint = True  # once per process: the joiner waits for a report with a checkpoint
            _log.warning("a worker waits to join the ring, but this report carries no checkpoint: joiners and "
                         "replacements enter only at a report with a checkpoint (every rank resumes from it); "
                         "report(metrics, checkpoint=...) now and then, or the run stays at its current size")
        if not (stop or persist or (change and has_checkpoint)):
            return
        membership.clear_membership_change()
        if stop or persist:
            try:
                state_pkg.flush_checkpoints(FLUSH_AT_STOP_S)
            except state_pkg.CheckpointError as exc:
                _log.error("the upload of the last reported checkpoint failed before %s: %s",
                           "the stop" if stop else "the drain", exc)
        if stop:
            raise TrainingStopped("the job was asked to stop; the last report is the last")
        raise er.MembershipChanged("the ring's membership changes at this report: every worker re-enters the "
                                   "training function from its newest checkpoint")

    def close(self) -> None:
        self.held.close()


class _Entry:
    """The elastic loop's state: the agreement runs in :meth:`Session.on_reform`, so the loop's own calls have
    nothing to do; a stop right at a re-form leaves at once (the last reported checkpoint is already durable)."""

    committed = True

    def __init__(self, session: Session) -> None:
        self.session = session

    def sync(self) -> None:
        pass

    def restore(self) -> None:
        pass

    def on_reset(self) -> None:
        pass

    def on_failure(self, exc: BaseException) -> None:
        pass

    def commit(self) -> None:
        state_pkg.flush_checkpoints(FLUSH_AT_STOP_S)
        raise TrainingStopped("the job was asked to stop while the ring re-formed")


def run_training_function(fn: Callable[..., Any], options: Options, config: dict) -> Any:
    """Run Ray Train's ``train_loop_per_worker`` on this worker until it returns (module docstring)."""
    global _session
    session = Session(options)
    with _lock:
        if _session is not None:
            raise RuntimeError("a drop-in training function is already running in this process")
        _session = session
    elastic.add_reform_listener(session.on_reform)
    try:
        _warm_up()

        @er.elastic.run
        def attempt(entry: _Entry) -> Any:
            return _enter(session, fn, config)

        return attempt(_Entry(session))
    finally:
        elastic.remove_reform_listener(session.on_reform)
        with _lock:
            _session = None
        session.close()


def _warm_up() -> None:
    """Before the first ring is asked for: import ``ray.train`` (its ``Checkpoint``, which get_checkpoint() returns:
    pandas and pyarrow take a second or more to import) and run one tiny forward, backward and optimizer step (a
    fresh process's first autograd pass loads libraries for seconds on a busy machine). Paid here, not while the
    ring waits for this worker at a re-entry or a join."""
    import torch

    ray_checkpoint_class()
    layer = torch.nn.Linear(1, 1)
    layer(torch.ones(1, 1)).sum().backward()
    torch.optim.SGD(layer.parameters(), lr=0.0).step()


def _enter(session: Session, fn: Callable[..., Any], config: dict) -> Any:
    session.entering = False
    try:
        return fn(config) if session.options.takes_config else fn()
    except (er.CommError, er.MembershipChanged):
        session.entering = True
        raise
    except (er.RingStopped, TrainingStopped):
        raise
    except Exception as exc:
        session.entering = True
        if isinstance(exc, RuntimeError) and _RAY_OUTSIDE in str(exc):
            raise RuntimeError(
                f"{exc}\nThis training function runs under ray_integration.train's TorchTrainer, but it called Ray "
                "Train's own `ray.train` (or `ray.train.torch`), which works only inside Ray Train's workers. Import "
                "ray_integration.train instead: `import ray_integration.train as train` for `train.X`, or `import "
                "ray_integration as ray` for a script that writes `ray.train.X` and uses nothing else of `ray` "
                "(docs/ray_train.md, 'Scripts that name ray.train')") from exc
        k = session.options.max_failures
        if k == -1 or session.failures + 1 <= k:
            _log.warning("the training function raised on rank %d; every worker re-enters it from the newest "
                         "checkpoint (failure %d of FailureConfig(max_failures=%s)):\n%s", er.rank(),
                         session.failures + 1, k, traceback.format_exc())
            raise er.CommError(f"the training function raised {type(exc).__name__}: {exc} on rank {er.rank()}; "
                               "every worker re-enters it (FailureConfig(max_failures))") from exc
        raise


def get_checkpoint() -> Any:
    """Ray Train's ``get_checkpoint()``: under the drop-in's ``TorchTrainer``, the checkpoint this worker resumes from
    (the newest reported one when the function was entered, from this process's copy or a peer's; then this
    worker's own latest report), or None; elsewhere (``ElasticTrainer``), the newest verified reported checkpoint at
    the run's location, downloaded (:func:`._checkpoint.get_checkpoint`)."""
    session = _session
    if session is not None:
        return session.checkpoint
    return _storage_checkpoint()
