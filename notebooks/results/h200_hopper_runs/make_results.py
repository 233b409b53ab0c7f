"""Assemble notebooks/results/h200_hopper.json (the shared schema) from the device runs' own JSON.
Rows come from run D alone; steps cite the run each figure came from. Usage: python3 make_results.py OUT"""

import json
import os
import math
import sys

R = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")
B = json.load(open(R + "runB.json"))  # run B
C = json.load(open(R + "runC.json"))  # run C
D = json.load(open(R + "runD.json"))  # run D


def row(run, kernel, dtype, d, causal):
    for r in run["rows"]:
        if (r["kernel"], r["dtype"], r["d"], r["causal"]) == (kernel, dtype, d, causal):
            return round(r["tflops"], 1)
    raise KeyError((kernel, dtype, d, causal))


def var(d, causal, cfg):
    return round(C[str((d, causal, tuple(cfg) + (False,)))], 1)


NO_PRED = "no prediction was written before this run (a short sweep of tile shapes)"
steps = [
    dict(name="fa2", change="FA2 Triton kernel (flashedu.triton_attention), pointer loads, its tuned "
         "config 128x64, 8 warps, 3 stages", expected="about 490 fwd / 450 causal, as in "
         "h200_attention.json", fwd_tflops=row(D, "fa2", "bf16", 128, False), fwd_bwd_tflops=None,
         causal_fwd_tflops=row(D, "fa2", "bf16", 128, True),
         note=f"run D; run B gave {row(B, 'fa2', 'bf16', 128, False)} / "
              f"{row(B, 'fa2', 'bf16', 128, True)}"),
    dict(name="tma_128x128", change="tensor descriptors (TMA) for Q, K, V; 128x128 tiles, 8 warps, "
         "2 stages", expected="+5-10 % over fa2: the copy engine takes address arithmetic and loads "
         "off the warps", fwd_tflops=row(B, "hopper", "bf16", 128, False), fwd_bwd_tflops=None,
         causal_fwd_tflops=row(B, "hopper", "bf16", 128, True),
         note="run B: -5 % / -10 % against FA2 in the same run. Compile report: 189 registers, no "
              "spill, 164 KB shared memory at 2 stages, so a third stage does not fit"),
    dict(name="tma_128x64_s3", change="TMA, 128x64 tiles, 8 warps, 3 stages",
         expected="within 5 % of tma_128x128", fwd_tflops=row(D, "hopper", "bf16", 128, False),
         fwd_bwd_tflops=None, causal_fwd_tflops=row(D, "hopper", "bf16", 128, True),
         note=f"run D (the module's d = 128 config); run B gave {round(B['variants']['tma_bn64_s3_causalFalse'], 1)}"
              f" / {round(B['variants']['tma_bn64_s3_causalTrue'], 1)}, +4 % / +7 % over 128x128. "
              "138 registers, 132 KB at 3 stages. Equal to FA2's 490 non-causal, 4 % under it causal"),
    dict(name="tma_128x64_s4", change="TMA, 128x64 tiles, 8 warps, 4 stages", expected=NO_PRED,
         fwd_tflops=var(128, False, (128, 64, 8, 4)), fwd_bwd_tflops=None,
         causal_fwd_tflops=var(128, True, (128, 64, 8, 4)), note="run C: no gain over 3 stages"),
    dict(name="tma_128x64_w4", change="TMA, 128x64 tiles, 4 warps (one warpgroup), 3 stages",
         expected=NO_PRED, fwd_tflops=var(128, False, (128, 64, 4, 3)), fwd_bwd_tflops=None,
         causal_fwd_tflops=var(128, True, (128, 64, 4, 3)), note="run C: 4 % under 8 warps"),
    dict(name="warp_specialize", change="warp_specialize=True in tl.range: num_warps=4 becomes one "
         "producer and two consumer warpgroups with setmaxnreg; one loop with the mask on every "
         "block; O stored through pointers", expected="+10-20 % over tma_128x128 non-causal (loads "
         "leave the consumers' instruction stream), less causal", fwd_tflops=None,
         fwd_bwd_tflops=None, causal_fwd_tflops=None,
         note="compiled for sm_90a here (168 registers, 180 KB, setmaxnreg in the PTX) only as one loop "
              "per kernel (Triton 3.6's Hopper pass asserts on a second loop) with a pointer store for "
              "O (a descriptor store fails its data partition); with 8 warps the pass leaves the loop "
              "unspecialised. On the H200 the first call (N = 8192) did not finish within a 25 s "
              "timeout, and run A, whose compile pool included these configs, ran past 540 s with no "
              "output. Cause not established; the option was removed from the module"),
    dict(name="d64_128x128_w8", change="d = 64 (B=4, N=4096): 128x128 tiles, 8 warps, 3 stages",
         expected=NO_PRED, fwd_tflops=row(B, "hopper", "bf16", 64, False), fwd_bwd_tflops=None,
         causal_fwd_tflops=row(B, "hopper", "bf16", 64, True),
         note="run B: 0.85x / 0.91x FA2 (410.8 / 327.7)"),
    dict(name="d64_128x128_w4", change="d = 64: 128x128 tiles, 4 warps, 3 stages (non-causal); "
         "128x64, 4 warps, 3 stages (causal)", expected=NO_PRED,
         fwd_tflops=row(D, "hopper", "bf16", 64, False), fwd_bwd_tflops=None,
         causal_fwd_tflops=row(D, "hopper", "bf16", 64, True),
         note=f"run D (the module's d = 64 configs); run C: 128x128x4w {var(64, False, (128, 128, 4, 3))}"
              f" / {var(64, True, (128, 128, 4, 3))}, 128x64x4w {var(64, False, (128, 64, 4, 3))} / "
              f"{var(64, True, (128, 64, 4, 3))}, 128x64x8w {var(64, False, (128, 64, 8, 3))} / "
              f"{var(64, True, (128, 64, 8, 3))}. 1.06x / 1.08x FA2 in run D"),
    dict(name="fp8_128x128", change="FP8 e4m3 Q, K, V (block scales for Q and K, channel scales for "
         "V, V transposed), P in e4m3; 128x128 tiles, 8 warps, 2 stages",
         expected="the goal, >= 1.5x the bf16 forward; no separate prediction was written before the run",
         fwd_tflops=row(B, "hopper_fp8", "fp8e4m3", 128, False), fwd_bwd_tflops=None,
         causal_fwd_tflops=row(B, "hopper_fp8", "fp8e4m3", 128, True),
         note="run B: 1.35x / 1.31x the bf16 kernel with the same tile in the same run (465.6 / 420.9); "
              "the module's FP8 config for d = 128"),
    dict(name="fp8_128x64_s3", change="FP8 with 128x64 tiles, 8 warps, 3 stages", expected=NO_PRED,
         fwd_tflops=row(D, "hopper_fp8", "fp8e4m3", 128, False), fwd_bwd_tflops=None,
         causal_fwd_tflops=row(D, "hopper_fp8", "fp8e4m3", 128, True),
         note="run D: 1.07x / 1.18x the bf16 kernel with the same tile; slower than 128x128 in run B"),
]
d64_fp8 = dict(name="fp8_d64", change="FP8, d = 64: 128x128 tiles, 8 warps (run B) and 4 warps "
               "(run D), 3 stages", expected=NO_PRED,
               fwd_tflops=row(D, "hopper_fp8", "fp8e4m3", 64, False), fwd_bwd_tflops=None,
               causal_fwd_tflops=row(B, "hopper_fp8", "fp8e4m3", 64, True),
               note=f"non-causal from run D with 4 warps (1.23x the bf16 kernel, same tile); causal from "
                    f"run B with 8 warps (1.15x); run B non-causal with 8 warps: "
                    f"{row(B, 'hopper_fp8', 'fp8e4m3', 64, False)}. Run D's causal FP8 row failed: the "
                    "benchmark quantised with the non-causal block size (fixed since in forward_fp8)")
