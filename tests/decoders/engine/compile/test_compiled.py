"""The compiled step: padded paged attention equals the eager backend, and compiled engines decode the
same greedy tokens as eager ones, in every batch composition, in fp32, with int4 weights and in w4a8."""

from __future__ import annotations

import random

import pytest
import torch

from dualserve.decoders.ar import ARDecoder
from dualserve.decoders.engine.attention.padded import ROWS_MAX, PaddedPagedAttention, StepShape
from dualserve.decoders.engine.engine import Engine, EngineConfig
from dualserve.decoders.engine.attention.paged_attention import KVCache, SdpaPagedAttention
from dualserve.decoders.engine.compile.step_graph import bit_exact
from dualserve.decoders.engine.runner import ModelRunner
from dualserve.decoders.engine.sampling import SamplingParams
from dualserve.models import kernels
from dualserve.models.quant import Dot8Linear, Int4Linear
from dualserve.models.transformer import Transformer
from tiny_engine import BLOCK, CFG, FakeTokenizer, meta_for, tiny


@pytest.mark.parametrize("seqs", [
    [(7, 1, "causal")],                                        # one decode
    [(7, 1, "causal"), (0, 1, "causal"), (13, 1, "causal")],   # a decode batch
    [(5, 6, "causal")],                                        # a prefill chunk
    [(9, 4, "bidirectional"), (3, 1, "causal")],               # a canvas beside a decode
    [(6, 4, torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool))],  # a tree
])
def test_padded_attention_equals_the_eager_backend(seqs) -> None:
    torch.manual_seed(1)
    caches = [KVCache(1, 32, BLOCK, 2, 16, torch.float32, "cpu") for _ in range(2)]
    for c in caches[1:]:
        c.k[0].copy_(caches[0].k[0].normal_())
        c.v[0].copy_(caches[0].v[0].normal_())
    total = sum(s[1] for s in seqs)
    q, k, v = torch.randn(total, 4, 16), torch.randn(total, 2, 16), torch.randn(total, 2, 16)
    want = SdpaPagedAttention(caches[0], meta_for(seqs))(0, q, k, v)
    before = caches[1].k[0].clone()
    padded = PaddedPagedAttention.build(caches[1], meta_for(seqs), "cpu")
    got = padded(0, q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The graph leaves the cache alone and hands back what to store: the same slots get the same values.
    assert torch.equal(caches[1].k[0], before)
    caches[1].store(padded.slot_mapping, torch.stack(padded.new_k), torch.stack(padded.new_v))
    torch.testing.assert_close(caches[1].k[0], caches[0].k[0], rtol=0, atol=0)
    torch.testing.assert_close(caches[1].v[0], caches[0].v[0], rtol=0, atol=0)


def engine_for(model: Transformer, compiled: bool) -> Engine:
    """An engine whose steps (prompts under ROWS_MAX tokens, within max_batched_tokens) all run
    the rows graph, so only that one is built."""
    engine = Engine(EngineConfig(num_blocks=256, block_size=BLOCK, max_batched_tokens=ROWS_MAX))
    runner = ModelRunner(model, 256, BLOCK, use_flash=False)
    if compiled:
        step = runner.compile()
        step.warm([(StepShape(False), ())])
        assert not step.failed and len(step.ready) == 1
    engine.add_decoder("m", ARDecoder(runner, engine.pool), FakeTokenizer(), CFG.vocab_size)
    return engine


def decode(engine: Engine, prompts: list[list[int]], waves: int) -> list[list[int]]:
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    per = max(1, len(prompts) // waves)
    for start in range(0, len(prompts), per):
        for i in range(start, min(start + per, len(prompts))):
            params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
            engine.submit("m", "ar", prompts[i], params, lambda _c, d, i=i: out[i].extend(d.token_ids))
        engine.step()
    engine.run_until_idle()
    assert engine.pool.num_used_blocks == 0
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize("quantization", ["none", "int4", "w4a8"])
def test_compiled_engine_decodes_the_eager_tokens_in_any_batch(quantization: str) -> None:
    if quantization == "w4a8" and not kernels.available():
        pytest.skip("no C++ compiler for the dot8 kernel")
    model = tiny(quantization)
    if quantization == "int4":
        assert isinstance(model.layers[0].mlp.down_proj, Int4Linear)
    if quantization == "w4a8":
        assert isinstance(model.layers[0].mlp.down_proj, Dot8Linear)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, CFG.vocab_size) for _ in range(rng.randrange(2, 14))] for _ in range(8)]
    eager = [decode(engine_for(model, False), [p], 1)[0] for p in prompts]
    compiled = engine_for(model, True)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    assert [decode(compiled, [p], 1)[0] for p in prompts] == eager, "one at a time"
    assert decode(compiled, prompts, 3) == eager, "batched in waves"
    assert counters["stats"]["unique_graphs"] == graphs, "a step recompiled on the engine thread"


