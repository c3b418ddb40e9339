"""NCCL's codes for torch dtypes and reduction ops, and its unique id as read from the store (pure; shared by
the communicator and its bucket paths)."""

from __future__ import annotations

import torch

from ...core.errors import CommError
from ...core.ops import ReduceOp
from . import lib as nccl_lib

_REDUCE_DTYPES = {
    torch.float16: nccl_lib.FLOAT16, torch.bfloat16: nccl_lib.BFLOAT16, torch.float32: nccl_lib.FLOAT32,
    torch.float64: nccl_lib.FLOAT64, torch.int8: nccl_lib.INT8, torch.uint8: nccl_lib.UINT8,
    torch.int32: nccl_lib.INT32, torch.int64: nccl_lib.INT64,
}
for _name, _code in (("uint32", nccl_lib.UINT32), ("uint64", nccl_lib.UINT64)):
    if hasattr(torch, _name):
        _REDUCE_DTYPES[getattr(torch, _name)] = _code

_REDUCE_OPS = {ReduceOp.SUM: nccl_lib.SUM, ReduceOp.MIN: nccl_lib.MIN, ReduceOp.MAX: nccl_lib.MAX,
               ReduceOp.PRODUCT: nccl_lib.PROD}


def reduce_dtype(dtype: torch.dtype) -> int:
    """NCCL's data type for reducing ``dtype``; ValueError naming the dtype and the fix otherwise."""
    try:
        return _REDUCE_DTYPES[dtype]
    except KeyError:
        names = sorted(str(d).replace("torch.", "") for d in _REDUCE_DTYPES)
        raise ValueError(f"NCCL cannot reduce tensors of dtype {dtype}; cast to one of {names}") from None


def reduce_op(op: ReduceOp) -> int:
    try:
        return _REDUCE_OPS[op]
    except KeyError:
        raise ValueError(f"the NCCL backend reduces with SUM, MIN, MAX or PRODUCT, got {op}") from None


def check_unique_id(value: object, identity: str) -> bytes:
    """The unique id read from the store, as bytes; CommError if it is not 128 raw bytes."""
    if isinstance(value, (bytes, bytearray)) and len(value) == nccl_lib.UNIQUE_ID_BYTES:
        return bytes(value)
    size = len(value) if isinstance(value, (bytes, bytearray)) else type(value).__name__
    raise CommError(
        f"[{identity}] the NCCL unique id in the store is not {nccl_lib.UNIQUE_ID_BYTES} raw bytes (got {size}); "
        "every worker must run the same elastic_ring version (the id is published as raw bytes, not pickled)"
    )
