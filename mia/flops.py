"""Model FLOPs of a decoder's forward pass and the peak FLOP/s of accelerators: tokens/s -> model FLOP utilisation.

MFU = model FLOPs of the work done / (seconds x devices x peak FLOP/s of one device). Model FLOPs per token
(forward only, PaLM's convention): 2 N + 4 L T D, with N the matmul weights (q/k/v, output, the two MLP matrices of
every layer, and the LM head; not the input embedding, a gather), L layers, T the row length, D the width.

Peaks (``PEAK_BF16_TFLOPS``) are dense bf16 (no structured sparsity) tensor-core / MXU figures per device, from the
vendors' data sheets: NVIDIA A100 Tensor Core GPU data sheet (BF16 312 TFLOPS; 624 "with sparsity"); NVIDIA H100
data sheet (SXM 1,979 / PCIe 1,513 / NVL 1,671 TFLOPS with sparsity, half that dense: 989 / 756 / 835); NVIDIA H200
data sheet (SXM 1,979 with sparsity: 989 dense; NVL 835); NVIDIA L4 data sheet (242 with sparsity: 121 dense); L40S
(733 with sparsity: 362); A10G (70, AWS); V100 (125, fp16 tensor cores); Google Cloud TPU system architecture pages,
peak bf16 per chip: v4 275, v5e 197, v5p 459, v6e (Trillium) 918. jax names the TPUs "TPU v4", "TPU v5 lite"
(v5e), "TPU v5" or "TPU v5p" (v5p), "TPU v6 lite" (v6e).
"""
from __future__ import annotations

from typing import Optional

# matched as substrings of jax's ``device_kind`` (lower case), first match wins
PEAK_BF16_TFLOPS = (
    ("h200 nvl", 835.0), ("h200", 989.0), ("h100 nvl", 835.0), ("h100 pcie", 756.0), ("h100", 989.0),
    ("a100", 312.0), ("l40s", 362.0), ("l4", 121.0), ("a10g", 70.0), ("v100", 125.0),
    ("tpu v6 lite", 918.0), ("tpu v6e", 918.0), ("tpu v5 lite", 197.0), ("tpu v5e", 197.0), ("tpu v5p", 459.0),
    ("tpu v5", 459.0), ("tpu v4", 275.0),
)


def peak_tflops(device_kind: str) -> Optional[float]:
    """Peak dense bf16 TFLOP/s of one device of a jax ``device_kind``, or None when unknown (e.g. a CPU)."""
    kind = device_kind.lower()
    return next((v for k, v in PEAK_BF16_TFLOPS if k in kind), None)


def forward_flops_per_token(hidden: int, layers: int, ffn: int, vocab: int, length: int) -> float:
    """2 N + 4 L T D for a decoder with the usual four attention matrices and a two-matrix MLP of width ``ffn``
    (N = matmul weights: per layer 4 D^2 + 2 D F, plus the D x V LM head)."""
    n_matmul = layers * (4 * hidden * hidden + 2 * hidden * ffn) + hidden * vocab
    return 2.0 * n_matmul + 4.0 * layers * length * hidden


def mfu(flops: float, seconds: float, peak: Optional[float], devices: int = 1) -> Optional[float]:
    """Model FLOP utilisation in [0, 1] of ``flops`` done in ``seconds`` on ``devices`` devices of ``peak``
    TFLOP/s each; None when the peak is unknown."""
    if not peak or seconds <= 0:
        return None
    return flops / seconds / (peak * 1e12 * devices)