def test_runners_past_dynamos_graph_cap_still_compile() -> None:
    """Every runner traces one code object; dynamo caps its graphs (8 by default, per thread), and a
    deployment (AR, twin, EAGLE variants) has more. Past the cap a shape would silently stay eager.
    Here the cap is 1, so the second model's graph is already past it."""
    from dataclasses import replace

    from torch._dynamo.utils import counters

    # The project's kernels loaded, as a server has them before its first compile: the graph's
    # attention is then their op. (Traced by dynamo in a fresh process without them, the fallback
    # attention's broadcast over a size-one dimension fails to compile; packages export with
    # size-oblivious checks and are not affected.)
    kernels.available()
    before = counters["stats"]["unique_graphs"]
    # A patch as a context: dynamo's config is global, and a value left behind (or an attribute
    # deleted by an undo that does not know the config module) breaks every later compile in the run.
    with torch._dynamo.config.patch(recompile_limit=1):
        for layers in (3, 5):  # two depths no other test compiles: two new graphs of one code object
            model = Transformer(replace(CFG, num_layers=layers)).eval().requires_grad_(False)
            step = ModelRunner(model, 16, BLOCK, use_flash=False).compile()
            step.packaged = False  # the torch.compile path (devices other than the CPU)
            step.warm([(StepShape(False), ())])
            assert not step.failed and step.ready
    assert counters["stats"]["unique_graphs"] - before >= 2, "the second runner's graph stayed eager"


def test_compiled_features_come_from_the_layers_asked_for() -> None:
    """EAGLE asks the target for the residual stream after some layers. Two sets of the same size
    must give their own layers: ints passed to a dynamic graph would turn symbolic and share one."""
    from dataclasses import replace

    from dualserve.decoders.engine.runner import ForwardItem

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Transformer(replace(CFG, num_layers=4)).eval().requires_grad_(False)
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.fill_(1.0)
    eager, compiled = (ModelRunner(model, 16, BLOCK, use_flash=False) for _ in range(2))
    step = compiled.compile()
    variants = [(0, 2), (1, 3)]
    step.warm([(StepShape(False), aux) for aux in variants])
    item = ForwardItem([5, 9, 3, 7, 1], list(range(5)), 0, [0, 1], list(range(5)))
    for aux in variants:
        want_h, want = eager.forward([item], aux_layers=aux)
        got_h, got = compiled.forward([item], aux_layers=aux)
        assert step.ready >= {(StepShape(False), aux)}
        torch.testing.assert_close(got_h, want_h, rtol=1e-4, atol=1e-4)
        assert len(got) == len(want) == 2
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_a_package_loads_from_the_cache_and_runs_on_the_live_weights(tmp_path) -> None:
    """On the CPU a step is an AOTInductor package under the cache: a second runner of the same
    model loads it instead of building it, and its constants are the model's own tensors (one copy
    in memory), so a weight changed in place changes the compiled output as it does the eager one."""
    from dualserve.decoders.engine.runner import ForwardItem

    model = tiny()
    key = (StepShape(False), ())
    first = ModelRunner(model, 16, BLOCK, use_flash=False).compile(cache_dir=tmp_path)
    first.warm([key])
    assert first.how == {key[0].name: "built"} and len(list((tmp_path / "aoti").glob("*.pt2"))) == 1
    eager, compiled = (ModelRunner(model, 16, BLOCK, use_flash=False) for _ in range(2))
    second = compiled.compile(cache_dir=tmp_path)
    second.warm([key])
    assert second.how == {key[0].name: "loaded"} and not second.failed
    item = ForwardItem([5, 9, 3, 7, 1], list(range(5)), 0, [0, 1], list(range(5)))
    with torch.no_grad():
        model.norm.weight.mul_(2.0)
        model.layers[1].mlp.down_proj.weight.mul_(-1.0)
    try:
        want, _ = eager.forward([item])
        got, _ = compiled.forward([item])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    finally:
        with torch.no_grad():
            model.norm.weight.div_(2.0)
            model.layers[1].mlp.down_proj.weight.mul_(-1.0)


