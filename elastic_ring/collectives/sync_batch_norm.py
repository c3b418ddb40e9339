"""Batch normalization over the whole ring's batch (Horovod's ``hvd.SyncBatchNorm``).

In training mode the batch statistics are those of every rank's batch together:
two allreduces per forward (the per-channel sums and counts, then the squared
deviations from the global mean: two passes, so the variance does not lose
precision to ``E[x^2] - E[x]^2``), and, through the allreduce's gradient
(the allreduce of the gradient), two per backward. Running statistics are
updated with the global mean and the unbiased global variance, so they are the
same on every rank. In eval mode, at world size 1, or outside a ring it is a
plain ``BatchNorm``. Every rank must call it the same number of times, as any
collective. Ranks may hold batches of different sizes (even empty ones).
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ..core.ops import Sum
from ..ring import runtime
from .tensors import allreduce


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.BatchNorm{1,2,3}d`` whose training statistics cover every rank's batch."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of shape (N, C, ...), got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        comm = runtime.current_or_none()
        if not self.training or comm is None or comm.size == 1:
            return super().forward(input)
        if self.momentum is None:
            raise ValueError("SyncBatchNorm needs a momentum (a cumulative average, momentum=None, is not supported)")
        channels = input.shape[1]
        dims = [d for d in range(input.dim()) if d != 1]
        shape = [1, channels] + [1] * (input.dim() - 2)
        local_count = input.numel() // channels if input.numel() else 0
        stats = torch.cat([input.sum(dims), torch.tensor([float(local_count)], dtype=input.dtype, device=input.device)])
        total = allreduce(stats, op=Sum, name="SyncBatchNorm.sum")
        count = total[-1]
        if float(count) < 2:
            raise ValueError(f"SyncBatchNorm needs more than one value per channel over the ring, got {int(count)}")
        mean = total[:-1] / count
        centered = input - mean.view(shape)
        var = allreduce((centered * centered).sum(dims), op=Sum, name="SyncBatchNorm.var") / count
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                unbiased = var.detach() * (count / (count - 1))
                self.running_mean.mul_(1 - self.momentum).add_(mean.detach(), alpha=self.momentum)
                self.running_var.mul_(1 - self.momentum).add_(unbiased, alpha=self.momentum)
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module) -> torch.nn.Module:
        """Replace every ``BatchNorm*d`` in ``module`` with a SyncBatchNorm holding the same parameters and stats."""
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
            if module.affine:
                with torch.no_grad():
                    converted.weight = module.weight
                    converted.bias = module.bias
            if module.track_running_stats:
                converted.running_mean = module.running_mean
                converted.running_var = module.running_var
                converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child))
        return converted

