"""The registry's "hopper" entry: the Hopper kernels where they run, the FA2 kernels elsewhere.

`flashedu.attention(impl="auto")` picks this entry where `preferred(q, k, v)`: CUDA tensors on an
sm_90 GPU at a head dim where the Gluon forward was measured faster than the FA2 forward;
`impl="hopper"` asks for it by name. Where `takes(q, k, v)` (fp16/bf16, one head dim of 64 or 128
for q, k and v, CUDA tensors on sm_90, or CPU tensors under TRITON_INTERPRET=1) the forward is a
Hopper kernel: the Gluon one (`gluon_fwd`, FA3's overlap written out) on the GPU, the Triton one
(`triton_fwd`) under the interpreter, which cannot run Gluon. Everything else, and every
backward, goes to the FA2 kernels (`flashedu.kernels`) with the same arguments and contract,
except the backward at the (head dim, mask) pairs of BWD_MEASURED_FASTER, which runs the Gluon
backward (`gluon_bwd`: a dK/dV kernel and a dQ kernel, deterministic), measured faster than the
FA2 backward there (GPU_NOTES.md, "Gluon backward").

Introduced in notebooks/11_hopper.ipynb.
"""

from __future__ import annotations

import torch

from .. import kernels
from .._nonfinite import poison_hidden_values
from . import triton_fwd

# Head dims where the Gluon forward beat the FA2 forward in one H200 run (round 4 in GPU_NOTES.md,
# bf16 and fp16, causal and not: 1.04x to 1.13x).
MEASURED_FASTER = (64, 128)
# (head dim, causal) where the Gluon backward (`gluon_bwd`, deterministic dQ pass) beat the
# FA2 backward on the H200 (GPU_NOTES.md, "Gluon backward"); elsewhere the FA2 backward runs.
BWD_MEASURED_FASTER = ((128, False), (128, True), (64, True))


def takes(q, k, v) -> bool:
    """True where a Hopper forward runs: `triton_fwd.supports` for a CUDA device, or CPU tensors
    under the interpreter, with one head dim for q, k and v."""
    if not all(isinstance(x, torch.Tensor) and x.ndim == 4 for x in (q, k, v)):
        return False
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d or q.dtype not in triton_fwd.DTYPES:
        return False
    if triton_fwd.interpreting():
        return q.device.type == "cpu" and d in triton_fwd.HEAD_DIMS
    if q.device.type != "cuda":
        return False
    return triton_fwd.supports(torch.cuda.get_device_capability(q.device), q.dtype, d)


# Head dims (besides those not a multiple of 8) that impl="auto" zero-pads to a Hopper width,
# where that measured faster than the FA2 kernels at the head dim itself and than SDPA's FLASH
# backend (notebooks/results/h200_headdims_runs/run3.json, "hopper_padded" rows, bf16, B = 4,
# H = 16, N = 4096: d = 40 padded to 64 ran 222 / 191 TFLOP/s forward / forward + backward against
# 124 / 101 for the FA2 kernels and 159 / 152 for FLASH). At d = 80 and 96 the two-chunk FA2
# kernels measured faster than the padded Hopper path, so those stay unpadded.
PAD_HEAD_DIMS: frozenset[int] = frozenset({40})


def pad_width(q, k, v) -> int | None:
    """The width in MEASURED_FASTER (64 or 128) that `flashedu.attention(impl="auto")` zero-pads
    q, k and v to before taking this entry, or None. Padded where one head dim d serves q, k and v
    and either d is not a multiple of 8 (a row of d fp16/bf16 elements is then not 16-byte
    aligned, so the FA2 kernels load it in pieces; SDPA's FLASH backend pads such a d too) or d is
    in PAD_HEAD_DIMS, and the Hopper forward runs at the padded width on this GPU.
    Zero columns leave q k^T unchanged and give zero output columns, which are sliced off; the
    softmax scale stays 1 / sqrt(d)."""
    if not all(isinstance(x, torch.Tensor) and x.ndim == 4 for x in (q, k, v)):
        return None
    d = q.shape[-1]
    if d in MEASURED_FASTER or k.shape[-1] != d or v.shape[-1] != d:
        return None
    if d % 8 == 0 and d not in PAD_HEAD_DIMS:
        return None
    width = next((w for w in sorted(MEASURED_FASTER) if w > d), None)
    if width is None or not q.is_cuda or triton_fwd.interpreting():
        return None
    if not triton_fwd.supports(torch.cuda.get_device_capability(q.device), q.dtype, width):
        return None
    return width


def preferred(q, k, v) -> bool:
    """Whether `flashedu.attention(impl="auto")` should take this entry: `takes` on a real sm_90
    GPU (never under the interpreter) at a head dim in MEASURED_FASTER."""
    if triton_fwd.interpreting() or not takes(q, k, v):
        return False
    return q.device.type == "cuda" and q.shape[-1] in MEASURED_FASTER


def forward(q, k, v, *, causal=False, softmax_scale=None, **options):
    """(o, lse) by a Hopper forward where `takes`, else by `kernels.forward` (which also
    takes the options the Hopper kernels do not: windows, ALiBi, score mods)."""
    if not options and takes(q, k, v):
        if triton_fwd.interpreting():
            o, lse = triton_fwd.forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
        else:
            from . import gluon_fwd  # Gluon is imported only where it runs

            o, lse = gluon_fwd.forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
        # the skipped blocks' keys: a non-finite v there is NaN in every row, as in the reference
        return poison_hidden_values(o, v, q.shape[2], -1, 0 if causal else -1), lse
    return kernels.forward(q, k, v, causal=causal, softmax_scale=softmax_scale, **options)


def backward(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, **options):
    """(dq, dk, dv) by the Gluon backward on an sm_90 GPU where it measured faster
    (BWD_MEASURED_FASTER), else by `kernels.backward` (the forward's o and lse are the same
    quantities whichever forward made them)."""
    fast = (q.shape[-1], bool(causal)) in BWD_MEASURED_FASTER
    if not options and fast and not triton_fwd.interpreting() and takes(q, k, v):
        from . import gluon_bwd  # Gluon is imported only where it runs

        return gluon_bwd.backward(do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale)
    return kernels.backward(
        do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale, **options
    )
