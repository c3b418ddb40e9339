"""Ray Train's calls inside the training function: ``report``, ``get_checkpoint``, ``get_context``; and
``load_checkpoint`` to read a run's checkpoints afterwards.

* ``report(metrics, checkpoint=None)``: the metrics reach the driver's ``Result`` (rank 0's); a checkpoint
  (``ray.train.Checkpoint.from_directory(d)``) is copied into a local snapshot at once (``d`` may go or be reused
  when ``report`` returns) and uploaded by rank 0 in the background into the run's location as a reported
  checkpoint (:mod:`state.checkpoints.uploads`, :mod:`state.checkpoints.reported`): the other ranks never wait for
  it. ``state.flush_checkpoints`` (when ``fn`` returns, at a stop or a drain) waits for the uploads. Other ranks'
  checkpoints are not uploaded (a warning, once).
* ``get_checkpoint()``: the newest verified reported checkpoint at the run's location (this run's, or an earlier
  run's: resuming after a whole-cluster loss), downloaded into a local directory; None when there is none.
* ``get_context()``: the ranks of the current ring (they change after a re-form).
"""

from __future__ import annotations

import atexit
import itertools
import numbers
import os
import posixpath
import shutil
import tempfile
import threading
import time
import warnings
from typing import Any

import elastic_ring as er
from elastic_ring.core import progress
from elastic_ring.core.log import get_logger
from elastic_ring.ring import report as ring_report
from elastic_ring.ring import runtime as ring_runtime
from state import CheckpointError, CheckpointRefused
from state.checkpoints.config import default_checkpointing as default_config
from state.checkpoints.policy import parse_checkpoint_dir
from state.checkpoints.reported import FILES, SUBDIR, ReportedCheckpoints, manifest_digest, verify_local
from state.checkpoints.store import CheckpointStore
from state.checkpoints.transport import Location
from state.checkpoints.uploads import uploads_for

_log = get_logger(__name__)
#: Keys every report record carries already; a metric of that name would hide them.
RESERVED_METRICS = ("time", "rank", "round", "world_size")
#: Seconds ``report(..., checkpoint_upload_mode=SYNC)`` waits for the upload before raising.
SYNC_UPLOAD_TIMEOUT_S = 300.0
#: How deep report's metric values may nest (lists, dicts).
MAX_METRIC_DEPTH = 32

_lock = threading.Lock()
#: get_checkpoint's downloads: (location, seq, manifest digest) -> the local directory it was verified into.
_downloads: dict[tuple[str, int, str], str] = {}
_names = itertools.count()
_tmp_root: str | None = None
_warned_rank: list[bool] = [False]


def _ray_checkpoint_class():
    from ray.train import Checkpoint

    return Checkpoint


# ---------------------------------------------------------------- report
def report(metrics: dict, checkpoint: Any = None, *, checkpoint_upload_mode: Any = None) -> None:
    """Report this step's ``metrics`` and, optionally, a checkpoint, as Ray Train's ``report``.

    ``metrics``: a dict of str -> JSON-able value (numbers, strings, bools, None, lists and dicts of them); all
    reach ``Result.metrics`` / ``metrics_history``. ``checkpoint``: a ``ray.train.Checkpoint`` of a local directory
    (``Checkpoint.from_directory(d)``), copied now and uploaded by rank 0 in the background (``d`` may be deleted
    or reused as soon as this returns); needs the run's location (``RunConfig(storage_path=..., name=...)`` or
    ``checkpoint_uri``). ``checkpoint_upload_mode``: None or ``ray.train.CheckpointUploadMode.ASYNC`` (the
    background upload), or ``SYNC``: rank 0 returns once the upload is durable (the other ranks do not wait for
    it: their next collective does, up to its timeout). Raises :class:`state.CheckpointError` after repeated
    failed uploads, or when a ``SYNC`` upload fails."""
    metrics = _checked_metrics(metrics)
    sync = _sync_mode(checkpoint_upload_mode)
    if checkpoint is not None:
        directory = _local_directory(checkpoint)
        config = default_config()
        if config is None:
            raise ValueError("report(metrics, checkpoint=...) needs a location for checkpoints: give the trainer "
                             "run_config=RunConfig(storage_path=..., name=...) or checkpoint_uri=...")
        rank = _rank()
        if rank == 0:
            uploads = uploads_for(config.uri, config.keep_last, run_id=config.run_id, signing_key=config.signing_key,
                                  lease_generation=config.lease_generation,
                                  max_consecutive_failures=config.max_consecutive_failures)
            uploads.submit(directory, metrics)
            if sync:
                uploads.flush(SYNC_UPLOAD_TIMEOUT_S)
        elif not _warned_rank[0]:
            _warned_rank[0] = True
            warnings.warn(f"report(checkpoint=...) on rank {rank}: only rank 0's checkpoint is kept (Ray Train "
                          "merges every rank's directory); write what every rank needs from rank 0",
                          UserWarning, stacklevel=2)
    _send(metrics)


