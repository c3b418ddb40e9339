"""Ray Train's ``report(metrics, checkpoint=None)`` inside the training function.

The metrics reach the driver's ``Result`` (rank 0's), by the same path as ``er.report``. A checkpoint
(``ray.train.Checkpoint.from_directory(d)``) is copied into a local snapshot at once (``d`` may go or be reused
when ``report`` returns) and uploaded by rank 0 in the background into the run's location as a reported
checkpoint (:mod:`state.checkpoints.uploads`, :mod:`state.checkpoints.reported`): the other ranks never wait for it.
``state.flush_checkpoints`` (when ``fn`` returns, at a stop or a drain) waits for the uploads. Other ranks'
checkpoints are not uploaded (a warning, once).
"""

from __future__ import annotations

import numbers
import shutil
import time
import warnings
from typing import Any

import elastic_ring as er
from elastic_ring.core import progress
from elastic_ring.core.log import get_logger
from elastic_ring.ring import report as ring_report
from elastic_ring.ring import runtime as ring_runtime
from state.checkpoints.config import default_checkpointing as default_config
from state.checkpoints.uploads import uploads_for

from . import _dropin
from ._checkpoint import ray_checkpoint_class

_log = get_logger(__name__)
#: Keys every report record carries already; a metric of that name would hide them.
RESERVED_METRICS = ("time", "rank", "round", "world_size")
#: Seconds ``report(..., checkpoint_upload_mode=SYNC)`` waits for the upload before raising.
SYNC_UPLOAD_TIMEOUT_S = 300.0
#: How deep report's metric values may nest (lists, dicts).
MAX_METRIC_DEPTH = 32

_warned_rank: list[bool] = [False]


def report(metrics: dict, checkpoint: Any = None, checkpoint_dir_name: str | None = None,
           checkpoint_upload_mode: Any = None, delete_local_checkpoint_after_upload: bool | None = None,
           checkpoint_upload_fn: Any = None, validation: Any = False) -> None:
    """Report this step's ``metrics`` and, optionally, a checkpoint, as Ray Train's ``report`` (its signature).

    ``metrics``: a dict of str -> JSON-able value (numbers, strings, bools, None, lists and dicts of them); all
    reach ``Result.metrics`` / ``metrics_history``. ``checkpoint``: a ``ray.train.Checkpoint`` of a local directory
    (``Checkpoint.from_directory(d)``), copied now and uploaded by rank 0 in the background (``d`` may be deleted
    or reused as soon as this returns); needs the run's location (``RunConfig(storage_path=..., name=...)`` or
    ``checkpoint_uri``). ``checkpoint_upload_mode``: ``ray.train.CheckpointUploadMode.ASYNC`` (the background
    upload), or ``SYNC``: rank 0 returns once the upload is durable (the other ranks do not wait for it: their next
    collective does, up to its timeout); None is ``SYNC`` under the drop-in ``TorchTrainer`` (Ray Train's default)
    and ``ASYNC`` under ``ElasticTrainer``. ``checkpoint_dir_name`` is accepted and not used (reported
    checkpoints are numbered ``ckpt-<n>``); ``delete_local_checkpoint_after_upload`` (Ray's default: with ``ASYNC``)
    deletes ``d`` once it is copied. Raises :class:`state.CheckpointError` after repeated failed uploads, or when a
    ``SYNC`` upload fails.

    Under ``ray_integration.train.torch.TorchTrainer`` (the drop-in) every rank keeps its own copy of its checkpoint
    and the report is a small collective of every rank, as Ray's is a barrier: call it the same number of times on
    every rank; a joiner enters at the next report that carries a checkpoint (:mod:`._dropin`)."""
    metrics = _checked_metrics(metrics)
    session = _dropin.current()
    # Ray Train's default (None) is SYNC: under the drop-in the newest reported checkpoint is durable once report()
    # returns, as Ray's, so a lost rank 0 (often its only holder) costs no reported step
    sync = _sync_mode(checkpoint_upload_mode) or checkpoint_upload_mode is None and session is not None
    delete = _refuse_or_delete(checkpoint, checkpoint_dir_name, checkpoint_upload_mode,
                               delete_local_checkpoint_after_upload, checkpoint_upload_fn, validation)
    directory = _local_directory(checkpoint) if checkpoint is not None else None
    config = default_config()
    if directory is not None and config is None:
        raise ValueError("report(metrics, checkpoint=...) needs a location for checkpoints: give the trainer "
                         "run_config=RunConfig(storage_path=..., name=...) or checkpoint_uri=...")
    agreed = session.report(directory) if session is not None else None
    if directory is not None:
        rank = _rank()
        if rank == 0:
            uploads = uploads_for(config.uri, config.keep_last, run_id=config.run_id, signing_key=config.signing_key,
                                  lease_generation=config.lease_generation,
                                  max_consecutive_failures=config.max_consecutive_failures)
            uploads.submit(directory, metrics)
            if sync:
                uploads.flush(SYNC_UPLOAD_TIMEOUT_S)
        elif session is None and not _warned_rank[0]:
            _warned_rank[0] = True
            warnings.warn(f"report(checkpoint=...) on rank {rank}: only rank 0's checkpoint is kept (Ray Train "
                          "merges every rank's directory); write what every rank needs from rank 0",
                          UserWarning, stacklevel=2)
        if delete:
            shutil.rmtree(directory, ignore_errors=True)
    _send(metrics)
    if agreed is not None:
        session.act_on_notices(*agreed)


