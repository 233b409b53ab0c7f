"""GPU correctness rows for what the kernels do beyond their tuned path: head dims that are not
powers of two (d = 40, 59, 80, 96, 111, 192, padded tiles), a value head dim of its own (Ev != E),
a score mod (soft-capping through `flashedu.kernels.score_mods`) and packed sequences in one launch
(`flashedu.kernels.varlen`). They are part of `python -m flashedu.bench.gpu_check`'s matrix, and run
alone, in a few minutes, with

    PYTHONPATH=$PWD python -m flashedu.bench.gpu_check --features --out FILE.json

Each row compares the kernels' o and lse (forward) and dq, dk, dv (backward) with a float64
computation on the GPU (`oracles.float64_attention`), and applies flash-attn's rule against a
same-precision computation on the same inputs: `oracles.lowp_attention`, PyTorch ops in the
inputs' dtype with autograd (flash-attn's `attention_ref(upcast=False)`). SDPA is not used here:
it has no score mod and no packed layout, and for head dims that are not multiples of 8 it falls
back to its MATH backend, which computes in fp32. A row passes when every element is within
flashedu.testing's tolerance, lse within 1e-3, and (fp16/bf16) the max error at most twice the
same-precision one plus 1e-6; fp32 rows are held to the tolerance only.

Introduced in notebooks/08_benchmarks.ipynb.
"""

from __future__ import annotations

import os

import torch

from .oracles import err as _err
from .oracles import float64_attention, lowp_attention, within

DIMS = (40, 59, 80, 96, 111, 192)  # head dims real models use that are not powers of two
VALUE_DIMS = ((128, 64), (64, 128), (192, 128), (96, 40))  # (d, d_v)
SOFTCAP = 2.0  # scores are scaled up 3x in the soft-capping rows so the cap bends them
LENS = ([1, 17, 1024, 3, 700], [1, 40, 1024, 90, 1500])  # packed (query, key) lengths


def feature_cases(quick: bool = False) -> list[dict]:
    """The rows as dicts: kind "dense" (with d_v and mod) or "varlen" (with lens_q, lens_k). Every
    head dim of DIMS in fp16, causal and not, and causal in bf16; each (d, d_v) of VALUE_DIMS;
    soft-capping; packed batches; a few fp32 rows. `quick`: fp16 causal rows only, one of each
    other kind."""
    base = dict(
        kind="dense", B=2, H=4, H_kv=2, N_q=300, N_k=433, mod=None, window=None, alibi=False
    )
    fp16 = [("float16", True)] if quick else [("float16", False), ("float16", True)]
    bf16 = [] if quick else [("bfloat16", True)]
    cases = [dict(base, dtype=t, d=d, d_v=d, causal=c) for t, c in fp16 + bf16 for d in DIMS]
    for d, d_v in VALUE_DIMS[:1] if quick else VALUE_DIMS:
        cases += [dict(base, dtype=t, d=d, d_v=d_v, causal=c) for t, c in fp16]
    cases += [
        dict(base, dtype=t, d=128, d_v=128, causal=True, mod="softcap") for t, _ in fp16[-1:] + bf16
    ]
    for dtype, causal in fp16 + bf16:
        lens_q, lens_k = LENS if causal else (LENS[0], LENS[0])
        cases.append(dict(kind="varlen", dtype=dtype, d=128, d_v=128, causal=causal, B=len(lens_q),
                          H=8, H_kv=2, N_q=sum(lens_q), N_k=sum(lens_k), lens_q=lens_q,
                          lens_k=lens_k, mod=None, window=None, alibi=False))  # fmt: skip
    for d, d_v in ((96, 96),) if quick else ((40, 40), (96, 96), (64, 128)):
        cases.append(dict(base, dtype="float32", d=d, d_v=d_v, causal=True))
    return cases


def _softcap(s):
    return SOFTCAP * torch.tanh(s / SOFTCAP)


def _inputs(B, H, H_kv, N_q, N_k, d, d_v, dtype, seed, scale=1.0):
    """Fresh standard-normal q, k, v (d_v wide) and do, on the GPU (CPU under the interpreter)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device).manual_seed(seed)
    return tuple(
        (torch.randn(s, device=device, generator=g) * scale).to(getattr(torch, dtype))
        for s in ((B, H, N_q, d), (B, H_kv, N_k, d), (B, H_kv, N_k, d_v), (B, H, N_q, d_v))
    )


def _rows(case, seed, o, lse, grads, ref, low, extra):
    """The fwd and bwd rows, in gpu_check's format, from the kernels' outputs, float64 (o, lse,
    dq, dk, dv) and the same-precision (o, dq, dk, dv)."""

    dtype = case["dtype"]
    rule = lambda e, e_low: dtype == "float32" or e <= 2 * e_low + 1e-6
    row = {
        "impl": "flashedu-triton",
        **{key: case[key] for key in ("dtype", "d", "d_v", "causal", "H", "H_kv")},
        **{key: case[key] for key in ("B", "N_q", "N_k")},
        "extra": extra,
        "seed": seed,
        "sdpa_backend": f"torch ops in {dtype}",
    }
    fwd = {**row, "pass": "fwd", "err": _err(o, ref[0]), "sdpa_err": _err(low[0], ref[0]),
           "lse_err": _err(lse, ref[1]),
           "within_tolerance": within(o, ref[0], dtype, False)}  # fmt: skip
    fwd["ok"] = rule(fwd["err"], fwd["sdpa_err"]) and fwd["within_tolerance"]
    fwd["ok"] = fwd["ok"] and fwd["lse_err"] <= 1e-3
    trip = list(zip(("dq", "dk", "dv"), grads, ref[2:], low[1:]))
    worst = max(trip, key=lambda t: _err(t[1], t[2]) / (2 * _err(t[3], t[2]) + 1e-6))
    bwd = {**row, "pass": "bwd", "err": _err(worst[1], worst[2]),
           "sdpa_err": _err(worst[3], worst[2]), "worst": worst[0],
           "within_tolerance": all(within(g, r, dtype, True) for _, g, r, _ in trip)}  # fmt: skip
    bwd["ok"] = rule(bwd["err"], bwd["sdpa_err"]) and bwd["within_tolerance"]
    return [fwd, bwd]


def _seed(case: dict) -> int:
    """The case's "seed" if it names one (a unit test), else fresh inputs for every run."""
    seed = case.get("seed")
    return int.from_bytes(os.urandom(4), "little") if seed is None else seed