steps.append(d64_fp8)

mm = D["matmul_tflops"]["bf16"]
rows = []
for r in D["rows"]:
    if not math.isfinite(r["tflops"]):
        continue
    keep = {k: r[k] for k in ("kernel", "dtype", "causal", "B", "H", "N", "d", "pass")}
    keep.update(ms=round(r["ms"], 4), tflops=round(r["tflops"], 1),
                matmul_fraction=round(r["tflops"] / mm, 3))
    if r.get("config"):
        keep["config"] = r["config"]
    rows.append(keep)
corr = [dict(run="D", **c) for c in D["correctness_rows"]] + [
    dict(run="B", **c) for c in B["correctness_rows"]]
out = dict(
    date=D["date"], gpu=D["gpu"], sms=D["sms"], torch=D["torch"], triton=D["triton"], cuda=D["cuda"],
    cudnn=D["cudnn"], python=D["python"],
    command="cd .hopper && python3 bench_lean.py --out $OUT/h200_hopper_final.json --budget 45 "
            "(rows, fp8, correctness); steps also cite runs B and C (GPU_NOTES.md)",
    matmul_tflops={"bf16": round(mm, 1), "fp8": None},
    rows=rows,
    missing=["hopper_fp8 fp8e4m3 d=64 causal (benchmark quantised with the wrong block size)",
             "every fwd_bwd row: not measured (the Hopper module has no backward; flashedu's FA2 "
             "backward kernels serve it)"],
    steps=steps,
    fp8=[dict(inputs=f["inputs"], rotation=f["rotation"], rmse=f["rmse"], bf16_rmse=f["bf16_rmse"],
              shape=f["shape"]) for f in D["fp8"]],
    fp8_quantize_ms={k: round(v, 3) for k, v in D["variants"].items() if k.startswith("quantize")},
    correctness=dict(rows=len(corr), passed=sum(c["passed"] for c in corr),
                     details="correctness_rows below: run D (24 rows, the module's bf16/fp16 configs) "
                             "and run B (36 rows, the earlier 128x128 configs, incl. the FP8 ones "
                             "kept); GPU_NOTES.md, section 'Hopper kernel'"),
    correctness_rows=corr,
)
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(len(rows), "rows", out["correctness"], mm)
