"""flashedu.sdpa_backends on the CPU: what runs and what refuses, the reasons SDPA gives, the
default pick seen by the profiler, the text table and the JSON record of
`python -m flashedu.sdpa_backends`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashedu import sdpa_backends as sb

ROOT = Path(__file__).resolve().parent.parent
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="states what the CPU backends do")


def test_math_runs_every_default_case():
    for case in sb.default_cases():
        assert sb.try_backend(case, "MATH") == {"ran": True, "error": None, "reasons": []}, case


@cpu_only
@pytest.mark.parametrize("backend", ["EFFICIENT_ATTENTION", "CUDNN_ATTENTION"])
def test_cuda_only_backends_refuse_on_cpu(backend):
    result = sb.try_backend(sb.Case("fp32", dtype="float32"), backend)
    assert not result["ran"] and "No viable backend" in result["error"]


@cpu_only
def test_cpu_flash_refuses_dropout_and_says_why():
    result = sb.try_backend(sb.Case("dropout", dtype="float32", dropout=0.1), "FLASH_ATTENTION")
    assert not result["ran"] and result["error"].startswith("No available kernel")
    assert any("dropout" in r for r in result["reasons"]), result["reasons"]
    assert not any("Triggered internally" in r for r in result["reasons"])


@cpu_only
def test_default_pick_is_read_from_the_profiler():
    assert sb.default_backend(sb.Case("plain", dtype="float32")) == {
        "backend": "FLASH_ATTENTION",
        "kernels": [],
    }
    assert sb.default_backend(sb.Case("dropout", dtype="float32", dropout=0.5))["backend"] == "MATH"


def test_inputs_follow_the_case():
    q, k, v, mask = sb.make_inputs(
        sb.Case("x", dtype="bfloat16", head_dim=40, mask="float", kv_heads=2, backward=True), "cpu"
    )
    assert q.shape == (2, 4, 128, 40) and k.shape == v.shape == (2, 2, 128, 40)
    assert q.dtype == mask.dtype == torch.bfloat16 and q.requires_grad
    _, _, _, bool_mask = sb.make_inputs(sb.Case("y", mask="bool"), "cpu")
    assert bool_mask.dtype == torch.bool and bool_mask.shape == (128, 128)


@pytest.mark.parametrize(
    "kw,words",
    [
        (dict(dtype="float8"), "dtype must be one of"),
        (dict(mask="causal"), "mask must be one of"),
        (dict(head_dim=0), "head_dim must be a positive int"),
        (dict(dropout=1.0), "dropout must be in [0, 1)"),
        (dict(kv_heads=3), "kv_heads must divide the 4 query heads"),
    ],
)
def test_bad_cases_are_named(kw, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace(")", r"\)")):
        sb.Case("bad", **kw)
    with pytest.raises(ValueError, match="backend must be one of"):
        sb.try_backend(sb.Case("ok"), "FLASH")


@cpu_only
def test_table_has_one_line_per_case_with_each_outcome():
    cases = [sb.Case("fp32", dtype="float32"), sb.Case("dropout", dtype="float32", dropout=0.1)]
    rows = sb.run_table(cases)
    text = sb.format_table(rows).splitlines()
    assert text[0].split() == ["case", "FLASH", "EFFICIENT", "CUDNN", "MATH", "default", "picks"]
    assert text[2].split() == ["fp32", "ran", "-", "-", "ran", "FLASH"]
    assert text[3].split() == ["dropout", "-", "-", "-", "ran", "MATH"]


@cpu_only
def test_command_line_writes_the_json_record(tmp_path):
    out = tmp_path / "backends.json"
    proc = subprocess.run(
        [sys.executable, "-m", "flashedu.sdpa_backends", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert {"date", "device", "device_name", "torch", "python", "command", "cases"} <= set(record)
    assert record["command"].startswith("python -m flashedu.sdpa_backends --out")
    assert [c["label"] for c in record["cases"]] == [c.label for c in sb.default_cases()]
    assert all(set(c["forced"]) == set(sb.BACKENDS) for c in record["cases"])
    assert "USDT" not in proc.stderr  # the profiler's own log lines are dropped
    assert sb.load_record(out) == record
    assert sb.refusals(record["cases"]) == [
        "fp16, dropout 0.1: Both fused kernels do not support non-zero dropout."
    ]
    assert len(sb.refusals(record["cases"], "EFFICIENT_ATTENTION")) == len(record["cases"])


def test_an_unexpected_error_is_recorded_not_raised(monkeypatch):
    def broken(*args):
        raise ValueError("boom")

    monkeypatch.setattr(sb, "_call", broken)
    assert sb.try_backend(sb.Case("x"), "MATH") == {
        "ran": False,
        "error": "ValueError: boom",
        "reasons": [],
    }


def test_the_committed_h200_table_says_why_flash_refused():
    """The H200 record (made by `python -m flashedu.sdpa_backends --out`) and what refusals keeps
    of it: FLASH's own reason per case, not the notes on the backends forcing disabled."""
    record = sb.load_record()
    assert record["device_name"] == "NVIDIA H200" and record["command"].startswith(
        "python -m flashedu.sdpa_backends"
    )
    lines = sb.refusals(record["cases"])
    by_label = {line.split(":")[0]: line for line in lines}
    assert "non-null attn_mask" in by_label["fp16, float mask"]
    assert "less than or equal to 256" in by_label["fp16, d=512"]
    assert not any("runtime disabled" in line for line in lines)
    assert {r["label"]: r["backend"] for r in record["cases"]}["fp16, d=64"] == "CUDNN_ATTENTION"
