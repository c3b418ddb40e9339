"""The one sequenced writer of durable checkpoints, for both kinds: the state's (``ckpt-N`` at the location's root,
:mod:`~state.checkpoints.store`) and the reported ones (``reported/ckpt-N``, :mod:`~state.checkpoints.reported`).
The kinds differ only in their :class:`Payload` (what they write as files, and their part of the manifest) and
their :class:`Kind` (the manifest's format string, how its JSON is written).

One checkpoint (see ``docs/checkpoints.md``)::

    ckpt-000000000007/CLAIM.json      run id of the writer; its conditional create claims number 7
    ckpt-000000000007/<payload>       data.pt (a state tree), or files/... (the user's files)
    ckpt-000000000007/MANIFEST.json   format, seq, run id, time, every file's size and sha256, the payload's
                                      fields (meta, or metrics), an optional HMAC; written last

A checkpoint exists only once its manifest does. :meth:`SequencedWriter.save`: the lease fence; the claim (a claim
that fails leaves no directory behind); the payload's files, streamed and fsynced; each read back against its size
and sha256, then the payload's own check; the fence again (the files may have taken minutes); the manifest (atomic,
fsynced, read back); the fence once more, unpublishing the checkpoint when the lease moved on meanwhile. Any failure
removes what the write left (manifest first) and raises :class:`~state.errors.CheckpointError` naming the location,
the cause, the newest checkpoint still there and the fix. Then older ones are pruned, manifest first
(:func:`~state.checkpoints.policy.plan_prune`).

The fence (:meth:`SequencedWriter.fence`): a writer given its run's ``lease_generation`` publishes only while that
generation is the location's current one; without one, only while no other live run holds the location's lease.
What no check closes on an object store (no conditional write ties the manifest to the lease object): a lease taken
over between the last check before the manifest and its write, when the writer then dies before the check after it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from elastic_ring.core.log import get_logger

from ..errors import CheckpointCorrupt, CheckpointError, CheckpointRefused
from .config import check_checkpoint_uri, check_lease_generation, check_signing_key
from .lease import read_holder
from .policy import Entry, StateOrder, by_age, checkpoint_dir, next_sequence, parse_checkpoint_dir, plan_prune
from .transport import Location

MANIFEST, CLAIM = "MANIFEST.json", "CLAIM.json"

_log = get_logger(__name__)


class CheckpointPruneError(CheckpointError):
    """Checkpoint ``seq`` (at ``uri``) was written and verified, but removing older ones failed."""

    def __init__(self, message: str, uri: str, seq: int) -> None:
        super().__init__(message)
        self.uri, self.seq = uri, seq


@dataclass(frozen=True)
class Kind:
    """What one kind of checkpoint series is called and how its manifest is written."""

    format: str                                   # the manifest's format string
    label: str                                    # "checkpoint" / "reported checkpoint", in messages
    lease_fix: str                                # how a job gets a location of its own, in the fence's refusal
    json_default: Callable[[Any], Any] | None = None  # how the manifest's JSON writes a value JSON does not know
    manifest_limit: int = 1 << 20                 # the largest manifest (or claim) read back, in bytes
    order_of: Callable[[dict], StateOrder | None] | None = None  # a manifest's state order (None: by number only)


class Payload(Protocol):
    """What one checkpoint of a kind writes as files; the writer does everything else."""

    subdir: str   # the files' directory inside the checkpoint's ("": beside the manifest)
    fields: dict  # the payload's part of the manifest ({"meta": ...} / {"metrics": ...})
    fix: str      # the fix to suggest when the write fails neither for storage nor with a CheckpointError

    def write(self, loc: Location, root: str) -> dict[str, dict]:
        """Write the files under ``root`` (streamed, fsynced); {name under root: {"bytes": n, "sha256": hex}}."""

    def check(self, loc: Location, root: str) -> None:
        """After the read-back: raise a CheckpointError for what must never be published."""


def _run(record: dict | None) -> str | None:
    run_id = record.get("run_id") if record else None
    return run_id if isinstance(run_id, str) else None


class SequencedWriter:
    """The numbered checkpoints of one kind under ``uri`` (``subdir`` below it): claim, write, publish, fence, prune,
    and the listing and manifest checks their readers share. ``run_id`` names this run in what it writes (a fresh
    one if None); ``lease_generation``: the generation of the lease this run holds on ``uri`` (None: no fence beyond
    refusing another live run's lease)."""

    def __init__(self, uri: str, kind: Kind, *, subdir: str = "", keep_last: int = 3, run_id: str | None = None,
                 signing_key: bytes | None = None, lease_generation: int | None = None) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last={keep_last!r} must be an int >= 1")
        check_lease_generation(lease_generation)
        check_signing_key(signing_key)
        self.uri = check_checkpoint_uri(uri, "checkpoint uri")
        self.kind, self.keep_last, self.lease_generation, self._key = kind, keep_last, lease_generation, signing_key
        self.run_id = run_id if run_id is not None else f"local-{uuid.uuid4().hex[:12]}"
        self.top = Location(self.uri)  # the location's root: where the lease is
        self.loc = Location(f"{self.uri}/{subdir}") if subdir else self.top
        self.where = f"{self.uri}/{subdir}" if subdir else self.uri

    # ------------------------------------------------------------ names and listing
    def dir(self, seq: int) -> str:
        return self.loc.path(checkpoint_dir(seq))

    def url(self, path: str) -> str:
        return self.loc.url(path)

    def sequences(self) -> list[int]:
        """Sequence numbers of every checkpoint directory, complete or not, ascending."""
        return sorted(s for s in map(parse_checkpoint_dir, self.loc.names()) if s is not None)

    def entries(self, runs: bool = False) -> list[Entry]:
        """Every checkpoint directory, with its state order when the kind has one (from the manifest); with
        ``runs``, with its run (from the manifest, or the claim while incomplete)."""
        out = []
        for seq in self.sequences():
            complete = self.loc.exists(f"{self.dir(seq)}/{MANIFEST}")
            if complete and (runs or self.kind.order_of is not None):
                manifest = self._small_json(seq, MANIFEST)
                order = self.kind.order_of(manifest) if self.kind.order_of is not None and manifest else None
                out.append(Entry(seq, _run(manifest) if runs else None, True, order))
            else:
                out.append(Entry(seq, _run(self._small_json(seq, CLAIM)) if runs and not complete else None, complete))
        return out

    def complete(self) -> list[int]:
        """Sequence numbers of the complete checkpoints (manifest written), oldest first: the last is the newest."""
        return [e.seq for e in by_age(self.entries())]

    def _small_json(self, seq: int, name: str) -> dict | None:
        """Checkpoint ``seq``'s manifest or claim as a dict, or None when it is missing or not JSON (an old or torn
        directory, one pruned meanwhile: it belongs to no run we know and has no order). Any other error of the
        storage is raised: an entry read as "no order" sorts below every ordered one, so a read that failed for a
        moment must never make the newest state look oldest (and be pruned or passed over)."""
        try:
            value = json.loads(self.loc.read_bytes(f"{self.dir(seq)}/{name}", self.kind.manifest_limit))
        except (FileNotFoundError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    # ------------------------------------------------------------ write
    def save(self, payload: Payload) -> int:
        """Write ``payload`` as the newest checkpoint (module docstring), then prune; returns its number.

        Raises :class:`CheckpointError` (the previous checkpoints untouched), or :class:`CheckpointPruneError`
        when only the pruning failed."""
        seq = None
        try:
            self.fence()
            seq = self._claim()
            directory = self.dir(seq)
            root = f"{directory}/{payload.subdir}" if payload.subdir else directory
            files = payload.write(self.loc, root)
            self._read_back(root, files)
            payload.check(self.loc, root)
            manifest = {"format": self.kind.format, "seq": seq, "run_id": self.run_id, "created_unix_s": time.time(),
                        "files": files, **payload.fields}
            if self._key is not None:
                manifest["hmac_sha256"] = self.sign(manifest)
            body = json.dumps(manifest, indent=1, default=self.kind.json_default).encode()
            self.fence()  # the files may have taken minutes: is the location still this run's?
            self.loc.write_small(f"{directory}/{MANIFEST}", body)
            if self.loc.read_bytes(f"{directory}/{MANIFEST}", self.kind.manifest_limit) != body:
                raise CheckpointCorrupt(f"{self.url(directory)}/{MANIFEST} reads back different from what was written")
            self.fence()  # lost while publishing: unpublished below
        except Exception as exc:  # every failure: clean up what this write left, then say what happened
            if seq is not None:
                self._discard(seq)
            raise self._write_error(exc, seq, payload.fix) from exc
        try:
            self.prune(seq)
        except Exception as exc:  # the checkpoint itself is safe; say so, and what failed
            url = self.url(self.dir(seq))
            raise CheckpointPruneError(f"{self.kind.label} {url} was written and verified, but removing older ones "
                                       f"failed: {type(exc).__name__}: {exc}; they take space until the next "
                                       "checkpoint prunes them (check permissions on the location)", url, seq) from exc
        return seq

    def fence(self) -> None:
        """Raise :class:`CheckpointError` unless this run may publish at the location now (module docstring)."""
        holder = read_holder(self.top)
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
                                  f"{self.kind.lease_fix}")

    def _claim(self) -> int:
        claim = json.dumps({"run_id": self.run_id, "host": socket.gethostname(), "pid": os.getpid()}).encode()
        self.loc.makedirs(self.loc.root)
        for _ in range(1000):
            seq = next_sequence(self.sequences())
            directory = self.dir(seq)
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
        raise CheckpointError(f"could not claim a {self.kind.label} number under {self.where} in 1000 tries: "
                              "other writers keep taking them; give each job its own checkpoint_uri")

    def _drop_empty_dir(self, directory: str) -> None:
        """Remove ``directory`` if it is empty (local only; another writer's claim in it keeps it)."""
        if not self.loc.local:
            return
        try:
            os.rmdir(directory)
        except OSError as exc:  # not empty (another claim), or already gone: the next prune handles it
            _log.debug("left %s after a failed claim: %s", directory, exc)

    def _read_back(self, root: str, files: dict[str, dict]) -> None:
        """Read every file back (streamed) before it is published: storage that corrupts fails the write."""
        for name, entry in files.items():
            got_size, got_digest = self.loc.sha256(f"{root}/{name}")
            if (got_size, got_digest) != (entry["bytes"], entry["sha256"]):
                raise CheckpointCorrupt(f"{self.url(root)}/{name} reads back as {got_size} bytes with another checksum "
                                        f"than the {entry['bytes']} bytes written (storage corrupts data?)")

    def _write_error(self, exc: Exception, seq: int | None, payload_fix: str) -> CheckpointError:
        label = self.kind.label
        try:
            newest = self.complete()
            previous = f"{label} {newest[-1]} is still the newest" if newest else f"there is no earlier {label}"
        except Exception as list_exc:  # the storage is failing as a whole: say so, keep the write's error
            previous = f"the location cannot be listed either ({type(list_exc).__name__}: {list_exc})"
        what = f"{label} {seq}" if seq is not None else f"a {label}"
        if isinstance(exc, OSError):
            fix = "Free space or fix permissions there, or set another checkpoint_uri"
        else:
            fix = "" if isinstance(exc, CheckpointError) else payload_fix
        cause = str(exc) if isinstance(exc, (OSError, CheckpointError)) else f"{type(exc).__name__}: {exc}"
        message = f"writing {what} under {self.where} failed: {cause}; {previous} (a torn write is never loaded)."
        error = CheckpointError(f"{message} {fix}" if fix else message)
        error.seq = seq
        return error

    def _discard(self, seq: int) -> None:
        """Remove what a failed write left (manifest first); a failure here is logged, the next prune retries."""
        try:
            self.remove(seq)
        except Exception as exc:  # the write's own error is what the caller raises
            _log.warning("could not remove the failed %s %s: %s; the next successful one removes it",
                         self.kind.label, self.url(self.dir(seq)), exc)

    # ------------------------------------------------------------ prune
    def prune(self, newest: int) -> list[int]:
        """Remove what :func:`plan_prune` names after ``newest`` was written; returns their numbers."""
        holder = read_holder(self.top)
        lease_held = holder is not None and holder.get("run_id") == self.run_id and not holder.get("released")
        doomed = plan_prune(self.entries(runs=True), newest, self.run_id, self.keep_last, lease_held)
        for seq in doomed:
            self.remove(seq)
        if doomed:
            self.loc.fsync_dir(self.loc.root)
        return doomed

    def remove(self, seq: int) -> None:
        """Unpublish checkpoint ``seq`` (its manifest, durably), then delete the rest."""
        self._unpublish(seq)
        self._remove_dir(seq)

    def _unpublish(self, seq: int) -> None:
        directory = self.dir(seq)
        self.loc.remove(f"{directory}/{MANIFEST}")
        if self.loc.local and os.path.isdir(directory):
            self.loc.fsync_dir(directory)

    def _remove_dir(self, seq: int) -> None:
        self.loc.remove_tree(self.dir(seq))

    # ------------------------------------------------------------ manifests, for the readers
    def read_manifest(self, seq: int) -> dict:
        """Checkpoint ``seq``'s manifest as written (JSON), or :class:`CheckpointCorrupt` if it is unreadable; the
        kind's reader checks the rest (format, files, then :meth:`check_signature`)."""
        path = f"{self.dir(seq)}/{MANIFEST}"
        try:
            manifest = json.loads(self.loc.read_bytes(path, self.kind.manifest_limit))
        except (OSError, ValueError) as exc:
            raise CheckpointCorrupt(f"{self.kind.label} manifest {self.url(path)} is unreadable: {exc}") from exc
        return manifest

    def check_signature(self, manifest: dict, seq: int) -> None:
        """With a signing key: :class:`CheckpointRefused` unless ``manifest`` is signed with it."""
        if self._key is None:
            return
        given = manifest.get("hmac_sha256")
        if not isinstance(given, str) or not hmac.compare_digest(given, self.sign(manifest)):
            raise CheckpointRefused(f"{self.kind.label} manifest {self.url(self.dir(seq))}/{MANIFEST} is "
                                    f"{'not signed' if given is None else 'signed with another key'}; it was not "
                                    "loaded. Use the signing_key its run used, or no key to load unsigned ones")

    def sign(self, manifest: dict) -> str:
        body = {k: v for k, v in manifest.items() if k != "hmac_sha256"}
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), default=self.kind.json_default).encode()
        return hmac.new(self._key, canonical, hashlib.sha256).hexdigest()
