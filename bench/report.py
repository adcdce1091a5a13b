#!/usr/bin/env python3
"""Writes the tables and plots of bench/run_all.sh from its results.

    report.py --results DIR [--doc docs/benchmarks.md] [--img docs/img] [--print]

DIR holds results.jsonl (one object per gpt_bench / peer_torch.py run), meta.json and the
profiles. The generated Markdown replaces what lies between <!-- run_all:begin --> and
<!-- run_all:end --> in the page (--print writes it to stdout instead); the plots go to
IMG/bench_*.png. Every figure printed comes from DIR; the goals are checked here. With
--section growth, DIR is bench/growth.sh's: the section between <!-- growth:begin --> and
<!-- growth:end -->, and IMG/bench_growth.png.
"""
import argparse
import collections
import json
import os
import platform
import sys

BEGIN, END = "<!-- run_all:begin -->", "<!-- run_all:end -->"
MB = 1e6

# The final losses of runs that must be the same, relative: ztrain's levels among themselves, and
# against plain libtorch's GPT, whose tied table's gradient is summed in another order. In bf16
# each add of that sum rounds; after 13 steps the two losses have parted by 2.4e-4 (small, on a
# Xeon) and 9.7e-4 (small, on a Zen 4 EPYC), relative: held to a bf16 rounding step, 2^-8.
SAME_LOSS = 1e-7
PLAIN_LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 2.0 ** -8}

# Goals of the issue, checked against the measurements.
GOAL_L0_VS_DDP = 1.10
GOAL_L3_VS_DDP = 1.00
GOAL_L3_VS_FSDP2 = 1.10
GOAL_MEMORY = 0.10
GOAL_COMM = 0.05
GOAL_BF16_EFFICIENCY = 0.45

SYSTEMS = [  # (key, label) in table order
    ("plain", "plain libtorch (no engine, no communication)"),
    ("ztrain0", "ztrain level 0"),
    ("ztrain1", "ztrain level 1"),
    ("ztrain2", "ztrain level 2"),
    ("ztrain3", "ztrain level 3"),
    ("ddp", "PyTorch DDP"),
    ("ddp_zero", "PyTorch DDP + ZeroRedundancyOptimizer"),
    ("fsdp2", "PyTorch FSDP2 (fully_shard)"),
]
PEERS = ("ddp", "ddp_zero", "fsdp2")  # the PyTorch systems of peer_torch.py


def key(r):
    return f"ztrain{r['level']}" if r["system"] == "ztrain" else r["system"]


def size_name(r):
    m = r["model"]
    return f"{m['layers']} × {m['d_model']}"


def fmt_int(v):
    return f"{v:,.0f}"


def fmt_mb(v):
    return f"{v / MB:.2f}"


def tokens_cell(r):
    s = r["step_s"]
    lo, hi = r["tokens_per_step"] / s["p90"], r["tokens_per_step"] / s["p10"]
    return f"{r['tokens_per_s']:,.0f} ({lo:,.0f}–{hi:,.0f})"


def ms(v):
    return f"{1e3 * v:.0f}"


def verdict(ok):
    return "**met**" if ok else "**missed**"


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def machine():
    """The CPU (with its widest SIMD and its bf16 units), its cores and the memory, in words."""
    info = open("/proc/cpuinfo").read()
    name = next((l.split(":", 1)[1].strip() for l in info.splitlines() if l.startswith("model name")),
                platform.processor())
    simd = "AVX-512" if " avx512f" in info else "AVX2, no AVX-512" if " avx2" in info else "no AVX2"
    simd += ", AMX" if " amx_bf16" in info else ", AVX-512 BF16" if " avx512_bf16" in info else ", no bf16 units"
    memory = next(int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal")) * 1024
    return f"{name} ({simd}), {os.cpu_count()} cores, {memory / 2**30:.1f} GiB"


def config_line(r, what="per rank"):
    m = r["model"]
    return (f"GPT {m['layers']} layers × d {m['d_model']}, {m['heads']} heads, context {m['context']}, "
            f"vocabulary {m['vocab']} ({fmt_int(r['params'])} parameters); batch {r['batch']} × sequence "
            f"{r['seq']} {what}; {r['threads']} intra-op thread per rank; AdamW (lr 1e-3, betas 0.9/0.95, "
            f"weight decay 0.1); {r['steps']} timed steps after {r['warmup']} warm-up")


def configs(rows):
    """One configuration line per model in `rows` (the first run of each)."""
    seen, out = set(), []
    for r in sorted(rows, key=lambda r: r["params"]):
        if r["model"]["preset"] not in seen:
            seen.add(r["model"]["preset"])
            out.append(f"`{r['model']['preset']}`: {config_line(r)}")
    return "Configurations: " + "; ".join(out) + "." if out else ""


# ---- loading ------------------------------------------------------------------------------------

def load(results):
    """The run's rows (of a timed configuration run in several rounds, the fastest round's) and its
    meta."""
    rows = [json.loads(l) for l in open(os.path.join(results, "results.jsonl")) if l.strip()]
    meta_path = os.path.join(results, "meta.json")
    meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
    fastest = {}
    for r in rows:
        if r["tag"] == "peer" and r["tokens_per_s"] >= fastest.setdefault(config_key(r), r)["tokens_per_s"]:
            fastest[config_key(r)] = r
    return [r for r in rows if r["tag"] != "peer" or fastest[config_key(r)] is r], meta


def config_key(r):
    return r["model"]["preset"], r["ranks"], r["dtype"], key(r)


def index(rows, tag):
    """{(preset, ranks, dtype, system key): row} for the rows of one tag."""
    return {config_key(r): r for r in rows if r["tag"] == tag}


def self_times(path):
    """Self time by operator name (ms) from a Chrome trace of libtorch's profiler, and the total."""
    events = [e for e in json.load(open(path)) if e.get("ph") == "X"]
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[e["tid"]].append(e)
    own, total = collections.Counter(), 0.0
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                own[stack[-1]["name"]] -= e["dur"]
            else:
                total += e["dur"]
            own[e["name"]] += e["dur"]
            stack.append(e)
    return {k: v / 1e3 for k, v in own.items()}, total / 1e3


MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm",
              "aten::baddbmm_"}


