"""Driver side of Ray Data input: materialize each dataset once and describe its blocks.

:func:`prepare_datasets` runs on the driver before any worker starts. Each dataset is
materialized once (``ds.materialize()``: its blocks go to Ray's object store, spilled to
disk when larger) with Ray Data's ``preserve_order`` on for that execution, and its blocks are
recorded in the dataset's own order as object refs with their row counts and a digest of a few
of their rows' values (computed where the blocks live). The result is a small picklable
description that travels to the workers with their settings; the driver keeps it (and so the
blocks) alive for the run.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import numpy as np

from elastic_ring.core.log import get_logger

_log = get_logger(__name__)

#: The longest the blocks' digests may take, all blocks together.
DIGEST_TIMEOUT_S = 300.0
#: Digest tasks in flight at once (each reads one block where it lives and returns 16 hex digits).
DIGESTS_IN_FLIGHT = 8


@dataclass(frozen=True)
class BlockSpan:
    """Rows ``[start, start + rows)`` of one block held in the object store under ``ref``."""

    ref: Any
    start: int
    rows: int


@dataclass(frozen=True)
class PreparedDataset:
    """One dataset's blocks in a fixed order; global row ``i`` is row ``i - first`` of the block that holds it."""

    name: str
    blocks: tuple[BlockSpan, ...]
    columns: tuple[tuple[str, str], ...] = ()
    #: One :func:`block_digest` per block (empty: not computed, e.g. a hand-built description).
    digests: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.digests and len(self.digests) != len(self.blocks):
            raise ValueError(f"PreparedDataset {self.name!r}: {len(self.digests)} digests for {len(self.blocks)} "
                             "blocks; give one per block (or none)")

    @property
    def num_rows(self) -> int:
        return sum(b.rows for b in self.blocks)

    @property
    def shape_fingerprint(self) -> str:
        """A digest of the block row counts and the columns."""
        text = ";".join([",".join(str(b.rows) for b in self.blocks), repr(self.columns)])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def fingerprint(self) -> str:
        """The shape and every block's content digest: what a rebuilt dataset must reproduce to resume."""
        if not self.digests:
            return self.shape_fingerprint
        text = ";".join([self.shape_fingerprint, ",".join(self.digests)])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class PreparedDatasets:
    """What :func:`prepare_datasets` returns: the description of every dataset, by name (picklable).

    On the driver it also holds the materialized datasets (never pickled), so their blocks stay in the
    object store for as long as the description lives."""

    datasets: dict[str, PreparedDataset]
    _keep: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __getstate__(self) -> dict:
        return {"datasets": self.datasets, "_keep": {}}

    def __setstate__(self, state: dict) -> None:
        self.datasets, self._keep = state["datasets"], {}

    @property
    def names(self) -> list[str]:
        return sorted(self.datasets)


def _columns(schema: Any) -> tuple[tuple[str, str], ...]:
    names, types = getattr(schema, "names", None), getattr(schema, "types", None)
    if names is None or types is None:
        return ()
    return tuple((str(n), str(t)) for n, t in zip(names, types))


def _spans(bundle: Any) -> list[BlockSpan]:
    """The blocks of one of Ray's ref bundles (entries with ``.ref``/``.metadata``, or ``(ref, metadata)``)."""
    slices = getattr(bundle, "slices", None) or [None] * len(bundle.blocks)
    spans = []
    for entry, piece in zip(bundle.blocks, slices):
        ref, meta = (entry.ref, entry.metadata) if hasattr(entry, "ref") else entry
        if piece is not None:
            spans.append(BlockSpan(ref, int(piece.start_offset), int(piece.end_offset - piece.start_offset)))
            continue
        rows = getattr(meta, "num_rows", None)
        if rows is None:  # unknown from the metadata: count it once, here on the driver
            import ray
            from ray.data.block import BlockAccessor

            rows = BlockAccessor.for_block(ray.get(ref)).num_rows()
        spans.append(BlockSpan(ref, 0, int(rows)))
    return spans


