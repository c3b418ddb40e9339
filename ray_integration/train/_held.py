"""The reported checkpoints a drop-in worker holds on its own disk, and their transfer over the ring.

Every rank that passes ``report(..., checkpoint=Checkpoint.from_directory(d))`` keeps a private copy of ``d``
(the newest one only, plus the one ``get_checkpoint()`` handed out last), so that after a failure the survivors
re-enter the training function with the newest reported checkpoint at hand, without a download. A rank that
needs a checkpoint it does not hold (a joiner, a rank that reported ``checkpoint=None``) receives the files from
a rank that holds it, over the ring (:func:`share`), in chunks of :data:`CHUNK_BYTES`, each authenticated.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import elastic_ring as er
from elastic_ring.core.log import get_logger
from state import CheckpointError
from state.checkpoints._local_files import local_files

_log = get_logger(__name__)

#: Bytes per broadcast when a checkpoint's files go from a holder to the ranks that need them.
CHUNK_BYTES = 64 << 20


class HeldCheckpoints:
    """This process's copies of reported checkpoints, under one private directory removed by :meth:`close`."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="er-held-")
        self._count = 0
        self.index = -1            # the report number of the newest copy held (-1: none)
        self.directory: str | None = None
        self._pinned: str | None = None  # the copy get_checkpoint() handed out last: kept while it is

    def new_directory(self, index: int) -> str:
        self._count += 1
        path = os.path.join(self.root, f"{self._count}-report-{index}")
        os.makedirs(path)
        return path

    def copy_in(self, source: str, index: int) -> str:
        """A private copy of directory ``source`` (the caller may delete or reuse it at once), not yet held."""
        files = local_files(source)  # ValueError: not a directory, links, too many files
        target = self.new_directory(index)
        try:
            for rel in files:
                path = os.path.join(target, *rel.split("/"))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                shutil.copyfile(os.path.join(source, *rel.split("/")), path)
        except OSError as exc:
            shutil.rmtree(target, ignore_errors=True)
            raise CheckpointError(f"report(checkpoint=...) could not copy {source} into {target} (the copy this "
                                  f"worker resumes from after a failure): {exc}; free space under "
                                  f"{tempfile.gettempdir()} or set TMPDIR") from exc
        return target

    def hold(self, directory: str, index: int) -> None:
        """Make ``directory`` (a copy made here) the newest held one, for report number ``index``."""
        old, self.directory, self.index = self.directory, directory, index
        self._drop(old)

    def discard(self, directory: str | None) -> None:
        self._drop(directory)

    def pin(self, directory: str | None) -> None:
        """``directory`` was handed out by get_checkpoint(): keep it until another one is."""
        old, self._pinned = self._pinned, directory
        self._drop(old)

    def _drop(self, directory: str | None) -> None:
        """Remove ``directory`` if it is a copy of this object's (not a download of the storage's) no longer used."""
        if directory is not None and directory not in (self.directory, self._pinned) and \
                os.path.dirname(directory) == self.root:
            shutil.rmtree(directory, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def share(root: int, source: str | None, target: str | None) -> None:
    """Broadcast the files of directory ``source`` (on rank ``root``) into ``target`` on the other ranks (those
    with ``target`` None take part and write nothing). A collective of the current ring: every rank calls it."""
    me = er.rank()
    listing = None
    if me == root:
        assert source is not None
        listing = [(rel, os.path.getsize(os.path.join(source, *rel.split("/")))) for rel in local_files(source)]
    listing = er.broadcast_object(listing, root, name="ray_integration.train checkpoint files")
    for rel, size in listing:
        path = None if target is None or me == root else os.path.join(target, *rel.split("/"))
        if path is not None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with (open(os.path.join(source, *rel.split("/")), "rb") if me == root else _null()) as src, \
                (open(path, "wb") if path is not None else _null()) as dst:
            for _ in range(-(-size // CHUNK_BYTES)):
                chunk = er.broadcast_object(src.read(CHUNK_BYTES) if me == root else None, root,
                                            name="ray_integration.train checkpoint chunk")
                if dst is not None:
                    dst.write(chunk)
    if target is not None and me != root:
        _log.info("received a reported checkpoint of %d files from rank %d", len(listing), root)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
