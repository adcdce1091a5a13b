"""ztrain.optim.OptimManager over Blocks: loss scaling, the global gradient norm counted once per
element across shards and ranks, and overflow steps skipped on every rank."""
import unittest

import torch

import ztrain

WIDTH, BATCH = 8, 8


def mlp_layers(seed):
    torch.manual_seed(seed)
    return [torch.nn.Sequential(torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Tanh(), torch.nn.Linear(2 * WIDTH, WIDTH))
            for _ in range(3)]


def batch(step):
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(step))


def local(x):
    n, r = ztrain.world_size(), ztrain.rank()
    return x[r * BATCH // n:(r + 1) * BATCH // n]


def forward(stack, x):
    for layer in stack:
        x = layer(x)
    return x.pow(2).mean()


class Manager(unittest.TestCase):
    def run_steps(self, level, loss_scale, steps=3, max_norm=None):
        blocks = ztrain.BlockList(mlp_layers(0), zero_level=level, use_checkpoint=False)
        opt = ztrain.optim.AdamW(blocks.parameters(), lr=1e-2)
        manager = ztrain.optim.OptimManager(blocks, loss_scale=loss_scale)
        manager.add_optimizer(opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
        norms = []
        for step in range(steps):
            manager.zero_grad()
            manager.backward(forward(blocks, local(batch(step))))
            norms.append(manager.clip_grad_norm(max_norm) if max_norm else manager.grad_norm())
            self.assertTrue(manager.step())
        return blocks, opt, manager, norms

    def test_the_global_norm_and_clipping_equal_one_process(self):
        ref = mlp_layers(0)
        params = [p for layer in ref for p in layer.parameters()]
        ref_opt = torch.optim.AdamW(params, lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
        want = []
        for step in range(3):
            ref_opt.zero_grad()
            forward(ref, batch(step)).backward()
            want.append(torch.nn.utils.clip_grad_norm_(params, 0.05).item())
            ref_opt.step()
            sched.step()
        for level in (0, 3):
            with self.subTest(level=level):
                blocks, opt, manager, norms = self.run_steps(level, None, max_norm=0.05)
                for got, expected in zip(norms, want):
                    self.assertAlmostEqual(got, expected, delta=1e-5 * expected)
                self.assertAlmostEqual(opt.param_groups[0]["lr"], 1e-2 / 8)  # the schedule stepped 3 times
                for block, layer in zip(blocks, ref):
                    full = block.gathered_parameters()
                    for name, p in layer.named_parameters():
                        torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)

    def test_a_power_of_two_loss_scale_changes_nothing(self):
        plain = self.run_steps(3, None)
        scaled = self.run_steps(3, 1024.0)
        self.assertEqual(plain[3], scaled[3])  # the norms, unscaled
        self.assertEqual(scaled[2].loss_scale, 1024.0)
        for a, b in zip(plain[0], scaled[0]):
            for (name, x), (_, y) in zip(a.gathered_parameters().items(), b.gathered_parameters().items()):
                self.assertTrue(torch.equal(x, y), name)

    def test_an_overflow_on_one_rank_skips_the_step_everywhere(self):
        blocks = ztrain.BlockList(mlp_layers(0), zero_level=2, use_checkpoint=False)
        opt = ztrain.optim.AdamW(blocks.parameters(), lr=1e-2)
        manager = ztrain.optim.OptimManager(blocks, loss_scale=256.0)
        manager.add_optimizer(opt)
        before = [dict(b.gathered_parameters()) for b in blocks]
        manager.zero_grad()
        loss = forward(blocks, local(batch(0)))
        if ztrain.rank() == 0:
            loss = loss * float("inf")
        manager.backward(loss)
        self.assertFalse(manager.step())
        self.assertEqual((manager.steps, manager.skipped_steps, manager.loss_scale), (0, 1, 128.0))
        for block, old in zip(blocks, before):
            for name, value in block.gathered_parameters().items():
                self.assertTrue(torch.equal(value, old[name]), name)
        manager.zero_grad()
        manager.backward(forward(blocks, local(batch(1))))
        self.assertTrue(manager.step())

    def test_only_ztrain_optimizers(self):
        blocks = ztrain.BlockList(mlp_layers(0), zero_level=1)
        manager = ztrain.optim.OptimManager(blocks)
        with self.assertRaisesRegex(ztrain.Error, "steps ztrain.optim optimizers .*got SGD"):
            manager.add_optimizer(torch.optim.SGD(blocks.parameters(), lr=0.1))


def init_distributed():
    """The runtime this file's tests run in (conftest.py calls it under pytest)."""
    ztrain.init_distributed(seed=0)


if __name__ == "__main__":
    init_distributed()
    unittest.main()