def _refuse_or_delete(checkpoint: Any, dir_name: Any, mode: Any, delete: Any, upload_fn: Any, validation: Any) -> bool:
    """Check Ray's other report arguments; whether to delete the checkpoint's directory once it is copied."""
    if dir_name is not None and not isinstance(dir_name, str):
        raise TypeError(f"report(checkpoint_dir_name={dir_name!r}) must be a str or None")
    if upload_fn is not None:
        raise ValueError("report(checkpoint_upload_fn=...) is not supported: rank 0 uploads the checkpoint into the "
                         "run's location itself (verified, in the background); drop checkpoint_upload_fn")
    if validation is not False:
        raise ValueError(f"report(validation={validation!r}) is not supported (Ray Train's ValidationConfig has no "
                         "equivalent here): validate in the training function and report the result as a metric")
    if delete is not None and not isinstance(delete, bool):
        raise TypeError(f"report(delete_local_checkpoint_after_upload={delete!r}) must be True, False or None")
    if delete is None:  # Ray's default: delete after an ASYNC upload
        delete = getattr(mode, "name", mode) == "ASYNC"
    return bool(delete and checkpoint is not None)


def _sync_mode(mode: Any) -> bool:
    """True for Ray Train's ``CheckpointUploadMode.SYNC``, False for None or ``ASYNC``; else ValueError."""
    name = getattr(mode, "name", mode)
    if mode is None or isinstance(name, str) and name.upper() == "ASYNC":
        return False
    if isinstance(name, str) and name.upper() == "SYNC":
        return True
    raise ValueError(f"report(checkpoint_upload_mode={mode!r}) is not supported: use None or "
                     "ray.train.CheckpointUploadMode.ASYNC (the background upload; the default under ElasticTrainer) or SYNC (rank 0 "
                     "waits for it); a checkpoint already in the run's storage (NO_UPLOAD) cannot be reported")


def _rank() -> int:
    """This worker's rank (forming the ring inside ElasticTrainer); 0 outside any ring (a plain script)."""
    try:
        return er.rank()
    except er.NotInitializedError:
        return 0


def _checked_metrics(metrics: Any) -> dict:
    if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
        raise TypeError(f"report(metrics=...) must be a dict of str -> JSON-able value (number, string, bool, None, "
                        f"list, dict), got {metrics!r}")
    clash = sorted(set(metrics) & set(RESERVED_METRICS))
    if clash:
        raise ValueError(f"report(metrics) has {clash}: every record carries {list(RESERVED_METRICS)} already; "
                         "rename those metrics (e.g. 'rank' -> 'my_rank')")
    return {key: _plain(value, key, 0) for key, value in metrics.items()}


def _plain(value: Any, where: str, depth: int) -> Any:
    """``value`` as JSON-able data (numpy scalars as Python numbers, tuples as lists); TypeError naming ``where``."""
    if depth > MAX_METRIC_DEPTH:
        raise TypeError(f"report(metrics={{{where!r}: ...}}) nests deeper than {MAX_METRIC_DEPTH} levels")
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, numbers.Real):  # a numpy scalar, a Fraction
        return value.item() if hasattr(value, "item") else float(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"report(metrics={{{where!r}: ...}}) holds a dict with non-str keys; use str keys")
        return {k: _plain(v, f"{where}.{k}", depth + 1) for k, v in value.items()}
    hint = (" (use float(t) for a scalar tensor, t.tolist() for a small one)" if type(value).__name__ == "Tensor"
            else "")
    raise TypeError(f"report(metrics={{{where!r}: ...}}) got a {type(value).__name__}; report JSON-able values: "
                    f"numbers, strings, bools, None, lists and dicts of them{hint}")


def _send(metrics: dict) -> None:
    """Rank 0's record to the driver. Numbers and strings go through ``er.report``; a record with other values
    (None, lists, dicts, which ``er.report`` refuses) is built the same way and handed to the installed reporter."""
    if all(isinstance(v, (str, bool, int, float)) for v in metrics.values()):
        er.report(**metrics)
        return
    comm = ring_runtime.current_or_none()
    record = {"time": time.time(), "rank": comm.rank if comm else 0, "round": comm.spec.round_id if comm else None,
              "world_size": comm.size if comm else 1, **progress.current(), **metrics}
    reporter = ring_report.current_reporter()
    if reporter is None:
        _log.info("report %s", metrics)
    else:
        reporter(record)


def _local_directory(checkpoint: Any) -> str:
    Checkpoint = ray_checkpoint_class()
    if not isinstance(checkpoint, Checkpoint):
        raise TypeError(f"report(checkpoint=...) must be a ray.train.Checkpoint (Checkpoint.from_directory(d)), "
                        f"got {type(checkpoint).__name__}")
    fs = checkpoint.filesystem
    if fs is not None and getattr(fs, "type_name", "local") != "local":
        raise ValueError(f"report(checkpoint=...) got a checkpoint on {fs.type_name} ({checkpoint.path}); report a "
                         "local directory (Checkpoint.from_directory(d)): rank 0 uploads it to the run's location")
    return checkpoint.path
