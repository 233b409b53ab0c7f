"""Where impl="auto" loses time against the same kernels launched directly: forward + backward
through `flashedu.attention` and autograd (as the library runs now; and with the backward's lse
scan, a host sync, put back), against `kernels.fwd.forward` + `kernels.bwd.run_backward` with the
same plan and table configs, and the forward alone both ways. bf16, B = 4, H = 16, N = 4096 (the
shape of h200_headdims.json), causal and not.

Usage (repository root, on a CUDA GPU): python3 scripts/hopper/auto_overhead.py --out RESULT.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import triton
import triton.testing

import flashedu
from flashedu import autograd
from flashedu.kernels import bwd, fwd, launch

B, H, N = 4, 16, 4096


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dims", type=int, nargs="+", default=[96, 192])
    a = ap.parse_args(argv)
    res = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, python=platform.python_version(),
               command="python3 " + " ".join(sys.argv), B=B, H=H, N=N, rows=[])  # fmt: skip
    for d in a.dims:
        for causal in (False, True):
            q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16)
                           for _ in range(4))  # fmt: skip
            qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))

            def auto_fb():
                o = flashedu.attention(qs, ks, vs, causal=causal)
                return torch.autograd.grad(o, (qs, ks, vs), do)

            pl = launch.plan(q, k, v, causal, None, None, None, None, "auto_overhead")

            def direct_fb():
                o, lse = fwd.forward(q, k, v, causal=causal)
                return bwd.run_backward(do, q, k, v, o, lse, pl, None, None)

            row = dict(d=d, causal=causal)
            row["auto_fwd_ms"] = bench(lambda: flashedu.attention(q, k, v, causal=causal))
            row["direct_fwd_ms"] = bench(lambda: fwd.forward(q, k, v, causal=causal))
            row["auto_fwd_bwd_ms"] = bench(auto_fb)
            keep = autograd.lse_from_forward
            autograd.lse_from_forward = contextlib.nullcontext  # the lse scan (a host sync) back
            try:
                row["auto_fwd_bwd_with_lse_scan_ms"] = bench(auto_fb)
            finally:
                autograd.lse_from_forward = keep
            row["direct_fwd_bwd_ms"] = bench(direct_fb)
            print(row, flush=True)
            res["rows"].append(row)
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
