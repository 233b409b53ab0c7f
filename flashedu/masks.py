"""Which keys each query may see, and ALiBi biases, as explicit arrays.

These are the *definitions*; the tiled and Triton implementations never build them (they test block
corners instead), and the tests compare those implementations with `reference.forward` fed these
arrays.

Alignment is bottom-right (flash-attn's convention): query row i sits at key position i + N_k - N_q,
so the last query lines up with the last key. With N_q == N_k that is the usual top-left causal
mask.

Introduced in notebooks/01_naive_attention.ipynb; windows and ALiBi in notebooks/09_beyond.ipynb.
"""

from __future__ import annotations

import numpy as np


def visible(
    N_q: int, N_k: int, *, causal: bool = False, window_size: tuple[int, int] | None = None
) -> np.ndarray:
    """(N_q, N_k) bool: True where query i may attend to key j.

    causal: j <= i + N_k - N_q.
    window_size=(left, right): i + N_k - N_q - left <= j <= i + N_k - N_q + right; -1 leaves a side
    open. Both together intersect (causal is window_size=(-1, 0)).
    """
    diag = np.arange(N_q)[:, None] + (N_k - N_q)  # (N_q, 1): key position aligned with each query
    j = np.arange(N_k)[None, :]  # (1, N_k)
    keep = np.ones((N_q, N_k), dtype=bool)
    if causal:
        keep &= j <= diag
    if window_size is not None:
        left, right = window_size
        if left >= 0:
            keep &= j >= diag - left
        if right >= 0:
            keep &= j <= diag + right
    return keep


def alibi_bias(slopes, N_q: int, N_k: int) -> np.ndarray:
    """(H, N_q, N_k) float64 ALiBi bias -slope_h * |i + N_k - N_q - j| (Press et al. 2022), added to
    scaled scores."""
    slopes = np.asarray(slopes, dtype=np.float64).reshape(-1)
    dist = np.abs(np.arange(N_q)[:, None] + (N_k - N_q) - np.arange(N_k)[None, :])  # (N_q, N_k)
    return -slopes[:, None, None] * dist[None, :, :]


def alibi_slopes(H: int) -> np.ndarray:
    """The geometric slopes of the ALiBi paper: 2^(-8 h / H) for h = 1..H (H a power of two),
    float64."""
    return 2.0 ** (-8.0 * np.arange(1, H + 1) / H)
