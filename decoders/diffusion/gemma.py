"""DiffusionGemma's canvas loop, served by the engine as the ``diffusion`` decoder.

The algorithm is transformers' ``DiffusionGemmaGenerationMixin.generate`` (uniform-noise block
diffusion; the model is ``dualserve.models.diffusion_gemma``), one request at a time:

  encode the prefix (prompt, then each finished canvas) into the KV cache
  canvas <- C uniformly random tokens                                           RNG draw 1
  for n = N, N-1, ..., 1 (N = max_denoising_steps):
      logits <- denoiser(canvas, self-conditioning = last step's scaled logits)
      scaled <- logits / T(n),  T(n) = t_min + (t_max - t_min) * n / N       temperature schedule
      sample  ~ softmax(scaled) per position                                    RNG draw 2
      accept the lowest-entropy positions while the sum of the entropies ranked below stays
          <= entropy_bound (entropy-bounded sampling, arXiv:2505.24857); the lowest is always kept
      canvas <- accepted positions take the sample, the others fresh random tokens  RNG draw 3
      stop early when the argmax canvas equals the last S ones and the mean entropy < threshold
  the canvas's output is the LAST ARGMAX, not the sampled canvas

Every rule is a function on tensors that keeps the reference's batch dimension of 1, and draws
come from the request's own generator in the reference's order (randint, multinomial, randint),
so a seeded request reproduces ``generate`` on a batch of one token for token.

Serving (``DiffusionGemmaDecoder``): a request alternates two phases, each step either
  * *encode*: a chunk of not-yet-cached tokens (the prompt, possibly in several chunks, or the
    canvas just committed) goes through the encoder, whose keys/values are written to the shared
    paged block pool; when the chunk completes the prefix a new canvas starts in the same step;
  * *denoise*: one denoiser forward over the canvas, reading the pool (its own keys/values go
    to the runner's scratch block, never read).
Both run through the model's ``ModelRunner``: it owns the KV (one shape per layer) and builds the
windowed backend; the decoder describes each forward as ``ForwardItem``s (an encoder chunk
"causal", a canvas "bidirectional") and calls the model's ``encode`` or ``denoise`` on the
runner's ``inputs``. Encoder chunks of all requests share one forward, canvases of all requests
another. A finished canvas goes out through ``Request.commit`` (EOS, stop strings, max_tokens,
logprobs applied there, exactly), then is encoded at the same positions before the next canvas.
The pool holds the prefix for every layer, sliding ones included, because the pool's block ids
index one layout per model; sliding layers simply read only the last W-1 cached tokens, as the
reference's ``DynamicSlidingWindowLayer`` keeps. Encoder KV is exact and causal, so full
blocks go to the prefix cache like an AR model's. ``num_forwards`` counts denoiser passes
(the reference's ``tokens_per_forward`` denominator); ``steps_per_block`` the passes per canvas.

Without the engine, ``generate`` runs the same loop for one prompt over ``DenseCache``, which keeps
the prefix as the reference's ``DynamicCache`` does.

Sampling parameters: ``temperature`` scales the schedule (1, the OpenAI default, is the
checkpoint's own); 0 takes the argmax instead of a sample. The canvas noise still comes from the
request's generator, which at temperature 0 without a seed starts from a fixed seed
(``sampling.request_seed``), so temperature 0 gives the same text on every call and in any batch
(each request draws only from its own generator); a seed picks other noise.
``top_k``/``top_p``/``min_p`` truncate the per-position distribution. Penalties and logit bias do
not apply to a canvas and are ignored; grammars, infill suffixes and prompt logprobs are refused
(``_unsupported``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from dualserve.models.diffusion_gemma import DenoisingConfig, DiffusionGemma, DiffusionGemmaConfig, attend
from dualserve.models.loader import LoadedModel

from ..ar import pending_tokens
from ..engine.blocks import BlockPool
from ..engine.attention.windowed import window_pattern
from ..engine.request import DecoderState, Request
from ..engine.runner import ForwardItem, ModelRunner
from ..engine.sampling import SamplingParams, make_generator, token_logprobs, truncated_probs
from ..engine.scheduler import Scheduled
from .decoder import DiffusionCounters

# ---- the sampler's rules -------------------------------------------------------------------------


def schedule_temperature(cfg: DenoisingConfig, cur_step: int) -> torch.Tensor:
    """T(n) = t_min + (t_max - t_min) * n / N for n = N..1: t_max first, t_min never reached.

    Evaluated with the same fp32 tensor ops as ``LinearTemperatureScheduleLogitsProcessor`` (the
    step is an int32 tensor there), so dividing by it rounds identically.
    """
    step = torch.tensor(cur_step, dtype=torch.int32)
    return cfg.t_min + (cfg.t_max - cfg.t_min) * (step / cfg.max_denoising_steps)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last axis, as ``Categorical(logits=...).entropy()``."""
    logp = logits - logits.logsumexp(dim=-1, keepdim=True)
    return -(logp.clamp(min=torch.finfo(logp.dtype).min) * torch.softmax(logp, dim=-1)).sum(-1)


