"""EAGLE-3 training-time test on the distillation shards: the loss falls, resume is exact, new shards join."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dualserve.decoders.training import eagle_train, loop
from dualserve.decoders.training.eagle_data import Cursor, ShardStream, target_batch
from dualserve.decoders.training.eagle_losses import eagle3_loss
from dualserve.models.checkpoint import LoadedModel
from dualserve.models.attention import DenseAttention
from dualserve.models.config import ModelConfig
from dualserve.models.eagle import load_eagle_head
from dualserve.models.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 64
STEPS = 60


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    # Eight layers: EAGLE-3 fuses three distinct ones (entering layers 2, n//2 and n-3).
    cfg = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=32, num_layers=8, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=48, tie_word_embeddings=True, eos_token_ids=(2,))
    torch.manual_seed(0)
    model = Transformer(cfg).eval().requires_grad_(False)
    return LoadedModel("tiny", Path("tiny"), cfg, model, None, 0.0)


def greedy(model: Transformer | None, prompt: list[int], n: int, r: random.Random) -> list[int]:
    """The target's own greedy answer (as the distillation job writes), or random tokens without a model."""
    if model is None:
        return [r.randrange(3, VOCAB) for _ in range(n)]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            final, _ = model(torch.tensor(ids), torch.arange(len(ids)), DenseAttention([len(ids)]))
            ids.append(int(model.logits(final[-1:]).argmax()))
    return ids[len(prompt):]


def write_shard(data: Path, records: int, start: int = 0, shard: int = 0, model: Transformer | None = None) -> None:
    data.mkdir(parents=True, exist_ok=True)
    r = random.Random(start)
    with (data / f"shard-{shard:05d}.jsonl").open("a") as f:
        for i in range(start, start + records):
            prompt = [r.randrange(3, VOCAB) for _ in range(r.randint(3, 6))]
            answer = greedy(model, prompt, r.randint(8, 14), r)
            f.write(json.dumps({"index": i, "turn": 1, "kind": "toy", "prompt_ids": prompt, "answer_ids": answer,
                                "finish": "stop", "temperature": 0.0, "settings": "x"}) + "\n")


def argv_for(tmp: Path, data: Path, steps: int, save_every: int = 5) -> list[str]:
    return ["--output", str(tmp / "head"), "--work-dir", str(tmp / "work"), "--data", str(data),
            "--steps", str(steps), "--batch-size", "4", "--block", "8", "--lr", "3e-3", "--warmup", "2",
            "--save-every", str(save_every), "--log-every", "100", "--draft-vocab", str(VOCAB),
            "--ttt-steps", "3", "--intermediate-size", "48"]


def args_for(tmp: Path, data: Path, steps: int, *extra: str, **kw) -> argparse.Namespace:
    return eagle_train.add_arguments(argparse.ArgumentParser()).parse_args(argv_for(tmp, data, steps, **kw) + list(extra))


