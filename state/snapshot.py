"""Host-memory snapshots of tensor trees, reusing their buffers from one commit to the next.

A tree is nested dicts, lists and tuples whose leaves are tensors or plain
values. ``take(tree)`` copies it to host memory. Buffers are reused when the
tree has the same structure as last time: a commit then costs one memcpy
(fresh buffers would pay page faults on every commit). ``copy_tree`` returns
an independent deep copy, for handing a snapshot to someone who keeps it.
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import torch

_MAPPINGS = (dict, collections.OrderedDict)


def _leaves(tree: Any, out: list[torch.Tensor]) -> Any:
    """The tree's structure with tensors replaced by their index in ``out``."""
    if isinstance(tree, torch.Tensor):
        out.append(tree)
        return ("__tensor__", len(out) - 1, tuple(tree.shape), tree.dtype)
    if type(tree) in _MAPPINGS:
        return type(tree)((k, _leaves(v, out)) for k, v in tree.items())
    if type(tree) in (list, tuple):
        return type(tree)(_leaves(v, out) for v in tree)
    return copy.deepcopy(tree)


def _build(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, tuple) and len(skeleton) == 4 and skeleton[0] == "__tensor__":
        return tensors[skeleton[1]]
    if type(skeleton) in _MAPPINGS:
        return type(skeleton)((k, _build(v, tensors)) for k, v in skeleton.items())
    if type(skeleton) in (list, tuple):
        return type(skeleton)(_build(v, tensors) for v in skeleton)
    return copy.deepcopy(skeleton)


class SnapshotBuffer:
    """Takes snapshots of trees with the same structure into the same host buffers."""

    def __init__(self) -> None:
        self._skeleton: Any = None
        self._buffers: list[torch.Tensor] = []

    def take(self, tree: Any) -> Any:
        sources: list[torch.Tensor] = []
        skeleton = _leaves(tree, sources)
        if skeleton != self._skeleton or len(sources) != len(self._buffers):
            self._skeleton = skeleton
            self._buffers = [torch.empty(t.shape, dtype=t.dtype, device="cpu") for t in sources]
        detached = [t.detach() for t in sources]
        if detached:
            torch._foreach_copy_(self._buffers, detached, non_blocking=True)
            if any(t.is_cuda for t in detached):
                torch.cuda.synchronize()
        return _build(skeleton, self._buffers)


def copy_tree(tree: Any) -> Any:
    """An independent deep copy (tensors cloned)."""
    sources: list[torch.Tensor] = []
    skeleton = _leaves(tree, sources)
    return _build(skeleton, [t.detach().clone() for t in sources])
