"""Importing ztrain routes torch's bf16 and fp16 matmuls and CPU flash attention through fp32 kernels
with one rounding (src/cpu_matmul16.cpp), for plain torch code too. The test runs with
ZTRAIN_CPU_MATMUL16=fp32, so it holds on any CPU; `auto` chooses it where the CPU lacks the units
for the type."""
import os
import unittest

import torch

import ztrain


def randn(*shape, gen, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=gen).to(dtype)


class Matmul16ThroughFp32(unittest.TestCase):
    def setUp(self):
        self.assertEqual(os.environ.get("ZTRAIN_CPU_MATMUL16"), "fp32")
        self.gen = torch.Generator().manual_seed(0)

    def test_matmuls_are_the_fp32_kernels_rounded_once(self):
        for dtype in (torch.bfloat16, torch.float16):
            with self.subTest(dtype=dtype):
                a, b, c = (randn(*s, gen=self.gen, dtype=dtype) for s in ((256, 384), (384, 128), (128,)))
                self.assertTrue(torch.equal(a @ b, (a.float() @ b.float()).to(dtype)))
                self.assertTrue(torch.equal(torch.addmm(c, a, b),
                                            torch.addmm(c.float(), a.float(), b.float()).to(dtype)))
                x, y = randn(3, 40, 512, gen=self.gen, dtype=dtype), randn(3, 512, 24, gen=self.gen, dtype=dtype)
                self.assertTrue(torch.equal(torch.bmm(x, y), torch.bmm(x.float(), y.float()).to(dtype)))

    def test_attention_forward_and_backward(self):
        q, k, v = (randn(2, 3, 64, 32, gen=self.gen) for _ in range(3))
        grad = randn(2, 3, 64, 32, gen=self.gen)

        def run(dtype):
            leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
            out.backward(grad.to(dtype))
            return [out.detach()] + [t.grad for t in leaves]

        got, want = run(torch.bfloat16), run(torch.float32)
        # The output is the fp32 kernel's on the same bf16 values, rounded once.
        self.assertTrue(torch.equal(got[0], want[0].bfloat16()))
        # The gradients too, except that backward reads the rounded output.
        for g, w in zip(got[1:], want[1:]):
            self.assertEqual(g.dtype, torch.bfloat16)
            self.assertLess(((g.float() - w).abs().max() / w.abs().max()).item(), 1e-2)

    def test_a_torch_models_gradients_match_float64(self):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(96, 192), torch.nn.GELU(), torch.nn.Linear(192, 8))
        ref = [p.detach().double() for p in model.parameters()]
        model = model.bfloat16()
        x, target = randn(32, 96, gen=self.gen), randn(32, 8, gen=self.gen)
        model(x).float().sub(target.float()).pow(2).mean().backward()
        params = [p.double().requires_grad_() for p in ref]
        h = torch.nn.functional.gelu(x.double() @ params[0].t() + params[1])
        (h @ params[2].t() + params[3]).sub(target.double()).pow(2).mean().backward()
        for p, r in zip(model.parameters(), params):
            err = ((p.grad.double() - r.grad).abs().max() / r.grad.abs().max()).item()
            self.assertLess(err, 2e-2)


def init_distributed():
    """The runtime this file's tests run in (conftest.py calls it under pytest)."""
    ztrain.init_distributed(seed=0)


if __name__ == "__main__":
    init_distributed()
    unittest.main()
