"""Private helpers of reported checkpoints on the local disk: the files of a reported directory, a hashing copy,
and whether a local copy still matches its manifest."""

from __future__ import annotations

import hashlib
import os
from typing import IO

from .transport import READ_CHUNK_BYTES

#: The most files one reported checkpoint may hold (the manifest lists each).
MAX_FILES = 10_000


def copy_hashed(src: IO[bytes], dst: IO[bytes] | None = None) -> tuple[int, str]:
    """Copy ``src`` into ``dst`` (None: only read it) in chunks; (bytes, sha256) of what went through."""
    sha, size = hashlib.sha256(), 0
    while chunk := src.read(READ_CHUNK_BYTES):
        sha.update(chunk)
        size += len(chunk)
        if dst is not None:
            dst.write(chunk)
    return size, sha.hexdigest()


def local_files(directory: str) -> list[str]:
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


def verify_local(directory: str, manifest: dict) -> bool:
    """True if local ``directory`` holds exactly the files ``manifest`` lists, each with its size and sha256."""
    try:
        present = local_files(directory)
    except (ValueError, OSError):
        return False
    files = manifest["files"]
    if sorted(files) != present:
        return False
    for rel, entry in files.items():
        try:
            with open(os.path.join(directory, *rel.split("/")), "rb") as f:
                got = copy_hashed(f)
        except OSError:
            return False
        if got != (entry["bytes"], entry["sha256"]):
            return False
    return True
