"""The roofline tool: every case runs on toy shapes, and the 8B roofline is the known arithmetic."""

from __future__ import annotations

import json

import pytest
import torch

from dualserve.clients.gpu_roofline import Case, items_for, main
from dualserve.clients.roofline import (EAGLE3_DRAFT_VOCAB_8B, LLAMA3_8B, Shape, eagle3_config, forward_work,
                                        on_meta, roofline_ms)
from dualserve.models.eagle import Eagle3Head
from dualserve.models.transformer import Transformer

CASES = ["ar-decode-b1", "ar-decode-b2", "eagle-verify-8", "eagle-verify-16", "eagle-draft", "diffusion-full",
         "diffusion-dual", "diffusion-dual-b2"]


def test_tiny_runs_ar_eagle_and_diffusion(tmp_path, capsys):
    out = tmp_path / "roofline.json"
    assert main(["--tiny", "--device", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["complete"] and report["dtype"] == "torch.float32"
    rows = {r["case"]: r for r in report["results"]}
    assert list(rows) == CASES
    for r in rows.values():
        assert r["step"] == "eager" and r["ms"] > 0 and r["roofline_ms"] > 0 and 0 < r["of_roofline"] < 1
        assert r["tokens_per_s"] == pytest.approx(1e3 * r["tokens"] / r["ms"], rel=0.01)
    assert (rows["ar-decode-b2"]["batch"], rows["ar-decode-b2"]["tokens"]) == (2, 2)
    assert rows["eagle-verify-16"]["tokens"] == 16 and rows["eagle-verify-16"]["context"] == 24
    assert rows["eagle-draft"]["tokens"] == 2 * 2  # the decoder's CPU tree: depth 3, top-k 2
    printed = capsys.readouterr().out
    assert all(name in printed for name in CASES)


def test_a_failing_case_is_a_row_and_the_rest_still_run(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("Expected all tensors to be on the same device")

    monkeypatch.setattr("dualserve.clients.gpu_roofline.draft_tree", broken)
    out = tmp_path / "roofline.json"
    assert main(["--tiny", "--device", "cpu", "--groups", "eagle", "--json", str(out)]) == 1
    rows = json.loads(out.read_text())["results"]
    assert [r["case"] for r in rows] == ["eagle-verify-8", "eagle-verify-16", "eagle-draft"]
    assert rows[-1]["error"] == "RuntimeError: Expected all tensors to be on the same device"
    assert all(r["ms"] > 0 for r in rows[:2])


def test_verify_items_are_the_decoders_tree_step():
    item, = items_for(Case("eagle-verify-8", "verify", 1, 8, 40, 8), block_size=16, vocab=100)
    depths = [0, 1, 1, 2, 2, 2, 2, 3]  # binary tree of 8 nodes
    assert item.positions.tolist() == [40 + d for d in depths] and item.context_len == 40
    assert item.mask.shape == (8, 8) and item.mask[7].tolist() == [True, True, False, True, False, False, False, True]
    assert list(item.slots) == list(range(40, 48)) and item.block_table == [0, 1, 2]


def test_8b_roofline_is_the_weight_stream():
    """Llama-3.1-8B bf16 decode reads 15.0 GB: 3.13 ms at 4.8 TB/s; built on meta, nothing allocated."""
    model = on_meta(lambda: Transformer(LLAMA3_8B), torch.bfloat16)
    shape = Shape.of(model)
    assert shape.layer_params == 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)
    assert shape.out_params == 128256 * 4096
    ms, bound = roofline_ms(forward_work(shape, 1, 1, 256, 1, 2), 989e12, 4.8e12)
    assert bound == "memory" and ms == pytest.approx(3.134, abs=1e-3)
    # 16 verify tokens cost the same weight stream: still memory-bound, within 1%.
    ms16, bound16 = roofline_ms(forward_work(shape, 1, 16, 256, 16, 2), 989e12, 4.8e12)
    assert bound16 == "memory" and ms16 == pytest.approx(ms, rel=0.01)
    head = Shape.of(on_meta(lambda: Eagle3Head(eagle3_config(LLAMA3_8B, EAGLE3_DRAFT_VOCAB_8B)), torch.bfloat16))
    assert head.num_layers == 1 and head.out_params == 32000 * 4096
    assert head.layer_params == 8192 * 6144 + 4096 * 4096 + 3 * 4096 * 14336  # qkv reads [emb; hidden]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tiny_on_cuda(tmp_path):
    out = tmp_path / "roofline.json"
    assert main(["--tiny", "--device", "cuda", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["dtype"] == "torch.bfloat16" and [r["case"] for r in report["results"]] == CASES
