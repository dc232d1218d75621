"""In-process benchmark of the diffusion decoder against plain AR decoding, on the fixed prompt set.

Run as ``python -m dualserve.clients.bench_diffusion``. For each model pair it decodes every
prompt of ``prompts/bench.jsonl`` one at a time (single stream, greedy) through the real engine
(scheduler, block pool, paged attention) and reports, per decoder:

- tokens per forward (completion tokens / model forwards, prefill included);
- forward time: mean wall time of one ``ModelRunner.forward`` (the model alone), and of one
  engine step (model + unmasking policy + bookkeeping);
- single-stream tokens/s (completion tokens / wall time), and the ratio to AR in the same run.

Model pairs:

- ``tiny-random``: a small random block-diffusion transformer (Qwen2 layout, shifted logits,
  block 8) over a byte-level vocabulary, decoded by the ``diffusion`` decoder and, with the same
  weights under causal attention, by the ``ar`` decoder. The output head is scaled (``--sharpen``)
  so logits are peaked like a trained model's and thresholds commit several tokens per step; the
  tokens are meaningless, the costs are real;
- ``twin``: when a diffusion twin of the default model exists (``models/assets/twin-smollm2``,
  or ``--twin PATH``), the default model under ``ar`` against its twin under ``diffusion``, with
  the chat template and EOS (each decoder stops where its own answer ends).

Each engine is private to one decoder, so nothing is shared through the prefix cache.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from dualserve.decoders.ar import ARDecoder
from dualserve.decoders.diffusion.decoder import DiffusionConfig, default_config, register_diffusion
from dualserve.decoders.diffusion.cache import DualCache, ExactCache, NoCache, PrefixCache
from dualserve.decoders.diffusion.policies import Threshold
from dualserve.decoders.engine.engine import Engine, EngineConfig
from dualserve.decoders.engine.runner import ModelRunner
from dualserve.decoders.engine.sampling import SamplingParams
from dualserve.models.config import ModelConfig
from dualserve.models.loader import LoadedModel
from dualserve.models.transformer import Transformer

from .bench import DEFAULT_PROMPTS, load_prompts

DEFAULT_TWIN = Path(__file__).resolve().parent.parent / "models" / "assets" / "twin-smollm2"
CACHES = {"none": NoCache(), "exact": ExactCache(), "prefix": PrefixCache(), "dual": DualCache()}


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; 256 is the [MASK] id; no EOS (the random model has no answer end)."""

    vocab_size = 258
    eos_token_ids: list[int] = []

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def tiny_random_model(seed: int, sharpen: float, device: str) -> LoadedModel:
    """A 4-layer random block-diffusion transformer over ``ByteTokenizer`` ids."""
    config = ModelConfig(family="block_diffusion", vocab_size=ByteTokenizer.vocab_size, hidden_size=128,
                         num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256,
                         attention_bias=True, mask_token_id=256, diffusion_block_size=8, shift_logits=True)
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        model.lm_head.weight.mul_(sharpen)
    model = model.to(device).eval().requires_grad_(False)
    model.rotary.reset(device)
    return LoadedModel("tiny-random", Path("."), config, model, ByteTokenizer(), 0.0)


class ForwardTimer:
    """Wraps one runner's ``forward`` to add up the model's own time (CUDA-synchronised)."""

    def __init__(self, runner: ModelRunner):
        self.seconds = 0.0
        self.calls = 0
        self._forward = runner.forward
        self._cuda = runner.device.type == "cuda"
        runner.forward = self  # an instance attribute shadows the method for this runner only

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self._forward(*args, **kwargs)
        if self._cuda:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out


@dataclass
class Row:
    pair: str
    decoder: str
    config: str
    prompts: int = 0
    tokens: int = 0
    forwards: int = 0
    steps: int = 0
    forward_seconds: float = 0.0
    wall_seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    def summary(self) -> dict:
        return {"pair": self.pair, "decoder": self.decoder, "config": self.config, "prompts": self.prompts,
                "tokens": self.tokens, "forwards": self.forwards,
                "tokens_per_forward": round(self.tokens / max(self.forwards, 1), 3),
                "forward_ms": round(1e3 * self.forward_seconds / max(self.forwards, 1), 3),
                "step_ms": round(1e3 * self.wall_seconds / max(self.steps, 1), 3),
                "tok_s": round(self.tokens / max(self.wall_seconds, 1e-9), 2)}


def measure_one(engine: Engine, model: str, decoder: str, timer: ForwardTimer, ids: list[int],
                params: SamplingParams, row: Row) -> None:
    """Decode one prompt alone (single stream); add its tokens, forwards and times to ``row``."""
    got: list[int] = []
    stats: dict = {}

    def sink(_index, delta) -> None:
        got.extend(delta.token_ids)
        if delta.finish_reason is not None:
            stats.update(delta.stats or {})

    steps, forward_seconds = engine.stats.steps, timer.seconds
    start = time.perf_counter()
    engine.submit(model, decoder, ids, params, sink)
    engine.run_until_idle()
    row.wall_seconds += time.perf_counter() - start
    row.forward_seconds += timer.seconds - forward_seconds
    row.steps += engine.stats.steps - steps
    row.forwards += stats.get("forward_passes", 0)
    row.tokens += len(got)
    row.prompts += 1
    row.outputs.append(got)