# ---- sections -----------------------------------------------------------------------------------

def header(meta, rows):
    out = []
    if meta:
        busy_start, busy_end = meta.get("busy_start", 0), meta.get("busy_end", 0)
        mins, secs = divmod(int(meta.get("elapsed_s", 0)), 60)
        out.append(f"Generated by `bench/run_all.sh` on {meta.get('date', '?')} at commit {meta.get('commit', '?')}"
                   f"{' with uncommitted changes' if meta.get('dirty') else ''}: {machine_of(meta)}, "
                   f"{meta.get('mpi', '')}, PyTorch {meta.get('torch_python', '?')} "
                   f"for the Python peer; {meta.get('runs', len(rows))} runs in {mins} min {secs} s"
                   + (f", the timed comparison in {meta['rounds']} rounds, configuration by configuration, each "
                      "configuration's fastest round shown" if meta.get("rounds", 1) > 1 else "") + ". "
                   f"The cores were {busy_start}% busy with other work in the 3 s before the run and {busy_end}% after.")
        if "bf16" not in meta.get("dtypes", ["bf16"]):
            out.append("\n**fp32 only: this CPU has no bf16 units (AVX-512 BF16 or AMX). ztrain's bf16 matmuls "
                       "run through fp32 kernels here (src/cpu_matmul16.cpp), but the PyTorch peers' fall back to "
                       "a path many times slower than fp32's; the bf16 goals are not measured here.**")
        if meta.get("quick"):
            out.append("\n**Quick run (`--quick`): 2 timed steps per configuration. These figures check the "
                       "tooling; they are not measurements.**")
        if busy_start > 10:
            out.append(f"\n**The machine was not idle when the run started ({busy_start}% busy): "
                       "every timing below is noisy and the ratios may move.**")
    return "\n".join(out)


def machine_of(meta):
    """The machine a run's meta names (older runs recorded the CPU and cores only)."""
    return meta.get("machine") or f"{meta.get('cpu', '?')}, {meta.get('cores', '?')} cores"


