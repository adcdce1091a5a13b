"""ztrain.bmtrain's pipelines (init_distributed(pipe_size=2) on an even number of ranks, one stage
otherwise): the GPT of test_bmtrain.py with its layers in a PipelineTransformerBlockList (five
layers: three on the first stage, two on the second; Blocks at ZeRO levels 3 and 2, with and
without recomputation), every rank feeding its own part of the batch
as BMTrain's pipeline takes it, trained with AdamOptimizer, clipping and OptimManager's loss
scale, equals the same model in plain single-process PyTorch on the whole batch step by step:
losses, the gradient norm (each parameter counted once although the embeddings live on every
stage) and every parameter, which the stages gather into one state dict; bmt.save writes it and
bmt.load reads it back into the stages, persistent buffers of every stage's layers included;
return_hidden_states gives every layer's input for this
rank's part, and gradients flow back through them; send_activations and recv_activations carry
tensors of any shape and dtype between stages."""
import os
import unittest

import torch
import torch.nn.functional as F

import ztrain.bmtrain as bmt
from bmtrain_gpt import Layernorm, check_save_and_load, reference_forward
from test_bmtrain import BATCH, DIM, HEADS, DIM_HEAD, SEQ, VOCAB, Embedding, TransformerEncoder, data, masks
from ztrain.bmtrain.global_var import config

LAYERS, STEPS, MAX_NORM = 5, 4, 0.5


class PipeGPT(bmt.DistributedModule):
    def __init__(self):
        super().__init__()
        self.word_emb = Embedding(VOCAB, DIM)
        self.pos_emb = Embedding(SEQ, DIM)
        # Blocks at level 3 (BMTrain's mode="PIPE" as its example writes them), and a module the
        # pipeline wraps at level 2.
        self.transformers = bmt.PipelineTransformerBlockList(
            [bmt.Block(TransformerEncoder(), mode="PIPE") for _ in range(LAYERS - 2)] + [TransformerEncoder()] +
            [bmt.Block(TransformerEncoder(), use_checkpoint=False)])
        self.layernorm = Layernorm(DIM)

    def forward(self, ids, pos, mask):
        out = self.transformers(self.pos_emb(pos) + self.word_emb(ids), mask)
        return self.word_emb(self.layernorm(out), projection=True)


class Step(bmt.DistributedModule):
    def __init__(self):
        super().__init__()
        self.lin = bmt.nn.Linear(DIM, DIM)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Steps(bmt.DistributedModule):
    def __init__(self):
        super().__init__()
        self.layers = bmt.PipelineTransformerBlockList([Step() for _ in range(LAYERS)])


class Shifted(bmt.DistributedModule):
    """A layer with a persistent buffer, which state dicts carry, and a non-persistent one."""

    def __init__(self, shift):
        super().__init__()
        self.lin = bmt.nn.Linear(DIM, DIM)
        self.register_buffer("shift", torch.full((DIM,), float(shift)))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x):
        return torch.tanh(self.lin(x) + self.shift)


class ShiftedSteps(bmt.DistributedModule):
    def __init__(self, shifts):
        super().__init__()
        self.layers = bmt.PipelineTransformerBlockList([Shifted(s) for s in shifts])


def part(x):
    """This rank's part of the batch: the ranks split it as under data parallelism."""
    n = BATCH // bmt.world_size()
    return x[bmt.rank() * n:(bmt.rank() + 1) * n]


def parts(x):
    n = BATCH // bmt.world_size()
    return [x[r * n:(r + 1) * n] for r in range(bmt.world_size())]


