"""ztrain.nn's fused CPU kernels against the torch functions they replace, side by side in one
process: nanoseconds an element (attention: milliseconds a call), forward alone and forward with
backward, the median of --repeats timings of --calls calls each. Every case runs in each code of
the fused kernels that --simd names, in turn (scalar, avx2, avx512, avx512_bf16, amx; the widest
this CPU has by default).

    OMP_NUM_THREADS=1 PYTHONPATH=build/python .venv/bin/python bench/fused_bench.py
"""
import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

import ztrain
from ztrain import _C


def per_element(fn, n, calls, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times) / n * 1e9


def with_backward(op, x, grad):
    leaf = x.detach().requires_grad_()

    def run():
        leaf.grad = None
        op(leaf).backward(grad)
    return run


def attention(args, batch, heads, kv_heads):
    """Causal self-attention over heads of 64: ztrain.nn against F.scaled_dot_product_attention and
    against the materialised form (scores, softmax, dropout, product) with ztrain's dropout. With
    as many key heads as query heads (GPT-2's), q, k and v are views of one tensor, as a GPT's one
    linear makes them; with fewer, each key and value head serves its group of query heads
    (enable_gqa; the materialised form repeats them)."""
    group = heads // kv_heads
    dtype = getattr(torch, args.attention_dtype)
    layout = f"{batch}x{heads}" + (f" on {kv_heads}" if group > 1 else "") + \
        ("" if dtype == torch.float32 else f" {args.attention_dtype}")
    print(f"{f'causal attention {layout}, ms a call':38} {'ztrain':>8} {'torch':>8} {'ratio':>6} | {'fwd+bwd':>8} "
          f"{'torch':>8} {'ratio':>6} | {'materialised':>12}")
    for t, p, simd in ((t, p, simd) for t in args.tokens for p in (0.0, args.p) for simd in args.simd):
        _C._set_fused_simd(simd)
        if group == 1:
            qkv = torch.randn(batch, t, 3, heads, 64, dtype=dtype, requires_grad=True)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            inputs = (qkv,)
        else:
            q = torch.randn(batch, heads, t, 64, dtype=dtype, requires_grad=True)
            k, v = (torch.randn(batch, kv_heads, t, 64, dtype=dtype, requires_grad=True) for _ in range(2))
            inputs = (q, k, v)
        mask = torch.full((t, t), -math.inf, dtype=dtype).triu(1)

        def ours():
            return ztrain.nn.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                          enable_gqa=group > 1)

        def theirs():
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=group > 1)

        def materialised():
            scores = (q @ k.repeat_interleave(group, 1).transpose(-2, -1)) / 8 + mask
            return ztrain.nn.dropout(scores.softmax(-1), p) @ v.repeat_interleave(group, 1)

        grad = torch.randn(batch, heads, t, 64, dtype=dtype)

        def both(op):
            return lambda: torch.autograd.grad(op(), inputs, grad)
        fwd = [per_element(op, 1e6, args.calls, args.repeats) for op in (ours, theirs)]
        fb = [per_element(both(op), 1e6, args.calls, args.repeats) for op in (ours, theirs, materialised)]
        print(f"{f'{t} tokens, dropout {p}, {simd}':38} {fwd[0]:8.1f} {fwd[1]:8.1f} {fwd[1] / fwd[0]:6.2f} | "
              f"{fb[0]:8.1f} {fb[1]:8.1f} {fb[1] / fb[0]:6.2f} | {fb[2]:12.1f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--p", type=float, default=0.1, help="dropout probability")
    parser.add_argument("--simd", nargs="*", default=[_C._fused_simd()],
                        help="the fused kernels' codes each case runs in, in turn: scalar, avx2, avx512, "
                             "avx512_bf16, amx (default: the widest this CPU has)")
    parser.add_argument("--tokens", type=int, nargs="*", default=[256, 1024],
                        help="sequence lengths of the causal attention cases")
    parser.add_argument("--attention-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="the attention cases' dtype (16-bit: ztrain's runs its kernel on the widening "
                             "where its first call timed that faster, models::detail::attention_widened)")
    args = parser.parse_args()
    torch.manual_seed(0)
    vocab = 50257
    cases = [  # name, input, ztrain's op, torch's op
        ("dropout 2^20", torch.randn(1 << 20),
         lambda x: ztrain.nn.dropout(x, args.p), lambda x: F.dropout(x, args.p)),
        ("dropout, attention map 2x12x256x256", torch.randn(2, 12, 256, 256),
         lambda x: ztrain.nn.dropout(x, args.p), lambda x: F.dropout(x, args.p)),
        ("dropout bf16 2^20", torch.randn(1 << 20).bfloat16(),
         lambda x: ztrain.nn.dropout(x, args.p), lambda x: F.dropout(x, args.p)),
        ("gelu_tanh 512x3072", torch.randn(512, 3072),
         ztrain.nn.gelu_tanh, lambda x: F.gelu(x, approximate="tanh")),
    ]
    targets = torch.randint(vocab, (512,))
    cases.append(("cross_entropy 512x50257", torch.randn(512, vocab),
                  lambda x: ztrain.nn.cross_entropy(x, targets), lambda x: F.cross_entropy(x, targets)))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); ns an element, "
          f"median of {args.repeats} x {args.calls} calls")
    print(f"{'kernel':38} {'ztrain':>8} {'torch':>8} {'ratio':>6} | {'fwd+bwd':>8} {'torch':>8} {'ratio':>6}")
    for (name, x, ours, theirs), simd in ((case, simd) for case in cases for simd in args.simd):
        _C._set_fused_simd(simd)
        n = x.numel()
        grad = torch.ones(()) if name.startswith("cross_entropy") else torch.randn_like(x)
        fwd = [per_element(lambda op=op: op(x), n, args.calls, args.repeats) for op in (ours, theirs)]
        both = [per_element(with_backward(op, x, grad), n, args.calls, args.repeats) for op in (ours, theirs)]
        print(f"{f'{name}, {simd}':38} {fwd[0]:8.2f} {fwd[1]:8.2f} {fwd[1] / fwd[0]:6.1f} | "
              f"{both[0]:8.2f} {both[1]:8.2f} {both[1] / both[0]:6.1f}")
    attention(args, 2, 12, 12)  # GPT-2's
    attention(args, 1, 16, 4)  # grouped-query, Llama-style
    mul = torch.randn(1 << 20)
    print(f"{'(a multiply of 2^20 floats)':38} {per_element(lambda: mul * 2, mul.numel(), args.calls, args.repeats):8.2f}")


if __name__ == "__main__":
    main()
