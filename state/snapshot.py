"""Host-memory snapshots of tensor trees, reusing their buffers from one snapshot to the next.

A tree is nested containers (dicts, lists, tuples, ... whatever ``torch.utils._pytree`` walks)
whose leaves are tensors or plain values. ``SnapshotBuffer.take(tree)`` copies it to host memory.
Buffers are reused while the tensors keep their shapes and dtypes: a snapshot then costs one
memcpy (fresh buffers would pay page faults every time). Plain leaves are deep-copied.
``copy_tree`` returns an independent deep copy, for handing a snapshot to someone who keeps it.

The commit of a :class:`~state.State` keeps one such buffer per handler, and the durable
checkpoint writer keeps one of its own: persisting costs one more copy of the state in host
memory, reused from one checkpoint to the next.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.utils._pytree as pytree


def _layout(leaves: list[Any]) -> tuple:
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else None for x in leaves)


class SnapshotBuffer:
    """Takes snapshots of trees with the same structure into the same host buffers."""

    def __init__(self) -> None:
        self._spec: Any = None
        self._layout: tuple = ()
        self._buffers: list[torch.Tensor | None] = []

    @property
    def nbytes(self) -> int:
        """Bytes held by this buffer's tensors."""
        return sum(b.numel() * b.element_size() for b in self._buffers if b is not None)

    def take(self, tree: Any) -> Any:
        """A host copy of ``tree`` in this buffer's tensors (valid until the next ``take``)."""
        leaves, spec = pytree.tree_flatten(tree)
        layout = _layout(leaves)
        if spec != self._spec or layout != self._layout:
            self._spec, self._layout = spec, layout
            self._buffers = [torch.empty(x.shape, dtype=x.dtype, device="cpu") if isinstance(x, torch.Tensor) else None
                             for x in leaves]
        targets = [b for b in self._buffers if b is not None]
        sources = [x.detach() for x in leaves if isinstance(x, torch.Tensor)]
        if sources:
            torch._foreach_copy_(targets, sources, non_blocking=True)
            if any(t.is_cuda for t in sources):
                torch.cuda.synchronize()
        out = [b if b is not None else copy.deepcopy(x) for b, x in zip(self._buffers, leaves)]
        return pytree.tree_unflatten(out, spec)

    def release(self) -> None:
        """Drop the buffers (the next ``take`` allocates again)."""
        self._spec, self._layout, self._buffers = None, (), []


def copy_tree(tree: Any) -> Any:
    """An independent deep copy (tensors cloned, plain values deep-copied)."""
    return pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else copy.deepcopy(x), tree)

