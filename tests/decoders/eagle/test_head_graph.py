"""The EAGLE head's one graph (``head_graph.py``): catch-up and tree levels are the head's causal
forward, seen through the paged cache and the spare slots; its package drafts as the eager
module does, and greedy output stays the target's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dualserve.decoders.eagle.head_graph import HeadGraph
from dualserve.decoders.eagle.tree import TreeConfig
from dualserve.decoders.engine.attention.paged_attention import SeqAttention
from dualserve.decoders.engine.runner import ModelRunner
from dualserve.models import kernels
from dualserve.models.attention import DenseAttention
from dualserve.models.eagle import load_eagle_head
from test_eagle import V, assert_same_as_ar, make_engine, tiny_target
from tiny_eagle import write_tiny_eagle3

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4


def eagle3(tmp_path: Path, seed: int = 4):
    target = tiny_target(seed, 0.5)
    write_tiny_eagle3(tmp_path, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=48, vocab_size=V,
                      draft_vocab_size=40, dtype=torch.float32)
    return target, load_eagle_head(tmp_path, target)


@torch.inference_mode()
def test_catch_up_and_levels_are_the_heads_causal_forward(tmp_path: Path) -> None:
    """P pairs caught up, then a level of two nodes (one on the path, one decoy) and a level of their
    children: the path's nodes get the outputs of one causal forward over the whole chain."""
    target, head = eagle3(tmp_path)
    runner = ModelRunner(target, 16, BLOCK)
    c = head.config.layer
    kv = runner.head_kv(1, c.num_kv_heads, c.head_dim, spare=8)
    graph = HeadGraph(head, kv, runner.kv.num_blocks * BLOCK, 8)
    P = 6
    torch.manual_seed(0)
    ids = torch.randint(1, V, (P + 2,))
    hidden = torch.randn(P + 2, c.hidden_size)
    pos = torch.arange(P + 2)
    want = head(ids, hidden, pos, DenseAttention([P + 2]))
    table = list(range(4))
    slots = torch.arange(P)  # blocks 0.. in order
    rows, context, mask = graph.sequences([SeqAttention(0, P, table, "causal", None)])
    h, logp = graph(ids[:P], hidden[:P], pos[:P], rows, context, mask, slots)
    torch.testing.assert_close(h, want[:P])
    torch.testing.assert_close(logp, torch.log_softmax(head.logits(want[:P]), -1))
    spare = graph.spare_start + torch.arange(4)
    decoy = (ids[P] + 1) % V
    # level 1: the path's node and a decoy, both at position P, seeing the prefix and themselves
    rows, context, mask = graph.level(slots, spare[:0], torch.zeros(2, 0, dtype=torch.bool))
    h1, _ = graph(torch.stack([decoy, ids[P]]), hidden[P].expand(2, -1).contiguous(), torch.full((2,), P),
                  rows, context, mask, spare[:2])
    torch.testing.assert_close(h1[1], want[P])
    # level 2: the decoy's child and the path's child, each seeing its own parent only
    visible = torch.tensor([[True, False], [False, True]])
    rows, context, mask = graph.level(slots, spare[:2], visible)
    h2, _ = graph(torch.stack([ids[P + 1], ids[P + 1]]), hidden[P + 1].expand(2, -1).contiguous(),
                  torch.full((2,), P + 1), rows, context, mask, spare[2:4])
    torch.testing.assert_close(h2[1], want[P + 1])
    assert not torch.allclose(h2[0], want[P + 1])  # the decoy's child saw the decoy


def test_the_package_drafts_like_the_module_and_output_stays_ar(tmp_path: Path) -> None:
    """Built once (a small package: seconds), the head's graph matches the eager module, and eagle
    drafting through it answers as ``ar`` does."""
    if not kernels.available():  # no C++ compiler: no packages either
        pytest.skip("no C++ compiler")
    target, head = eagle3(tmp_path / "head")
    engine = make_engine(target, head, TreeConfig(depth=3, top_k=3, num_nodes=8))
    graph = engine.decoders[("m", "eagle")].sources["head"].graph
    graph.request(tmp_path / "aoti", None)
    assert graph.how == "built" and list((tmp_path / "aoti").glob("head-*.pt2"))
    assert_same_as_ar(engine)
