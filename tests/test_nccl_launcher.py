"""The NCCL bucket paths' CUDA-free parts on CPU: the FIFO launcher thread (order, one job at a time, drains,
failures, stop), the communicator's use of it (another collective waits for queued buckets; close and abort stop it; a
failed launch fails the communicator), one watchdog entry per step (OrderedWatch), and the option's
validation. The CUDA parts run in tests/gpu/test_gpu_bucket_paths.py."""

import contextlib
import subprocess
import sys
import threading
import time

import pytest
import torch

import elastic_ring as er
from elastic_ring.backends.base import BucketPath
from elastic_ring.backends.nccl import handle as nccl_handle
from elastic_ring.backends.nccl.communicator import NcclCommunicator
from elastic_ring.backends.nccl.launcher import Launcher, LauncherFailed
from elastic_ring.backends.nccl.lib import IN_PROGRESS, SUCCESS, NcclError
from elastic_ring.backends.nccl.watchdog import OrderedWatch, Watchdog
from tests.test_nccl import FakeLib
from tests.test_nccl_teardown import make_comm
from tests.test_nccl_watchdog import FakeClock, FakeComm


def _launcher(log, fail_on=None, delay_s=0.0):
    def run(job):
        if delay_s:
            time.sleep(delay_s)
        if job == fail_on:
            raise NcclError("allreduce", 6, "peer 1 closed the connection")
        log.append(job)

    errors = []
    return Launcher("test-launcher", run, errors.append), errors


# ---------------------------------------------------------------- the launcher thread
def test_jobs_run_one_at_a_time_in_submission_order_even_when_they_queue_up_together():
    """Never a batch: which jobs queue up together depends on the rank's timing, and NCCL plans a group of
    collectives as a whole, so grouping them made the ranks' launches differ (the GPU run of 2026-11-27)."""
    runs, gate = [], threading.Event()
    launcher = Launcher("test-launcher", lambda job: (gate.wait(5), runs.append(job)), lambda exc: None)
    for i in range(5):  # the first job holds the thread while the rest queue up behind it
        launcher.submit((i,))
    assert launcher.pending == 5
    gate.set()
    launcher.drain(5)
    assert runs == [(i,) for i in range(5)], "each job is run alone, in order"
    assert launcher.pending == 0
    launcher.stop()
    assert launcher.join(5)


def test_drain_waits_for_everything_submitted_before_it():
    log = []
    launcher, _ = _launcher(log, delay_s=0.05)
    launcher.submit(("a",))
    launcher.submit(("b",))
    started = time.monotonic()
    launcher.drain(5)
    assert log == [("a",), ("b",)] and time.monotonic() - started >= 0.1
    launcher.submit(("c",))
    launcher.drain(5)
    assert log[-1] == ("c",)
    launcher.drain(5)  # nothing pending: returns at once
    launcher.stop()


def test_a_submit_during_a_drain_on_another_thread_is_never_lost():
    """The async queue's thread may drain (another collective) while the autograd thread submits a bucket: the
    counters have one writer each, so the later bucket still counts as pending and the next drain waits for it."""
    gate, runs = threading.Event(), []
    launcher = Launcher("test-launcher", lambda job: (gate.wait(5) if job == ("late",) else None, runs.append(job)),
                        lambda exc: None)
    launcher.submit(("early",))
    launcher.drain(5)
    launcher.submit(("late",))  # held on the thread until the gate opens
    drained = threading.Thread(target=launcher.drain, args=(5,))
    drained.start()
    assert launcher.pending == 1
    gate.set()
    drained.join(5)
    assert runs == [("early",), ("late",)] and launcher.pending == 0
    launcher.stop()


def test_a_failed_job_drops_the_later_ones_and_every_caller_call_names_it():
    log = []
    launcher, errors = _launcher(log, fail_on=("bad",))
    launcher.submit(("good",))
    launcher.drain(5)
    launcher.submit(("bad",))
    with pytest.raises(LauncherFailed, match="peer 1 closed the connection") as failed:
        launcher.drain(5)
    assert isinstance(failed.value.__cause__, NcclError) and len(errors) == 1
    with pytest.raises(LauncherFailed):
        launcher.submit(("after",))
    assert log == [("good",)] and launcher.pending == 0, "a dropped job is no longer pending"
    launcher.stop()


def test_a_drain_that_outlives_its_deadline_raises_and_stop_ends_the_thread():
    gate = threading.Event()
    launcher = Launcher("test-launcher", lambda job: gate.wait(5), lambda exc: None)
    launcher.submit((1,))
    with pytest.raises(TimeoutError, match="within 0.05 s"):
        launcher.drain(0.05)
    launcher.stop()
    gate.set()
    assert launcher.join(5) and not launcher.alive
    with pytest.raises(RuntimeError, match="stopped"):
        launcher.submit((2,))