def engine_for(loaded: LoadedModel, decoder: str, config: DiffusionConfig | None, device: str,
               num_blocks: int) -> tuple[Engine, ForwardTimer]:
    engine = Engine(EngineConfig(num_blocks=num_blocks, block_size=16, max_batched_tokens=2048))
    runner = ModelRunner(loaded.model, num_blocks, 16, device=device)
    timer = ForwardTimer(runner)
    if decoder == "ar":
        engine.add_decoder(loaded.name, ARDecoder(runner, engine.pool), loaded.tokenizer, loaded.config.vocab_size)
    else:
        register_diffusion(engine, loaded.name, runner, loaded, config)
    return engine, timer


def config_label(config: DiffusionConfig) -> str:
    policy = config.policy
    rule = f"tau={policy.tau:g}" if isinstance(policy, Threshold) else type(policy).__name__
    cache = next(k for k, v in CACHES.items() if type(v) is type(config.cache))
    return f"{rule} block={config.block_length} cache={cache}"


def bench_pair(pair: str, ar: LoadedModel, diffusion: LoadedModel, prompts: list[list[int]],
               params: SamplingParams, configs: list[DiffusionConfig], device: str) -> list[Row]:
    """AR and every diffusion config on each prompt in turn, so load drift hits all alike."""
    num_blocks = max(64, 4 * (max(map(len, prompts)) + params.max_tokens) // 16)
    runs: list[tuple[LoadedModel, str, DiffusionConfig | None]] = [(ar, "ar", None)]
    runs += [(diffusion, "diffusion", c) for c in configs]
    setups = []
    for loaded, decoder, config in runs:
        engine, timer = engine_for(loaded, decoder, config, device, num_blocks)
        measure_one(engine, loaded.name, decoder, timer, prompts[0], params, Row(pair, decoder, ""))  # warm-up
        label = "" if config is None else config_label(config)
        setups.append((loaded, decoder, engine, timer, Row(pair, decoder, label)))
    for ids in prompts:
        for loaded, decoder, engine, timer, row in setups:
            measure_one(engine, loaded.name, decoder, timer, ids, params, row)
    return [row for *_, row in setups]


def twin_pair(path: Path, device: str) -> tuple[LoadedModel, LoadedModel, Callable[[str], list[int]]]:
    from dualserve.decoders.training.diffusion_data import chat_prompt_ids
    from dualserve.models.loader import load_twin
    from dualserve.models.hub import default_cache_dir, resolve_model
    from dualserve.models.loader import load_model

    cache = default_cache_dir()
    name, base_path = resolve_model(None, cache)
    base = load_model(base_path, name=name, device=device, cache_dir=cache)
    twin = load_twin(path, base=base, name=f"{name}-twin")
    return base, twin, lambda text: chat_prompt_ids(base, text)


def print_table(rows: list[Row]) -> None:
    cols = ["pair", "decoder", "config", "tokens", "forwards", "tokens_per_forward", "forward_ms", "step_ms", "tok_s",
            "vs_ar"]
    table = []
    for r in rows:
        s = r.summary()
        ar = next(x for x in rows if x.pair == r.pair and x.decoder == "ar").summary()
        s["vs_ar"] = f"{s['tok_s'] / max(ar['tok_s'], 1e-9):.2f}x"
        table.append([str(s[c]) for c in cols])
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dualserve.clients.bench_diffusion", description=__doc__.split("\n")[0])
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSONL prompt set")
    p.add_argument("--num-prompts", type=int, default=16, help="first N prompts of the set (0: all)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--taus", default="0.9,0.7", help="threshold policies to run (comma-separated)")
    p.add_argument("--cache", choices=sorted(CACHES), default=None, help="cache strategy (default: the model's)")
    p.add_argument("--twin", default=str(DEFAULT_TWIN), help="twin directory (skipped when absent)")
    p.add_argument("--skip-tiny", action="store_true")
    p.add_argument("--sharpen", type=float, default=8.0, help="output-head scale of the tiny random model")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--json", default=None, help="write the summary rows here")
    return p.parse_args(argv)


def configs_for(model: ModelConfig, taus: list[float], cache: str | None) -> list[DiffusionConfig]:
    base = default_config(model)
    if cache:
        base = DiffusionConfig(block_length=base.block_length, policy=base.policy, cache=CACHES[cache])
    return [DiffusionConfig(block_length=base.block_length, policy=Threshold(t), cache=base.cache) for t in taus]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    texts = [p.prompt for p in load_prompts(args.prompts)]
    texts = texts[: args.num_prompts] if args.num_prompts else texts
    taus = [float(t) for t in args.taus.split(",") if t]
    rows: list[Row] = []
    if not args.skip_tiny:
        tiny = tiny_random_model(0, args.sharpen, args.device)
        ids = [tiny.tokenizer.encode(t) for t in texts]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        rows += bench_pair("tiny-random", tiny, tiny, ids, params, configs_for(tiny.config, taus, args.cache),
                           args.device)
    twin_path = Path(args.twin)
    if (twin_path / "config.json").exists():
        base, twin, encode = twin_pair(twin_path, args.device)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        rows += bench_pair("twin", base, twin, [encode(t) for t in texts], params,
                           configs_for(twin.config, taus, args.cache), args.device)
    else:
        print(f"no twin at {twin_path}: only the tiny random model is measured")
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [r.summary() for r in rows],
                                               "max_tokens": args.max_tokens, "prompts": len(texts),
                                               "device": args.device}, indent=2))
    return 0


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
