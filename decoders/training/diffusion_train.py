"""``dualserve train-diffusion``: adapt an AR checkpoint into a block-diffusion twin.

Stages, each resumable from ``--work-dir``:

1. **data** (``diffusion_data.py``): the AR model's own greedy answers to a
   varied prompt set, generated through the engine in one batch and cached as
   JSONL (``--data``). One prompt in ``--holdout`` (by a stable hash) is kept
   out of training for the sanity evaluation.
2. **train** (``diffusion_twin.py``): LoRA adapters on every projection plus
   the [MASK] embedding row, trained on the two-stream block-diffusion
   objective with complementary masks, in the shared loop (``loop.py``: AdamW,
   linear warmup, cosine decay to 10%, a checkpoint of the trainable tensors,
   optimizer moments and progress every ``--save-every`` steps). The twin
   directory is rewritten at each checkpoint, so an interrupted run leaves a
   usable twin.
3. **eval** (``diffusion_eval.py``): masked-block denoising accuracy on the
   held-out answers, before and after training.

The mask token: the model's own ``mask_token_id`` if it has one, else
``--mask-token`` (default ``<reponame>``, SmolLM2's unused duplicate of
``<repo_name>``), else the last vocabulary id. Its embedding row starts as the
mean embedding and is trained.

bf16 autocast is used where the CPU has bf16 matrix units (AMX or AVX512-BF16)
or on CUDA; on AVX2-only CPUs bf16 matmuls are emulated and measured slower
than fp32, so ``--bf16 auto`` leaves them in fp32.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import random
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from safetensors.torch import load_file

from dualserve.models.adapter import ADAPTER_FILE, TwinSpec, apply_twin, save_twin
from dualserve.models.loader import LoadedModel, hf_config_dict

from .diffusion_data import generate_dataset, twin_prompts
from .diffusion_twin import (Example, LoRALinear, Objective, adapter_tensors, add_lora, make_example, pack,
                             twin_loss)
from . import loop
from .distil import answered_records
from .loop import EpochBatches, Schedule, Trainee, Window

console = Console(stderr=True)
DEFAULT_MASK_TOKEN = "<reponame>"


def is_holdout(record: dict, every: int) -> bool:
    """One record in ``every``, by a stable hash of its prompt (its prompt ids in a distilled set)."""
    key = record["prompt"] if "prompt" in record else json.dumps(record["prompt_ids"])
    return every > 0 and int(hashlib.sha1(key.encode()).hexdigest(), 16) % every == 0


def pick_mask_token(loaded: LoadedModel, name: str | None) -> int:
    if loaded.config.mask_token_id is not None:
        return loaded.config.mask_token_id
    tok_id = loaded.tokenizer.token_to_id(name or DEFAULT_MASK_TOKEN)
    return tok_id if tok_id is not None else loaded.config.vocab_size - 1


def use_bf16(choice: str, device: str) -> bool:
    if choice != "auto":
        return choice == "on"
    if device.startswith("cuda"):
        return True
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def examples_from(records: list[dict], block_size: int, pad_id: int) -> list[Example]:
    out = []
    for rec in records:
        ex = make_example(rec["prompt_ids"], rec["answer_ids"], rec["finish"] == "stop", block_size, pad_id)
        if ex is not None:
            out.append(ex)
    return out


def packed_len(ex: Example, block_size: int) -> int:
    n0 = ex.prompt_len // block_size * block_size
    return len(ex.ids) + 2 * (len(ex.ids) - n0)


def schedule(examples: list[Example], block_size: int, max_tokens: int, seed: int) -> list[list[int]]:
    """One epoch's steps: shuffled examples packed greedily into steps of at most ``max_tokens``."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    steps: list[list[int]] = []
    used = max_tokens
    for i in order:
        n = packed_len(examples[i], block_size)
        if used + n > max_tokens:
            steps.append([])
            used = 0
        steps[-1].append(i)
        used += n
    return steps


# ---- training ----------------------------------------------------------------------

