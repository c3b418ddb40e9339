"""State checkpoints: the state tree a ``State`` persists, one ``torch.save`` file per checkpoint, at the location's
root, written by the one :class:`~state.checkpoints.sequenced.SequencedWriter` (claim, files, manifest last, fence,
prune) and read back verified.

Layout under the root URI (see ``docs/checkpoints.md``)::

    LEASE.lock, LEASE.json            file systems: the OS lock and its holder's record (lease_file.py)
    LEASE-000000000003.json           object stores: the lease's current generation (lease_object_store.py)
    ckpt-000000000007/CLAIM.json      run id of the writer; its conditional create claims number 7
    ckpt-000000000007/data.pt         the state tree, streamed by torch.save (hashed on the way)
    ckpt-000000000007/MANIFEST.json   format, seq, run id, size and sha256 of data.pt, meta (with the state's
                                      order: lineage, round, version); written last

Before the manifest is published, the data is read back and checked for objects a safe load would refuse (unless
the store is ``trusted``). Loading verifies size and sha256 (streamed) before anything is unpickled, and unpickles
with ``weights_only=True`` unless the store is ``trusted``. A damaged checkpoint is skipped with a warning naming
it; another job's, or one holding objects a safe load refuses, stops the load with an error saying what to do.
"""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import torch

from ..errors import CheckpointCorrupt, CheckpointError, CheckpointRefused
from .policy import Entry, StateOrder
from .sequenced import MANIFEST, Kind, SequencedWriter
from .transport import HashingWriter, Location

FORMAT = "elastic_ring.checkpoint/2"
READABLE = ("elastic_ring.checkpoint/1", FORMAT)
DATA = "data.pt"


def _state_order(manifest: dict) -> StateOrder | None:
    """The order of the state a checkpoint holds (``meta.order``, written by ``State``), or None (an older one)."""
    meta = manifest.get("meta")
    return StateOrder.parse(meta.get("order")) if isinstance(meta, dict) else None


KIND = Kind(format=FORMAT, label="checkpoint", lease_fix="checkpoint_uri", order_of=_state_order)

__all__ = ["CheckpointStore", "FORMAT"]

_TRUST_FIX = ("if you trust everyone who can write to this location, set trusted_checkpoints=True "
              "(CheckpointConfig(trusted=True) / enable_checkpoints(..., trusted=True)), or register the classes "
              "with torch.serialization.add_safe_globals([...])")


class _Tree:
    """The payload of a state checkpoint: ``tree`` streamed by ``torch.save`` into ``data.pt``."""

    subdir = ""
    fix = ("Keep tensors, numbers, strings, containers and objects with state_dict() in the state, "
           "or fix the storage backend named in the error")

    def __init__(self, tree: Any, meta: dict | None, trusted: bool) -> None:
        self.tree, self.trusted, self.fields = tree, trusted, {"meta": meta or {}}

    def write(self, loc: Location, root: str) -> dict[str, dict]:
        path = f"{root}/{DATA}"
        with loc.fs.open(path, "wb") as f:
            writer = HashingWriter(f)
            try:
                torch.save(self.tree, writer)
            except Exception as exc:
                if writer.error is not None and writer.error is not exc:
                    raise writer.error from exc  # the storage's own error (ENOSPC...), not torch's wrapper
                raise
            if writer.error is not None:
                raise writer.error
            loc.fsync_file(f)
        loc.fsync_dir(root)
        return {DATA: {"bytes": writer.size, "sha256": writer.hexdigest()}}

    def check(self, loc: Location, root: str) -> None:
        if self.trusted:
            return
        with loc.fs.open(f"{root}/{DATA}", "rb") as f:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(f)
        if unsafe:
            raise CheckpointRefused(f"the state holds objects that a safe load refuses ({', '.join(sorted(unsafe))}), so "
                                    "this checkpoint could never be resumed by default; keep tensors, numbers, strings, "
                                    f"containers and objects with state_dict() in the state, or, {_TRUST_FIX}")