def test_a_package_that_does_not_match_the_eager_forward_is_not_used(tmp_path, monkeypatch) -> None:
    """A package is checked against the eager forward before use. One whose code differs from the
    model's in what its key does not name (here the norms' epsilon, with the key pinned) is refused,
    and the shape stays eager."""
    from dataclasses import replace

    from dualserve.decoders.engine.compile import aoti

    monkeypatch.setattr(aoti, "package_key", lambda *a, **k: "pinned")
    key = (StepShape(False), ())
    ModelRunner(tiny(), 16, BLOCK, use_flash=False).compile(cache_dir=tmp_path).warm([key])
    other = Transformer(replace(CFG, rms_norm_eps=100.0)).eval().requires_grad_(False)
    other.load_state_dict(tiny().state_dict())
    step = ModelRunner(other, 16, BLOCK, use_flash=False).compile(cache_dir=tmp_path)
    step.warm([key])
    assert step.how == {} and step.failed and key not in step.ready


def test_the_engine_decodes_while_a_package_is_traced_beside_it(tmp_path) -> None:
    """Non-strict ``torch.export`` patches ``torch.nn.Module.__call__`` for the whole process, so
    a step that ran while a package was traced failed (or was traced into the graph). Steps and
    traces take turns at ``tracing.TRACING``: the engine keeps decoding eagerly, token for token as
    without the build, and the packages still build."""
    from dualserve.decoders.engine.compile.compile_worker import CompileWorker

    model = tiny()
    rng = random.Random(1)
    prompts = [[rng.randrange(3, CFG.vocab_size) for _ in range(rng.randrange(2, 14))] for _ in range(4)]
    want = decode(engine_for(model, False), prompts, 1)
    engine = Engine(EngineConfig(num_blocks=256, block_size=BLOCK, max_batched_tokens=24))
    runner = ModelRunner(model, 256, BLOCK, use_flash=False)
    worker = CompileWorker()
    step = runner.compile(cache_dir=tmp_path, worker=worker)
    engine.add_decoder("m", ARDecoder(runner, engine.pool), FakeTokenizer(), CFG.vocab_size)
    step.prewarm()
    rounds = 0
    # One thread decoding leaves a core to the builds: at the lowest priority they run only where
    # this process's threads leave one (the server's governor reserves it: ``openmp``).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        while worker.busy:
            assert decode(engine, prompts, 1) == want
            rounds += 1
    finally:
        torch.set_num_threads(threads)
    assert rounds > 0 and not step.failed and len(step.ready) == 2


def test_an_export_waits_for_the_running_step_and_holds_new_ones_back() -> None:
    import threading
    import time

    from dualserve.decoders.engine.compile.tracing import TraceGate

    gate, events = TraceGate(), []
    inside, release = threading.Event(), threading.Event()

    def step(name: str, hold: bool) -> None:
        with gate.step():
            events.append(name)
            if hold:
                inside.set()
                release.wait(5)
            events.append(f"/{name}")

    def export() -> None:
        with gate.export():
            events.append("export")
            time.sleep(0.05)
            events.append("/export")

    first = threading.Thread(target=step, args=("a", True))
    first.start()
    inside.wait(5)
    exporter = threading.Thread(target=export)
    exporter.start()
    time.sleep(0.05)  # the export now waits for step a
    second = threading.Thread(target=step, args=("b", False))
    second.start()
    time.sleep(0.05)  # step b waits for the export, which asked first
    assert events == ["a"]
    release.set()
    for t in (first, exporter, second):
        t.join(5)
    assert events == ["a", "/a", "export", "/export", "b", "/b"]


