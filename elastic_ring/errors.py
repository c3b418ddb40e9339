"""Exception types of elastic_ring.

Two of them drive the elastic loop, Horovod-style:

* :class:`CommError` -- a collective failed (a peer died, a timeout, a broken
  connection). The ring is unusable; the elastic loop *rolls back* to the last
  commit, re-forms the ring and carries on.
* :class:`MembershipChanged` -- the membership changed at a commit (a worker
  joins or leaves gracefully). The state is consistent; the elastic loop
  re-forms the ring *without* rolling back.

The others are user errors that a new ring would not fix.
"""

from __future__ import annotations


class ElasticRingError(Exception):
    """Base class of every error raised by elastic_ring."""


class CommError(ElasticRingError):
    """A collective failed: a peer was lost, a connection broke, or it timed out.

    Raised on every surviving rank. The communicator is aborted; form a new
    round with :func:`elastic_ring.init` (the elastic loop does this for you).
    """


class MembershipChanged(ElasticRingError):
    """The ring's membership changes at this commit; re-form without rolling back."""


class TensorMismatchError(ElasticRingError, ValueError):
    """Ranks passed tensors of different shapes, dtypes or counts to one collective.

    Raised on every rank with the same message, which names the tensor and what
    each rank passed. Fix the training script so that all ranks agree.
    """


class NotInitializedError(ElasticRingError, RuntimeError):
    """A collective was called before a ring was formed."""
