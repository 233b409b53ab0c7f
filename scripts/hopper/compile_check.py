"""Compile the Hopper kernel for sm_90a on a machine without a GPU; report registers, spills, shared
memory and the instructions that matter (wgmma, TMA copies, mbarriers). Usage: python compile_check.py"""
import os, re, sys, json, subprocess
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton_hopper as th

def compile_one(d, bm, bn, warps, stages, ws, causal, dtype="bf16", fp8=False):
    el = "fp8e4nv" if fp8 else dtype
    vshape = f"[1,1,{d},{bn}]" if fp8 else f"[1,1,{bn},{d}]"
    odt = "bf16" if fp8 else dtype
    sig = {"desc_q": f"tensordesc<{el}[1,1,{bm},{d}]>", "desc_k": f"tensordesc<{el}[1,1,{bn},{d}]>",
           "desc_v": f"tensordesc<{el}{vshape}>", "O": f"*{odt}",
           "LSE": "*fp32", "SQ": "*fp32", "SK": "*fp32", "SV": "*fp32", "qk_scale": "fp32",
           "H": "i32", "GROUP": "i32", "N_q": "i32", "N_k": "i32", "N_QB": "i32", "N_KB": "i32"}
    const = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, IS_FP8=fp8, SCALE_POS=True,
                 UPCAST=False)
    for k, v in const.items():
        sig[k] = "constexpr"
    src = ASTSource(th._hopper_fwd, sig, constexprs=const)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=warps, num_stages=stages))
    ptx = k.asm["ptx"]
    sass = k.asm.get("sass", "")
    open("/tmp/tc/k.ptx", "w").write(ptx)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    rep = subprocess.run([ptxas, "-arch=sm_90a", "-v", "/tmp/tc/k.ptx", "-o", "/tmp/tc/k.cubin"],
                         capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", rep)
    spill = re.search(r"(\d+) bytes spill stores", rep)
    return dict(regs=int(regs.group(1)) if regs else rep[-300:], spills=int(spill.group(1)) if spill else None,
                shared=k.metadata.shared,
                wgmma=len(re.findall(r"wgmma.mma_async", ptx)), tma=len(re.findall(r"cp.async.bulk.tensor", ptx)),
                ldshared=len(re.findall(r"ld.shared", ptx)), stshared=len(re.findall(r"st.shared", ptx)),
                stmatrix=len(re.findall(r"stmatrix", ptx)), setmaxnreg=len(re.findall("setmaxnreg", ptx)),
                local=len(re.findall(r"\.local", ptx)), ttgir=k.asm["ttgir"])

if __name__ == "__main__":
    cases = [tuple(json.loads(a)) for a in sys.argv[1:]] or [(128, 128, 128, 8, 2, False, False)]
    for c in cases:
        d, bm, bn, w, s, ws, causal = c[:7]
        fp8 = len(c) > 7 and c[7]
        try:
            r = compile_one(d, bm, bn, w, s, ws, causal, fp8=fp8)
            open(f"/tmp/tc/{'_'.join(map(str, c))}.ttgir", "w").write(r.pop("ttgir"))
            print(c, r, flush=True)
        except Exception as e:
            print(c, "FAILED", type(e).__name__, str(e)[:400], flush=True)
