"""The measurement loops of the llama.cpp comparison: the same prompts sent to dualserve and to a
baseline server one after the other (who goes first alternating, ``settle`` seconds between
requests), the settle comparison, and the cold / warm prompt pairs; and the records they fill.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

from dualserve.clients.bench import (
    WARMUP_PROMPT,
    BenchSpec,
    LevelSummary,
    Prompt,
    RequestResult,
    ratios,
    stream_one,
    summarize_level,
)
from dualserve.clients.code_prompts import CodePrompt

COLD_MAX_TOKENS = 4  # the first token is what is timed; a few more show the answer is sane
WARM_LINE = "Keep the answer to one paragraph."


@dataclass
class SideBySide:
    """One single-stream comparison: dualserve with `decoder` against a baseline, alternating."""

    decoder: str
    ours: LevelSummary
    base: LevelSummary
    ours_requests: list[RequestResult] = field(default_factory=list)
    base_requests: list[RequestResult] = field(default_factory=list)

    @property
    def ratios(self) -> dict[str, float | None]:
        return ratios(self.ours, self.base)


@dataclass
class Aggregate:
    concurrency: int
    ours: LevelSummary
    base: LevelSummary
    ours_requests: list[RequestResult] = field(default_factory=list)
    base_requests: list[RequestResult] = field(default_factory=list)


@dataclass
class ColdRow:
    """Cold prompts of one size against one baseline, and the same prompts with a line added."""

    size: int  # the token budget the prompts were cut to
    cold: SideBySide
    warm: SideBySide  # each cold prompt plus WARM_LINE, sent right after it: the prefix is cached


@dataclass
class BaselineRun:
    """Everything measured against one baseline server on one file."""

    server: str  # "llama-server" or "llama-cpp-python"
    model: str
    single: list[SideBySide]
    aggregate: Aggregate | None
    settle_ratio: float | None = None  # dualserve ar no-settle / settle decode tok/s (--settle-compare)
    cold: list[ColdRow] = field(default_factory=list)
    url: str = ""
    commands: list[list[str]] = field(default_factory=list)  # the baseline's, where this command started it


async def timed(client, spec: BenchSpec, prompt: Prompt) -> tuple[RequestResult, float]:
    t0 = time.perf_counter()
    res = await stream_one(client, spec, prompt)
    return res, time.perf_counter() - t0


async def _warm(ours, ours_spec: BenchSpec, base, base_spec: BenchSpec, warmup: int) -> None:
    for _ in range(warmup):
        await stream_one(ours, ours_spec, WARMUP_PROMPT)
        await stream_one(base, base_spec, WARMUP_PROMPT)


def _progress(label: str, prompt: Prompt, o: RequestResult, b: RequestResult, base_name: str) -> None:
    print(f"  {label:<9} {prompt.id:<18} ours {_tps(o):>6} tok/s ({o.tokens:>3} tok)  "
          f"{base_name} {_tps(b):>6} tok/s ({b.tokens:>3} tok)", file=sys.stderr, flush=True)


async def side_by_side(ours, ours_spec: BenchSpec, base, base_spec: BenchSpec, prompts: Sequence[Prompt],
                       n: int, warmup: int, settle: float = 0.0, base_name: str = "llama.cpp") -> SideBySide:
    """n prompts, each sent to both servers one after the other, ``settle`` seconds apart; who goes
    first alternates."""
    await _warm(ours, ours_spec, base, base_spec, warmup)
    runs: dict[str, list[RequestResult]] = {"ours": [], "base": []}
    wall = {"ours": 0.0, "base": 0.0}
    sides = {"ours": (ours, ours_spec), "base": (base, base_spec)}
    for i in range(n):
        prompt = prompts[i % len(prompts)]
        for side in (("ours", "base") if i % 2 == 0 else ("base", "ours")):
            await asyncio.sleep(settle)
            res, seconds = await timed(*sides[side], prompt)
            runs[side].append(res)
            wall[side] += seconds
        _progress(ours_spec.decoder or "default", prompt, runs["ours"][-1], runs["base"][-1], base_name)
    return SideBySide(ours_spec.decoder or "default", summarize_level(1, runs["ours"], wall["ours"]),
                      summarize_level(1, runs["base"], wall["base"]), runs["ours"], runs["base"])


async def settle_compare(ours, ours_spec: BenchSpec, base, base_spec: BenchSpec, prompts: Sequence[Prompt],
                         n: int, warmup: int, settle: float, base_name: str = "llama.cpp"
                         ) -> tuple[SideBySide, SideBySide]:
    """n prompts, each sent to dualserve twice, each time right after the baseline answered it:
    once ``settle`` seconds after, once with no pause (which first alternates by prompt). Returns
    the settled and the unsettled rows; both hold all 2n baseline requests."""
    await _warm(ours, ours_spec, base, base_spec, warmup)
    runs: dict[float, list[RequestResult]] = {settle: [], 0.0: []}
    wall = {settle: 0.0, 0.0: 0.0}
    base_runs: list[RequestResult] = []
    base_wall = 0.0
    for i in range(n):
        prompt = prompts[i % len(prompts)]
        for pause in ((settle, 0.0) if i % 2 == 0 else (0.0, settle)):
            await asyncio.sleep(settle)  # the baseline always starts on settled cores
            res, seconds = await timed(base, base_spec, prompt)
            base_runs.append(res)
            base_wall += seconds
            await asyncio.sleep(pause)
            res, seconds = await timed(ours, ours_spec, prompt)
            runs[pause].append(res)
            wall[pause] += seconds
            _progress(f"{ours_spec.decoder}+{pause:g}s", prompt, res, base_runs[-1], base_name)
    base_sum = summarize_level(1, base_runs, base_wall)
    d = ours_spec.decoder or "default"
    return (SideBySide(d, summarize_level(1, runs[settle], wall[settle]), base_sum, runs[settle], base_runs),
            SideBySide(f"{d} (no settle)", summarize_level(1, runs[0.0], wall[0.0]), base_sum, runs[0.0], base_runs))


def as_prompt(p: CodePrompt) -> Prompt:
    return Prompt(p.id, "code", p.text)


def with_line(p: CodePrompt) -> Prompt:
    return Prompt(f"{p.id} +line", "code", f"{p.text}\n{WARM_LINE}")


async def cold_row(ours, ours_spec: BenchSpec, base, base_spec: BenchSpec, prompts: Sequence[CodePrompt],
                   warmup: Sequence[CodePrompt], settle: float, base_name: str = "llama.cpp") -> ColdRow:
    """Each prompt to both servers (who goes first alternates), then each with WARM_LINE added in the
    same order, every request ``settle`` seconds after the previous one ended. ``warmup`` prompts go
    to both first, unmeasured."""
    for p in warmup:
        for client, spec in ((ours, ours_spec), (base, base_spec)):
            await asyncio.sleep(settle)
            await stream_one(client, spec, as_prompt(p))
    sides = {"ours": (ours, ours_spec), "base": (base, base_spec)}
    runs: dict[tuple[str, str], list[RequestResult]] = {}
    wall: dict[tuple[str, str], float] = {}
    for i, p in enumerate(prompts):
        for kind, prompt in (("cold", as_prompt(p)), ("warm", with_line(p))):
            for side in (("ours", "base") if i % 2 == 0 else ("base", "ours")):
                await asyncio.sleep(settle)
                res, seconds = await timed(*sides[side], prompt)
                runs.setdefault((kind, side), []).append(res)
                wall[kind, side] = wall.get((kind, side), 0.0) + seconds
        _cold_progress(p, runs, base_name)

    def pair(kind: str) -> SideBySide:
        o, b = runs[kind, "ours"], runs[kind, "base"]
        return SideBySide(f"{kind} {prompts[0].size}", summarize_level(1, o, wall[kind, "ours"]),
                          summarize_level(1, b, wall[kind, "base"]), o, b)

    return ColdRow(prompts[0].size, pair("cold"), pair("warm"))


def _cold_progress(p: CodePrompt, runs: dict[tuple[str, str], list[RequestResult]], base_name: str) -> None:
    def ms(r: RequestResult) -> str:
        return "err" if not r.ok else (f"{r.ttft * 1e3:.0f}" if r.ttft is not None else "-")

    o, b, ow, bw = (runs[k][-1] for k in (("cold", "ours"), ("cold", "base"), ("warm", "ours"), ("warm", "base")))
    print(f"  cold {p.id}  ours {ms(o)} ms ({o.prompt_tokens} tok), warm {ms(ow)} ms  "
          f"{base_name} {ms(b)} ms ({b.prompt_tokens} tok), warm {ms(bw)} ms", file=sys.stderr, flush=True)


def _tps(r: RequestResult) -> str:
    return "err" if not r.ok else (f"{r.decode_tps:.1f}" if r.decode_tps else "-")
