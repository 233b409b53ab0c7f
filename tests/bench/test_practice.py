"""The FlexAttention / score-mod / packed-sequence GPU benchmark: what can be checked on a CPU."""

import math

import pytest
import torch

from flashedu.bench import practice


def test_documents_cover_every_token_in_order():
    ids, cuts = practice._doc_ids(37, 8, "cpu")
    assert cuts[0] == 0 and cuts[-1] == 37 and len(cuts) == 9
    assert torch.all(ids[1:] >= ids[:-1])
    assert ids.unique().tolist() == list(range(8))


def test_reference_is_softmax_attention_with_a_bias_and_zero_rows_where_all_masked():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    bias = torch.zeros(5, 5, dtype=torch.float64)
    bias[0] = float("-inf")  # row 0 sees nothing
    o = practice._reference(q, k, v, bias)
    s = q @ k.transpose(-1, -2) / math.sqrt(4)
    expected = torch.softmax(s[..., 1:, :], dim=-1) @ v
    assert torch.allclose(o[..., 1:, :], expected, atol=1e-12)
    assert torch.all(o[..., 0, :] == 0)


def test_main_refuses_without_a_gpu_and_validates_n(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the benchmark would run")
    assert practice.main(["--out", str(tmp_path / "x.json")]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        practice.main(["--out", str(tmp_path / "x.json"), "--N", "-5"])
    assert not (tmp_path / "x.json").exists()


def test_the_committed_h200_record_formats_one_line_per_setting():
    record = practice.load_record()
    assert record["gpu"] == "NVIDIA H200" and all(r["ok"] for r in record["rows"])
    table = practice.format_table(record).splitlines()
    assert [line.split()[0] for line in table[2:]] == ["plain", "alibi", "softcap", "documents"]
    softcap = next(line for line in table if line.startswith("softcap"))
    assert softcap.split()[-2] == "-"  # SDPA cannot soft-cap