def peers_section(rows, img):
    idx = index(rows, "peer")
    presets = sorted({p for (p, _, _, _) in idx}, key=lambda p: min(r["params"] for (q, *_), r in idx.items() if q == p))
    out = ["### Throughput against PyTorch and plain libtorch", ""]
    out.append(
        "Tokens/s (global batch over the median step, p10–p90 of the steps in brackets), each system with its own "
        "optimizer and mixed precision: ztrain's fused AdamW with bf16 parameters and gradients and fp32 masters; "
        "PyTorch's `torch.optim.AdamW` with fp32 parameters and the forward under `torch.autocast(\"cpu\", "
        "torch.bfloat16)` for DDP, FSDP2's `MixedPrecisionPolicy(param_dtype=torch.bfloat16)` (fp32 shards, "
        "bf16 gathers, compute and gradient reductions); DDP over gloo with its default buckets, FSDP2 with each "
        "transformer block a unit. Plain libtorch is the same GPT built from plain "
        "libtorch modules with ztrain's AdamW, every rank training its own replica without any communication: "
        "the ceiling for data parallelism on these cores. Ratios are to PyTorch DDP of the same dtype and rank "
        "count, and to plain libtorch. The loss is the mean over ranks after the last step (same data for every "
        "system; ztrain and plain libtorch also start from the same weights).")
    goals = []
    for preset in presets:
        any_row = next(r for (p, *_), r in idx.items() if p == preset)
        peer_params = {r["params"] for (p, _, _, s), r in idx.items() if p == preset and s in PEERS}
        ours = {r["params"] for (p, _, _, s), r in idx.items() if p == preset and s not in PEERS}
        same = "equal" if peer_params == ours and len(ours) == 1 else f"DIFFERENT: {sorted(peer_params)} vs {sorted(ours)}"
        out += ["", f"**`{preset}`**: {config_line(any_row)}. Parameters counted by ztrain "
                    f"{', '.join(fmt_int(p) for p in sorted(ours))}, by the PyTorch peer "
                    f"{', '.join(fmt_int(p) for p in sorted(peer_params))} ({same}).", ""]
        body = []
        for dtype in ("fp32", "bf16"):
            for sk, label in SYSTEMS:
                r1, r2 = idx.get((preset, 1, dtype, sk)), idx.get((preset, 2, dtype, sk))
                d1, d2 = idx.get((preset, 1, dtype, "ddp")), idx.get((preset, 2, dtype, "ddp"))
                p2 = idx.get((preset, 2, dtype, "plain"))
                if not r1 and not r2:
                    continue
                body.append([
                    label, dtype,
                    tokens_cell(r1) if r1 else "–",
                    f"{r1['tokens_per_s'] / d1['tokens_per_s']:.2f}" if r1 and d1 else "–",
                    tokens_cell(r2) if r2 else "–",
                    f"{r2['tokens_per_s'] / d2['tokens_per_s']:.2f}" if r2 and d2 else "–",
                    f"{r2['tokens_per_s'] / p2['tokens_per_s']:.2f}" if r2 and p2 else "–",
                    f"{r2['loss_last']:.3f}" if r2 else "–",
                ])
            for level, peer, goal in ((0, "ddp", GOAL_L0_VS_DDP), (3, "ddp", GOAL_L3_VS_DDP),
                                      (3, "fsdp2", GOAL_L3_VS_FSDP2)):
                r2, d2 = idx.get((preset, 2, dtype, f"ztrain{level}")), idx.get((preset, 2, dtype, peer))
                if r2 and d2:
                    ratio = r2["tokens_per_s"] / d2["tokens_per_s"]
                    goals.append((preset, dtype, level, peer, goal, ratio))
        out.append(table(["system", "dtype", "tokens/s, 1 rank", "÷ DDP", "tokens/s, 2 ranks", "÷ DDP", "÷ plain",
                          "loss, 2 ranks"], body))
    # (what, the largest difference of the final losses, relative, and the most it may be)
    diffs, against = [], []
    for preset in presets:
        for dtype in ("fp32", "bf16"):
            plain = idx.get((preset, 1, dtype, "plain"))
            for n in (1, 2):
                levels = [idx[k]["loss_last"] for k in idx if k[:3] == (preset, n, dtype) and k[3].startswith("ztrain")]
                if len(levels) > 1:
                    diffs.append((f"{preset} {dtype}, {n} rank{'s' if n > 1 else ''}, among the levels",
                                  (max(levels) - min(levels)) / abs(min(levels)), SAME_LOSS))
                if n == 1 and plain and levels:
                    d = max(abs(v - plain["loss_last"]) for v in levels) / abs(plain["loss_last"])
                    diffs.append((f"{preset} {dtype}, 1 rank, against plain libtorch", d, PLAIN_LOSS_TOLERANCE[dtype]))
                    against.append(f"{preset} {dtype} {d:.1e}")
    if diffs:
        bad = [(w, d, t) for w, d, t in diffs if d > t]
        out += ["", "Verification: " + (
            "the final losses of ztrain's levels 0–3 are identical to each other at 1 and at 2 ranks, and at 1 rank "
            f"within {PLAIN_LOSS_TOLERANCE['fp32']:.0e} (fp32) and {PLAIN_LOSS_TOLERANCE['bf16']:.0e} (bf16) of plain "
            f"libtorch's, relative ({', '.join(against)}). Same weights and data, and every gradient the same bit for "
            "bit but the tied table's, which ztrain's GPT sums in another order: the head's product made in its "
            "place and the lookup's rows added into it (`Gpt.GradientsArePlainGpts`, tests/models/gpt_test.cpp)."
            if not bad else
            "the final losses differ: " + "; ".join(f"{w} by {d:.3g} relative (at most {t:.0e})" for w, d, t in bad)
            + " (same weights and data).")]
    out += ["", f"![tokens/s at 2 ranks]({img}/bench_peers.png)", ""]
    out += ["**Goals** (2 ranks, same model and dtype): ztrain level 0 ≥ "
            f"{GOAL_L0_VS_DDP:.1f}× and level 3 ≥ {GOAL_L3_VS_DDP:.1f}× the tokens/s of PyTorch DDP, level 3 ≥ "
            f"{GOAL_L3_VS_FSDP2:.1f}× that of PyTorch FSDP2.", ""]
    out.append(table(["model", "dtype", "ztrain", "against", "goal", "ratio", ""],
                     [[p, d, f"level {l}", dict(SYSTEMS)[s], f"≥ {g:.2f}", f"{v:.2f}", verdict(v >= g)]
                      for p, d, l, s, g, v in goals]))
    missed = [(p, d, l) for p, d, l, s, g, v in goals if v < g]
    if missed:
        out += ["", "Where the time goes at 2 ranks (medians of rank 0's phases, ms; the step is the max over ranks "
                    "from a barrier). Plain libtorch does the same computation per rank without communication; "
                    "the difference to it is what the data parallelism costs:", ""]
        body = []
        for preset, dtype in sorted({(p, d) for p, d, _ in missed}):
            for sk, label in SYSTEMS:
                r = idx.get((preset, 2, dtype, sk))
                if r:
                    ph = r["phase_s"]
                    plain = idx.get((preset, 2, dtype, "plain"))
                    extra = f"{1e3 * (r['step_s']['median'] - plain['step_s']['median']):+.0f}" if plain else "–"
                    body.append([preset, dtype, label, ms(ph["forward"]), ms(ph["backward"]), ms(ph["optimizer"]),
                                 ms(r["step_s"]["median"]), extra])
        out.append(table(["model", "dtype", "system", "forward", "backward", "optimizer", "step", "step − plain"], body))
        out += ["", "ztrain's backward includes waiting for the last gradient reductions (they run on a "
                    "communication thread during backward and are complete when `backward()` returns); DDP's "
                    "backward likewise includes its bucketed all-reduce; ZeroRedundancyOptimizer's step includes "
                    "the broadcast of the updated parameters. With one compute thread per core, the communication "
                    "threads' copies and reduction arithmetic take the same cores as the compute."]
    return "\n".join(out), goals


