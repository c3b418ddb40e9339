"""ElasticDataShard: a Ray Data dataset read as an :class:`~state.ElasticSampler` over its global row indices.

The shard *is* the sampler (a subclass), so everything the sampler gives holds unchanged: the
state links it to the optimizer's steps, re-partitions the rest of the epoch at every re-form,
syncs its position from the newest live state, and keeps it in commits and durable checkpoints.
What it adds is where a position's row comes from and the batch it yields:

* **Order.** An epoch's order is a seeded permutation of the blocks, each block's rows shuffled
  within it (``shuffle=False``: the dataset's own order). Consecutive positions come from one
  block, so a rank's consecutive batches come from few blocks.
* **Rows.** A batch's global row indices are mapped to (block, row); each block is fetched from
  the object store once (``ray.get``), kept in a small per-shard cache (``cache_blocks``, least
  recently used first out) and sliced (contiguous rows) or gathered (shuffled rows).
* **Batches.** ``iter_batches`` yields what Ray Data yields (a dict of column -> numpy array, or a
  pandas / pyarrow batch); ``iter_torch_batches`` a dict of column -> tensor.
* **Epochs.** An iteration yields the rest of the shard's *current* epoch; the next epoch starts with
  ``set_epoch`` (the epoch is part of the saved position). Iterating again after an iteration ran
  to the end of the epoch, without ``set_epoch``, raises (Ray Data would start a new epoch there).
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
import warnings
import weakref
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

import elastic_ring as er
from elastic_ring.core.log import get_logger
from elastic_ring.core.validation import check_int
from elastic_ring.ring import runtime
from state import ElasticSampler

from ..errors import InputUnavailable
from . import convert
from .prepare import BlockSpan, PreparedDataset

#: Ray Data's default batch size (``iter_batches`` / ``iter_torch_batches``).
DEFAULT_BATCH_SIZE = 256
_log = get_logger(__name__)

#: The longest a block's fetch from the object store may take.
FETCH_TIMEOUT_S = 300.0
#: Tries of one block's read when a try fails in the object store (a timeout, a lost object); after the last, the
#: worker leaves as a lost worker (InputUnavailable).
FETCH_TRIES = 3
#: Seconds between those tries.
FETCH_RETRY_DELAY_S = 1.0


def _unreadable(exc: BaseException) -> bool:
    """A read that failed because of the object store or the block's producer (a lost object, a dead owner, a
    producer that cannot be re-run on a reclaimed node), not because of the code reading it: tried again, then the
    worker leaves as a lost worker (:class:`~ray_integration.errors.InputUnavailable`)."""
    if _transient(exc):
        return True
    try:
        from ray.exceptions import RayError
    except ImportError:
        return False
    return isinstance(exc, RayError)


def _transient(exc: BaseException) -> bool:
    """A failed read worth trying again: a timeout (Ray's GetTimeoutError is one) or Ray's fetch timeout."""
    if isinstance(exc, TimeoutError):
        return True
    try:
        from ray.exceptions import ObjectFetchTimedOutError
    except ImportError:
        return False
    return isinstance(exc, ObjectFetchTimedOutError)


def block_order(rows: Sequence[int], shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    """An epoch's order of global row indices: the blocks in a seeded random order, each block's rows shuffled
    within it (the same on every rank for the same seed and epoch); ``shuffle=False``: the dataset's order."""
    total = int(sum(rows))
    if not shuffle:
        return torch.arange(total)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    firsts = np.concatenate([[0], np.cumsum(rows)[:-1]]).tolist() if len(rows) else []
    parts = [firsts[b] + torch.randperm(rows[b], generator=g) for b in torch.randperm(len(rows), generator=g).tolist()]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


def _ray_fetch(ref: Any) -> Any:
    import ray

    return ray.get(ref, timeout=FETCH_TIMEOUT_S)


class BlockCache:
    """The most recently used blocks of one shard (at most ``capacity``, plus those in flight), fetched on demand
    or ahead of time on one background thread. A failed read is never cached: the next read of the block
    fetches it again (a timeout is retried at once, :data:`FETCH_TRIES` tries in all). ``close()`` (or the
    cache's collection) stops the thread."""

    def __init__(self, spans: Sequence[BlockSpan], fetch: Callable[[Any], Any], capacity: int) -> None:
        self._spans, self._fetch, self.capacity = spans, fetch, capacity
        self._blocks: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._numpy: dict[int, dict[str, np.ndarray]] = {}  # cached blocks as numpy columns, converted once
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._stop_pool: weakref.finalize | None = None
        self.fetches = 0  # blocks fetched (or asked for ahead): what the tests and the benchmark read
        self.retries = 0  # reads tried again after a failure

    def _load(self, b: int) -> Any:
        from ray.data.block import BlockAccessor

        span = self._spans[b]
        block = self._fetch(span.ref)
        accessor = BlockAccessor.for_block(block)
        if span.start or accessor.num_rows() != span.rows:
            block = accessor.slice(span.start, span.start + span.rows, False)
        return block

    def _insert(self, b: int, value: Any, keep: int) -> None:
        self._blocks[b] = value
        self.fetches += 1
        while len(self._blocks) > max(self.capacity, keep):
            gone, _ = self._blocks.popitem(last=False)
            self._numpy.pop(gone, None)

    def get(self, b: int, keep: int = 0) -> Any:
        """Block ``b`` (its span's rows), from the cache or fetched now."""
        for attempt in range(1, FETCH_TRIES + 1):
            try:
                return self._get_once(b, keep)
            except Exception as exc:  # the entry is gone (_get_once): the next try, or the next read, refetches
                if not _unreadable(exc):
                    raise
                if attempt == FETCH_TRIES:
                    raise InputUnavailable(
                        f"block {b} of {len(self._spans)} of the dataset could not be read in {FETCH_TRIES} tries "
                        f"({type(exc).__name__}: {exc}): its object is lost or its producer cannot run again; this "
                        "worker leaves the job as a lost worker, its peers re-form from their live state, and its "
                        "replacement reads the block again") from exc
                self.retries += 1
                _log.warning("reading block %d of %d failed (%s: %s); trying again (%d of %d tries)", b,
                             len(self._spans), type(exc).__name__, exc, attempt + 1, FETCH_TRIES)
                time.sleep(FETCH_RETRY_DELAY_S)
        raise AssertionError("unreachable")

    def _get_once(self, b: int, keep: int) -> Any:
        if b in self._blocks:
            self._blocks.move_to_end(b)
            value = self._blocks[b]
            if isinstance(value, concurrent.futures.Future):
                try:
                    value = value.result(timeout=FETCH_TIMEOUT_S)
                except BaseException:
                    self._drop(b, value)
                    raise
                self._blocks[b] = value
            return value
        value = self._load(b)
        self._insert(b, value, keep)
        return value

    def _drop(self, b: int, value: Any) -> None:
        """Forget block ``b`` if the cache still holds ``value`` for it (a failed or abandoned read)."""
        if self._blocks.get(b) is value:
            del self._blocks[b]
            self._numpy.pop(b, None)
        if isinstance(value, concurrent.futures.Future):
            value.cancel()

    def numpy(self, b: int, keep: int = 0) -> dict[str, np.ndarray]:
        """Block ``b`` as a dict of column -> numpy array (converted once while the block stays cached)."""
        block = self.get(b, keep)
        arrays = self._numpy.get(b)
        if arrays is None:
            arrays = self._numpy[b] = convert.to_batch(block, "numpy")
        return arrays

    def prefetch(self, blocks: Sequence[int], keep: int) -> None:
        """Start fetching the blocks not cached yet in the background."""
        for b in blocks:
            if b not in self._blocks:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="elastic-ring-blocks")
                    # the thread ends with the cache even without close(); the finalizer must not hold the cache
                    self._stop_pool = weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
                self._insert(b, self._pool.submit(self._load, b), keep)

    def clear(self) -> None:
        for b, value in list(self._blocks.items()):
            if isinstance(value, concurrent.futures.Future):
                value.cancel()
        self._blocks.clear()
        self._numpy.clear()

    def close(self) -> None:
        """Drop every block and stop the background thread (a read after this starts a new one)."""
        self.clear()
        if self._stop_pool is not None:
            self._stop_pool()  # shuts the pool down once; a second call does nothing
        self._pool = self._stop_pool = None

    @property
    def thread_running(self) -> bool:
        """Whether this cache's background thread exists and was not shut down."""
        return self._pool is not None


