"""ztrain.nn's fused CPU kernels against torch: dropout (a Bernoulli mask at rate p, kept elements
scaled as torch scales them, backward through the same mask, torch's generator as the source),
the tanh GELU and cross-entropy (values and gradients to a few ulps), attention against torch's in
double, in each code of the kernels, and with dropout against ztrain.nn.dropout of the
probabilities, and torch's own functions where no kernel takes the input."""
import math
import unittest

import torch
import torch.nn.functional as F

import ztrain


class Dropout(unittest.TestCase):
    def test_rate_and_kept_values(self):
        n = 1 << 20
        for p in (0.1, 0.5):
            for dtype in (torch.float32, torch.bfloat16):
                with self.subTest(p=p, dtype=dtype):
                    torch.manual_seed(1)
                    x = torch.randn(n).to(dtype)
                    y = ztrain.nn.dropout(x, p)
                    kept = y != 0
                    self.assertLess(abs((1 - kept.double().mean().item()) - p), 5 * math.sqrt(p * (1 - p) / n))
                    want = (x.float() * (1 / (1 - p))).to(dtype)  # torch's product: x times the float scale
                    self.assertTrue(torch.equal(y[kept], want[kept]))

    def test_backward_uses_the_forwards_mask(self):
        x = torch.randn(4096, requires_grad=True)
        torch.manual_seed(2)
        y = ztrain.nn.dropout(x, 0.3)
        dy = torch.randn(4096)
        y.backward(dy)
        self.assertTrue(torch.equal(x.grad, torch.where(y != 0, dy * (1 / 0.7), torch.zeros(()))))

    def test_torch_manual_seed_decides_the_mask(self):
        x = torch.randn(1000)
        torch.manual_seed(3)
        a, b = ztrain.nn.dropout(x, 0.5), ztrain.nn.dropout(x, 0.5)
        self.assertFalse(torch.equal(a, b))
        torch.manual_seed(3)
        self.assertTrue(torch.equal(ztrain.nn.dropout(x, 0.5), a))

    def test_module_follows_train_and_eval(self):
        layer = ztrain.nn.Dropout(0.5)
        x = torch.randn(64, 32)
        self.assertFalse(torch.equal(layer(x), x))
        layer.eval()
        self.assertIs(layer(x), x)
        self.assertEqual(repr(layer), "Dropout(p=0.5, inplace=False)")

    def test_other_dtypes_are_torchs_and_bad_p_is_named(self):
        x = torch.randn(1000, dtype=torch.float64)
        torch.manual_seed(4)
        a = ztrain.nn.dropout(x, 0.5)
        torch.manual_seed(4)
        self.assertTrue(torch.equal(a, F.dropout(x, 0.5)))
        with self.assertRaisesRegex(ztrain.Error, r"probability must be in \[0, 1\], got 1.5"):
            ztrain.nn.dropout(x.float(), 1.5)


class GeluAndCrossEntropy(unittest.TestCase):
    def test_gelu_tanh(self):
        x = (torch.randn(10007) * 4).requires_grad_()
        y = ztrain.nn.gelu_tanh(x)
        y.backward(torch.ones_like(y))
        xd = x.detach().double().requires_grad_()
        F.gelu(xd, approximate="tanh").sum().backward()
        self.assertLess((y.double() - F.gelu(xd.detach(), approximate="tanh")).abs().max().item(), 1e-6)
        self.assertLess((x.grad.double() - xd.grad).abs().max().item(), 1e-5)

    def test_cross_entropy(self):
        logits = (torch.randn(37, 501) * 5).requires_grad_()
        target = torch.randint(501, (37,))
        target[3] = -100
        loss = ztrain.nn.cross_entropy(logits, target)
        loss.backward()
        ld = logits.detach().double().requires_grad_()
        want = F.cross_entropy(ld, target)
        want.backward()
        self.assertAlmostEqual(loss.item(), want.item(), places=5)
        self.assertLess((logits.grad.double() - ld.grad).abs().max().item(), 1e-6)
        self.assertTrue(torch.equal(logits.grad[3], torch.zeros(501)))
        with self.assertRaisesRegex(ztrain.Error, "logits of \\(rows, classes\\)"):
            ztrain.nn.cross_entropy(logits, target[:5])


