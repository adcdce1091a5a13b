#!/usr/bin/env python3
"""Writes the section of bench/beyond_memory.sh from its results.

    beyond_memory_report.py --results FILE [--doc docs/benchmarks.md]

FILE is the run's results.jsonl: the disk probe's line, then one line per training run. The
Markdown replaces what lies between <!-- beyond_memory:begin --> and <!-- beyond_memory:end -->
in the page (without --doc it is printed). Every figure comes from FILE; the goal is checked here.
"""
import argparse
import json
import os
import sys

from report import machine, replace_section, table, verdict

BEGIN, END = "<!-- beyond_memory:begin -->", "<!-- beyond_memory:end -->"
GOAL_RATIO = 2.0  # ztrain's largest model over FSDP2's
GB = 1e9
LABELS = {"fsdp2": "PyTorch FSDP2, in memory", "ztrain-memory": "ztrain level 3, in memory",
          "ztrain": "ztrain level 3, model state on disk"}


def outcome(run):
    """Why a run failed: killed by the kernel for memory (the cgroup's count, or the peer's rank
    killed by signal 9), or something else."""
    log = open(run["log"], errors="replace").read() if os.path.exists(run["log"]) else ""
    if run.get("oom_kills") or run["rc"] == 137 or "exit codes [-9]" in log:
        return "**does not fit**: killed by the kernel, out of memory"
    return f"**failed** (exit {run['rc']}, see {os.path.basename(run['log'])})"


def render(rows):
    disk = next(r for r in rows if r["name"] == "disk")
    runs = [r for r in rows if r["name"] != "disk"]
    write_bw, read_bw = disk["bytes"] / disk["write_s"], disk["bytes"] / disk["read_s"]
    limit = runs[0]["limit"] if runs else 0
    largest = {}
    body = []
    for r in runs:
        system = r["name"].rsplit("-L", 1)[0]
        ok = r["rc"] == 0
        if ok:
            largest[system] = max(largest.get(system, 0), r["params_m"])
        moved = r["read_bytes"] + r["write_bytes"]
        disk_s = r["read_bytes"] / read_bw + r["write_bytes"] / write_bw
        step = f"{r['step_s']:.1f}" if ok and r["step_s"] else "—"
        body.append([
            LABELS[system],
            f"{r['params_m']:,.0f}", "trained 3 steps" if ok else outcome(r),
            step, f"{r['cgroup_peak'] / GB:.2f}", f"{r['peak_rss'] / GB:.2f}",
            f"{r['read_bytes'] / GB:.1f} / {r['write_bytes'] / GB:.1f}",
            f"{disk_s / 3:.0f}" if moved else "—",
            " → ".join(f"{x:.3f}" for x in r["losses"]) if r["losses"] else "—",
        ])
    ratio = largest.get("ztrain", 0) / largest["fsdp2"] if largest.get("fsdp2") else 0
    by_name = {r["name"]: r for r in runs}
    pairs = [(n, "ztrain-" + n.split("-", 2)[2]) for n in by_name if n.startswith("ztrain-memory-")]
    same = [by_name[m]["losses"] == by_name[d]["losses"] and by_name[m]["losses"] for m, d in pairs if d in by_name]
    out = [
        f"Measured on {machine()}, {len(runs)} runs; each run one process tree in a memory cgroup limited to "
        f"{limit / 2**30:.1f} GiB (page cache included, no swap): a run that does not fit is killed by the kernel. "
        "GPT of width 2048 (16 heads, byte vocabulary, context 64), one sequence of 64 tokens per step, fp32, "
        "AdamW, 1 rank, 2 threads; sizes grow by layers. FSDP2: `bench/peer_torch.py --system fsdp2` (its model "
        "state in memory). ztrain: `ztrain-gpt train --zero-level 3 --recompute --offload --offload-dir DIR "
        "--offload-param-dir DIR` (parameter and gradient shards and the optimizer state in files in DIR).",
        "",
        f"Disk, through a shared mapping of an unlinked preallocated file in the offload directory (4 GiB, "
        f"written and synced, then read back cold): **write {write_bw / 1e6:.0f} MB/s, read {read_bw / 1e6:.0f} "
        "MB/s**.",
        "",
        table(["system", "parameters (M)", "result", "step (s)", "cgroup peak (GB)", "peak RSS (GB)",
               "disk read / written (GB, whole run)", "its disk time per step at the probe's rates (s)", "losses"],
              body),
        "",
        f"Largest trained: FSDP2 {largest.get('fsdp2', 0):,.0f} M, ztrain {largest.get('ztrain', 0):,.0f} M "
        f"parameters: **{ratio:.2f}×** (goal ≥ {GOAL_RATIO:.0f}×: {verdict(ratio >= GOAL_RATIO)}). The cgroup peak "
        "counts the page cache the kernel lends the mapped files; what a run cannot give back is its resident "
        "anonymous memory, which for ztrain is the gathered block, activations and buffers. The bytes moved "
        "are the block device's over the whole run (initialisation and the final model file included); the "
        "losses of 3 steps at a warmup's learning rates only show that each step ran.",
        "",
        "Losses on disk equal those in memory (the same model and steps): "
        + (("**yes**" if all(same) else "**no**") if same else "not measured") + ".",
    ]
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", required=True)
    p.add_argument("--doc", help="the page whose marked section is replaced")
    a = p.parse_args()
    rows = [json.loads(line) for line in open(a.results) if line.strip()]
    text = render(rows)
    replace_section(a.doc, BEGIN, END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
