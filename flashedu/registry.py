"""Every attention implementation in one table, so tests, benchmarks and widgets treat them alike.

Each entry holds a module with the common contract

    forward(q, k, v, *, causal=False, softmax_scale=None, ...) -> (o, lse)
    backward(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, ...) -> (dq, dk, dv)

and says what arrays it takes ("numpy" or "torch"), which dtypes, and which features beyond plain
and causal attention it supports: "gqa" (fewer K/V heads), "window" (sliding window), "alibi",
"score_mod" (a `flashedu.kernels.score_mods` score mod). The NumPy and PyTorch implementations are
imported here (they need nothing beyond numpy and torch); the Triton ones are held by a function
that imports them on first use (`_triton`, `_hopper`), so listing them does not import triton.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

from . import naive, reference, tiled, torch_tiled


@dataclass(frozen=True)
class Implementation:
    name: str
    load: Callable[[], ModuleType]  # returns the module with forward and backward
    kind: str  # "numpy" or "torch"
    dtypes: tuple[str, ...]
    features: frozenset[str]
    chapter: str
    summary: str
    _loaded: list = field(default_factory=list, init=False, compare=False, repr=False)

    @property
    def module(self) -> ModuleType:
        """The implementation's module, loaded on first use and kept: later calls read a list,
        which `torch.compile` can trace (it cannot trace an import)."""
        if not self._loaded:
            self._loaded.append(self.load())
        return self._loaded[0]

    def forward(self, q, k, v, **kw):
        return self.module.forward(q, k, v, **kw)

    def backward(self, do, q, k, v, o, lse, **kw):
        return self.module.backward(do, q, k, v, o, lse, **kw)


def _triton() -> ModuleType:
    from . import kernels  # triton loads here, on first use

    return kernels


def _hopper() -> ModuleType:
    from .hopper import dispatch

    return dispatch


def _impl(name, module, kind, dtypes, features, chapter, summary):
    """`module`: the module itself, or a function that imports it on first use."""
    load = module if callable(module) else (lambda: module)
    return Implementation(name, load, kind, tuple(dtypes), frozenset(features), chapter, summary)


IMPLEMENTATIONS: dict[str, Implementation] = {
    impl.name: impl
    for impl in [
        _impl(
            "reference",
            reference,
            "numpy",
            ["float64"],
            ["gqa", "window", "alibi"],
            "01",
            "float64 oracle by the plain formulas",
        ),
        _impl(
            "naive",
            naive,
            "numpy",
            ["float16", "float32", "float64"],
            ["gqa", "window"],
            "01",
            "standard attention: S and P through HBM",
        ),
        _impl(
            "tiled",
            tiled,
            "numpy",
            ["float16", "float32", "float64"],
            ["gqa", "window", "alibi"],
            "03",
            "FlashAttention tiles and online softmax in NumPy",
        ),
        _impl(
            "torch_tiled",
            torch_tiled,
            "torch",
            ["float16", "bfloat16", "float32", "float64"],
            ["gqa"],
            "05",
            "the tiled algorithm in PyTorch ops; differentiable through flashedu.autograd",
        ),
        _impl(
            "triton",
            _triton,
            "torch",
            ["float16", "bfloat16", "float32"],
            ["gqa", "window", "alibi", "score_mod"],
            "06",
            "FlashAttention-2 kernels in Triton",
        ),
        _impl(
            "hopper",
            _hopper,
            "torch",
            ["float16", "bfloat16", "float32"],
            ["gqa"],
            "11",
            "Hopper kernels on sm_90 (fp16/bf16, d 64 and 128), the FA2 kernels elsewhere",
        ),
    ]
}