class Attention(unittest.TestCase):
    def test_against_torch_in_double(self):
        # (causal, scale, key heads: 3, or 1 shared by the 3 query heads)
        for causal, scale, kv_heads in ((True, None, 3), (False, None, 3), (True, 0.2, 1), (False, 1.5, 1)):
            with self.subTest(causal=causal, scale=scale, kv_heads=kv_heads):
                q = torch.randn(2, 3, 70, 16, requires_grad=True)
                k, v = (torch.randn(2, kv_heads, 70, 16, requires_grad=True) for _ in range(2))
                dy = torch.randn(2, 3, 70, 16)
                gqa = kv_heads != 3
                y = ztrain.nn.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
                grads = torch.autograd.grad(y, (q, k, v), dy)
                exact_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
                exact = F.scaled_dot_product_attention(*exact_in, is_causal=causal, scale=scale, enable_gqa=gqa)
                exact_grads = torch.autograd.grad(exact, exact_in, dy.double())
                for got, want in zip((y, *grads), (exact, *exact_grads)):
                    self.assertLess((got.double() - want).abs().max().item(), 2e-5)

    def test_dropout_is_ztrain_dropout_of_the_probabilities(self):
        q, k, v = (torch.randn(1, 2, 45, 8) for _ in range(3))
        torch.manual_seed(4)
        y = ztrain.nn.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(torch.ones(45, 45).triu(1).bool(), -math.inf)
        torch.manual_seed(4)
        want = ztrain.nn.dropout(scores.softmax(-1), 0.2) @ v
        self.assertLess((y - want).abs().max().item(), 1e-5)
        with self.assertRaisesRegex(ztrain.Error, "do not match"):
            ztrain.nn.scaled_dot_product_attention(q, k[..., :4], v)

    def test_each_code_of_the_kernels_and_a_wrong_name(self):
        # the benchmarks' switch: every code this CPU runs gives the attention within rounding
        q, k, v = (torch.randn(2, 3, 70, 16) for _ in range(3))
        widest = ztrain._C._fused_simd()
        codes = ["scalar", "avx2", "avx512", "avx512_bf16", "amx"]
        results = []
        try:
            for code in codes[:codes.index(widest) + 1]:
                ztrain._C._set_fused_simd(code)
                self.assertEqual(ztrain._C._fused_simd(), code)
                results.append(ztrain.nn.scaled_dot_product_attention(q, k, v, is_causal=True))
            with self.assertRaisesRegex(ztrain.Error, "scalar, avx2, avx512, avx512_bf16 or amx, got 'sse'"):
                ztrain._C._set_fused_simd("sse")
        finally:
            ztrain._C._set_fused_simd(widest)
        for y in results[1:]:
            self.assertLess((y - results[0]).abs().max().item(), 1e-5)

    def test_torchs_function_with_a_mask_or_other_ranks(self):
        q, k, v = (torch.randn(2, 3, 70, 16) for _ in range(3))
        mask = torch.rand(70, 70) > 0.3
        self.assertTrue(torch.equal(ztrain.nn.scaled_dot_product_attention(q, k, v, mask),
                                    F.scaled_dot_product_attention(q, k, v, mask)))
        self.assertTrue(torch.equal(ztrain.nn.scaled_dot_product_attention(q[0], k[0], v[0], is_causal=True),
                                    F.scaled_dot_product_attention(q[0], k[0], v[0], is_causal=True)))


def init_distributed():
    """The runtime this file's tests run in (conftest.py calls it under pytest)."""
    ztrain.init_distributed(seed=0)


if __name__ == "__main__":
    init_distributed()
    unittest.main()