def test_packages_unused_for_two_weeks_are_removed_when_another_is_used(tmp_path) -> None:
    import os
    import time

    from dualserve.decoders.engine.compile import aoti

    stale, recent, used = (tmp_path / f"{n}.pt2" for n in ("stale", "recent", "used"))
    for p in (stale, recent, used):
        p.write_bytes(b"x")
    old = time.time() - (aoti.STALE_DAYS + 1) * 86400
    os.utime(stale, (old, old))
    os.utime(used, (old, old))
    aoti.mark_used(used)
    assert not stale.exists() and recent.exists() and used.exists()
    assert used.stat().st_mtime > old


@pytest.mark.parametrize("quantization", ["int4", "w4a16"])
def test_a_token_is_the_same_bits_decoded_alone_verified_in_a_tree_chunked_or_batched(tmp_path, quantization) -> None:
    """End to end on the served format (int4 weights, whose GEMMs compute each row alone): a
    position's hidden state depends on its tokens only, not on the step it is computed in. Greedy
    EAGLE equals AR, and batching never moves greedy output, only because a token decoded alone,
    the same token inside a verify tree or a short prefill chunk, and the same token beside other
    sequences come out bit for bit the same. (The bf16 rounding of the GEMM inputs hides most
    last-bit differences of a 2-layer model; the attention itself is held to exact equality by
    the next test.) In ``w4a16`` (dot8 layers) every step is the project's ops alone, and a step of
    both forms runs through one graph."""
    from dualserve.decoders.engine.runner import ForwardItem

    model = tiny(quantization)
    prompt, follow = [5, 9, 3, 7, 1, 8, 2, 6, 4] * 3, [11, 12, 13, 14]
    n = len(prompt)
    runners = []
    for _ in range(4):
        runner = ModelRunner(model, 64, BLOCK, use_flash=False)
        runner.compile(cache_dir=tmp_path).warm([(StepShape(False), ()), (StepShape(True), ())])
        assert not runner.compiled.failed
        runners.append(runner)
    table = list(range(8))
    slots = lambda positions: [table[p // BLOCK] * BLOCK + p % BLOCK for p in positions]  # noqa: E731

    def item(ids, start, mask="causal", positions=None):
        positions = list(range(start, start + len(ids))) if positions is None else positions
        return ForwardItem(ids, positions, start, table, slots(positions), mask)

    for runner in runners:
        runner.forward([item(prompt, 0)])

    alone, beside = [], []
    # First beside a prefill chunk longer than ROWS_MAX: a step of both forms. Where every step is
    # the project's ops alone (the kernels built), it runs through the chunks graph in one pass;
    # elsewhere each form's part through its own graph.
    step = runners[1].compiled
    forms = []
    run = step._run
    step._run = lambda graph, shape, *rest: forms.append(shape.chunks) or run(graph, shape, *rest)
    long = list(range(40, 40 + ROWS_MAX + 8))
    other = [ForwardItem(long, range(len(long)), 0, list(range(40, 54)), list(range(160, 160 + len(long)))),
             ForwardItem([31], [0], 0, [60], [240])]
    for i, tok in enumerate(follow):
        alone.append(runners[0].forward([item([tok], n + i)])[0][0])
        batch = [other[0], item([tok], n + i), other[1]] if i % 2 else [item([tok], n + i), *other]
        hidden = runners[1].forward(batch)[0]
        if i == 0:  # the chunk's rows agree with an eager forward
            assert forms == ([True] if step.one_form else [False, True])
            assert step.one_form == (step.packaged and bit_exact(model))
            eager = ModelRunner(model, 64, BLOCK, use_flash=False).forward([other[0]])[0]
            torch.testing.assert_close(hidden[1: 1 + len(long)], eager, rtol=0.05, atol=0.05)
        beside.append(hidden[len(other[0].token_ids)] if i % 2 else hidden[0])
        other = [ForwardItem([24 + i], [len(long) + i], len(long) + i, list(range(40, 54)), [160 + len(long) + i]),
                 ForwardItem([32 + i], [1 + i], 1 + i, [60, 61], [241 + i])]
    chunk = runners[2].forward([item(follow, n)])[0]
    # A verify tree: follow[0] -> (a sibling branch, follow[1] -> follow[2]).
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    verified = runners[3].forward([item([follow[0], 17, follow[1], follow[2]], n, tree, [n, n + 1, n + 1, n + 2])])[0]
    for i in range(len(follow)):
        assert torch.equal(beside[i], alone[i]), f"token {i} beside other sequences"
        assert torch.equal(chunk[i], alone[i]), f"token {i} in a chunk"
    for row, i in ((0, 0), (2, 1), (3, 2)):
        assert torch.equal(verified[row], alone[i]), f"token {i} in a verify tree"


class _Attention(torch.nn.Module):
    def forward(self, q, k, v, rows, context, mask, stacked):
        return PaddedPagedAttention(stacked, None, rows, context, mask, False)(0, q, k, v)


def test_the_rows_form_gives_a_position_the_same_bits_in_any_step(tmp_path) -> None:
    """The rows form's attention, as built into a package (sizes of one not specialised): a query
    row's output is the same bits whether it is the only row of the only sequence, a row of a
    verify tree whose earlier nodes are new rather than cached, or beside other sequences. A form
    that reduces the cached and the new keys in two parts fails this, and so does a graph that
    keeps a new key in fp32 where the pool will round it to bf16 (inductor's default)."""
    from dualserve.decoders.engine.compile import aoti, aoti_build
    from dualserve.decoders.engine.compile.step_graph import PACKAGE_INDUCTOR

    torch.manual_seed(0)
    heads, kv_heads, d, n = 8, 2, 64, 70
    stacked = torch.zeros(2, 256, kv_heads, d, dtype=torch.bfloat16)
    # New keys and values come in fp32; the pool holds them in bf16 (as a step stores them).
    keys, values = torch.randn(n + 8, kv_heads, d), torch.randn(n + 8, kv_heads, d)
    stacked[0, : n + 8], stacked[1, : n + 8] = keys, values
    queries = torch.randn(n + 8, heads, d)

    def step(seqs):
        """seqs: (first new position, new positions, mask among them); the cached slots are 0..first-1."""
        q = torch.cat([queries[ps] for _, ps, _ in seqs])
        k = torch.cat([keys[ps] for _, ps, _ in seqs])
        v = torch.cat([values[ps] for _, ps, _ in seqs])
        S, Q, W = len(seqs), max(len(ps) for _, ps, _ in seqs), max(2, max(c for c, _, _ in seqs))
        rows, context = torch.full((S, Q), len(q), dtype=torch.long), torch.zeros(S, W, dtype=torch.long)
        mask, start = torch.zeros(S, Q, W + Q, dtype=torch.bool), 0
        for i, (c, ps, own) in enumerate(seqs):
            rows[i, : len(ps)] = torch.arange(start, start + len(ps))
            start += len(ps)
            context[i, :c] = torch.arange(c)
            mask[i, : len(ps), :c] = True
            mask[i, : len(ps), W: W + len(ps)] = own
            mask[i, len(ps):, W + len(ps) - 1] = True
        return q, k, v, rows, context, mask, stacked

    module = _Attention()
    auto = torch.export.Dim.AUTO
    path = tmp_path / "attention.pt2"
    aoti_build.build(module, step([(5, [5, 6], torch.ones(2, 2).tril().bool()), (9, [9, 10, 11], torch.ones(3, 3).tril().bool())]),
               ({0: auto}, {0: auto}, {0: auto}, {0: auto, 1: auto}, {0: auto, 1: auto}, {0: auto, 1: auto, 2: auto},
                {1: auto}), path, PACKAGE_INDUCTOR)
    graph = aoti.PackagedGraph(path, module)
    with torch.inference_mode():
        alone = [graph(*step([(p, [p], torch.ones(1, 1).bool())]))[0][0] for p in range(n, n + 3)]
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
        # Positions n, n+1 (a sibling, not on the path: it reuses position n+1's key), n+1, n+2.
        verify = graph(*step([(n, [n, n + 1, n + 1, n + 2], tree)]))[0]
        batch = graph(*step([(40, [40, 41], torch.ones(2, 2).tril().bool()), (n + 1, [n + 1], torch.ones(1, 1).bool()),
                             (17, [17], torch.ones(1, 1).bool())]))[0]
    for row, i in ((0, 0), (2, 1), (3, 2)):
        assert torch.equal(verify[row], alone[i]), f"position {n + i} in a verify tree"
    assert torch.equal(batch[2], alone[1]), "a position beside other sequences"


def test_eager_steps_and_every_graph_give_the_same_bits(tmp_path) -> None:
    """A server answers with eager steps until each graph is ready, and EAGLE runs a graph that also
    returns feature layers: in the dot8 formats, a prompt prefilled eagerly or by the chunks graph,
    and a token decoded eagerly or by the rows graph with or without features, give the same hidden
    states bit for bit (GEMMs, norms, SwiGLU, rotary angles and attention are the project's ops on
    every path). Float weights are not held to this: inductor multiplies them with GEMMs of its own."""
    from dualserve.decoders.engine.runner import ForwardItem

    if not kernels.available():
        pytest.skip("no C++ compiler for the project's kernels")
    model = tiny("w4a16")
    prompt = [(7 * i + 3) % CFG.vocab_size for i in range(ROWS_MAX + 9)]
    table = list(range(16))
    slots = lambda positions: [table[p // BLOCK] * BLOCK + p % BLOCK for p in positions]  # noqa: E731

    def item(ids, start):
        positions = list(range(start, start + len(ids)))
        return ForwardItem(ids, positions, start, table, slots(positions))

    eager = ModelRunner(model, 64, BLOCK, use_flash=False)
    graphs = ModelRunner(model, 64, BLOCK, use_flash=False)
    graphs.compile(cache_dir=tmp_path).warm([(StepShape(False), ()), (StepShape(True), ()), (StepShape(False), (0,))])
    assert not graphs.compiled.failed and len(graphs.compiled.ready) == 3
    want = eager.forward([item(prompt, 0)])[0]
    assert torch.equal(graphs.forward([item(prompt, 0)])[0], want), "prefill: eager against the chunks graph"
    n = len(prompt)
    for i, tok in enumerate([11, 12, 13]):
        want = eager.forward([item([tok], n + i)])[0]
        assert torch.equal(graphs.forward([item([tok], n + i)], aux_layers=(0,))[0], want), "rows graph, features"
        # the same position again through the plain rows graph (its key and value are rewritten alike)
        assert torch.equal(graphs.forward([item([tok], n + i)])[0], want), "rows graph"


def test_the_rows_graph_builds_first_and_alone(tmp_path, monkeypatch) -> None:
    """A first start builds the rows (decode) graph before the chunks graph starts building, on
    two compile threads; a stop while the chunks graph waits starts no build of it."""
    import threading
    import time

    from dualserve.decoders.engine.compile import aoti
    from dualserve.decoders.engine.compile.compile_worker import CompileWorker

    events, release = [], threading.Event()

    def build(module, path, inputs, dynamic, inductor, *, before_build=None, **kw):
        if before_build is not None:
            before_build()
        name = "chunks" if module.chunks else "rows"
        events.append(f"start {name}")
        release.wait(5) if name == "rows" else time.sleep(0.05)
        events.append(f"end {name}")
        return (lambda *a: None), "built"

    monkeypatch.setattr(aoti, "load_or_build", build)
    runner = ModelRunner(tiny(), 256, BLOCK, use_flash=False)
    for stop in (False, True):
        events.clear()
        release.clear()
        worker = CompileWorker(2)
        step = runner.compile(cache_dir=tmp_path, worker=worker)
        if not step.packaged:
            pytest.skip("no AOTInductor packages on this host")
        step.prewarm()
        deadline = time.monotonic() + 10  # both jobs running: the rows graph's build, the chunks graph waiting
        both = {"rows", "chunks"}
        while (set(str(worker.progress().running).split(", ")) != both or not events) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert set(str(worker.progress().running).split(", ")) == both and events == ["start rows"]
        if stop:
            worker.stop()
        release.set()
        deadline = time.monotonic() + 10
        while worker.busy and time.monotonic() < deadline:
            time.sleep(0.02)
        assert events == (["start rows", "end rows"] if stop else
                          ["start rows", "end rows", "start chunks", "end chunks"])