def entropy_bounded_accept(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """(1, C) bool: the k lowest-entropy positions with sum(H_1..H_k) - max(H_1..H_k) <= bound.

    The left side bounds the mutual information among the accepted tokens (arXiv:2505.24857), so
    they can be sampled independently; the lowest-entropy position is always accepted.
    """
    ranked, order = torch.sort(entropy, dim=-1, descending=False)
    keep = torch.cumsum(ranked, dim=-1) - ranked <= bound
    return torch.scatter(torch.zeros_like(keep), -1, order, keep)


@dataclass
class Canvas(DecoderState):
    """One request's canvas while it is denoised (batch dimension 1 kept, as in the reference)."""

    tokens: torch.Tensor                # (1, C) the noisy canvas fed to the next step
    argmax: torch.Tensor                # (1, C) latest argmax: the canvas's output when it stops
    remaining: int                      # n of the next step: N, N-1, ..., 1
    sc_logits: torch.Tensor | None = None  # (1, C, V) last step's scaled logits (self-conditioning)
    history: torch.Tensor | None = None    # (S, 1, C) last S argmax canvases, -1 before any
    raw_logits: torch.Tensor | None = None  # (1, C, V) last step's logits, kept for logprobs
    steps: int = 0
    done: bool = False


def new_canvas(config: DiffusionGemmaConfig, steps: int, generator: torch.Generator) -> Canvas:
    """C uniformly random tokens, to be denoised in at most ``steps`` steps."""
    device = generator.device
    tokens = torch.randint(0, config.vocab_size, (1, config.canvas_length), generator=generator, device=device)
    return Canvas(tokens=tokens, argmax=tokens, remaining=steps)


def draw(scaled: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """(1, C) tokens from (1, C, V) scaled logits: argmax at temperature 0, else a sample."""
    if params.greedy:
        return scaled.argmax(-1)
    if params.top_k or params.top_p < 1.0 or params.min_p > 0:
        probs = truncated_probs(scaled, dataclasses.replace(params, temperature=1.0))
    else:
        probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
    # Drawn on the generator's device (a CPU generator cannot draw for CUDA probabilities).
    rows = probs.view(-1, probs.shape[-1]).to(generator.device)  # (C, V)
    return torch.multinomial(rows, 1, generator=generator).view(scaled.shape[:2]).to(scaled.device)


def denoise_update(canvas: Canvas, logits: torch.Tensor, cfg: DenoisingConfig, params: SamplingParams,
                   generator: torch.Generator, keep_logits: bool = False) -> None:
    """One denoising step on (1, C, V) fp32 logits; updates ``canvas`` in place."""
    temperature = schedule_temperature(cfg, canvas.remaining).to(logits.device)
    if not params.greedy and params.temperature != 1.0:
        temperature = temperature * params.temperature
    scaled = logits / temperature
    sample = draw(scaled, params, generator)
    argmax = scaled.argmax(-1)
    entropy = token_entropy(scaled)                                         # (1, C)
    accepted = entropy_bounded_accept(entropy, cfg.entropy_bound)
    kept = torch.where(accepted, sample, canvas.tokens)
    noise = torch.randint(0, logits.shape[-1], kept.shape, generator=generator, device=generator.device)
    canvas.tokens = torch.where(~accepted, noise.to(kept.device), kept)
    if cfg.stability_threshold is not None and cfg.confidence_threshold is not None:
        canvas.done = stable_and_confident(canvas, argmax, entropy, cfg)
    canvas.argmax = argmax
    canvas.sc_logits = scaled
    canvas.raw_logits = logits if keep_logits else None
    canvas.remaining -= 1
    canvas.steps += 1
    canvas.done = canvas.done or canvas.remaining == 0


def stable_and_confident(canvas: Canvas, argmax: torch.Tensor, entropy: torch.Tensor, cfg: DenoisingConfig) -> bool:
    """The argmax canvas equals each of the last S (``StableAndConfidentStoppingCriteria``), and the
    mean entropy of the scaled logits is below the confidence threshold."""
    s = cfg.stability_threshold
    stable = True
    if s:
        if canvas.history is None:
            canvas.history = torch.full((s, *argmax.shape), -1, dtype=argmax.dtype, device=argmax.device)
        stable = bool((canvas.history == argmax[None]).all())
        canvas.history = torch.roll(canvas.history, shifts=-1, dims=0)
        canvas.history[-1] = argmax
    return stable and bool(torch.mean(entropy, dim=-1)[0] < cfg.confidence_threshold)


# ---- without the engine: one prompt, a dense cache -----------------------------------------------


class DenseCache:
    """One sequence's encoder KV as ``DynamicCache`` keeps it: full layers keep every token,
    sliding layers the last W-1 (all a later query can see). ``writer()`` is the encoder's
    backend (append, causal/sliding mask), ``reader()`` the denoiser's (read only, no mask)."""

    def __init__(self, config: DiffusionGemmaConfig):
        self.config = config
        self.k: list[torch.Tensor | None] = [None] * config.num_layers
        self.v: list[torch.Tensor | None] = [None] * config.num_layers
        self.seen = [0] * config.num_layers  # tokens encoded so far, per layer

    @property
    def length(self) -> int:
        return self.seen[0]

    def _write(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cached_k, cached_v = self.k[layer_idx], self.v[layer_idx]
        kk = k if cached_k is None else torch.cat([cached_k, k])
        vv = v if cached_v is None else torch.cat([cached_v, v])
        window = self.config.windows[layer_idx]
        mask, causal = window_pattern(kk.shape[0], q.shape[0], self.seen[layer_idx] + q.shape[0], window, q.device)
        out = attend(q, kk, vv, mask, causal)
        keep = kk.shape[0] if window is None else window - 1
        self.k[layer_idx], self.v[layer_idx] = kk[-keep:], vv[-keep:]
        self.seen[layer_idx] += q.shape[0]
        return out

    def _read(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cached_k, cached_v = self.k[layer_idx], self.v[layer_idx]
        if cached_k is not None:
            k, v = torch.cat([cached_k, k]), torch.cat([cached_v, v])
        return attend(q, k, v, None)

    def writer(self):
        return self._write

    def reader(self):
        return self._read


@torch.inference_mode()
def generate(model: DiffusionGemma, prompt_ids: Sequence[int], max_new_tokens: int, generator: torch.Generator,
             denoising: DenoisingConfig | None = None, params: SamplingParams = SamplingParams(),
             eos_token_ids: Sequence[int] = ()) -> list[int]:
    """Whole canvases for one prompt, ending with the first canvas that holds an EOS (not cut)."""
    cfg, device = model.config, model.embed_tokens.weight.device
    denoising = denoising or cfg.denoising
    cache = DenseCache(cfg)
    new = torch.tensor(list(prompt_ids), device=device)
    out: list[int] = []
    for _ in range(math.ceil(max_new_tokens / cfg.canvas_length)):
        start = cache.length
        model.encode(new, torch.arange(start, start + len(new), device=device), cache.writer())
        positions = torch.arange(start + len(new), start + len(new) + cfg.canvas_length, device=device)
        canvas = new_canvas(cfg, denoising.max_denoising_steps, generator)
        while not canvas.done:
            sc = canvas.sc_logits[0] if canvas.sc_logits is not None else None
            logits = model.denoise(canvas.tokens[0].to(device), positions, cache.reader(), sc)
            denoise_update(canvas, logits[None], denoising, params, generator)
        new = canvas.argmax[0].to(device)
        out += new.tolist()
        if any(t in eos_token_ids for t in new.tolist()):
            break
    return out


# ---- the engine decoder --------------------------------------------------------------------------


def _unsupported(req: Request) -> str | None:
    if req.suffix_ids:
        return "DiffusionGemma cannot infill: its canvas sees only the text before it"
    if req.constraint is not None or req.needs_prompt_logprobs:
        return "structured output and prompt logprobs need an autoregressive decoder"
    return None


class DiffusionGemmaDecoder:
    name = "diffusion"
    supports_infill = False  # the canvas sees only the text before it
    shares_prompt_blocks = True
    default_max_tokens = 256  # a canvas is sized by max_tokens
    draft_choices = ()

    def __init__(self, runner: ModelRunner, pool: BlockPool, denoising: DenoisingConfig | None = None):
        model = runner.model
        if not isinstance(model, DiffusionGemma):
            raise TypeError(f"the DiffusionGemma decoder needs a DiffusionGemma runner, not {type(model).__name__}")
        self.runner = runner
        self.model = model
        self.config = model.config
        self.pool = pool
        self.denoising = denoising or model.config.denoising
        self.device = model.embed_tokens.weight.device

    @property
    def kv_owner(self) -> ModelRunner:
        return self.runner

    def plan(self, req: Request, budget: int) -> tuple[int, int]:
        """(tokens to encode, slots to reserve) or, while denoising, (canvas compute, the rest).

        Encoding that finishes the prefix reserves the canvas's slots (it is encoded later).
        A canvas is never stored; it counts against the step's token budget as far as the budget
        goes, but always runs, so a canvas longer than the budget cannot stall.
        """
        size = self.config.canvas_length
        if isinstance(req.decoder_state, Canvas):
            work = min(size, max(budget, 0))
            return work, size - work
        if budget <= 0:
            return 0, 0
        pending = pending_tokens(req, self.pool)
        n = min(pending, budget)
        return n, size if n == pending else 0  # (0, size) when all is cached: the canvas starts

    def step(self, batch: Sequence[Scheduled], emit) -> None:
        encode = []
        for s in batch:
            req = s.request
            error = _unsupported(req)
            if error is not None:
                delta = req.finish("error")
                delta.error = error
                emit(req, delta)
            elif req.decoder_state is None and s.num_new_tokens > 0:
                encode.append(s)
            elif req.decoder_state is None and req.num_computed == req.num_tokens:
                self._start_canvas(req)
        if encode:
            self._encode(encode)
        canvases = [s.request for s in batch if isinstance(s.request.decoder_state, Canvas)]
        if canvases:
            self._denoise(canvases, emit)

    def _start_canvas(self, req: Request) -> None:
        req.decoder_state = new_canvas(self.config, self.denoising.max_denoising_steps, self._generator(req))

    def _generator(self, req: Request) -> torch.Generator:
        """The request's generator, remade once on the model's device from the request's seed
        (``Request.seed``): every draw is made on the device of the logits it samples from."""
        if req.generator.device != self.device:
            req.generator = make_generator(req.seed, self.device)
        return req.generator

    @torch.inference_mode()
    def _encode(self, batch: Sequence[Scheduled]) -> None:
        items = []
        for s in batch:
            req, start = s.request, s.request.num_computed
            end = start + s.num_new_tokens
            items.append(ForwardItem(req.all_ids[start:end], range(start, end), start, list(req.table.blocks),
                                     self.pool.slot_mapping(req.table, start, end), mask="causal"))
        self.runner.encode(items)
        for s in batch:
            req = s.request
            done = req.num_computed + s.num_new_tokens
            self.pool.mark_written(req.table, req.all_ids, done)
            if done == req.num_tokens:
                self._start_canvas(req)

    @torch.inference_mode()
    def _denoise(self, reqs: Sequence[Request], emit) -> None:
        size = self.config.canvas_length
        states = [r.decoder_state for r in reqs if isinstance(r.decoder_state, Canvas)]
        # A canvas sees its whole self and the cached prefix; its keys/values are never stored.
        items = [ForwardItem(st.tokens[0], range(r.num_tokens, r.num_tokens + size), r.num_tokens,
                             list(r.table.blocks), None, mask="bidirectional") for r, st in zip(reqs, states)]
        sc, rows = self._self_conditioning(states)
        logits = self.runner.denoise(items, sc, rows)
        for i, (req, st) in enumerate(zip(reqs, states)):
            denoise_update(st, logits[i * size:(i + 1) * size][None], self.denoising, req.params,
                           self._generator(req), keep_logits=req.params.logprobs is not None)
            req.num_forwards += 1
            if st.done:
                self._commit(req, st, emit)

    def _self_conditioning(self, states: Sequence[Canvas]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Flattened (tokens, V) self-conditioning logits and the rows that have them (None = all)."""
        have = [st.sc_logits is not None for st in states]
        if not any(have):
            return None, None
        size, vocab = self.config.canvas_length, self.config.vocab_size
        sc = torch.cat([st.sc_logits[0] if st.sc_logits is not None else
                        torch.zeros(size, vocab, device=self.device) for st in states])
        if all(have):
            return sc, None
        return sc, torch.tensor(have, device=self.device).repeat_interleave(size)

    def _commit(self, req: Request, st: Canvas, emit) -> None:
        req.counters_of(DiffusionCounters).steps_per_block.append(st.steps)
        req.decoder_state = None
        tokens = st.argmax[0].tolist()
        logprobs = None
        if req.params.logprobs is not None:
            logprobs = token_logprobs(st.raw_logits[0], tokens, req.params.logprobs)
        emit(req, req.commit(tokens, logprobs))


def register_diffusion_gemma(engine, name: str, runner: ModelRunner, loaded: LoadedModel,
                             denoising: DenoisingConfig | None = None) -> DiffusionGemmaDecoder:
    """Serve a loaded DiffusionGemma as ``name``'s ``diffusion`` decoder, through its runner's KV."""
    decoder = DiffusionGemmaDecoder(runner, engine.pool, denoising)
    engine.add_decoder(name, decoder, loaded.tokenizer, loaded.config.vocab_size)
    return decoder