def test_a_setup_that_fails_is_the_launchers_error():
    def setup():
        raise RuntimeError("no such CUDA device")

    launcher = Launcher("test-launcher", lambda job: None, lambda exc: None, setup=setup)
    with pytest.raises(LauncherFailed, match="no such CUDA device"):
        launcher.submit((1,))  # raises already if the thread failed first
        launcher.drain(5)
    launcher.stop()


# ---------------------------------------------------------------- the communicator and its launcher
@pytest.fixture
def cuda_free(monkeypatch):
    """NcclCommunicator's CUDA calls as no-ops (the test's communicator is wired by hand)."""
    record = []

    class FakeEvent:
        def __init__(self, blocking=False):
            pass

        def record(self, stream=None):
            record.append("event")

        def query(self):
            return True

    class FakeStream:
        cuda_stream = 0

        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: record.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    record.append(FakeStream())
    return record


def _comm(cuda_free, lib=None):
    lib = lib or FakeLib([SUCCESS])
    comm = make_comm(lib, cuda_free)
    comm._stream = cuda_free[0]
    return comm


def test_another_collective_waits_for_the_queued_buckets_first(cuda_free):
    comm = _comm(cuda_free)
    order = []
    gate = threading.Event()
    comm._launcher = Launcher("test-launcher", lambda job: (gate.wait(5), order.append("buckets")), comm.fail)
    comm._launcher.submit(("bucket 0",))
    threading.Timer(0.1, gate.set).start()
    comm._launch("broadcast", (), None, (), 5.0)  # any collective (here a zero-byte one) drains the launcher first
    order.append("broadcast")
    assert order == ["buckets", "broadcast"]
    comm.close()


def test_the_launcher_is_made_once_and_close_or_abort_stops_it(cuda_free):
    comm = _comm(cuda_free, FakeLib([IN_PROGRESS, SUCCESS]))
    launcher = comm.bucket_launcher()
    assert comm.bucket_launcher() is launcher and launcher.alive
    comm.close()
    assert launcher.join(5)
    aborted = _comm(cuda_free)
    launcher = aborted.bucket_launcher()
    aborted.abort()
    assert launcher.join(5)
    with pytest.raises(er.CommError):
        aborted.bucket_launcher()  # a closed communicator makes none


def test_a_failed_launch_fails_and_aborts_the_communicator(cuda_free):
    lib = FakeLib([SUCCESS])
    comm = _comm(cuda_free, lib)

    def run(job):
        raise NcclError("allreduce", 6, "peer 1 closed the connection")

    comm._launcher = Launcher("test-launcher", run, comm.fail)
    comm._launcher.submit(("bucket",))
    with pytest.raises(LauncherFailed):
        comm._launcher.drain(5)
    assert comm.errored and "abort" in lib.calls
    with pytest.raises(er.CommError, match="peer 1 closed the connection"):
        comm.barrier(timeout_s=5)


def test_the_bucket_path_option_is_checked(cuda_free):
    comm = _comm(cuda_free)
    assert type(comm.bucket_path("collective")) is BucketPath
    with pytest.raises(ValueError, match="'bogus' is not one of collective, inline, thread"):
        comm.bucket_path("bogus")
    comm.close()


def test_the_environment_variable_is_checked_when_elastic_ring_loads():
    done = subprocess.run([sys.executable, "-c", "import elastic_ring"], capture_output=True, text=True, timeout=120,
                          env={"ELASTIC_RING_NCCL_BUCKETS": "fast", "PATH": "/usr/bin:/bin",
                               "PYTHONPATH": ":".join(sys.path)})
    assert done.returncode != 0
    assert "ELASTIC_RING_NCCL_BUCKETS='fast' is not one of collective, inline, thread" in done.stderr


# ---------------------------------------------------------------- one watchdog entry per step
class Done:
    def __init__(self):
        self.done = False

    def __call__(self):
        return self.done


def test_a_steps_buckets_share_one_watchdog_entry_whose_deadline_follows_the_last_launch():
    clock, comm = FakeClock(), FakeComm()
    dog = Watchdog(clock=clock)
    watch = OrderedWatch(dog, comm, "gradient bucket allreduce", timeout_s=5, clock=clock)
    buckets = [Done() for _ in range(4)]
    for i, bucket in enumerate(buckets):
        watch.launched(bucket)
        clock.now += 3  # 3 s apart: the first bucket's own deadline would pass, the step's does not
        dog.poll_once()
        assert dog.pending(comm) == 1
    assert watch.registrations == 1 and comm.failures == []
    buckets[-1].done = True  # in order on one stream: the last one done means all are
    dog.poll_once()
    assert dog.pending(comm) == 0
    nxt = Done()
    watch.launched(nxt)  # the next step registers anew
    assert watch.registrations == 2 and dog.pending(comm) == 1
    clock.now += 6
    dog.poll_once()
    assert len(comm.failures) == 1 and "gradient bucket allreduce did not finish within collective_timeout_s=5" in \
        str(comm.failures[0])


