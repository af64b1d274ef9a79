"""The decoder's building blocks: RoPE tables, RMSNorm, the MLP's gate activations, and the
dense matmul wrapper."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model import kernels
from radixserve.model.config import ModelConfig


def frozen(t: torch.Tensor) -> nn.Parameter:
    """`t` as a parameter that takes no gradient (the model only runs inference)."""
    return nn.Parameter(t, requires_grad=False)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim/2] of base `theta`, with `scaling` (linear, llama3)."""
    d = head_dim
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = scaling
    if not s:
        return inv.float()
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "default":
        return inv.float()
    if kind == "linear":
        return (inv / float(s["factor"])).float()
    if kind == "llama3":
        factor = float(s["factor"])
        low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_ctx = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_ctx / low, old_ctx / high
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > low_wl, inv / factor, inv)
        is_mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        return torch.where(is_mid, mid, out).float()
    raise ValueError(f"unsupported rope scaling {kind!r}")


class Rotary(nn.Module):
    """cos/sin tables for every position below `positions` (the served context; the model's
    maximum when None), built once: table 0 for full-attention layers, table 1 for sliding
    layers with their own base (Gemma 3). A 128k-position model served at 8k builds 1/16 of
    them (Llama 3.2's whole tables: 67 MB, held while its weights load)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: ModelConfig, dtype: torch.dtype, positions: int | None = None):
        super().__init__()
        limit = config.max_position_embeddings
        t = torch.arange(min(positions, limit) if positions else limit, dtype=torch.float32)
        bases = [(config.rope_theta, config.rope_scaling)]
        if config.local_rope_theta is not None:
            bases.append((config.local_rope_theta, None))
        cos, sin = [], []
        for theta, scaling in bases:
            freqs = torch.outer(t, rope_inv_freq(config.head_dim, theta, scaling))
            emb = torch.cat([freqs, freqs], dim=-1)
            cos.append(emb.cos().to(dtype))
            sin.append(emb.sin().to(dtype))
        self.register_buffer("cos", torch.stack(cos), persistent=False)
        self.register_buffer("sin", torch.stack(sin), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [tables, T, head_dim] of each position [T]."""
        return self.cos[:, positions], self.sin[:, positions]


class Linear:
    """y = x W^T (+ b), with the weight prepacked for oneDNN where that is faster.

    On CPU in bfloat16, oneDNN's prepacked GEMM is ~1.7x faster than F.linear for the
    few-row matmuls of decode steps; elsewhere this is F.linear. A weight still empty (a GGUF
    matrix that will compute from its codes) is not packed.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias, self.packed = weight, bias, None
        if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.numel():
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
                probe = torch.ones(2, weight.shape[1], dtype=weight.dtype)
                self._packed_call(probe, packed)
                self.packed = packed
            except (RuntimeError, AttributeError):
                self.packed = None

    def _packed_call(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return out

    def __call__(self, x: torch.Tensor, fp32_rows: int = 0) -> torch.Tensor:
        """x [..., in] -> [..., out]. `fp32_rows` is QuantLinear's (decode rows); a dense
        matmul computes every row alike."""
        if self.packed is not None:
            return self._packed_call(x, self.packed)
        return F.linear(x, self.weight, self.bias)


def fused_kernels_apply(weight: torch.Tensor) -> bool:
    """Whether a layer with weights like `weight` runs its elementwise steps in our CPU
    kernels (float32 on CPU, kernels built; RADIXSERVE_CPU_KERNELS=0 turns them off)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and kernels.load()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, scaled in the model dtype (as transformers does).

    Normalising in float32 explicitly is also ~20x faster on CPU than bf16 F.rms_norm.
    """
    normed: torch.Tensor = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by the per-token cos/sin [T, D] (rotate-half layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def gate_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's gate activation by ModelConfig.hidden_act: SiLU (SwiGLU) or tanh-approximated
    GELU (GeGLU, as transformers' gelu_pytorch_tanh)."""
    if name == "silu":
        return F.silu
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"unknown activation {name!r}")
