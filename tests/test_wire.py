"""The driver <-> worker contract (issue 31): message kinds as enums, each with its handler on the driver, the
typed WorkerSettings checked where they are made, and what a worker does with the exception that ended fn."""

from __future__ import annotations

import json

import pytest

import elastic_ring as er
import state
from ray_integration.driver.pool import _HANDLERS
from ray_integration.errors import WorkerError
from ray_integration.wire.protocol import DriverKind, WorkerKind
from ray_integration.wire.settings import WorkerSettings
from ray_integration.worker.actor import Fate, _describe_failure, fate


def test_every_kind_a_worker_sends_has_its_handler_on_the_driver():
    assert set(_HANDLERS) == set(WorkerKind)


def test_kinds_travel_as_their_strings_and_unknown_ones_are_ignored():
    assert json.loads(json.dumps({"k": WorkerKind.HEARTBEAT})) == {"k": "hb"} and f"{DriverKind.RING}" == "ring"
    assert WorkerKind.of({"k": "hb"}) is WorkerKind.HEARTBEAT and DriverKind.of({"k": "pending"}) is DriverKind.PENDING
    assert WorkerKind.of({"k": "ring"}) is None and WorkerKind.of({"k": 3}) is None and WorkerKind.of({}) is None


@pytest.mark.parametrize("changes, error, match", [
    (dict(driver_silence_s=0), ValueError, "WorkerSettings.driver_silence_s=0 must be"),
    (dict(flush_timeout_s=float("nan")), ValueError, "flush_timeout_s"),
    (dict(checkpoint="s3://bucket/run"), TypeError, "must be a state.CheckpointConfig or None"),
    (dict(use_gpu="yes"), ValueError, "use_gpu='yes' must be True or False"),
    (dict(timeline=1), ValueError, "timeline=1 must be True or False"),
])
def test_worker_settings_are_checked_when_made(changes, error, match):
    good = dict(driver_silence_s=60.0, flush_timeout_s=30.0)
    WorkerSettings(**good, checkpoint=state.CheckpointConfig("/tmp/x", every_n_commits=1))
    with pytest.raises(error, match=match):
        WorkerSettings(**{**good, **changes})


def _raised_from(error: BaseException, cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except type(cause) as inner:
            raise error from inner
    except type(error) as outer:
        return outer


@pytest.mark.parametrize("exc, expected", [
    (er.RingStopped("not in the next ring"), Fate.LEAVE),
    (state.TrainingStopped("the job stops"), Fate.LEAVE),
    (WorkerError("w", 0, "node", "host", "tb"), Fate.RAISE),
    (er.RendezvousError("no word from the driver"), Fate.GIVE_UP),
    (_raised_from(er.RendezvousError("the rendezvous failed"), er.AuthenticationError("forged")), Fate.ERROR),
    (er.AuthenticationError("a value failed authentication"), Fate.ERROR),
    (ValueError("fn's own bug"), Fate.ERROR),
])
def test_what_a_worker_does_with_the_exception_that_ended_fn(exc, expected):
    assert fate(exc) is expected


def test_a_rendezvous_failure_from_forged_data_is_named_as_tampering_not_a_lost_worker():
    forged = _raised_from(er.RendezvousError("the rendezvous failed"), er.AuthenticationError("forged"))
    assert "failed authentication" in _describe_failure(forged)
    assert _describe_failure(er.RendezvousError("x")) == "the rendezvous with the driver failed"