def memory_section(rows):
    out = ["### Model-state memory against the ZeRO formulas", ""]
    out.append(
        "Bytes per rank (MB = 10⁶ bytes; the max over ranks) held for the model state after the last backward, "
        "before its optimizer step, when parameters, gradients and optimizer state all exist, from "
        "`ztrain::memory_stats(model, &optimizer)` (optimizer state: moments, and fp32 masters for bf16). Bytes per "
        "parameter: fp32 4 parameters + 4 gradients + 8 Adam moments; bf16 mixed precision 2 + 2 + 12 (fp32 "
        "master and moments). Two formulas divide parts of that by N ranks. The ZeRO paper's stages: level 1 "
        "the optimizer state, 2 also the gradients, 3 also the parameters. ztrain's levels as designed "
        "(DESIGN.md §5): gradients are reduce-scattered from level 1 on and parameters stay sharded between "
        "steps from level 2 on (level 2 gathers them once per step and keeps them from forward to backward, "
        "level 3 gathers twice), so ztrain's levels 1 and 2 hold less than the paper's stages of the same "
        "number. The goal is checked against the design; the paper's ratio is shown beside it. Peak RSS is the "
        "process's high-water mark (libtorch, MPI, activations, the gathered parameters of levels 2-3 and "
        "communication buffers included; the 4-rank runs oversubscribe the 2 cores, which does not change bytes).")
    sel = [r for r in rows if r["system"] == "ztrain" and r["model"]["preset"] == "small"
           and r["tag"] in ("peer", "memory") and r["formula"]]
    if not sel:
        return "\n".join(out + ["", "(not measured in this run)"]), []
    r0 = sel[0]
    out += ["", f"Model: {config_line(r0)}.", ""]
    body, checks = [], []
    for dtype in ("fp32", "bf16"):
        for level in range(4):
            for n in (1, 2, 4):
                r = next((x for x in sel if x["dtype"] == dtype and x["level"] == level and x["ranks"] == n), None)
                if not r:
                    continue
                m, design, paper = r["memory"], r["formula"]["design"], r["formula"]["paper"]
                ratio = m["model_state"] / design["model_state"]
                checks.append((dtype, level, n, ratio))
                body.append([dtype, level, n, fmt_mb(m["parameter"]), fmt_mb(m["gradient"]), fmt_mb(m["optimizer"]),
                             fmt_mb(m["gathered"]), fmt_mb(m["model_state"]), fmt_mb(design["model_state"]),
                             f"{ratio:.3f}", fmt_mb(paper["model_state"]),
                             f"{m['model_state'] / paper['model_state']:.3f}", fmt_mb(m["peak_rss"])])
    out.append(table(["dtype", "level", "ranks", "parameters", "gradients", "optimizer", "gathered", "model state",
                      "design formula", "÷ design", "paper formula", "÷ paper", "peak RSS"], body))
    peers = [r for r in rows if r["tag"] == "peer" and r["system"] in PEERS and r["model"]["preset"] == "small"
             and r["ranks"] == 2]
    if peers:
        out += ["", "The PyTorch peers at 2 ranks on the same model, for comparison (parameters, gradients and "
                    "optimizer state as tensors; DDP's gradient buckets are not counted):", ""]
        out.append(table(["system", "dtype", "parameters", "gradients", "optimizer", "model state", "peak RSS"],
                         [[dict(SYSTEMS)[r["system"]], r["dtype"], fmt_mb(r["memory"]["parameter"]),
                           fmt_mb(r["memory"]["gradient"]), fmt_mb(r["memory"]["optimizer"]),
                           fmt_mb(r["memory"]["model_state"]), fmt_mb(r["memory"]["peak_rss"])] for r in peers]))
    bad = [(d, l, n, v) for d, l, n, v in checks if abs(v - 1) > GOAL_MEMORY]
    out += ["", f"**Goal**: model state within {100 * GOAL_MEMORY:.0f}% of the formula: "
                f"{verdict(not bad)} ({len(checks) - len(bad)} of {len(checks)} configurations within"
                + (", ratios " + f"{min(v for *_, v in checks):.3f}–{max(v for *_, v in checks):.3f}" if checks else "")
                + ")."]
    if bad:
        out.append(" Outside: " + ", ".join(f"{d} level {l} N={n}: {v:.3f}" for d, l, n, v in bad) + ".")
    return "\n".join(out), checks


