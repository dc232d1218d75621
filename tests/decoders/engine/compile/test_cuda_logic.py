"""The engine's CUDA path, its logic run on the CPU: CUDA graph capture beside the compile thread,
the KV pool's size from the device's free memory, when flash-attn is chosen, context slots per
device, and the rows form's eager sums in bounded pieces. One GPU-marked test runs flash-attn."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from dualserve.decoders.engine import kv_budget
from dualserve.decoders.engine.attention import padded
from dualserve.decoders.engine.attention.padded import PaddedPagedAttention, StepShape
from dualserve.decoders.engine.attention.paged_attention import (AttentionMetadata, FlashPagedAttention, KVCache,
                                                                 SdpaPagedAttention, SeqAttention, flash_available,
                                                                 flash_fits)
from dualserve.decoders.engine.compile.compile_worker import CompileWorker
from dualserve.decoders.engine.compile.compiled import CompiledStep
from dualserve.decoders.engine.compile.cuda_graphs import Captured, CudaGraphs, bucket, static_inputs
from dualserve.decoders.engine.compile.step_graph import ForwardWithFeatures
from tiny_engine import BLOCK, CFG, meta_for, tiny

GiB = 2**30


def step_inputs(seqs):
    meta = meta_for(seqs)
    ids = torch.arange(sum(n for _, n, _ in seqs)) % 50 + 3
    pos = torch.cat([torch.arange(c, c + n) for c, n, _ in seqs])
    return ids, pos, meta


class EagerGraph:
    """A stand-in for ``torch.cuda.CUDAGraph`` on the CPU: replay runs the forward on the bucket's
    static inputs and writes its static outputs, as a captured graph does."""

    def __init__(self, fn, inputs, stacked, outputs):
        self.fn, self.inputs, self.stacked, self.outputs = fn, inputs, stacked, outputs

    def replay(self) -> None:
        for static, new in zip(self.outputs, self.fn(*self.inputs, self.stacked)):
            static.copy_(new)


@pytest.fixture
def parts(tmp_path):
    torch.manual_seed(3)
    cache = KVCache(CFG.num_layers, 64, BLOCK, CFG.num_kv_heads, CFG.head_dim, torch.float32, "cpu")
    cache.stacked.normal_()
    model = tiny()
    worker = CompileWorker()
    step = CompiledStep(model, cache, lambda n: 64 * BLOCK + torch.arange(n) % BLOCK, tmp_path, worker)
    return step, ForwardWithFeatures(model, ()), worker


def wait_idle(worker: CompileWorker) -> None:
    deadline = time.monotonic() + 10
    while worker.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not worker.busy


@torch.inference_mode()
def test_a_failed_capture_beside_a_running_compile_job_still_answers(parts, caplog) -> None:
    step, forward, worker = parts
    attempts = []

    def capture(sizes):
        attempts.append(sizes)
        raise RuntimeError("operation not permitted when stream is capturing\n(a second line)")

    step.cuda_graphs = {id(forward): CudaGraphs(forward, step.cache, worker.device_lock, capture)}
    ids, pos, meta = step_inputs([(7, 1, "causal"), (3, 1, "causal")])
    plain = PaddedPagedAttention.build(step.cache, meta, "cpu", False)
    want = forward(ids, pos, plain.rows, plain.context, plain.mask, step.cache.stacked)[:-2]

    started, release = threading.Event(), threading.Event()
    worker.submit(lambda: (started.set(), release.wait(10)))  # a slow compile job holds the device
    assert started.wait(10)
    got = step._run(forward, StepShape(False), ids, pos, meta)
    assert attempts == []  # no capture while the compile thread runs a job: the step ran uncaptured
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    release.set()
    wait_idle(worker)

    with caplog.at_level(logging.WARNING, logger="dualserve.compile"):
        got = step._run(forward, StepShape(False), ids, pos, meta)
        again = step._run(forward, StepShape(False), ids, pos, meta)
    assert attempts == [bucket(meta)]  # tried once the thread was idle, and never again for that bucket
    assert all(torch.equal(g, w) and torch.equal(a, w) for g, a, w in zip(got, again, want))
    warnings = [r for r in caplog.records if "capturing a CUDA graph" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage() and warnings[0].exc_info is None


@torch.inference_mode()
def test_a_compile_job_waits_for_a_capture_in_progress(parts) -> None:
    step, forward, worker = parts
    in_capture, finish, order = threading.Event(), threading.Event(), []

    def capture(sizes):
        in_capture.set()
        assert finish.wait(10)
        order.append("capture")
        inputs = static_inputs(sizes, "cpu")
        outputs = [o.clone() for o in forward(*inputs, step.cache.stacked)]
        return Captured(EagerGraph(forward, inputs, step.cache.stacked, outputs), inputs, outputs)

    graphs = CudaGraphs(forward, step.cache, worker.device_lock, capture)
    ids, pos, meta = step_inputs([(9, 4, "bidirectional"), (5, 1, "causal")])
    result = {}
    engine = threading.Thread(target=lambda: result.setdefault("r", graphs(ids, pos, meta)))
    engine.start()
    assert in_capture.wait(10)
    worker.submit(lambda: order.append("job"))
    time.sleep(0.1)
    assert order == []  # the job has not started while the capture holds the device
    finish.set()
    engine.join(10)
    wait_idle(worker)
    assert order == ["capture", "job"]
    # the replay bookkeeping: the step's tokens get the unpadded forward's outputs
    plain = PaddedPagedAttention.build(step.cache, meta, "cpu", False)
    want = forward(ids, pos, plain.rows, plain.context, plain.mask, step.cache.stacked)
    replayed = result["r"]
    torch.testing.assert_close(replayed.outputs[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(replayed.new_k, want[-2], rtol=1e-5, atol=1e-5)
    assert torch.equal(replayed.slot_mapping, plain.slot_mapping)


def test_the_kv_pool_takes_the_gpus_free_memory_after_the_weights(monkeypatch) -> None:
    asked = []

    def mem_get_info(device):
        asked.append(device)
        return 60 * GiB, 80 * GiB  # (free, total) once the weights are on the device

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    got = kv_budget.pool_bytes("cuda:1", None)
    assert got == int(60 * GiB * 0.9) - kv_budget.ACTIVATION_HEADROOM
    assert asked == [torch.device("cuda:1")]
    assert kv_budget.pool_bytes("cuda", None, utilization=0.5, headroom=GiB) == 29 * GiB
    assert kv_budget.pool_bytes("cuda", 3.0) == 3 * GiB  # --kv-memory-gb wins
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (GiB, 80 * GiB))
    assert kv_budget.pool_bytes("cuda", None) == 0  # nothing left beside the headroom
    with pytest.raises(ValueError):
        kv_budget.device_pool_bytes("cuda", utilization=1.5)
    per_block = 2 * 30 * 256 * 3 * 64 * 2  # the default model's KV of one 256-token block in bf16
    assert kv_budget.pool_blocks(int(60 * GiB * 0.9) - 2 * GiB, per_block) == 9466  # 52 GiB of 5.6 MiB blocks
    assert kv_budget.pool_blocks(0, per_block) == kv_budget.MIN_BLOCKS


def test_the_cpu_pool_keeps_the_host_rule(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: pytest.fail("asked the GPU on the CPU"))
    assert kv_budget.host_pool_gb(8) == 0.25 and kv_budget.host_pool_gb(32) == 0.5
    assert kv_budget.host_pool_gb(128) == 1.0
    monkeypatch.setattr(kv_budget, "host_memory_gb", lambda: 32.0)
    assert kv_budget.pool_bytes("cpu", None) == GiB // 2


def test_flash_attn_only_where_its_kernel_takes_the_dtype_and_blocks() -> None:
    assert flash_fits(torch.bfloat16, torch.bfloat16, 256) and flash_fits(torch.float16, torch.float16, 512)
    assert not flash_fits(torch.float32, torch.float32, 256)   # fp32: flash-attn refuses it
    assert not flash_fits(torch.bfloat16, torch.bfloat16, 16)  # its paged blocks are multiples of 256
    assert not flash_fits(torch.float32, torch.bfloat16, 256)  # queries and cache in one dtype


def test_context_slots_are_cached_per_device() -> None:
    meta = AttentionMetadata([SeqAttention(6, 1, [3, 1])], torch.tensor([5]), BLOCK)
    cpu = meta.context_index(0, "cpu")
    assert cpu.device.type == "cpu" and cpu.tolist() == [12, 13, 14, 15, 4, 5]
    elsewhere = meta.context_index(0, "meta")
    assert elsewhere.device.type == "meta"  # not the CPU tensor built first
    assert meta.context_index(0, "cpu") is cpu


@pytest.mark.parametrize("bound", [3000, 7000, 20000])  # a row at a time, two, several
def test_the_rows_form_in_bounded_pieces_is_the_same_bits(monkeypatch, bound: int) -> None:
    torch.manual_seed(5)
    seqs = [(40, 9, "causal"), (0, 3, "bidirectional"), (17, 1, "causal")]
    cache = KVCache(1, 64, BLOCK, 2, 16, torch.float32, "cpu")
    cache.stacked.normal_()
    total = sum(n for _, n, _ in seqs)
    q, k, v = torch.randn(total, 4, 16), torch.randn(total, 2, 16), torch.randn(total, 2, 16)
    whole = PaddedPagedAttention.build(cache, meta_for(seqs), "cpu", False)
    whole.attend_kernel = False  # the sums below are what CUDA runs eagerly
    want = whole(0, q, k, v)
    monkeypatch.setattr(padded, "EAGER_ROWS_ELEMENTS", bound)  # a query row's products: 4 * 16 * (W + Q)
    pieces = PaddedPagedAttention.build(cache, meta_for(seqs), "cpu", False)
    pieces.attend_kernel = False
    assert torch.equal(pieces(0, q, k, v), want)


@pytest.mark.gpu
@pytest.mark.skipif(not flash_available(), reason="needs CUDA and flash-attn")
def test_flash_matches_sdpa_with_256_token_blocks_on_gpu() -> None:
    torch.manual_seed(0)
    block = 256
    cache = KVCache(1, 8, block, 2, 64, torch.bfloat16, "cuda")
    cache.stacked.normal_()
    seqs = [SeqAttention(300, 7, [2, 5]), SeqAttention(20, 1, [1]), SeqAttention(0, 5, [6])]
    slots = torch.tensor([2 * block + 44 + i for i in range(7)] + [block + 20] + [6 * block + i for i in range(5)])
    meta = AttentionMetadata(seqs, slots.cuda(), block)
    q = torch.randn(13, 4, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(13, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flash = FlashPagedAttention(cache, meta)
    assert flash._usable
    got = flash(0, q, k, v)
    want = SdpaPagedAttention(cache, meta)(0, q, k, v)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
