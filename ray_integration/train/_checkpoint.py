"""Ray Train's checkpoints: ``get_checkpoint()`` inside the training function, and ``load_checkpoint`` to read a
run's checkpoints afterwards (on the driver, or anywhere).

* ``get_checkpoint()``: the newest verified reported checkpoint at the run's location (this run's, or an earlier
  run's: resuming after a whole-cluster loss), downloaded into a local directory; None when there is none.
* ``load_checkpoint(source)``: a reported checkpoint's files in a new local directory, or a state checkpoint's tree.
* :func:`as_ray_checkpoint` / :func:`checkpoint_url`: a URL as a ``ray.train.Checkpoint`` and back
  (``Result.checkpoint``).
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import tempfile
import threading
import time
from typing import Any

from elastic_ring.core.log import get_logger
from state import CheckpointError, CheckpointRefused
from state.checkpoints.config import default_checkpointing as default_config
from state.checkpoints.hooks import listener as checkpoint_listener
from state.checkpoints.policy import parse_checkpoint_dir
from state.checkpoints.reported import FILES, SUBDIR, ReportedCheckpoints, manifest_digest, verify_local
from state.checkpoints.sequenced import MANIFEST
from state.checkpoints.store import READABLE as STATE_FORMATS, CheckpointStore
from state.checkpoints.transport import Location

from ..errors import InputUnavailable

_log = get_logger(__name__)

_lock = threading.Lock()
#: get_checkpoint's downloads: (location, seq, manifest digest) -> the local directory it was verified into.
_downloads: dict[tuple[str, int, str], str] = {}
_names = itertools.count()
_tmp_root: str | None = None


def ray_checkpoint_class() -> type:
    """``ray.train.Checkpoint`` (imported when first needed: importing ray_integration does not import ray.train)."""
    from ray.train import Checkpoint

    return Checkpoint


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
    copy: handed out again while its files match the checkpoint's manifest, downloaded again otherwise.

    A location that cannot be read now (a listing or a download failing, the newest checkpoint pruned while it was
    read, every one damaged) is read again with backoff for :data:`GET_CHECKPOINT_RETRY_S`, each failure a
    ``checkpoint_read_failed`` event; then this worker leaves the job as a lost worker (``InputUnavailable``, named
    in its ``worker_lost`` event) and is replaced: a fault of the location never ends a healthy job (the ring's
    live state reaches a replacement by the sync anyway). Another job's checkpoint is refused at once."""
    config = default_config()
    if config is None:
        return None
    found = _read_with_retries(config.uri, lambda: _fetch_reported(config.uri, config.signing_key, cache=True))
    return None if found is None else ray_checkpoint_class().from_directory(found[1])


#: How long ``get_checkpoint()`` reads the run's location again after failures before the worker gives up.
GET_CHECKPOINT_RETRY_S = 30.0
#: The first wait between those reads (doubling, at most 4 s).
GET_CHECKPOINT_FIRST_WAIT_S = 0.5


def _read_with_retries(uri: str, read: Any) -> Any:
    started = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return read()
        except CheckpointRefused:
            raise  # another job's checkpoint, or one signed with another key: reading again changes nothing
        except (OSError, CheckpointError) as exc:
            waited = time.monotonic() - started
            wait = min(4.0, GET_CHECKPOINT_FIRST_WAIT_S * 2 ** (attempt - 1))
            _notify({"kind": "checkpoint_read_failed", "uri": uri, "attempt": attempt,
                     "error": f"{type(exc).__name__}: {exc}"[:500]})
            if waited + wait > GET_CHECKPOINT_RETRY_S:
                raise InputUnavailable(
                    f"get_checkpoint() could not read the reported checkpoints at {uri} in {attempt} tries over "
                    f"{waited:.0f} s (the last: {type(exc).__name__}: {exc}); this worker leaves the job as a lost "
                    "worker and is replaced (the ring's live state reaches its replacement by the sync); check the "
                    "storage behind the run's location") from exc
            _log.warning("get_checkpoint(): reading %s failed (%s: %s); trying again in %.1f s", uri,
                         type(exc).__name__, exc, wait)
            time.sleep(wait)


def _notify(event: dict) -> None:
    """An event in the run's result (the worker runtime forwards checkpoint events to the driver)."""
    listener = checkpoint_listener()
    if listener is not None:
        try:
            listener(event)
        except Exception as exc:  # the event is a courtesy: the read's own outcome decides
            _log.warning("could not send %s: %s", event.get("kind"), exc)



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
    Checkpoint = ray_checkpoint_class()
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
    if isinstance(source, ray_checkpoint_class()):  # before os.PathLike: a Checkpoint's __fspath__ raises
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
    if len(parts) >= 3 and parts[-2] == SUBDIR and parse_checkpoint_dir(parts[-1]) is not None \
            and not _is_state_checkpoint(url):  # (a state checkpoint of a location whose last part is "reported")
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


def _is_state_checkpoint(url: str) -> bool:
    """The checkpoint directory ``url`` holds a state checkpoint (its manifest says so), not a reported one."""
    loc = Location(url)
    try:
        manifest = json.loads(loc.read_bytes(loc.path(MANIFEST), 1 << 20))
    except (OSError, ValueError):
        return False  # no readable manifest: read it as the reported checkpoint its path names (which says why not)
    return isinstance(manifest, dict) and manifest.get("format") in STATE_FORMATS


def _reported(location: str, seq: int, signing_key: bytes | None) -> str:
    found = _fetch_reported(location, signing_key, seq)
    assert found is not None
    return found[1]