def trainable(loras: dict[str, LoRALinear], mask_embedding: torch.nn.Parameter) -> dict[str, torch.nn.Parameter]:
    out = {"mask_embedding": mask_embedding}
    for name, m in loras.items():
        out[f"{name}.lora_A"] = m.lora_A
        out[f"{name}.lora_B"] = m.lora_B
    return out


def trainee(params: dict[str, torch.nn.Parameter]) -> Trainee:
    """The adapter as the loop trains it; its checkpoint holds the tensors under ``param.``."""

    @torch.no_grad()
    def load(state: dict[str, torch.Tensor]) -> None:
        for name, p in params.items():
            p.copy_(state[f"param.{name}"])

    return Trainee(params, lambda: {f"param.{k}": v for k, v in params.items()}, load)


def start_from(params: dict[str, torch.nn.Parameter], twin_dir: Path) -> None:
    """Start training from an existing twin's adapter (the same rank and targets) instead of B = 0."""
    adapter = load_file(str(twin_dir / ADAPTER_FILE))
    if adapter.keys() != params.keys() or any(adapter[k].shape != p.shape for k, p in params.items()):
        raise SystemExit(f"--init {twin_dir}: its adapter does not match this twin's rank and targets")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(adapter[name])


def write_twin(loaded: LoadedModel, args: argparse.Namespace, spec: TwinSpec, loras, mask_embedding,
               step: int) -> None:
    save_twin(args.output, hf_config_dict(loaded.config), spec, adapter_tensors(loras, mask_embedding),
              dtype=torch.bfloat16 if args.adapter_dtype == "bf16" else torch.float16,
              metadata={"step": str(step), "base_model": spec.base_model})


def train(loaded: LoadedModel, args: argparse.Namespace, examples: list[Example], spec: TwinSpec) -> None:
    """Train LoRA + [MASK] row on ``examples`` for ``args.steps`` optimizer steps (resumable; the
    shared loop, ``loop.py``).

    Works on a copy of the model, so ``loaded`` stays the plain AR model (the parent whose
    distribution the soft targets are)."""
    objective = Objective(distil=args.distil, certainty=args.certainty, temperature=args.certainty_temperature)
    model = copy.deepcopy(loaded.model)
    loras = add_lora(model, args.rank, args.alpha, args.seed)
    emb = model.embed_tokens.weight
    mask_embedding = torch.nn.Parameter(emb.detach().float().mean(0).to(emb))
    params = trainable(loras, mask_embedding)
    if args.init:
        start_from(params, Path(args.init))
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    history = work / "history.jsonl"

    def batch(epoch: int, index: int, step: int) -> list:
        chosen = schedule(examples, spec.block_size, args.tokens_per_step, args.seed + epoch)[index]
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        return [pack(examples[i], spec.block_size, spec.mask_token_id, gen) for i in chosen]

    def loss(packed: list, step: int):
        value, n, correct = twin_loss(model, mask_embedding, spec.mask_token_id, packed, objective,
                                      parent=loaded.model)
        return value, (n, correct, sum(p.length for p in packed))

    per_epoch = len(schedule(examples, spec.block_size, args.tokens_per_step, args.seed))
    plan = Schedule(args.steps, args.lr, args.warmup, (0.9, 0.98), args.save_every, args.log_every,
                    use_bf16(args.bf16, args.device), args.device, args.max_minutes)
    bar = Progress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                   console=console, disable=not console.is_terminal)

    def log(w: Window) -> None:
        bar.update(task, completed=w.step, info=log_window(w, history))

    def save(step: int) -> None:
        write_twin(loaded, args, spec, loras, mask_embedding, step)

    with bar:
        task = bar.add_task("train", total=args.steps, completed=0, info="")
        first = loop.train(trainee(params), plan, work, EpochBatches(per_epoch, batch), loss, save, log)
    if first >= args.steps:  # no step ran: a finished run called again (a new --threshold)
        save(first)


