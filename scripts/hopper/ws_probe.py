"""Does the warp-specialised config run (no hang) and agree with the plain one? Prints TFLOP/s.
Usage: timeout 25 python3 ws_probe.py OUT.json"""
import json
import sys
import time

import torch

from bench_hopper import BF16, WS128, bench, flops, rand, th

out = {}
for causal in (False, True):
    q, k, v = (rand((2, 16, 8192, 128), BF16) for _ in range(3))
    t = time.time()
    o_ws, lse_ws = th.forward(q, k, v, causal=causal, config=WS128)
    torch.cuda.synchronize()
    o, lse = th.forward(q, k, v, causal=causal)
    diff = (o_ws.float() - o.float()).abs().max().item()
    ms = bench(lambda: th.forward(q, k, v, causal=causal, config=WS128))
    out[f"ws_causal{causal}"] = dict(max_diff_vs_plain=diff, ms=ms,
                                     tflops=flops(2, 16, 8192, 128, causal, "fwd") / ms * 1e-9,
                                     first_call_s=time.time() - t)
    print(out, flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
