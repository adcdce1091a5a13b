#!/usr/bin/env python3
"""The peer of bench/gpt_bench: the same GPT trained with PyTorch's own data parallelism.

    peer_torch.py --system ddp|ddp_zero|fsdp2 --ranks N --preset small --dtype fp32|bf16 \
        --batch 4 --seq 128 --steps 10 --warmup 3 --data data/tinyshakespeare.txt [--json FILE]
    peer_torch.py --check        # the model against tests/models/gpt_reference.py, then exit

With --ranks N the script starts N copies of itself (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
set; torchrun is not used) that train over gloo:
  ddp        DistributedDataParallel (default buckets), torch.optim.AdamW
  ddp_zero   DistributedDataParallel and ZeroRedundancyOptimizer over torch.optim.AdamW (each rank
             keeps and updates a shard of the optimizer state, then broadcasts its parameters)
  fsdp2      FSDP2 (torch.distributed.fsdp.fully_shard, PyTorch 2.x): each transformer block is a
             unit, the embeddings and final LayerNorm the root unit; parameters, gradients and
             optimizer state sharded (ZeRO-3), torch.optim.AdamW on the shards
  eager      the model as it is, no data parallelism (each rank trains alone): with --device cuda
             and one rank, PyTorch eager's single-GPU step (scripts/gpu_check.sh)
bf16: for ddp and ddp_zero PyTorch's autocast on the CPU (fp32 parameters, gradients and
optimizer, the forward and loss under torch.autocast("cpu", bfloat16)); for fsdp2 its own mixed
precision (MixedPrecisionPolicy: fp32 shards, parameters gathered and computed in bf16, gradients
reduced in bf16). ztrain's bf16 keeps bf16 parameters and gradients with fp32 masters in the
optimizer: each side's usual recipe.

The model is ztrain::models::Gpt's architecture (GPT-2: learned positions, pre-LayerNorm, causal
attention, tanh GELU, tied head; Conv1D weights [in, out]) under the same parameter names; its
forward follows tests/models/gpt_reference.py, the PyTorch reference of ztrain's golden values,
and --check verifies that it computes that reference's loss. Initialisation: GPT-2's (as
ztrain::models::gpt_init; the random draws differ). Batches, timing and output as gpt_bench:
rank r takes windows (step*N + r)*batch + i of the byte file; a step runs from a barrier to the
end of the optimizer step, its time the max over ranks; tokens/s is the global batch over the
median step after the warm-up. Rank 0 prints one JSON object.
"""
import argparse
import json
import math
import os
import resource
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

PRESETS = {  # ztrain::models::GptConfig::preset
    "tiny": dict(vocab=256, context=64, d_model=64, layers=2, heads=2),
    "small": dict(vocab=256, context=256, d_model=256, layers=4, heads=4),
    "medium": dict(vocab=256, context=512, d_model=512, layers=8, heads=8),
    "gpt2": dict(vocab=50257, context=1024, d_model=768, layers=12, heads=12),
}


