"""Compile the FA2 Triton kernels (flashedu.kernels: forward, dK/dV, dQ) for sm_90a on a machine
without a GPU and print ptxas's resource report for each launch config: registers, spill bytes,
shared memory, and the count of wgmma instructions in the PTX.

Usage: python scripts/hopper/compile_fa2.py [--d 192 256] [--kernels fwd dkdv dq] [--causal]
           [--dtype bf16] [--configs "128,64,8,2" ...] [--split] [--tables] [--parts 1 2]
           [--out FILE.json]
Without --configs every entry of the kernel's candidate list (CANDIDATES below) is compiled;
--tables compiles every entry of the kernels' tables at d's tile width instead, causal and not
(with --split: the two-chunk width, `tiles.chunk_dims`; with --parts 1 2: the dK/dV kernel as two
launches, dV alone and dK alone, over `bwd.dkdv_parts_table`).
The specialisation matches a real launch at B = 4, H = 16, N = 4096: every pointer and every stride
16-aligned, the lengths not specialised (the kernels' do_not_specialize).
A config is usable when ptxas reports no spill and its shared memory fits the 227 KB an sm_90
block may have.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashedu.kernels import bwd, fwd, score_mods, tiles

SMEM_LIMIT = 227 * 1024
KERNELS = {"fwd": fwd._attn_fwd, "dkdv": bwd.attn_bwd_dkdv, "dq": bwd.attn_bwd_dq}
POINTERS = {"Q", "K", "V", "O", "LSE", "MOD_ARGS", "CU_Q", "CU_K", "DO", "DELTA", "DK", "DV", "DQ"}
FP32_POINTERS = {"LSE", "MOD_ARGS", "DELTA"}
INT32_POINTERS = {"CU_Q", "CU_K"}
# (BLOCK_M, BLOCK_N, warps, stages) tried per kernel at tile widths above 128
CANDIDATES = {
    "fwd": [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2),
            (64, 64, 4, 3), (128, 128, 8, 2), (64, 32, 4, 3), (128, 64, 4, 2)],
    "dkdv": [(32, 64, 8, 2), (32, 64, 4, 2), (32, 32, 4, 2), (32, 32, 4, 3), (64, 64, 8, 2),
             (64, 64, 8, 1), (64, 32, 4, 2), (16, 64, 4, 2), (32, 128, 8, 2), (64, 128, 8, 2)],
    "dq": [(128, 32, 8, 2), (128, 32, 8, 3), (128, 64, 8, 2), (64, 32, 4, 2), (64, 64, 4, 2),
           (64, 32, 4, 3), (128, 16, 8, 2)],
}  # fmt: skip


def flags(d, causal, dtype, split=False, parts=3):
    """The constexprs `launch.plan` would give a plain (no window, mod or packing) call."""
    chunks = tiles.chunk_dims(d) if split else (tiles.pad_dim(d), 0)
    return dict(
        HEAD_DIM=d, V_DIM=d, BLOCK_D=chunks[0], BLOCK_DV=chunks[0], BLOCK_D2=chunks[1],
        BLOCK_DV2=chunks[1], HAS_LEFT=False, HAS_RIGHT=causal, SCORE_MOD=score_mods.identity,
        HAS_MOD=False, VARLEN=False, UPCAST=False, PRECISION="tf32", SCORE_GRAD=score_mods.identity,
        HAS_GRAD=False, SCALE_POS=True, PARTS=parts,
    )  # fmt: skip


def code_hash(ptx: str) -> str:
    """A hash of the PTX's instructions, blind to source positions (.loc, .file and the debug
    sections change whenever the kernel's file is edited)."""
    body = ptx.split(".section\t.debug")[0].split(".section .debug")[0]
    keep = [ln for ln in body.splitlines() if not ln.strip().startswith((".loc", ".file", "$L__"))]
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()[:12]


def compile_one(kernel, d, causal, config, dtype="bf16", split=False, parts=3):
    fn = KERNELS[kernel]
    bm, bn, warps, stages = config
    const = {k: v for k, v in flags(d, causal, dtype, split, parts).items() if k in fn.arg_names}
    const.update(BLOCK_M=bm, BLOCK_N=bn)
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in POINTERS:
            el = "fp32" if name in FP32_POINTERS else "i32" if name in INT32_POINTERS else dtype
            sig[name] = f"*{el}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "sm_scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride") and i not in fn.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs=const, attrs=attrs)
    k = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages)
    )
    ptx = k.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", path[:-3] + "cubin"],
                           capture_output=True, text=True)  # fmt: skip
    text = r.stdout + r.stderr
    num = lambda pat: max([int(x) for x in re.findall(pat, text)] or [-1])
    row = dict(
        kernel=kernel, d=d, causal=causal, dtype=dtype, split=split, parts=parts,
        config=list(config),
        registers=num(r"Used (\d+) registers"), spill_stores=num(r"(\d+) bytes spill stores"),
        spill_loads=num(r"(\d+) bytes spill loads"), stack=num(r"(\d+) bytes stack frame"),
        smem=k.metadata.shared, wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
        mma_sync=len(re.findall(r"\bmma\.sync", ptx)),
    )  # fmt: skip
    row["ptx_sha"] = code_hash(ptx)
    row["usable"] = row["spill_stores"] == 0 and row["smem"] <= SMEM_LIMIT
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, nargs="+", default=[192, 256])
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--configs", nargs="*", default=None)
    ap.add_argument("--split", action="store_true", help="the split head dim (tiles.chunk_dims)")
    ap.add_argument("--tables", action="store_true", help="the tables' entries, causal and not")
    parts = "dK/dV kernel: 3 both, 1 dV alone, 2 dK alone (`bwd.dkdv_parts_table`)"
    ap.add_argument("--parts", type=int, nargs="+", default=[3], help=parts)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = []
    tables = {"fwd": fwd.fwd_table, "dkdv": bwd.dkdv_table, "dq": bwd.dq_table}
    if a.parts != [3]:
        tables["dkdv"] = bwd.dkdv_parts_table
    for d in a.d:
        width = sum(tiles.chunk_dims(d)) if a.split else tiles.pad_dim(d)
        for kernel in a.kernels:
            if a.tables:
                configs = tables[kernel](width, False)
            elif a.configs:
                configs = [tuple(map(int, c.split(","))) for c in a.configs]
            else:
                configs = CANDIDATES[kernel]
            masks = (False, True) if a.tables else (a.causal,)
            parts = a.parts if kernel == "dkdv" else [3]
            for cfg, causal, pt in [(cfg, c, p) for cfg in configs for c in masks for p in parts]:
                try:
                    row = compile_one(kernel, d, causal, cfg, a.dtype, a.split, pt)
                except Exception as e:  # a config that does not compile is a row too
                    err = f"{type(e).__name__}: {str(e)[:300]}"
                    row = dict(kernel=kernel, d=d, causal=causal, config=list(cfg), split=a.split,
                               parts=pt, error=err, usable=False)  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
