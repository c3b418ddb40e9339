"""Gradient compression: which dtype tensors travel in ("the wire dtype").

Horovod-style objects: ``Compression.none`` sends tensors as they are;
``Compression.fp16`` sends float32/float64 tensors as float16 and restores the
dtype after the reduction. Compression applies to whole fusion buffers, so it
costs one cast per buffer, not one per tensor.
"""

from __future__ import annotations

import torch


class Compressor:
    """Sends tensors in their own dtype."""

    name = "none"

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """Return the tensor to send and what ``decompress`` needs to undo it."""
        return tensor.to(self.wire_dtype(tensor.dtype)), tensor.dtype

    def decompress(self, tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        return tensor.to(ctx)

    def __repr__(self) -> str:
        return f"Compression.{self.name}"


class FP16Compressor(Compressor):
    """Sends float32 and float64 tensors as float16 (half the bytes)."""

    name = "fp16"

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float16 if dtype in (torch.float32, torch.float64) else dtype


class Compression:
    """The available compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = Compressor()
    fp16 = FP16Compressor()


def check_compressor(compression: object) -> Compressor:
    if not isinstance(compression, Compressor):
        raise ValueError(
            f"compression={compression!r} is not a compressor; use elastic_ring.Compression.none or Compression.fp16"
        )
    return compression
