"""Durable checkpoints on any fsspec URL: claimed, streamed, fsynced, verified, then pruned.

Layout under the root URI (see ``docs/checkpoints.md``)::

    LEASE.lock, LEASE.json            file systems: the OS lock and its holder's record (lease_file.py)
    LEASE-000000000003.json           object stores: the lease's current generation (lease_object_store.py)
    ckpt-000000000007/CLAIM.json      run id of the writer; its conditional create claims number 7
    ckpt-000000000007/data.pt         the state tree, streamed by torch.save (hashed on the way)
    ckpt-000000000007/MANIFEST.json   format, seq, run id, size and sha256 of data.pt, meta; written last

A checkpoint exists only once its manifest does. Writing: claim, data (fsync), manifest (fsync,
atomic rename, fsync of the directories), then the new checkpoint is read back and verified, and
only then are older ones pruned: manifest deleted first, then the rest. Loading verifies size and
sha256 (streamed) before anything is unpickled, and unpickles with ``weights_only=True`` unless the
store is ``trusted``. A damaged checkpoint is skipped with a warning naming it; another job's, or
one holding objects a safe load refuses, stops the load with an error saying what to do.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
import socket
import time
import uuid
import warnings
from typing import Any

import torch

from elastic_ring.core.log import get_logger

from . import checkpoint_lease
from .checkpoint_errors import CheckpointCorrupt, CheckpointError, CheckpointPruneError, CheckpointRefused
from .checkpoint_io import HashingWriter, Location
from .checkpoint_policy import (
    Entry, check_checkpoint_uri, check_signing_key, next_sequence, parse_checkpoint_dir, plan_prune,
)

FORMAT = "elastic_ring.checkpoint/2"
_READABLE = ("elastic_ring.checkpoint/1", FORMAT)
MANIFEST, DATA, CLAIM = "MANIFEST.json", "data.pt", "CLAIM.json"

__all__ = ["CheckpointError", "CheckpointStore", "FORMAT"]

_log = get_logger(__name__)

_TRUST_FIX = ("if you trust everyone who can write to this location, set trusted_checkpoints=True "
              "(CheckpointConfig(trusted=True) / enable_checkpoints(..., trusted=True)), or register the classes "
              "with torch.serialization.add_safe_globals([...])")


class CheckpointStore:
    """The checkpoints under ``uri``. ``run_id`` names this run in what it writes (a fresh one if None);
    ``trusted`` loads custom objects (full unpickling) instead of refusing them."""

    def __init__(self, uri: str, keep_last: int = 3, *, run_id: str | None = None, trusted: bool = False,
                 signing_key: bytes | None = None) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last={keep_last!r} must be an int >= 1")
        check_signing_key(signing_key)
        self._key = signing_key
        self.uri = check_checkpoint_uri(uri, "checkpoint uri")
        self.keep_last = keep_last
        self.run_id = run_id if run_id is not None else f"local-{uuid.uuid4().hex[:12]}"
        self.trusted = bool(trusted)
        self.loc = Location(self.uri)
        try:
            self.loc.makedirs(self.loc.root)
        except OSError as exc:
            raise CheckpointError(f"cannot create the checkpoint directory {self.uri}: {exc}") from exc

    @property
    def fs(self):
        return self.loc.fs

    @property
    def root(self) -> str:
        return self.loc.root

    # ------------------------------------------------------------ naming and listing
    def _dir(self, seq: int) -> str:
        return self.loc.path(f"ckpt-{seq:012d}")

    def _url(self, path: str) -> str:
        return self.loc.url(path)

    def _sequences(self) -> list[int]:
        """Sequence numbers of every checkpoint directory, complete or not, ascending."""
        return sorted(s for s in map(parse_checkpoint_dir, self.loc.names()) if s is not None)

    def complete(self) -> list[int]:
        """Sequence numbers whose manifest exists (written to the end), ascending."""
        return [s for s in self._sequences() if self.loc.exists(f"{self._dir(s)}/{MANIFEST}")]

    def entries(self) -> list[Entry]:
        """Every checkpoint directory with its run (from the manifest, or the claim while incomplete)."""
        out = []
        for seq in self._sequences():
            complete = self.loc.exists(f"{self._dir(seq)}/{MANIFEST}")
            out.append(Entry(seq, self._run_of(seq, MANIFEST if complete else CLAIM), complete))
        return out

    def _run_of(self, seq: int, name: str) -> str | None:
        try:
            run_id = json.loads(self.loc.read_bytes(f"{self._dir(seq)}/{name}")).get("run_id")
        except (OSError, ValueError, AttributeError):
            return None  # no claim (an old or torn directory): it belongs to no run we know
        return run_id if isinstance(run_id, str) else None

    def newest_uri(self) -> str | None:
        """URI of the newest complete checkpoint (manifest written), or None."""
        complete = self.complete()
        return self._url(self._dir(complete[-1])) if complete else None

    # ------------------------------------------------------------ write
    def save(self, tree: Any, meta: dict | None = None) -> str:
        """Write ``tree`` as the newest checkpoint, verify it, prune older ones; returns its URI.

        Raises :class:`CheckpointError` naming the location, the cause and the fix (the previous
        checkpoint is untouched), or :class:`CheckpointPruneError` if only the pruning failed."""
        seq = None
        try:
            self._check_lease()
            seq = self._claim()
            directory = self._dir(seq)
            size, digest = self._write_data(f"{directory}/{DATA}", tree)
            self._verify_data(seq, size, digest)
            if not self.trusted:
                self._check_safe(f"{directory}/{DATA}")
            manifest = {"format": FORMAT, "seq": seq, "run_id": self.run_id, "created_unix_s": time.time(),
                        "files": {DATA: {"bytes": size, "sha256": digest}}, "meta": meta or {}}
            if self._key is not None:
                manifest["hmac_sha256"] = self._sign(manifest)
            body = json.dumps(manifest, indent=1).encode()
            self.loc.write_small(f"{directory}/{MANIFEST}", body)
            if self.loc.read_bytes(f"{directory}/{MANIFEST}") != body:
                raise CheckpointCorrupt(f"{self._url(directory)}/{MANIFEST} reads back different from what was written")
        except Exception as exc:  # every failure: clean up what this write left, then say what happened
            if seq is not None:
                self._discard(seq)
            raise self._write_error(exc, seq) from exc
        url = self._url(directory)
        try:
            self._prune(seq)
        except Exception as exc:  # the checkpoint itself is safe; say so, and what failed
            raise CheckpointPruneError(f"checkpoint {url} was written and verified, but removing older checkpoints "
                                       f"failed: {type(exc).__name__}: {exc}; they take space until the next "
                                       "checkpoint prunes them (check permissions on the location)", url) from exc
        return url

    def _write_error(self, exc: Exception, seq: int | None) -> CheckpointError:
        try:
            newest = self.complete()
            previous = f"checkpoint {newest[-1]} is still the newest" if newest else "there is no earlier checkpoint"
        except Exception as list_exc:  # the storage is failing as a whole: say so, keep the write's error
            previous = f"the location cannot be listed either ({type(list_exc).__name__}: {list_exc})"
        what = f"checkpoint {seq}" if seq is not None else "a checkpoint"
        if isinstance(exc, OSError):
            fix = "Free space or fix permissions there, or set another checkpoint_uri"
        elif isinstance(exc, CheckpointError):
            fix = ""
        else:
            fix = ("Keep tensors, numbers, strings, containers and objects with state_dict() in the state, "
                   "or fix the storage backend named in the error")
        cause = str(exc) if isinstance(exc, (OSError, CheckpointError)) else f"{type(exc).__name__}: {exc}"
        message = f"writing {what} under {self.uri} failed: {cause}; {previous} (a torn write is never loaded)."
        error = CheckpointError(f"{message} {fix}" if fix else message)
        error.seq = seq
        return error

    def _check_lease(self) -> None:
        holder = checkpoint_lease.read_holder(self.loc)
        if holder is not None and not holder.get("released") and holder.get("run_id") != self.run_id:
            raise CheckpointError(f"checkpoint location {self.uri} is leased by run {holder.get('run_id')!r} "
                                  f"(host {holder.get('host')}, pid {holder.get('pid')}), not by this run "
                                  f"{self.run_id!r}; two jobs must not share a location: give this one its own "
                                  "checkpoint_uri")

    def _claim(self) -> int:
        claim = json.dumps({"run_id": self.run_id, "host": socket.gethostname(), "pid": os.getpid()}).encode()
        for _ in range(1000):
            seq = next_sequence(self._sequences())
            directory = self._dir(seq)
            if self.loc.local:
                self.loc.makedirs(directory)
            try:
                created = self.loc.create_exclusive(f"{directory}/{CLAIM}", claim)
            except BaseException:
                self._drop_empty_dir(directory)  # a claim that failed (disk full) leaves no directory behind
                raise
            if created:
                self.loc.fsync_dir(self.loc.root)
                return seq
        raise CheckpointError(f"could not claim a checkpoint number under {self.uri} in 1000 tries: "
                              "other writers keep taking them; give each job its own checkpoint_uri")

    def _drop_empty_dir(self, directory: str) -> None:
        """Remove ``directory`` if it is empty (local only; another writer's claim in it keeps it)."""
        if not self.loc.local:
            return
        try:
            os.rmdir(directory)
        except OSError as exc:  # not empty (another claim), or already gone: the next prune handles it
            _log.debug("left %s after a failed claim: %s", directory, exc)

    def _write_data(self, path: str, tree: Any) -> tuple[int, str]:
        with self.loc.fs.open(path, "wb") as f:
            writer = HashingWriter(f)
            try:
                torch.save(tree, writer)
            except Exception as exc:
                if writer.error is not None and writer.error is not exc:
                    raise writer.error from exc  # the storage's own error (ENOSPC...), not torch's wrapper
                raise
            if writer.error is not None:
                raise writer.error
            self.loc.fsync_file(f)
        self.loc.fsync_dir(path.rsplit("/", 1)[0])
        return writer.size, writer.hexdigest()

    def _check_safe(self, path: str) -> None:
        with self.loc.fs.open(path, "rb") as f:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(f)
        if unsafe:
            raise CheckpointRefused(f"the state holds objects that a safe load refuses ({', '.join(sorted(unsafe))}), so "
                                    "this checkpoint could never be resumed by default; keep tensors, numbers, strings, "
                                    f"containers and objects with state_dict() in the state, or, {_TRUST_FIX}")

    def _verify_data(self, seq: int, size: int, digest: str) -> None:
        """Read the data back (streamed) before it is published: storage that corrupts fails the write."""
        directory = self._dir(seq)
        got_size, got_digest = self.loc.sha256(f"{directory}/{DATA}")
        if (got_size, got_digest) != (size, digest):
            raise CheckpointCorrupt(f"{self._url(directory)}/{DATA} reads back as {got_size} bytes with another "
                                    f"checksum than the {size} bytes written (storage corrupts data?)")

    def _discard(self, seq: int) -> None:
        """Remove what a failed write left (manifest first); a failure here is logged, the next prune retries."""
        try:
            self._unpublish(seq)
            self._remove_dir(seq)
        except Exception as exc:  # the write's own error is what the caller raises
            warnings.warn(f"could not remove the failed checkpoint {self._url(self._dir(seq))}: {exc}; "
                          "the next successful checkpoint removes it", RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------ prune
    def _prune(self, newest: int) -> None:
        holder = checkpoint_lease.read_holder(self.loc)
        lease_held = holder is not None and holder.get("run_id") == self.run_id and not holder.get("released")
        doomed = plan_prune(self.entries(), newest, self.run_id, self.keep_last, lease_held)
        for seq in doomed:
            self._unpublish(seq)
            self._remove_dir(seq)
        if doomed:
            self.loc.fsync_dir(self.loc.root)

    def _unpublish(self, seq: int) -> None:
        """Delete the manifest (the checkpoint stops existing), durably, before any of its data."""
        directory = self._dir(seq)
        self.loc.remove(f"{directory}/{MANIFEST}")
        if self.loc.local and os.path.isdir(directory):
            self.loc.fsync_dir(directory)

    def _remove_dir(self, seq: int) -> None:
        self.loc.remove_tree(self._dir(seq))

    # ------------------------------------------------------------ read
    def _manifest(self, seq: int) -> dict:
        path = f"{self._dir(seq)}/{MANIFEST}"
        try:
            manifest = json.loads(self.loc.read_bytes(path))
        except (OSError, ValueError) as exc:
            raise CheckpointCorrupt(f"checkpoint manifest {self._url(path)} is unreadable: {exc}") from exc
        if not isinstance(manifest, dict) or manifest.get("format") not in _READABLE:
            found = manifest.get("format") if isinstance(manifest, dict) else None
            raise CheckpointRefused(f"{self._url(path)} is not an elastic_ring checkpoint (format {found!r}, "
                                    f"expected {FORMAT!r}); point checkpoint_uri at this job's checkpoints")
        entry = manifest.get("files", {}).get(DATA) if isinstance(manifest.get("files"), dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) or not isinstance(entry.get("sha256"), str):
            raise CheckpointCorrupt(f"checkpoint manifest {self._url(path)} does not describe {DATA}")
        if self._key is not None:
            given = manifest.get("hmac_sha256")
            if not isinstance(given, str) or not hmac.compare_digest(given, self._sign(manifest)):
                raise CheckpointRefused(f"checkpoint manifest {self._url(path)} is "
                                        f"{'not signed' if given is None else 'signed with another key'}; it was not "
                                        "loaded. Use the signing_key its run used, or no key to load unsigned ones")
        return manifest

    def _sign(self, manifest: dict) -> str:
        body = {k: v for k, v in manifest.items() if k != "hmac_sha256"}
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self._key, canonical, hashlib.sha256).hexdigest()

    def load(self, seq: int, expected_names: list[str] | None = None) -> tuple[Any, dict]:
        """Read checkpoint ``seq``: :class:`CheckpointCorrupt` if damaged, :class:`CheckpointRefused` if
        it is another job's or holds objects a safe load refuses (both name the file)."""
        directory = self._dir(seq)
        manifest = self._manifest(seq)
        meta = manifest.get("meta") if isinstance(manifest.get("meta"), dict) else {}
        names = meta.get("names")
        if expected_names is not None and names is not None and sorted(names) != sorted(expected_names):
            raise CheckpointRefused(f"checkpoint {self._url(directory)} holds state values {sorted(names)}, but this "
                                    f"state has {sorted(expected_names)}; point checkpoint_uri at this job's checkpoints")
        data_path = f"{directory}/{DATA}"
        expected = manifest["files"][DATA]
        try:
            size, digest = self.loc.sha256(data_path)
        except OSError as exc:
            raise CheckpointCorrupt(f"checkpoint data {self._url(data_path)} is unreadable: {exc}") from exc
        if size != expected["bytes"] or digest != expected["sha256"]:
            raise CheckpointCorrupt(f"checkpoint data {self._url(data_path)} is corrupt: {size} bytes, "
                                    f"checksum does not match its manifest")
        tree = self._unpickle(data_path)
        return tree, {"uri": self._url(directory), "seq": seq, "run_id": manifest.get("run_id"), "meta": meta}

    def _unpickle(self, path: str) -> Any:
        url = self._url(path)
        with self.loc.fs.open(path, "rb") as f:
            if not self.trusted:
                try:
                    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(f)
                except (ValueError, RuntimeError) as exc:  # a TorchScript archive (code), or not torch.save's
                    raise CheckpointRefused(f"checkpoint data {url} was refused: {exc}; it was not loaded, since it "
                                            f"may hold code; {_TRUST_FIX}") from exc
                if unsafe:
                    raise CheckpointRefused(f"checkpoint data {url} holds objects a safe load refuses "
                                            f"({', '.join(sorted(unsafe))}); it was not loaded, since unpickling them "
                                            f"can run code; {_TRUST_FIX}")
                f.seek(0)
            try:
                return torch.load(f, map_location="cpu", weights_only=not self.trusted)
            except pickle.UnpicklingError as exc:
                if self.trusted:
                    raise CheckpointCorrupt(f"checkpoint data {url} cannot be unpickled: {exc}") from exc
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise CheckpointRefused(f"checkpoint data {url} was refused by the safe (weights_only) load: {first}; "
                                        f"{_TRUST_FIX}") from exc
            except (RuntimeError, EOFError, OSError) as exc:
                raise CheckpointCorrupt(f"checkpoint data {url} cannot be loaded: {exc}") from exc

    def load_latest(self, expected_names: list[str] | None = None) -> tuple[Any, dict] | None:
        """The newest valid checkpoint of any run, falling back (with a warning) past damaged ones;
        None if there is none. Stops with :class:`CheckpointRefused` at a foreign or unsafe one."""
        errors = []
        for seq in reversed(self.complete()):
            try:
                return self.load(seq, expected_names)
            except CheckpointCorrupt as exc:
                errors.append(str(exc))
                warnings.warn(f"{exc}; falling back to the previous checkpoint", RuntimeWarning, stacklevel=2)
        if errors:
            raise CheckpointError("no valid checkpoint under " + self.uri + ": " + "; ".join(errors))
        return None