class Pipeline(unittest.TestCase):
    def test_training_equals_plain_pytorch(self):
        pipe = config["pipe_size"]
        model = PipeGPT()
        bmt.init_parameters(model)
        self.assertEqual(len(model.transformers), LAYERS)
        expected = {1: [0, 1, 2, 3, 4], 2: [[0, 1, 2], [3, 4]][config["topology"].stage_id]}[pipe]
        self.assertEqual(list(model.transformers.layer_ids), expected)
        reference = {k: v.clone().requires_grad_() for k, v in model.state_dict().items()}
        self.assertEqual(len(reference), 4 + 16 * LAYERS)  # every stage's layers

        loss_func = torch.nn.CrossEntropyLoss(ignore_index=-100)
        # eps 1e-5: the pipeline sums its micro-batches' gradients in another order than the whole
        # batch's backward, and Adam turns a gradient of rounding size into a step of about lr once
        # it is not small against eps (with 1e-6, final weights 1e-3 apart on a Zen 4 EPYC; with
        # 1e-5, at most 4e-8 beyond the rtol below there).
        optimizer = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2, eps=1e-5)
        optim_manager = bmt.optim.OptimManager(loss_scale=2 ** 10)
        optim_manager.add_optimizer(optimizer)
        ref_opt = torch.optim.Adam(reference.values(), lr=1e-2, eps=1e-5)
        grad_scale = bmt.world_size() // pipe  # BMTrain's: the sum over every rank / zero_size

        losses = []
        for step in range(STEPS):
            ids, targets = data(step)
            pos, mask = masks(ids)
            logits = model(part(ids), part(pos), part(mask))
            loss = loss_func(logits.reshape(-1, VOCAB), part(targets).reshape(-1))
            global_loss = bmt.sum_loss(loss).item()
            optim_manager.zero_grad()
            optim_manager.backward(loss)
            norm = optim_manager.clip_grad_norm(optimizer.param_groups, MAX_NORM)
            optim_manager.step()

            ref_opt.zero_grad()
            ref_logits = reference_forward(reference, ids, pos, mask, LAYERS, HEADS, DIM_HEAD)
            ref_losses = [loss_func(lg.reshape(-1, VOCAB), t.reshape(-1))
                          for lg, t in zip(parts(ref_logits), parts(targets))]
            (sum(ref_losses) / grad_scale).backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.values(), MAX_NORM).item()
            ref_opt.step()
            self.assertAlmostEqual(global_loss, torch.stack(ref_losses).mean().item(), delta=5e-5, msg=f"step {step}")
            self.assertAlmostEqual(norm, ref_norm, delta=1e-4 * ref_norm, msg=f"step {step}")
            self.assertGreater(norm, MAX_NORM)  # clipping applied
            losses.append(global_loss)
        self.assertLess(losses[-1], losses[0] - 0.1, losses)
        final = model.state_dict()
        self.assertEqual(sorted(final), sorted(reference))
        for name, value in reference.items():
            if name.endswith("project_k.bias"):
                continue  # its gradient is zero but for rounding (softmax ignores a shift), which Adam magnifies
            torch.testing.assert_close(final[name], value.detach(), atol=2e-5, rtol=1e-4, msg=name)
        fresh, _ = check_save_and_load(self, model, final, PipeGPT, "bmt_pipe")
        ids, targets = data(STEPS)
        pos, mask = masks(ids)
        with torch.no_grad():
            torch.testing.assert_close(fresh(part(ids), part(pos), part(mask)), model(part(ids), part(pos), part(mask)),
                                       atol=0, rtol=0)

    def test_accumulated_steps_and_inspection(self):
        """Two backward passes (each on half of the parts) before one step equal one pass on the
        whole: the gradients of the parameters every stage holds are summed over the stages once;
        inspect_model sees every stage's layers with the whole gradient."""
        def run(halves):
            model = PipeGPT()
            bmt.init_parameters(model)
            optimizer = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2, eps=1e-6)
            manager = bmt.optim.OptimManager(loss_scale=None)
            manager.add_optimizer(optimizer)
            loss_func = torch.nn.CrossEntropyLoss(ignore_index=-100, reduction="sum")  # halves add up
            ids, targets = data(0)
            pos, mask = masks(ids)
            ids, targets, pos, mask = (part(t) for t in (ids, targets, pos, mask))
            manager.zero_grad()
            n = ids.shape[0] // halves
            for h in range(halves):
                rows = slice(h * n, (h + 1) * n)
                logits = model(ids[rows], pos[rows], mask[rows])
                manager.backward(loss_func(logits.reshape(-1, VOCAB), targets[rows].reshape(-1)) / 100)
            summary = {s["name"]: s for s in bmt.inspect.inspect_model(model, "*")}
            norm = manager.clip_grad_norm(optimizer.param_groups, 1e9)
            manager.step()
            return summary, norm, model.state_dict()

        if BATCH // bmt.world_size() < 2:
            self.skipTest("one sequence per rank")
        whole, whole_norm, whole_params = run(1)
        halves, halves_norm, halves_params = run(2)
        self.assertEqual(sorted(whole), sorted(halves))
        self.assertEqual(len(whole), 4 + 16 * LAYERS)  # every stage's layers
        self.assertAlmostEqual(halves_norm, whole_norm, delta=1e-5 * whole_norm)
        for name, summary in whole.items():
            self.assertAlmostEqual(halves[name]["grad_std"], summary["grad_std"], delta=1e-6 + 1e-4 * summary["grad_std"],
                                   msg=name)
        for name, value in whole_params.items():
            if not name.endswith("project_k.bias"):  # a gradient of rounding only, which Adam magnifies
                torch.testing.assert_close(halves_params[name], value, atol=1e-5, rtol=1e-4, msg=name)

    def test_hidden_states_of_every_layer(self):
        net = Steps()
        bmt.init_parameters(net)
        weights = net.state_dict()  # every stage's
        gen = torch.Generator().manual_seed(7)
        x_all = torch.randn(BATCH, 3, DIM, generator=gen)
        coeff = torch.randn(LAYERS, BATCH, 3, DIM, generator=gen)
        x = part(x_all).clone().requires_grad_()
        out, hidden = net.layers(x, return_hidden_states=True)
        (out.square().sum() + (hidden * coeff[:, part(torch.arange(BATCH))]).sum()).backward()

        ref_x = x_all.clone().requires_grad_()
        h, inputs = ref_x, []
        for i in range(LAYERS):
            inputs.append(h)
            h = torch.tanh(F.linear(h, weights[f"layers.{i}.lin.weight"], weights[f"layers.{i}.lin.bias"]))
        (h.square().sum() + (torch.stack(inputs) * coeff).sum()).backward()
        torch.testing.assert_close(out, part(h).detach())
        self.assertEqual(tuple(hidden.shape), (LAYERS,) + tuple(x.shape))
        torch.testing.assert_close(hidden, torch.stack(inputs)[:, part(torch.arange(BATCH))].detach())
        # Through the pipeline, the hidden states' own gradients and every rank's part.
        torch.testing.assert_close(x.grad, part(ref_x.grad), rtol=1e-5, atol=1e-6)

    def test_buffers_of_every_stage_are_saved_and_loaded(self):
        net = ShiftedSteps(range(LAYERS))
        bmt.init_parameters(net)
        state = net.state_dict()  # every stage's, as the parameters
        self.assertEqual(sorted(k for k in state if not k.endswith(("weight", "bias"))),
                         sorted(f"layers.{i}.shift" for i in range(LAYERS)))
        for i in range(LAYERS):
            torch.testing.assert_close(state[f"layers.{i}.shift"], torch.full((DIM,), float(i)), atol=0, rtol=0)
        fresh, _ = check_save_and_load(self, net, state, lambda: ShiftedSteps([-1] * LAYERS), "bmt_pipe_buffers")
        x = part(torch.randn(BATCH, 3, DIM, generator=torch.Generator().manual_seed(5)))
        with torch.no_grad():
            torch.testing.assert_close(fresh.layers(x), net.layers(x), atol=0, rtol=0)

    def test_activations_travel_between_stages(self):
        if config["pipe_size"] == 1:
            self.skipTest("one stage")
        stage = config["topology"].stage_id
        if stage == 0:
            bmt.distributed.send_activations(torch.arange(24, dtype=torch.bfloat16).view(2, 3, 4), 1,
                                             config["pipe_comm"])
            bmt.distributed.send_activations(torch.tensor([True, False]), 1, config["pipe_comm"])
        else:
            got = bmt.distributed.recv_activations(0, config["pipe_comm"])
            self.assertEqual(got.dtype, torch.bfloat16)
            torch.testing.assert_close(got, torch.arange(24, dtype=torch.bfloat16).view(2, 3, 4), atol=0, rtol=0)
            self.assertEqual(bmt.distributed.recv_activations(0, config["pipe_comm"]).tolist(), [True, False])

    def test_layout_follows_bmtrain(self):
        topology, pipe = config["topology"], config["pipe_size"]
        stage_size = bmt.world_size() // pipe
        self.assertEqual(topology.stage_id, bmt.rank() // stage_size)
        self.assertEqual(topology.pipe_idx, bmt.rank() % stage_size)
        self.assertEqual(config["zero_size"], stage_size)
        self.assertEqual(config["micros"], pipe)
        ranks = bmt.distributed.all_gather(torch.tensor([bmt.rank()]), config["pipe_comm"]).flatten().tolist()
        self.assertEqual(ranks, [s * stage_size + topology.pipe_idx for s in range(pipe)])

    def test_bad_input_is_named(self):
        if config["pipe_size"] == 1:
            self.skipTest("one stage")
        layers = bmt.PipelineTransformerBlockList([TransformerEncoder() for _ in range(2)])
        with self.assertRaisesRegex(bmt._C.Error, "layer 1 is on another pipeline stage|layer 0 is on another"):
            layers[1 - config["topology"].stage_id]
        x = torch.randn(1, SEQ, DIM)
        with self.assertRaisesRegex(bmt._C.Error, "argument 1 requires a gradient"):
            layers(x, torch.ones(1, SEQ, SEQ, dtype=torch.bool).float().requires_grad_())
        with self.assertRaisesRegex(bmt._C.Error, "1 layers cannot fill 2 pipeline stages"):
            bmt.PipelineTransformerBlockList([TransformerEncoder()])


def init_distributed():
    """The runtime this file's tests run in (conftest.py calls it under pytest)."""
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    bmt.init_distributed(seed=0, pipe_size=2 if world % 2 == 0 else -1)


if __name__ == "__main__":
    init_distributed()
    unittest.main()
