"""Durable checkpoints on any fsspec URL, written atomically, newest valid one first.

Layout under the root URI::

    ckpt-000000000007/data.pt         the state tree (torch.save), written first
    ckpt-000000000007/MANIFEST.json   format, sequence number, size and sha256 of data.pt, meta; written last

A checkpoint exists only once its manifest does, so a write torn at any point
is never taken as the latest. Both files are written to a temporary name and
moved into place. On a local filesystem the move is atomic, and a ``filelock``
serialises writers sharing the directory (sequence numbers, pruning). On
object stores (s3://, gs://) one PUT is atomic and the manifest-last rule
still holds. Loading verifies size and checksum. A damaged newest checkpoint
is reported with its path, and loading falls back to the previous valid one;
if none is valid, it raises :class:`CheckpointError` naming the files.
Checkpoints are trusted input (``torch.load`` unpickles them).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import time
import uuid
import warnings
from typing import Any

import filelock
import fsspec
import torch

FORMAT = "elastic_ring.checkpoint/1"
_DIR = re.compile(r"ckpt-(\d{12})$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file."""


class CheckpointStore:
    def __init__(self, uri: str, keep_last: int = 3) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be >= 1")
        self.uri = uri.rstrip("/")
        self.keep_last = keep_last
        self.fs, self.root = fsspec.core.url_to_fs(self.uri)
        self._local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        try:
            self.fs.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot create the checkpoint directory {self.uri}: {exc}") from exc

    # ------------------------------------------------------------ naming
    def _dir(self, seq: int) -> str:
        return f"{self.root}/ckpt-{seq:012d}"

    def _url(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    def _sequences(self) -> list[int]:
        """Sequence numbers of every checkpoint directory, complete or not, ascending."""
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            m = _DIR.search(entry.rstrip("/"))
            if m:
                found.append(int(m.group(1)))
        return sorted(found)

    def complete(self) -> list[int]:
        """Sequence numbers whose manifest exists (written to the end), ascending."""
        return [s for s in self._sequences() if self.fs.exists(f"{self._dir(s)}/MANIFEST.json")]

    @contextlib.contextmanager
    def _writer_lock(self):
        if self._local:
            with filelock.FileLock(f"{self.root}/.writer.lock", timeout=300):
                yield
        else:
            yield

    def _write_atomic(self, path: str, data: bytes) -> None:
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
        self.fs.mv(tmp, path)

    # ------------------------------------------------------------ write
    def save(self, tree: Any, meta: dict | None = None) -> str:
        """Write ``tree`` as the newest checkpoint; returns its URI."""
        buffer = io.BytesIO()
        torch.save(tree, buffer)
        data = buffer.getvalue()
        digest = hashlib.sha256(data).hexdigest()
        try:
            with self._writer_lock():
                existing = self._sequences()
                seq = (existing[-1] + 1) if existing else 1
                directory = self._dir(seq)
                self.fs.makedirs(directory, exist_ok=True)
                self._write_atomic(f"{directory}/data.pt", data)
                manifest = {"format": FORMAT, "seq": seq, "created_unix_s": time.time(),
                            "files": {"data.pt": {"bytes": len(data), "sha256": digest}}, "meta": meta or {}}
                self._write_atomic(f"{directory}/MANIFEST.json", json.dumps(manifest, indent=1).encode())
                self._prune(seq)
        except OSError as exc:
            newest = self.complete()
            previous = f"checkpoint {newest[-1]} is still the newest" if newest else "there is no earlier checkpoint"
            raise CheckpointError(f"writing a checkpoint under {self.uri} failed: {exc}; {previous} (a torn write is "
                                  "never loaded). Free space or fix permissions there, or set another "
                                  "checkpoint_uri") from exc
        return self._url(directory)

    def _prune(self, newest: int) -> None:
        keep = set(self.complete()[-self.keep_last:])
        for seq in self._sequences():
            if seq not in keep and seq < newest:
                self.fs.rm(self._dir(seq), recursive=True)

    # ------------------------------------------------------------ read
    def load(self, seq: int, expected_names: list[str] | None = None) -> tuple[Any, dict]:
        """Read checkpoint ``seq``; raises :class:`CheckpointError` naming the damaged file."""
        directory = self._dir(seq)
        manifest_path = f"{directory}/MANIFEST.json"
        try:
            with self.fs.open(manifest_path, "rb") as f:
                manifest = json.loads(f.read())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"checkpoint manifest {self._url(manifest_path)} is unreadable: {exc}") from exc
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"{self._url(manifest_path)} is not an elastic_ring checkpoint "
                                  f"(format {manifest.get('format') if isinstance(manifest, dict) else None!r}, expected {FORMAT!r})")
        data_path = f"{directory}/data.pt"
        expected = manifest["files"]["data.pt"]
        try:
            with self.fs.open(data_path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise CheckpointError(f"checkpoint data {self._url(data_path)} is unreadable: {exc}") from exc
        if len(data) != expected["bytes"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
            raise CheckpointError(f"checkpoint data {self._url(data_path)} is corrupt: {len(data)} bytes, "
                                  f"checksum does not match its manifest")
        tree = torch.load(io.BytesIO(data), weights_only=False)
        names = manifest.get("meta", {}).get("names")
        if expected_names is not None and names is not None and sorted(names) != sorted(expected_names):
            raise CheckpointError(f"checkpoint {self._url(directory)} holds state values {sorted(names)}, "
                                  f"but this state has {sorted(expected_names)}; point checkpoint_uri at this job's checkpoints")
        return tree, {"uri": self._url(directory), "seq": seq, "meta": manifest.get("meta", {})}

    def newest_uri(self) -> str | None:
        """URI of the newest complete checkpoint (manifest written), or None."""
        complete = self.complete()
        return self._url(self._dir(complete[-1])) if complete else None

    def load_latest(self, expected_names: list[str] | None = None) -> tuple[Any, dict] | None:
        """The newest valid checkpoint, falling back (with a warning) past damaged ones; None if there is none."""
        complete = self.complete()
        errors = []
        for seq in reversed(complete):
            try:
                return self.load(seq, expected_names)
            except CheckpointError as exc:
                if "holds state values" in str(exc):
                    raise
                errors.append(str(exc))
                warnings.warn(f"{exc}; falling back to the previous checkpoint", RuntimeWarning, stacklevel=2)
        if errors:
            raise CheckpointError("no valid checkpoint under " + self.uri + ": " + "; ".join(errors))
        return None
