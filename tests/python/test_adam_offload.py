"""ztrain.optim.AdamOffload against ztrain.optim.AdamW: the same numbers bit for bit, the update
behind the next forward, the state in memory or in files (state_dir), at every world size it is
launched with."""
import os
import tempfile
import unittest

import torch

import ztrain

WIDTH = 8


class Net(torch.nn.Module):
    def __init__(self, level, offload_dir=None):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = ztrain.BlockList([torch.nn.Sequential(torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.GELU(),
                                                            torch.nn.Linear(2 * WIDTH, WIDTH)) for _ in range(3)],
                                       zero_level=level, use_checkpoint=level % 2 == 1, offload_dir=offload_dir)
        self.head = torch.nn.Linear(WIDTH, 4)  # a plain parameter, updated inside step()

    def forward(self, x):
        return self.head(self.blocks(x)).pow(2).mean()


def train(level, offload, state_dir=None, offload_dir=None):
    model = Net(level, offload_dir)
    opt = (ztrain.optim.AdamOffload(model, lr=1e-2, weight_decay=0.1, state_dir=state_dir) if offload
           else ztrain.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    losses = []
    gen = torch.Generator().manual_seed(ztrain.rank())
    for _ in range(5):
        opt.zero_grad()
        loss = model(torch.randn(4, WIDTH, generator=gen))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if offload:
            assert all(p.grad is None for p in model.parameters()), "step() takes the gradients"
    if offload:
        opt.wait()
    params = {name: t for block in model.blocks for name, t in block.gathered_parameters().items()}
    params.update({"head." + n: p.detach().clone() for n, p in model.head.named_parameters()})
    return losses, params, opt


def mapping_of(tensor):
    """The path of the file `tensor`'s memory maps ("" for anonymous memory)."""
    at = tensor.data_ptr()
    for line in open("/proc/self/maps"):
        fields = line.split(maxsplit=5)
        begin, end = (int(x, 16) for x in fields[0].split("-"))
        if begin <= at < end:
            return fields[5].strip() if len(fields) > 5 else ""
    return ""


class Offload(unittest.TestCase):
    def test_equals_adamw_bit_for_bit(self):
        state_dir = tempfile.mkdtemp()  # the state on disk (for levels 1 and 3)
        for level in range(4):
            with self.subTest(level=level):
                want_losses, want, _ = train(level, False)
                # Level 3: the blocks' parameter and gradient shards on disk too.
                losses, got, opt = train(level, True, state_dir if level % 2 else None,
                                         state_dir if level == 3 else None)
                self.assertEqual(losses, want_losses)
                self.assertEqual(sorted(got), sorted(want))
                for name in want:
                    self.assertTrue(torch.equal(got[name], want[name]), name)
                self.assertEqual(len(opt.param_groups), 1)
                steps = {opt.state_dict()["state"][i]["step"].item() for i in opt.state_dict()["state"]}
                self.assertEqual(steps, {5.0})
                if level % 2:  # the state lives in files there, unlinked: nothing left in the directory
                    shard = opt.param_groups[0]["params"][0]
                    self.assertIn(os.path.join(state_dir, "ztrain-offload-"), mapping_of(opt._native.state(shard)[1]))
                    on_disk = mapping_of(shard).startswith(os.path.join(state_dir, "ztrain-offload-"))
                    self.assertEqual(on_disk, level == 3)
                    self.assertEqual(os.listdir(state_dir), [])
        os.rmdir(state_dir)


def init_distributed():
    """The runtime this file's tests run in (conftest.py calls it under pytest)."""
    ztrain.init_distributed(seed=0)


if __name__ == "__main__":
    init_distributed()
    unittest.main()
