"""flashedu.nb: the source a notebook displays is the package's, without the comments addressed to
the formatter and the linter."""

from __future__ import annotations

import ast

from flashedu import nb
from flashedu.kernels import bwd


def test_readable_drops_formatter_and_linter_comments_only():
    text = "\n".join(
        [
            "x = f(a,  b)  # fmt: skip",
            "# fmt: off",
            "table = [1,   2]",
            "# fmt: on",
            "import os  # noqa: F401",
            "g = lambda: 0  # noqa: E731, E501",
            "y = 1  # noqa",
            "import sys  # noqa: F401  (kept: the reason is for the reader)",
            "z = 2  # the comment a reader wants",
            "",
            "w = 3",
        ]
    )
    assert nb.readable(text).split("\n") == [
        "x = f(a,  b)",
        "table = [1,   2]",
        "import os",
        "g = lambda: 0",
        "y = 1",
        "import sys  # noqa: F401  (kept: the reason is for the reader)",
        "z = 2  # the comment a reader wants",
        "",
        "w = 3",
    ]


def test_a_shown_kernel_is_the_same_code():
    raw = nb.source(bwd.attn_bwd_dkdv)
    shown = nb.readable(raw)
    assert "fmt: skip" in raw and "fmt: skip" not in shown
    assert ast.dump(ast.parse(shown)) == ast.dump(ast.parse(raw))


def test_show_source_displays_the_readable_text(capsys, monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", shown.append)
    nb.show_source(bwd.attn_bwd_dkdv)
    (code,) = shown
    assert code.data == nb.readable(nb.source(bwd.attn_bwd_dkdv))
