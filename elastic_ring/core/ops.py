"""Reduction operations of allreduce, with Horovod-style module aliases."""

from __future__ import annotations

import enum


class ReduceOp(enum.Enum):
    """How allreduce combines the ranks' tensors."""

    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"

    @classmethod
    def parse(cls, op: "ReduceOp | str") -> "ReduceOp":
        if isinstance(op, cls):
            return op
        if isinstance(op, str):
            try:
                return cls(op.lower())
            except ValueError:
                pass
        choices = ", ".join(f"elastic_ring.{m.name.title()}" for m in cls)
        raise ValueError(f"op={op!r} is not a reduction; use one of {choices}")


Sum = ReduceOp.SUM
Average = ReduceOp.AVERAGE
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
