#!/usr/bin/env python3
"""Reads a run's TensorBoard event files with TensorBoard's own reader and checks every scalar
against the run's metrics.jsonl (tensorboard_test.sh).

    tensorboard_check.py TB_DIR METRICS_JSONL
"""
import json
import sys

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TAGS = {"loss": "loss", "lr": "lr", "tokens_per_s": "tokens_per_s", "mem_bytes": "mem_bytes",
        "grad_norm": "grad_norm", "loss_scale": "loss_scale", "val_loss": "val_loss",
        "val_loss_per_byte": "val_loss_per_byte"}


def main(tb_dir, metrics_path):
    records = [json.loads(line) for line in open(metrics_path)]
    events = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    events.Reload()
    found = sorted(events.Tags()["scalars"])
    assert found == sorted(TAGS), f"scalars {found}, expected {sorted(TAGS)}"
    for tag, key in TAGS.items():
        want = [(r["step"], r[key]) for r in records if key in r]
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in want], f"{tag}: steps {[s for s, _ in got]}, want {[s for s, _ in want]}"
        for (step, g), (_, w) in zip(got, want):
            assert g == float(np.float32(w)), f"{tag} at step {step}: {g}, metrics.jsonl {w}"
        print(f"{tag}: {len(got)} points equal metrics.jsonl")


if __name__ == "__main__":
    main(*sys.argv[1:])
