"""DFlash drafter training on the tiny target and toy shards: the objective, its attention mask, the trainer."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dualserve.decoders.training import dflash_train, loop
from dualserve.decoders.training.dflash_losses import block_hidden, dflash_loss, draft_index, sample_anchors
from dualserve.decoders.training.eagle_data import ShardStream, target_batch
from dualserve.decoders.training.eagle_losses import Batch
from dualserve.decoders.training.eagle_train import draft_vocab
from dualserve.models.checkpoint import LoadedModel
from dualserve.models.dflash import DFlashDrafter, load_dflash
from dualserve.models.errors import InputError
from dualserve.models.transformer import apply_rope
from test_eagle_stream import VOCAB, target, write_shard  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK = 4


def args_for(tmp: Path, data: Path, steps: int = 6, save_every: int = 3, draft: int = VOCAB) -> argparse.Namespace:
    argv = ["--output", str(tmp / "drafter"), "--work-dir", str(tmp / "work"), "--data", str(data),
            "--steps", str(steps), "--batch-size", "4", "--block", "8", "--lr", "3e-3", "--warmup", "2",
            "--save-every", str(save_every), "--log-every", "100", "--draft-vocab", str(draft),
            "--block-size", str(BLOCK), "--anchors", "4"]
    return dflash_train.add_arguments(argparse.ArgumentParser()).parse_args(argv)


@pytest.fixture(scope="module")
def data(target: LoadedModel, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dflash") / "data"
    write_shard(path, 16, model=target.model)
    return path


def toy_batch(target: LoadedModel, data: Path, drafter: DFlashDrafter, count: int = 8) -> Batch:
    stream = ShardStream(data, count, block=16)
    stream.refresh()
    return target_batch(target.model, stream.seqs[:count], drafter.config.target_layer_ids)


def new(target: LoadedModel, data: Path, draft: int = VOCAB) -> tuple[DFlashDrafter, torch.Tensor | None]:
    args = args_for(data.parent, data, draft=draft)
    stream = ShardStream(data, 4, block=8)
    stream.refresh()
    seqs = [{"ids": s.ids, "prompt_len": torch.tensor(s.prompt_len)} for s in stream.seqs]
    d2t = draft_vocab(seqs, VOCAB, draft)[0]
    drafter = dflash_train.new_drafter(target, args, d2t).requires_grad_(True)
    return drafter, None if draft == VOCAB else draft_index(d2t, VOCAB)


@pytest.mark.parametrize("draft", [VOCAB, 24])
def test_loss_falls_on_a_fixed_batch(target: LoadedModel, data: Path, draft: int) -> None:
    drafter, t2d_index = new(target, data, draft)
    batch = toy_batch(target, data, drafter)
    anchors = sample_anchors(batch, 4, torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss, stats = dflash_loss(drafter, batch, 4, None, 2.0, t2d_index, anchors=anchors)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert stats.blocks == int((anchors >= 0).sum()) and len(stats.per_offset) == BLOCK - 1
    assert all(hits <= rows for hits, rows in stats.per_offset)
    assert 0 <= stats.acceptance <= BLOCK - 1
    assert losses[-1] < 0.5 * losses[0]


def test_anchors_are_answer_tokens_with_a_successor(target: LoadedModel, data: Path) -> None:
    drafter, _ = new(target, data)
    batch = toy_batch(target, data, drafter)
    anchors = sample_anchors(batch, 50, torch.Generator().manual_seed(1))
    for i in range(len(anchors)):
        mine = anchors[i][anchors[i] >= 0]
        n, first = int(batch.lengths[i]), int(batch.valid[i].nonzero()[0])
        assert mine.tolist() == list(range(first, n - 1))  # 50 > the answer: all of them, ascending


def test_a_block_sees_the_context_before_its_anchor_and_its_own_block_only(target: LoadedModel, data: Path) -> None:
    drafter, _ = new(target, data)
    batch = toy_batch(target, data, drafter, count=4)
    anchors = sample_anchors(batch, 3, torch.Generator().manual_seed(2))
    with torch.no_grad():
        base = block_hidden(drafter, batch, anchors)
        for j in (int(anchors[0, 1]), int(anchors[0, 1]) - 1):  # at an anchor, then just before it
            aux = batch.aux.clone()
            aux[0, j] += 3.0
            out = block_hidden(drafter, Batch(batch.ids, batch.final, aux, batch.valid, batch.lengths), anchors)
            changed = (out - base).abs().amax(dim=(-1, -2)) > 1e-5  # per block
            expect = torch.zeros_like(changed)
            expect[0] = anchors[0] > j
            assert torch.equal(changed, expect), j
        ids = batch.ids.clone()  # another anchor token: its block changes, no other one
        ids[1, int(anchors[1, 0])] = (ids[1, int(anchors[1, 0])] + 1) % VOCAB
        out = block_hidden(drafter, Batch(ids, batch.final, batch.aux, batch.valid, batch.lengths), anchors)
    changed = (out - base).abs().amax(dim=(-1, -2)) > 1e-5
    expect = torch.zeros_like(changed)
    expect[1, 0] = True
    assert torch.equal(changed, expect)


def reference_loss(drafter: DFlashDrafter, batch: Batch, a: int, decay: float) -> torch.Tensor:
    """One block of sequence 0, written out: explicit context keys, a dense softmax, the weighted CE."""
    cfg, size = drafter.config, drafter.config.block_size
    heads, kv_heads, d = cfg.layer.num_heads, cfg.layer.num_kv_heads, cfg.layer.head_dim
    c = drafter.hidden_norm(batch.aux[0, :a] @ drafter.fc.weight.T)  # (a, hidden)
    x = drafter.target[0].embed_tokens(torch.tensor([int(batch.ids[0, a])] + [cfg.mask_token_id] * (size - 1)))
    cos_c, sin_c = drafter.rotary(torch.arange(a), x.dtype)
    cos_b, sin_b = drafter.rotary(torch.arange(a, a + size), x.dtype)
    for layer in drafter.layers:
        at = layer.self_attn
        wq, wk, wv = at.qkv_proj.weight.split(at.split)
        y = layer.input_layernorm(x)
        q = apply_rope(at.q_norm((y @ wq.T).view(size, heads, d)), cos_b, sin_b)
        k = torch.cat([apply_rope(at.k_norm((c @ wk.T).view(a, kv_heads, d)), cos_c, sin_c),
                       apply_rope(at.k_norm((y @ wk.T).view(size, kv_heads, d)), cos_b, sin_b)])
        v = torch.cat([c @ wv.T, y @ wv.T]).view(a + size, kv_heads, d)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        w = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5, dim=-1)
        x = x + at.o_proj(torch.einsum("hqk,khd->qhd", w, v).reshape(size, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    logits = drafter.norm(x) @ drafter.target[0].lm_head_weight.T
    n = int(batch.lengths[0])
    rows = [k for k in range(1, size) if a + k < n]
    ce = F.cross_entropy(logits[rows], batch.ids[0, [a + k for k in rows]], reduction="none")
    weight = torch.tensor([float(torch.exp(torch.tensor(-(k - 1) / decay))) for k in rows])
    return (ce * weight).sum() / weight.sum()


def test_the_loss_equals_a_dense_reference_for_one_block(target: LoadedModel, data: Path) -> None:
    drafter, _ = new(target, data)
    batch = toy_batch(target, data, drafter, count=1)
    n = int(batch.lengths[0])
    with torch.no_grad():
        for a in (int(batch.valid[0].nonzero()[0]), n - 3, n - 2):  # first answer token; the sequence's end
            loss, stats = dflash_loss(drafter, batch, 1, None, 1.5, anchors=torch.tensor([[a]]))
            assert torch.allclose(loss, reference_loss(drafter, batch, a, 1.5), atol=1e-5), a
            assert [rows for _, rows in stats.per_offset] == [int(a + k < n) for k in range(1, BLOCK)]


def test_train_dflash_writes_a_loadable_drafter_and_resumes_exactly(target: LoadedModel, data: Path,
                                                                     tmp_path: Path, monkeypatch) -> None:
    straight = tmp_path / "straight"
    dflash_train.run(target, args_for(straight, data))  # 4 batches a pass: six steps cross into the second
    drafter = load_dflash(straight / "drafter", target.model)
    assert drafter.config.block_size == BLOCK and drafter.config.target_layer_ids == (1, 3, 4)
    assert drafter.config.mask_token_id == VOCAB - 1  # no tokenizer: the highest id that is not EOS
    cfg = json.loads((straight / "drafter" / "config.json").read_text())
    assert cfg["dflash_config"]["block_size"] == BLOCK

    resumed = tmp_path / "resumed"
    save = loop.save_checkpoint

    def save_then_stop(work, head, opt, progress):
        save(work, head, opt, progress)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "save_checkpoint", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        dflash_train.run(target, args_for(resumed, data))
    progress = json.loads((resumed / "work" / "checkpoint.json").read_text())
    assert progress == {"step": 3, "cursor": {"pass_index": 0, "blocks": 2, "block": 1, "batch": 1}}
    monkeypatch.setattr(loop, "save_checkpoint", save)
    dflash_train.run(target, args_for(resumed, data))

    a = load_file(str(straight / "work" / "checkpoint.safetensors"))
    b = load_file(str(resumed / "work" / "checkpoint.safetensors"))
    assert a.keys() == b.keys() and any(k.startswith("opt.") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert json.loads((resumed / "work" / "checkpoint.json").read_text()) == \
        json.loads((straight / "work" / "checkpoint.json").read_text())


def test_draft_vocab_index_maps_target_ids() -> None:
    d2t = torch.tensor([3, 3, 5])  # draft ids 0, 1, 2 -> target ids 3, 4, 7
    index = draft_index(d2t, 10)
    assert index.tolist() == [-1, -1, -1, 0, 1, -1, -1, 2, -1, -1]


def test_bf16_autocast_step_follows_fp32(target: LoadedModel, data: Path) -> None:
    """``--bf16`` autocast (any CPU runs it: AMX and AVX512-BF16 natively, AVX2 emulated) gives the
    fp32 loss within bf16's precision and finite gradients for every parameter."""
    drafter, _ = new(target, data)
    batch = toy_batch(target, data, drafter)
    anchors = sample_anchors(batch, 4, torch.Generator().manual_seed(0))
    fp32, _ = dflash_loss(drafter, batch, 4, None, 2.0, None, anchors=anchors)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16, _ = dflash_loss(drafter, batch, 4, None, 2.0, None, anchors=anchors)
    bf16.backward()
    assert abs(float(bf16) - float(fp32)) < 0.05 * float(fp32)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in drafter.parameters() if p.requires_grad)


def test_a_data_directory_that_is_missing_or_short_is_one_line(target: LoadedModel, data: Path,
                                                                tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such directory"):
        dflash_train.run(target, args_for(tmp_path, tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="0 sequences, fewer than one block"):
        dflash_train.run(target, args_for(tmp_path, empty))
