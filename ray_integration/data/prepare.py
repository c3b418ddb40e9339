"""Driver side of Ray Data input: materialize each dataset once and describe its blocks.

:func:`prepare_datasets` runs on the driver before any worker starts. Each dataset is
materialized once (``ds.materialize()``: its blocks go to Ray's object store, spilled to
disk when larger), and its blocks are recorded in the dataset's own order as object refs
with their row counts. The result is a small picklable description that travels to the
workers with their settings; the driver keeps it (and so the blocks) alive for the run.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Mapping


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

    @property
    def num_rows(self) -> int:
        return sum(b.rows for b in self.blocks)

    @property
    def fingerprint(self) -> str:
        """A digest of the block row counts and the columns: what a rebuilt dataset must reproduce to resume."""
        text = ";".join([",".join(str(b.rows) for b in self.blocks), repr(self.columns)])
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


def prepare_datasets(datasets: Mapping[str, Any] | None) -> PreparedDatasets | None:
    """Materialize every ``ray.data.Dataset`` of ``datasets`` once and describe its blocks (on the driver).

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
        materialized = ds.materialize()
        spans, schema = [], None
        for bundle in materialized.iter_internal_ref_bundles():
            spans.extend(_spans(bundle))
            schema = schema if schema is not None else getattr(bundle, "schema", None)
        described[name] = PreparedDataset(name, tuple(s for s in spans if s.rows > 0), _columns(schema))
        keep[name] = materialized
    return PreparedDatasets(described, keep)