def comm_section(rows):
    out = ["### Bytes sent per step against theory", ""]
    out.append(
        "Bytes one rank moves per training step (the max over ranks), counted inside the process "
        "(`bench/mpi_traffic.h`: the MPI calls of the ZeRO engine's two stream communicators, gathers and "
        "reductions; the runtime's own communicators carry the benchmark's barriers and loss and are left out). "
        "ztrain's collectives at or above 256 KiB read the peers' host-shared buffers in place when the ranks share "
        "a host (the engine's default; the bytes read are counted, the in-place column) and are otherwise rings of "
        "point-to-point messages, counted as sent; "
        "below, MPI's own collectives run, counted at their bandwidth-optimal volume (the native column). Theory "
        "per rank: a ring all-reduce or reduce-scatter + all-gather of the Ψ·b bytes of the parameters (b bytes "
        "per element of the model dtype) sends 2·(N−1)/N·Ψb; levels 0–2 send that (the ZeRO paper's 2Ψ, its "
        "N → ∞ limit), level 3 gathers them again for backward, all but the last block, which keeps them "
        "from its forward: (N−1)/N·(3Ψ − Ψ_block)·b. Where the ranks share a host, the full parameters of "
        "levels 2 and 3 map the ranks' shards instead (the engine's default with host-shared buffers, for flat "
        "groups whose shard is at least 256 KiB): those parameters are reduced and never gathered, and the theory "
        "leaves them out of the gathers. Where the native share is 100% (the tiny model), "
        "the row checks the volume the engine asks MPI to move, not the transport's own traffic.")
    sel = [r for r in rows if r["system"] == "ztrain" and r["ranks"] > 1 and r["tag"] in ("peer", "memory")]
    body, checks = [], []
    for r in sorted(sel, key=lambda r: (r["params"], r["dtype"], r["ranks"], r["level"])):
        n, b = r["ranks"], (4 if r["dtype"] == "fp32" else 2)
        c = r["comm_bytes_per_step"]
        theory = sent_theory(r, b)
        sent = c["gather"] + c["reduce"]
        ratio = sent / theory
        checks.append((r["model"]["preset"], r["dtype"], r["level"], n, ratio))
        body.append([r["model"]["preset"], r["dtype"], r["level"], n, fmt_mb(c["gather"]), fmt_mb(c["reduce"]),
                     f"{100 * c.get('in_place', 0) / sent:.0f}%" if sent else "–",
                     f"{100 * c['native'] / sent:.0f}%" if sent else "–", fmt_mb(theory), f"{ratio:.3f}"])
    out += ["", configs(sel) + " The 4-rank runs: 2 timed steps after 1 warm-up."]
    out += ["", table(["model", "dtype", "level", "ranks", "gathers MB", "reductions MB", "in place", "native",
                       "theory MB", "÷ theory"], body)]
    bad = [c for c in checks if abs(c[4] - 1) > GOAL_COMM]
    out += ["", f"**Goal**: within {100 * GOAL_COMM:.0f}% of theory: {verdict(not bad)} "
                f"({len(checks) - len(bad)} of {len(checks)} configurations within)."]
    if bad:
        out.append(" Outside: " + ", ".join(f"{p} {d} level {l} N={n} ({v:.3f})" for p, d, l, n, v in bad) + ".")
    return "\n".join(out), checks