class Conv1D(torch.nn.Module):
    """y = x W + b with W stored (in, out), as GPT-2's Conv1D and ztrain's kInOut layers."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(n_in, n_out))
        self.bias = torch.nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class Attention(torch.nn.Module):
    def __init__(self, d, heads, fused=True):
        super().__init__()
        self.heads = heads
        self.fused = fused  # F.scaled_dot_product_attention, as GptConfig::fused_attention
        self.c_attn = Conv1D(d, 3 * d)
        self.c_proj = Conv1D(d, d)

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.heads
        qkv = self.c_attn(x).view(b, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        if self.fused:
            y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
            return self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        s = torch.matmul(qkv[0], qkv[1].transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        p = torch.softmax(s, -1, dtype=torch.float32).to(qkv.dtype)
        return self.c_proj(torch.matmul(p, qkv[2]).transpose(1, 2).reshape(b, t, d))


class Mlp(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = Conv1D(d, 4 * d)
        self.c_proj = Conv1D(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(torch.nn.Module):
    def __init__(self, d, heads, fused=True):
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(d, eps=1e-5)
        self.attn = Attention(d, heads, fused)
        self.ln_2 = torch.nn.LayerNorm(d, eps=1e-5)
        self.mlp = Mlp(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = torch.nn.Embedding(c["vocab"], c["d_model"])
        self.wpe = torch.nn.Embedding(c["context"], c["d_model"])
        fused = c.get("attention", "fused") == "fused"
        self.h = torch.nn.ModuleList(Block(c["d_model"], c["heads"], fused) for _ in range(c["layers"]))
        self.ln_f = torch.nn.LayerNorm(c["d_model"], eps=1e-5)


class Gpt(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.transformer = Transformer(c)
        proj_std = 0.02 / math.sqrt(2.0 * max(c["layers"], 1))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    p.normal_(0.0, proj_std)
                elif name.endswith("wpe.weight"):
                    p.normal_(0.0, 0.01)
                elif name.endswith("bias"):
                    p.zero_()
                elif p.dim() >= 2:
                    p.normal_(0.0, 0.02)
                else:
                    p.fill_(1.0)

    def forward(self, tokens):
        """Mean next-token cross-entropy over tokens [batch, seq + 1]."""
        x_ids, y_ids = tokens[:, :-1], tokens[:, 1:]
        tr = self.transformer
        h = tr.wte(x_ids) + tr.wpe(torch.arange(x_ids.shape[1], device=x_ids.device))
        for block in tr.h:
            h = block(h)
        logits = torch.matmul(tr.ln_f(h), tr.wte.weight.t())
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y_ids.reshape(-1))


def check():
    """Our module in float64 against gpt_reference.loss on the same weights and tokens."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models"))
    import gpt_reference

    torch.manual_seed(0)
    c = dict(vocab=256, context=16, d_model=32, layers=2, heads=4)
    model = Gpt(c).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # biases and norms away from 0 and 1
    weights = {name: p.detach() for name, p in model.named_parameters()}
    tokens = torch.randint(0, 256, (3, 12))
    ours = model(tokens).item()
    reference = gpt_reference.loss(weights, tokens, c["heads"])
    ok = abs(ours - reference) <= 1e-9 * abs(reference)
    print(f"peer_torch --check: loss {ours:.12g}, gpt_reference {reference:.12g}: {'equal' if ok else 'DIFFERENT'}")
    # Every tensor the forward makes is on its input's device (--device cuda): on the meta device
    # a tensor made on the CPU raises, without a GPU.
    with torch.device("meta"):
        on_meta = Gpt(c)
    on_meta(torch.zeros(3, 12, dtype=torch.long, device="meta"))
    return 0 if ok else 1


def emit(result, path=None):
    """Prints one result line, and appends it to the JSON-lines file `path` if given."""
    print(json.dumps(result), flush=True)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(result) + "\n")


def batches(path, seq, batch, rank, ranks):
    data = torch.frombuffer(bytearray(open(path, "rb").read()), dtype=torch.uint8).long()
    windows = data.numel() // (seq + 1)

    def at(step):
        rows = [((step * ranks + rank) * batch + i) % windows for i in range(batch)]
        return torch.stack([data[w * (seq + 1):(w + 1) * (seq + 1)] for w in rows])

    return at


