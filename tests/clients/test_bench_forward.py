"""The forward cost table and the format quality report: arguments, tables, the timed step on a tiny
random model (eager), and the quality summary on fake outputs. Fast: no real model is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dualserve.clients import bench_forward, eval_formats
from dualserve.clients.bench_forward import Report, Row
from dualserve.clients.eval_formats import FormatRun
from dualserve.decoders.engine.runner import ForwardItem, ModelRunner
from dualserve.models.config import ModelConfig
from dualserve.models.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = ModelConfig(family="llama", vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, intermediate_size=48, tie_word_embeddings=True)


def tiny() -> Transformer:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Transformer(CFG).eval().requires_grad_(False)
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.fill_(1.0)
    return model


def test_bench_forward_arguments() -> None:
    args = bench_forward.parse_args([])
    assert args.formats == ["fp32", "bf16", "int8", "int4", "w4a8", "w4a16"]
    assert args.tokens == [1, 2, 4, 8, 16, 32, 64]
    assert (args.context, args.threads, args.no_compile, args.json) == (128, 2, False, None)
    args = bench_forward.parse_args(["--formats", "int4", "--no-compile", "--tokens", "8", "1", "8"])
    assert args.formats == ["int4"] and args.no_compile and args.tokens == [1, 8]
    with pytest.raises(SystemExit):
        bench_forward.parse_args(["--formats", "fp16"])
    with pytest.raises(SystemExit):
        bench_forward.parse_args(["--tokens", "0"])


def test_table_shows_ms_ratios_and_the_target() -> None:
    report = Report("AVX512", 2, 128, (1, 2, 8), 20, [
        Row("int4", "eager", {1: 10.0, 2: 11.0, 8: 12.0}),
        Row("int4", "compiled", {1: 5.0, 2: 6.0, 8: 10.0}),
    ], compile_seconds={"int4": {"single/one-token": 61.5}})
    assert report.rows[1].ratio(8) == 2.0
    text = bench_forward.format_table(report)
    assert "host capability AVX512" in text and "threads 2" in text
    assert "12.00" in text and "1.20x" in text and "met" in text
    assert "missed by 1.54x" in text           # 2.0 / 1.3
    assert "int4 T=1 2.00x T=8 1.20x" in text  # eager / compiled
    assert "single/one-token 61.5 s" in text
    as_json = report.as_json()
    assert as_json["rows"][0]["ratio_to_1"]["8"] == 1.2 and as_json["rows"][1]["ms"]["1"] == 5.0


def test_the_timed_item_reads_the_cached_context() -> None:
    """span_item's block table and slots are right: its last row equals one forward over the whole sequence."""
    model, block, context, t = tiny(), 4, 9, 5
    ids = torch.randint(0, CFG.vocab_size, (context + t,), generator=torch.Generator().manual_seed(3))
    table = list(range(4))[::-1]  # not the identity, so slots must follow the table
    whole = ModelRunner(model, 4, block, use_flash=False)
    want, _ = whole.forward([ForwardItem(ids, range(context + t), 0, table,
                                         [table[p // block] * block + p % block for p in range(context + t)])])
    runner = ModelRunner(model, 4, block, use_flash=False)
    runner.forward([bench_forward.span_item(0, context, ids, table, block)])
    got, _ = runner.forward([bench_forward.span_item(context, t, ids, table, block)])
    torch.testing.assert_close(got, want[context:], rtol=1e-4, atol=1e-4)


def test_forward_parts_add_up_to_the_forward_and_name_the_kernels() -> None:
    """``--profile``'s parts on a tiny model in ``w4a16`` (its GEMMs are the dot8 kernel): the
    kernel ops of the forward, the rest, and the head, each a share of one forward's time."""
    from dualserve.models import kernels
    from dualserve.models.quant import quantize_linears

    if not kernels.available():
        pytest.skip("no C++ compiler for the kernels")
    model, block, context = tiny(), 4, 9
    quantize_linears(model, "w4a16")
    ids = torch.randint(0, CFG.vocab_size, (context + 1,), generator=torch.Generator().manual_seed(3))
    runner = ModelRunner(model, 4, block, use_flash=False)
    runner.forward([bench_forward.span_item(0, context, ids, list(range(4)), block)])
    parts = bench_forward.forward_parts(runner, bench_forward.span_item(context, 1, ids, list(range(4)), block),
                                        forwards=3)
    assert {"dot8 GEMMs", "rest of the forward", "output head"} <= set(parts)
    assert all(ms >= 0 for ms in parts.values()) and parts["dot8 GEMMs"] > 0 and parts["output head"] > 0


def test_main_prints_an_eager_table_for_one_format(monkeypatch, tmp_path: Path, capsys) -> None:
    import dualserve.models.hub as hub

    monkeypatch.setattr(hub, "resolve_model", lambda name, cache: ("tiny", tmp_path / "tiny.gguf"))
    monkeypatch.setattr(bench_forward, "load_format", lambda fmt, path, name, cache: tiny())
    threads = torch.get_num_threads()
    out = tmp_path / "forward.json"
    try:
        code = bench_forward.main(["--formats", "int4", "--no-compile", "--tokens", "1", "2", "8", "--context", "8",
                                   "--repeats", "2", "--warmup", "1", "--threads", "1", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    text = capsys.readouterr().out
    assert "ms per forward" in text and "T=8 target" in text
    report = json.loads(out.read_text())
    assert [(r["format"], r["mode"]) for r in report["rows"]] == [("int4", "eager")]
    assert all(v > 0 for v in report["rows"][0]["ms"].values()) and report["threads"] == 1


ITEMS = [
    {"id": "fact-0", "kind": "fact", "check": "contains", "answer": "Paris"},
    {"id": "fact-1", "kind": "fact", "check": "contains", "answer": "Rome"},
    {"id": "math-0", "kind": "arithmetic", "check": "number", "answer": "12"},
    {"id": "math-1", "kind": "arithmetic", "check": "number", "answer": "7"},
]


def run(fmt: str, texts: list[str], outputs: list[list[int]]) -> FormatRun:
    r = FormatRun(fmt, seconds=1.0)
    for it, text, out in zip(ITEMS, texts, outputs):
        r.texts[it["id"]], r.outputs[it["id"]] = text, out
        r.tokens += len(out)
    return r


def test_format_summary_scores_against_fp32() -> None:
    fp32 = run("fp32", ["Paris.", "Rome!", "It is 12.", "It is 8."], [[1, 2], [3, 4], [5, 6, 7, 8], [9]])
    int4 = run("int4", ["Paris.", "Milan", "It is 13.", "It is 7."], [[1, 2], [3, 5], [5, 6, 0, 0], [9, 9]])
    s = eval_formats.summarize(ITEMS, [fp32, int4])
    assert (s["items"], s["scored"]) == (4, 3)  # math-1 is out: fp32 got it wrong, so int4's right answer is moot
    ref, q = s["rows"]
    assert ref["exact_match"] == 1.0 and ref["ratio_to_fp32"] == 1.0 and ref["identical_to_fp32"] == 1.0
    assert q["exact_match"] == round(1 / 3, 3) and q["ratio_to_fp32"] == round(1 / 3, 3) and not q["meets_target"]
    assert q["identical_to_fp32"] == 0.25
    assert q["prefix_agreement"] == round((1 + 0.5 + 0.5 + 1) / 4, 3)
    assert q["by_kind"] == {"arithmetic": 0.0, "fact": 0.5}
    assert q["tok_s"] == 10.0
    text = eval_formats.format_table(s)
    assert "4 prompts, 3 scored" in text and "int4" in text and "NO" in text


def test_fp32_is_always_the_reference() -> None:
    assert eval_formats.formats_in_order(["int4", "int8"]) == ["none", "int4", "int8"]
    assert eval_formats.formats_in_order(["fp32", "none", "bf16"]) == ["none", "bf16"]
    assert eval_formats.parse_args([]).formats == ["none", "int8", "int4", "w4a8"]