def test_a_launch_racing_the_watchdogs_forgetting_is_never_unwatched():
    clock, comm = FakeClock(), FakeComm()
    dog = Watchdog(clock=clock)
    watch = OrderedWatch(dog, comm, "gradient bucket allreduce", timeout_s=5, clock=clock)
    first, second = Done(), Done()
    watch.launched(first)
    first.done = True
    original = watch._probe

    def probe_then_launch():  # the watchdog sees the step done; meanwhile the next bucket is launched
        finished = original()
        watch.launched(second)
        return finished

    dog._watched[0].done = probe_then_launch
    dog.poll_once()
    assert dog.pending(comm) == 1 and watch.registrations == 2, "the second launch got an entry of its own"


# ---------------------------------------------------------------- the bucket paths on fake CUDA
class FakeCuda:
    """Streams and events that log what the bucket path asks of CUDA (on CPU tensors)."""

    def __init__(self):
        self.log = []
        outer = self

        class Event:
            def __init__(self, blocking=False):
                self.blocking, self.recorded = blocking, 0

            def record(self, stream=None):
                self.recorded += 1
                outer.log.append(("record", "done" if self.blocking else "ready"))

            def query(self):
                return True

            def synchronize(self):
                outer.log.append(("host wait",))

        class Stream:
            cuda_stream = 0x5

            def wait_event(self, event):
                outer.log.append(("stream waits", "done" if event.blocking else "ready"))

            def wait_stream(self, other):
                pass

        self.Event, self.Stream = Event, Stream


class BucketLib(FakeLib):
    """FakeLib whose allreduce sums nothing (one rank) and logs; ``fail_at`` makes that call fail."""

    def __init__(self, log, fail_at=None):
        super().__init__([SUCCESS])
        self.log, self.fail_at, self.launches = log, fail_at, 0

    def all_reduce(self, comm, ptr, count, dtype, op, stream):
        self.launches += 1
        self.log.append(("allreduce", count))
        return 6 if self.launches == self.fail_at else IN_PROGRESS

    def group_start(self):
        self.log.append(("group start",))
        return SUCCESS

    def group_end(self):
        self.log.append(("group end",))
        return IN_PROGRESS


@pytest.fixture
def fake_cuda(monkeypatch, cuda_free):
    from elastic_ring.backends.nccl import bucket_path

    cuda = FakeCuda()
    monkeypatch.setattr(torch.cuda, "Event", cuda.Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: cuda.Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: cuda.log.append(("record_stream",)),
                        raising=False)
    monkeypatch.setattr(bucket_path, "pinned", lambda numel, dtype: torch.empty(numel, dtype=dtype))
    return cuda


def _path_comm(fake_cuda, cuda_free, fail_at=None):
    lib = BucketLib(fake_cuda.log, fail_at)
    comm = make_comm(lib, cuda_free)
    comm._stream = fake_cuda.Stream()
    return comm, lib


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_a_step_on_a_bucket_path_waits_once_and_reads_the_trailer_from_its_pinned_copy(fake_cuda, cuda_free, mode):
    comm, lib = _path_comm(fake_cuda, cuda_free)
    path = comm.bucket_path(mode)
    buckets = [torch.ones(4), torch.ones(8), torch.zeros(5 + 3)]
    trailer = buckets[2][5:]
    for step in range(2):
        fake_cuda.log.clear()
        works = [path.launch(buckets[0]), path.launch(buckets[1])]
        path.fill_trailer(trailer, [1.0, 0.0, float(step)])
        works.append(path.launch(buckets[2]))
        path.wait(works)
        assert path.read_trailer(trailer) == [1.0, 0.0, float(step)]  # the pinned copy (one rank: unreduced)
        assert [entry for entry in fake_cuda.log if entry[0] == "allreduce"] == [("allreduce", 4), ("allreduce", 8),
                                                                               ("allreduce", 8)]
        assert fake_cuda.log.count(("host wait",)) == 1, "one host wait per step, on the last bucket"
        assert fake_cuda.log.count(("stream waits", "ready")) == 3 and fake_cuda.log.count(("record", "done")) == 3
        assert fake_cuda.log.count(("record_stream",)) == 3
    assert len(path._done) == 3, "the events are pooled: the second step made none"
    assert path.watch.registrations == 1, "one watchdog entry (the watchdog never saw the step end here)"
    comm.close()


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_a_failed_bucket_launch_fails_the_communicator_and_the_step(fake_cuda, cuda_free, mode):
    comm, lib = _path_comm(fake_cuda, cuda_free, fail_at=2)
    path = comm.bucket_path(mode)
    with pytest.raises(er.CommError, match="ncclRemoteError"):
        works = [path.launch(torch.ones(4)), path.launch(torch.ones(4))]  # inline: raises here
        path.wait(works)  # thread: raises here
    assert comm.errored and "abort" in lib.calls
    with pytest.raises(er.CommError):
        path.launch(torch.ones(4))
