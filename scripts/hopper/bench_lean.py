"""One short GPU call: time the Hopper kernel (module defaults), FP8, FA2 (fixed configs), SDPA FLASH and
cuDNN; check the correctness matrix; FP8 accuracy. Saves JSON after each phase; stops starting new work
after --budget seconds. Usage: python3 bench_lean.py --out OUT.json [--budget 95]"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback

import torch
import triton

import bench_hopper as bh
from bench_hopper import BF16, DT_NAME, FP16, bench, flops, rand, th

FA2_CFG = {128: dict(block_m=128, block_n=64, num_warps=8, num_stages=3),  # FA2's tuned winners
           64: dict(block_m=128, block_n=64, num_warps=4, num_stages=3)}
STEP_VARIANTS = {"tma_bn64_s3": (128, 64, 8, 3, False)}
CASES = [(1, 8, 2, 777, 1301, True), (1, 4, 1, 1300, 500, True), (2, 4, 2, 1000, 1000, False),
         (1, 4, 4, 2048, 2048, True)]


def time_setting(dtype, d, causal, fa2, rows, variants):
    from torch.nn.attention import SDPBackend

    (B, H, N), (q, k, v) = bh.setting_inputs(dtype, d)
    entry = dict(dtype=DT_NAME[dtype], causal=causal, B=B, H=H, N=N, d=d)

    def add(kernel, ms, **extra):
        tf = flops(B, H, N, d, causal, "fwd") / ms * 1e-9
        rows.append(dict(kernel=kernel, **entry, **{"pass": "fwd"}, ms=ms, tflops=tf, **extra))
        print(f"{kernel:10s} {entry['dtype']} d={d} causal={causal} {ms:.3f} ms {tf:6.1f}", flush=True)

    add("hopper", bench(lambda: th.forward(q, k, v, causal=causal)),
        config=list(th.config_for(d, causal)))
    if dtype == BF16:
        x8 = th.quantize_fp8(q, k, v)
        rows.append(dict(kernel="hopper_fp8", **{**entry, "dtype": "fp8e4m3"}, **{"pass": "fwd"},
                         ms=bench(lambda: th.forward_fp8(x8, causal=causal)),
                         config=list(th.config_for(d, causal, fp8=True))))
        rows[-1]["tflops"] = flops(B, H, N, d, causal, "fwd") / rows[-1]["ms"] * 1e-9
        print(f"hopper_fp8 d={d} causal={causal} {rows[-1]['tflops']:.1f}", flush=True)
        variants[f"quantize_fp8_ms_d{d}"] = bench(lambda: th.quantize_fp8(q, k, v))
        variants[f"quantize_fp8_rotate_ms_d{d}"] = bench(lambda: th.quantize_fp8(q, k, v, rotate=True))
    if fa2 is not None:
        add("fa2", bench(lambda: fa2.forward(q, k, v, causal=causal, **FA2_CFG[d])),
            config=FA2_CFG[d])
    for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                     ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        add(name, bench(bh.sdpa_fn(be, q, k, v, causal, False)))
    if dtype == BF16 and d == 128:
        for name, cfg in STEP_VARIANTS.items():
            ms = bench(lambda: th.forward(q, k, v, causal=causal, config=cfg))
            variants[f"{name}_causal{causal}"] = flops(B, H, N, d, causal, "fwd") / ms * 1e-9
            print("variant", name, causal, variants[f"{name}_causal{causal}"], flush=True)


def correctness():
    out = []
    for key in ("bf16", "fp16", "fp8"):
        dtype = FP16 if key == "fp16" else BF16
        for d in (128, 64):
            for case in CASES:
                out.append(bh.check_case(case, d, dtype, None, fp8=key == "fp8", rotate=case[-1]))
                if not out[-1]["passed"]:
                    print("FAILED", out[-1], flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=95)
    args = ap.parse_args()
    t0 = time.time()
    fa2, _ = bh.fa2_module()
    res = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               gpu=torch.cuda.get_device_name(),
               sms=torch.cuda.get_device_properties(0).multi_processor_count,
               torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
               cudnn=torch.backends.cudnn.version(), python=platform.python_version(),
               command=" ".join(["python3"] + sys.argv), rows=[], variants={}, skipped=[])
    phases = [("matmul_tflops", lambda: {"bf16": 2 * 8192**3 * 1e-9 / bench(
        lambda a=rand((8192, 8192), BF16), b=rand((8192, 8192), BF16): a @ b), "fp8": None})]
    for dtype, d in ((BF16, 128), (BF16, 64)):
        for causal in (False, True):
            phases.append((f"time_{DT_NAME[dtype]}_{d}_{causal}", lambda dtype=dtype, d=d, c=causal:
                           time_setting(dtype, d, c, fa2, res["rows"], res["variants"])))
    for d in (128, 64):
        for causal in (False, True):
            phases.append((f"time_fp16_{d}_{causal}", lambda d=d, c=causal:
                           time_setting(FP16, d, c, fa2, res["rows"], res["variants"])))
    phases.append(("fp8", bh.fp8_accuracy))
    phases.append(("correctness_rows", correctness))
    for key, fn in phases:
        if time.time() - t0 > args.budget:
            res["skipped"].append(key)
            continue
        try:
            val = fn()
            if val is not None:
                res[key] = val
        except Exception:
            res[key + "_error"] = traceback.format_exc()[-1500:]
            print(res[key + "_error"], flush=True)
        print(f"-- {key} {time.time() - t0:.0f} s", flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    if "correctness_rows" in res:
        c = res["correctness_rows"]
        print(f"correctness {sum(r['passed'] for r in c)}/{len(c)}")
    print(json.dumps(res.get("fp8")), "skipped", res["skipped"], flush=True)


if __name__ == "__main__":
    main()
