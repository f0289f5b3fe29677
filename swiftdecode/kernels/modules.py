"""torch modules over quantized weights: a linear layer and an embedding table that read `QuantWeight` planes.

Each module holds its own kernel handle (no class-wide state), so models on different paths share a process.
"""

from __future__ import annotations

import torch
from torch import nn

from swiftdecode.kernels.qgemm import Plan, QKernel
from swiftdecode.kernels.qweight import QuantWeight


class QuantLinear(nn.Module):
    """y = x W^T + b with W kept block-quantized; x fp32 [..., in_features] -> fp32 [..., out_features]."""

    def __init__(self, qweight: QuantWeight, bias: torch.Tensor | None, kernel: QKernel):
        super().__init__()
        self.qweight, self.kernel = qweight, kernel
        self.in_features, self.out_features = qweight.k, qweight.n
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)
        self._plan: Plan | None = None  # the prepared kernel call, rebuilt if the bias is replaced (as loading does)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._plan is None or self._plan.bias_tensors[0] is not self.bias:
            self._plan = Plan([self.qweight], [self.bias])
        return self.kernel.run(self._plan, x)[0]

    def extra_repr(self) -> str:
        q = self.qweight
        return f"in_features={q.k}, out_features={q.n}, format={q.kind}, bias={self.bias is not None}"


class QuantEmbedding(nn.Module):
    """Embedding lookup from a block-quantized table (rows dequantized on the fly), times `scale` if given
    (Gemma's scaled embeddings)."""

    def __init__(self, qweight: QuantWeight, kernel: QKernel, scale: float | None = None):
        super().__init__()
        self.qweight, self.kernel = qweight, kernel
        self.num_embeddings, self.embedding_dim = qweight.n, qweight.k
        self.scale = None if scale is None else torch.tensor(scale, dtype=torch.float32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.kernel.rows(self.qweight, ids)
        return out if self.scale is None else out * self.scale

    def extra_repr(self) -> str:
        return f"{self.qweight.n}, {self.qweight.k}, format={self.qweight.kind}"
