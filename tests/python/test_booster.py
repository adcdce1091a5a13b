"""ztrain.booster over a plain Python model against single-process PyTorch (torch.optim.AdamW,
clip_grad_norm_ over the whole batch): every plugin at every world size it is launched with,
resuming from saved model and optimizer files, gradient accumulation under no_sync, and the
errors of a wrong optimizer or model."""
import contextlib
import os
import shutil
import tempfile
import unittest

import torch
import torch.nn.functional as F

import ztrain
from ztrain.booster import Booster, DataParallelPlugin, FullyShardPlugin, LowLevelZeroPlugin

VOCAB, WIDTH, LAYERS, BATCH, SEQ, LR, CLIP = 32, 16, 3, 8, 6, 1e-2, 0.5


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.fc1 = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyLM(torch.nn.Module):
    """Embedding, a ModuleList of layers, a final norm and a head (by default tied to the
    embedding); the forward gives the next-token loss."""

    def __init__(self, seed=0, layer=Layer, tied=True):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.layers = torch.nn.ModuleList(layer() for _ in range(LAYERS))
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = None if tied else torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        logits = F.linear(x, self.embed.weight) if self.head is None else self.head(x)
        return F.cross_entropy(logits.view(-1, VOCAB), ids.roll(-1, dims=1).view(-1))


def batch(step):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))


