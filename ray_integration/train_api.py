"""Ray Train's calls inside the training function: ``report``, ``get_checkpoint``, ``get_context``; and
``load_checkpoint`` to read a run's checkpoints afterwards.

* ``report(metrics, checkpoint=None)``: the metrics go through ``er.report`` (rank 0's reach the driver's
  ``Result``); a checkpoint (``ray.train.Checkpoint.from_directory(d)``) is uploaded by rank 0, synchronously,
  into the run's location as a reported checkpoint (:mod:`state.reported_checkpoints`): durable and verified
  when ``report`` returns. Other ranks' checkpoints are not uploaded (a warning, once).
* ``get_checkpoint()``: the newest verified reported checkpoint at the run's location (this run's, or an earlier
  run's: resuming after a whole-cluster loss), downloaded into a local directory; None when there is none.
* ``get_context()``: the ranks of the current ring (they change after a re-form).
"""

from __future__ import annotations

import atexit
import os
import posixpath
import shutil
import tempfile
import threading
import warnings
from typing import Any

import elastic_ring as er
from elastic_ring.core.log import get_logger
from state import CheckpointError, CheckpointStore
from state.checkpoint_io import Location
from state.checkpoint_policy import parse_checkpoint_dir
from state.reported_checkpoints import FILES, SUBDIR, ReportedCheckpoints, default_config

_log = get_logger(__name__)
#: Keys every er.report record carries already; a metric of that name would hide them.
RESERVED_METRICS = ("time", "rank", "round", "world_size")

_lock = threading.Lock()
_downloads: dict[tuple[str, int], str] = {}  # (location, seq) -> the local directory it was verified into
_tmp_root: str | None = None
_warned_rank: list[bool] = [False]


def _ray_checkpoint_class():
    from ray.train import Checkpoint

    return Checkpoint


# ---------------------------------------------------------------- report
def report(metrics: dict, checkpoint: Any = None) -> None:
    """Report this step's ``metrics`` (a dict of str -> number or short string) and, optionally, a checkpoint: a
    ``ray.train.Checkpoint`` of a local directory (``Checkpoint.from_directory(d)``), uploaded by rank 0 before this
    call returns. Needs the run's location (``RunConfig(storage_path=..., name=...)`` or ``checkpoint_uri``)."""
    if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
        raise TypeError(f"report(metrics=...) must be a dict of str -> number or string, got {metrics!r}")
    clash = sorted(set(metrics) & set(RESERVED_METRICS))
    if clash:
        raise ValueError(f"report(metrics) has {clash}: every record carries {list(RESERVED_METRICS)} already; "
                         "rename those metrics (e.g. 'rank' -> 'my_rank')")
    if checkpoint is not None:
        directory = _local_directory(checkpoint)
        config = default_config()
        if config is None:
            raise ValueError("report(metrics, checkpoint=...) needs a location for checkpoints: give the trainer "
                             "run_config=RunConfig(storage_path=..., name=...) or checkpoint_uri=...")
        rank = er.rank() if er.is_initialized() else 0  # outside a ring (a plain script): this process is rank 0
        if rank == 0:
            store = ReportedCheckpoints(config.uri, config.keep_last, run_id=config.run_id,
                                        signing_key=config.signing_key)
            seq, url = store.save(directory, metrics)
            _log.info("reported checkpoint %d written to %s", seq, url)
        elif not _warned_rank[0]:
            _warned_rank[0] = True
            warnings.warn(f"report(checkpoint=...) on rank {rank}: only rank 0's checkpoint is kept (Ray Train "
                          "merges every rank's directory); write what every rank needs from rank 0",
                          UserWarning, stacklevel=2)
    er.report(**metrics)


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


def _fetch_reported(uri: str, signing_key: bytes | None = None, seq: int | None = None) -> tuple[int, str] | None:
    """The newest verified reported checkpoint at ``uri`` (or number ``seq``) in a local directory: (seq, dir);
    downloaded once per process and number."""
    store = ReportedCheckpoints(uri, signing_key=signing_key)
    with _lock:
        complete = store.complete()
        if seq is not None and seq not in complete:
            raise CheckpointError(f"there is no reported checkpoint {seq} under {uri}/{SUBDIR} (it was pruned, or "
                                  f"never completed); the complete ones are {complete}")
        wanted = seq if seq is not None else (complete[-1] if complete else None)
        if wanted is not None and (uri, wanted) in _downloads:
            return wanted, _downloads[(uri, wanted)]

        def dest(n: int) -> str:
            return os.path.join(_tmp(), f"{len(_downloads)}-{n}")

        if seq is not None:
            path = dest(seq)
            store.download(seq, path)
            found = (seq, path, None)
        else:
            found = store.newest(dest)
        if found is None:
            return None
        _downloads[(uri, found[0])] = found[1]
        return found[0], found[1]


def get_checkpoint() -> Any:
    """The checkpoint to resume from: the newest verified reported checkpoint at this run's location (written by
    this run or an earlier one there), as a ``ray.train.Checkpoint`` of a local directory; None if there is none
    (or the run has no location)."""
    config = default_config()
    if config is None:
        return None
    found = _fetch_reported(config.uri, config.signing_key)
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
        spec = er.runtime.current().spec
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

    A state checkpoint (``ckpt-*``, or a location holding any) returns its state tree: a dict with one entry per
    state value (``tree["model"]``, ``tree["optimizer"]``: their state_dicts). A reported checkpoint (or a location
    holding only those) returns the path of a local directory holding its verified files. Raises
    :class:`state.CheckpointError` naming the location when there is nothing, or nothing valid;
    :class:`state.CheckpointRefused` for another job's checkpoint."""
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
    if store.complete():
        loaded = store.load_latest()
        assert loaded is not None
        return loaded[0]
    found = _fetch_reported(location, signing_key)
    if found is None:
        raise CheckpointError(f"there is no complete checkpoint at {location} (no ckpt-* directory with a manifest, no "
                              f"reported checkpoint under {SUBDIR}/); was it this run's checkpoint_uri?")
    return found[1]


def _reported(location: str, seq: int, signing_key: bytes | None) -> str:
    found = _fetch_reported(location, signing_key, seq)
    assert found is not None
    return found[1]
