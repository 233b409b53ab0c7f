"""Where the package runs: the Triton interpreter flag (set before anything imports `triton`),
whether Triton is installed at all, the torch/triton pairs the kernels were checked with, and the
repository's root.

Triton's interpreter (`TRITON_INTERPRET=1`) runs the same `@triton.jit` kernels on CPU tensors, so
the course's Triton chapters work on a laptop. The variable is read when `triton.jit` decorates a
kernel, so it has to be set before any kernel module (`flashedu.kernels`, `flashedu.hopper`) is
imported. We set it only when no CUDA device exists and the user has not chosen either way.

Triton publishes wheels for Linux only. Without it, `import flashedu` and every chapter without a
Triton kernel still work; what needs Triton raises `TritonUnavailable`, whose message says in one
line what to do, and in Jupyter that line is all the cell shows (`_show_one_line`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository: book.toml, notebooks/, tests/

# (torch, triton) release pairs the kernels were checked with: the CPU course's pins
# (requirements.txt) and the GPU environment's, measured on the H200 (requirements-gpu.txt).
CHECKED_PAIRS = (("2.13", "3.7"), ("2.11", "3.6"))


class TritonUnavailable(ModuleNotFoundError):
    """Raised by what needs Triton when Triton is not installed; an ImportError, so code that
    tries an import and falls back keeps working."""

    def __init__(self, what: str):
        super().__init__(
            f"{what} needs Triton, which installs on Linux only: run this part of the course on "
            "Linux, in WSL2 on Windows, or in the course container (README, 'Installing').",
            name="triton",
        )


def is_triton_missing(e: BaseException) -> bool:
    """True for the ImportError an `import triton` (or of a triton submodule) raises without it."""
    name = getattr(e, "name", None) or ""
    return isinstance(e, ImportError) and (name == "triton" or name.startswith("triton."))


def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["triton"] is None (blocked)
        return False


def require_triton(what: str) -> None:
    """Raise `TritonUnavailable(what)` unless Triton can be imported."""
    if not HAS_TRITON:
        raise TritonUnavailable(what)


def _release(version: str) -> str:
    """ "2.13.0+cpu" -> "2.13"."""
    return ".".join(re.findall(r"\d+", version)[:2])


def _check_pair() -> None:
    """Warn once when torch and triton are a pair the kernels were not checked with."""
    try:
        import torch

        found = (torch.__version__, importlib.metadata.version("triton"))
    except (ImportError, importlib.metadata.PackageNotFoundError):
        return
    if (_release(found[0]), _release(found[1])) not in CHECKED_PAIRS:
        pairs = ", ".join(f"torch {a} + triton {b}" for a, b in CHECKED_PAIRS)
        warnings.warn(
            f"flashedu: found torch {found[0]} with triton {found[1]}; the kernels were checked "
            f"with {pairs} (requirements.txt, requirements-gpu.txt).",
            RuntimeWarning,
            stacklevel=3,
        )


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return torch.cuda.is_available()


def _show_one_line(shell, etype, value, tb, tb_offset=None):
    """IPython's handler for ImportError: a missing Triton is one line, anything else the usual
    traceback."""
    if is_triton_missing(value):
        msg = (
            str(value)
            if isinstance(value, TritonUnavailable)
            else str(TritonUnavailable("This cell"))
        )
        print(f"{etype.__name__}: {msg}", file=sys.stderr)
        return None
    return shell.showtraceback((etype, value, tb), tb_offset=tb_offset)


def _install_notebook_handler() -> None:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None and not HAS_TRITON:
        shell.set_custom_exc((ImportError,), _show_one_line)


HAS_TRITON = _triton_installed()
if "TRITON_INTERPRET" not in os.environ and not _cuda_available():
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"
_check_pair()
_install_notebook_handler()
