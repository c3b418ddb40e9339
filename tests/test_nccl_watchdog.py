"""The NCCL watchdog's logic on CPU: fake communicators and fake events, a fake clock for the decisions,
and the real thread for "a blocked wait returns once the watchdog aborts"."""

import threading
import time

import pytest

import elastic_ring as er
from elastic_ring.backends.nccl.watchdog import Watchdog


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class FakeComm:
    """A communicator whose abort completes its in-flight 'events' (like NCCL kernels exiting)."""

    def __init__(self, name="rank 0/2 round 5", async_error=None, abort_raises=None):
        self.identity = name
        self.error = async_error
        self.failures = []
        self.aborted = threading.Event()
        self.abort_raises = abort_raises

    def async_error(self):
        if isinstance(self.error, BaseException):
            raise self.error
        return self.error

    def watchdog_failed(self, error):
        self.failures.append(error)
        self.aborted.set()
        if self.abort_raises is not None:
            raise self.abort_raises


class FakeEvent:
    def __init__(self, comm, done=False):
        self.comm, self.done = comm, done

    def query(self):
        return self.done or self.comm.aborted.is_set()


def test_finished_operations_are_forgotten_without_failing_anyone():
    clock, comm = FakeClock(), FakeComm()
    dog = Watchdog(clock=clock)
    event = FakeEvent(comm)
    dog.watch(comm, "allreduce", event.query, timeout_s=5)
    dog.poll_once()
    assert dog.pending(comm) == 1
    event.done = True
    clock.now += 100  # long past the deadline, but done: not a failure
    dog.poll_once()
    assert dog.pending() == 0 and comm.failures == []


def test_a_missed_deadline_fails_the_communicator_once_naming_the_op_and_the_deadline():
    clock, comm = FakeClock(), FakeComm()
    dog = Watchdog(clock=clock)
    for op in ("allreduce", "broadcast"):
        dog.watch(comm, op, FakeEvent(comm).query, timeout_s=5)
    clock.now += 5.0
    dog.poll_once()
    assert comm.failures == []  # at the deadline, not past it
    clock.now += 0.25
    dog.poll_once()
    assert len(comm.failures) == 1
    message = str(comm.failures[0])
    assert isinstance(comm.failures[0], er.CommError)
    assert message.startswith("[rank 0/2 round 5] NCCL allreduce did not finish within collective_timeout_s=5 "
                              "(deadline passed 0.25 s ago)")
    assert "the watchdog aborted the communicator" in message
    assert dog.pending() == 0  # every operation of the failed communicator is dropped
    dog.poll_once()
    assert len(comm.failures) == 1


def test_an_async_nccl_error_fails_before_the_deadline():
    clock, comm = FakeClock(), FakeComm()
    dog = Watchdog(clock=clock)
    dog.watch(comm, "allgather", FakeEvent(comm).query, timeout_s=60)
    dog.poll_once()
    assert comm.failures == []
    comm.error = "ncclRemoteError: peer 1 closed the connection"
    dog.poll_once()
    assert [str(e) for e in comm.failures] == [
        "[rank 0/2 round 5] NCCL allgather failed: NCCL reported an asynchronous error (ncclRemoteError: peer 1 "
        "closed the connection); a peer is probably lost; the watchdog aborted the communicator"]


def test_probes_that_raise_fail_the_communicator_with_the_exception():
    clock, comm = FakeClock(), FakeComm()
    dog = Watchdog(clock=clock)

    def broken_event():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    dog.watch(comm, "broadcast", broken_event, timeout_s=60)
    dog.poll_once()
    assert str(comm.failures[0]) == ("[rank 0/2 round 5] NCCL broadcast failed while the watchdog checked it: "
                                     "RuntimeError: CUDA error: an illegal memory access was encountered")
    other = FakeComm("rank 1/2 round 5", async_error=OSError("handle gone"))
    dog.watch(other, "allreduce", FakeEvent(other).query, timeout_s=60)
    dog.poll_once()
    assert "OSError: handle gone" in str(other.failures[0])


def test_only_the_late_communicator_fails():
    clock = FakeClock()
    late, healthy = FakeComm("late"), FakeComm("healthy")
    dog = Watchdog(clock=clock)
    dog.watch(late, "allreduce", FakeEvent(late).query, timeout_s=1)
    dog.watch(healthy, "allreduce", FakeEvent(healthy).query, timeout_s=10)
    clock.now += 2
    dog.poll_once()
    assert len(late.failures) == 1 and healthy.failures == [] and dog.pending(healthy) == 1


def test_an_abort_that_raises_is_kept_and_the_others_are_still_served():
    clock = FakeClock()
    bad, good = FakeComm("bad", abort_raises=RuntimeError("abort blew up")), FakeComm("good")
    dog = Watchdog(clock=clock)
    dog.watch(bad, "allreduce", FakeEvent(bad).query, timeout_s=1)
    dog.watch(good, "allreduce", FakeEvent(good).query, timeout_s=1)
    clock.now += 2
    dog.poll_once()
    assert len(bad.failures) == 1 and len(good.failures) == 1
    assert [str(e) for e in dog.errors] == ["abort blew up"]


def test_forget_drops_a_communicators_operations():
    clock, comm = FakeClock(), FakeComm()
    dog = Watchdog(clock=clock)
    dog.watch(comm, "allreduce", FakeEvent(comm).query, timeout_s=1)
    dog.forget(comm)
    clock.now += 10
    dog.poll_once()
    assert comm.failures == [] and dog.pending() == 0


def test_the_thread_aborts_a_hung_collective_and_the_blocked_wait_returns():
    comm = FakeComm()
    dog = Watchdog(interval_s=0.01)
    dog.ensure_running()
    try:
        event = FakeEvent(comm)
        started = time.monotonic()
        dog.watch(comm, "allreduce", event.query, timeout_s=0.3)
        # the "calling thread": blocked like event.synchronize() until the collective ends or is aborted
        assert comm.aborted.wait(5.0), "the watchdog never aborted"
        elapsed = time.monotonic() - started
        assert 0.3 <= elapsed < 1.5, elapsed
        assert "did not finish within collective_timeout_s=0.3" in str(comm.failures[0])
    finally:
        dog.stop()


def test_a_dead_watchdog_thread_fails_everything_it_watched_and_refuses_new_work():
    class Crashing(Watchdog):
        def poll_once(self):
            raise ValueError("bug in the watchdog")

    comm = FakeComm()
    dog = Crashing(interval_s=0.01)
    dog.watch(comm, "allreduce", FakeEvent(comm).query, timeout_s=60)
    dog.ensure_running()
    assert comm.aborted.wait(5.0), "a dead watchdog left a wait hanging"
    assert "the NCCL watchdog thread died (ValueError('bug in the watchdog'))" in str(comm.failures[0])
    assert isinstance(dog.crash, ValueError)
    with pytest.raises(er.CommError, match="watchdog thread died earlier"):
        dog.watch(FakeComm(), "allreduce", lambda: False, timeout_s=1)
    with pytest.raises(er.CommError, match="died earlier"):
        dog.ensure_running()


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match=r"interval_s=0 must be > 0"):
        Watchdog(interval_s=0)