def efficiency_section(rows, results):
    out = ["### Compute efficiency against the matmul peak", ""]
    out.append(
        "Achieved model FLOP/s per rank (`GptConfig::flops_per_token`: 6 per parameter use and token plus "
        "attention, times tokens/s, divided by the ranks) against the matmul peak measured at the start of "
        "the same process with the same threads, all ranks measuring at once: the best of square fp32 / bf16 "
        "matmuls of 512, 1024 and 2048 (`peak`; a size is skipped when the one before took over a second), and the "
        "model's own largest matmul shape (tokens × d by d × 4d)."
        + (" The bf16 matmuls of `gpt_bench` (ztrain's and plain libtorch's, in a process that loads ztrain) ran "
           "through fp32 kernels on widened operands, which the first bf16 matmul timed faster on this CPU than its "
           "bf16 units (`src/cpu_matmul16.cpp`); the PyTorch peers' ran on the units, through oneDNN."
           if any(r.get("cpu_matmul16") == "fp32" for r in rows)
           else " bf16 matmuls run on the CPU's AMX/AVX-512 BF16 units through oneDNN, hence their much higher peak."
           if any(r["dtype"] == "bf16" for r in rows) else ""))
    sel = [r for r in rows if r["tag"] == "peer" and r.get("matmul")]
    body, goals, disturbed = [], [], 0
    largest = max((r["params"] for r in sel), default=0)
    mark = lambda share: f"{100 * share:.1f}%" + (" †" if share > 1 else "")  # † above the peak: see below
    for r in sorted(sel, key=lambda r: (r["params"], r["ranks"], r["dtype"], key(r))):
        mm = r["matmul"][r["dtype"]]
        eff = r["model_gflops_per_rank"] / mm["peak_gflops"]
        of_shape = r["model_gflops_per_rank"] / mm["model_shape_gflops"]
        body.append([r["model"]["preset"], r["dtype"], r["ranks"], dict(SYSTEMS)[key(r)], f"{r['model_gflops_per_rank']:.1f}",
                     f"{mm['peak_gflops']:.0f}", f"{mm['model_shape_gflops']:.0f}", mark(eff), mark(of_shape)])
        disturbed += eff > 1 or of_shape > 1
        if r["dtype"] == "bf16" and r["params"] == largest and r["system"] == "ztrain" and eff <= 1:
            goals.append((r["ranks"], eff))
    out += ["", configs(sel)]
    out += ["", table(["model", "dtype", "ranks", "system", "model GFLOP/s per rank", "peak GFLOP/s",
                       "model-shape GFLOP/s", "÷ peak", "÷ model shape"], body)]
    if disturbed:
        out += ["", "† Above 100%: the step ran faster than the matmul peak its own process measured, so that "
                    "probe was slowed while it timed its matmuls and the share means nothing; the goal leaves such a "
                    "run out."]
    ok = goals and all(e >= GOAL_BF16_EFFICIENCY for _, e in goals)
    goal = f"**Goal**: bf16 ≥ {100 * GOAL_BF16_EFFICIENCY:.0f}% of the measured matmul peak for the larger model: "
    out += ["", goal + (f"{verdict(bool(ok))} (" + ", ".join(f"{n} rank{'s' if n > 1 else ''}: {100 * e:.1f}%"
                                                            for n, e in goals) + ")." if goals else
                        "not measured (no bf16 runs: this CPU has no bf16 units).")]
    profiles = [r for r in rows if r.get("profile") and os.path.exists(os.path.join(results, os.path.basename(r["profile"])))]
    if profiles:
        out += ["", "Profile of one step (libtorch's profiler, rank 0, 1 rank, ztrain level 0): self time by "
                    "operator, the ten largest, and the share of all matmuls (mm, addmm, bmm and their in-place forms):", ""]
        cols, names = {}, []
        for r in sorted(profiles, key=lambda r: r["dtype"]):
            own, total = self_times(os.path.join(results, os.path.basename(r["profile"])))
            cols[r["dtype"]] = (own, total)
            for name, _ in sorted(own.items(), key=lambda kv: -kv[1])[:10]:
                if name not in names:
                    names.append(name)
        dts = sorted(cols)
        body = []
        for name in sorted(names, key=lambda n: -max(cols[d][0].get(n, 0) / cols[d][1] for d in dts)):
            body.append([f"`{name}`"] + [f"{cols[d][0].get(name, 0):.1f} ({100 * cols[d][0].get(name, 0) / cols[d][1]:.0f}%)"
                                        for d in dts])
        body.append(["all matmuls"] + [f"{sum(v for k, v in cols[d][0].items() if k in MATMUL_OPS):.1f} "
                                       f"({100 * sum(v for k, v in cols[d][0].items() if k in MATMUL_OPS) / cols[d][1]:.0f}%)"
                                       for d in dts])
        body.append(["the step (profiled)"] + [f"{cols[d][1]:.1f}" for d in dts])
        out.append(table(["operator"] + [f"{d} ms (share)" for d in dts], body))
        if "bf16" in cols and not ok:
            own, total = cols["bf16"]
            mm_ms = sum(v for k, v in own.items() if k in MATMUL_OPS)
            others = [(k, v) for k, v in sorted(own.items(), key=lambda kv: -kv[1]) if k not in MATMUL_OPS][:4]
            fp32 = cols.get("fp32", ({}, 0))[0]
            # The step if the matmuls ran at the measured bf16 peak and everything else as profiled.
            bf16_row = next(r for r in profiles if r["dtype"] == "bf16")
            matmul_flops = bf16_row["flops_per_token"] * bf16_row["tokens_per_step"] / bf16_row["ranks"]
            peak = bf16_row["matmul"]["bf16"]["peak_gflops"] * 1e9
            ideal_ms = 1e3 * matmul_flops / peak
            # The efficiency of that step, every other operator as profiled: the most this profile allows.
            bound = matmul_flops / ((total - mm_ms + ideal_ms) / 1e3) / peak
            out += ["", f"Why the bf16 goal is missed: in the profiled bf16 step the matmuls take {mm_ms:.0f} ms "
                        f"({100 * mm_ms / total:.0f}%) of {total:.0f} ms; at the measured peak the model's FLOPs "
                        f"would need {ideal_ms:.0f} ms. The largest other operators: "
                        + ", ".join(f"`{k}` {v:.0f} ms" + (f" (fp32: {fp32[k]:.0f} ms)" if k in fp32 else "")
                                    for k, v in others)
                        + ". With the model's FLOPs done at the peak and the other operators as profiled the "
                          f"step would reach {100 * bound:.0f}% of the peak: a model of width {bf16_row['model']['d_model']} does "
                          "few FLOPs per byte its other operators move, and the bf16 units make the matmuls "
                          "many times faster than that traffic."]
    return "\n".join(out), goals


GROWTH = ("<!-- growth:begin -->", "<!-- growth:end -->")


def block_params(d):
    """Parameters of one GPT block of width d: attention and MLP weights and biases, two LayerNorms."""
    return 12 * d * d + 13 * d


def growth_params(m):
    """Parameters of gpt_bench's GPT (byte vocabulary, learnt positions, tied head) of shape `m`."""
    d = m["d_model"]
    return m["layers"] * block_params(d) + (m["vocab"] + m["context"]) * d + 2 * d


def sent_theory(r, b=4):
    """Bytes a rank sends per step by the ring formulas, b bytes per element: a reduce-scatter and
    an all-gather of the Ψ·b bytes of the parameters at levels 0–2, 2·(N−1)/N·Ψb; level 3 gathers
    them again for backward, all but the last block's, which keeps its parameters from its forward
    to its backward. Parameters whose full buffers map the ranks' shards (levels 2-3 on one host)
    are reduced but never gathered."""
    n, psi = r["ranks"], r["params"]
    mapped, mapped_block = r.get("mapped_params", 0), r.get("mapped_block_params", 0)
    elements = psi + (psi - mapped)
    if r["level"] == 3:
        elements += psi - mapped - (block_params(r["model"]["d_model"]) - mapped_block)
    return (n - 1) / n * elements * b


