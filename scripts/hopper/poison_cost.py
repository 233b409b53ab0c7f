"""What the non-finite rule costs a causal forward on the GPU: `flashedu.attention(impl="auto")`
timed as it runs and with `_nonfinite.poison_hidden_values` replaced by the identity, and the
rule's two kernels alone (`kernels.nonfinite`; causal, where a finite last row of o ends the
scan, and with a left window edge of 256 keys, where v is read in full), at the shapes of h200_headdims.json (B = 4,
H = 16, N = 4096, d = 96, FA2 kernels) and h200_backward.json's auto rows (B = 2, H = 16,
N = 8192, d = 128, the Hopper forward), bf16.

Usage (repository root, on a CUDA GPU): python3 scripts/hopper/poison_cost.py --out RESULT.json
"""

from __future__ import annotations

import argparse
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
from flashedu.hopper import dispatch
from flashedu.kernels import fwd, nonfinite

SHAPES = [(4, 16, 4096, 96), (2, 16, 8192, 128), (4, 16, 4096, 192)]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    res = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, python=platform.python_version(),
               command="python3 " + " ".join(sys.argv), rows=[])  # fmt: skip
    for B, H, N, d in SHAPES:
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        o = torch.zeros_like(q)  # finite, as a forward leaves it
        row = dict(B=B, H=H, N=N, d=d, causal=True)
        row["auto_ms"] = bench(lambda: flashedu.attention(q, k, v, causal=True))
        keep = (fwd.poison_hidden_values, dispatch.poison_hidden_values)
        fwd.poison_hidden_values = dispatch.poison_hidden_values = lambda o, *a: o
        try:
            row["auto_without_rule_ms"] = bench(lambda: flashedu.attention(q, k, v, causal=True))
        finally:
            fwd.poison_hidden_values, dispatch.poison_hidden_values = keep
        row["rule_kernels_ms"] = bench(lambda: nonfinite.poison_hidden_values(o, v, N, -1, 0))
        # a left window edge: the last row does not see every key, so v is scanned in full
        row["rule_kernels_window_ms"] = bench(
            lambda: nonfinite.poison_hidden_values(o, v, N, 256, 0)
        )
        row["v_bytes"] = v.numel() * v.element_size()
        row["rule_window_GBps"] = row["v_bytes"] / row["rule_kernels_window_ms"] * 1e-6
        print(row, flush=True)
        res["rows"].append(row)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
