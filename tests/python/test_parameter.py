"""ztrain.DistributedParameter against single-process PyTorch, at every world size it is launched
with: a tied embedding and head (gathered once, its gradient reduced once) at levels 2 and 3,
the names save, load and init_parameters give it, and a Block taking it whole."""
import os
import tempfile
import unittest

import torch
import torch.nn.functional as F

import ztrain

VOCAB, DIM, BATCH, STEPS = 24, 8, 8, 3


class Tied(torch.nn.Module):
    def __init__(self, weight, level):
        super().__init__()
        self.wte = ztrain.DistributedParameter(weight, zero_level=level)
        self.norm = torch.nn.Module()
        self.norm.weight = ztrain.DistributedParameter(torch.ones(DIM), zero_level=level)

    def forward(self, ids):
        w = self.wte.gather()
        self.gathers = sum(1 for _ in range(2) if self.wte.gather() is w)  # the same tensor within a forward
        h = F.embedding(ids, w) * self.norm.weight.gather()
        return F.linear(h, self.wte.gather())


def plain_forward(w, g, ids):
    return F.linear(F.embedding(ids, w) * g, w)


def batches():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (BATCH, 5), generator=gen) for _ in range(STEPS)]


def local(x):
    n = x.shape[0] // ztrain.world_size()
    return x[ztrain.rank() * n:(ztrain.rank() + 1) * n]


class DistributedParameterTest(unittest.TestCase):
    def test_a_tied_weight_equals_plain_pytorch(self):
        for level in (2, 3):
            torch.manual_seed(1)
            w0 = torch.randn(VOCAB, DIM)
            model = Tied(w0, level)
            self.assertEqual(model.wte.full_shape, (VOCAB, DIM))
            self.assertEqual(model.wte.dim(), 1)  # this rank's flat shard
            self.assertGreaterEqual(model.wte.numel() * ztrain.world_size(), VOCAB * DIM)
            w, g = w0.clone().requires_grad_(), torch.ones(DIM, requires_grad=True)
            opt = ztrain.optim.AdamW(model.parameters(), lr=0.05)
            ref = torch.optim.AdamW([w, g], lr=0.05)
            for ids in batches():
                opt.zero_grad()
                ref.zero_grad()
                loss = model(local(ids)).logsumexp(-1).mean()
                self.assertEqual(model.gathers, 2)
                loss.backward()
                ref_loss = plain_forward(w, g, ids).logsumexp(-1).mean()
                ref_loss.backward()
                self.assertAlmostEqual(ztrain.sum_loss(loss).item(), ref_loss.item(), delta=1e-5)
                opt.step()
                ref.step()
            state = ztrain.state_dict(model)
            self.assertEqual(sorted(state), ["norm.weight", "wte"])
            torch.testing.assert_close(state["wte"], w.detach(), atol=1e-6, rtol=1e-5, msg=f"level {level}")
            torch.testing.assert_close(state["norm.weight"], g.detach(), atol=1e-6, rtol=1e-5, msg=f"level {level}")

    def test_names_in_files_and_initialisation(self):
        model = Tied(torch.zeros(VOCAB, DIM), 2)
        ztrain.init_parameters(model, seed=5)
        plain = torch.nn.Module()
        plain.wte = torch.nn.Parameter(torch.zeros(VOCAB, DIM))
        plain.norm = torch.nn.Module()
        plain.norm.weight = torch.nn.Parameter(torch.zeros(DIM))
        ztrain.init_parameters(plain, seed=5)
        state = ztrain.state_dict(model)
        torch.testing.assert_close(state["wte"], plain.wte.detach(), atol=0, rtol=0)
        torch.testing.assert_close(state["norm.weight"], plain.norm.weight.detach(), atol=0, rtol=0)
        # The ranks are children of one launcher: its pid names a file they share.
        path = os.path.join(tempfile.gettempdir(), f"ztrain_py_tied_{os.getppid()}.safetensors")
        ztrain.save(model, path)
        other = Tied(torch.zeros(VOCAB, DIM), 3)
        ztrain.load(other, path)
        torch.testing.assert_close(ztrain.state_dict(other)["wte"], state["wte"], atol=0, rtol=0)
        ztrain.synchronize()
        if ztrain.rank() == 0:
            os.remove(path)
        ztrain.load_state_dict(other, {"wte": torch.ones(VOCAB, DIM), "norm.weight": torch.ones(DIM)})
        self.assertTrue(torch.equal(ztrain.state_dict(other)["wte"], torch.ones(VOCAB, DIM)))
        with self.assertRaisesRegex(ztrain.Error, r"'wte' is \(2, 2\) in the dict, \(24, 8\) in the model"):
            ztrain.load_state_dict(other, {"wte": torch.ones(2, 2), "norm.weight": torch.ones(DIM)})
        with self.assertRaisesRegex(ztrain.Error, r"\['norm.weight'\] are not in the dict"):
            ztrain.load_state_dict(other, {"wte": torch.ones(VOCAB, DIM)})

    def test_a_block_takes_it_whole(self):
        inner = torch.nn.Module()
        inner.weight = ztrain.DistributedParameter(torch.arange(12.0).view(3, 4))
        inner.forward = lambda x: x @ inner.weight
        block = ztrain.Block(inner, zero_level=3)
        self.assertEqual(type(inner.weight), torch.nn.Parameter)
        self.assertEqual(ztrain.state_dict(block)["weight"].tolist(), torch.arange(12.0).view(3, 4).tolist())


def init_distributed():
    """The runtime this file's tests run in (conftest.py calls it under pytest)."""
    ztrain.init_distributed(seed=0)


if __name__ == "__main__":
    init_distributed()
    unittest.main()
