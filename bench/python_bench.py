#!/usr/bin/env python3
"""gpt_bench's GPT trained from Python: what the ztrain package's Python side costs.

    mpirun -np N python3 bench/python_bench.py --level 3 --preset small --batch 4 --seq 128 \
        --steps 10 --warmup 3 [--data FILE] [--json FILE]

The model is ztrain::models::Gpt's as gpt_bench trains it, written in Python over the ztrain
package: bench/peer_torch.py's transformer blocks (the same architecture and parameter names) in
a ztrain.BlockList, the token and position embeddings as ztrain.DistributedParameters (the head
reusing the token embedding), the final LayerNorm a Block, all at one ZeRO level without
recomputation, ztrain.optim.AdamW (lr 1e-3, betas (0.9, 0.95), weight decay 0.1). Batches and
timing are gpt_bench's: rank r takes windows (step*N + r)*batch + i of the byte file; a step runs
from a barrier to the end of the optimizer step, its time the max over ranks; tokens/s is the
global batch over the median step after the warm-up. Rank 0 prints one JSON object in
gpt_bench's form. bench/python_overhead.sh runs both side by side.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import ztrain

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_torch  # noqa: E402  (the blocks, presets and batches of the PyTorch peer)


class Gpt(torch.nn.Module):
    def __init__(self, c, level):
        super().__init__()
        self.wte = ztrain.DistributedParameter(torch.empty(c["vocab"], c["d_model"]), zero_level=level)
        self.wpe = ztrain.DistributedParameter(torch.empty(c["context"], c["d_model"]), zero_level=level)
        self.h = ztrain.BlockList([peer_torch.Block(c["d_model"], c["heads"]) for _ in range(c["layers"])],
                                  zero_level=level, use_checkpoint=False)
        self.ln_f = ztrain.Block(torch.nn.LayerNorm(c["d_model"], eps=1e-5), zero_level=level, use_checkpoint=False)

    def forward(self, tokens):
        x_ids, y_ids = tokens[:, :-1], tokens[:, 1:]
        wte = self.wte.gather()
        h = F.embedding(x_ids, wte) + F.embedding(torch.arange(x_ids.shape[1]), self.wpe.gather())
        logits = torch.matmul(self.ln_f(self.h(h)), wte.t())
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y_ids.reshape(-1))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--level", type=int, default=0)
    p.add_argument("--preset", choices=sorted(peer_torch.PRESETS), default="small")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq", type=int, help="sequence length (default: the context)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--data", default="data/tinyshakespeare.txt")
    p.add_argument("--json")
    p.add_argument("--tag", default="")
    a = p.parse_args()

    ztrain.init_distributed(seed=1234)
    rank, n = ztrain.rank(), ztrain.world_size()
    c = peer_torch.PRESETS[a.preset]
    seq = a.seq or c["context"]
    model = Gpt(c, a.level)
    ztrain.init_parameters(model, seed=1234)
    opt = ztrain.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    at = peer_torch.batches(a.data, seq, a.batch, rank, n)

    step_s, phases, losses = [], {"forward": [], "backward": [], "optimizer": []}, []
    for step in range(a.warmup + a.steps):
        tokens = at(step)
        ztrain.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(tokens)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        dt = torch.tensor([t3 - t0], dtype=torch.float64)
        ztrain._C._all_reduce(dt, "max", "world")
        losses.append(ztrain.sum_loss(loss).item())
        if step >= a.warmup:
            step_s.append(dt.item())
            for name, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                phases[name].append(seconds)

    median = statistics.median(step_s)
    tokens_per_step = a.batch * seq * n
    out = {
        "bench": "gpt", "tag": a.tag, "system": "ztrain_python", "level": a.level, "dtype": "fp32", "device": "cpu",
        "ranks": n, "threads": torch.get_num_threads(),
        "model": {"vocab": c["vocab"], "context": c["context"], "d_model": c["d_model"], "layers": c["layers"],
                  "heads": c["heads"], "preset": a.preset},
        "params": sum(v.numel() for v in ztrain.state_dict(model).values()),
        "batch": a.batch, "seq": seq, "steps": a.steps, "warmup": a.warmup,
        "optimizer": "ztrain.optim.AdamW lr 1e-3 betas (0.9, 0.95) wd 0.1", "torch": torch.__version__,
        "tokens_per_step": tokens_per_step,
        "step_s": {"median": median, "p10": min(step_s), "p90": max(step_s)},
        "tokens_per_s": tokens_per_step / median,
        "phase_s": {k: statistics.median(v) for k, v in phases.items()},
        "loss_first": losses[0], "loss_last": losses[-1],
    }
    if rank == 0:
        peer_torch.emit(out, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
