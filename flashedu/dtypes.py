"""Dtype names and the accumulation dtype: one rule for every implementation, NumPy or torch.

Storage follows the input (fp16, bf16, fp32, fp64); sums and products accumulate in float32, or in
float64 for float64 input, as a GPU kernel's fp32 registers would (FlashAttention keeps its running
statistics and its output accumulator in fp32 whatever the input dtype).

Introduced in notebooks/01_naive_attention.ipynb.
"""

from __future__ import annotations

import numpy as np


def is_torch_dtype(dtype) -> bool:
    return str(dtype).startswith("torch.")


def dtype_name(dtype) -> str:
    """'float32' for np.float32, np.dtype('float32'), torch.float32 or the string itself."""
    s = str(dtype)
    if s.startswith("torch."):
        return s.split(".")[-1]
    return s if s == "bfloat16" else np.dtype(dtype).name


def acc_dtype(dtype):
    """The accumulation dtype for inputs of `dtype`: float64 for float64, else float32.

    A NumPy dtype (or anything `np.dtype` accepts) gives a `np.dtype`; a torch dtype gives a torch
    dtype, so NumPy and torch implementations share the rule.
    """
    if is_torch_dtype(dtype):
        import torch

        return torch.float64 if dtype == torch.float64 else torch.float32
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)
