"""ztrain.optim against torch.optim: the same updates, schedules, groups and state dicts."""
import io
import unittest

import torch

import ztrain


def mlp(seed, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(dtype)


def twin(model):
    other = mlp(0, next(model.parameters()).dtype)
    other.load_state_dict(model.state_dict())
    return other


def train(model, opt, steps, seed=1, scheduler=None):
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen).to(dtype)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()
        if scheduler:
            scheduler.step()


def max_rel(a, b):
    return max(((p - q).abs().max() / q.abs().max()).item() for p, q in zip(a.parameters(), b.parameters()))


class NativeAdamAgainstTorch(unittest.TestCase):
    def test_adamw_follows_torch(self):
        ours, ref = mlp(0), mlp(0)
        train(ours, ztrain.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1), 50)
        train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1), 50)
        # The native kernel rounds as libtorch's CPU kernels (docs: within 1.3e-6 after 100 steps).
        self.assertLess(max_rel(ours, ref), 1e-5)
        self.assertGreater(max_rel(ours, mlp(0)), 1e-2)  # and it did train

    def test_adam_adds_weight_decay_to_the_gradient(self):
        ours, ref = mlp(0), mlp(0)
        train(ours, ztrain.optim.Adam(ours.parameters(), lr=1e-2, betas=(0.8, 0.99), weight_decay=1e-2), 30)
        train(ref, torch.optim.Adam(ref.parameters(), lr=1e-2, betas=(0.8, 0.99), weight_decay=1e-2), 30)
        self.assertLess(max_rel(ours, ref), 1e-5)
        adamw = mlp(0)
        train(adamw, ztrain.optim.AdamW(adamw.parameters(), lr=1e-2, betas=(0.8, 0.99), weight_decay=1e-2), 30)
        self.assertGreater(max_rel(adamw, ref), 1e-4)  # the two decays differ

    def test_groups_and_a_torch_schedule(self):
        def groups(model):
            return [{"params": model[0].parameters(), "lr": 3e-2, "weight_decay": 0.0},
                    {"params": model[2].parameters()}]
        ours, ref = mlp(0), mlp(0)
        opt = ztrain.optim.AdamW(groups(ours), lr=1e-2, weight_decay=0.1)
        ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, weight_decay=0.1)
        decay = lambda step: 1.0 / (1 + step)  # noqa: E731
        train(ours, opt, 20, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, decay))
        train(ref, ref_opt, 20, scheduler=torch.optim.lr_scheduler.LambdaLR(ref_opt, decay))
        self.assertLess(max_rel(ours, ref), 1e-5)
        self.assertAlmostEqual(opt.param_groups[0]["lr"], 3e-2 / 21)

    def test_bf16_parameters_keep_an_fp32_master(self):
        model = mlp(0, torch.bfloat16)
        opt = ztrain.optim.AdamW(model.parameters(), lr=1e-2)
        train(model, opt, 5)
        state = opt.state_dict()["state"]
        self.assertEqual(len(state), 4)
        for index, p in enumerate(model.parameters()):
            master = state[index]["master"]
            self.assertEqual(master.dtype, torch.float32)
            self.assertEqual(state[index]["step"].item(), 5)
            self.assertTrue(torch.equal(master.to(torch.bfloat16), p.detach()))

    def test_state_dicts_move_between_torch_and_ztrain(self):
        for first, second in ((torch.optim.AdamW, ztrain.optim.AdamW), (ztrain.optim.AdamW, torch.optim.AdamW)):
            with self.subTest(first=first.__module__, second=second.__module__):
                ref = mlp(0)
                ref_opt = first(ref.parameters(), lr=1e-2)
                train(ref, ref_opt, 5)
                moved = twin(ref)
                moved_opt = second(moved.parameters(), lr=1e-2)
                saved = io.BytesIO()  # as a checkpoint holds it (a state dict in memory shares the tensors)
                torch.save(ref_opt.state_dict(), saved)
                saved.seek(0)
                moved_opt.load_state_dict(torch.load(saved))
                train(ref, ref_opt, 5, seed=2)
                train(moved, moved_opt, 5, seed=2)
                self.assertLess(max_rel(moved, ref), 1e-5)
                self.assertEqual(moved_opt.state_dict()["state"][0]["step"].item(), 10)

    def test_bad_input_is_named(self):
        model = mlp(0)
        with self.assertRaisesRegex(ztrain.Error, "lr must be finite and >= 0, got -1"):
            ztrain.optim.AdamW(model.parameters(), lr=-1)
        opt = ztrain.optim.AdamW(model[0].parameters())
        with self.assertRaisesRegex(ztrain.Error, "add_param_group after construction"):
            opt.add_param_group({"params": model[2].parameters()})
        opt.param_groups[0]["betas"] = (0.9, 1.5)  # checked again at every step
        model(torch.ones(1, 16)).sum().backward()
        with self.assertRaisesRegex(ztrain.Error, "beta"):
            opt.step()
        self.assertTrue(issubclass(ztrain.Error, RuntimeError))
        self.assertTrue(issubclass(ztrain.CommError, ztrain.Error))


def init_distributed():
    """The runtime this file's tests run in (conftest.py calls it under pytest)."""
    ztrain.init_distributed(seed=0)


if __name__ == "__main__":
    init_distributed()
    unittest.main()
