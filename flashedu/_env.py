"""Where the package runs: the Triton interpreter flag, set before anything imports `triton`, and
the repository's root.

Triton's interpreter (`TRITON_INTERPRET=1`) runs the same `@triton.jit` kernels on CPU tensors, so
the course's Triton chapters work on a laptop. The variable is read when `triton.jit` decorates a
kernel, so it has to be set before `flashedu.kernels.fwd` is imported. We set it only when no
CUDA device exists and the user has not chosen either way.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository: book.toml, notebooks/, tests/


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return torch.cuda.is_available()


INTERPRETER = False
if "TRITON_INTERPRET" not in os.environ and not _cuda_available():
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"