class ElasticDataShard(ElasticSampler):
    """This rank's part of a dataset passed to ``ElasticTrainer(datasets={...})``; get it with
    ``get_dataset_shard(name)`` and keep it in the state (``TorchState(..., sampler=shard)``).

    ``shuffle`` / ``seed``: the epoch's order (see :func:`block_order`); ``batch_size``: rows per batch
    (``iter_*``'s ``batch_size`` sets it); ``global_batch_size``: rows per optimizer step over the ring, as in
    ElasticSampler; ``cache_blocks``: blocks kept per shard. ``fetch`` (tests): reads a block from its ref."""

    def __init__(self, dataset: PreparedDataset, batch_size: int = DEFAULT_BATCH_SIZE, shuffle: bool = True,
                 seed: int = 0, global_batch_size: int | None = None, *, cache_blocks: int = 2,
                 fetch: Callable[[Any], Any] | None = None) -> None:
        if not isinstance(dataset, PreparedDataset):
            raise TypeError(f"ElasticDataShard takes a PreparedDataset (from get_dataset_shard(name)), got "
                            f"{type(dataset).__name__}")
        check_int("ElasticDataShard", "cache_blocks", cache_blocks, minimum=1,
                  hint="blocks kept in this worker's memory; 2 covers a batch that straddles two blocks")
        rows = [span.rows for span in dataset.blocks]
        self._prepared = dataset
        self._firsts = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64) if rows else np.zeros(0, np.int64)
        self._order: tuple[tuple[int, int, bool], torch.Tensor] | None = None
        self._cache = BlockCache(dataset.blocks, fetch or _ray_fetch, cache_blocks)
        self._partition = 0       # bumped by every re-partition (reset, set_epoch, load_state_dict)
        self._ran_out = -1        # the partition in which an iteration ran to the end of the epoch
        self._warned_unheld = False
        super().__init__(dataset.num_rows, batch_size, shuffle, seed, global_batch_size)

    def reset(self, rank: int | None = None, world: int | None = None) -> None:
        self._partition += 1
        super().reset(rank, world)

    def close(self) -> None:
        """Drop the cached blocks and stop the background reader thread (also done when the shard is collected)."""
        self._cache.close()

    @property
    def name(self) -> str:
        return self._prepared.name

    @property
    def block_fetches(self) -> int:
        """Blocks this shard has fetched from the object store (including those fetched ahead)."""
        return self._cache.fetches

    # ------------------------------------------------------------ order and rows
    def _permutation(self) -> torch.Tensor:
        key = (self.epoch, self.seed, self.shuffle)
        if self._order is None or self._order[0] != key:
            self._order = (key, block_order([s.rows for s in self._prepared.blocks], self.shuffle, self.seed,
                                            self.epoch))
        return self._order[1]

    def _locate(self, indices: Sequence[int]) -> list[tuple[int, np.ndarray]]:
        """``indices`` as runs of (block, rows within it), in order."""
        idx = np.asarray(indices, dtype=np.int64)
        blocks = np.searchsorted(self._firsts, idx, side="right") - 1
        local = idx - self._firsts[blocks]
        cuts = np.flatnonzero(np.diff(blocks)) + 1
        return [(int(b[0]), rows) for b, rows in zip(np.split(blocks, cuts), np.split(local, cuts))]

    @staticmethod
    def _run(rows: np.ndarray) -> slice | np.ndarray:
        """Rows of one block as a slice when they are contiguous and ascending, else as they are."""
        first, last = int(rows[0]), int(rows[-1])
        if last - first + 1 == len(rows) and (len(rows) == 1 or bool(np.all(np.diff(rows) == 1))):
            return slice(first, last + 1)
        return rows

    def _block_of_rows(self, indices: Sequence[int], keep: int = 0) -> Any:
        """The rows at global ``indices`` as one block (an empty one keeps the columns)."""
        from ray.data.block import BlockAccessor

        if len(indices) == 0:
            return BlockAccessor.for_block(self._cache.get(0, keep)).slice(0, 0, False)
        pieces = []
        for b, rows in self._locate(indices):
            accessor, run = BlockAccessor.for_block(self._cache.get(b, keep)), self._run(rows)
            pieces.append(accessor.slice(run.start, run.stop, False) if isinstance(run, slice)
                          else accessor.take(run.tolist()))
        return convert.concat_blocks(pieces)

    def _numpy_rows(self, indices: Sequence[int], keep: int = 0) -> dict[str, np.ndarray]:
        """The rows at global ``indices`` as fresh numpy columns, gathered from the cached blocks' columns."""
        if len(indices) == 0:
            return {k: v[:0].copy() for k, v in self._cache.numpy(0, keep).items()}
        parts = [(self._cache.numpy(b, keep), self._run(rows)) for b, rows in self._locate(indices)]
        return {k: np.concatenate([arrays[k][run] for arrays, run in parts]) for k in parts[0][0]}

    def _blocks(self, prefetch_batches: int, numpy: bool) -> Iterator[Any]:
        """This rank's remaining batches of the epoch as blocks (or numpy columns), fetching the next
        ``prefetch_batches``' blocks ahead."""
        partition, batches = self._partition, self._batches()
        window: collections.deque[list[int]] = collections.deque()
        for indices in batches:
            window.append(indices)
            if len(window) <= prefetch_batches:
                continue
            yield self._next(window, numpy)
        while window:
            yield self._next(window, numpy)
        if partition == self._partition:
            self._ran_out = partition

    def _next(self, window: collections.deque, numpy: bool) -> Any:
        current = window.popleft()
        ahead = sorted({b for indices in window if indices for b, _ in self._locate(indices)})
        need = len({b for b, _ in self._locate(current)}) if current else 1
        keep = need + len(ahead)
        rows = self._numpy_rows(current, keep) if numpy else self._block_of_rows(current, keep)
        if ahead:
            self._cache.prefetch(ahead, keep)
        return rows

    # ------------------------------------------------------------ Ray Data's iterators
    def _check_epoch(self, what: str) -> None:
        """RuntimeError if an iteration of this partition already ran to the end of the epoch and nothing is left."""
        if self._ran_out == self._partition and self._consumed >= len(self._sizes):
            raise RuntimeError(
                f"{what}: shard {self.name!r} is at the end of epoch {self.epoch} (an earlier iteration yielded its "
                f"last batch) and set_epoch() was not called since. In Ray Data every iter_*() call is a new epoch; "
                f"here the epoch is part of the shard's saved position, so that it survives failures: call "
                f"shard.set_epoch(epoch + 1) after each epoch, e.g. `for state.epoch in range(state.epoch, epochs): "
                f"shard.set_epoch(state.epoch); for batch in shard.iter_torch_batches(...): ...` (docs/ray_data.md)")

    def _check_held(self) -> None:
        """Warn once when iterated in a ring without a State holding the position (it would not survive a failure)."""
        if self._warned_unheld or self._held_by_state or runtime.current_or_none() is None:
            return
        self._warned_unheld = True
        warnings.warn(
            f"shard {self.name!r} is iterated in a ring, but no State holds its position: a failure would lose its "
            f"place in the epoch. If it feeds training steps, keep it in the state, TorchState(..., sampler=shard), "
            f"and iterate it inside @er.elastic.run (a validation shard may stay outside: a failure then restarts "
            f"its evaluation epoch)", RuntimeWarning,
            stacklevel=4)

    def _use(self, batch_size: Any, drop_last: Any, local_shuffle_buffer_size: Any, prefetch_batches: Any,
             what: str) -> None:
        self._check_epoch(what)
        self._check_held()
        if batch_size is None:
            raise ValueError(f"{what} batch_size=None (whole blocks) is not supported: every rank takes an equal "
                             "share of each step; give the rows per batch (Ray Data's default is 256)")
        check_int(what, "batch_size", batch_size, minimum=1)
        check_int(what, "prefetch_batches", prefetch_batches, minimum=0)
        if drop_last:
            raise ValueError(f"{what} drop_last=True is not supported: every row is trained exactly once per "
                             "epoch (the epoch's tail is folded into its last batch); leave drop_last=False")
        if local_shuffle_buffer_size is not None:
            raise ValueError(f"{what} local_shuffle_buffer_size={local_shuffle_buffer_size!r} is not supported: "
                             "the order is a seeded per-epoch shuffle; use get_dataset_shard(name, shuffle=True, "
                             "seed=...)")
        if batch_size == self.batch_size:
            return
        if self._done or self._acks:
            raise ValueError(
                f"{what} batch_size={batch_size}, but this shard is {self._done + self._acks} batch(es) into its "
                f"part of epoch {self.epoch} with batch_size={self.batch_size}; use one batch size for the "
                f"whole job (or give it to get_dataset_shard(name, batch_size=...))")
        self.batch_size = batch_size
        self.reset(self._rank, self._world)

    def iter_batches(self, *, batch_size: int | None = DEFAULT_BATCH_SIZE, batch_format: str = "default",
                     prefetch_batches: int = 1, drop_last: bool = False, local_shuffle_buffer_size: int | None = None,
                     local_shuffle_seed: int | None = None) -> Iterator[Any]:
        """This rank's remaining batches of the epoch: dicts of column -> numpy array (``batch_format``
        ``"default"``/``"numpy"``), pandas frames (``"pandas"``) or pyarrow tables (``"pyarrow"``)."""
        fmt = convert.check_batch_format(batch_format)
        self._use(batch_size, drop_last, local_shuffle_buffer_size, prefetch_batches, "iter_batches")
        if fmt == "numpy":
            return self._blocks(prefetch_batches, numpy=True)
        return (convert.to_batch(block, fmt) for block in self._blocks(prefetch_batches, numpy=False))

    def iter_torch_batches(self, *, batch_size: int | None = DEFAULT_BATCH_SIZE, dtypes: Any = None,
                           device: Any = "auto", collate_fn: Callable | None = None, prefetch_batches: int = 1,
                           drop_last: bool = False, local_shuffle_buffer_size: int | None = None,
                           local_shuffle_seed: int | None = None, pin_memory: bool = False) -> Iterator[Any]:
        """This rank's remaining batches of the epoch as dicts of column -> tensor on ``device`` (``"auto"``:
        this worker's GPU when it has one), or what ``collate_fn`` makes of each batch."""
        if collate_fn is not None and dtypes is not None:
            raise ValueError("iter_torch_batches: collate_fn cannot be used with dtypes; convert the dtypes in "
                             "collate_fn")
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"iter_torch_batches collate_fn={collate_fn!r} must be callable")
        self._use(batch_size, drop_last, local_shuffle_buffer_size, prefetch_batches, "iter_torch_batches")
        target = convert.resolve_device(device)

        def batches() -> Iterator[Any]:
            fmt = convert.collate_input_format(collate_fn) if collate_fn is not None else "numpy"
            for rows in self._blocks(prefetch_batches, numpy=fmt == "numpy"):
                batch = rows if fmt == "numpy" else convert.to_batch(rows, fmt)
                if collate_fn is not None:
                    yield convert.move(collate_fn(batch), target)
                else:
                    yield convert.to_tensors(batch, dtypes, target)

        return batches()

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict:
        prepared = self._prepared
        return {**super().state_dict(), "dataset": {"name": prepared.name, "rows": prepared.num_rows,
                                                    "blocks": len(prepared.blocks),
                                                    "fingerprint": prepared.fingerprint,
                                                    "shape": prepared.shape_fingerprint}}

    def load_state_dict(self, state: dict) -> None:
        saved, prepared = state.get("dataset"), self._prepared
        if saved is not None and (saved.get("rows"), saved.get("fingerprint")) != (prepared.num_rows,
                                                                                   prepared.fingerprint):
            same_shape = saved.get("shape") == prepared.shape_fingerprint and saved.get("rows") == prepared.num_rows
            why = ("the same rows per block and columns, but other values in the blocks (other data, the blocks in "
                   "another order, or a random or time-dependent transform)" if same_shape else
                   "resuming needs the same rows in the same blocks")
            raise ValueError(
                f"the saved position is for dataset {saved.get('name')!r} of {saved.get('rows')} rows in "
                f"{saved.get('blocks')} blocks (fingerprint {saved.get('fingerprint')}), but dataset {prepared.name!r} "
                f"now has {prepared.num_rows} rows in {len(prepared.blocks)} blocks (fingerprint "
                f"{prepared.fingerprint}): {why}; rebuild the dataset exactly as the run that saved it did (same "
                f"files, same transforms, same block sizes)")
        super().load_state_dict(state)
