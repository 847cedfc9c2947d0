"""Helpers that build tiny random transformers (PyTorch) checkpoints in a temp dir, for parity tests."""
from __future__ import annotations

import numpy as np


def save_tiny(hf_config, path, seed: int = 0):
    """Random-init a transformers CausalLM from ``hf_config``, save it (safetensors) to ``path``; return the torch
    model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config).float().eval()
    with torch.no_grad():  # larger-than-default init so that differences would show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def torch_logits(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long)
        )
    return out.logits.float().numpy()


def log_softmax(x) -> np.ndarray:
    """Float64 log-softmax over the last axis (the tests' NumPy reference)."""
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def torch_sequence_logits(model, seq) -> np.ndarray:
    """[T, V] float64 logits of one unpadded token sequence from a transformers (PyTorch) model."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor(np.asarray(seq, np.int64))[None])
    return out.logits[0].double().numpy()


def padded_batch(vocab: int, lengths, seed: int = 0):
    """Right-padded random batch: tokens [B, T], mask [B, T] (1 = real token)."""
    rng = np.random.default_rng(seed)
    t = max(lengths)
    tokens = np.zeros((len(lengths), t), np.int64)
    mask = np.zeros((len(lengths), t), np.int64)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(0, vocab, n)
        mask[i, :n] = 1
    return tokens, mask