def check_dense(case: dict) -> list[dict]:
    """One (B, H, N, d) row pair: a head dim, a value head dim and maybe the soft-capping mod."""
    from .. import kernels
    from ..kernels import score_mods

    seed = _seed(case)
    keys = ("B", "H", "H_kv", "N_q", "N_k", "d", "d_v", "dtype")
    boost = 3.0 if case["mod"] else 1.0  # soft-capping needs scores past the cap
    q, k, v, do = _inputs(*(case[x] for x in keys), seed, scale=boost)
    scale = case["d"] ** -0.5
    mod = score_mods.softcap(SOFTCAP) if case["mod"] else None
    o, lse = kernels.forward(q, k, v, causal=case["causal"], score_mod=mod)
    grads = kernels.backward(do, q, k, v, o, lse, causal=case["causal"], score_mod=mod)
    opts = dict(causal=case["causal"], window=None, scale=scale)
    ref = float64_attention(q, k, v, do, slopes=None, mod=_softcap if mod else None, **opts)
    low = lowp_attention(q, k, v, do, mod=_softcap if mod else None, **opts)
    extra = " ".join(x for x in (f"gqa {case['H']}/{case['H_kv']}",
                                 f"Ev {case['d_v']}" if case["d_v"] != case["d"] else "",
                                 f"softcap {SOFTCAP}" if mod else "") if x)  # fmt: skip
    return _rows(case, seed, o, lse, grads, ref, low, extra)


def _packed(x, lens):
    """(1, H, total, d) -> one (1, H, len, d) view per sequence."""
    return list(torch.split(x, lens, dim=2))


def check_varlen(case: dict) -> list[dict]:
    """One packed batch through `flashedu.kernels.varlen` against float64 and the same-precision
    computation run sequence by sequence (bottom-right causal within each)."""
    from ..kernels import varlen as kernel_varlen

    seed = _seed(case)
    lens_q, lens_k, H, H_kv, d = case["lens_q"], case["lens_k"], case["H"], case["H_kv"], case["d"]
    q4, k4, v4, do4 = _inputs(1, H, H_kv, sum(lens_q), sum(lens_k), d, d, case["dtype"], seed)
    packed = [x[0].transpose(0, 1).contiguous() for x in (q4, k4, v4, do4)]  # (total, heads, d)
    dev = packed[0].device
    cu_q, cu_k = (torch.tensor([0, *lens], device=dev).cumsum(0).int() for lens in (lens_q, lens_k))
    args = (*packed[:3], cu_q, cu_k, max(lens_q), max(lens_k))
    o, lse = kernel_varlen.forward(*args, causal=case["causal"])
    grads = kernel_varlen.backward(packed[3], *packed[:3], o, lse, *args[3:], causal=case["causal"])
    opts = dict(causal=case["causal"], window=None, scale=d**-0.5)
    per_seq = zip(*(_packed(x, lens) for x, lens in ((q4, lens_q), (k4, lens_k), (v4, lens_k),
                                                      (do4, lens_q))))  # fmt: skip
    refs, lows = [], []
    for q_s, k_s, v_s, do_s in per_seq:
        refs.append(float64_attention(q_s, k_s, v_s, do_s, slopes=None, **opts))
        lows.append(lowp_attention(q_s, k_s, v_s, do_s, mod=None, **opts))

    def cat(parts, i):  # sequence outputs i (1, H, len, d) -> packed (total, H, d)
        return torch.cat([p[i] for p in parts], dim=2)[0].transpose(0, 1)

    ref = [cat(refs, 0), torch.cat([r[1] for r in refs], dim=2)[0]]
    ref += [cat(refs, i) for i in (2, 3, 4)]
    low = [cat(lows, i) for i in range(4)]
    extra = f"varlen {len(lens_q)} seqs, gqa {H}/{H_kv}"
    return _rows(case, seed, o, lse, grads, ref, low, extra)


def check(case: dict) -> list[dict]:
    return (check_varlen if case["kind"] == "varlen" else check_dense)(case)
