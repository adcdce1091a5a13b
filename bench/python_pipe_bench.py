#!/usr/bin/env python3
"""Pipeline schedules from Python: the Booster's HybridParallelPlugin over bench/peer_torch.py's
GPT, unchanged, one step of which each schedule runs.

    mpirun -np P python3 bench/python_pipe_bench.py --style 1f1b --micro-batches 8 --preset small \
        --batch 16 [--chunks 2] [--seq 256] [--level 0] [--checkpoint] [--steps 6] [--warmup 2] [--json FILE]

The P ranks are P pipeline stages (dp 1); the model's layers are cut over them. --style:
  1f1b, gpipe, interleaved
                Booster.execute_pipeline with that pp_style: every rank takes the same batch of
                --batch sequences, cut into --micro-batches (interleaved: --chunks model chunks
                per stage)
  forward       the model called on each rank's part of the batch (--batch / P sequences; the
                parts gathered into one pipeline batch, GPipe's order) and booster.backward
A step runs from a barrier to the end of the optimizer step, its time the max over the ranks;
tokens/s is the batch over the median step after the warm-up. The peak resident set is each
rank's high-water mark (getrusage), the largest over the ranks and each stage's. Rank 0 prints
one JSON object. Run one style per process: the high-water mark never falls.
"""
import argparse
import os
import resource
import statistics
import sys
import time

import torch

import ztrain
from ztrain.booster import Booster, HybridParallelPlugin

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_torch  # noqa: E402  (the model, presets and batches of the PyTorch peer)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--style", choices=("1f1b", "gpipe", "interleaved", "forward"), default="1f1b")
    p.add_argument("--chunks", type=int, default=2, help="model chunks per stage (interleaved)")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--preset", choices=sorted(peer_torch.PRESETS), default="small")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (per pipeline)")
    p.add_argument("--seq", type=int, help="sequence length (default: the context)")
    p.add_argument("--level", type=int, default=0, help="ZeRO level of the stages' layers")
    p.add_argument("--checkpoint", action="store_true", help="recompute each layer in backward")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--data", default="data/tinyshakespeare.txt")
    p.add_argument("--json")
    a = p.parse_args()

    pp = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    ztrain.init_distributed(seed=1234, pp_size=pp)
    stage = ztrain._C._group_rank("pp")
    c = peer_torch.PRESETS[a.preset]
    seq = a.seq or c["context"]
    model = peer_torch.Gpt(c)
    plugin = HybridParallelPlugin(tp_size=1, pp_size=pp, zero_stage=a.level, num_microbatches=a.micro_batches,
                                  pp_style="gpipe" if a.style == "forward" else a.style,
                                  num_model_chunks=a.chunks if a.style == "interleaved" else 1,
                                  use_checkpoint=a.checkpoint)
    booster = Booster(plugin)
    opt = ztrain.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    model, opt, *_ = booster.boost(model, opt)
    at = peer_torch.batches(a.data, seq, a.batch, 0, 1)  # the same batch on every rank of the pipeline

    step_s, losses = [], []
    for step in range(a.warmup + a.steps):
        tokens = at(step)
        ztrain.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad()
        if a.style == "forward":
            loss = model(tokens.chunk(pp)[stage])
            booster.backward(loss, opt)
            loss = ztrain.sum_loss(loss)
        else:
            loss = booster.execute_pipeline(iter([tokens]), model, lambda out, inputs: out, opt)["loss"]
        opt.step()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        ztrain._C._all_reduce(dt, "max", "world")
        losses.append(loss.item())
        if step >= a.warmup:
            step_s.append(dt.item())

    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64)
    per_stage = torch.zeros(pp, dtype=torch.float64)
    per_stage[stage] = peak
    ztrain._C._all_reduce(per_stage, "max", "world")
    median = statistics.median(step_s)
    out = {
        "bench": "python_pipe", "style": a.style, "stages": pp, "micro_batches": a.micro_batches,
        "chunks": a.chunks if a.style == "interleaved" else 1,
        "level": a.level, "checkpoint": a.checkpoint, "preset": a.preset, "batch": a.batch, "seq": seq,
        "steps": a.steps, "warmup": a.warmup, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "step_s": {"median": median, "min": min(step_s), "max": max(step_s)},
        "tokens_per_s": a.batch * seq / median,
        "peak_rss_bytes": per_stage.tolist(),
        "loss_first": losses[0], "loss_last": losses[-1],
    }
    if ztrain.rank() == 0:
        peer_torch.emit(out, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
