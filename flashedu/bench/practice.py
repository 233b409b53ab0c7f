"""FlexAttention against flashedu's own score mods and packed sequences, and SDPA where it applies.

    python -m flashedu.bench.practice --out notebooks/results/h200_practice.json

One run on a CUDA GPU, forward only, bf16: for each setting the same attention is computed by
compiled FlexAttention (`torch.compile(flex_attention)`), by flashedu's Triton forward with the
matching `score_mod` (or its one-launch packed-sequence path), and by SDPA when SDPA can express it
(ALiBi as a float mask, documents as a boolean mask; soft-capping it cannot). Before timing, every
output is compared with a float64 computation on the same inputs and must stay within twice the
smallest error among the implementations plus 1e-3 (the course's same-precision rule); a failing
implementation is reported and not timed. Times are medians of `triton.testing.do_bench`.

Introduced in notebooks/10_in_practice.ipynb.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from .._env import ROOT
from .results import meta, write

IMPLS = ("flex-compiled", "flashedu-triton", "sdpa")
RESULTS_FILE = ROOT / "notebooks" / "results" / "h200_practice.json"


def _inputs(B, H, N, d, gen, device):
    shape = (B, H, N, d)
    return [torch.randn(shape, generator=gen, device=device).to(torch.bfloat16) for _ in range(3)]


def _doc_ids(N, n_docs, device):
    """Document id of every token: n_docs documents of nearly equal length."""
    cuts = [round(i * N / n_docs) for i in range(n_docs + 1)]
    ids = torch.empty(N, dtype=torch.int32, device=device)
    for i in range(n_docs):
        ids[cuts[i] : cuts[i + 1]] = i
    return ids, torch.tensor(cuts, dtype=torch.int32, device=device)


def _reference(q, k, v, bias):
    """float64 softmax(q k^T / sqrt(d) + bias) v; bias is (H, N, N) or (N, N) with -inf masked."""
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v.double()


def _settings(B, H, N, d, device):
    """name -> float64 reference, FlexAttention (score_mod, block_mask), flashedu and SDPA calls."""
    from torch.nn.attention.flex_attention import create_block_mask

    from .. import kernels
    from ..kernels import score_mods
    from ..kernels import varlen as kernel_varlen

    i = torch.arange(N, device=device)
    causal = i[None, :] <= i[:, None]
    neg = torch.tensor(float("-inf"), device=device, dtype=torch.float64)
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=device)
    dist = (i[:, None] - i[None, :]).abs().double()
    alibi = torch.where(causal, -slopes.double()[:, None, None] * dist, neg)  # (H, N, N)
    ids, cuts = _doc_ids(N, 8, device)
    same = ids[:, None] == ids[None, :]
    cap = 30.0

    def causal_mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def doc_mask(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    def alibi_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    def softcap_mod(score, b, h, q_idx, kv_idx):
        # cap = 30 as literals: a float taken from the enclosing scope reaches torch.compile as a
        # CPU scalar tensor, which inductor (torch 2.11) failed to lower on the H200
        return 30.0 * torch.tanh(score * (1.0 / 30.0))

    def everything(b, h, q_idx, kv_idx):
        return q_idx >= 0

    def block(mask_mod):
        return create_block_mask(mask_mod, None, None, N, N, device=device)

    def packed(q, k, v):
        to_p = lambda x: x[0].transpose(0, 1).contiguous()
        args = (to_p(q), to_p(k), to_p(v), cuts, cuts, N, N)
        return lambda: kernel_varlen.forward(*args)[0]

    def softcapped(q, k, v):
        s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(d)
        return torch.softmax(cap * torch.tanh(s / cap), dim=-1) @ v.double()

    return {
        "plain causal": dict(
            ref=lambda q, k, v: _reference(q, k, v, torch.where(causal, 0.0, neg)),
            flex=(None, block(causal_mask)),
            flashedu=lambda q, k, v: lambda: kernels.forward(q, k, v, causal=True)[0],
            sdpa=lambda q, k, v: (
                lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            ),
        ),
        "alibi causal": dict(
            ref=lambda q, k, v: _reference(q, k, v, alibi),
            flex=(alibi_mod, block(causal_mask)),
            flashedu=lambda q, k, v: (
                lambda: kernels.forward(q, k, v, causal=True, score_mod=score_mods.alibi(slopes))[0]
            ),
            sdpa=lambda q, k, v: (
                lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=alibi.to(q.dtype)[None]
                )
            ),
        ),
        "softcap 30": dict(
            ref=softcapped,
            # a block mask built outside torch.compile: with none, torch 2.11 builds an empty one
            # inside the compiled call, which inductor failed to lower on the H200
            flex=(softcap_mod, block(everything)),
            flashedu=lambda q, k, v: (
                lambda: kernels.forward(q, k, v, score_mod=score_mods.softcap(cap))[0]
            ),
            sdpa=None,
        ),
        "documents": dict(
            ref=lambda q, k, v: _reference(q, k, v, torch.where(same, 0.0, neg)),
            flex=(None, block(doc_mask)),
            flashedu=lambda q, k, v: (lambda f: lambda: f().transpose(0, 1)[None])(packed(q, k, v)),
            sdpa=lambda q, k, v: (
                lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=same)
            ),
        ),
    }


def run(B: int = 1, H: int = 16, N: int = 4096, d: int = 64, seed: int = 0, log=print) -> dict:
    """Check, then time, every setting; returns rows of {setting, impl, ms, error, ok}."""
    import triton.testing
    from torch.nn.attention.flex_attention import flex_attention

    device = "cuda"
    gen = torch.Generator(device).manual_seed(seed)
    flex = torch.compile(flex_attention)
    rows = []
    for name, s in _settings(B, H, N, d, device).items():
        q, k, v = _inputs(B, H, N, d, gen, device)
        ref = s["ref"](q, k, v).to(torch.float64)
        score_mod, block_mask = s["flex"]
        calls = {
            "flex-compiled": lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask),
            "flashedu-triton": s["flashedu"](q, k, v),
        }
        if s["sdpa"] is not None:
            calls["sdpa"] = s["sdpa"](q, k, v)
        errors = {impl: (fn().double() - ref).abs().max().item() for impl, fn in calls.items()}
        bound = 2 * min(errors.values()) + 1e-3
        for impl, fn in calls.items():
            ok = errors[impl] <= bound
            ms = (
                triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                if ok
                else None
            )
            rows.append(dict(setting=name, impl=impl, ms=ms, error=errors[impl], ok=ok))
            log(
                f"{name:<14} {impl:<16} error {errors[impl]:.2e} "
                + (f"{ms:.3f} ms" if ok else "FAILED")
            )
    return dict(config=dict(B=B, H=H, N=N, d=d, dtype="bfloat16", passes="fwd"), rows=rows)


def load_record(path=RESULTS_FILE) -> dict:
    """A JSON record written by `python -m flashedu.bench.practice --out`."""
    with open(path) as f:
        return json.load(f)


def format_table(record: dict) -> str:
    """One line per setting: median ms of each implementation ("-" where it does not apply,
    "failed" where its output missed the float64 check), then the largest error of the row."""
    by = {(r["setting"], r["impl"]): r for r in record["rows"]}
    head = f"{'setting':<14}" + "".join(f"{impl:>17}" for impl in IMPLS) + f"{'max error':>11}"
    lines = [head, "-" * len(head)]
    for name in dict.fromkeys(r["setting"] for r in record["rows"]):
        cells, errors = "", []
        for impl in IMPLS:
            r = by.get((name, impl))
            cell = "-" if r is None else (f"{r['ms']:.3f} ms" if r["ok"] else "failed")
            cells += f"{cell:>17}"
            errors += [] if r is None else [r["error"]]
        lines.append(f"{name:<14}{cells}{max(errors):>11.1e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashedu.bench.practice", description=__doc__)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--N", type=int, default=4096)
    args = parser.parse_args(argv)
    if args.N < 16:
        parser.error(f"--N must be at least 16, got {args.N}")
    if not torch.cuda.is_available():
        print("python -m flashedu.bench.practice needs a CUDA GPU; none was found", file=sys.stderr)
        return 1
    result = run(N=args.N)
    command = "python -m flashedu.bench.practice " + " ".join(argv or sys.argv[1:])
    gpu = torch.cuda.get_device_name()
    write({**meta(command, 0, result["config"]), "gpu": gpu, **result}, args.out)
    return 0 if all(r["ok"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
