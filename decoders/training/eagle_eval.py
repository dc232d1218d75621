"""``python -m dualserve.decoders.training.eagle_eval``: how often an EAGLE-3 head's top draft is the
target's next token, depth by depth, on held-out prompts and on its training records.

Teacher-forced, as the training-time test unrolls it (``eagle_losses.eagle3_loss``): at each answer
position the head reads the target's features of the real prefix, and at depth k its own k earlier
outputs, and its top draft (mapped to a target id) is compared with the target's greedy token there,
over the whole vocabulary. So a token outside the draft vocabulary counts as a miss, and the table
also gives their share. Depth 1's rate (the first drafted token) is what a drafting step's first
level gets from the head's top token; it moves with acceptance in the server but needs no timing,
so a checkpoint can be judged in a minute while training goes on.

The held-out sets are the target's own greedy answers (``--max-tokens``) to the evaluation prompts
(``clients/prompts/bench.jsonl`` and ``agentic.jsonl`` by default), which training never sees; the
training set is a seeded sample of ``--records`` records of the ``--data`` directories. The gap
between the two says whether more of the training distribution, or a different one, would help.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from dualserve.models.eagle import Eagle3Head, load_eagle_head
from dualserve.models.transformer import Transformer

from .eagle_data import Sequence, load_distilled, target_batch
from .eagle_losses import row_mask, shifted, unrolled
from .eagle_train import chat_ids, generate_shard, load_target
from ..engine.runner import ModelRunner

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "models" / "assets" / "eagle-smollm2"
PROMPTS = [ROOT / "clients" / "prompts" / "bench.jsonl", ROOT / "clients" / "prompts" / "agentic.jsonl"]


@torch.inference_mode()
def depth_accuracy(head: Eagle3Head, target: Transformer, seqs: list[Sequence], depths: int,
                   batch_size: int = 4) -> list[tuple[int, int, int]]:
    """Per depth k: (rows whose top draft is the target's greedy token, answer rows, rows whose token is
    outside the draft vocabulary), over the answer positions with a target k + 1 tokens on."""
    out = [[0, 0, 0] for _ in range(depths)]
    for i in range(0, len(seqs), batch_size):
        batch = target_batch(target, seqs[i:i + batch_size], head.config.aux_layers)
        b, t = batch.ids.shape
        greedy = target.logits(batch.final.reshape(b * t, -1)).argmax(-1).view(b, t)  # the token after position i
        for k, h in enumerate(unrolled(head, batch, depths)):
            rows = row_mask(batch, k)
            want = shifted(greedy, 1 + k)
            draft = head.to_target(head.logits(h).argmax(-1))
            out[k][0] += int(((draft == want) & rows).sum())
            out[k][1] += int(rows.sum())
            out[k][2] += int((~head.t2d[want] & rows).sum())
    return [tuple(x) for x in out]


@torch.inference_mode()
def held_out_answers(loaded, path: Path, limit: int, max_tokens: int) -> list[Sequence]:
    """The target's greedy answers to the first ``limit`` prompts of a JSONL prompt file."""
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()][:limit]
    ids = [chat_ids(loaded, p) for p in prompts]
    bs = 16
    per_seq = -(-(max(map(len, ids)) + max_tokens) // bs)
    runner = ModelRunner(loaded.model, len(ids) * per_seq, bs)
    eos = set(loaded.config.eos_token_ids) | set(loaded.tokenizer.eos_token_ids)
    done = generate_shard(runner, ids, max_tokens, eos, (), 0.0, 0)
    return [Sequence(s["ids"], int(s["prompt_len"])) for s in done]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dualserve.decoders.training.eagle_eval",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--head", default=str(BUNDLED), help="EAGLE-3 head directory (default: the bundled one)")
    p.add_argument("--model", default=None)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--quantization", default="w4a16", help="the target's weight format (default: as served)")
    p.add_argument("--prompts", nargs="*", default=[str(f) for f in PROMPTS], help="held-out JSONL prompt files")
    p.add_argument("--limit", type=int, default=24, help="prompts per file")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--data", nargs="*", default=[], help="distillation directories to sample training records from")
    p.add_argument("--records", type=int, default=48)
    p.add_argument("--max-len", type=int, default=640)
    p.add_argument("--depths", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_target(argparse.Namespace(model=args.model, cache_dir=args.cache_dir, device="cpu",
                                            quantization=args.quantization))
    try:
        head = load_eagle_head(args.head, loaded.model, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"--head {args.head}: {e}")
    if not isinstance(head, Eagle3Head):
        raise SystemExit(f"--head {args.head}: an EAGLE-3 head is needed")
    sets = {Path(f).stem: held_out_answers(loaded, Path(f), args.limit, args.max_tokens) for f in args.prompts}
    if args.data:
        recs = load_distilled([Path(d) for d in args.data], args.max_len)
        random.Random(0).shuffle(recs)
        sets["training records"] = recs[:args.records]
    table = Table(title=f"{Path(args.head).name}: top draft = target's greedy token, teacher-forced")
    for col in ("set", "answer rows", "outside draft vocab", *(f"depth {k + 1}" for k in range(args.depths))):
        table.add_column(col, justify="right")
    figures = {}
    for name, seqs in sets.items():
        acc = depth_accuracy(head, loaded.model, seqs, args.depths)
        rows = acc[0][1]
        figures[name] = {"rows": rows, "outside": acc[0][2] / max(rows, 1),
                         "top1": [hits / max(n, 1) for hits, n, _ in acc]}
        table.add_row(name, str(rows), f"{figures[name]['outside']:.3f}",
                      *(f"{x:.3f}" for x in figures[name]["top1"]))
    Console().print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"head": args.head, "sets": figures}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
