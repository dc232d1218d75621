"""``python -m dualserve.decoders.training.distil``: a resumable self-distillation job.

The target answers the ``distil_prompts`` conversations through the serving engine
(continuous batching over the paged pool; ``--concurrency`` 16 gives about 3x the
single-stream rate on CPU), with the chat template, and for tool-call prompts the
tool description, exactly as the server renders them. Two-turn conversations send
the second message (a user follow-up, or a tool result for the model's own call)
after the model's first answer is in, so turn 2's prompt holds the model's own turn 1.

Output, under ``--out`` (default ``~/.cache/dualserve/distil/<model>-<format>/``):

  ``shard-NNNNN.jsonl``  append-only; one record per answered turn:
      {"index", "turn", "kind", "prompt_ids", "answer_ids", "finish", "temperature", "settings"}
      ``finish`` is "stop", "length", "loop" (cut once it looped, ``looping``) or "skipped".
      ``prompt_ids`` + ``answer_ids`` is the sequence; the boundary is len(prompt_ids).
      ``settings`` is the key of the generation settings in the manifest.
  ``manifest.json``      model, weight format, settings, prompt-set seed, held-out files,
      per-shard record and token counts; rewritten atomically as the job goes.

A restart reads the shards, skips every finished (index, turn) and continues where
it stopped; a torn last line is ignored. Settings that differ from the manifest's
are refused, so one directory holds one distribution. Readers (the head and twin
trainers) read the shards directly with ``read_records`` and see them grow.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from dualserve.models.loader import LoadedModel
from dualserve.models.quant import QUANTIZATIONS
from dualserve.models.tool_prompt import format_for, inject_tools, template_renders_tools

from .distil_prompts import (Conversation, HeldOut, Message, conversation, default_held_out, file_conversations,
                             signature)

SHARD_RECORDS = 1000  # records per shard before the next one opens
ANSWERED = ("stop", "length", "loop")  # finishes whose answer is the target's own text ("loop": cut, see below)


def looping(ids: list[int], window: int) -> bool:
    """The last ``window`` tokens repeat with some period p <= window / 2.

    A small greedy model often falls into a loop and stays there until max_tokens;
    in the first sample of this job such answers held over half of all answer tokens,
    three quarters of their 4-grams repeats. Cutting an answer once two full cycles
    are in keeps an example of the loop (a draft head should learn to continue it) and
    spends the rest of the budget on new text. The kept tokens are still exactly the
    target's own.
    """
    if window <= 0 or len(ids) < window + 1:
        return False
    tail = ids[-window:]
    return any(tail[:-p] == tail[p:] for p in range(1, window // 2 + 1))


@dataclass(frozen=True)
class Settings:
    seed: int
    temperature: float        # 0 = greedy
    max_new_tokens: int
    max_prompt_len: int       # longer prompts are recorded as "skipped"
    model: str
    quantization: str
    loop_window: int = 96     # stop an answer whose last this-many tokens repeat with a period <= half of it
    prompts: str = ""         # the prompt file's sha1 (--prompts), "" for the generated set

    def as_dict(self) -> dict[str, Any]:
        # "prompts" joins the key only when set, so the generated set keeps the key its committed shards carry
        return {k: v for k, v in self.__dict__.items() if k != "prompts" or v}

    @property
    def key(self) -> str:
        return hashlib.sha1(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:10]


def model_key(loaded: LoadedModel) -> str:
    return f"{loaded.name}-{loaded.quantization}"


# ---- rendering, as the server does it ------------------------------------------

def render(loaded: LoadedModel, messages: list[Message], tools: list[dict] | None) -> list[int]:
    """Prompt ids for ``messages``: the server's chat rendering, including its tool prompt.

    Tool prompts must match serving byte for byte (what a draft model learns to draft is what
    the server sends), so this renders with the tool prompts the server uses
    (``models/tool_prompt.py``) rather than a copy of them.
    """
    tok = loaded.tokenizer
    if tools and not template_renders_tools(tok.chat_template):
        messages, tools = inject_tools(messages, tools, format_for(tok.chat_template)), None
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def second_turn(loaded: LoadedModel, conv: Conversation, answer_ids: list[int]) -> list[int]:
    """Turn 2's prompt: turn 1, the model's own answer (its tool calls parsed as a client would), the follow-up."""
    text = loaded.tokenizer.decode(answer_ids, skip_special_tokens=True)
    reply: Message = {"role": "assistant", "content": text}
    if conv.tools:
        content, calls = format_for(loaded.tokenizer.chat_template).read_calls(text)
        if calls:  # ids as the server gives them (a template that renders tools may show them)
            reply = {"role": "assistant", "content": content or None, "tool_calls": [
                {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": name, "arguments": arguments}} for name, arguments in calls]}
    return render(loaded, [*conv.messages, reply, conv.followup], conv.tools)


# ---- shards ------------------------------------------------------------------------

def read_records(out: Path) -> Iterator[dict]:
    """Every record of every shard in order; a torn (unparseable) last line of a shard is skipped."""
    for shard in sorted(out.glob("shard-*.jsonl")):
        with shard.open() as f:
            for line in f:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    break


def answered_records(out: Path, max_len: int) -> Iterator[dict]:
    """The records a trainer learns from: answered ones (``ANSWERED``) whose prompt leaves at least
    8 of ``max_len`` tokens for the answer; an answer that runs past ``max_len`` is cut, and its
    finish becomes "length"."""
    for rec in read_records(out):
        prompt, answer = rec["prompt_ids"], rec["answer_ids"]
        if rec["finish"] not in ANSWERED or not answer or len(prompt) + 8 > max_len:
            continue
        if len(prompt) + len(answer) > max_len:
            rec = rec | {"answer_ids": answer[: max_len - len(prompt)], "finish": "length"}
        yield rec


class ShardWriter:
    """Appends records to numbered shards; a new run always starts a new shard."""

    def __init__(self, out: Path, counts: dict[str, list[int]]):
        self.out = out
        self.counts = counts  # shard name -> [records, answer tokens], kept current for the manifest
        existing = sorted(out.glob("shard-*.jsonl"))
        self.next = int(existing[-1].stem.split("-")[1]) + 1 if existing else 0
        self.file = None
        self.count = 0

    def write(self, record: dict) -> None:
        if self.file is None or self.count >= SHARD_RECORDS:
            self.close()
            self.name = f"shard-{self.next:05d}.jsonl"
            self.file = (self.out / self.name).open("a")
            self.counts[self.name] = [0, 0]
            self.next += 1
            self.count = 0
        self.file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self.file.flush()
        self.count += 1
        self.counts[self.name][0] += 1
        self.counts[self.name][1] += len(record["answer_ids"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def shard_counts(out: Path) -> dict[str, list[int]]:
    """Per shard file: [records, answer tokens]."""
    counts = {}
    for shard in sorted(out.glob("shard-*.jsonl")):
        counts[shard.name] = [0, 0]
        with shard.open() as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    break
                counts[shard.name][0] += 1
                counts[shard.name][1] += len(rec["answer_ids"])
    return counts


def write_manifest(out: Path, loaded: LoadedModel, settings: Settings, held_out_files: list[str],
                   counts: dict[str, list[int]]) -> dict:
    manifest = {"model": loaded.name, "key": model_key(loaded), "quantization": loaded.quantization,
                "settings": {settings.key: settings.as_dict()},
                "prompt_set": ({"file_sha1": settings.prompts} if settings.prompts else
                               {"module": "dualserve.decoders.training.distil_prompts", "seed": settings.seed}),
                "held_out": held_out_files,
                "records": sum(c[0] for c in counts.values()),
                "answer_tokens": sum(c[1] for c in counts.values()),
                "shards": {name: {"records": c[0], "answer_tokens": c[1]} for name, c in sorted(counts.items())},
                "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.rename(out / "manifest.json")
    return manifest


def check_settings(out: Path, settings: Settings) -> None:
    path = out / "manifest.json"
    if path.exists():
        known = json.loads(path.read_text())["settings"]
        if settings.key not in known:
            raise SystemExit(f"{out} holds data made with other settings {known}; use another --out")


# ---- the job ------------------------------------------------------------------------

@dataclass
class Work:
    index: int
    turn: int
    conv: Conversation
    prompt_ids: list[int]


@dataclass(frozen=True)
class JobSpec:
    """What to make and how hard to push: everything ``distil`` needs besides the model and the output."""

    settings: Settings
    target_tokens: int
    concurrency: int = 16
    held_out: HeldOut = field(default_factory=HeldOut)
    held_out_files: tuple[str, ...] = ()
    max_conversations: int | None = None   # stop after this many conversation indices (tests)
    window: int = 128                      # conversations queued at a time, sorted by prompt length
    compile_dir: Path | None = None        # compiled steps, with inductor's cache here
    conversations: list[Conversation] | None = None  # a prompt file's (--prompts) instead of the generated set


class Distiller:
    """One run of the job: what is on disk, the queue of pending turns, the engine that answers them."""

    def __init__(self, loaded: LoadedModel, out: Path, spec: JobSpec, log: Callable[[str], None]):
        self.loaded, self.out, self.spec, self.log = loaded, out, spec, log
        out.mkdir(parents=True, exist_ok=True)
        check_settings(out, spec.settings)
        self.done: dict[int, dict[int, dict]] = {}  # index -> turn -> record, from earlier runs
        self.have = 0
        for rec in read_records(out):
            self.done.setdefault(rec["index"], {})[rec["turn"]] = rec
            self.have += len(rec["answer_ids"])
        self.counts = shard_counts(out)
        self.writer = ShardWriter(out, self.counts)
        self.queue: deque[Work] = deque()
        self.seen: set[str] = set()
        self.next_index = self.inflight = self.new_tokens = self.new_records = 0

    def manifest(self) -> dict:
        return write_manifest(self.out, self.loaded, self.spec.settings, list(self.spec.held_out_files), self.counts)

    def make_work(self, index: int, turn: int, conv: Conversation, first_answer: list[int] | None) -> Work:
        ids = (render(self.loaded, conv.messages, conv.tools) if turn == 1
               else second_turn(self.loaded, conv, first_answer))
        return Work(index, turn, conv, ids)

    def record(self, work: Work, answer: list[int], finish: str) -> None:
        s = self.spec.settings
        self.writer.write({"index": work.index, "turn": work.turn, "kind": work.conv.kind,
                           "prompt_ids": work.prompt_ids, "answer_ids": answer, "finish": finish,
                           "temperature": s.temperature, "settings": s.key})
        self.new_tokens += len(answer)
        self.new_records += 1
        if work.turn < work.conv.turns and finish in ANSWERED:
            # Second turns are long (they hold the first): they join the window's tail, beside the longest.
            self.queue.append(self.make_work(work.index, work.turn + 1, work.conv, answer))

    def sink_for(self, work: Work, engine) -> tuple[Callable, dict]:
        answer: list[int] = []
        request = {"id": None, "loop": False}  # the id is set right after submit, before any delta

        def sink(_index: int, delta) -> None:
            answer.extend(delta.token_ids)
            if delta.finish_reason is not None:
                self.inflight -= 1
                self.record(work, answer, "loop" if request["loop"] else delta.finish_reason)
            elif not request["loop"] and looping(answer, self.spec.settings.loop_window):
                request["loop"] = True
                engine.abort(request["id"])
        return sink, request

    def next_conversation(self) -> Work | None:
        """The next unfinished conversation's first pending turn, or None when the set is exhausted."""
        while self.spec.max_conversations is None or self.next_index < self.spec.max_conversations:
            i = self.next_index
            self.next_index += 1
            if self.spec.conversations is not None:
                if i >= len(self.spec.conversations):
                    return None
                conv = self.spec.conversations[i]
            else:
                conv = conversation(self.spec.settings.seed, i, self.spec.held_out)
            sig = signature(conv)
            if sig in self.seen:  # a repeat of an earlier index (the same on every run, so resume agrees)
                continue
            self.seen.add(sig)
            turns = self.done.get(i, {})
            if len(turns) >= conv.turns or any(t["finish"] not in ANSWERED for t in turns.values()):
                continue
            if 1 in turns:  # turn 1 finished in an earlier run: continue from its recorded answer
                return self.make_work(i, 2, conv, turns[1]["answer_ids"])
            return self.make_work(i, 1, conv, None)
        return None

    def next_window(self) -> bool:
        """Queue the next ``window`` unfinished conversations, shortest prompt first; False when none are left.

        A decode step pads every row to the longest context in the batch, so running
        prompts of similar length together (tool prompts and second turns are the long
        ones) keeps that padding, which dominates a step's cost on CPU, small.
        """
        batch: list[Work] = []
        while len(batch) < self.spec.window and (work := self.next_conversation()) is not None:
            batch.append(work)
        self.queue.extend(sorted(batch, key=lambda w: len(w.prompt_ids)))
        return bool(batch)

    def fill(self, engine, params) -> None:
        """Keep twice the engine's batch in flight, so a finished sequence's place is taken at once."""
        while self.inflight < 2 * self.spec.concurrency:
            if not self.queue and (self.have + self.new_tokens >= self.spec.target_tokens or not self.next_window()):
                return
            work = self.queue.popleft()
            if len(work.prompt_ids) > self.spec.settings.max_prompt_len:
                self.record(work, [], "skipped")
                continue
            sink, request = self.sink_for(work, engine)
            request["id"] = engine.submit(self.loaded.name, "ar", work.prompt_ids, params, sink)
            self.inflight += 1

    def run(self, log_every: float) -> dict:
        from ..deployment import CompileSpec, PoolSpec, build_deployment
        from ..engine.engine import EngineConfig
        from ..engine.sampling import SamplingParams

        s, c = self.spec.settings, self.spec.concurrency
        self.manifest()
        self.log(f"distil: {self.out}: {sum(map(len, self.done.values()))} records, {self.have} answer tokens "
                 f"on disk; target {self.spec.target_tokens}")
        per_seq = -(-(s.max_prompt_len + s.max_new_tokens) // 16) + 1
        dep = build_deployment([self.loaded], EngineConfig(max_num_seqs=c, max_batched_tokens=1024,
                                                           max_waiting=4 * c + 8),
                               PoolSpec(block_size=16, num_blocks=c * per_seq + 64),
                               compile=CompileSpec(cache_dir=self.spec.compile_dir) if self.spec.compile_dir else None)
        params = SamplingParams(max_tokens=s.max_new_tokens, temperature=s.temperature,
                                seed=s.seed if s.temperature > 0 else None)
        started = last_log = time.perf_counter()
        try:
            while True:
                self.fill(dep.engine, params)
                if not dep.engine.has_work():
                    break
                dep.engine.step()
                if time.perf_counter() - last_log >= log_every:
                    last_log = time.perf_counter()
                    self.log(f"distil: {self.have + self.new_tokens} answer tokens ({self.new_tokens} this run, "
                             f"{self.new_records} records), {self.new_tokens / (last_log - started):.1f} tok/s, "
                             f"{self.inflight} in flight")
                    self.manifest()
        finally:
            self.writer.close()
            manifest = self.manifest()
        rate = self.new_tokens / max(time.perf_counter() - started, 1e-9)
        self.log(f"distil: done: {manifest['answer_tokens']} answer tokens in {manifest['records']} records "
                 f"({rate:.1f} tok/s this run)")
        return manifest


def distil(loaded: LoadedModel, out: Path, spec: JobSpec, log: Callable[[str], None],
           log_every: float = 30.0) -> dict:
    """Answer conversations 0, 1, ... until ``spec.target_tokens`` answer tokens exist in ``out``; resumable."""
    return Distiller(loaded, out, spec, log).run(log_every)


def main(argv: list[str] | None = None) -> int:
    from dualserve.models.hub import default_cache_dir, resolve_model
    from dualserve.models.loader import load_model

    p = argparse.ArgumentParser(prog="python -m dualserve.decoders.training.distil",
                                description="Self-distil the target's answers into resumable shards.")
    p.add_argument("--model", default=None, help="target: HF directory, .gguf file or known name (default model)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--quantization", default="auto", choices=["auto", *QUANTIZATIONS],
                   help="weight format; auto keeps the checkpoint's (int4 for the default Q4 GGUF), as served")
    p.add_argument("--out", default=None, help="default: <cache>/distil/<model>-<format>")
    p.add_argument("--tokens", type=int, default=500_000, help="stop once this many answer tokens exist")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (recorded per record)")
    p.add_argument("--max-new-tokens", type=int, default=400)
    p.add_argument("--max-prompt-len", type=int, default=1536)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loop-window", type=int, default=96, help="cut an answer once its last N tokens loop "
                   "(0: never)")
    p.add_argument("--prompts", default=None, help="answer this JSONL file's prompts ({\"prompt\": ...} or "
                   "{\"messages\": [...]} per line, e.g. logged requests) instead of the generated set")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile", action="store_true", help="compiled steps (built on a background thread, eager "
                   "until ready; on one busy core the build takes long and slows the eager steps meanwhile)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    cache = default_cache_dir(args.cache_dir)
    name, path = resolve_model(args.model, cache)
    loaded = load_model(path, name=name, dtype=torch.float32, cache_dir=cache, quantization=args.quantization)
    out = Path(args.out) if args.out else cache / "distil" / model_key(loaded)
    root = Path(__file__).resolve().parents[2]
    held_out = default_held_out(root)
    conversations, prompts = None, ""
    if args.prompts:
        try:
            conversations = file_conversations(Path(args.prompts), held_out)
            prompts = hashlib.sha1(Path(args.prompts).read_bytes()).hexdigest()[:12]
        except (OSError, ValueError) as e:
            raise SystemExit(f"--prompts: {e}")
    settings = Settings(args.seed, args.temperature, args.max_new_tokens, args.max_prompt_len, loaded.name,
                        loaded.quantization, args.loop_window, prompts)
    files = sorted(str(f.relative_to(root)) for f in (root / "clients" / "prompts").glob("*.jsonl"))
    spec = JobSpec(settings, args.tokens, args.concurrency, held_out, tuple(files),
                   compile_dir=cache / "compile" if args.compile else None, conversations=conversations)
    with torch.inference_mode():
        distil(loaded, out, spec, lambda m: print(time.strftime("%H:%M:%S"), m, flush=True))
    return 0


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
