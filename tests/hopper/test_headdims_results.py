"""The head-dim results (notebooks/results/h200_headdims.json) as chapter 11 reads them: the file
is runs 2-4 merged by scripts/hopper/merge_headdims.py, each head dim's rows from one run; the
table's cells and ratios; and the claim the chapter makes of them (impl="auto" at or above FLASH in
every row). Also serving.decode_table on the paged-decoding results."""

from __future__ import annotations

import importlib.util
import json

import pytest

from flashedu import _env, serving
from flashedu.hopper import results as hr

RESULTS = _env.ROOT / "notebooks" / "results"


def _merge_module():
    path = _env.ROOT / "scripts" / "hopper" / "merge_headdims.py"
    spec = importlib.util.spec_from_file_location("merge_headdims", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_committed_file_is_runs_2_to_4_merged_by_the_script():
    committed = json.loads((RESULTS / "h200_headdims.json").read_text())
    assert _merge_module().merge([2, 3, 4]) == committed
    for r in committed["rows"]:  # every row of a head dim comes from the run named for it
        assert r["run"] == committed["head_dims"][str(r["d"])]


def test_the_loader_reads_the_file_and_names_what_a_wrong_one_lacks(tmp_path):
    assert hr.load_headdims(tmp_path / "absent.json") is None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not a head-dim results file, it lacks runs, head_dims"):
        hr.load_headdims(bad)
    assert set(hr.load_headdims()["head_dims"]) == {"40", "80", "96", "111", "192", "256"}


def _row(kernel, d, causal, pass_, tflops, ok=True):
    return dict(kernel=kernel, dtype="bf16", d=d, causal=causal, **{"pass": pass_},
                tflops=tflops, ok=ok)  # fmt: skip


def test_the_table_takes_the_faster_of_a_columns_kernels_and_drops_failed_rows():
    result = dict(head_dims={"96": 7}, rows=[
        _row("flashedu_auto", 96, False, "fwd", 300.0),
        _row("fa2_split", 96, False, "fwd", 250.0),
        _row("fa2_split_sep", 96, False, "fwd", 280.0),
        _row("hopper_padded", 96, False, "fwd", 999.0, ok=False),  # failed its check: not shown
        _row("sdpa_flash", 96, False, "fwd", 200.0),
        _row("sdpa_cudnn", 96, False, "fwd", 400.0),
    ])  # fmt: skip
    line = hr.headdims_table(result).splitlines()[1].split()
    assert line == ["96", "-", "fwd", "300", "-", "280", "-", "200", "400", "1.50", "0.75", "7"]


def test_auto_is_at_or_above_flash_in_every_row_the_chapter_shows():
    """Issue 28's acceptance, on the committed run: impl="auto" >= SDPA's FLASH backend at every
    head dim, mask, pass and dtype measured."""
    res = hr.load_headdims()
    for dtype in ("bf16", "fp16"):
        lines = hr.headdims_table(res, dtype).splitlines()[1:]
        assert lines or dtype == "fp16"
        for line in lines:
            assert float(line.split()[-3]) >= 1.0, line


def test_decode_table_reads_the_graph_replays_against_the_copy():
    res = json.loads((RESULTS / "h200_paged_decode.json").read_text())
    lines = serving.decode_table(res).splitlines()
    assert len(lines) == 1 + sum("ms_graph" in r for r in res["rows"]) == 13
    first = res["rows"][0]
    cells = lines[1].split()
    assert cells[:3] == [str(first["B"]), str(first["ctx"]), str(first["num_splits"])]
    assert cells[3] == f"{first['ms_graph'] * 1e3:.0f}"
    assert cells[4] == f"{first['gbs_graph'] / res['hbm']['gbs']:.0%}"
