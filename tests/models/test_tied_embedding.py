"""A tied model's embedding read from its dot8 head (``models/tied_embedding.py``): one table in
memory, rows that are ``head.dequantize()``'s bits (today's ``QuantEmbedding`` bits for the int8
kinds: the same logits), a lookup that compiles and exports reading the head's own buffers, and
tensor-parallel shards that read the head's shard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dualserve.models import checkpoint, kernels
from dualserve.models.attention import DenseAttention
from dualserve.models.loader import LoadedModel, load_model
from dualserve.models.portable import GGUF_PACKED, gguf_blocks
from dualserve.models.quant import Dot8Linear, QuantEmbedding
from dualserve.models.tied_embedding import HeadRowsEmbedding, head_rows

from test_dot8_gguf import random_rows
from tiny_gguf import trimmed

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the dot8 kernel")

TINY = dict(arch="llama", hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512)  # K-quant rows: 256s
PROMPT = [1, 17, 300, 5, 42, 511, 7, 8]


@pytest.fixture(scope="module")
def tied_files(default_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny tied Llama GGUFs (Q4_K layers), by the embedding's block type."""
    from dualserve.clients import write_gguf as wg

    out, fields = tmp_path_factory.mktemp("tied"), trimmed(wg.tokenizer_fields(default_gguf))
    shape = wg.Shape(**TINY, rope_theta=10000.0, rms_eps=1e-6, context_length=256, tied=True)
    return {kind: wg.write_gguf(out / f"tied-{kind}.gguf", shape, fields, matrix_type="Q4_K",
                                embedding_type=kind, seed=3).path for kind in ("Q8_0", "Q6_K", "Q4_K")}


def logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    hidden, _ = loaded.model(torch.tensor(ids), torch.arange(len(ids)), DenseAttention([len(ids)]))
    return loaded.model.logits(hidden)


def load(path: Path, cache: Path, monkeypatch, from_head: bool) -> LoadedModel:
    monkeypatch.setattr(checkpoint, "TIED_FROM_HEAD", from_head)
    return load_model(path, quantization="w4a16", cache_dir=cache)


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "Q4_K"])
def test_a_tied_gguf_model_holds_one_table(kind, tied_files, tmp_path, monkeypatch) -> None:
    old = load(tied_files[kind], tmp_path, monkeypatch, from_head=False)
    new = load(tied_files[kind], tmp_path, monkeypatch, from_head=True)
    emb, head = new.model.embed_tokens, new.model.lm_head
    assert isinstance(old.model.embed_tokens, QuantEmbedding)
    assert isinstance(emb, HeadRowsEmbedding) and isinstance(head, Dot8Linear) and emb.head is head
    # no table of its own: no tensors, no state, and the model's bytes drop by the old table's
    assert not list(emb.parameters()) and not list(emb.buffers()) and not emb.state_dict()
    assert not any(k.startswith("embed_tokens.") for k in new.model.state_dict())

    def held(m: nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in m.buffers()}.values())
    table = held(old.model.embed_tokens)
    assert table >= new.config.vocab_size * new.config.hidden_size
    assert held(new.model) == held(old.model) - table

    ids = torch.tensor(PROMPT)
    assert torch.equal(emb(ids), head.dequantize()[ids])
    if kind != "Q4_K":  # int8 groups: today's lookup was exact, so the same bits throughout
        assert torch.equal(emb(ids), old.model.embed_tokens(ids))
        assert torch.equal(logits(new, PROMPT), logits(old, PROMPT))
    else:  # a minimum: today's table was quantized again; the rows are now the file's values
        torch.testing.assert_close(logits(new, PROMPT), logits(old, PROMPT), rtol=0.05, atol=0.05)
    assert torch.equal(emb.weight, head.dequantize()) and torch.equal(new.model.lm_head_weight, emb.weight)


def test_untied_and_non_dot8_heads_keep_their_own_table(tied_files, tmp_path) -> None:
    int8 = load_model(tied_files["Q8_0"], quantization="int8", cache_dir=tmp_path)
    assert isinstance(int8.model.embed_tokens, QuantEmbedding)


class _HeadAndEmbedding(nn.Module):
    """As in the model: the head registered in the tree, the embedding borrowing it."""

    def __init__(self, head: Dot8Linear):
        super().__init__()
        self.lm_head = head
        self.embed_tokens = HeadRowsEmbedding(head)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids) * 2


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "Q4_K", "IQ4_XS"])
def test_the_lookup_compiles_and_exports_with_the_same_bits(kind) -> None:
    head = Dot8Linear.from_portable(gguf_blocks(random_rows(kind, 70, 512, seed=4), kind), digits=2)
    model = _HeadAndEmbedding(head).eval()
    ids = torch.tensor([69, 0, 16, 15, 33, 33])
    want = model(ids)
    assert torch.equal(want, head.dequantize()[ids] * 2)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(ids), want) and torch.equal(compiled(ids[:2]), want[:2])
    program = torch.export.export(model, (ids,), dynamic_shapes=({0: torch.export.Dim.AUTO},), strict=False)
    # the graph reads the head's buffers as inputs: no copy of the table is baked in as a constant
    assert not program.constants
    assert {"lm_head.packed", "lm_head.d"} <= set(program.graph_signature.buffers)
    assert torch.equal(program.module()(ids), want) and torch.equal(program.module()(ids[:3]), want[:3])


@pytest.mark.parametrize("kind", GGUF_PACKED)
def test_rows_are_the_heads_rows_for_every_packed_type(kind) -> None:
    head = Dot8Linear.from_portable(gguf_blocks(random_rows(kind, 40, 512, seed=5), kind))
    w = head.dequantize()
    ids = torch.tensor([[39, 3, 17], [3, 16, 15]])
    assert torch.equal(head_rows(head, ids), w[ids])
    assert head_rows(head, torch.tensor([], dtype=torch.long)).shape == (0, 512)


def test_tensor_parallel_ranks_read_their_rows_of_the_head_shard(monkeypatch) -> None:
    """Each rank's embedding reads its vocabulary rows from the head's shard (one module for both);
    the ranks' lookups add up to the whole lookup (the all-reduce, done here by hand)."""
    from dualserve.models import sharding_core
    from dualserve.models.config import ModelConfig
    from dualserve.models.sharding_core import CoreSharder, Shard
    from dualserve.models.transformer import Transformer

    monkeypatch.setattr(sharding_core.dist, "all_reduce", lambda x, group=None: x)
    vocab, hidden = 100, 256
    table = gguf_blocks(random_rows("Q8_0", vocab, hidden, seed=6), "Q8_0")
    config = ModelConfig(family="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=512,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64, tie_word_embeddings=True)
    ids = torch.tensor([0, 49, 50, 99, 7, 63])
    parts = []
    for rank in range(2):
        with torch.device("meta"):
            model = Transformer(config)
        model.layers = nn.ModuleList()
        model.lm_head = Dot8Linear.from_portable(table, digits=2)
        model.embed_tokens = HeadRowsEmbedding(model.lm_head)
        whole = model.embed_tokens(ids)
        sharder = CoreSharder(Shard(rank, 2))
        model.embed_tokens = sharder.embedding(model.embed_tokens, vocab)
        model.lm_head = sharder.head(model)
        local = model.embed_tokens.local
        assert isinstance(local, HeadRowsEmbedding) and local.head is model.lm_head.local
        assert local.num_embeddings == 50
        parts.append(model.embed_tokens(ids))
    assert torch.equal(parts[0] + parts[1], whole)
