"""``dualserve train-eagle``: self-distil an EAGLE draft head for any loaded target.

Three resumable stages, each writing under ``--work-dir``:

1. **data**: the target answers a varied prompt set (``eagle_prompts.py``, plus
   any ``--prompts`` JSONL files) through the paged runner, batched; every fed
   position's post-norm hidden state and EAGLE-3 low/mid/high features are
   captured in the same forwards and written as fp16 safetensors shards.
   Finished shards are skipped on restart.
2. **vocab** (EAGLE-3): the ``--draft-vocab`` most frequent answer tokens, sorted
   ascending, give ``d2t``/``t2d`` (upstream ``traineagle3/cnets.py``). A run that
   continues a finished head (``--init``) keeps its vocabulary, or grows it to a larger
   ``--draft-vocab`` (``grow_draft_vocab``).
3. **train**: the shared loop (``loop.py``: AdamW with warmup and cosine decay,
   a checkpoint of weights, optimizer moments and progress every
   ``--save-every`` steps) on the objectives in ``eagle_losses.py``; the head is
   written in the layout ``models/eagle.py`` loads at every checkpoint.

With ``--data DIR`` the head trains instead on the shards of the self-distillation
job (``distil.py``), which may still be growing: stage 1 is skipped, the draft
vocabulary comes from the answers on disk when training starts, target features
are computed per batch (``eagle_data.py``), and a checkpoint also records the data
cursor, so a resumed run draws the same batches a straight run would. ``--steps``
sets the schedule's length; later passes take in the records written meanwhile.

The EAGLE-3 head starts from the target where shapes allow: its lm_head rows
and final norm are the target's, ``fc`` passes the highest fused feature
through and the residual branches start at zero, so training starts from the
target's own output space rather than from noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path

import torch
from rich.console import Console
from safetensors.torch import load_file, save_file

from dualserve.models.config import RopeScaling
from dualserve.models.eagle import (EagleConfig, EagleHead, HEAD_CLASSES, eagle3_aux_layers, load_eagle_head,
                                    save_eagle_head)
from dualserve.models.errors import InputError
from dualserve.models.loader import LoadedModel
from dualserve.models.quant import QUANTIZATIONS

from . import loop
from .distil_prompts import default_held_out
from .eagle_data import ShardBatches, ShardStream, target_batch
from .eagle_losses import Batch, eagle1_loss, eagle3_loss
from .eagle_prompts import build_prompts
from .features import feature_store
from .loop import EpochBatches, Schedule, Trainee, Window
from ..engine.runner import ForwardItem, ModelRunner

console = Console(stderr=True)


# ---- stage 1: self-distilled data ----------------------------------------------

def chat_ids(loaded: LoadedModel, prompt: str) -> list[int]:
    tok = loaded.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


@torch.inference_mode()
def generate_shard(runner: ModelRunner, prompts: list[list[int]], max_new: int, eos: set[int],
                   aux_layers: tuple[int, ...], temperature: float, seed: int) -> list[dict[str, torch.Tensor]]:
    """Answer a batch of prompts; return per sequence its tokens and the features of every fed position.

    Each sequence owns a contiguous run of blocks, so slot = base + position.
    """
    bs = runner.block_size
    per_seq = -(-(max(map(len, prompts)) + max_new) // bs)
    gen = torch.Generator().manual_seed(seed)
    seqs = [{"ids": list(p), "final": [], "aux": [], "done": False} for p in prompts]
    starts = [0] * len(seqs)
    while True:
        live = [i for i, s in enumerate(seqs) if not s["done"]]
        if not live:
            break
        items = []
        for i in live:
            ids, start, base = seqs[i]["ids"], starts[i], i * per_seq * bs
            items.append(ForwardItem(ids[start:], range(start, len(ids)), start,
                                     list(range(i * per_seq, (i + 1) * per_seq)),
                                     range(base + start, base + len(ids))))
        final, aux = runner.forward(items, aux_layers=aux_layers)
        aux_cat = torch.cat(aux, -1) if aux else final[:, :0]
        offset, last_rows = 0, []
        for i in live:
            n = len(seqs[i]["ids"]) - starts[i]
            seqs[i]["final"].append(final[offset:offset + n].half())
            seqs[i]["aux"].append(aux_cat[offset:offset + n].half())
            offset += n
            last_rows.append(offset - 1)
            starts[i] = len(seqs[i]["ids"])
        logits = runner.logits(final[last_rows])  # (live, vocab)
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)[:, 0]
        else:
            nxt = logits.argmax(-1)
        for i, tok in zip(live, nxt.tolist()):
            s = seqs[i]
            s["ids"].append(tok)
            if tok in eos or len(s["ids"]) - len(prompts[i]) >= max_new:
                s["done"] = True
    return [{"ids": torch.tensor(s["ids"]), "prompt_len": torch.tensor(len(p)),
             "final": torch.cat(s["final"]), "aux": torch.cat(s["aux"])} for s, p in zip(seqs, prompts)]


def make_data(loaded: LoadedModel, args: argparse.Namespace, aux_layers: tuple[int, ...], data_dir: Path) -> None:
    prompts = build_prompts(args.num_prompts, args.seed)
    for path in args.prompts or []:
        prompts += [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line.strip()]
    data_dir.mkdir(parents=True, exist_ok=True)
    bs = 16
    per_seq = -(-(args.max_prompt_len + args.max_new_tokens) // bs)
    runner = ModelRunner(loaded.model, args.gen_batch * per_seq, bs)
    eos = set(loaded.config.eos_token_ids) | set(loaded.tokenizer.eos_token_ids)
    shards = [prompts[i:i + args.gen_batch] for i in range(0, len(prompts), args.gen_batch)]
    tokens, started = 0, time.perf_counter()
    for n, shard in enumerate(shards):
        out = data_dir / f"shard-{n:04d}.safetensors"
        if out.exists():
            continue
        ids = [chat_ids(loaded, p)[-args.max_prompt_len:] for p in shard]
        # Every other shard is sampled: the head should know the target's spread, not one path.
        temperature = args.gen_temperature if n % 2 else 0.0
        seqs = generate_shard(runner, ids, args.max_new_tokens, eos, aux_layers, temperature, args.seed + n)
        flat = {f"{j}.{k}": v for j, s in enumerate(seqs) for k, v in s.items()}
        save_file(flat, str(out.with_suffix(".tmp")))
        out.with_suffix(".tmp").rename(out)
        tokens += sum(len(s["ids"]) - int(s["prompt_len"]) for s in seqs)
        rate = tokens / (time.perf_counter() - started)
        console.log(f"data: shard {n + 1}/{len(shards)}, {tokens} answer tokens, {rate:.1f} tok/s")


def load_sequences(data_dir: Path) -> list[dict[str, torch.Tensor]]:
    seqs = []
    for f in sorted(data_dir.glob("shard-*.safetensors")):
        flat = load_file(str(f))
        count = len({k.split(".")[0] for k in flat})
        seqs += [{k: flat[f"{j}.{k}"] for k in ("ids", "prompt_len", "final", "aux")} for j in range(count)]
    return seqs


# ---- stage 2: draft vocabulary ---------------------------------------------------

def by_answer_count(seqs: list[dict[str, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """Every target id, the most frequent answer tokens first; ties and unseen ids by ascending id."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s["ids"][int(s["prompt_len"]):], minlength=vocab_size)[:vocab_size]
    return torch.argsort(counts * vocab_size - torch.arange(vocab_size), descending=True)  # stable by id


