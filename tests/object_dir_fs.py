"""``objdir://``: a real local directory that the checkpoint code treats as an object store.

Its protocol names no ``file``, so ``Location.local`` is False: the lease there is the generation
protocol of object stores (``state/checkpoints/lease_object_store.py``), on real files, in real processes (a
subprocess imports this module to register it). Conditional creates are ``O_EXCL`` opens;
parent directories appear on write, as prefixes do."""

import fsspec
from fsspec.implementations.local import LocalFileSystem


class ObjectDirFileSystem(LocalFileSystem):
    protocol = ("objdir",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, auto_mkdir=True, **kwargs)  # keys have no directories to create first


fsspec.register_implementation("objdir", ObjectDirFileSystem, clobber=True)


def object_uri(path) -> str:
    """The ``objdir://`` URL of the local directory ``path``."""
    return f"objdir://{path}"