def _update(h: Any, value: Any) -> None:
    """Feed ``value`` (a numpy column, or one cell of an object column) into the hash ``h``."""
    if isinstance(value, np.ndarray) and value.dtype != object:
        h.update(f"{value.dtype.str}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, np.ndarray):
        h.update(f"object{value.shape}".encode())
        for cell in value.ravel():
            _update(h, cell)
    elif isinstance(value, (bytes, bytearray)):
        h.update(b"b" + bytes(value))
    else:
        h.update(repr(value).encode())
    h.update(b"|")


def block_digest(block: Any, start: int, rows: int) -> str:
    """16 hex digits of the values of rows ``start``, ``start + rows // 2`` and ``start + rows - 1`` of ``block``
    (a cheap check that a rebuilt dataset holds the same data in the same order, not a hash of every row)."""
    from ray.data.block import BlockAccessor

    accessor, h = BlockAccessor.for_block(block), hashlib.sha256()
    for i in sorted({start, start + rows // 2, start + rows - 1}):
        arrays = BlockAccessor.for_block(accessor.slice(i, i + 1, False)).to_batch_format("numpy")
        for name in sorted(arrays):
            h.update(name.encode())
            _update(h, arrays[name])
    return h.hexdigest()[:16]


_remote_digest: Any = None


def _local(refs: list[Any]) -> list[bool]:
    """For each ref: is the block in this process's node (or small enough to live in its owner's memory)?"""
    import ray

    try:
        import ray.experimental

        where = ray.experimental.get_object_locations(refs, timeout_ms=30_000)
        node = ray.get_runtime_context().get_node_id()
    except (AttributeError, ImportError, RuntimeError, TimeoutError) as exc:  # run every digest as a task then
        _log.info("prepare_datasets: block locations unknown (%s); every digest runs where its block is", exc)
        return [False] * len(refs)
    return [ref in where and (not where[ref].get("node_ids") or node in where[ref]["node_ids"]) for ref in refs]


def _digests(name: str, spans: list[BlockSpan], timeout_s: float = DIGEST_TIMEOUT_S) -> tuple[str, ...]:
    """Every span's :func:`block_digest`, within ``timeout_s``: read here for a block on this node (zero-copy from
    the object store), else by a task given the block's ref, which Ray runs where the block lives (16 hex digits
    come back), at most :data:`DIGESTS_IN_FLIGHT` at once."""
    global _remote_digest
    import ray

    deadline = time.monotonic() + timeout_s
    out: list[str | None] = [None] * len(spans)
    remote = []
    for i, (span, here) in enumerate(zip(spans, _local([s.ref for s in spans]))):
        if not here:
            remote.append(i)
            continue
        block = ray.get(span.ref, timeout=max(1.0, deadline - time.monotonic()))
        out[i] = block_digest(block, span.start, span.rows)
        del block
    if remote and _remote_digest is None:  # no CPU reserved: a few rows read; a cluster busy training must not block it
        _remote_digest = ray.remote(num_cpus=0)(block_digest)
    pending: dict[Any, int] = {}
    queue = iter(remote)
    while True:
        for i in queue:
            pending[_remote_digest.remote(spans[i].ref, spans[i].start, spans[i].rows)] = i
            if len(pending) >= DIGESTS_IN_FLIGHT:
                break
        if not pending:
            return tuple(out)  # type: ignore[arg-type]
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            for ref in pending:
                ray.cancel(ref)
            raise TimeoutError(f"prepare_datasets: dataset {name!r}: the digests of its {len(spans)} blocks took "
                               f"over {timeout_s:.0f} s ({sum(d is not None for d in out)} done); the cluster may "
                               f"be out of worker processes or the blocks unreachable; retry when it can run tasks")
        for ref in done:
            out[pending.pop(ref)] = ray.get(ref)


@contextlib.contextmanager
def _order_preserved(ds: Any) -> Iterator[None]:
    """Ray Data's ``preserve_order`` on for executions started inside (the dataset's own context and the current
    one), restored after: Ray Data emits blocks in completion order otherwise, which differs run to run."""
    from ray.data import DataContext

    options = []
    for context in (getattr(ds, "context", None), DataContext.get_current()):
        execution = getattr(context, "execution_options", None)
        if execution is not None and all(execution is not o for o, _ in options):
            options.append((execution, execution.preserve_order))
    try:
        for execution, _ in options:
            execution.preserve_order = True
        yield
    finally:
        for execution, before in options:
            execution.preserve_order = before


def prepare_datasets(datasets: Mapping[str, Any] | None) -> PreparedDatasets | None:
    """Materialize every ``ray.data.Dataset`` of ``datasets`` once, in its order, and describe its blocks (on the
    driver): refs, row counts, columns and a digest of a few rows per block (:func:`block_digest`).

    Returns None for None or an empty dict. Raises TypeError for a name that is not a non-empty string or
    a value that is not a ``ray.data.Dataset``."""
    if datasets is None:
        return None
    if not isinstance(datasets, Mapping):
        raise TypeError(f"datasets must be a dict of name -> ray.data.Dataset, e.g. {{'train': ds}}; got "
                        f"{type(datasets).__name__}")
    if not datasets:
        return None
    import ray.data

    for name, ds in datasets.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"datasets names must be non-empty strings (as in get_dataset_shard('train')); got {name!r}")
        if not isinstance(ds, ray.data.Dataset):
            raise TypeError(f"datasets[{name!r}] must be a ray.data.Dataset (e.g. ray.data.read_parquet(...)), got "
                            f"{type(ds).__name__}; wrap in-memory data with ray.data.from_items / from_numpy")
    described, keep = {}, {}
    for name, ds in datasets.items():
        with _order_preserved(ds):
            materialized = ds.materialize()
        spans, schema = [], None
        for bundle in materialized.iter_internal_ref_bundles():
            spans.extend(_spans(bundle))
            schema = schema if schema is not None else getattr(bundle, "schema", None)
        spans = [s for s in spans if s.rows > 0]
        described[name] = PreparedDataset(name, tuple(spans), _columns(schema), _digests(name, spans))
        keep[name] = materialized
    return PreparedDatasets(described, keep)