def local(ids):
    """This rank's share over the data-parallel ranks (the tp ranks of one replica see the same)."""
    n, r = ztrain._C._group_size("dp"), ztrain._C._group_rank("dp")
    return ids[r * BATCH // n:(r + 1) * BATCH // n]


PLUGINS = {
    "ddp": lambda: DataParallelPlugin(),
    "zero1": lambda: LowLevelZeroPlugin(stage=1),
    "zero2": lambda: LowLevelZeroPlugin(stage=2),
    "fsdp": lambda: FullyShardPlugin(),
    "fsdp_checkpoint": lambda: FullyShardPlugin(use_checkpoint=True, wrap=Layer),
}


def reference(steps, make_model=TinyLM):
    """Losses, final weights and gradient norms of `steps` clipped AdamW steps on the whole
    batch, one process."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        loss = model(batch(step))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict(), norms


def check_params(test, model, want):
    """Every full parameter of `model` (all stages') equals `want`'s."""
    got = ztrain.state_dict(model)
    test.assertEqual(set(got), set(want))
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=key)


def boosted(plugin):
    model = TinyLM()
    optimizer = ztrain.optim.AdamW(model.parameters(), lr=LR)
    booster = Booster(plugin, max_grad_norm=CLIP)
    model, optimizer, *_ = booster.boost(model, optimizer)
    return booster, model, optimizer


def train(booster, model, optimizer, steps, first=0):
    losses = []
    for step in range(first, first + steps):
        optimizer.zero_grad()
        loss = model(local(batch(step)))
        booster.backward(loss, optimizer)
        assert optimizer.step()
        losses.append(ztrain.sum_loss(loss).item())
    return losses


class Plugins(unittest.TestCase):
    def test_every_plugin_equals_one_process(self):
        want_losses, want_params, _ = reference(4)
        for name, make in PLUGINS.items():
            with self.subTest(plugin=name):
                booster, model, optimizer = boosted(make())
                losses = train(booster, model, optimizer, 4)
                torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
                check_params(self, model, want_params)
                self.assertGreater(optimizer.last_grad_norm, 0)

    def test_weight_decay_groups_equal_one_process(self):
        def groups(model):  # GPT-2's split: decay the matrices, not biases and norms
            decay = [p for p in model.parameters() if p.dim() >= 2]
            return [{"params": decay, "weight_decay": 0.1},
                    {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]

        ref = TinyLM()
        ref_opt = torch.optim.AdamW(groups(ref), lr=LR)
        want = []
        for step in range(3):
            ref_opt.zero_grad()
            loss = ref(batch(step))
            loss.backward()
            ref_opt.step()
            want.append(loss.item())
        for name in ("ddp", "zero1", "fsdp"):
            with self.subTest(plugin=name):
                model = TinyLM()
                booster = Booster(PLUGINS[name]())
                model, optimizer, *_ = booster.boost(model, ztrain.optim.AdamW(groups(model), lr=LR))
                self.assertEqual([g["weight_decay"] for g in optimizer.param_groups], [0.1, 0.0])
                torch.testing.assert_close(train(booster, model, optimizer, 3), want, rtol=1e-5, atol=1e-6)
                got = ztrain.state_dict(model)
                for key, value in ref.state_dict().items():
                    torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=key)

    def test_units_are_blocks_of_the_plugins_level(self):
        for name, level in (("ddp", 0), ("zero1", 1), ("zero2", 2), ("fsdp", 3)):
            _, model, _ = boosted(PLUGINS[name]())
            self.assertEqual([layer.zero_level for layer in model.layers], [level] * LAYERS)
            self.assertIsInstance(model.embed.weight, torch.nn.Parameter)  # replicated, outside the units

    def test_resume_from_saved_files_continues_exactly(self):
        # The ranks of one job share the launcher's process id (as test_model_file.py's files).
        prefix = os.path.join(tempfile.gettempdir(), f"ztrain_py_booster_{os.getppid()}")
        model_file, optim_file = prefix + ".model.safetensors", prefix + ".optim.safetensors"
        try:
            for name, other in (("zero1", "zero2"), ("fsdp", "ddp")):
                with self.subTest(plugin=name):
                    booster, model, optimizer = boosted(PLUGINS[name]())
                    train(booster, model, optimizer, 2)
                    booster.save_model(model, model_file)
                    booster.save_optimizer(optimizer, optim_file)
                    want = train(booster, model, optimizer, 2, first=2)
                    # Another plugin loads them: the files do not depend on the level.
                    booster, model, optimizer = boosted(PLUGINS[other]())
                    booster.load_model(model, model_file)
                    booster.load_optimizer(optimizer, optim_file)
                    got = train(booster, model, optimizer, 2, first=2)
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        finally:
            ztrain.synchronize()
            if ztrain.rank() == 0:
                for path in (model_file, optim_file):
                    if os.path.exists(path):
                        os.remove(path)

    def test_a_training_checkpoint_resumes_exactly_under_another_plugin(self):
        root = os.path.join(tempfile.gettempdir(), f"ztrain_py_booster_ckpt_{os.getppid()}")

        def make(name):
            model = TinyLM()
            optimizer = ztrain.optim.AdamW(model.parameters(), lr=LR)
            schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            booster = Booster(PLUGINS[name](), max_grad_norm=CLIP)
            model, optimizer, _, _, schedule = booster.boost(model, optimizer, lr_scheduler=schedule)
            return booster, model, optimizer, schedule

        def run(booster, model, optimizer, schedule, first):
            losses = []
            for step in range(first, first + 2):
                optimizer.zero_grad()
                loss = model(local(batch(step)))
                booster.backward(loss, optimizer)
                optimizer.step()
                schedule.step()
                losses.append(ztrain.sum_loss(loss).item())
            return losses

        try:
            saved = make("fsdp")
            run(*saved, 0)
            path = saved[0].save_checkpoint(root, 2, extra={"data": 17})
            want = run(*saved, 2)
            resumed = make("zero2")
            self.assertEqual(ztrain.latest_checkpoint(root), path)
            info = resumed[0].load_checkpoint(ztrain.latest_checkpoint(root))
            self.assertEqual((info["step"], info["extra"], info["world_size"]), (2, {"data": 17}, ztrain.world_size()))
            self.assertEqual(resumed[2].param_groups[0]["lr"], LR / 4)  # the schedule's, restored
            self.assertEqual(resumed[2]._manager.steps, 2)
            torch.testing.assert_close(run(*resumed, 2), want, rtol=1e-6, atol=1e-7)
            self.assertEqual(resumed[2].param_groups[0]["lr"], saved[2].param_groups[0]["lr"])
            ztrain.synchronize()
            if ztrain.rank() == 0:
                with open(os.path.join(path, "model.safetensors"), "r+b") as f:
                    f.truncate(100)
            ztrain.synchronize()
            with self.assertRaisesRegex(ztrain.Error, "model.safetensors"):
                resumed[0].load_checkpoint(path)
        finally:
            ztrain.synchronize()
            if ztrain.rank() == 0:
                shutil.rmtree(root, ignore_errors=True)

    def test_no_sync_accumulates_and_reduces_once(self):
        ref = TinyLM()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        for step in (0, 1):
            (ref(batch(step)) / 2).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        booster, model, optimizer = boosted(PLUGINS["zero2"]())
        optimizer.zero_grad()
        for step in (0, 1):
            with booster.no_sync(model) if step == 0 else contextlib.nullcontext():
                booster.backward(model(local(batch(step))) / 2, optimizer)
        self.assertTrue(optimizer.step())
        got = ztrain.state_dict(model)
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=key)


class Errors(unittest.TestCase):
    def test_a_torch_optimizer_is_refused_with_the_alternative(self):
        model = TinyLM()
        with self.assertRaisesRegex(ztrain.Error, "must be a ztrain.optim.AdamW or Adam .*got AdamW"):
            Booster(DataParallelPlugin()).boost(model, torch.optim.AdamW(model.parameters()))

    def test_param_groups_that_split_a_shard_are_refused(self):
        model = TinyLM()
        fc1 = [model.layers[0].fc1.weight]
        rest = [p for p in model.parameters() if p is not fc1[0]]
        with self.assertRaisesRegex(ztrain.Error, "the unit 'layers.0' keeps 'fc1.weight' \\(param group 0\\), "
                                                  "'fc2.weight' \\(param group 1\\) in one flat shard"):
            Booster(FullyShardPlugin()).boost(model, ztrain.optim.AdamW([{"params": fc1}, {"params": rest}]))

    def test_an_optimizer_over_other_parameters_is_refused(self):
        model = TinyLM()
        with self.assertRaisesRegex(ztrain.Error, "not the model's"):
            Booster(FullyShardPlugin()).boost(model, ztrain.optim.AdamW(model.layers.parameters()))

    def test_a_model_without_units_names_the_wrap_option(self):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        with self.assertRaisesRegex(ztrain.Error, "found no unit to wrap in Sequential.*wrap="):
            Booster(FullyShardPlugin()).boost(model, ztrain.optim.AdamW(model.parameters()))

    def test_a_parameter_shared_with_a_unit_is_refused(self):
        model = TinyLM()
        model.head = torch.nn.Linear(WIDTH, WIDTH)
        model.head.weight = model.layers[0].fc1.weight
        with self.assertRaisesRegex(ztrain.Error, "'head.weight' is shared with the unit 'layers.0'"):
            Booster(FullyShardPlugin()).boost(model, ztrain.optim.AdamW(model.parameters()))

    def test_a_wrong_stage_and_a_second_boost(self):
        with self.assertRaisesRegex(ztrain.Error, "stage must be 1 or 2, got 3"):
            LowLevelZeroPlugin(stage=3)
        booster, model, optimizer = boosted(DataParallelPlugin())
        with self.assertRaisesRegex(ztrain.Error, "boost\\(\\) was called already"):
            booster.boost(model, optimizer.optim)


def init_distributed():
    """The runtime this file's tests run in (conftest.py calls it under pytest)."""
    ztrain.init_distributed(seed=0)


if __name__ == "__main__":
    init_distributed()
    unittest.main()
