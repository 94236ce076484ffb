"""Training FLOPs per token of the reference GPT, and model FLOPs utilisation (MFU).

MFU = achieved model FLOPs per second / the device's peak FLOPs per second, where
the model FLOPs are counted from the architecture, not measured, so that MFU is
comparable across implementations and does not reward recomputation (PaLM,
Chowdhery et al. 2022, appendix B; nanoGPT ``estimate_mfu``).

Per token of training (forward + backward = 3 x forward):

    flops_per_token = 6 * N + 12 * L * d_model * T

* ``N``: parameters that take part in a matrix multiply for each token:
  per layer the attention projections ``4 * d^2`` and the feed-forward
  ``2 * d * h`` (``h = mlp_ratio * d``); for a mixture of experts only the
  ``top_k`` experts a token is routed to, plus the router ``d * E``; and the
  LM head ``d * V``.  Embedding lookups do no multiply, and LayerNorm affine
  parameters are O(d) elementwise work, so neither is counted.  Each such
  parameter costs 2 FLOPs (multiply + add) forward and 4 backward: ``6 * N``.
* ``12 * L * d_model * T`` (``= 12 * L * H * Q * T`` with H heads of size Q): the
  attention score ``QK^T`` and the weighted sum ``AV``, 2 * 2 * T * d FLOPs
  forward per token and layer, times 3 for training.  As in PaLM it counts the
  full T x T matrix, not the causal half, and ``T`` is ``model.seq_len``.

Peak numbers are dense (no 2:4 sparsity) bf16 tensor-core FLOPs from the
vendors' datasheets.  CPUs have no entry: MFU is None there unless the caller
supplies a peak.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence, Tuple

# Ordered: the first pattern that matches torch.cuda.get_device_name() wins.
# Word boundaries keep "A10" from matching "A100" or "A10G".
PEAK_BF16_DENSE_FLOPS: Sequence[Tuple[str, float]] = (
    (r"\bH100\b.*\bPCIe\b", 756e12),
    (r"\bH100\b.*\bNVL\b", 835e12),
    (r"\bH100\b", 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    (r"\bH200\b.*\bNVL\b", 835e12),
    (r"\bH200\b", 989e12),
    (r"\bA100\b", 312e12),  # SXM and PCIe alike
    (r"\bL40S\b", 362e12),
    (r"\bL4\b", 121e12),
    (r"\bA10\b", 125e12),
    (r"\bMI300X\b", 1307e12),
)


def model_flops_per_token(model_cfg) -> float:
    """Training FLOPs per token: ``6 * N + 12 * L * d_model * seq_len`` (see the module doc)."""
    return (
        6.0 * matmul_params(model_cfg)
        + 12.0 * model_cfg.n_layers * model_cfg.d_model * model_cfg.seq_len
    )


def matmul_params(model_cfg) -> int:
    """``N``: the parameters one token multiplies through (embeddings and LayerNorms excluded)."""
    d, hidden = model_cfg.d_model, model_cfg.mlp_ratio * model_cfg.d_model
    moe = model_cfg.moe
    if moe.num_experts:
        ffn = moe.top_k * 2 * d * hidden + d * moe.num_experts
    else:
        ffn = 2 * d * hidden
    return model_cfg.n_layers * (4 * d * d + ffn) + d * model_cfg.vocab_size


def peak_flops_for(device_name: Optional[str]) -> Optional[float]:
    """Dense bf16 peak FLOP/s of one device named like ``torch.cuda.get_device_name()``.

    None for an unknown device or a CPU: pass the peak explicitly then.
    """
    if not device_name:
        return None
    for pattern, peak in PEAK_BF16_DENSE_FLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peak
    return None


def mfu(
    tokens_per_s: Optional[float],
    flops_per_token: float,
    peak_flops: Optional[float],
    num_devices: int = 1,
) -> Optional[float]:
    """Model FLOPs utilisation in [0, 1]: ``tokens_per_s * flops_per_token / (peak * devices)``.

    ``tokens_per_s`` is the throughput of all ``num_devices`` together (the
    run's global tokens/s with ``num_devices = world size``); ``peak_flops``
    is one device's peak.  None when the peak or the throughput is unknown.
    """
    if peak_flops is None or tokens_per_s is None:
        return None
    if peak_flops <= 0:
        raise ValueError(
            f"peak_flops must be > 0 FLOP/s (got {peak_flops}); pass None "
            "when the device's peak is unknown"
        )
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1 (got {num_devices})")
    return tokens_per_s * flops_per_token / (peak_flops * num_devices)