def growth_theory(r):
    """The lines drawn beside a growth run: its step if the model FLOPs ran at the matmul peak
    measured in the same process, the bytes a rank moves per step by the ring formulas, and the
    model state per rank by the design formula."""
    n = r["ranks"]
    tokens = r["tokens_per_step"] / n
    return {"step_s": r["flops_per_token"] * tokens / (r["matmul"]["fp32"]["peak_gflops"] * 1e9),
            "bytes": sent_theory(r),
            "model_state": r["formula"]["design"]["model_state"]}


def growth_series(rows):
    """{(level, ranks): [row, ...] by size}; rows that did not fit carry "fits": False."""
    out = collections.defaultdict(list)
    for r in rows:
        if r["tag"] == "growth":
            r.setdefault("params", growth_params(r["model"]))
            out[(r["level"], r["ranks"])].append(r)
    for v in out.values():
        v.sort(key=lambda r: r["params"])
    return dict(sorted(out.items(), key=lambda kv: (kv[0][1], -kv[0][0])))


def growth_header(meta):
    if not meta:
        return ""
    mins, secs = divmod(int(meta["elapsed_s"]), 60)
    return (f"Generated by `bench/growth.sh` on {meta['date']} at commit {meta['commit']}"
            f"{' with uncommitted changes' if meta['dirty'] else ''}: {meta['cpu']}, {meta['cores']} cores, "
            f"{meta['memory_gib']:.1f} GiB; {meta['runs']} runs in {mins} min {secs} s.\n\n")


def growth_section(rows, img):
    out = ["### Growth with model size and rank count", ""]
    series = growth_series(rows)
    fitted = [r for rs in series.values() for r in rs if r.get("fits", True)]
    if not fitted:
        return "\n".join(out + ["(not measured in this run)"])
    r0 = fitted[0]
    out.append(
        f"GPT of {r0['model']['layers']} layers and width d (d/64 heads, byte vocabulary), context "
        f"{r0['model']['context']}, batch {r0['batch']} × sequence {r0['seq']} per rank, fp32, AdamW, one intra-op "
        f"thread per rank; ZeRO level 3 at 1, 2 and 4 ranks and level 0 at 2 ranks; {r0['steps']} timed steps after "
        f"{r0['warmup']} warm-up, step time the median (max over ranks). The 4-rank runs oversubscribe the 2 cores, "
        "so a rank has about half a core; their peak is measured with all ranks at once, but its short square matmuls "
        "can run at a whole core's rate, and then their compute-bound line and share of the peak compare half a core "
        "with a whole one. Each run is one process tree in a memory cgroup limited to the machine's memory less 1 GiB; "
        "a size the kernel killed there does not fit, and its series stops. Theory beside each measure: "
        "**compute-bound step**, the model FLOPs of a rank's tokens (`GptConfig::flops_per_token`) at the fp32 matmul "
        "peak measured at the start of the same run; **bytes** a rank moves per step (gathers and reductions, in place "
        "or sent), by the ring formulas (`sent_theory`): a reduce-scatter and an all-gather of the 4Ψ bytes of the "
        "parameters, 2·(N−1)/N·4Ψ, and at level 3 a second all-gather for backward of all blocks but the last; "
        "parameters whose full buffers map the ranks' shards (level 3 with every rank on one host) are reduced but "
        "never gathered, so there the bytes fall to about (N−1)/N·4Ψ; **model state** per rank by the design formula "
        "(16Ψ at level 0, 16Ψ/N at level 3). Peak RSS adds libtorch, MPI, activations and the gathered (on one host, "
        "mapped) blocks to the model state, and counts the pages ranks share in each one's.")
    body = []
    for (level, n), rs in series.items():
        for r in rs:
            head = [r["model"]["d_model"], fmt_int(r["params"]), level, n]
            if not r.get("fits", True):
                body.append(head + [f"does not fit: killed at {r['cgroup_peak'] / 2**30:.1f} GiB "
                                    f"(limit {r['limit'] / 2**30:.1f} GiB)"] + [""] * 7)
                continue
            t = growth_theory(r)
            c = r["comm_bytes_per_step"]
            moved = c["gather"] + c["reduce"]
            body.append(head + [ms(r["step_s"]["median"]), ms(t["step_s"]), f"{r['step_s']['median'] / t['step_s']:.2f}",
                                fmt_mb(moved), fmt_mb(t["bytes"]), fmt_mb(r["memory"]["model_state"]),
                                fmt_mb(t["model_state"]), fmt_mb(r["memory"]["peak_rss"]),
                                f"{r['model_gflops_per_rank'] / r['matmul']['fp32']['peak_gflops']:.0%}"])
    out += ["", table(["d", "parameters", "level", "ranks", "step ms", "compute-bound ms", "÷", "bytes moved MB",
                       "theory MB", "model state MB", "formula MB", "peak RSS MB", "of matmul peak"], body)]
    largest = {k: max((r for r in rs if r.get("fits", True)), key=lambda r: r["params"], default=None)
               for k, rs in series.items()}
    out += ["", "Largest that trained: " + "; ".join(
        f"level {l}, {n} rank{'s' if n > 1 else ''}: {r['params'] / 1e6:,.1f} M" for (l, n), r in largest.items() if r)
        + ".", "", f"![growth]({img}/bench_growth.png)"]
    return "\n".join(out)


