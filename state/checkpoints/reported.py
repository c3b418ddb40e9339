"""Reported checkpoints: directories of the user's own files (Ray Train's ``report(metrics, checkpoint=...)``),
kept beside the state's checkpoints at the same location, written by the same
:class:`~state.checkpoints.sequenced.SequencedWriter` (claim, files, manifest last, lease-generation fence, prune)
and read with the same guarantees.

Layout under the location ``uri`` (the state's ``ckpt-*`` directories and lease sit at its root)::

    reported/ckpt-000000000004/CLAIM.json       run id of the writer; its conditional create claims number 4
    reported/ckpt-000000000004/files/...        the user's files, as in the directory they reported
    reported/ckpt-000000000004/MANIFEST.json    format, seq, run id, every file's size and sha256, the metrics;
                                                written last

A reader verifies every file against the manifest before it hands the directory out. A run that was given its
lease's generation (``CheckpointConfig.lease_generation``) publishes only while that generation is the current one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

from elastic_ring.core.log import get_logger

from ..errors import CheckpointCorrupt, CheckpointError, CheckpointRefused
from ._local_files import copy_hashed, local_files, verify_local  # noqa: F401  (verify_local: for the readers)
from .sequenced import MANIFEST, CheckpointPruneError, Kind, SequencedWriter
from .transport import Location

FORMAT = "elastic_ring.reported/1"
SUBDIR, FILES = "reported", "files"
#: How many times :meth:`ReportedCheckpoints.newest` lists again after finding the checkpoint it read pruned.
LIST_ATTEMPTS = 5
KIND = Kind(format=FORMAT, label="reported checkpoint", lease_fix="RunConfig(storage_path=..., name=...) / checkpoint_uri",
            json_default=str, manifest_limit=64 << 20)

_log = get_logger(__name__)


def manifest_digest(manifest: dict) -> str:
    """A checkpoint's identity: the sha256 of its manifest (canonical JSON). A location deleted and written again
    gives its checkpoints other digests (run id, time, files), though their numbers repeat."""
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(canonical).hexdigest()


class _Files:
    """The payload of a reported checkpoint: the files under a local directory, copied into ``files/``."""

    subdir, fix = FILES, ""

    def __init__(self, directory: str, files: list[str], metrics: dict, upload: Any) -> None:
        self.directory, self.files, self.upload, self.fields = directory, files, upload, {"metrics": metrics}

    def write(self, loc: Location, root: str) -> dict[str, dict]:
        return {rel: self.upload(os.path.join(self.directory, rel), f"{root}/{rel}") for rel in self.files}

    def check(self, loc: Location, root: str) -> None:
        """Nothing beyond the read-back: the files are the user's own."""


class ReportedCheckpoints:
    """The reported checkpoints under location ``uri``. ``run_id`` names this run in what it writes;
    ``lease_generation``: the generation of the lease this run holds on ``uri`` (None: no fence beyond refusing
    another live run's lease)."""

    def __init__(self, uri: str, keep_last: int = 3, *, run_id: str | None = None,
                 signing_key: bytes | None = None, lease_generation: int | None = None) -> None:
        self.writer = SequencedWriter(uri, KIND, subdir=SUBDIR, keep_last=keep_last, run_id=run_id,
                                      signing_key=signing_key, lease_generation=lease_generation)
        self.uri, self.keep_last, self.run_id = self.writer.uri, keep_last, self.writer.run_id
        self.lease_generation = lease_generation
        self.top, self.loc = self.writer.top, self.writer.loc

    def files_url(self, seq: int) -> str:
        """The URL of checkpoint ``seq``'s files (what ``Checkpoint.path`` names)."""
        return self.loc.url(f"{self.writer.dir(seq)}/{FILES}")

    def complete(self) -> list[int]:
        """Sequence numbers whose manifest exists, oldest first."""
        return self.writer.complete()

    # ------------------------------------------------------------ write
    def save(self, directory: str, metrics: dict | None = None) -> tuple[int, str]:
        """Upload the files under local ``directory`` as the newest reported checkpoint, verify them, publish
        the manifest, prune older ones; returns (seq, files URL). Raises ``ValueError`` for a directory that cannot
        be a checkpoint, :class:`CheckpointError` naming the location, the cause and the fix (a failed write leaves
        no checkpoint behind)."""
        files = local_files(directory)
        try:
            seq = self.writer.save(_Files(directory, files, metrics or {}, self._upload))
        except CheckpointPruneError as exc:  # the checkpoint itself is safe
            _log.warning("%s", exc)
            seq = exc.seq
        return seq, self.files_url(seq)

    def _upload(self, source: str, target: str) -> dict:
        """Copy one local file to ``target`` in chunks, hashing on the way; fsynced where local."""
        parent = target.rsplit("/", 1)[0]
        if self.loc.local:
            self.loc.makedirs(parent)
        with open(source, "rb") as src, self.loc.fs.open(target, "wb") as dst:
            size, digest = copy_hashed(src, dst)
            self.loc.fsync_file(dst)
        self.loc.fsync_dir(parent)
        return {"bytes": size, "sha256": digest}

    # ------------------------------------------------------------ read
    def manifest(self, seq: int) -> dict:
        """Checkpoint ``seq``'s manifest, checked (format, file list, signature)."""
        path = f"{self.writer.dir(seq)}/{MANIFEST}"
        manifest = self.writer.read_manifest(seq)
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
        self.writer.check_signature(manifest, seq)
        return manifest

    def check_sizes(self, seq: int) -> dict:
        """The manifest, after checking that every listed file exists with its size (no read of the data)."""
        manifest = self.manifest(seq)
        base = f"{self.writer.dir(seq)}/{FILES}"
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
        base = f"{self.writer.dir(seq)}/{FILES}"
        os.makedirs(dest)
        try:
            for rel, entry in manifest["files"].items():
                local = os.path.join(dest, *rel.split("/"))
                os.makedirs(os.path.dirname(local), exist_ok=True)
                try:
                    with self.loc.fs.open(f"{base}/{rel}", "rb") as src, open(local, "wb") as dst:
                        size, digest = copy_hashed(src, dst)
                except OSError as exc:
                    raise CheckpointCorrupt(f"{self.loc.url(base)}/{rel} is unreadable: {exc}") from exc
                if (size, digest) != (entry["bytes"], entry["sha256"]):
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
                if not self.loc.exists(f"{self.writer.dir(seq)}/{MANIFEST}"):
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
