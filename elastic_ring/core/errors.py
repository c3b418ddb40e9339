"""Exception types of elastic_ring.

Two of them drive the elastic loop, Horovod-style:

* :class:`CommError` -- a collective failed (a peer died, a timeout, a broken
  connection). The ring is unusable; the elastic loop re-forms it, and the next
  sync chooses between continuing from the newest *whole live state* of a
  survivor (no rollback: at most the step in flight is redone) and *rolling
  back* to the last commit, when no survivor's live state can be trusted (see
  docs/architecture.md's failure model).
* :class:`MembershipChanged` -- the membership changes at a commit or a step
  boundary (a worker joins or leaves gracefully). The state is whole; the
  elastic loop re-forms the ring *without* rolling back.

:class:`RingStopped` ends this process's part quietly; the others are errors
that a new ring would not fix. The packages built on elastic_ring derive their
own root errors from :class:`ElasticRingError`.
"""

from __future__ import annotations


class ElasticRingError(Exception):
    """Base class of every error raised by elastic_ring (and of the root errors of the packages built on it)."""


class CommError(ElasticRingError):
    """A collective failed: a peer was lost, a connection broke, or it timed out.

    Raised on every surviving rank. The communicator is aborted; form a new
    round with :func:`elastic_ring.init` (the elastic loop does this for you).

    ``live_state_consistent`` is True when the failure surfaced where this rank's
    training state is whole: inside DistributedOptimizer's gradient reduction
    (before the update is applied), a commit's agreement, a sync or a re-form.
    The elastic loop then continues from the live state instead of rolling back.
    A failure in any other collective (the user's own) leaves it False.
    """

    live_state_consistent: bool = False


class MembershipChanged(ElasticRingError):
    """The ring's membership changes at this commit; re-form without rolling back."""


class TensorMismatchError(ElasticRingError, ValueError, RuntimeError):
    """Ranks passed tensors of different shapes, dtypes or counts to one collective.

    Raised on every rank with the same message, which names the tensor and what
    each rank passed. Fix the training script so that all ranks agree. It is a
    ``ValueError`` and, as Horovod's mismatch errors, a ``RuntimeError``, so
    ``except RuntimeError`` written for Horovod catches it.
    """


class NotInitializedError(ElasticRingError, RuntimeError):
    """A collective was called before a ring was formed."""


class AuthenticationError(ElasticRingError):
    """A value read from the rendezvous store, or a payload received from a peer, failed
    authentication (its HMAC does not match the job's secret): someone who is not part of
    the job wrote it, or it was damaged in transit. It is never deserialized. The message
    names the key or the collective."""


class RendezvousError(ElasticRingError):
    """The next ring could not be obtained from the rendezvous (it timed out, the store became
    unreachable, or its answer was invalid). The elastic loop does not retry it: the job ends
    with this error, which says what the rendezvous reported."""


class RingStopped(ElasticRingError):
    """The rendezvous ended this process's part in the job (it is not in the next ring, or the job
    is over). Not an error: the elastic loop lets it through and the process's run ends quietly."""