def state_bytes(tensors):
    """Bytes this rank holds: a sharded tensor (DTensor) counts its local shard."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    return sum(local(t).numel() * local(t).element_size() for t in tensors if torch.is_tensor(t))


def wrap(a, model, n):
    """The model as the system trains it: DDP, or FSDP2 units (each block, then the root)."""
    if a.system == "eager":
        return model
    if a.system != "fsdp2":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cpu", (n,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if a.dtype == "bf16" else MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    return fully_shard(model, mesh=mesh, mp_policy=mp)


def train(a):
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.manual_seed(1234)
    c = dict(PRESETS[a.preset])
    for k in ("d_model", "layers", "heads", "context"):
        if getattr(a, k) is not None:
            c[k] = getattr(a, k)
    c["attention"] = a.attention
    seq = a.seq or c["context"]
    device = torch.device(a.device)
    model = Gpt(c).to(device)
    params = sum(p.numel() for p in model.parameters())
    ddp = wrap(a, model, n)
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    if a.system == "ddp_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **hyper)
        inner = opt.optim
    else:
        opt = torch.optim.AdamW(ddp.parameters(), **hyper)
        inner = opt
    at = batches(a.data, seq, a.batch, rank, n)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.dtype == "bf16" and a.system != "fsdp2")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # kernels run asynchronously

    step_s, phases, losses, held = [], {"forward": [], "backward": [], "optimizer": []}, [], {}
    for step in range(a.warmup + a.steps):
        tokens = at(step).to(device)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = ddp(tokens)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        if step + 1 == a.warmup + a.steps:  # model state: parameters, gradients, optimizer state
            held = {"parameter": state_bytes(model.parameters()),
                    "gradient": state_bytes(p.grad for p in model.parameters()),
                    "optimizer": state_bytes(v for s in inner.state.values() for v in s.values())}
        opt.step()
        sync()
        t3 = time.perf_counter()
        dt = torch.tensor([t3 - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        mean_loss = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / n)
        if step >= a.warmup:
            step_s.append(dt.item())
            phases["forward"].append(t1 - t0)
            phases["backward"].append(t2 - t1)
            phases["optimizer"].append(t3 - t2)

    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    held["model_state"] = held["parameter"] + held["gradient"] + held["optimizer"]
    held["peak_rss"] = peak.item()
    s = sorted(step_s)
    pick = lambda q: s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]
    median = statistics.median(step_s)
    tokens_per_step = a.batch * seq * n
    out = {
        "bench": "gpt", "tag": a.tag, "system": a.system, "level": None, "dtype": a.dtype, "device": a.device,
        "ranks": n,
        "threads": torch.get_num_threads(),
        "model": {"vocab": c["vocab"], "context": c["context"], "d_model": c["d_model"], "layers": c["layers"],
                  "heads": c["heads"], "preset": a.preset, "attention": a.attention},
        "params": params, "batch": a.batch, "seq": seq, "steps": a.steps, "warmup": a.warmup,
        "optimizer": ("ZeroRedundancyOptimizer(" if a.system == "ddp_zero" else "(")
        + "torch.optim.AdamW lr 1e-3 betas (0.9, 0.95) wd 0.1)",
        "torch": torch.__version__,
        "tokens_per_step": tokens_per_step,
        "step_s": {"median": median, "p10": pick(0.1), "p90": pick(0.9)},
        "tokens_per_s": tokens_per_step / median,
        "phase_s": {k: statistics.median(v) for k, v in phases.items()},
        "loss_first": losses[0], "loss_last": losses[-1],
        "memory": held,
    }
    if rank == 0:
        emit(out, a.json)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(a, argv):
    """Starts the ranks as child processes and waits for all of them."""
    env = dict(os.environ, WORLD_SIZE=str(a.ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS=str(a.threads), OPENBLAS_NUM_THREADS=str(a.threads))
    children = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank-process"] + argv,
                                 env=dict(env, RANK=str(r))) for r in range(a.ranks)]
    deadline = time.monotonic() + a.timeout
    while any(p.poll() is None for p in children):
        failed = any(p.poll() not in (None, 0) for p in children)
        if failed or time.monotonic() > deadline:  # a rank died (its peers would wait) or too slow
            for p in children:
                if p.poll() is None:
                    p.kill()
            for p in children:
                p.wait()
            break
        time.sleep(0.05)
    codes = [p.returncode for p in children]
    if any(codes):
        sys.exit(f"peer_torch: rank exit codes {codes} (negative: killed; limit {a.timeout} s)")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system", choices=["ddp", "ddp_zero", "fsdp2", "eager"], default="ddp")
    p.add_argument("--device", default="cpu", help="cpu, or cuda with --system eager")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--d-model", dest="d_model", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--context", type=int)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--attention", choices=["fused", "eager"], default="fused",
                   help="F.scaled_dot_product_attention or the eager product and softmax")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq", type=int, help="sequence length (default: the context)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--data", default="data/tinyshakespeare.txt")
    p.add_argument("--json", help="append the result line to this file")
    p.add_argument("--tag", default="")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--check", action="store_true", help="verify the model against gpt_reference.py and exit")
    p.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    a = p.parse_args(argv)
    if a.device != "cpu" and a.system != "eager":
        p.error("--device cuda runs --system eager (the peers' process groups are gloo's, on the CPU)")
    if a.check:
        return check()
    if a.rank_process:
        code = train(a)
        # No interpreter teardown: with FSDP2 over gloo a rank sometimes aborts there ("terminate
        # called without an active exception") after its work is done.
        sys.stdout.flush()
        os._exit(code)
    return launch(a, argv)


if __name__ == "__main__":
    sys.exit(main())