def _sync_mode(mode: Any) -> bool:
    """True for Ray Train's ``CheckpointUploadMode.SYNC``, False for None or ``ASYNC``; else ValueError."""
    name = getattr(mode, "name", mode)
    if mode is None or isinstance(name, str) and name.upper() == "ASYNC":
        return False
    if isinstance(name, str) and name.upper() == "SYNC":
        return True
    raise ValueError(f"report(checkpoint_upload_mode={mode!r}) is not supported: use None or "
                     "ray.train.CheckpointUploadMode.ASYNC (the background upload, the default here) or SYNC (rank 0 "
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
    Checkpoint = _ray_checkpoint_class()
    if not isinstance(checkpoint, Checkpoint):
        raise TypeError(f"report(checkpoint=...) must be a ray.train.Checkpoint (Checkpoint.from_directory(d)), "
                        f"got {type(checkpoint).__name__}")
    fs = checkpoint.filesystem
    if fs is not None and getattr(fs, "type_name", "local") != "local":
        raise ValueError(f"report(checkpoint=...) got a checkpoint on {fs.type_name} ({checkpoint.path}); report a "
                         "local directory (Checkpoint.from_directory(d)): rank 0 uploads it to the run's location")
    return checkpoint.path


# ---------------------------------------------------------------- get_checkpoint
def _tmp() -> str:
    global _tmp_root
    if _tmp_root is None:
        _tmp_root = tempfile.mkdtemp(prefix="er-checkpoints-")
        atexit.register(shutil.rmtree, _tmp_root, True)
    return _tmp_root


def _new_dir(seq: int) -> str:
    return os.path.join(_tmp(), f"{next(_names)}-{seq}")


def _fetch_reported(uri: str, signing_key: bytes | None = None, seq: int | None = None, *,
                    cache: bool = False) -> tuple[int, str] | None:
    """The newest verified reported checkpoint at ``uri`` (or number ``seq``) in a local directory: (seq, dir).
    With ``cache``, a directory this process downloaded before is handed out again when the manifest read now has
    the same digest and every file still matches it (else it is downloaded again, into a new directory)."""
    store = ReportedCheckpoints(uri, signing_key=signing_key)

    def reuse(n: int, manifest: dict) -> str | None:
        if not cache:
            return None
        with _lock:
            local = _downloads.get((uri, n, manifest_digest(manifest)))
        return local if local is not None and verify_local(local, manifest) else None

    if seq is not None:
        if seq not in store.complete():
            raise CheckpointError(f"there is no reported checkpoint {seq} under {uri}/{SUBDIR} (it was pruned, or "
                                  f"never completed); the complete ones are {store.complete()}")
        manifest = store.manifest(seq)
        local = reuse(seq, manifest)
        if local is None:
            local = _new_dir(seq)
            store.download(seq, local, manifest)
        found = (seq, local, manifest)
    else:
        found = store.newest(_new_dir, reuse=reuse)
        if found is None:
            return None
    if cache:
        with _lock:
            _downloads[(uri, found[0], manifest_digest(found[2]))] = found[1]
    return found[0], found[1]


def get_checkpoint() -> Any:
    """The checkpoint to resume from: the newest verified reported checkpoint at this run's location (written by
    this run or an earlier one there), as a ``ray.train.Checkpoint`` of a local directory; None if there is none
    (or the run has no location). Uploads still in flight are not visible yet. The directory is this process's
    copy: handed out again while its files match the checkpoint's manifest, downloaded again otherwise."""
    config = default_config()
    if config is None:
        return None
    found = _fetch_reported(config.uri, config.signing_key, cache=True)
    return None if found is None else _ray_checkpoint_class().from_directory(found[1])


# ---------------------------------------------------------------- get_context
class TrainContext:
    """Ray Train's ``get_context()``: this worker's place in the current ring (after a re-form, the new ring's)."""

    def get_world_rank(self) -> int:
        return er.rank()

    def get_world_size(self) -> int:
        return er.size()

    def get_local_rank(self) -> int:
        return er.local_rank()

    def get_local_world_size(self) -> int:
        return er.local_size()

    def get_node_rank(self) -> int:
        """The index of this worker's node among the ring's nodes (in rank order: rank 0's node is 0)."""
        er.size()  # forms the ring if it is not formed yet
        spec = ring_runtime.current().spec
        nodes = list(dict.fromkeys(spec.node_ids))
        return nodes.index(spec.node_ids[spec.rank])

    def get_experiment_name(self) -> str | None:
        """RunConfig's ``name``: the last part of the run's location (None without one)."""
        config = default_config()
        return None if config is None else posixpath.basename(config.uri.rstrip("/"))

    get_trial_name = get_experiment_name

    def get_storage_path(self) -> str | None:
        """The run's location (``storage_path/name``), or None."""
        config = default_config()
        return None if config is None else config.uri


_context = TrainContext()


def get_context() -> TrainContext:
    return _context


# ---------------------------------------------------------------- after the run
def checkpoint_url(checkpoint: Any) -> str:
    """The fsspec URL a ``ray.train.Checkpoint`` names (local path, or the URL of its filesystem)."""
    fs = checkpoint.filesystem
    if fs is None or getattr(fs, "type_name", "") == "local":
        return os.fspath(checkpoint.path)
    handler = getattr(fs, "handler", None)
    inner = getattr(handler, "fs", None)
    if inner is not None:  # a pyarrow PyFileSystem over an fsspec filesystem (what Result.checkpoint uses)
        return inner.unstrip_protocol(checkpoint.path)
    scheme = {"s3": "s3", "gcs": "gs", "hdfs": "hdfs", "abfs": "abfs"}.get(fs.type_name)
    if scheme is None:
        raise ValueError(f"a checkpoint on a {fs.type_name!r} filesystem cannot be read here; pass its URL instead")
    return f"{scheme}://{checkpoint.path}"


def as_ray_checkpoint(url: str) -> Any:
    """A ``ray.train.Checkpoint`` naming ``url`` (a local path, or any fsspec URL through pyarrow's FSSpecHandler)."""
    Checkpoint = _ray_checkpoint_class()
    loc = Location(url)
    if loc.local:
        return Checkpoint(loc.root)
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    return Checkpoint(loc.root, filesystem=PyFileSystem(FSSpecHandler(loc.fs)))


def load_checkpoint(source: Any, *, trusted: bool = False, signing_key: bytes | None = None) -> Any:
    """Read a checkpoint of a run, verified: ``source`` is the run's location (``checkpoint_uri``,
    ``Result.path``), one checkpoint's URI, or a ``ray.train.Checkpoint`` (``Result.checkpoint``).

    Returns, for a reported checkpoint (``report(..., checkpoint=...)``: the user's own files), the path of a new
    local directory holding its files, each verified against the manifest (as Ray Train's
    ``Checkpoint.as_directory()`` gives a directory: read your files from it); for a state checkpoint (``ckpt-*``),
    its state tree: a dict with one entry per state value (``tree["model"]``, ``tree["optimizer"]``: their
    state_dicts). A location means the same checkpoint as ``Result.checkpoint``: its newest valid reported
    checkpoint when it holds any, else its newest valid state checkpoint (pass ``Result.checkpoint_uri`` for the
    state's own). Each call reads the storage again (nothing is cached). Raises :class:`state.CheckpointError`
    naming the location when there is nothing, or nothing valid; :class:`state.CheckpointRefused` for another
    job's checkpoint."""
    if isinstance(source, _ray_checkpoint_class()):  # before os.PathLike: a Checkpoint's __fspath__ raises
        url = checkpoint_url(source)
    elif isinstance(source, (str, os.PathLike)):
        url = os.fspath(source)
    else:
        url = None
    if not isinstance(url, str) or not url:
        raise TypeError(f"load_checkpoint expects a location URI, a checkpoint's URI or a ray.train.Checkpoint, "
                        f"got {source!r}")
    url = url.rstrip("/")
    parts = url.rsplit("/", 3)
    if len(parts) == 4 and parts[-1] == FILES and parts[-3] == SUBDIR and parse_checkpoint_dir(parts[-2]) is not None:
        return _reported(parts[0], parse_checkpoint_dir(parts[-2]), signing_key)
    if len(parts) >= 3 and parts[-2] == SUBDIR and parse_checkpoint_dir(parts[-1]) is not None:
        return _reported(url.rsplit("/", 2)[0], parse_checkpoint_dir(parts[-1]), signing_key)
    seq = parse_checkpoint_dir(parts[-1])
    location = url.rsplit("/", 1)[0] if seq is not None else url
    loc = Location(location)
    if not loc.exists(loc.root):
        raise CheckpointError(f"there is no checkpoint at {url}: the location does not exist (give the run's "
                              "checkpoint_uri / RunConfig storage_path/name, or Result.path)")
    store = CheckpointStore(location, trusted=trusted, signing_key=signing_key)
    if seq is not None:
        return store.load(seq)[0]
    damaged = None
    try:
        found = _fetch_reported(location, signing_key)
    except CheckpointRefused:
        raise
    except CheckpointError as exc:  # every reported one is damaged: the state's, as Result.checkpoint falls back
        found, damaged = None, exc
        _log.warning("%s; reading the newest state checkpoint instead", exc)
    if found is not None:
        return found[1]
    if store.complete():
        loaded = store.load_latest()
        assert loaded is not None
        return loaded[0]
    if damaged is not None:
        raise damaged
    raise CheckpointError(f"there is no complete checkpoint at {location} (no ckpt-* directory with a manifest, no "
                          f"reported checkpoint under {SUBDIR}/); was it this run's checkpoint_uri?")


def _reported(location: str, seq: int, signing_key: bytes | None) -> str:
    found = _fetch_reported(location, signing_key, seq)
    assert found is not None
    return found[1]
