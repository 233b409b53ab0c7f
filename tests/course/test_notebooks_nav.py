"""What a learner meets at the edges of every chapter in book.toml: the last cell links to the next
chapter and says how to reset an exercise; code cells carry nbval's cell tags, never its
`# NBVAL_*` comment markers, which a learner would read as code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flashedu import course

ROOT = Path(__file__).resolve().parents[2]
_, CHAPTERS = course.load()
MARKER = re.compile(r"^\s*#\s*NBVAL_", re.M)


def _cells(chapter) -> list[dict]:
    path = ROOT / chapter.notebook
    if not path.exists():
        pytest.skip(
            f"{chapter.notebook} does not exist yet (tests/course/test_manifest.py reports it)"
        )
    return course.read_notebook(path)["cells"]


@pytest.mark.parametrize(
    "chapter,after", list(zip(CHAPTERS, CHAPTERS[1:])), ids=[c.id for c in CHAPTERS[:-1]]
)
def test_the_last_cell_links_to_the_next_chapter(chapter, after):
    last = _cells(chapter)[-1]
    text = course.cell_source(last)
    target = Path(after.notebook).name
    assert last["cell_type"] == "markdown", f"{chapter.notebook} should end on markdown"
    assert "next" in text.lower() and re.search(rf"\]\({re.escape(target)}\)", text), (
        f"{chapter.notebook} should end with a link to the next chapter, e.g. "
        f"'Next: [{target[:2]} · {after.title}]({target})'"
    )


@pytest.mark.parametrize("chapter", CHAPTERS, ids=[c.id for c in CHAPTERS])
def test_the_last_cell_says_how_to_reset(chapter):
    text = course.cell_source(_cells(chapter)[-1])
    assert "reset" in text and f"git checkout {chapter.notebook}" in text, (
        f"{chapter.notebook}: say how to reset an exercise and how to restore the notebook"
    )


@pytest.mark.parametrize("chapter", CHAPTERS, ids=[c.id for c in CHAPTERS])
def test_code_cells_use_nbval_tags_not_comment_markers(chapter):
    for cell in _cells(chapter):
        if cell["cell_type"] == "code":
            src = course.cell_source(cell)
            assert not MARKER.search(src), (
                f"{chapter.notebook}: move the marker into the cell's tags "
                f"(nbval-ignore-output / nbval-skip):\n{src}"
            )
