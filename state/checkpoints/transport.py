"""The storage primitives of durable checkpoints, for a local disk and for object stores alike.

* :class:`Location`: one fsspec filesystem and root. On a local filesystem it fsyncs files and
  their directories and replaces small files atomically (temporary name, fsync, rename, fsync of
  the directory). On an object store a PUT is atomic, so final keys are written directly.
* ``create_exclusive``: a conditional create (``O_EXCL`` locally, ``If-None-Match`` on S3 through
  fsspec's ``"xb"`` mode), the primitive that claims sequence numbers and lease generations.
* :class:`HashingWriter`: the file object ``torch.save`` streams into; it hashes and counts on the
  way and hands the file system bounded chunks, so no copy of the state builds up in memory.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from typing import IO, Any

import fsspec

from elastic_ring.core.log import get_logger

_log = get_logger(__name__)

#: Bytes handed to the file system per write (slices of torch's buffers: no copy).
CHUNK_BYTES = 8 << 20
#: Bytes read per chunk when hashing a file (one reused buffer).
READ_CHUNK_BYTES = 1 << 20


class HashingWriter:
    """Write-only file object: forwards bounded chunks to ``f``, keeping a sha256 and a byte count."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self._sha = hashlib.sha256()
        self.size = 0
        #: The first error of the file's write(): torch.save's C++ writer replaces it with its own
        #: ("unexpected pos ..."), so the caller re-raises this one (e.g. ENOSPC) instead.
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            for start in range(0, len(view), CHUNK_BYTES):
                chunk = view[start:start + CHUNK_BYTES]
                self._sha.update(chunk)
                self._f.write(chunk)
        except BaseException as exc:
            if self.error is None:
                self.error = exc
            raise
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


class Location:
    """An fsspec filesystem and a root path under it."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.fs, self.root = fsspec.core.url_to_fs(uri)
        self.root = self.root.rstrip("/") or self.root
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.local = "file" in protocols or "local" in protocols

    # ------------------------------------------------------------ names
    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def url(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    def names(self, path: str | None = None) -> list[str]:
        """Base names of the entries directly under ``path`` (the root by default); [] if it is absent."""
        path = path or self.root
        self.fs.invalidate_cache(path)  # object stores cache listings; a lease watcher needs fresh ones
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def exists(self, path: str) -> bool:
        if not self.local:
            self.fs.invalidate_cache(path.rsplit("/", 1)[0])  # never answer from a stale listing
        return self.fs.exists(path)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    # ------------------------------------------------------------ durability
    def fsync_file(self, f: Any) -> None:
        """Flush ``f`` and, on a local filesystem, force its bytes to the device."""
        f.flush()
        if self.local:
            os.fsync(f.fileno())

    def fsync_dir(self, path: str) -> None:
        """Make the names in directory ``path`` durable (local filesystems; object stores have none)."""
        if not self.local:
            return
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # ------------------------------------------------------------ small files
    def read_bytes(self, path: str, limit: int = 1 << 20) -> bytes:
        """A small file's bytes (manifests, claims, leases); refuses files over ``limit`` bytes."""
        if self.local:
            with self.fs.open(path, "rb") as f:
                data = f.read(limit + 1)
        else:  # one GET: an open file would pin the object's ETag and fail if a renewal replaced it meanwhile
            data = self.fs.cat_file(path)
        if len(data) > limit:
            raise ValueError(f"{self.url(path)} is over {limit} bytes, too large for a manifest or lease")
        return data

    def create_exclusive(self, path: str, data: bytes, durable: bool = True) -> bool:
        """Create ``path`` holding ``data`` only if it does not exist; False if it already does.

        Locally ``O_EXCL``; on object stores fsspec's ``"xb"`` (S3: a conditional PUT). A backend
        without conditional creates falls back to check-then-write, which is not atomic (the
        location's lease still keeps one live job per location)."""
        try:
            f = self.fs.open(path, "xb")
        except FileExistsError:
            return False
        except (ValueError, NotImplementedError) as exc:
            if isinstance(exc, ValueError) and "mode" not in str(exc).lower():
                raise  # not "unsupported mode": a real error
            _log.warning("%s has no conditional create (%s); claiming %s by check-then-write",
                         type(self.fs).__name__, exc, self.url(path))
            if self.fs.exists(path):
                return False
            self.write_small(path, data, durable=durable)
            f = None
        if f is not None:
            try:
                with f:
                    f.write(data)
                    if durable:
                        self.fsync_file(f)
            except FileExistsError:
                return False  # object stores: the conditional PUT at close found the key taken
            except BaseException:
                if self.local:  # our O_EXCL open created it: a torn file (disk full) must not block the name
                    self.remove_quietly(path)
                raise
        if durable and self.local:
            self.fsync_dir(path.rsplit("/", 1)[0])
        return True

    def write_small(self, path: str, data: bytes, durable: bool = True) -> None:
        """Replace ``path`` with ``data`` atomically: readers see the old bytes or the new, never a mix.

        Locally: a temporary name in the same directory, fsync, rename, fsync of the directory.
        Object stores: one PUT of the final key."""
        if not self.local:
            self.fs.pipe_file(path, data)
            return
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
                if durable:
                    self.fsync_file(f)
            os.replace(tmp, path)
        except BaseException:
            self.remove_quietly(tmp)
            raise
        if durable:
            self.fsync_dir(path.rsplit("/", 1)[0])

    # ------------------------------------------------------------ big files
    def sha256(self, path: str) -> tuple[int, str]:
        """Size and sha256 of ``path``, read in chunks (never whole into memory)."""
        sha, size = hashlib.sha256(), 0
        buffer = bytearray(READ_CHUNK_BYTES)
        view = memoryview(buffer)
        with self.fs.open(path, "rb") as f:
            while True:
                n = f.readinto(buffer)
                if not n:
                    return size, sha.hexdigest()
                sha.update(view[:n])
                size += n

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    # ------------------------------------------------------------ removal
    def remove(self, path: str) -> None:
        """Remove a file; a missing one is not an error (someone finished the job already)."""
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    def remove_tree(self, path: str) -> None:
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        if self.local and os.path.isdir(path):
            os.rmdir(path)  # an empty directory left behind: remove it, or say why not

    def remove_quietly(self, path: str) -> None:
        """Best-effort cleanup on an error path: a failure is logged (the original error is raised)."""
        try:
            self.remove(path)
        except OSError as exc:
            _log.warning("could not remove %s while cleaning up after an error: %s", self.url(path), exc)