def vocab_maps(used: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of the draft vocabulary ``used`` (target ids, ascending)."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(len(used)), t2d


def draft_vocab(seqs: list[dict[str, torch.Tensor]], vocab_size: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of the ``size`` most frequent answer tokens."""
    return vocab_maps(by_answer_count(seqs, vocab_size)[:size].sort().values, vocab_size)


def log_coverage(seqs: list[dict[str, torch.Tensor]], t2d: torch.Tensor) -> None:
    """Log the share of the answer tokens that the draft vocabulary ``t2d`` holds."""
    kept = t2d.cpu()
    answers = [s["ids"][int(s["prompt_len"]):] for s in seqs]
    covered, answer = sum(int(kept[a].sum()) for a in answers), sum(len(a) for a in answers)
    console.log(f"vocab: {int(kept.sum())} draft ids cover {covered / max(answer, 1):.1%} of answer tokens")


def grow_draft_vocab(loaded: LoadedModel, head: EagleHead, seqs: list[dict[str, torch.Tensor]],
                     size: int) -> EagleHead:
    """``head`` with its draft vocabulary grown to ``size`` ids (itself when it has as many): its own ids
    keep their trained output rows, and the most frequent answer tokens it lacks join. A new id's row
    is the target's output-head row carried into the head's output space by the least-squares linear
    map from the target's rows of the head's own ids to their trained rows: training has moved the
    head's space off the target's, where a new head's rows start (``new_head``)."""
    have = head.config.draft_vocab_size
    vocab = loaded.config.vocab_size
    size = min(size, vocab)
    if size <= have:
        return head
    own = (torch.arange(have, device=head.d2t.device) + head.d2t).cpu()
    order = by_answer_count(seqs, vocab)
    joining = order[~torch.isin(order, own)][: size - have]
    used = torch.cat([own, joining]).sort().values
    target_rows = loaded.model.lm_head_weight
    trained = head.lm_head.weight.detach().float()
    carry = torch.linalg.lstsq(target_rows[own.to(target_rows.device)].float(), trained).solution
    rows = target_rows[used.to(target_rows.device)].float() @ carry
    old = torch.isin(used, own)
    rows[old.to(rows.device)] = trained.to(rows)
    config = dataclasses.replace(head.config, draft_vocab_size=size)
    grown = HEAD_CLASSES[config.kind](config).to(head.d2t.device)
    state = {k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    d2t, t2d = vocab_maps(used, vocab)
    state.update({"lm_head.weight": rows.to(head.lm_head.weight), "d2t": d2t, "t2d": t2d})
    grown.load_state_dict(state, strict=True)
    grown.rotary.reset(head.d2t.device)
    return grown.attach(loaded.model)


# ---- stage 3: training -----------------------------------------------------------

def batches(seqs: list[dict[str, torch.Tensor]], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Length-bucketed batches (little padding), in random order."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]["ids"]))
    groups = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(groups)
    return groups


def collate(seqs: list[dict[str, torch.Tensor]], device: str = "cpu") -> Batch:
    t = max(len(s["ids"]) for s in seqs)
    b, h, a = len(seqs), seqs[0]["final"].shape[1], seqs[0]["aux"].shape[1]
    ids = torch.zeros(b, t, dtype=torch.long)
    final = torch.zeros(b, t, h)
    aux = torch.zeros(b, t, a)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for i, s in enumerate(seqs):
        n = len(s["ids"])
        ids[i, :n] = s["ids"]
        final[i, :n - 1] = s["final"].float()
        aux[i, :n - 1] = s["aux"].float()
        valid[i, int(s["prompt_len"]):n] = True
    lengths = torch.tensor([len(s["ids"]) for s in seqs])
    return Batch(*(x.to(device) for x in (ids, final, aux, valid, lengths)))


def new_head(loaded: LoadedModel, args: argparse.Namespace, d2t: torch.Tensor | None,
             t2d: torch.Tensor | None) -> EagleHead:
    target = loaded.config
    layer = target.replace(num_layers=1, intermediate_size=args.intermediate_size or target.intermediate_size,
                           rope_scaling=RopeScaling(),
                           tie_word_embeddings=False)
    if args.kind == "eagle1":
        config = EagleConfig("eagle1", layer, target.hidden_size, target.vocab_size, fc_bias=False)
    else:
        config = EagleConfig("eagle3", layer, target.hidden_size, len(d2t),
                             aux_layers=eagle3_aux_layers({}, target.num_layers))
    torch.manual_seed(args.seed)
    head = HEAD_CLASSES[config.kind](config).to(args.device)
    head.rotary.reset(args.device)
    model = loaded.model
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                p.zero_()  # residual branches start closed
        if config.kind == "eagle3":
            used = torch.arange(len(d2t)) + d2t
            head.lm_head.weight.copy_(model.lm_head_weight[used.to(model.lm_head_weight.device)])
            head.norm.weight.copy_(model.norm.weight)
            # fc starts as "take the highest feature": step 0 then begins as an early exit
            # from that layer through the target's own output space.
            h = target.hidden_size
            head.fc.weight.mul_(0.01)
            head.fc.weight[:, 2 * h:] += torch.eye(h, device=head.fc.weight.device)
            head.d2t.copy_(d2t)
            head.t2d.copy_(t2d)
    return head.attach(model)


def schedule_of(args: argparse.Namespace, steps: int) -> Schedule:
    """The loop's schedule from the training flags (shared by ``train-eagle`` and ``train-dflash``)."""
    return Schedule(steps, args.lr, args.warmup, (0.9, 0.95), args.save_every, args.log_every, args.bf16, args.device)


def trainee(model: torch.nn.Module) -> Trainee:
    """A draft model as the loop trains it: every parameter that takes gradients; its checkpoint holds
    the whole state dict (draft vocabulary maps included) under ``head.``."""

    def load(state: dict[str, torch.Tensor]) -> None:
        model.load_state_dict({k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")})

    return Trainee({n: p for n, p in model.named_parameters() if p.requires_grad},
                   lambda: {f"head.{k}": v for k, v in model.state_dict().items()}, load)


def train(loaded: LoadedModel, args: argparse.Namespace, seqs: list[dict[str, torch.Tensor]], head: EagleHead,
          work: Path) -> None:
    """``args.epochs`` passes over the self-made shards (stage 1), resumable."""
    per_epoch = len(batches(seqs, args.batch_size, random.Random(0)))
    draft_rows = None
    if args.kind == "eagle3":
        used = torch.arange(len(head.d2t), device=head.d2t.device) + head.d2t
        draft_rows = loaded.model.lm_head_weight[used.to(loaded.model.lm_head_weight.device)].float()

    def batch(epoch: int, index: int, step: int) -> Batch:
        order = batches(seqs, args.batch_size, random.Random(args.seed + epoch))
        return collate([seqs[i] for i in order[index]], args.device)

    def loss(batch: Batch, step: int):
        if args.kind == "eagle3":
            return eagle3_loss(head, batch, draft_rows, args.ttt_steps)
        return eagle1_loss(head, batch)

    loop.train(trainee(head), schedule_of(args, per_epoch * args.epochs), work, EpochBatches(per_epoch, batch), loss,
               lambda step: save_head(loaded, args, head, step), log_progress)


def train_stream(loaded: LoadedModel, args: argparse.Namespace, stream: ShardStream, head: EagleHead,
                 work: Path) -> None:
    """EAGLE-3 training-time test over the distillation shards, ``args.steps`` steps, resumable."""
    model = loaded.model
    used = torch.arange(len(head.d2t), device=head.d2t.device) + head.d2t
    draft_rows = model.lm_head_weight[used.to(model.lm_head_weight.device)].float()
    aux_layers = head.config.aux_layers
    store = feature_store(loaded, args, aux_layers)
    data = ShardBatches(stream, lambda seqs: target_batch(model, seqs, aux_layers, store))
    loop.train(trainee(head), schedule_of(args, args.steps), work, data,
               lambda batch, step: eagle3_loss(head, batch, draft_rows, args.ttt_steps, t2d=head.t2d),
               lambda step: save_head(loaded, args, head, step), log_progress)


def save_head(loaded: LoadedModel, args: argparse.Namespace, head: EagleHead, step: int) -> None:
    save_eagle_head(head, loaded.config, args.output,
                    metadata={"step": str(step), "target": loaded.name, "kind": args.kind})


def log_progress(w: Window) -> None:
    loss = sum(e[0] for e in w.entries) / len(w.entries)
    steps = len(w.entries[0][1])
    acc = []
    for k in range(steps):
        hits = sum(e[1][k][0] for e in w.entries)
        rows = sum(e[1][k][1] for e in w.entries)
        acc.append(f"{hits / max(rows, 1):.3f}")
    console.log(f"train: step {w.step}/{w.total} epoch {w.epoch} loss {loss:.4f} top1@step [{', '.join(acc)}] "
                f"{w.elapsed / 60:.1f} min")


def run(loaded: LoadedModel, args: argparse.Namespace) -> Path:
    """All three stages for an already loaded target; returns the output directory."""
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    if args.data:
        return run_stream(loaded, args, work)
    aux_layers = eagle3_aux_layers({}, loaded.config.num_layers) if args.kind == "eagle3" else ()
    console.log(f"target {loaded.name}: {loaded.config.num_layers} layers, hidden {loaded.config.hidden_size}; "
                f"head {args.kind}, aux layers {aux_layers}")
    make_data(loaded, args, aux_layers, work / "data")
    seqs = load_sequences(work / "data")
    console.log(f"data: {len(seqs)} sequences, {sum(len(s['ids']) for s in seqs)} tokens")
    d2t = t2d = None
    if args.kind == "eagle3":
        d2t, t2d = draft_vocab(seqs, loaded.config.vocab_size, min(args.draft_vocab, loaded.config.vocab_size))
        log_coverage(seqs, t2d)
    head = new_head(loaded, args, d2t, t2d)
    for p in head.parameters():
        p.requires_grad_(True)
    head.train()
    train(loaded, args, seqs, head, work)
    console.log(f"head written to {args.output}")
    return Path(args.output)


def check_data_dirs(dirs: list[str] | None) -> None:
    """Every ``--data`` directory exists (checked before the target loads)."""
    missing = [d for d in dirs or () if not Path(d).is_dir()]
    if missing:
        raise InputError(f"--data {' '.join(missing)}: no such directory (a set made by distil.py)")


def distilled_stream(loaded: LoadedModel, args: argparse.Namespace) -> tuple[ShardStream, list[dict]]:
    """The batches over ``args.data`` and its sequences as ``draft_vocab`` takes them (logged)."""
    # The evaluation prompts were kept out when the data was made; checking again here also keeps
    # out any added to clients/prompts since.
    held_out = default_held_out()
    tok = loaded.tokenizer
    exclude = (lambda ids: held_out.overlaps(tok.decode(ids, skip_special_tokens=True))) if tok else None
    check_data_dirs(args.data)
    stream = ShardStream([Path(d) for d in args.data], args.batch_size, args.block, args.seed, args.max_len,
                         exclude)
    if stream.refresh() == 0:
        raise InputError(f"--data {' '.join(args.data)}: {len(stream.seqs)} sequences, fewer than one block "
                         f"({args.block})")
    seqs = [{"ids": s.ids, "prompt_len": torch.tensor(s.prompt_len)} for s in stream.seqs]
    answer = sum(len(s["ids"]) - int(s["prompt_len"]) for s in seqs)
    console.log(f"data: {', '.join(args.data)}: {len(seqs)} sequences, {answer} answer tokens")
    return stream, seqs


def run_stream(loaded: LoadedModel, args: argparse.Namespace, work: Path) -> Path:
    """Train an EAGLE-3 head on the distillation shards in ``args.data``."""
    if args.kind != "eagle3":
        raise SystemExit("--data trains EAGLE-3 heads (training-time test); use --kind eagle3")
    work.mkdir(parents=True, exist_ok=True)
    stream, seqs = distilled_stream(loaded, args)
    if args.init:  # continue from a finished head: its weights and draft vocabulary, a fresh optimizer
        head = load_eagle_head(args.init, loaded.model, dtype=torch.float32, device=args.device)
        if head.config.kind != "eagle3":
            raise SystemExit(f"--init {args.init}: an EAGLE-3 head is needed, this one is {head.config.kind}")
        console.log(f"init: {args.init} (draft vocabulary {head.config.draft_vocab_size}, "
                    f"MLP {head.config.layer.intermediate_size})")
        if args.draft_vocab > head.config.draft_vocab_size:
            head = grow_draft_vocab(loaded, head, seqs, args.draft_vocab)
            console.log(f"vocab: grown to {head.config.draft_vocab_size} draft ids")
    else:
        d2t, t2d = draft_vocab(seqs, loaded.config.vocab_size, min(args.draft_vocab, loaded.config.vocab_size))
        head = new_head(loaded, args, d2t, t2d)
    log_coverage(seqs, head.t2d)
    # A checkpoint in the work directory, if any, overwrites all of it (vocab maps included).
    head.requires_grad_(True).train()
    train_stream(loaded, args, stream, head, work)
    console.log(f"head written to {args.output}")
    return Path(args.output)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``train-eagle`` flags, for this module's own parser or a subcommand of ``dualserve``."""
    p.add_argument("--model", default=None, help="target: HF directory, .gguf file or known name (default model)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--kind", choices=["eagle3", "eagle1"], default="eagle3")
    p.add_argument("--output", required=True, help="head directory to write (config.json + model.safetensors)")
    p.add_argument("--work-dir", required=True, help="data shards and checkpoints (resumable)")
    p.add_argument("--data", default=None, nargs="+", help="train on these distillation shards (distil.py; several "
                   "directories are read in turn, and only the last may still grow) instead of "
                   "generating data; they may still be growing")
    p.add_argument("--steps", type=int, default=20000, help="with --data: optimizer steps (the LR schedule's length)")
    p.add_argument("--block", type=int, default=256, help="with --data: records shuffled together")
    p.add_argument("--max-len", type=int, default=1024, help="with --data: tokens per sequence (prompt + answer)")
    p.add_argument("--quantization", default="auto", choices=["auto", *QUANTIZATIONS],
                   help="target weight format; auto keeps the checkpoint's (int4 for a Q4 GGUF), as served")
    p.add_argument("--prompts", nargs="*", help="extra JSONL prompt files ({\"prompt\": ...} per line)")
    p.add_argument("--num-prompts", type=int, default=384, help="generated prompts")
    p.add_argument("--max-prompt-len", type=int, default=192)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--gen-batch", type=int, default=32)
    p.add_argument("--gen-temperature", type=float, default=0.7)
    p.add_argument("--draft-vocab", type=int, default=4096,
                   help="EAGLE-3 draft ids: the most frequent answer tokens; with --init, a larger value grows the "
                   "head's own vocabulary (its ids keep their rows, new ones start from the target's)")
    p.add_argument("--intermediate-size", type=int, default=None, help="head MLP width (default: the target's)")
    p.add_argument("--init", default=None, help="with --data: start from this EAGLE-3 head directory (e.g. the "
                   "bundled one) instead of a new head; its size and draft vocabulary win (--draft-vocab may grow it)")
    p.add_argument("--ttt-steps", type=int, default=3, help="EAGLE-3 training-time-test unroll")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--feature-store", default=None,
                   help="keep the target's features per sequence in this directory and reuse them (the "
                        "trainers share one)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (GPUs, CPUs with bf16 units; AVX2-only "
                   "CPUs run it slower than fp32)")
    p.add_argument("--device", default="cpu")
    return p


def load_target(args: argparse.Namespace) -> LoadedModel:
    """The target named by ``args`` (--model, --cache-dir, --quantization, --device), in fp32 compute."""
    from dualserve.models.hub import default_cache_dir, resolve_model
    from dualserve.models.loader import load_model

    cache = default_cache_dir(args.cache_dir)
    name, path = resolve_model(args.model, cache)
    return load_model(path, name=name, dtype=torch.float32, device=args.device, cache_dir=cache,
                      quantization=args.quantization)


def cmd_train_eagle(args: argparse.Namespace) -> int:
    """Load the target named by ``args`` and run all stages."""
    check_data_dirs(args.data)
    run(load_target(args), args)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dualserve train-eagle", description="Self-distil an EAGLE draft head.")
    return cmd_train_eagle(add_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