def growth_plot(rows, img_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = growth_series(rows)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ((level, n), rs) in enumerate(series.items()):
        color, label = colors[i % len(colors)], f"level {level}, {n} rank{'s' if n > 1 else ''}"
        fit = [r for r in rs if r.get("fits", True)]
        x = [r["params"] / 1e6 for r in fit]
        theory = [growth_theory(r) for r in fit]
        axes[0].plot(x, [r["step_s"]["median"] for r in fit], marker="o", color=color, label=label)
        axes[0].plot(x, [t["step_s"] for t in theory], linestyle="--", color=color)
        if n > 1:
            axes[1].plot(x, [(r["comm_bytes_per_step"]["gather"] + r["comm_bytes_per_step"]["reduce"]) / 1e9
                             for r in fit], marker="o", color=color, label=label)
            axes[1].plot(x, [t["bytes"] / 1e9 for t in theory], linestyle="--", color=color)
        axes[2].plot(x, [r["memory"]["peak_rss"] / 1e9 for r in fit], marker="o", color=color, label=f"{label}: peak RSS")
        axes[2].plot(x, [t["model_state"] / 1e9 for t in theory], linestyle="--", color=color)
        for r in rs:
            if not r.get("fits", True):
                axes[2].plot([r["params"] / 1e6], [r["limit"] / n / 1e9], marker="X", markersize=10, color=color,
                             linestyle="none")
    titles = ["step time (dashed: compute-bound at the measured matmul peak)",
              "bytes moved per rank per step (dashed: ring formula, under the measured lines)",
              "memory per rank (dashed: model-state formula; X: did not fit, at limit / N)"]
    for ax, title, ylabel in zip(axes, titles, ["s", "GB", "GB"]):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters (M)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(img_dir, exist_ok=True)
    fig.savefig(os.path.join(img_dir, "bench_growth.png"), dpi=90)
    plt.close(fig)


# ---- plots --------------------------------------------------------------------------------------

def plots(rows, img_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(img_dir, exist_ok=True)
    idx = index(rows, "peer")
    presets = sorted({p for (p, *_) in idx}, key=lambda p: min(r["params"] for (q, *_), r in idx.items() if q == p))
    if presets:
        fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 4.2), squeeze=False)
        for ax, preset in zip(axes[0], presets):
            labels = [sk for sk, _ in SYSTEMS if any((preset, 2, d, sk) in idx for d in ("fp32", "bf16"))]
            for i, dtype in enumerate(("fp32", "bf16")):
                vals = [idx[(preset, 2, dtype, sk)]["tokens_per_s"] if (preset, 2, dtype, sk) in idx else 0 for sk in labels]
                ax.bar([x + 0.4 * i for x in range(len(labels))], vals, width=0.4, label=dtype)
            ax.set_xticks([x + 0.2 for x in range(len(labels))])
            ax.set_xticklabels([s.replace("ztrain", "ztrain L").replace("ddp_zero", "DDP+ZeRO").replace("ddp", "DDP")
                                .replace("fsdp2", "FSDP2")
                                for s in labels], rotation=30, ha="right")
            ax.set_ylabel("tokens/s (2 ranks)")
            ax.set_title(f"GPT {preset} ({idx[next(k for k in idx if k[0] == preset)]['params'] / 1e6:.2f} M params)")
            ax.legend(loc="lower right", framealpha=0.9)
        fig.tight_layout()
        fig.savefig(os.path.join(img_dir, "bench_peers.png"), dpi=90)
        plt.close(fig)


# ---- main ---------------------------------------------------------------------------------------

def replace_section(doc, begin, end, text):
    """Puts `text` between the markers `begin` and `end` of the page `doc`; without a page, prints it."""
    if not doc:
        sys.stdout.write(text)
        return
    page = open(doc).read()
    if begin not in page or end not in page:
        sys.exit(f"report: {doc} lacks the markers {begin} and {end}")
    head, rest = page.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(doc, "w") as f:
        f.write(head + begin + "\n" + text + end + tail)
    print(f"report: wrote {doc}", file=sys.stderr)


def render(rows, meta, results, img_rel):
    parts = [header(meta, rows)]
    peers, _ = peers_section(rows, img_rel)
    memory, _ = memory_section(rows)
    comm, _ = comm_section(rows)
    eff, _ = efficiency_section(rows, results)
    parts += [peers, memory, comm, eff]
    return "\n\n".join(p for p in parts if p) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", required=True)
    p.add_argument("--doc", help="the page whose marked section is replaced")
    p.add_argument("--img", help="directory of the plots")
    p.add_argument("--print", action="store_true", help="print the section instead of writing the page")
    p.add_argument("--section", choices=("run_all", "growth"), default="run_all",
                   help="which script's results: bench/run_all.sh's or bench/growth.sh's")
    a = p.parse_args()
    rows, meta = load(a.results)
    img_rel = os.path.relpath(a.img, os.path.dirname(os.path.abspath(a.doc))) if a.img and a.doc else "img"
    if a.section == "growth":
        text, markers = growth_header(meta) + growth_section(rows, img_rel) + "\n", GROWTH
    else:
        text, markers = render(rows, meta, a.results, img_rel), (BEGIN, END)
    replace_section(None if a.print else a.doc, *markers, text)
    if a.img:
        (growth_plot if a.section == "growth" else plots)(rows, a.img)
    return 0


if __name__ == "__main__":
    sys.exit(main())
