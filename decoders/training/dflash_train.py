"""``dualserve train-dflash``: train a DFlash block-diffusion drafter on the self-distillation shards.

The drafter (``models/dflash.py``) drafts a block of ``--block-size`` tokens in one
forward of ``--layers`` layers, from the anchor token, mask tokens, and the target's
fused features at ``--target-layers`` injected as keys and values. It trains on the
shards of the self-distillation job (``distil.py``) as ``train-eagle --data`` does:
the same ``ShardStream`` order, target features computed per batch in the served
weight format (``eagle_data.target_batch``), the evaluation prompts held out, and
the shared loop (``loop.py``) with its checkpoint (weights, optimizer moments, step,
data cursor) every ``--save-every`` steps, so a resumed run draws the same batches,
and the same anchors, as a straight run. The objective is ``dflash_losses.dflash_loss``.

Defaults, and why:

* ``--target-layers``: the three layers EAGLE-3 fuses (``eagle3_aux_layers``), so a
  server running both drafters computes one feature set.
* ``--mask-token-id``: the tokenizer's highest special token that is not a BOS, EOS,
  end-of-turn, pad or unknown token (SmolLM2: 16, ``<empty_output>``, which chat text
  never holds; its vocabulary has no mask token). Without a tokenizer, the highest
  id that is none of the config's BOS, EOS or pad ids.
* ``--decay``: half the block size (4 for blocks of 8).

Initialisation borrows the target where shapes allow: draft layer l is a copy of
target layer ``num_layers - layers + l`` (attention, MLP, norms; the q/k norms
start at ones), the final norm is the target's, and ``fc`` starts near "take the
highest fused feature", so c_j begins close to that layer's residual stream.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from rich.console import Console
from torch import nn

from dualserve.models.config import RopeScaling
from dualserve.models.dflash import DFlashConfig, DFlashDrafter, save_dflash
from dualserve.models.eagle import eagle3_aux_layers
from dualserve.models.loader import LoadedModel
from dualserve.models.quant import QUANTIZATIONS, linear_weight
from dualserve.models.transformer import Transformer

from . import loop
from .dflash_losses import DFlashStats, default_decay, dflash_loss, draft_index
from .eagle_data import ShardBatches, ShardStream, target_batch
from .eagle_train import check_data_dirs, distilled_stream, draft_vocab, load_target, schedule_of, trainee
from .features import feature_store
from .loop import Trainee, Window

console = Console(stderr=True)


def default_mask_token(loaded: LoadedModel) -> int:
    """A special token the drafter's masks can borrow (see the module docstring)."""
    cfg, tok = loaded.config, loaded.tokenizer
    reserved = {cfg.bos_token_id, cfg.pad_token_id, *cfg.eos_token_ids}
    if tok is not None:
        reserved |= {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id, *tok.eos_token_ids}
        spare = sorted(i for i in tok.all_special_ids if i not in reserved and i < cfg.vocab_size)
        if spare:
            return spare[-1]
    return next(i for i in range(cfg.vocab_size - 1, -1, -1) if i not in reserved)


def target_layers(args: argparse.Namespace, num_layers: int) -> tuple[int, ...]:
    if not args.target_layers:
        return eagle3_aux_layers({}, num_layers)
    ids = tuple(sorted({int(x) for x in args.target_layers.split(",")}))
    if ids[0] < 0 or ids[-1] >= num_layers:
        raise SystemExit(f"--target-layers {list(ids)} outside the target's {num_layers} layers")
    return ids


def attach(drafter: DFlashDrafter, target: Transformer) -> DFlashDrafter:
    """Attach without gradients; a quantized head, which has no backward, is trained through its float rows."""
    with torch.no_grad():
        drafter.attach(target)
        if drafter.draft_rows is None and target.lm_head is not None and not isinstance(target.lm_head, nn.Linear):
            drafter.draft_rows = target.lm_head_weight.float()  # the whole vocabulary, d2t all zero
    return drafter


def new_drafter(loaded: LoadedModel, args: argparse.Namespace, d2t: torch.Tensor) -> DFlashDrafter:
    target, model = loaded.config, loaded.model
    if args.layers > target.num_layers:
        raise SystemExit(f"--layers {args.layers}: the target has {target.num_layers}")
    # Plain RoPE, as EAGLE heads use (``save_dflash`` would carry a scaling if one were set).
    layer = target.replace(num_layers=args.layers, rope_scaling=RopeScaling(), tie_word_embeddings=False)
    ids = target_layers(args, target.num_layers)
    mask = default_mask_token(loaded) if args.mask_token_id is None else args.mask_token_id
    config = DFlashConfig(layer, ids, target.hidden_size, args.block_size, mask, len(d2t))
    torch.manual_seed(args.seed)
    drafter = DFlashDrafter(config).to(args.device)
    drafter.rotary.reset(args.device)
    with torch.no_grad():
        for l, mine in enumerate(drafter.layers):
            src = model.layers[target.num_layers - args.layers + l]
            for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
                theirs = src.get_submodule(name)
                ours = mine.get_submodule(name)
                ours.weight.copy_(linear_weight(theirs).float())
                if ours.bias is not None and getattr(theirs, "bias", None) is not None:
                    ours.bias.copy_(theirs.bias.float())
            mine.input_layernorm.weight.copy_(src.input_layernorm.weight)
            mine.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
        drafter.norm.weight.copy_(model.norm.weight)
        h = target.hidden_size
        drafter.fc.weight.mul_(0.01)
        drafter.fc.weight[:, (len(ids) - 1) * h:] += torch.eye(h, device=drafter.fc.weight.device)
        drafter.d2t.copy_(d2t)
    return attach(drafter, model)


