"""ztrain.Block over Python modules against single-process PyTorch: levels 0-3, with and without
recomputation, at every world size it is launched with (ZTRAIN_TEST_WORLD_SIZE ranks)."""
import contextlib
import unittest

import torch

import ztrain

WIDTH, LAYERS, BATCH, STEPS = 16, 3, 12, 4


class Layer(torch.nn.Module):
    """A residual MLP with a non-tensor argument and a second output, as transformer layers have."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = torch.nn.Linear(4 * WIDTH, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)

    def forward(self, x, scale):
        h = self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))
        return x + scale * h, h.pow(2).mean()


def layers(seed):
    torch.manual_seed(seed)
    return [Layer() for _ in range(LAYERS)]


def batches():
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(BATCH, WIDTH, generator=gen) for _ in range(STEPS)]


def step_loss(stack, x):
    aux = 0
    for layer in stack:
        x, a = layer(x, 0.5)
        aux = aux + a
    return x.pow(2).mean() + 0.1 * aux


def step_main(stack, x):
    for layer in stack:
        x = layer(x, 0.5)[0]
    return x


def train(stack, params, x_of):
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    losses = []
    for x in batches():
        opt.zero_grad()
        loss = step_loss(stack, x_of(x))
        loss.backward()
        opt.step()
        losses.append(ztrain.sum_loss(loss).item())
    return losses


class BlockParity(unittest.TestCase):
    def test_every_level_equals_one_process(self):
        ref = layers(0)
        want_losses = train(ref, [p for layer in ref for p in layer.parameters()], lambda x: x)
        n, r = ztrain.world_size(), ztrain.rank()
        self.assertEqual(BATCH % n, 0)
        local = BATCH // n
        for level in range(4):
            for recompute in (False, True):
                with self.subTest(level=level, recompute=recompute):
                    # Every rank builds other weights: the blocks start from dp rank 0's.
                    blocks = [ztrain.Block(layer, zero_level=level, use_checkpoint=recompute)
                              for layer in layers(0 if r == 0 else 100 + r)]
                    params = [p for b in blocks for p in b.parameters()]
                    losses = train(blocks, params, lambda x: x[r * local:(r + 1) * local])
                    # The mean over ranks of the per-rank means is the full batch's mean.
                    for got, want in zip(losses, want_losses):
                        self.assertAlmostEqual(got, want, delta=1e-5 * abs(want))
                    for block, layer in zip(blocks, ref):
                        full = block.gathered_parameters()
                        for name, p in layer.named_parameters():
                            torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
                    # Level 0 updates the whole (aligned) buffers, levels 1-3 this rank's 1/n of them.
                    kept = sum(p.numel() for p in params)
                    if level == 0:
                        whole = kept
                        self.assertGreaterEqual(whole, sum(p.numel() for layer in ref for p in layer.parameters()))
                    else:
                        self.assertEqual(kept * n, whole)

    def test_a_block_list_equals_one_process(self):
        n, r = ztrain.world_size(), ztrain.rank()
        local = BATCH // n

        class Stack(torch.nn.Module):  # the list's forward takes one output: keep the main one
            def __init__(self, layer):
                super().__init__()
                self.layer = layer

            def forward(self, x, scale):
                return self.layer(x, scale)[0]

        for level in (1, 3):
            with self.subTest(level=level):
                ref = layers(0)
                blocks = ztrain.BlockList([Stack(layer) for layer in layers(0)], zero_level=level, prefetch_depth=1)
                opt = torch.optim.SGD(blocks.parameters(), lr=0.1, momentum=0.9)
                ref_opt = torch.optim.SGD([p for layer in ref for p in layer.parameters()], lr=0.1, momentum=0.9)
                for x in batches()[:2]:
                    for model, optimizer, data in ((blocks, opt, x[r * local:(r + 1) * local]), (ref, ref_opt, x)):
                        optimizer.zero_grad()
                        out = model(data, 0.5) if model is blocks else step_main(ref, data)
                        out.pow(2).mean().backward()
                        optimizer.step()
                names = [name for name, _ in blocks.named_parameters()]
                self.assertEqual(names[0], "0.zero_shard_0")
                for block, layer in zip(blocks, ref):
                    full = block.gathered_parameters()
                    for name, p in layer.named_parameters():
                        torch.testing.assert_close(full["layer." + name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)

    def test_a_block_list_gathers_one_block_ahead(self):
        seen = []  # (block index, blocks with gathered storage) whenever a layer computes

        class Probe(torch.nn.Module):
            def __init__(self, index):
                super().__init__()
                self.index = index
                self.fc = torch.nn.Linear(WIDTH, WIDTH)

            def forward(self, x):
                seen.append((self.index, [b.gathered_bytes() > 0 for b in blocks]))
                return x + self.fc(x)

        blocks = ztrain.BlockList([Probe(i) for i in range(4)], zero_level=3, use_checkpoint=False, prefetch_depth=1)
        blocks(torch.randn(2, WIDTH)).sum().backward()
        self.assertEqual([i for i, _ in seen], [0, 1, 2, 3])
        for i, gathered in seen:
            # This block and the next one hold their parameters (the next one's gather started
            # before this one computed); the earlier ones released theirs, the later ones wait.
            self.assertEqual(gathered, [j in (i, i + 1) for j in range(4)], f"while block {i} computed")

    def test_recomputation_replays_the_dropout_masks(self):
        def dropped():
            torch.manual_seed(3)
            return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Dropout(0.5), torch.nn.Linear(WIDTH, WIDTH))
        grads = []
        for recompute in (False, True):
            block = ztrain.Block(dropped(), zero_level=2, use_checkpoint=recompute)
            torch.manual_seed(11)
            x = torch.randn(4, WIDTH)
            block(x).pow(2).sum().backward()
            # Another draw between forward and backward would shift an unreplayed mask.
            torch.rand(100)
            grads.append([p.grad.clone() for p in block.parameters()])
        for kept, recomputed in zip(*grads):
            self.assertTrue(torch.equal(kept, recomputed))

    def test_memory_stats_count_this_ranks_share(self):
        n = ztrain.world_size()
        kept = {}
        for level in (0, 3):
            blocks = ztrain.BlockList(layers(0), zero_level=level)
            opt = ztrain.optim.AdamW(blocks.parameters())
            step_main(blocks, batches()[0]).pow(2).mean().backward()
            opt.step()
            stats = ztrain.memory_stats(blocks, opt)
            shard = sum(p.numel() for p in blocks.parameters()) * 4  # fp32
            self.assertEqual(stats["parameter_bytes"], shard)
            self.assertEqual(stats["gradient_bytes"], shard)
            self.assertEqual(stats["optimizer_bytes"], 2 * shard)  # two fp32 moments
            self.assertEqual(stats["gathered_bytes"], 0)  # between steps
            self.assertGreaterEqual(stats["peak_rss_bytes"], stats["rss_bytes"])
            kept[level] = stats["parameter_bytes"]
        self.assertEqual(kept[3] * n, kept[0])
        with self.assertRaisesRegex(ztrain.Error, "ztrain.optim optimizers, got SGD"):
            ztrain.memory_stats(blocks, torch.optim.SGD(blocks.parameters(), lr=0.1))

    def test_the_module_sees_the_engine_values(self):
        layer = layers(0)[0]
        weight = layer.fc1.weight
        block = ztrain.Block(layer, zero_level=1)
        self.assertIs(layer.fc1.weight, weight)  # the same parameter object
        self.assertTrue(torch.equal(block.gathered_parameters()["fc1.weight"], weight.detach()))

    def test_accumulation_under_no_sync_equals_reducing_every_micro_batch(self):
        micro = [x[ztrain.rank() * 2:(ztrain.rank() + 1) * 2] for x in batches()[:3]]  # this rank's rows
        for level in range(4):
            with self.subTest(level=level):
                grads = []
                for hold in (False, True):
                    blocks = [ztrain.Block(layer, zero_level=level) for layer in layers(0)]
                    model = torch.nn.ModuleList(blocks)
                    for i, x in enumerate(micro):
                        held = hold and i + 1 < len(micro)
                        with ztrain.no_sync(model) if held else contextlib.nullcontext():
                            (step_loss(blocks, x) / len(micro)).backward()
                        if held:
                            self.assertTrue(all(p.grad is None for p in model.parameters()))
                    grads.append([p.grad.clone() for p in model.parameters()])
                for got, want in zip(grads[1], grads[0]):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)

    def test_bad_output_is_named(self):
        class Bad(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(2, 2)

            def forward(self, x):
                return {"y": self.fc(x)}

        block = ztrain.Block(Bad(), zero_level=0)
        with self.assertRaisesRegex(ztrain.Error, "must return a tensor or a tuple of tensors"):
            block(torch.ones(1, 2))
        with self.assertRaisesRegex(ztrain.Error, "pass tensors positionally"):
            block(x=torch.ones(1, 2))


def init_distributed():
    """The runtime this file's tests run in (conftest.py calls it under pytest)."""
    ztrain.init_distributed(seed=0)


if __name__ == "__main__":
    init_distributed()
    unittest.main()
