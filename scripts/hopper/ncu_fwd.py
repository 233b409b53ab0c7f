"""Profile one forward launch each of the Hopper kernel and SDPA's cuDNN backend (bf16, d = 128,
B = 2, H = 16, N = 8192, non-causal) under Nsight Compute. Warm-up runs happen before
cudaProfilerStart, so with --profile-from-start off only the two measured launches are profiled:
    ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats ... python3 ncu_fwd.py
"""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from flashedu.hopper import triton_fwd as th  # noqa: E402

q, k, v = (torch.randn(2, 16, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))


def cudnn():
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


for _ in range(3):
    th.forward(q, k, v), cudnn()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
th.forward(q, k, v)
cudnn()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