def log_progress(w: Window) -> None:
    stats: list[DFlashStats] = [e[1] for e in w.entries]
    loss = sum(e[0] for e in w.entries) / len(w.entries)
    acc = []
    for k in range(len(stats[0].per_offset)):
        hits = sum(s.per_offset[k][0] for s in stats)
        rows = sum(s.per_offset[k][1] for s in stats)
        acc.append(f"{hits / max(rows, 1):.3f}")
    accepted = sum(s.accepted for s in stats) / max(sum(s.blocks for s in stats), 1)
    console.log(f"train: step {w.step}/{w.total} pass {w.epoch} loss {loss:.4f} accepted/block {accepted:.3f} "
                f"top1@offset [{', '.join(acc)}] {w.elapsed / 60:.1f} min")


def train_stream(loaded: LoadedModel, args: argparse.Namespace, stream: ShardStream, drafter: DFlashDrafter,
                 work: Path) -> None:
    """``args.steps`` steps over the distillation shards, resumable (the shared loop, ``loop.py``)."""
    model = loaded.model
    trained = trainee(drafter)
    vocab = loaded.config.vocab_size
    decay = args.decay or default_decay(args.block_size)
    aux_layers = drafter.config.target_layer_ids
    store = feature_store(loaded, args, aux_layers)

    def index_of_d2t() -> torch.Tensor | None:
        return None if len(drafter.d2t) == vocab else draft_index(drafter.d2t, vocab)

    t2d_index = index_of_d2t()

    def load(state: dict[str, torch.Tensor]) -> None:
        nonlocal t2d_index
        trained.load(state)
        attach(drafter, model)  # a checkpoint brings its own d2t: rebuild the draft rows from it
        t2d_index = index_of_d2t()

    def loss(batch, step: int):
        # One generator per step: a resumed run samples the anchors a straight run does.
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        return dflash_loss(drafter, batch, args.anchors, gen, decay, t2d_index)

    def save(step: int) -> None:
        save_dflash(drafter, loaded.config, args.output,
                    metadata={"step": str(step), "target": loaded.name, "kind": "dflash"})

    data = ShardBatches(stream, lambda seqs: target_batch(model, seqs, aux_layers, store))
    loop.train(Trainee(trained.params, trained.state, load), schedule_of(args, args.steps), work, data, loss, save,
               log_progress)


def run(loaded: LoadedModel, args: argparse.Namespace) -> Path:
    """Train a drafter for an already loaded target on the shards in ``args.data``; returns the output directory."""
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    stream, seqs = distilled_stream(loaded, args)  # the evaluation prompts held out
    vocab = loaded.config.vocab_size
    size = vocab if args.draft_vocab <= 0 else min(args.draft_vocab, vocab)
    d2t = draft_vocab(seqs, vocab, size)[0] if size < vocab else torch.zeros(vocab, dtype=torch.long)
    drafter = new_drafter(loaded, args, d2t)  # a checkpoint, if any, overwrites all of it (d2t included)
    c = drafter.config
    console.log(f"target {loaded.name}: {loaded.config.num_layers} layers; drafter {c.num_layers} layers, "
                f"block {c.block_size}, mask token {c.mask_token_id}, target layers {c.target_layer_ids}, "
                f"draft vocab {c.draft_vocab_size}")
    drafter.requires_grad_(True).train()
    train_stream(loaded, args, stream, drafter, work)
    console.log(f"drafter written to {args.output}")
    return Path(args.output)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``train-dflash`` flags, for this module's own parser or a subcommand of ``dualserve``."""
    p.add_argument("--model", default=None, help="target: HF directory, .gguf file or known name (default model)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--quantization", default="auto", choices=["auto", *QUANTIZATIONS],
                   help="target weight format; auto keeps the checkpoint's (int4 for a Q4 GGUF), as served")
    p.add_argument("--data", required=True, nargs="+", help="distillation shards (distil.py; several directories "
                   "are read in turn, and only the last may still grow)")
    p.add_argument("--output", required=True, help="drafter directory to write (config.json + model.safetensors)")
    p.add_argument("--work-dir", required=True, help="checkpoints (resumable)")
    p.add_argument("--steps", type=int, default=20000, help="optimizer steps (the LR schedule's length)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block", type=int, default=256, help="records shuffled together")
    p.add_argument("--max-len", type=int, default=1024, help="tokens per sequence (prompt + answer)")
    p.add_argument("--layers", type=int, default=2, help="draft layers")
    p.add_argument("--block-size", type=int, default=8, help="anchor + drafted tokens per block")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="default: the highest special token that is not BOS/EOS/pad/unknown")
    p.add_argument("--target-layers", default=None, help="comma-separated target layer outputs to fuse "
                   "(default: EAGLE-3's three)")
    p.add_argument("--draft-vocab", type=int, default=4096, help="most frequent answer tokens; 0: the whole vocabulary")
    p.add_argument("--anchors", type=int, default=16, help="blocks drawn per sequence")
    p.add_argument("--decay", type=float, default=None, help="position weight exp(-(k-1)/decay) (default: block/2)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--feature-store", default=None,
                   help="keep the target's features per sequence in this directory and reuse them (the "
                        "trainers share one)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (GPUs, CPUs with bf16 units)")
    p.add_argument("--device", default="cpu")
    return p


def cmd_train_dflash(args: argparse.Namespace) -> int:
    check_data_dirs(args.data)
    run(load_target(args), args)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dualserve train-dflash", description="Train a DFlash drafter.")
    return cmd_train_dflash(add_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
