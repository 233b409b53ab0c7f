"""Compile the paged decoding kernels for sm_90 on a machine without a GPU, and report what ptxas
says of each (registers, spills) with the shared memory Triton allots: a check that the kernels
build for the H200 before a GPU run, and the numbers behind `kernels.paged`'s choice of warps.

Usage (repository root): python3 scripts/serving/compile_check.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # compile, do not interpret (set before triton is imported)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashedu.kernels import paged
from flashedu.kernels.paged_solution import page_rows

TARGET = GPUTarget("cuda", 90, 64)
INTS = ("stride_qb", "stride_qh", "stride_qm", "stride_kn", "stride_kh", "stride_vn", "stride_vh",
        "stride_tb", "B", "H", "H_kv", "GROUP", "N_q", "SPLIT")  # fmt: skip


def split(dtype, d, block_n, warps, stages=2, page_size=64, causal=False):
    sig = {n: f"*{dtype}" for n in ("Q", "K", "V")}
    sig.update(TABLE="*i32", LENS="*i32", M_PART="*fp32", L_PART="*fp32", O_PART="*fp32")
    sig.update({n: "i32" for n in INTS}, qk_scale="fp32")
    const = dict(CAUSAL=causal, HEAD_DIM=d, V_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
                 BLOCK_DV=max(16, triton.next_power_of_2(d)), UPCAST=False,
                 PRECISION="ieee" if dtype == "fp32" else "tf32", PAGE_SIZE=page_size,
                 PAGE_ROWS=page_rows, BLOCK_M=16, BLOCK_N=block_n)  # fmt: skip
    sig.update({k: "constexpr" for k in const})
    src = ASTSource(paged.paged_split_kernel, sig, constexprs=const)
    return triton.compile(src, target=TARGET, options=dict(num_warps=warps, num_stages=stages))


def combine(dtype, d, block_s, sinks):
    sig = dict(M_PART="*fp32", L_PART="*fp32", O_PART="*fp32", SINKS="*fp32", O=f"*{dtype}",
               LSE="*fp32", NUM_SPLITS="i32", ROWS="i32", H="i32", N_q="i32")  # fmt: skip
    const = dict(V_DIM=d, BLOCK_DV=max(16, triton.next_power_of_2(d)), BLOCK_S=block_s,
                 HAS_SINKS=sinks)  # fmt: skip
    sig.update({k: "constexpr" for k in const})
    src = ASTSource(paged.combine_kernel, sig, constexprs=const)
    return triton.compile(src, target=TARGET, options=dict(num_warps=4, num_stages=1))


def ptxas(kernel) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        rep = subprocess.run([tool, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True).stderr  # fmt: skip
    regs = re.search(r"Used (\d+) registers", rep)
    spill = re.search(r"(\d+) bytes spill stores", rep)
    return (f"{regs.group(1) if regs else '?'} registers, {spill.group(1) if spill else '?'} B "
            f"spilled, {kernel.metadata.shared} B shared")  # fmt: skip


def main() -> int:
    failed = 0
    jobs = [
        (f"split {dt} d={d} BLOCK_N={bn} warps={w}", split, (dt, d, bn, w))
        for dt in ("fp16", "bf16")
        for d in (64, 128)
        for bn in (32, 64)
        for w in (4, 8)
    ]
    jobs += [
        ("split fp32 d=40", split, ("fp32", 40, 16, 4)),
        ("split fp16 d=256 page 256", split, ("fp16", 256, 64, 8, 2, 256, True)),
    ]
    jobs += [(f"combine {dt} S={s} sinks={k}", combine, (dt, 128, s, k))
             for dt in ("fp16", "bf16") for s in (2, 128) for k in (False, True)]  # fmt: skip
    for label, build, args in jobs:
        try:
            print(f"{label:40s} {ptxas(build(*args))}", flush=True)
        except Exception as e:  # a kernel that does not build for sm_90 is the finding
            failed += 1
            print(f"{label:40s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
