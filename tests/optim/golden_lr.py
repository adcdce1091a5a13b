#!/usr/bin/env python3
"""Golden learning rates from torch.optim.lr_scheduler for lr_scheduler_test.cpp.

    .venv/bin/python tests/optim/golden_lr.py

prints C++ arrays to paste into lr_scheduler_test.cpp (kGolden*). Entry i is the lr in effect
for step i, i.e. after i calls of scheduler.step(); the ztrain equivalent is lr_at(i).

  ztrain Linear   <-> LinearLR(1 -> min/peak over T) [after LinearLR warmup start/peak -> 1 over W]
  ztrain Cosine   <-> CosineAnnealingLR(T_max = T - W, eta_min = min) [after the same warmup]
  ztrain Exponential <-> ExponentialLR(gamma) [after the same warmup]

Warmup from a non-zero start: LinearLR cannot start from factor 0 (its recursive form would stay
at 0), so the warmup cases use warmup_start_lr = 1e-4. PyTorch's schedulers are chainable
(each lr is computed from the previous one), so they agree with ztrain's closed forms to rounding
only; the test compares with a relative tolerance.
"""
import warnings

import torch
from torch.optim.lr_scheduler import (CosineAnnealingLR, ExponentialLR, LinearLR, SequentialLR)

PEAK = 1e-3
MIN = 1e-4
START = 1e-4
WARMUP = 5
TOTAL = 20
GAMMA = 0.9


def run(make_decay, warmup, steps):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=PEAK)
    decay = make_decay(opt)
    if warmup:
        warm = LinearLR(opt, start_factor=START / PEAK, end_factor=1.0, total_iters=warmup)
        sched = SequentialLR(opt, [warm, decay], milestones=[warmup])
    else:
        sched = decay
    out = []
    for _ in range(steps + 1):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def emit(name, values):
    print(f"// {name}: steps 0..{len(values) - 1}")
    print(f"constexpr double {name}[] = {{")
    for i in range(0, len(values), 3):
        print("    " + ", ".join(repr(v) for v in values[i:i + 3]) + ",")
    print("};")


def main():
    # SequentialLR steps the next scheduler with an explicit epoch at a milestone (closed form).
    warnings.filterwarnings("ignore", message="The epoch parameter")
    print(f"// golden_lr.py, torch {torch.__version__}: peak_lr {PEAK}, min_lr {MIN}, "
          f"warmup_start_lr {START}, warmup_steps {WARMUP}, total_steps {TOTAL}, gamma {GAMMA}")
    for warmup, suffix in ((0, "NoWarmup"), (WARMUP, "Warmup")):
        emit(f"kGoldenLinear{suffix}",
             run(lambda o: LinearLR(o, start_factor=1.0, end_factor=MIN / PEAK,
                                    total_iters=TOTAL - warmup), warmup, TOTAL))
        emit(f"kGoldenCosine{suffix}",
             run(lambda o: CosineAnnealingLR(o, T_max=TOTAL - warmup, eta_min=MIN), warmup, TOTAL))
        emit(f"kGoldenExponential{suffix}",
             run(lambda o: ExponentialLR(o, gamma=GAMMA), warmup, TOTAL))


if __name__ == "__main__":
    main()
