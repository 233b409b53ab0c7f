"""One backward each, for Nsight Compute: the Gluon dK/dV and dQ kernels and SDPA's cuDNN backward,
bf16, B = 2, H = 16, N = 8192, d = 128, non-causal.

Usage: ncu --clock-control none --kernel-name regex:'_gluon_bwd|bprop|dgrad' --launch-skip 0
    --launch-count 4 --section SpeedOfLight --section Occupancy --section WarpStateStats
    --section ComputeWorkloadAnalysis --section LaunchStats python3 scripts/hopper/ncu_backward.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from flashedu.hopper import gluon_fwd as gh  # noqa: E402
from flashedu.hopper import gluon_bwd as gb  # noqa: E402

B, H, N, d = 2, 16, 8192, 128
q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
o, lse = gh.forward(q, k, v)
gb.backward(do, q, k, v, o, lse)
qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs)
torch.autograd.grad(out, (qs, ks, vs), do)
torch.cuda.synchronize()
print("done")