class CheckpointStore:
    """The state checkpoints under ``uri``. ``run_id`` names this run in what it writes (a fresh one if None);
    ``trusted`` loads custom objects (full unpickling) instead of refusing them; ``lease_generation`` fences the
    writes by the lease this run holds (:class:`~state.checkpoints.sequenced.SequencedWriter`)."""

    def __init__(self, uri: str, keep_last: int = 3, *, run_id: str | None = None, trusted: bool = False,
                 signing_key: bytes | None = None, lease_generation: int | None = None) -> None:
        self.writer = SequencedWriter(uri, KIND, keep_last=keep_last, run_id=run_id, signing_key=signing_key,
                                      lease_generation=lease_generation)
        self.uri, self.keep_last, self.run_id = self.writer.uri, keep_last, self.writer.run_id
        self.trusted = bool(trusted)
        self.loc = self.writer.loc
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

    # ------------------------------------------------------------ listing
    def complete(self) -> list[int]:
        """Sequence numbers whose manifest exists (written to the end), oldest first."""
        return self.writer.complete()

    def entries(self) -> list[Entry]:
        """Every checkpoint directory with its run (from the manifest, or the claim while incomplete)."""
        return self.writer.entries(runs=True)

    def newest_uri(self) -> str | None:
        """URI of the newest complete checkpoint (manifest written), or None."""
        complete = self.complete()
        return self.writer.url(self.writer.dir(complete[-1])) if complete else None

    # ------------------------------------------------------------ write
    def save(self, tree: Any, meta: dict | None = None) -> str:
        """Write ``tree`` as the newest checkpoint, verify it, prune older ones; returns its URI.

        Raises :class:`CheckpointError` naming the location, the cause and the fix (the previous
        checkpoint is untouched), or :class:`~state.checkpoints.sequenced.CheckpointPruneError` if only the pruning failed."""
        seq = self.writer.save(_Tree(tree, meta, self.trusted))
        return self.writer.url(self.writer.dir(seq))

    # ------------------------------------------------------------ read
    def _manifest(self, seq: int) -> dict:
        path = f"{self.writer.url(self.writer.dir(seq))}/{MANIFEST}"
        manifest = self.writer.read_manifest(seq)
        if not isinstance(manifest, dict) or manifest.get("format") not in READABLE:
            found = manifest.get("format") if isinstance(manifest, dict) else None
            raise CheckpointRefused(f"{path} is not an elastic_ring checkpoint (format {found!r}, "
                                    f"expected {FORMAT!r}); point checkpoint_uri at this job's checkpoints")
        entry = manifest.get("files", {}).get(DATA) if isinstance(manifest.get("files"), dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) or not isinstance(entry.get("sha256"), str):
            raise CheckpointCorrupt(f"checkpoint manifest {path} does not describe {DATA}")
        self.writer.check_signature(manifest, seq)
        return manifest

    def load(self, seq: int, expected_names: list[str] | None = None) -> tuple[Any, dict]:
        """Read checkpoint ``seq``: :class:`CheckpointCorrupt` if damaged, :class:`CheckpointRefused` if
        it is another job's or holds objects a safe load refuses (both name the file)."""
        directory = self.writer.dir(seq)
        manifest = self._manifest(seq)
        meta = manifest.get("meta") if isinstance(manifest.get("meta"), dict) else {}
        names = meta.get("names")
        if expected_names is not None and names is not None and sorted(names) != sorted(expected_names):
            raise CheckpointRefused(f"checkpoint {self.writer.url(directory)} holds state values {sorted(names)}, but this "
                                    f"state has {sorted(expected_names)}; point checkpoint_uri at this job's checkpoints")
        data_path = f"{directory}/{DATA}"
        expected = manifest["files"][DATA]
        try:
            size, digest = self.loc.sha256(data_path)
        except OSError as exc:
            raise CheckpointCorrupt(f"checkpoint data {self.writer.url(data_path)} is unreadable: {exc}") from exc
        if size != expected["bytes"] or digest != expected["sha256"]:
            raise CheckpointCorrupt(f"checkpoint data {self.writer.url(data_path)} is corrupt: {size} bytes, "
                                    f"checksum does not match its manifest")
        tree = self._unpickle(data_path)
        return tree, {"uri": self.writer.url(directory), "seq": seq, "run_id": manifest.get("run_id"), "meta": meta}

    def _unpickle(self, path: str) -> Any:
        url = self.writer.url(path)
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
