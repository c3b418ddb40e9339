"""Turning a block of rows into what Ray Data's iterators yield: numpy / pandas / pyarrow batches and tensors."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

BATCH_FORMATS = ("default", "numpy", "pandas", "pyarrow")


def check_batch_format(batch_format: Any) -> str:
    if batch_format not in BATCH_FORMATS:
        raise ValueError(f"iter_batches batch_format={batch_format!r} must be one of {', '.join(BATCH_FORMATS)} "
                         "('default' is 'numpy': a dict of column -> numpy array)")
    return "numpy" if batch_format == "default" else batch_format


def concat_blocks(pieces: list[Any]) -> Any:
    """One block from several (pyarrow tables stay a table; anything else becomes a pandas frame)."""
    if len(pieces) == 1:
        return pieces[0]
    import pyarrow as pa

    if all(isinstance(p, pa.Table) for p in pieces):
        return pa.concat_tables(pieces)
    import pandas as pd
    from ray.data.block import BlockAccessor

    return pd.concat([BlockAccessor.for_block(p).to_pandas() for p in pieces], ignore_index=True)


def to_batch(block: Any, batch_format: str) -> Any:
    """``block`` in ``batch_format`` (``numpy``: a dict of column -> numpy array, as Ray Data yields)."""
    from ray.data.block import BlockAccessor

    return BlockAccessor.for_block(block).to_batch_format(batch_format)


def auto_device() -> torch.device:
    """Ray Data's ``device="auto"`` inside a worker: its GPU when the actor holds one, else the CPU."""
    if torch.cuda.is_available():
        import ray

        if ray.is_initialized() and ray.get_gpu_ids():
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_device(device: Any) -> torch.device:
    if device is None or device == "auto":
        return auto_device()
    try:
        resolved = torch.device(device)
    except (TypeError, RuntimeError) as exc:
        raise ValueError(f"iter_torch_batches device={device!r} is not a torch device ('cpu', 'cuda:0', 'auto')") from exc
    if resolved.type == "cuda" and resolved.index is None and torch.cuda.is_available():
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def to_tensors(batch: dict[str, np.ndarray], dtypes: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """A numpy batch as a dict of tensors (``dtypes``: one torch dtype, or a dict of column -> dtype)."""
    out = {}
    for name, values in batch.items():
        dtype = dtypes.get(name) if isinstance(dtypes, dict) else dtypes
        if values.dtype == object:
            try:
                values = np.stack(values)
            except (TypeError, ValueError) as exc:
                raise TypeError(
                    f"column {name!r} holds {type(values[0]).__name__ if len(values) else 'object'} values of "
                    f"unequal shapes or non-numeric data, which cannot become one tensor; use iter_batches() or "
                    f"iter_torch_batches(collate_fn=...) for it") from exc
        if not values.flags.writeable:  # zero-copy views of the object store: the tensor owns its memory
            values = values.copy()
        out[name] = torch.as_tensor(values, dtype=dtype, device=device)
    return out


def move(value: Any, device: torch.device) -> Any:
    """Tensors in ``value`` (a tensor, or a dict / list / tuple of them) on ``device``; anything else as is."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: move(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(move(v, device) for v in value)
    return value


def collate_input_format(collate_fn: Callable) -> str:
    """The batch format Ray Data hands a ``collate_fn``: by its base class, else a numpy dict."""
    try:
        from ray.data.collate_fn import ArrowBatchCollateFn, PandasBatchCollateFn
    except ImportError:  # an older Ray: plain callables take numpy dicts
        return "numpy"
    if isinstance(collate_fn, ArrowBatchCollateFn):
        return "pyarrow"
    if isinstance(collate_fn, PandasBatchCollateFn):
        return "pandas"
    return "numpy"
