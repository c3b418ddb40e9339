"""Every error ``ray_integration`` raises to its users, under one root, :class:`RayIntegrationError`.

``except ray_integration.RayIntegrationError`` catches any of them. Each keeps the base it had before
(``RuntimeError`` for the trainer's, ``RuntimeError`` and :class:`elastic_ring.CommError` for Horovod's), so
code that catches those still does. This module imports nothing of ray_integration: every sub-package may
import it.

* :class:`RunFailed`: ``ElasticTrainer.run`` ended without a result; the message says why and what to change.
* :class:`WorkerError`: ``fn`` raised on a worker (or the worker could not run it), with the remote traceback.
* :class:`HorovodInternalError`: Horovod's ``hvd.HorovodInternalError``, a failed collective of ``hvd``.
* :class:`WorkerGaveUp` is internal: a worker tells the driver, through Ray, that it lost the job's rendezvous
  for good (the driver counts it as a lost worker and replaces it); users never see it.
* :class:`InputUnavailable` (a :class:`WorkerGaveUp`): something a worker reads from outside the ring (a Ray Data
  block, the run's checkpoints) could not be read after its retries: the worker leaves as a lost worker, with the
  cause in its ``worker_lost`` event, and is replaced; the ring goes on from its live state.
"""

from __future__ import annotations

import elastic_ring as er


class RayIntegrationError(Exception):
    """The root of ray_integration's errors."""


class RunFailed(RayIntegrationError, RuntimeError):
    """The job ended without a result; the message says why and what to change."""


class WorkerError(RayIntegrationError, RuntimeError):
    """``fn`` raised on a worker (or the worker could not run it): carries the rank, the node, the remote
    traceback and, as ``cause``, the exception ``fn`` raised itself (None when it could not be pickled, or when
    the worker failed outside ``fn``)."""

    def __init__(self, worker_id: str, rank: int | None, node_id: str, hostname: str, tb: str,
                 what: str = "fn raised", cause: BaseException | None = None) -> None:
        self.worker_id, self.rank, self.node_id, self.hostname, self.remote_traceback = worker_id, rank, node_id, hostname, tb
        self.what, self.cause = what, cause
        super().__init__(f"{what} on rank {rank} (worker {worker_id}, node {node_id[:12]} {hostname}):\n{tb}")

    def __reduce__(self):
        # the cause travels as bytes of its own: the error itself must always unpickle on the driver, also when the
        # cause cannot be pickled (it holds a lock) or its class cannot be imported there (a library only the
        # workers have); then ``cause`` is None and the traceback says what it was
        return (_rebuild_worker_error, (self.worker_id, self.rank, self.node_id, self.hostname, self.remote_traceback,
                                        self.what, _dump(self.cause)))


def _dump(cause: BaseException | None) -> bytes | None:
    if cause is None:
        return None
    import ray.cloudpickle

    try:
        return ray.cloudpickle.dumps(cause)
    except Exception:  # any pickling failure: the cause stays behind, the error goes
        return None


def _rebuild_worker_error(worker_id: str, rank: int | None, node_id: str, hostname: str, tb: str, what: str,
                          cause: bytes | None) -> "WorkerError":
    loaded = None
    if cause is not None:
        import ray.cloudpickle

        try:  # (these bytes came inside Ray's own result, which Ray unpickled already: no new trust boundary)
            loaded = ray.cloudpickle.loads(cause)
        except Exception:  # its class is not importable here, or it cannot be rebuilt: left out
            loaded = None
    return WorkerError(worker_id, rank, node_id, hostname, tb, what, loaded)


class WorkerGaveUp(RayIntegrationError, RuntimeError):
    """This worker lost its rendezvous with the driver or its store connection for good: the driver counts
    it as a lost worker and replaces it (a store blip at one worker never ends the job)."""


class InputUnavailable(WorkerGaveUp):
    """A worker could not read an input from outside the ring (a Ray Data block whose object is lost, the run's
    checkpoint location) after retrying: a fault of that input, not of ``fn`` nor of the job. Raised inside ``fn``,
    it makes the worker a lost worker (its ``worker_lost`` event names the cause) that the driver replaces, as for a
    lost node; the ring re-forms without it from the live state."""


class HorovodInternalError(RayIntegrationError, er.CommError, RuntimeError):
    """Horovod's ``HorovodInternalError``: a collective failed (a lost peer, a timeout, a broken connection).

    A ``RuntimeError``, as Horovod's, so ``except RuntimeError`` in a Horovod script catches it; and an
    :class:`elastic_ring.CommError`, so the elastic loop rolls back and re-forms as for any failed collective.
    Every call of ``ray_integration.horovod`` (collectives, ``synchronize``, ``broadcast_parameters``, the
    ``DistributedOptimizer``'s ``step`` / ``synchronize`` and its bucket launches inside ``loss.backward()``)
    raises it in place of a ``CommError``; the state's
    own methods (``state.commit()``, ``state.sync()``) raise the plain ``elastic_ring.CommError``, its base
    class (``except er.CommError`` catches both). A membership change stays a separate exception
    (``hvd.HostsUpdatedInterrupt``, elastic_ring's ``MembershipChanged``), as in Horovod."""


__all__ = ["HorovodInternalError", "InputUnavailable", "RayIntegrationError", "RunFailed", "WorkerError",
           "WorkerGaveUp"]
