"""Compile the Gluon backward kernels for sm_90a without a GPU and print ptxas's resource report.

Usage: TRITON_INTERPRET=0 python scripts/hopper/compile_gluon_bwd.py [kv|dq] D CAUSAL BM BN WARPS
       STAGES [atomic|separate] [overlap|serial] [reg|smem]
Prints one JSON line: registers, spill bytes, shared memory, counts of wgmma / waits / TMA copies
in the PTX, and whether ptxas serialised the wgmma pipeline.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from flashedu.hopper import gluon_fwd as gh  # noqa: E402
from flashedu.hopper import gluon_bwd as gb  # noqa: E402


def compile_kernel(
    which, d, causal, bm, bn, warps, stages, atomic=True, overlap=True, smem_p=False, dtype="bf16"
):
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16

    def desc(r):
        return f"tensordesc<{dtype}[1, {r}, {d}],{gh.shared_layout(r, d, tdt)!r}>"

    if which == "kv":
        fn = gb._gluon_bwd_kv
        sig = dict(
            desc_q=desc(bm),
            desc_k=desc(bn),
            desc_v=desc(bn),
            desc_do=desc(bm),
            LSE="*fp32",
            DELTA="*fp32",
            DQ="*fp32",
            DK=f"*{dtype}",
            DV=f"*{dtype}",
            qk_scale="fp32",
            dq_scale="fp32",
            dk_scale="fp32",
            H="i32",
            GROUP="i32",
            N_q="i32",
            N_k="i32",
            CAUSAL="constexpr",
            ATOMIC_DQ="constexpr",
            OVERLAP="constexpr",
            SMEM_P="constexpr",
            NUM_STAGES="constexpr",
        )
        const = dict(
            CAUSAL=causal, ATOMIC_DQ=atomic, OVERLAP=overlap, SMEM_P=smem_p, NUM_STAGES=stages
        )
    else:
        fn = gb._gluon_bwd_dq
        sig = dict(
            desc_q=desc(bm),
            desc_k=desc(bn),
            desc_v=desc(bn),
            desc_do=desc(bm),
            LSE="*fp32",
            DELTA="*fp32",
            DQ=f"*{dtype}",
            qk_scale="fp32",
            dq_scale="fp32",
            H="i32",
            GROUP="i32",
            N_q="i32",
            N_k="i32",
            CAUSAL="constexpr",
            OVERLAP="constexpr",
            NUM_STAGES="constexpr",
        )
        const = dict(CAUSAL=causal, OVERLAP=overlap, NUM_STAGES=stages)
    src = GluonASTSource(
        fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()}
    )
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=warps))
    ptx = kernel.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    text = ""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        open(path, "w").write(ptx)
        r = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", path, "-o", path[:-3] + "cubin"],
            capture_output=True,
            text=True,
        )
        text = r.stdout + r.stderr
    num = lambda pat: [int(x) for x in re.findall(pat, text)]  # noqa: E731
    return dict(
        kernel=which,
        d=d,
        causal=causal,
        config=[bm, bn, warps, stages],
        atomic=atomic,
        overlap=overlap,
        smem_p=smem_p,
        registers=num(r"Used (\d+) registers"),
        spill_stores=num(r"(\d+) bytes spill stores"),
        spill_loads=num(r"(\d+) bytes spill loads"),
        smem=kernel.metadata.shared,
        wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
        wait1=len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)),
        tma=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        atomics=len(re.findall(r"\bred\.|atom\.", ptx)),
        serialized="serialized" in text or "C7515" in text or "C7510" in text,
        ptxas_tail=text[-600:],
    )


if __name__ == "__main__":
    a = sys.argv[1:]
    res = compile_kernel(
        a[0],
        int(a[1]),
        a[2] == "causal",
        *map(int, a[3:7]),
        atomic=(a[7] if len(a) > 7 else "atomic") == "atomic",
        overlap=(a[8] if len(a) > 8 else "overlap") == "overlap",
        smem_p=(a[9] if len(a) > 9 else "reg") == "smem",
    )
    print(json.dumps(res))
