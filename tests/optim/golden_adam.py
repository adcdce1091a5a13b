#!/usr/bin/env python3
"""Golden trajectories of torch.optim.AdamW and torch.optim.Adam for adam_test.cpp.

    .venv/bin/python tests/optim/golden_adam.py > /tmp/golden.inc

prints C++ arrays to paste into adam_test.cpp (between the "golden values" markers).

Each configuration runs 100 steps on one float32 parameter of n elements, n in SIZES, on CPU
with PyTorch's default (single-tensor, foreach=False) implementation. The inputs are closed
forms of the element index i and the step t that C++ reproduces exactly, without sharing an RNG:
integer hashing, then IEEE float64 division and subtraction (correctly rounded in every
language and SIMD width, unlike sin/cos), then one rounding to float32:

    h(i, t)  = (i * 2654435761 + t * 2246822519) mod 1048573
    u(i, t)  = h(i, t) / 1048573                                   (float64)
    p0[i]    = float32(2 u(i, 0) - 1)
    g_t[i]   = float32((2 u(i, t) - 1) / 10^(i mod 4))              t = 1..100
    lr_t     = 1 / (100 + t)                                        set before step t

Recorded per configuration and size:
  k<Config>AbsSum<n>[t-1] = sum_i |p_i| after step t, accumulated in float64   (t = 1..100)
  k<Config>Final<n>       = {i, p_i, exp_avg_i, exp_avg_sq_i} after step 100 at sample indices
                            (every index for n <= 17).
Values are printed with repr() of the float64 value of the float32, which C++ reads back exactly.
"""
import torch

SIZES = [0, 1, 15, 17, 1023, 1000000]
STEPS = 100
CONFIGS = {
    # name: (optimizer class, keyword arguments)
    "AdamW": (torch.optim.AdamW, dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)),
    "Adam": (torch.optim.Adam, dict(betas=(0.85, 0.995), eps=1e-6, weight_decay=0.05)),
}
MOD = 1048573


def inputs(n, t):
    i = torch.arange(n, dtype=torch.int64)
    h = torch.remainder(i * 2654435761 + t * 2246822519, MOD)
    x = 2 * (h.to(torch.float64) / MOD) - 1
    if t == 0:
        return x.to(torch.float32)
    scale = torch.tensor([1.0, 10.0, 100.0, 1000.0], dtype=torch.float64)[i % 4]
    return (x / scale).to(torch.float32)


def lr_at(t):
    return 1.0 / (100 + t)


def samples(n):
    if n <= 17:
        return list(range(n))
    picked = set(range(4)) | set(range(n - 4, n)) | set(range(0, n, max(1, n // 12)))
    return sorted(picked)


def run(cls, kwargs, n):
    p = inputs(n, 0).clone().requires_grad_(True)
    opt = cls([p], lr=lr_at(1), **kwargs)
    abs_sums = []
    for t in range(1, STEPS + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(t)
        p.grad = inputs(n, t)
        opt.step()
        abs_sums.append(p.detach().to(torch.float64).abs().sum().item())
    state = opt.state[p]
    return abs_sums, p.detach(), state["exp_avg"], state["exp_avg_sq"]


def emit_doubles(name, values):
    print(f"constexpr double {name}[] = {{")
    for k in range(0, len(values), 4):
        print("    " + ", ".join(repr(v) for v in values[k:k + 4]) + ",")
    print("};")


def main():
    torch.set_num_threads(1)
    print(f"// golden_adam.py, torch {torch.__version__}, {STEPS} steps, lr_t = 1/(100+t)")
    for name, (cls, kwargs) in CONFIGS.items():
        print(f"// {name}: {kwargs}")
        for n in SIZES:
            if n == 0:
                continue  # nothing to record: the C++ test checks that an empty parameter steps
            abs_sums, p, m, v = run(cls, kwargs, n)
            emit_doubles(f"k{name}AbsSum{n}", abs_sums)
            print(f"constexpr GoldenSample k{name}Final{n}[] = {{")
            for i in samples(n):
                print(f"    {{{i}, {p[i].item()!r}, {m[i].item()!r}, {v[i].item()!r}}},")
            print("};")


if __name__ == "__main__":
    main()
