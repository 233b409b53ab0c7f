"""Which of PyTorch's SDPA backends runs for which inputs, tried one backend at a time.

`torch.nn.functional.scaled_dot_product_attention` dispatches to one of several kernels:
FLASH_ATTENTION (FlashAttention-2 on CUDA, a tiled C++ kernel on the CPU), EFFICIENT_ATTENTION
(xFormers' memory-efficient kernel), CUDNN_ATTENTION and MATH (the plain formula in ATen ops).
`torch.nn.attention.sdpa_kernel([...])` restricts the choice; when no allowed backend accepts the
inputs, SDPA raises a RuntimeError, and its warnings give each refusing backend's reason. This
module runs that experiment for a list of `Case`s:

    rows = sdpa_backends.run_table(sdpa_backends.default_cases(), device="cpu")
    print(sdpa_backends.format_table(rows))

and `python -m flashedu.sdpa_backends --out FILE` writes the table of the current device as JSON,
with the date, the device, the versions and the command. For each case it also records which
backend SDPA picks when nothing is restricted (from the ATen operator the profiler records) and,
on a GPU, the names of the kernels that ran.

Limits: a backend that runs for one shape may refuse another (alignment, sequence length, GPU
generation); each case uses one small shape (B=2, H=4, N=128), and the answer holds for the device
and the PyTorch version that ran it.

Introduced in notebooks/10_in_practice.ipynb.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

RESULTS_FILE = (
    Path(__file__).resolve().parent.parent / "notebooks" / "results" / "h200_sdpa_backends.json"
)
BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
DTYPES = ("float16", "bfloat16", "float32", "float64")
MASKS = ("none", "bool", "float")
# ATen operator of each backend, as the profiler names it (CPU and CUDA variants)
OPERATORS = {
    "_scaled_dot_product_flash_attention": "FLASH_ATTENTION",
    "_scaled_dot_product_flash_attention_for_cpu": "FLASH_ATTENTION",
    "_scaled_dot_product_efficient_attention": "EFFICIENT_ATTENTION",
    "_scaled_dot_product_cudnn_attention": "CUDNN_ATTENTION",
    "_scaled_dot_product_attention_math": "MATH",
    "_scaled_dot_product_fused_attention_overrideable": "OVERRIDEABLE",
}


@dataclass(frozen=True)
class Case:
    """One input setting: dtype, head dim, mask kind, causal, dropout, backward, K/V heads."""

    label: str
    dtype: str = "float16"
    head_dim: int = 64
    mask: str = "none"  # "none", "bool" (True = attend) or "float" (added to the scores)
    causal: bool = False
    dropout: float = 0.0
    backward: bool = False
    kv_heads: int = 4  # fewer than the 4 query heads: GQA through enable_gqa=True

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(
                f"Case {self.label!r}: dtype must be one of {DTYPES}, got {self.dtype!r}"
            )
        if self.mask not in MASKS:
            raise ValueError(f"Case {self.label!r}: mask must be one of {MASKS}, got {self.mask!r}")
        if not (isinstance(self.head_dim, int) and self.head_dim > 0):
            raise ValueError(
                f"Case {self.label!r}: head_dim must be a positive int, got {self.head_dim!r}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(
                f"Case {self.label!r}: dropout must be in [0, 1), got {self.dropout!r}"
            )
        if self.kv_heads not in (1, 2, 4):
            raise ValueError(
                f"Case {self.label!r}: kv_heads must divide the 4 query heads, got "
                f"{self.kv_heads!r}"
            )


def default_cases() -> list[Case]:
    """The settings of the chapter's table: each changes one thing from fp16, d=64, no mask."""
    return [
        Case("fp16, d=64"),
        Case("bf16, d=128, causal", dtype="bfloat16", head_dim=128, causal=True),
        Case("fp32, d=64", dtype="float32"),
        Case("fp64, d=64", dtype="float64"),
        Case("fp16, d=256", head_dim=256),
        Case("fp16, d=512", head_dim=512),
        Case("fp16, d=60 (not a multiple of 8)", head_dim=60),
        Case("fp16, bool mask", mask="bool"),
        Case("fp16, float mask", mask="float"),
        Case("fp16, dropout 0.1", dropout=0.1),
        Case("fp16, GQA 4:1", kv_heads=1),
        Case("fp16, d=64, backward", backward=True),
        Case("fp16, d=256, backward", head_dim=256, backward=True),
        Case("fp16, float mask, backward", mask="float", backward=True),
    ]


