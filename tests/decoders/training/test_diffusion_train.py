"""``dualserve train-diffusion``: the two-stream layout, complementary masks, checkpoints, resume, output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dualserve.decoders.training import diffusion_train, loop
from dualserve.decoders.training.distil import answered_records
from dualserve.decoders.training.diffusion_eval import ORACLE, denoise_eval, fill_block
from dualserve.decoders.training.diffusion_twin import (LoRALinear, Objective, add_lora, make_example, pack,
                                                        parent_logprobs, stream_mask, twin_loss)
from dualserve.models.adapter import ADAPTER_FILE, lora_names
from dualserve.models.loader import load_twin
from dualserve.models.attention import DenseAttention
from dualserve.models.config import ModelConfig
from dualserve.models.loader import load_model
from dualserve.models.transformer import Transformer
from tiny_twin import write_tiny_llama

B, MASK = 4, 4


def tiny_model(seed: int = 0) -> Transformer:
    cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=48, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Transformer(cfg).eval()


def example(prompt_len: int = 6, answer_len: int = 13):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 64, (prompt_len + answer_len,), generator=gen).tolist()
    return make_example(ids[:prompt_len], ids[prompt_len:], True, B, pad_id=2)


def test_example_padding_and_trimming() -> None:
    done = make_example([9] * 6, [7] * 5, True, B, pad_id=2)
    assert len(done.ids) == 12 and done.ids[-1] == 2 and done.answer_end == 11
    cut = make_example([9] * 6, [7] * 5, False, B, pad_id=2)
    assert cut.ids == [9] * 6 + [7] * 2
    assert make_example([9] * 6, [7], False, B, pad_id=2) is None


def test_stream_mask() -> None:
    m = stream_mask(12, 4, B)  # clean 0..11, views over positions 4..11
    assert m.shape == (28, 28)
    assert m[3, 0] and m[1, 3] and not m[3, 4]           # clean: bidirectional in a block, causal across
    a = lambda pos: 12 + pos - 4                          # row of position ``pos`` in view a
    b = lambda pos: 20 + pos - 4
    assert m[a(9), 7] and not m[a(9), 8]                  # noisy sees clean blocks before its own only
    assert m[a(9), a(11)] and not m[a(9), a(7)]           # and its own block, both directions
    assert not m[a(9), b(9)] and not m[b(9), a(9)]        # views never see each other
    assert not m[:12, 12:].any()                          # clean never sees noisy


def test_complementary_masks_and_shifted_sources() -> None:
    ex = example()
    p = pack(ex, B, MASK, torch.Generator().manual_seed(0))
    length, n0 = len(ex.ids), ex.prompt_len // B * B
    ln = length - n0
    view_a, view_b = p.input_ids[length:length + ln], p.input_ids[length + ln:]
    masked_a, masked_b = view_a == MASK, view_b == MASK
    answer = torch.arange(n0, length) >= ex.prompt_len
    assert torch.equal(masked_a ^ masked_b, answer) and not (masked_a & masked_b).any()
    assert len(p.targets) == length - ex.prompt_len        # every answer token is a target exactly once
    for row, target in zip(p.source_rows.tolist(), p.targets.tolist()):
        j = int(p.positions[row]) + 1                      # row j-1 predicts token j
        assert ex.ids[j] == target and j >= ex.prompt_len
        assert (row < length) == (j % B == 0)              # a block's first token comes from clean context


def test_each_view_sees_exactly_clean_prefix_plus_one_noisy_block() -> None:
    model, ex = tiny_model(), example()
    p = pack(ex, B, MASK, torch.Generator().manual_seed(1))
    length, n0 = len(ex.ids), ex.prompt_len // B * B
    ln = length - n0
    with torch.inference_mode():
        packed, _ = model(p.input_ids, p.positions, DenseAttention([p.length], masks=[p.attn_mask]))
        for v in range(2):
            view = p.input_ids[length + v * ln:length + (v + 1) * ln].tolist()
            for start in range(n0, length, B):
                seq = torch.tensor(ex.ids[:start] + view[start - n0:start - n0 + B])
                alone, _ = model(seq, torch.arange(len(seq)), DenseAttention([len(seq)], "block_causal", B))
                rows = slice(length + v * ln + start - n0, length + v * ln + start - n0 + B)
                torch.testing.assert_close(packed[rows], alone[start:], rtol=0, atol=1e-5)
        clean, _ = model(torch.tensor(ex.ids), torch.arange(length), DenseAttention([length], "block_causal", B))
        torch.testing.assert_close(packed[:length], clean, rtol=0, atol=1e-5)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_lora_forward_under_autocast(bf16: bool) -> None:
    """The LoRA GEMM runs with bf16 autocast on (CUDA, AMX / AVX512-BF16 CPUs) and off, on any host."""
    torch.manual_seed(0)
    base = torch.nn.Linear(32, 64, bias=False)
    lora = LoRALinear(base, 4, 4.0, torch.Generator().manual_seed(0))
    torch.nn.init.normal_(lora.lora_B)
    x = torch.randn(3, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y = lora(x)
        y.float().sum().backward()
    assert y.dtype == (torch.bfloat16 if bf16 else torch.float32)
    want = base(x) + x @ lora.lora_A.t() @ lora.lora_B.t() * lora.scale
    torch.testing.assert_close(y.float(), want.detach(), rtol=0.05 if bf16 else 1e-5, atol=0.05 if bf16 else 1e-5)
    assert lora.lora_A.grad is not None and lora.lora_B.grad is not None


def test_lora_starts_as_the_base_and_trains() -> None:
    model = tiny_model()
    ex = example()
    mask_row = torch.nn.Parameter(model.embed_tokens.weight.mean(0).clone())
    batch = [pack(ex, B, MASK, torch.Generator().manual_seed(0))]
    with torch.no_grad():
        before, _, _ = twin_loss(model, mask_row, MASK, batch)
    loras = add_lora(model, rank=4, alpha=8, seed=0)
    assert [f"layers.{i}.{t}" for i in range(2) for t in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                          "mlp.gate_up_proj", "mlp.down_proj")] == list(loras)
    loss, n, _ = twin_loss(model, mask_row, MASK, batch)
    # The same loss, to the float rounding of another GEMM path (with gradients on, the host's
    # BLAS may sum in another order: one ulp of 17.9 on an AVX-512 AMD EPYC)
    torch.testing.assert_close(loss.detach(), before, rtol=1e-6, atol=1e-6)
    loss.backward()
    assert all(m.lora_B.grad is not None and m.lora_B.grad.abs().sum() > 0 for m in loras.values())
    assert mask_row.grad.abs().sum() > 0 and n == len(batch[0].targets)


def test_parent_soft_targets_are_the_causal_forward_at_j_minus_one() -> None:
    parent, ex = tiny_model(seed=1), example()
    batch = [pack(ex, B, MASK, torch.Generator().manual_seed(s)) for s in (0, 1)]
    with torch.no_grad():
        got = parent_logprobs(parent, batch)
        want = []
        for p in batch:
            for j in p.target_pos.tolist():
                hidden, _ = parent(torch.tensor(ex.ids[:j]), torch.arange(j), DenseAttention([j], "causal"))
                want.append(torch.log_softmax(parent.logits(hidden[-1:]), -1)[0])
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-5, atol=1e-5)


def test_objective_terms() -> None:
    """Soft targets at weight 1 are the cross-entropy to the parent's distribution; certainty forcing
    adds the tempered entropy of the correctly predicted targets only; both train the adapters."""
    model, parent, ex = tiny_model(), tiny_model(seed=1), example(answer_len=40)
    mask_row = torch.nn.Parameter(model.embed_tokens.weight.mean(0).clone())
    batch = [pack(ex, B, MASK, torch.Generator().manual_seed(0))]
    emb = model.embed_tokens.weight.detach().clone()
    emb[MASK] = mask_row.detach()
    with torch.no_grad():
        ids = batch[0].input_ids
        hidden, _ = model(None, batch[0].positions, DenseAttention([batch[0].length], masks=[batch[0].attn_mask]),
                          inputs_embeds=emb[ids])
        logits = hidden[batch[0].source_rows] @ emb.t()
        batch[0].targets[::2] = logits.argmax(-1)[::2]  # a random model predicts some targets right
        hard = torch.nn.functional.cross_entropy(logits, batch[0].targets)
        soft = -(parent_logprobs(parent, batch).exp() * torch.log_softmax(logits, -1)).sum(-1).mean()
        right = logits.argmax(-1) == batch[0].targets
        logp = torch.log_softmax(logits[right] / 0.5, -1)
        entropy = -(logp.exp() * logp).sum(-1).mean()
    assert 0 < int(right.sum()) < len(right)
    with torch.no_grad():
        plain, n, correct = twin_loss(model, mask_row, MASK, batch)
        distilled, _, _ = twin_loss(model, mask_row, MASK, batch, Objective(distil=1.0), parent=parent)
        half, _, _ = twin_loss(model, mask_row, MASK, batch, Objective(distil=0.5), parent=parent)
        certain, _, _ = twin_loss(model, mask_row, MASK, batch, Objective(certainty=2.0))
    assert correct == int(right.sum()) and n == len(right)
    torch.testing.assert_close(plain, hard, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(distilled, soft, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(half, (hard + soft) / 2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(certain, hard + 2.0 * entropy, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        twin_loss(model, mask_row, MASK, batch, Objective(distil=0.5))
    loras = add_lora(model, rank=4, alpha=8, seed=0)
    loss, _, _ = twin_loss(model, mask_row, MASK, batch, Objective(distil=0.5, certainty=2.0), parent=parent)
    loss.backward()
    assert all(m.lora_B.grad.abs().sum() > 0 for m in loras.values()) and mask_row.grad.abs().sum() > 0
    assert all(p.grad is None for p in parent.parameters()), "the parent is a fixed teacher"


def reference_fill(model: Transformer, prefix: list[int], length: int, tau: float | None) -> list[int]:
    """The same rules with no cache: every forward runs prefix + canvas under block-causal attention."""
    seq, start = torch.tensor(prefix + [MASK] * length), len(prefix)
    masked = torch.ones(length, dtype=torch.bool)
    while masked.any():
        hidden, _ = model(seq, torch.arange(len(seq)), DenseAttention([len(seq)], "block_causal", B))
        probs = torch.softmax(model.logits(hidden[start - 1:-1]), -1)
        probs[:, MASK] = 0
        conf, tok = probs.max(-1)
        conf = torch.where(masked, conf, torch.full_like(conf, -1.0))
        commit = masked.clone() if tau is None else masked & (conf >= tau)
        commit[int(conf.argmax())] = True
        seq[start:][commit] = tok[commit]
        masked &= ~commit
    return seq[start:].tolist()


@pytest.mark.parametrize("prefix_len", [8, 10, 3])
@pytest.mark.parametrize("tau", [None, 0.5, 1.01])
def test_fill_block_with_prefix_kv_equals_no_cache(prefix_len: int, tau: float | None) -> None:
    model, ex = tiny_model(), example(prompt_len=6, answer_len=20)
    length = -prefix_len % B or B
    with torch.inference_mode():
        got, _ = fill_block(model, ex.ids[:prefix_len], length, MASK, B, tau)
        assert got == reference_fill(model, ex.ids[:prefix_len], length, tau)


def test_fill_block_rules() -> None:
    model, ex = tiny_model(), example()
    prefix, n = ex.ids[:8], 4
    one_shot, f1 = fill_block(model, prefix, n, MASK, B, None)
    serial, f2 = fill_block(model, prefix, n, MASK, B, 1.01)
    assert f1 == 1 and f2 == n and MASK not in one_shot + serial
    scores = denoise_eval(model, [ex], B, MASK, max_blocks=2)
    assert [s.rule for s in scores] == ["one-shot", "threshold 0.9", "threshold 1.01"]
    # Prompt of 6: block 1 has 2 canvas positions, block 2 has 4.
    assert (scores[0].forwards, scores[0].filled, scores[2].forwards) == (2, 6, 6)


def test_the_oracle_rule_agrees_with_ar_and_needs_no_more_forwards_than_serial() -> None:
    """The oracle commits only AR's tokens, at least one a forward, and whatever the twin already
    predicts right, so its tokens per forward bound every rule at exact agreement."""
    model, ex = tiny_model(), example()
    with torch.inference_mode():
        one_shot, _ = fill_block(model, ex.ids[:8], 4, MASK, B, None)
        got, forwards = fill_block(model, ex.ids[:8], 4, MASK, B, ORACLE, truth=ex.ids[8:12])
    assert got == ex.ids[8:12]
    assert forwards <= 4 - sum(int(a == b) for a, b in zip(one_shot[1:], ex.ids[9:12]))
    scores = denoise_eval(model, [ex], B, MASK, max_blocks=3, taus=(1.01, ORACLE))
    assert scores[1].rule == "oracle" and scores[1].accuracy == 1.0
    assert scores[1].forwards <= scores[0].forwards


def train_args(base: Path, work: Path, data: Path, steps: int = 4, bf16: str = "off") -> list[str]:
    return ["--bf16", bf16, "--from", str(base), "--output", str(work / "twin"), "--work-dir", str(work), "--data", str(data),
            "--num-prompts", "6", "--max-new-tokens", "10", "--gen-concurrency", "4", "--block-size", str(B),
            "--rank", "4", "--alpha", "8", "--steps", str(steps), "--save-every", "2", "--log-every", "1",
            "--tokens-per-step", "160", "--warmup", "1", "--holdout", "3", "--eval-samples", "1",
            "--eval-blocks", "1", "--threads", "1"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("base") / "tiny-llama")


@pytest.mark.parametrize("bf16", ["off", "on"])
def test_train_checkpoint_resume_and_load(base_dir: Path, tmp_path: Path, monkeypatch, bf16: str) -> None:
    """Both branches of the host-dependent ``--bf16 auto`` run here, whatever this CPU has."""
    data = tmp_path / "data.jsonl"
    straight = tmp_path / "straight"
    assert diffusion_train.main(train_args(base_dir, straight, data, bf16=bf16)) == 0
    records = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(records) == 6 and all(r["answer_ids"] for r in records)
    assert json.loads((straight / "checkpoint.json").read_text()) == {"step": 4}
    history = [json.loads(line) for line in (straight / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3, 4] and all(h["tokens_per_s"] > 0 for h in history)

    # Interrupted right after the step-2 checkpoint, then run again: the same twin comes out.
    resumed = tmp_path / "resumed"
    real_save = loop.save_checkpoint

    def crash_after_save(*a, **k):
        real_save(*a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "save_checkpoint", crash_after_save)
    with pytest.raises(KeyboardInterrupt):
        diffusion_train.main(train_args(base_dir, resumed, data, bf16=bf16))
    assert json.loads((resumed / "checkpoint.json").read_text()) == {"step": 2}
    monkeypatch.setattr(loop, "save_checkpoint", real_save)
    assert diffusion_train.main(train_args(base_dir, resumed, data, bf16=bf16)) == 0
    a = load_file(str(straight / "twin" / ADAPTER_FILE))
    b = load_file(str(resumed / "twin" / ADAPTER_FILE))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)

    # The written twin loads, and its weights are base + scale * B @ A of the stored adapter.
    twin, base = load_twin(straight / "twin"), load_model(base_dir)
    cfg = json.loads((straight / "twin" / "config.json").read_text())
    assert cfg["dualserve_diffusion"] == {"block_size": B, "mask_token_id": MASK, "shift_logits": True,
                                          "base_model": str(base_dir.resolve())}
    assert twin.config.family == "block_diffusion" and twin.config.diffusion_block_size == B
    ours, theirs = twin.model.state_dict(), base.model.state_dict()
    for name in lora_names(base.model):
        delta = a[f"{name}.lora_B"].float() @ a[f"{name}.lora_A"].float() * 2.0
        torch.testing.assert_close(ours[f"{name}.weight"], theirs[f"{name}.weight"] + delta, rtol=0, atol=1e-6)
        assert delta.abs().max() > 0, "training moved every adapter off zero"
    assert torch.equal(ours["embed_tokens.weight"][MASK], a["mask_embedding"].float())
    assert diffusion_train.main(train_args(base_dir, straight, data, bf16=bf16) + ["--eval-only"]) == 0
    evals = [json.loads(line) for line in (straight / "eval.jsonl").read_text().splitlines()]
    assert [e["label"] for e in evals] == ["AR model, step 0", "twin, step 4"] * 2
    assert evals[1] == evals[3], "evaluation of the written twin is deterministic"


@pytest.mark.parametrize("bf16", ["off", "on"])
def test_qwen2_layout_trains_and_serves(tmp_path: Path, bf16: str) -> None:
    """The same command on a Qwen2 checkpoint (biases, untied head); the twin then decodes in an engine."""
    from dualserve.decoders.deployment import PoolSpec, ServedSpec, build_deployment
    from dualserve.decoders.engine.sampling import SamplingParams

    base_dir = write_tiny_llama(tmp_path / "tiny-qwen2", family="qwen2")
    work = tmp_path / "run"
    assert diffusion_train.main(train_args(base_dir, work, tmp_path / "data.jsonl", steps=2, bf16=bf16)) == 0
    base = load_model(base_dir)
    assert base.config.attention_bias and not base.config.tie_word_embeddings
    twin = load_twin(work / "twin", base=base)
    assert twin.config.family == "block_diffusion" and twin.config.attention_bias
    dep = build_deployment([ServedSpec("m", base, twin=twin)], pool=PoolSpec(num_blocks=32))
    assert dep.decoders("m") == ["ar", "diffusion"]
    out: list[int] = []
    dep.engine.submit("m", "diffusion", [1, 10, 11, 12], SamplingParams(max_tokens=8, temperature=0.0,
                                                                        ignore_eos=True),
                      lambda _i, d: out.extend(d.token_ids))
    dep.engine.run_until_idle()
    assert len(out) == 8 and MASK not in out


@pytest.mark.parametrize("bf16", ["off", "on"])
def test_trains_on_a_distilled_directory(base_dir: Path, tmp_path: Path, bf16: str) -> None:
    """``--data`` naming a self-distilled set's directory (the EAGLE head's data) trains on it as it is,
    with answers cut at ``--max-len``, soft targets and certainty forcing on (both branches of the
    host-dependent ``--bf16 auto``)."""
    data = tmp_path / "distilled"
    data.mkdir()
    gen = torch.Generator().manual_seed(5)
    records = []
    for i in range(8):
        prompt = [1] + torch.randint(5, 60, (5 + i,), generator=gen).tolist()
        answer = torch.randint(5, 60, (9 + 3 * i,), generator=gen).tolist() + [2]
        records.append({"index": i, "turn": 1, "prompt_ids": prompt, "answer_ids": answer,
                        "finish": "stop" if i != 3 else "error"})
    (data / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    kept = list(answered_records(data, max_len=30))
    assert len(kept) == 7 and all(len(r["prompt_ids"]) + len(r["answer_ids"]) <= 30 for r in kept)
    assert [r["finish"] for r in kept] == ["stop", "stop", "stop", "length", "length", "length", "length"]
    work = tmp_path / "run"
    args = train_args(base_dir, work, data, steps=2, bf16=bf16) + ["--max-len", "30", "--distil", "0.5",
                                                                    "--certainty", "1"]
    assert diffusion_train.main(args) == 0
    assert json.loads((work / "checkpoint.json").read_text()) == {"step": 2}
    assert not (work / "data.jsonl").exists(), "a distilled directory is read, never regenerated"
    assert load_twin(work / "twin").config.family == "block_diffusion"
    # A run started from that twin's adapter, with no step, writes the same adapter back.
    again = tmp_path / "again"
    args = train_args(base_dir, again, data, steps=0) + ["--max-len", "30", "--init", str(work / "twin"),
                                                         "--eval-samples", "0"]
    assert diffusion_train.main(args) == 0
    a, b = load_file(str(work / "twin" / ADAPTER_FILE)), load_file(str(again / "twin" / ADAPTER_FILE))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
