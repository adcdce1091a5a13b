"""ztrain.save and ztrain.load on Python models with Blocks: files a model without ztrain reads,
loaded back at another ZeRO level (at every world size it is launched with)."""
import os
import tempfile
import unittest

import safetensors.torch
import torch

import ztrain

WIDTH, VOCAB = 16, 32


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(torch.nn.Module):
    """An embedding and a head around layers; `wrap` puts the layers under ztrain."""

    def __init__(self, seed, wrap=None):
        super().__init__()
        torch.manual_seed(seed)
        self.wte = torch.nn.Embedding(VOCAB, WIDTH)
        layers = [Layer() for _ in range(3)]
        self.blocks = wrap(layers) if wrap else torch.nn.ModuleList(layers)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.wte(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def shared_path(name):
    """A file name every rank of this host agrees on: the ranks share their launcher, their parent."""
    return os.path.join(tempfile.gettempdir(), f"ztrain_py_{name}_{os.getppid()}.safetensors")


class ModelFile(unittest.TestCase):
    def test_round_trip_through_a_model_without_ztrain(self):
        r = ztrain.rank()
        # The blocks start from dp rank 0's weights whatever each rank built; the rest is the same everywhere.
        model = Net(0 if r == 0 else 10 + r, lambda layers: ztrain.BlockList(layers, zero_level=3))
        if r > 0:  # the parts outside the blocks are the user's to keep equal
            model.wte.load_state_dict(Net(0).wte.state_dict())
            model.head.load_state_dict(Net(0).head.state_dict())
        path = shared_path("roundtrip")
        ztrain.save(model, path, metadata={"note": "from Python"})

        plain = Net(0)
        tensors = safetensors.torch.load_file(path)
        self.assertEqual(sorted(tensors), sorted(plain.state_dict()))
        for name, value in plain.state_dict().items():
            self.assertTrue(torch.equal(tensors[name], value), name)

        # Back into Blocks at another level, built from other weights.
        other = Net(5, lambda layers: ztrain.BlockList(layers, zero_level=1))
        ztrain.load(other, path)
        tokens = torch.randint(VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.testing.assert_close(other(tokens), plain(tokens))
        for block, layer in zip(other.blocks, plain.blocks):
            full = block.gathered_parameters()
            for name, p in layer.named_parameters():
                self.assertTrue(torch.equal(full[name], p.detach()), name)
        ztrain.synchronize()
        if r == 0:
            os.remove(path)

    def test_init_parameters_is_the_same_at_every_world_size(self):
        # A plain model in one process and Blocks over every rank draw the same weights.
        plain = Net(1)
        ztrain.init_parameters(plain, seed=42)
        model = Net(2 + ztrain.rank(), lambda layers: ztrain.BlockList(layers, zero_level=3))
        ztrain.init_parameters(model, seed=42)
        for block, layer in zip(model.blocks, plain.blocks):
            full = block.gathered_parameters()
            for name, p in layer.named_parameters():
                self.assertTrue(torch.equal(full[name], p.detach()), name)
        self.assertTrue(torch.equal(model.wte.weight, plain.wte.weight))
        self.assertTrue(torch.equal(plain.head.bias, torch.zeros(VOCAB)))  # GPT-2's rule
        self.assertAlmostEqual(plain.wte.weight.std().item(), 0.02, delta=0.004)
        names = []

        def constant(name, tensor, generator):
            names.append(name)
            tensor.fill_(0.5 if name.endswith("weight") else -1.0)

        ztrain.init_parameters(model, init=constant)
        self.assertIn("blocks.0.fc1.weight", names)
        self.assertTrue(torch.equal(model.blocks[2].gathered_parameters()["fc2.bias"], torch.full((WIDTH,), -1.0)))
        self.assertTrue(torch.equal(model.head.weight, torch.full((VOCAB, WIDTH), 0.5)))

    def test_a_single_block_and_the_errors(self):
        layer = Layer()
        block = ztrain.Block(layer, zero_level=2)
        path = shared_path("block")
        ztrain.save(block, path)
        self.assertEqual(sorted(safetensors.torch.load_file(path)), sorted(dict(Layer().named_parameters())))
        with self.assertRaisesRegex(ztrain.Error, "missing.safetensors"):
            ztrain.load(block, path + ".missing.safetensors")
        class Wider(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = torch.nn.Linear(WIDTH, 3 * WIDTH)
                self.fc2 = torch.nn.Linear(3 * WIDTH, WIDTH)

        wider = ztrain.Block(Wider(), zero_level=2)
        with self.assertRaisesRegex(ztrain.Error, r"'fc1.weight' in '.*' has shape \[32, 16\], the model's \[48, 16\]"):
            ztrain.load(wider, path)
        ztrain.synchronize()
        if ztrain.rank() == 0:
            os.remove(path)


def init_distributed():
    """The runtime this file's tests run in (conftest.py calls it under pytest)."""
    ztrain.init_distributed(seed=0)


if __name__ == "__main__":
    init_distributed()
    unittest.main()