def make_inputs(case: Case, device: str, *, B: int = 2, H: int = 4, N: int = 128, seed: int = 0):
    """(q, k, v, attn_mask) for a case: q (B, H, N, d), k and v (B, kv_heads, N, d)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    q_shape, kv_shape = (B, H, N, case.head_dim), (B, case.kv_heads, N, case.head_dim)
    q, k, v = (
        torch.randn(s, generator=gen).to(device, dtype) for s in (q_shape, kv_shape, kv_shape)
    )
    for x in (q, k, v):
        x.requires_grad_(case.backward)
    mask = None
    if case.mask == "bool":
        mask = torch.rand(N, N, generator=gen).to(device) < 0.9  # (N, N), True = may attend
    elif case.mask == "float":
        mask = torch.randn(N, N, generator=gen).to(device, dtype)  # (N, N), added to the scores
    return q, k, v, mask


def _call(case: Case, q, k, v, mask):
    o = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=case.dropout,
        is_causal=case.causal,
        enable_gqa=case.kv_heads != q.shape[1],
    )
    if case.backward:
        o.sum().backward()
    return o


def _reason(message: str) -> str:
    """A warning's text without PyTorch's "(Triggered internally at <source path>)" tail."""
    return re.sub(r"\s*\(Triggered internally at .*", "", message, flags=re.S).strip()


def try_backend(case: Case, backend: str, device: str = "cpu") -> dict:
    """Run the case with only `backend` allowed: {"ran", "error" (str or None), "reasons"}.

    reasons: SDPA's warnings, which say why a backend refused (empty when it ran).
    """
    if backend not in BACKENDS:
        raise ValueError(f"try_backend: backend must be one of {BACKENDS}, got {backend!r}")
    q, k, v, mask = make_inputs(case, device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                _call(case, q, k, v, mask)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()  # a kernel's own failure surfaces here, not later
            error = None
        except RuntimeError as e:  # SDPA's refusal (and CUDA errors) are RuntimeErrors
            error = str(e).strip().splitlines()[0]
        except Exception as e:  # anything else is recorded too, so one case cannot stop the table
            error = (
                f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            )
    reasons = [
        _reason(str(w.message)) for w in caught if "kernel not used because" not in str(w.message)
    ]
    return {"ran": error is None, "error": error, "reasons": [r for r in reasons if r]}


@contextlib.contextmanager
def _stderr_dropped():
    """Send file descriptor 2 to /dev/null for the duration (C++ log lines bypass sys.stderr)."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def default_backend(case: Case, device: str = "cpu") -> dict:
    """What SDPA runs with every backend allowed: {"backend": name, "kernels": [GPU kernel names]}.

    The backend comes from the ATen operator the profiler records; kernels are the names of the
    device kernels it launched (empty on a CPU), as a GPU profiler trace would show them.
    """
    from torch.profiler import ProfilerActivity, profile

    q, k, v, mask = make_inputs(case, device)
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if device.startswith("cuda") else []
    )
    prof = profile(activities=activities)
    with _stderr_dropped():  # the profiler logs its own start and stop on the process's stderr
        prof.start()
    _call(case, q, k, v, mask)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    with _stderr_dropped():
        prof.stop()
    names = [e.key for e in prof.key_averages()]
    ops = [
        OPERATORS[n.removeprefix("aten::")] for n in names if n.removeprefix("aten::") in OPERATORS
    ]
    kernels = sorted({e.key for e in prof.key_averages() if e.device_type.name == "CUDA"})
    return {"backend": ops[0] if ops else "unknown", "kernels": kernels}


def run_table(cases: list[Case], device: str = "cpu", backends=BACKENDS) -> list[dict]:
    """One row per case: its settings, the default backend and each forced backend's outcome."""
    rows = []
    for case in cases:
        row = asdict(case)
        row.update(default_backend(case, device))
        row["forced"] = {b: try_backend(case, b, device) for b in backends}
        rows.append(row)
    return rows


SHORT = {
    "FLASH_ATTENTION": "FLASH",
    "EFFICIENT_ATTENTION": "EFFICIENT",
    "CUDNN_ATTENTION": "CUDNN",
    "MATH": "MATH",
    "OVERRIDEABLE": "OVERRIDE",
    "unknown": "?",
}


def format_table(rows: list[dict]) -> str:
    """A text table: one line per case, "ran" or "-" per forced backend, and the default's pick."""
    backends = list(rows[0]["forced"]) if rows else list(BACKENDS)
    width = max([len(r["label"]) for r in rows] + [4])
    head = f"{'case':<{width}}" + "".join(f"{SHORT[b]:>10}" for b in backends) + "   default picks"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = "".join(f"{'ran' if r['forced'][b]['ran'] else '-':>10}" for b in backends)
        lines.append(f"{r['label']:<{width}}{cells}   {SHORT.get(r['backend'], r['backend'])}")
    return "\n".join(lines)


def refusals(rows: list[dict], backend: str = "FLASH_ATTENTION") -> list[str]:
    """One line per case the backend refused: its label and SDPA's reasons (or the error). The
    notes that the other backends "have been runtime disabled" (by forcing this one) are left out:
    they say nothing about this backend."""
    out = []
    for r in rows:
        result = r["forced"][backend]
        if not result["ran"]:
            reasons = [x for x in result["reasons"] if "has been runtime disabled" not in x]
            out.append(f"{r['label']}: {'; '.join(reasons) or result['error']}")
    return out


def load_record(path=RESULTS_FILE) -> dict:
    """A JSON record written by `python -m flashedu.sdpa_backends --out`."""
    with open(path) as f:
        return json.load(f)


def environment(device: str) -> dict:
    """Date, device name and versions for the JSON record."""
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.processor()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "device_name": name or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flashedu.sdpa_backends",
        description="Which SDPA backend runs for which inputs.",
    )
    parser.add_argument("--out", help="write the table as JSON to this file")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    rows = run_table(default_cases(), args.device)
    print(format_table(rows))
    if args.out:
        command = "python -m flashedu.sdpa_backends " + " ".join(
            sys.argv[1:] if argv is None else argv
        )
        record = {**environment(args.device), "command": command.strip(), "cases": rows}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