def test_ttt_loss_falls_on_a_toy_set(target: LoadedModel, tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_shard(data, 16, model=target.model)
    args = args_for(tmp_path, data, steps=STEPS, save_every=STEPS)
    stream = ShardStream(data, 16, block=16)
    stream.refresh()
    batch = target_batch(target.model, stream.seqs, (1, 3, 4))
    d2t, t2d = torch.zeros(VOCAB, dtype=torch.long), torch.ones(VOCAB, dtype=torch.bool)
    rows = target.model.lm_head_weight.float()

    def loss_of(head) -> list[float]:
        with torch.no_grad():
            total, stats = eagle3_loss(head, batch, rows, 3, t2d=t2d)
        return [float(total)] + [hits / n for hits, n in stats]

    before = loss_of(eagle_train.new_head(target, args, d2t, t2d))
    eagle_train.run(target, args)
    after = loss_of(load_eagle_head(tmp_path / "head", target.model))
    assert after[0] < 0.2 * before[0]
    assert after[3] > before[3] + 0.1  # the third unrolled step, fed its own features, learned most


def test_resume_draws_the_same_batches_and_reaches_the_same_state(target: LoadedModel, tmp_path: Path,
                                                                 monkeypatch) -> None:
    data = tmp_path / "data"
    write_shard(data, 16)
    straight = tmp_path / "straight"
    eagle_train.run(target, args_for(straight, data, steps=10))  # 4 batches a pass: crosses two passes

    resumed = tmp_path / "resumed"
    save = loop.save_checkpoint

    def save_then_stop(work, head, opt, progress):
        save(work, head, opt, progress)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "save_checkpoint", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        eagle_train.run(target, args_for(resumed, data, steps=10))
    assert json.loads((resumed / "work" / "checkpoint.json").read_text())["step"] == 5
    monkeypatch.setattr(loop, "save_checkpoint", save)
    eagle_train.run(target, args_for(resumed, data, steps=10))

    a = load_file(str(straight / "work" / "checkpoint.safetensors"))
    b = load_file(str(resumed / "work" / "checkpoint.safetensors"))
    assert a.keys() == b.keys() and any(k.startswith("opt.") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_init_continues_from_a_finished_head(target: LoadedModel, tmp_path: Path) -> None:
    """``--init``: a new run starts from the given head (weights and draft vocabulary), not a new one."""
    data = tmp_path / "data"
    write_shard(data, 16, model=target.model)
    first = tmp_path / "first"
    eagle_train.run(target, args_for(first, data, steps=20))
    done = load_eagle_head(first / "head", target.model, dtype=torch.float32)
    stream = ShardStream(data, 16, block=16)
    stream.refresh()
    batch = target_batch(target.model, stream.seqs, done.config.aux_layers)
    rows = target.model.lm_head_weight.float()

    def loss_of(head) -> float:
        with torch.no_grad():
            return float(eagle3_loss(head, batch, rows, 3, t2d=head.t2d)[0])

    second = tmp_path / "second"
    args = args_for(second, data, 1, "--init", str(first / "head"), "--lr", "0")  # one step that changes nothing
    eagle_train.run(target, args)
    cont = load_eagle_head(second / "head", target.model, dtype=torch.float32)
    assert torch.equal(cont.d2t, done.d2t) and torch.equal(cont.t2d, done.t2d)
    assert loss_of(cont) == pytest.approx(loss_of(done), rel=1e-3)
    fresh = eagle_train.new_head(target, args_for(tmp_path / "fresh", data, 1), done.d2t, done.t2d)
    assert loss_of(cont) < 0.5 * loss_of(fresh)


def test_stream_takes_in_new_shards_at_the_next_pass(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_shard(data, 16)
    stream = ShardStream(data, 4, block=8, seed=1)
    cursor = stream.start(None)
    assert cursor == Cursor(0, 2, 0, 0)
    seen = []
    for _ in range(4):
        batch, cursor = stream.next(cursor)
        seen += [tuple(s.ids.tolist()) for s in batch]
        if len(seen) == 8:
            write_shard(data, 9, start=16, shard=1)  # written mid-pass: waits for the next pass
    assert len(set(seen)) == 16 and cursor == Cursor(1, 3, 0, 0)
    again = ShardStream(data, 4, block=8, seed=1)
    again.start(Cursor(0, 2, 0, 0))
    replay = []
    c = Cursor(0, 2, 0, 0)
    for _ in range(4):
        batch, c = again.next(c)
        replay += [tuple(s.ids.tolist()) for s in batch]
    assert replay == seen  # a pass is fixed by its cursor, whatever was appended since


def test_excluded_prompts_never_reach_training(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_shard(data, 16)
    everything = ShardStream(data, 4, block=8)
    everything.refresh()
    banned = everything.seqs[3].ids[:everything.seqs[3].prompt_len].tolist()
    kept = ShardStream(data, 4, block=8, exclude=lambda ids: ids == banned)
    kept.refresh()
    assert len(kept.seqs) == 15 and all(s.ids[:s.prompt_len].tolist() != banned for s in kept.seqs)


def test_several_data_directories_are_read_in_turn(tmp_path: Path) -> None:
    write_shard(tmp_path / "a", 8)
    write_shard(tmp_path / "b", 5, start=8)
    one = [ShardStream(tmp_path / d, 4, block=8) for d in "ab"]
    both = ShardStream([tmp_path / "a", tmp_path / "b"], 4, block=8)
    for s in (*one, both):
        s.refresh()
    assert [s.ids.tolist() for s in both.seqs] == [s.ids.tolist() for s in one[0].seqs + one[1].seqs]
    assert both.start(None) == Cursor(0, 1, 0, 0)  # 13 records: one whole block of 8


def test_ttt_loss_over_trained_rows_equals_the_masked_loss_over_every_row(target: LoadedModel,
                                                                          tmp_path: Path) -> None:
    """The loss computes draft logits for the trained rows only; it is the masked mean over all rows."""
    from dualserve.decoders.training.eagle_losses import UnrolledAttention, row_mask, shifted, soft_ce

    data = tmp_path / "data"
    write_shard(data, 8, model=target.model)
    stream = ShardStream(data, 8, block=8)
    stream.refresh()
    batch = target_batch(target.model, stream.seqs, (1, 3, 4))
    t2d = torch.rand(VOCAB, generator=torch.Generator().manual_seed(1)) < 0.8
    head = eagle_train.new_head(target, args_for(tmp_path, data, steps=1), torch.zeros(VOCAB, dtype=torch.long), t2d)
    rows = target.model.lm_head_weight.float()
    with torch.no_grad():
        total, stats = eagle3_loss(head, batch, rows, 3, t2d=t2d)
        b, t = batch.ids.shape
        target_logits = batch.final.float() @ rows.T
        hidden, attn, want, want_stats = head.fc(batch.aux), UnrolledAttention(b, t), 0.0, []
        for k in range(3):
            h = head(shifted(batch.ids, 1 + k).reshape(-1), hidden.reshape(b * t, -1),
                     (torch.arange(t) + k).repeat(b), attn).view(b, t, -1)
            mask = row_mask(batch, k) & t2d[shifted(batch.ids, 2 + k)]
            loss, hits = soft_ce(head.logits(h), shifted(target_logits, 1 + k), mask)
            want, hidden = want + 0.8 ** k * loss, h
            want_stats.append((hits, int(mask.sum())))
    assert stats == want_stats and all(n > 0 for _, n in stats)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-6)


def test_a_feature_store_fills_once_and_trains_as_fresh_features(target: LoadedModel, tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_shard(data, 16)
    store = tmp_path / "features"
    fresh, filling, reading = (tmp_path / name for name in ("fresh", "filling", "reading"))
    eagle_train.run(target, args_for(fresh, data, steps=10))  # two passes over 16 records
    with_store = ["--feature-store", str(store)]
    eagle_train.run(target, args_for(filling, data, 10, *with_store))
    files = list(store.rglob("*.safetensors"))
    assert len(files) == 16  # one per sequence, written once although each was read in two passes
    stamps = {f: f.stat().st_mtime_ns for f in files}
    eagle_train.run(target, args_for(reading, data, 10, *with_store))
    assert {f: f.stat().st_mtime_ns for f in store.rglob("*.safetensors")} == stamps  # read, never rewritten

    a, b, c = (load_file(str(d / "work" / "checkpoint.safetensors")) for d in (fresh, filling, reading))
    for k in a:
        assert torch.equal(b[k], c[k]), k  # features stored then read train exactly as when computed
        # A float target's GEMM may round a row differently in a batch of another size; the
        # quantized formats' kernels do not.
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def test_init_grows_the_draft_vocabulary_keeping_the_trained_rows(target: LoadedModel, tmp_path: Path) -> None:
    """``--init`` with a larger ``--draft-vocab``: the head's own ids keep their trained output rows, the most
    frequent answer tokens it lacks join with the target's rows, and training goes on over the grown head."""
    data = tmp_path / "data"
    write_shard(data, 16, model=target.model)
    first = tmp_path / "first"
    argv = argv_for(first, data, 10)
    argv[argv.index("--draft-vocab") + 1] = "16"
    eagle_train.run(target, eagle_train.add_arguments(argparse.ArgumentParser()).parse_args(argv))
    done = load_eagle_head(first / "head", target.model, dtype=torch.float32)
    own = torch.arange(16) + done.d2t

    stream = ShardStream(data, 16, block=16)
    stream.refresh()
    seqs = [{"ids": s.ids, "prompt_len": torch.tensor(s.prompt_len)} for s in stream.seqs]
    grown = eagle_train.grow_draft_vocab(target, done, seqs, 24)
    used = torch.arange(24) + grown.d2t
    assert torch.equal(used, used.sort().values) and set(own.tolist()) <= set(used.tolist())
    assert int(grown.t2d.sum()) == 24 and bool(grown.t2d[used].all())
    counts = torch.bincount(torch.cat([s["ids"][int(s["prompt_len"]):] for s in seqs]), minlength=VOCAB)
    joined = used[~torch.isin(used, own)]
    left = torch.tensor([t for t in range(VOCAB) if t not in used.tolist()])
    assert int(counts[joined].min()) >= int(counts[left].max())  # the most frequent missing tokens joined
    carry = torch.linalg.lstsq(target.model.lm_head_weight[own].float(), done.lm_head.weight.float()).solution
    for i, t in enumerate(used.tolist()):
        row = grown.lm_head.weight[i]
        if t in own.tolist():
            assert torch.equal(row, done.lm_head.weight[own.tolist().index(t)])
        else:  # the target's row, carried into the head's trained output space
            torch.testing.assert_close(row, target.model.lm_head_weight[t].float() @ carry)
    # Everything but the output rows is the trained head's: the same logits on its own ids.
    after = grown.state_dict()
    for name, p in done.state_dict().items():
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(after[name], p), name
    h = torch.randn(5, 32)
    with torch.no_grad():
        assert torch.equal(grown.logits(h)[:, torch.isin(used, own)], done.logits(h))
    assert eagle_train.grow_draft_vocab(target, done, seqs, 16) is done

    second = tmp_path / "second"
    argv = argv_for(second, data, 2) + ["--init", str(first / "head")]
    argv[argv.index("--draft-vocab") + 1] = "24"
    eagle_train.run(target, eagle_train.add_arguments(argparse.ArgumentParser()).parse_args(argv))
    cont = load_eagle_head(second / "head", target.model, dtype=torch.float32)
    assert cont.config.draft_vocab_size == 24 and torch.equal(cont.d2t, grown.d2t)


def test_depth_accuracy_counts_the_head_top_draft_against_the_target_greedy_token(target: LoadedModel,
                                                                                  tmp_path: Path) -> None:
    """eagle_eval's depth-0 rate equals a plain loop: the head on each prefix, its top draft against the next
    greedy token; the share outside the draft vocabulary is counted among the misses."""
    from dualserve.decoders.training.eagle_eval import depth_accuracy

    data = tmp_path / "data"
    write_shard(data, 16, model=target.model)  # the target's own greedy answers
    eagle_train.run(target, args_for(tmp_path, data, STEPS, "--draft-vocab", "40", save_every=STEPS))
    head = load_eagle_head(tmp_path / "head", target.model)  # trained on them, 40 of the 64 ids
    stream = ShardStream(data, 8, block=8)
    stream.refresh()
    t2d = head.t2d
    t2d[stream.seqs[0].ids[-1]] = False  # counted outside the draft vocabulary from here on
    acc = depth_accuracy(head, target.model, stream.seqs, depths=2, batch_size=4)
    hits = rows = outside = 0
    with torch.no_grad():
        for s in stream.seqs:
            ids = s.ids
            _, aux = target.model(ids, torch.arange(len(ids)), DenseAttention([len(ids)]), aux_layers=head.config.aux_layers)
            feats = head.fc(torch.cat(aux, -1))
            for i in range(s.prompt_len - 2, len(ids) - 2):  # row i predicts token i + 2
                h = head(ids[1:i + 2], feats[:i + 1], torch.arange(i + 1), DenseAttention([i + 1]))
                draft = int(head.to_target(head.logits(h[-1:]).argmax(-1)))
                hits += draft == int(ids[i + 2])
                outside += not bool(t2d[ids[i + 2]])
                rows += 1
    assert acc[0] == (hits, rows, outside) and 0 < hits and 0 < outside < rows
    assert acc[1][1] == rows  # a level deeper, every answer token is predicted from a row one earlier
