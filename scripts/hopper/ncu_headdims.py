"""One forward + backward at d = 192 for Nsight Compute: `impl="auto"` (the FA2 kernels with the
head dim in two chunks, dK and dV in two launches) and SDPA's cuDNN backend, bf16, B = 4, H = 16,
N = 4096, non-causal (the shape of notebooks/results/h200_headdims.json).

Usage: ncu --clock-control none
    --kernel-name regex:'_attn_fwd|attn_bwd_dkdv|attn_bwd_dq|fprop|bprop' --launch-count 8
    --section SpeedOfLight --section Occupancy --section WarpStateStats
    --section ComputeWorkloadAnalysis --section LaunchStats python3 scripts/hopper/ncu_headdims.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashedu

B, H, N, d = 4, 16, 4096, 192
q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
for backend in (None, SDPBackend.CUDNN_ATTENTION):
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    if backend is None:
        out = flashedu.attention(qs, ks, vs)
    else:
        with sdpa_kernel([backend]):
            out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs)
    torch.autograd.grad(out, (qs, ks, vs), do)
torch.cuda.synchronize()
print("done")
