"""Reported checkpoints: directories of the user's own files (Ray Train's ``report(metrics, checkpoint=...)``),
kept beside the state's checkpoints at the same location, written and read with the same guarantees.

Layout under the location ``uri`` (the state's ``ckpt-*`` directories and lease sit at its root)::

    reported/ckpt-000000000004/CLAIM.json       run id of the writer; its conditional create claims number 4
    reported/ckpt-000000000004/files/...        the user's files, as in the directory they reported
    reported/ckpt-000000000004/MANIFEST.json    format, seq, run id, every file's size and sha256, the metrics;
                                                written last

A reported checkpoint exists only once its manifest does; the manifest is written after every file was
written, fsynced and read back with the right size and sha256. A reader verifies every file against the
manifest before it hands the directory out. Pruning keeps the ``keep_last`` newest (the rule of
:func:`~state.checkpoint_policy.plan_prune`), manifest first. A run writes only while it holds the location's
lease (or while no lease exists); a run that was given its lease's generation
(:func:`with_lease_generation`) writes only while that generation is the current one, checked before the first
byte, again just before the manifest is published and once after (unpublishing it when the lease moved on
meanwhile). What no check closes on an object store (no conditional write ties the manifest to the lease
object): a lease taken over between the last check and the manifest's write, when the writer then dies before
its check after the write; a reader may then find that manifest, written by a run whose lease had just expired.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import socket
import time
import uuid
from typing import Any

from elastic_ring.core.log import get_logger

from . import checkpoint_lease
from .checkpoint_errors import CheckpointCorrupt, CheckpointError, CheckpointRefused
from .checkpoint_io import READ_CHUNK_BYTES, Location
from .checkpoint_policy import (
    Entry, CheckpointConfig, check_checkpoint_uri, check_signing_key, next_sequence, parse_checkpoint_dir, plan_prune,
)

FORMAT = "elastic_ring.reported/1"
SUBDIR, FILES, MANIFEST, CLAIM = "reported", "files", "MANIFEST.json", "CLAIM.json"
#: The most files one reported checkpoint may hold (the manifest lists each).
MAX_FILES = 10_000
#: How many times :meth:`ReportedCheckpoints.newest` lists again after finding the checkpoint it read pruned.
LIST_ATTEMPTS = 5
_GENERATION_ATTR = "_er_lease_generation"

_log = get_logger(__name__)


def default_config() -> CheckpointConfig | None:
    """The checkpointing this process was given by the worker runtime (``ElasticTrainer``'s checkpoint options:
    location, keep_last, run id), or None when the run has no ``checkpoint_uri``."""
    from .state import default_checkpointing  # (state.py imports the samplers, torch: only when asked)

    return default_checkpointing()


def with_lease_generation(config: CheckpointConfig, generation: int | None) -> CheckpointConfig:
    """``config`` carrying the generation of the lease its run holds on ``config.uri`` (the driver's), so that the
    workers' reported-checkpoint writes are fenced by it. Kept beside the dataclass's fields (it travels with the
    object when pickled; ``dataclasses.asdict`` and ``==`` do not see it)."""
    if generation is not None and (isinstance(generation, bool) or not isinstance(generation, int) or generation < 1):
        raise ValueError(f"lease generation={generation!r} must be None or an int >= 1")
    object.__setattr__(config, _GENERATION_ATTR, generation)
    return config


def lease_generation(config: CheckpointConfig | None) -> int | None:
    """The lease generation :func:`with_lease_generation` attached to ``config``, or None."""
    return getattr(config, _GENERATION_ATTR, None)


def manifest_digest(manifest: dict) -> str:
    """A checkpoint's identity: the sha256 of its manifest (canonical JSON). A location deleted and written again
    gives its checkpoints other digests (run id, time, files), though their numbers repeat."""
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(canonical).hexdigest()


class ReportedCheckpoints:
    """The reported checkpoints under location ``uri``. ``run_id`` names this run in what it writes;
    ``lease_generation``: the generation of the lease this run holds on ``uri`` (None: no fence beyond refusing
    another live run's lease)."""

    def __init__(self, uri: str, keep_last: int = 3, *, run_id: str | None = None,
                 signing_key: bytes | None = None, lease_generation: int | None = None) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last={keep_last!r} must be an int >= 1")
        if lease_generation is not None and (isinstance(lease_generation, bool) or not isinstance(lease_generation, int)
                                             or lease_generation < 1):
            raise ValueError(f"lease_generation={lease_generation!r} must be None or an int >= 1")
        check_signing_key(signing_key)
        self.uri = check_checkpoint_uri(uri, "checkpoint uri")
        self.keep_last, self._key, self.lease_generation = keep_last, signing_key, lease_generation
        self.run_id = run_id if run_id is not None else f"local-{uuid.uuid4().hex[:12]}"
        self.top = Location(self.uri)  # the location's root: where the lease is
        self.loc = Location(f"{self.uri}/{SUBDIR}")

    # ------------------------------------------------------------ names
    def _dir(self, seq: int) -> str:
        return self.loc.path(f"ckpt-{seq:012d}")

    def files_url(self, seq: int) -> str:
        """The URL of checkpoint ``seq``'s files (what ``Checkpoint.path`` names)."""
        return self.loc.url(f"{self._dir(seq)}/{FILES}")

    def _sequences(self) -> list[int]:
        return sorted(s for s in map(parse_checkpoint_dir, self.loc.names()) if s is not None)

    def complete(self) -> list[int]:
        """Sequence numbers whose manifest exists, ascending."""
        return [s for s in self._sequences() if self.loc.exists(f"{self._dir(s)}/{MANIFEST}")]

    # ------------------------------------------------------------ write
    def save(self, directory: str, metrics: dict | None = None) -> tuple[int, str]:
        """Upload the files under local ``directory`` as the newest reported checkpoint, verify them, publish
        the manifest, prune older ones; returns (seq, files URL). Raises :class:`CheckpointError` naming the
        location, the cause and the fix (a failed write leaves no checkpoint behind)."""
        files = _local_files(directory)
        seq = None
        try:
            self._check_lease()
            seq = self._claim()
            base = self._dir(seq)
            listed = {}
            for rel in files:
                listed[rel] = self._upload(os.path.join(directory, rel), f"{base}/{FILES}/{rel}")
            for rel, entry in listed.items():  # read back: storage that corrupts fails the write, unpublished
                if self.loc.sha256(f"{base}/{FILES}/{rel}") != (entry["bytes"], entry["sha256"]):
                    raise CheckpointCorrupt(f"{self.loc.url(base)}/{FILES}/{rel} reads back different from what "
                                            "was written (storage corrupts data?)")
            manifest = {"format": FORMAT, "seq": seq, "run_id": self.run_id, "created_unix_s": time.time(),
                        "files": listed, "metrics": metrics or {}}
            if self._key is not None:
                manifest["hmac_sha256"] = self._sign(manifest)
            body = json.dumps(manifest, indent=1, default=str).encode()
            self._check_lease()  # the upload may have taken minutes: is the location still this run's?
            self.loc.write_small(f"{base}/{MANIFEST}", body)
            if self.loc.read_bytes(f"{base}/{MANIFEST}", limit=64 << 20) != body:
                raise CheckpointCorrupt(f"{self.loc.url(base)}/{MANIFEST} reads back different from what was written")
            self._check_lease()  # lost while publishing: unpublished below
        except Exception as exc:
            if seq is not None:
                self._remove(seq)
            cause = str(exc) if isinstance(exc, (OSError, CheckpointError)) else f"{type(exc).__name__}: {exc}"
            fix = " Free space or fix permissions there, or use another location." if isinstance(exc, OSError) else ""
            raise CheckpointError(f"writing reported checkpoint {seq if seq is not None else ''} under "
                                  f"{self.loc.url(self.loc.root)} failed: {cause}; no checkpoint was published "
                                  f"(a torn write is never loaded).{fix}") from exc
        try:
            self._prune(seq)
        except Exception as exc:  # the checkpoint itself is safe
            _log.warning("reported checkpoint %s was written, but removing older ones failed: %s", seq, exc)
        return seq, self.files_url(seq)

    def _check_lease(self) -> None:
        holder = checkpoint_lease.read_holder(self.top)
        if self.lease_generation is not None:
            held = (holder is not None and holder.get("run_id") == self.run_id and not holder.get("released")
                    and holder.get("generation") == self.lease_generation)
            if not held:
                now = ("no lease at all" if holder is None else
                       f"generation {holder.get('generation')!r} of run {holder.get('run_id')!r}"
                       f"{', released' if holder.get('released') else ''}")
                raise CheckpointError(f"this run {self.run_id!r} no longer holds the lease on checkpoint location "
                                      f"{self.uri} (it held generation {self.lease_generation}; now: {now}): the "
                                      "lease expired or another run took the location over, so this run must not "
                                      "publish there; the driver stops the run (CheckpointLeaseLost)")
            return
        if holder is not None and not holder.get("released") and holder.get("run_id") != self.run_id:
            raise CheckpointError(f"checkpoint location {self.uri} is leased by run {holder.get('run_id')!r} "
                                  f"(host {holder.get('host')}, pid {holder.get('pid')}), not by this run "
                                  f"{self.run_id!r}; two jobs must not share a location: give this one its own "
                                  "RunConfig(storage_path=..., name=...) / checkpoint_uri")

    def _claim(self) -> int:
        claim = json.dumps({"run_id": self.run_id, "host": socket.gethostname(), "pid": os.getpid()}).encode()
        self.loc.makedirs(self.loc.root)
        for _ in range(1000):
            seq = next_sequence(self._sequences())
            if self.loc.local:
                self.loc.makedirs(self._dir(seq))
            if self.loc.create_exclusive(f"{self._dir(seq)}/{CLAIM}", claim):
                self.loc.fsync_dir(self.loc.root)
                return seq
        raise CheckpointError(f"could not claim a reported checkpoint number under {self.uri} in 1000 tries")

    def _upload(self, source: str, target: str) -> dict:
        """Copy one local file to ``target`` in chunks, hashing on the way; fsynced where local."""
        sha, size = hashlib.sha256(), 0
        parent = target.rsplit("/", 1)[0]
        if self.loc.local:
            self.loc.makedirs(parent)
        with open(source, "rb") as src, self.loc.fs.open(target, "wb") as dst:
            while chunk := src.read(READ_CHUNK_BYTES):
                sha.update(chunk)
                size += len(chunk)
                dst.write(chunk)
            self.loc.fsync_file(dst)
        self.loc.fsync_dir(parent)
        return {"bytes": size, "sha256": sha.hexdigest()}

    def _sign(self, manifest: dict) -> str:
        body = {k: v for k, v in manifest.items() if k != "hmac_sha256"}
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()
        return hmac.new(self._key, canonical, hashlib.sha256).hexdigest()

    # ------------------------------------------------------------ prune
    def _run_of(self, seq: int, name: str) -> str | None:
        try:
            run_id = json.loads(self.loc.read_bytes(f"{self._dir(seq)}/{name}", limit=64 << 20)).get("run_id")
        except (OSError, ValueError, AttributeError):
            return None
        return run_id if isinstance(run_id, str) else None

    def _prune(self, newest: int) -> None:
        holder = checkpoint_lease.read_holder(self.top)
        lease_held = holder is not None and holder.get("run_id") == self.run_id and not holder.get("released")
        entries = []
        for seq in self._sequences():
            complete = self.loc.exists(f"{self._dir(seq)}/{MANIFEST}")
            entries.append(Entry(seq, self._run_of(seq, MANIFEST if complete else CLAIM), complete))
        for seq in plan_prune(entries, newest, self.run_id, self.keep_last, lease_held):
            self._remove(seq)

    def _remove(self, seq: int) -> None:
        """Unpublish (manifest first, durably), then delete the rest; a failure is logged, the next prune retries."""
        base = self._dir(seq)
        try:
            self.loc.remove(f"{base}/{MANIFEST}")
            if self.loc.local and os.path.isdir(base):
                self.loc.fsync_dir(base)
            self.loc.remove_tree(base)
        except OSError as exc:
            _log.warning("could not remove reported checkpoint %s: %s; the next prune retries", self.loc.url(base), exc)

    # ------------------------------------------------------------ read
    def manifest(self, seq: int) -> dict:
        """Checkpoint ``seq``'s manifest, checked (format, file list, signature)."""
        path = f"{self._dir(seq)}/{MANIFEST}"
        try:
            manifest = json.loads(self.loc.read_bytes(path, limit=64 << 20))
        except (OSError, ValueError) as exc:
            raise CheckpointCorrupt(f"reported checkpoint manifest {self.loc.url(path)} is unreadable: {exc}") from exc
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            found = manifest.get("format") if isinstance(manifest, dict) else None
            raise CheckpointRefused(f"{self.loc.url(path)} is not an elastic_ring reported checkpoint (format "
                                    f"{found!r}, expected {FORMAT!r}); point the location at this job's checkpoints")
        files = manifest.get("files")
        if not isinstance(files, dict) or not all(
                isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
                and _safe_relpath(rel) for rel, e in files.items()):
            raise CheckpointCorrupt(f"reported checkpoint manifest {self.loc.url(path)} does not describe its files")
        clash = _path_clash(files)
        if clash is not None:
            raise CheckpointCorrupt(f"reported checkpoint manifest {self.loc.url(path)} does not describe its files: "
                                    f"it lists {clash[0]!r} as a file and {clash[1]!r} inside it")
        if self._key is not None:
            given = manifest.get("hmac_sha256")
            if not isinstance(given, str) or not hmac.compare_digest(given, self._sign(manifest)):
                raise CheckpointRefused(f"reported checkpoint manifest {self.loc.url(path)} is "
                                        f"{'not signed' if given is None else 'signed with another key'}")
        return manifest

    def check_sizes(self, seq: int) -> dict:
        """The manifest, after checking that every listed file exists with its size (no read of the data)."""
        manifest = self.manifest(seq)
        base = f"{self._dir(seq)}/{FILES}"
        for rel, entry in manifest["files"].items():
            try:
                size = self.loc.size(f"{base}/{rel}")
            except OSError as exc:
                raise CheckpointCorrupt(f"{self.loc.url(base)}/{rel} is missing or unreadable: {exc}") from exc
            if size != entry["bytes"]:
                raise CheckpointCorrupt(f"{self.loc.url(base)}/{rel} has {size} bytes, its manifest says "
                                        f"{entry['bytes']}")
        return manifest

    def download(self, seq: int, dest: str, manifest: dict | None = None) -> dict:
        """Copy checkpoint ``seq``'s files into the new local directory ``dest``, verifying every size and sha256
        against ``manifest`` (read now when None); returns the manifest. :class:`CheckpointCorrupt` (``dest``
        removed) when anything does not match."""
        manifest = self.manifest(seq) if manifest is None else manifest
        base = f"{self._dir(seq)}/{FILES}"
        os.makedirs(dest)
        try:
            for rel, entry in manifest["files"].items():
                local = os.path.join(dest, *rel.split("/"))
                os.makedirs(os.path.dirname(local), exist_ok=True)
                sha, size = hashlib.sha256(), 0
                try:
                    with self.loc.fs.open(f"{base}/{rel}", "rb") as src, open(local, "wb") as dst:
                        while chunk := src.read(READ_CHUNK_BYTES):
                            sha.update(chunk)
                            size += len(chunk)
                            dst.write(chunk)
                except OSError as exc:
                    raise CheckpointCorrupt(f"{self.loc.url(base)}/{rel} is unreadable: {exc}") from exc
                if (size, sha.hexdigest()) != (entry["bytes"], entry["sha256"]):
                    raise CheckpointCorrupt(f"{self.loc.url(base)}/{rel} is corrupt: {size} bytes, checksum does "
                                            "not match its manifest")
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        return manifest

    def newest(self, dest_for: Any, skip_above: int | None = None, *,
               reuse: Any = None) -> tuple[int, str, dict] | None:
        """The newest reported checkpoint that verifies, downloaded into ``dest_for(seq)`` (a new local directory
        path): (seq, that directory, manifest), or None when there is none. ``reuse(seq, manifest)``, if given,
        may return a local directory already verified against that manifest instead (no download). A damaged one
        is skipped with a warning; another job's stops the search with :class:`CheckpointRefused`. One found pruned
        while it was read (the writer moved on) means newer ones exist: the listing is read again, from the newest
        (up to :data:`LIST_ATTEMPTS` times, then :class:`CheckpointError`)."""
        errors: dict[int, str] = {}
        for _ in range(LIST_ATTEMPTS):
            found, pruned = self._newest_once(dest_for, skip_above, reuse, errors)
            if not pruned:
                break
        else:
            raise CheckpointError(f"the reported checkpoints under {self.loc.url(self.loc.root)} were pruned while "
                                  f"they were read, {LIST_ATTEMPTS} times in a row (a writer saving faster than they "
                                  "download?); try again, or raise CheckpointConfig(num_to_keep=...)")
        if found is not None:
            return found
        if errors:
            raise CheckpointError(f"no valid reported checkpoint under {self.loc.url(self.loc.root)}: "
                                  + "; ".join(errors.values()))
        return None

    def _newest_once(self, dest_for: Any, skip_above: int | None, reuse: Any,
                     errors: dict[int, str]) -> tuple[tuple[int, str, dict] | None, bool]:
        """One pass over the listing, newest first: (found or None, whether one was found pruned)."""
        for seq in reversed(self.complete()):
            if skip_above is not None and seq > skip_above or seq in errors:
                continue
            try:
                manifest = self.manifest(seq)
                local = reuse(seq, manifest) if reuse is not None else None
                if local is None:
                    local = dest_for(seq)
                    self.download(seq, local, manifest)
                return (seq, local, manifest), False
            except CheckpointCorrupt as exc:
                if not self.loc.exists(f"{self._dir(seq)}/{MANIFEST}"):
                    return None, True  # pruned while it was read: newer ones were written, list again
                errors[seq] = str(exc)
                _log.warning("%s; falling back to the previous reported checkpoint", exc)
        return None, False


def _safe_relpath(rel: object) -> bool:
    """A manifest's file name: relative, '/'-separated, no '..' (a forged manifest must not write elsewhere)."""
    return (isinstance(rel, str) and rel != "" and not rel.startswith("/") and "\\" not in rel
            and all(part not in ("", ".", "..") for part in rel.split("/")))


def _path_clash(files: dict) -> tuple[str, str] | None:
    """Two names of a manifest that cannot both be files (``a`` and ``a/b``), or None."""
    names = set(files)
    for rel in sorted(names):
        parts = rel.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if parent in names:
                return parent, rel
    return None


def verify_local(directory: str, manifest: dict) -> bool:
    """True if local ``directory`` holds exactly the files ``manifest`` lists, each with its size and sha256."""
    try:
        present = _local_files(directory)
    except (ValueError, OSError):
        return False
    files = manifest["files"]
    if sorted(files) != present:
        return False
    for rel, entry in files.items():
        sha, size = hashlib.sha256(), 0
        try:
            with open(os.path.join(directory, *rel.split("/")), "rb") as f:
                while chunk := f.read(READ_CHUNK_BYTES):
                    sha.update(chunk)
                    size += len(chunk)
        except OSError:
            return False
        if (size, sha.hexdigest()) != (entry["bytes"], entry["sha256"]):
            return False
    return True


def _local_files(directory: str) -> list[str]:
    """The regular files under local ``directory``, as sorted '/'-separated relative paths."""
    if not isinstance(directory, (str, os.PathLike)) or not os.path.isdir(directory):
        raise ValueError(f"a reported checkpoint must be a local directory; {directory!r} is not one (make it with "
                         "ray.train.Checkpoint.from_directory(d) after writing your files into d)")
    found = []
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for name in names:
            path = os.path.join(root, name)
            if os.path.islink(path) or not os.path.isfile(path):
                raise ValueError(f"reported checkpoint directory {directory} holds {path}, which is not a regular "
                                 "file (a link, a socket...); put plain files in it")
            found.append(os.path.relpath(path, directory).replace(os.sep, "/"))
    if len(found) > MAX_FILES:
        raise ValueError(f"reported checkpoint directory {directory} holds {len(found)} files, over {MAX_FILES}; "
                         "pack them (e.g. one torch.save of a dict)")
    return sorted(found)