def log_window(w: Window, history: Path) -> str:
    """One line of ``history.jsonl`` for the window, and the same figures for the log and the bar."""
    targets = sum(s[0] for _, s in w.entries)
    correct = sum(s[1] for _, s in w.entries)
    tokens = sum(s[2] for _, s in w.entries)
    loss = 0.0
    for value, s in w.entries:
        loss += value * s[0]
    seconds = max(w.seconds, 1e-9)
    rec = {"step": w.step, "epoch": w.epoch, "loss": round(loss / max(targets, 1), 4),
           "acc": round(correct / max(targets, 1), 4),
           "tokens_per_s": round(tokens / seconds, 1), "targets_per_s": round(targets / seconds, 1),
           "time": round(time.time())}
    with history.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    info = (f"loss {rec['loss']:.3f} acc {rec['acc']:.3f} {rec['tokens_per_s']:.0f} tok/s "
            f"({rec['targets_per_s']:.0f} targets/s)")
    console.log(f"train: step {w.step}/{w.total} epoch {w.epoch} {info}")
    return info


# ---- the command -------------------------------------------------------------------

def untrained(loaded: LoadedModel, spec: TwinSpec) -> torch.nn.Module:
    """The AR model as training step 0 sees it: [MASK] embedded as the mean embedding."""
    model = copy.deepcopy(loaded.model)
    with torch.no_grad():
        model.embed_tokens.weight[spec.mask_token_id] = model.embed_tokens.weight.mean(0)
    return model


def run_eval(model: torch.nn.Module, examples: list[Example], spec: TwinSpec, args: argparse.Namespace,
             label: str) -> list[dict]:
    from .diffusion_eval import ORACLE, denoise_eval

    taus = (None, *args.eval_thresholds, ORACLE)
    rows = [s.row() for s in denoise_eval(model, examples[: args.eval_samples], spec.block_size,
                                          spec.mask_token_id, args.eval_blocks, taus)]
    for r in rows:
        console.log(f"eval ({label}): {r['rule']}: accuracy {r['accuracy']:.3f} vs AR greedy, "
                    f"{r['tokens_per_forward']:.2f} tokens/forward over {r['tokens']} tokens")
    with (Path(args.work_dir) / "eval.jsonl").open("a") as f:
        f.write(json.dumps({"label": label, "rows": rows}) + "\n")
    return rows


