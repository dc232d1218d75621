"""One training loop for the EAGLE head, the DFlash drafter and the diffusion twin: ``train``.

Each trainer (``eagle_train``, ``dflash_train``, ``diffusion_train``) optimises a few tensors
beside a frozen model with the same machinery, kept here once:

* AdamW without weight decay, linear warmup then cosine decay to 10% of the peak rate
  (``lr_at``), gradients clipped to norm 1, optional bf16 autocast;
* a checkpoint every ``save_every`` steps, at the last step and when ``max_minutes`` runs
  out (``save_checkpoint``): the trained tensors and the optimizer moments in one
  safetensors file whose metadata holds the progress (the step and where the data stands),
  so one rename commits both, plus the progress as JSON for people. ``load_checkpoint`` puts
  all of it back, so a resumed run continues exactly as a straight run would;
* each step's loss and statistics gathered into a ``Window`` handed to the trainer's ``log``
  every ``log_every`` steps and at the last one.

What differs is passed in: the tensors (``Trainee``), the batches (``Batches``: from the step
number, or a cursor over a growing set that the checkpoint records), the loss, the log, and
``save``, which writes the artifact (a head, a drafter, a twin) after each checkpoint.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


@dataclass(frozen=True)
class Schedule:
    """The optimizer, its schedule and the loop's strides (from a trainer's flags)."""

    steps: int                   # optimizer steps in all (the schedule's length)
    lr: float                    # peak learning rate
    warmup: int                  # steps of linear warmup
    betas: tuple[float, float] = (0.9, 0.95)
    save_every: int = 50
    log_every: int = 10
    bf16: bool = False           # bf16 autocast
    device: str = "cpu"
    max_minutes: float = 0.0     # stop, checkpointed, after this long (0: no limit)


def lr_at(step: int, schedule: Schedule) -> float:
    """Linear warmup to the peak, then cosine decay to 10% of it at the last step."""
    if step < schedule.warmup:
        return schedule.lr * (step + 1) / schedule.warmup
    progress = (step - schedule.warmup) / max(1, schedule.steps - schedule.warmup)
    return schedule.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@dataclass
class Trainee:
    """What a trainer trains: the optimizer's tensors by name (the names key their moments in a
    checkpoint), the tensors a checkpoint keeps (``state``, names prefixed as in every checkpoint
    the trainer has written) and how they go back (``load``)."""

    params: dict[str, torch.nn.Parameter]
    state: Callable[[], dict[str, torch.Tensor]]
    load: Callable[[dict[str, torch.Tensor]], None]


class Batches(Protocol):
    """Where each step's batch comes from."""

    def resume(self, progress: dict) -> None:
        """Continue from a checkpoint's progress (``{"step": 0}`` for a new run)."""
        ...

    def next(self, step: int) -> tuple[Any, int]:
        """(the batch of ``step``, the epoch or pass it belongs to)."""
        ...

    def progress(self) -> dict:
        """What a checkpoint records beside the step, e.g. a data cursor past the last batch."""
        ...


class EpochBatches:
    """Batches by step number: ``per_epoch`` a pass, ``make(epoch, index, step)`` the batch."""

    def __init__(self, per_epoch: int, make: Callable[[int, int, int], Any]):
        self.per_epoch, self.make = per_epoch, make

    def resume(self, progress: dict) -> None:
        pass  # the step number is the whole position

    def next(self, step: int) -> tuple[Any, int]:
        epoch, index = divmod(step, self.per_epoch)
        return self.make(epoch, index, step), epoch

    def progress(self) -> dict:
        return {}


@dataclass
class Window:
    """The steps since the last log."""

    step: int                            # the last step done
    total: int
    epoch: int                           # of the last step's batch
    entries: list[tuple[float, Any]]     # (loss, the loss function's statistics) per step
    seconds: float                       # since the last log
    elapsed: float                       # since this run started


LossFn = Callable[[Any, int], tuple[torch.Tensor, Any]]  # (batch, step) -> (loss, statistics)


def train(trainee: Trainee, schedule: Schedule, work: Path, batches: Batches, loss_fn: LossFn,
          save: Callable[[int], None], log: Callable[[Window], None]) -> int:
    """Train from the checkpoint in ``work`` (if any) to ``schedule.steps``; returns the step it
    started from. ``save(step)`` writes the artifact after each checkpoint."""
    params = list(trainee.params.values())
    opt = torch.optim.AdamW(params, lr=schedule.lr, betas=schedule.betas, weight_decay=0.0)
    progress = load_checkpoint(work, trainee, opt)
    first = step = progress["step"]
    batches.resume(progress)
    autocast = torch.autocast(torch.device(schedule.device).type, dtype=torch.bfloat16, enabled=schedule.bf16)
    deadline = time.monotonic() + schedule.max_minutes * 60 if schedule.max_minutes else math.inf
    started = since = time.perf_counter()
    entries: list[tuple[float, Any]] = []
    while step < schedule.steps and time.monotonic() < deadline:
        batch, epoch = batches.next(step)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, schedule)
        with autocast:
            loss, stats = loss_fn(batch, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        entries.append((float(loss.detach()), stats))
        last = step == schedule.steps
        if step % schedule.log_every == 0 or last:
            now = time.perf_counter()
            log(Window(step, schedule.steps, epoch, entries, now - since, now - started))
            entries, since = [], time.perf_counter()
        if step % schedule.save_every == 0 or last or time.monotonic() >= deadline:
            save_checkpoint(work, trainee, opt, {"step": step, **batches.progress()})
            save(step)
    return first


# ---- checkpoints -------------------------------------------------------------------

def checkpoint_paths(work: Path) -> tuple[Path, Path]:
    return work / "checkpoint.safetensors", work / "checkpoint.json"


def save_checkpoint(work: Path, trainee: Trainee, opt: torch.optim.Optimizer, progress: dict) -> None:
    weights, meta = checkpoint_paths(work)
    state = {k: v.detach().clone() for k, v in trainee.state().items()}
    for name, p in trainee.params.items():
        for k, v in opt.state.get(p, {}).items():
            if torch.is_tensor(v):
                state[f"opt.{name}.{k}"] = v.detach().clone()
    # Progress rides in the weights file's metadata, so one rename commits both; the JSON is for people.
    tmp = weights.with_suffix(".tmp")
    save_file(state, str(tmp), metadata={"progress": json.dumps(progress)})
    tmp.replace(weights)
    meta.write_text(json.dumps(progress))


def load_checkpoint(work: Path, trainee: Trainee, opt: torch.optim.Optimizer) -> dict:
    """The progress of the checkpoint in ``work``, its tensors and moments put back; ``{"step": 0}``
    when there is none (a checkpoint whose metadata carries no progress needs its JSON)."""
    weights, meta = checkpoint_paths(work)
    if not weights.exists():
        return {"step": 0}
    with safe_open(str(weights), framework="pt") as f:
        stored = (f.metadata() or {}).get("progress")
    if stored is None and not meta.exists():
        return {"step": 0}
    state = load_file(str(weights))
    trainee.load(state)
    for key, v in state.items():
        if key.startswith("opt."):
            name, field = key.removeprefix("opt.").rsplit(".", 1)
            p = trainee.params[name]
            opt.state.setdefault(p, {})[field] = v.to(p.device)
    return json.loads(stored) if stored else json.loads(meta.read_text())
