"""FlashAttention-2 in Triton: the kernels a GPU engineer reads, and the registry's "triton" entry.

`forward` and `backward` here follow the package's contract (`flashedu.registry`), on the dtypes
`DTYPES` and the head dims `HEAD_DIMS` (1-256); the modules:

* `fwd`: the general forward kernel and its launcher (GQA, windows, ALiBi and score mods, packed
  sequences, any head dim 1-256, a value head dim of its own). `bwd`: the backward kernels
  (preprocess, dK/dV, dQ) and their launcher.
* `teach`: the forward kernel chapter 06 shows, no larger than Triton's tutorial kernel, tested
  equal to `fwd` on the cases both support.
* `common` (mask rule, ALiBi, base-2 constants), `tiles` (padded tile loads and stores),
  `score_mods`, `launch` (validation, plans, autotuning): what the forward and backward share.
* `paged`: split-KV decoding through a paged KV cache's block table, with attention sinks
  (chapter 12; `decoding.paged_forward`); `paged_solution`: the page lookup it calls, the answer
  to chapter 12's Triton exercise.
* `nonfinite`: the GPU form of `_nonfinite.poison_hidden_values` (a non-finite v in a skipped
  block reaches the rows the reference makes NaN): one read of v, no host sync.
* `varlen`: packed sequences in one launch. `intro`: chapter 06's first kernels (one tile of S
  or P). `exercises` / `solutions`: the kernel exercises of chapters 06 and 07 and their answers.

Importing this package imports triton (`flashedu._env` sets TRITON_INTERPRET=1 first when there is
no GPU); `import flashedu` alone does not. Without Triton (macOS, Windows) it raises
`TritonUnavailable`, whose one line says where the kernels run.
"""

from __future__ import annotations

from .._env import TritonUnavailable, is_triton_missing

try:
    from .bwd import backward
    from .fwd import forward
    from .launch import DTYPES, HEAD_DIMS
except ImportError as e:
    if is_triton_missing(e):
        raise TritonUnavailable("flashedu.kernels (the Triton kernels)") from None
    raise

__all__ = ["DTYPES", "HEAD_DIMS", "backward", "forward"]