def run(loaded: LoadedModel, args: argparse.Namespace, base_model: str) -> Path:
    """Data, training and evaluation for an already loaded AR model; returns the twin directory."""
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = TwinSpec(block_size=args.block_size, mask_token_id=pick_mask_token(loaded, args.mask_token),
                    base_model=base_model, rank=args.rank, alpha=args.alpha, threshold=args.threshold)
    console.log(f"twin of {loaded.name}: block {spec.block_size}, mask id {spec.mask_token_id} "
                f"({loaded.tokenizer.convert_ids_to_tokens([spec.mask_token_id])[0]}), LoRA rank {spec.rank}, "
                f"bf16 autocast {'on' if use_bf16(args.bf16, args.device) else 'off'}")
    if Path(args.data).is_dir():
        records = list(answered_records(Path(args.data), args.max_len))
    else:
        prompts = twin_prompts(args.num_prompts, args.seed, args.prompts)
        records = generate_dataset(loaded, prompts, Path(args.data), max_new_tokens=args.max_new_tokens,
                                   max_prompt_len=args.max_prompt_len, concurrency=args.gen_concurrency,
                                   log=console.log)
    pad = loaded.tokenizer.eos_token_id if loaded.tokenizer.eos_token_id is not None else loaded.config.eos_token_ids[0]
    train_recs = [r for r in records if not is_holdout(r, args.holdout)]
    held = examples_from([r for r in records if is_holdout(r, args.holdout)], spec.block_size, pad)
    examples = examples_from(train_recs, spec.block_size, pad)
    console.log(f"data: {len(examples)} training answers ({sum(len(e.ids) - e.prompt_len for e in examples)} "
                f"answer tokens), {len(held)} held out")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if args.eval_samples and (args.eval_only or not (work / "checkpoint.json").exists()):
        run_eval(untrained(loaded, spec), held, spec, args, "AR model, step 0")
    if not args.eval_only:
        train(loaded, args, examples, spec)
    if args.eval_samples:
        checkpoint = work / "checkpoint.json"
        step = json.loads(checkpoint.read_text())["step"] if checkpoint.exists() else "as given"
        # The twin as written and loaded back (bf16 adapter, merged), not the training copy.
        run_eval(apply_twin(loaded, args.output).model, held, spec, args, f"twin, step {step}")
    console.log(f"twin written to {args.output}")
    return Path(args.output)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualserve train-diffusion",
                                description="Adapt an AR checkpoint into a block-diffusion twin (LoRA).")
    p.add_argument("--from", dest="model", default=None,
                   help="AR model: HF directory, .gguf file or known name (default: the embedded model)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--output", required=True, help="twin directory to write (config.json + adapter.safetensors)")
    p.add_argument("--work-dir", required=True, help="checkpoints, training history and eval results")
    p.add_argument("--data", default=None,
                   help="self-distilled JSONL cache (default: WORK_DIR/data.jsonl), or the directory of a set "
                        "made by `python -m dualserve.decoders.training.distil` (used as it is)")
    p.add_argument("--max-len", type=int, default=768,
                   help="prompt + answer tokens kept per record of a distilled directory")
    p.add_argument("--prompts", nargs="*", help="extra JSONL prompt files ({\"prompt\": ...} per line)")
    p.add_argument("--num-prompts", type=int, default=640, help="generated prompts")
    p.add_argument("--max-prompt-len", type=int, default=192)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gen-concurrency", type=int, default=64)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--mask-token", default=None, help=f"token text to use as [MASK] (default {DEFAULT_MASK_TOKEN})")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--max-minutes", type=float, default=0,
                   help="stop training after this long, checkpointed (run again to resume; 0: no limit)")
    p.add_argument("--tokens-per-step", type=int, default=2048, help="packed tokens per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--init", default=None,
                   help="start from this twin's adapter (same --rank) instead of a zero one")
    p.add_argument("--distil", type=float, default=0.0,
                   help="weight of the AR parent's soft targets (the hard targets get 1 - this)")
    p.add_argument("--certainty", type=float, default=0.0,
                   help="weight of certainty forcing: the entropy of correctly predicted masked tokens (dParallel)")
    p.add_argument("--certainty-temperature", type=float, default=0.5)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--holdout", type=int, default=20, help="keep one prompt in N out of training")
    p.add_argument("--eval-samples", type=int, default=24, help="held-out answers to evaluate (0: none)")
    p.add_argument("--eval-blocks", type=int, default=2, help="answer blocks evaluated per held-out answer")
    p.add_argument("--eval-thresholds", type=float, nargs="*", default=[0.9, 1.01],
                   help="confidence thresholds evaluated besides one-shot (above 1: one token per forward)")
    p.add_argument("--eval-only", action="store_true", help="evaluate the AR model and the twin in --output")
    p.add_argument("--threshold", type=float, default=None,
                   help="unmasking threshold recorded in the twin as the decoder's default "
                        "(choose it with python -m dualserve.clients.eval_twin; unset: 0.9)")
    p.add_argument("--adapter-dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--bf16", choices=["auto", "on", "off"], default="auto",
                   help="bf16 autocast (auto: CUDA, or CPUs with AMX / AVX512-BF16)")
    p.add_argument("--device", default="cpu")
    return p


def main(argv: list[str] | None = None) -> int:
    from dualserve.models.hub import ALIASES, default_cache_dir, resolve_model
    from dualserve.models.loader import load_model

    args = parser().parse_args(argv)
    args.data = args.data or str(Path(args.work_dir) / "data.jsonl")
    cache = default_cache_dir(args.cache_dir)
    name, path = resolve_model(args.model, cache)
    base_model = name if args.model is None or args.model in ALIASES else str(Path(path).resolve())
    loaded = load_model(path, name=name, dtype=torch.float32, device=args.device, cache_dir=cache)
    run(loaded, args, base_model)
    return 0
