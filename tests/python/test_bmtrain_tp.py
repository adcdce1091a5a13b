"""ztrain.bmtrain's tensor parallelism (init_distributed(tp_size=2) on an even number of ranks,
tp_size 1 otherwise): a GPT written as BMTrain's example writes its tensor-parallel one — the
sequence split over the tp ranks, VPEmbedding, the fused q/k/v projection through
OpParallelLinear, ColumnParallelLinear and RowParallelLinear, FusedCrossEntropy(parallel=True),
AdamOffloadOptimizer, OptimManager — trains as the same model in plain single-process PyTorch,
step by step, its gradients BMTrain's (the true ones over tp_size); bmt.save writes full tensors
and bmt.load splits them again; a run resumed from the model and the OptimManager's state_dict
continues bit for bit. The other modes of OpParallelLinear and the vocabulary-parallel
cross entropy are checked against full-tensor references."""
import math
import os
import tempfile
import unittest

import torch
import torch.nn.functional as F

import ztrain.bmtrain as bmt
from bmtrain_gpt import Layernorm, check_save_and_load, reference_forward
from ztrain.bmtrain.global_var import config

VOCAB, DIM, HEADS, DIM_HEAD, FF, LAYERS, SEQ, STEPS = 48, 32, 4, 8, 64, 2, 12, 6


class Embedding(bmt.DistributedModule):
    def __init__(self, n, dim):
        super().__init__()
        self.weight = bmt.DistributedParameter(torch.empty(n, dim), init_method=torch.nn.init.normal_)

    def forward(self, x):
        return F.embedding(x, self.weight)


class Attention(bmt.DistributedModule):
    def __init__(self):
        super().__init__()
        self.project_q = bmt.nn.ColumnParallelLinear(DIM, HEADS * DIM_HEAD, gather_input=False)
        self.project_k = bmt.nn.ColumnParallelLinear(DIM, HEADS * DIM_HEAD, gather_input=False)
        self.project_v = bmt.nn.ColumnParallelLinear(DIM, HEADS * DIM_HEAD, gather_input=False)
        self.project_out = bmt.nn.RowParallelLinear(HEADS * DIM_HEAD, DIM)

    def forward(self, x, mask):
        batch = x.shape[0]
        h = bmt.nn.OpParallelLinear.apply(
            x, torch.cat([self.project_q.weight, self.project_k.weight, self.project_v.weight], dim=0),
            torch.cat([self.project_q.bias, self.project_k.bias, self.project_v.bias], dim=0), True, False, False, None)
        h = h.view(batch, -1, h.shape[-1])
        seq = h.shape[1]
        q, k, v = (t.reshape(batch, seq, -1, DIM_HEAD).transpose(1, 2) for t in h.chunk(3, dim=-1))
        score = (torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(DIM_HEAD)).masked_fill(~mask[:, None], float("-inf"))
        out = torch.matmul(score.softmax(-1), v).transpose(1, 2).reshape(batch, seq, -1)
        return self.project_out(out.view(batch * config["tp_size"], -1, out.shape[-1]))


class TransformerEncoder(bmt.DistributedModule):
    def __init__(self):
        super().__init__()
        self.ln_attn = Layernorm(DIM)
        self.attn = Attention()
        self.ln_ff = Layernorm(DIM)
        self.w_in = bmt.nn.ColumnParallelLinear(DIM, FF)
        self.w_out = bmt.nn.RowParallelLinear(FF, DIM)

    def forward(self, hidden, mask):
        hidden = hidden + self.attn(self.ln_attn(hidden), mask)
        return hidden + self.w_out(torch.relu(self.w_in(self.ln_ff(hidden)))).view_as(hidden)


class GPT(bmt.DistributedModule):
    def __init__(self):
        super().__init__()
        self.word_emb = bmt.nn.VPEmbedding(VOCAB, DIM, dtype=torch.float32, init_std=0.5)
        self.pos_emb = Embedding(SEQ, DIM)
        self.transformers = bmt.TransformerBlockList([bmt.Block(TransformerEncoder()) for _ in range(LAYERS)])
        self.layernorm = Layernorm(DIM)

    def forward(self, ids, pos, mask):
        ids = ids.chunk(config["tp_size"], dim=1)[config["tp_rank"]]
        pos = pos.chunk(config["tp_size"], dim=1)[config["tp_rank"]]
        out = self.transformers(self.pos_emb(pos) + self.word_emb(ids), mask)
        return self.word_emb(self.layernorm(out), projection=True)


def data(step, batch):
    """The whole batch: one sequence per data-parallel rank."""
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=gen)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (batch,), generator=gen)
    targets = ids[:, 1:].masked_fill(torch.arange(SEQ)[None, :] >= lengths[:, None], -100)
    pos = torch.arange(SEQ).repeat(batch, 1)
    return ids[:, :-1], targets, pos, pos[:, None, :] <= pos[:, :, None]


def trainer(model):
    """BMTrain's example optimizer, schedule and manager over `model`."""
    optimizer = bmt.optim.AdamOffloadOptimizer(model.parameters(), lr=1e-2, weight_decay=1e-2)
    lr_scheduler = bmt.lr_scheduler.Noam(optimizer, start_lr=2e-2, warmup_iter=2, end_iter=100, num_iter=0)
    optim_manager = bmt.optim.OptimManager(loss_scale=2 ** 10)
    optim_manager.add_optimizer(optimizer, lr_scheduler)
    return optim_manager, lr_scheduler


def train_step(test, model, optim_manager, step, check=lambda: None):
    """One step on this data-parallel rank's sequence of the step's batch; the global loss."""
    tp, dp, me = config["tp_size"], config["tp_zero_size"], config["tp_zero_rank"]
    ids, targets, pos, mask = (t[me:me + 1] for t in data(step, dp))
    logits = model(ids, pos, mask)
    test.assertEqual(tuple(logits.shape), (1, SEQ, VOCAB // tp))
    loss = bmt.loss.FusedCrossEntropy(ignore_index=-100, parallel=True)(logits.reshape(-1, VOCAB // tp),
                                                                          targets.reshape(-1))
    global_loss = bmt.sum_loss(loss).item()
    optim_manager.zero_grad()
    optim_manager.backward(loss)
    check()
    optim_manager.step()
    return global_loss


def tp_gather(x):
    return bmt.distributed.all_gather(x.contiguous(), config["tp_comm"])


class TensorParallelGPT(unittest.TestCase):
    def test_training_equals_plain_pytorch(self):
        tp, dp = config["tp_size"], config["tp_zero_size"]
        model = GPT()
        bmt.init_parameters(model)
        reference = {k: v.clone().requires_grad_() for k, v in model.state_dict().items()}
        self.assertEqual(tuple(reference["transformers.0.w_in.weight"].shape), (FF, DIM))  # full tensors
        self.assertEqual(tuple(reference["transformers.0.w_out.weight"].shape), (DIM, FF))
        self.assertEqual(tuple(reference["word_emb.weight"].shape), (VOCAB, DIM))
        self.assertAlmostEqual(reference["word_emb.weight"].std().item(), 0.5, delta=0.05)
        self.assertEqual(tuple(model.word_emb.weight.shape), (VOCAB // tp, DIM))  # this rank's slice

        optim_manager, _ = trainer(model)
        ref_opt = torch.optim.AdamW(reference.values(), lr=1e-2, weight_decay=1e-2)
        ref_sched = bmt.lr_scheduler.Noam(ref_opt, start_lr=2e-2, warmup_iter=2, end_iter=100, num_iter=0)

        losses = []
        for step in range(STEPS):
            ids, targets, pos, mask = data(step, dp)
            ref_opt.zero_grad()
            ref_logits = reference_forward(reference, ids, pos, mask, LAYERS, HEADS, DIM_HEAD)
            ref_loss = torch.stack([F.cross_entropy(ref_logits[i], targets[i], ignore_index=-100)
                                    for i in range(dp)]).mean()
            ref_loss.backward()
            global_loss = train_step(self, model, optim_manager, step, check=lambda: (
                self.check_gradients(model, reference, optim_manager.loss_scale / tp) if step == 0 else None))
            self.assertAlmostEqual(global_loss, ref_loss.item(), delta=2e-5, msg=f"step {step}")
            ref_opt.step()
            ref_sched.step()
            losses.append(global_loss)
        self.assertLess(losses[-1], losses[0] - 0.1, losses)
        final = model.state_dict()
        for name, value in reference.items():
            if name.endswith("project_k.bias"):
                continue  # its gradient is zero but for rounding (softmax ignores a shift), which Adam magnifies
            torch.testing.assert_close(final[name], value.detach(), atol=2e-5, rtol=1e-4, msg=name)
        # A row-parallel layer's bias is replicated over the tp ranks, and stays so.
        bias = final["transformers.0.w_out.bias"]
        for other in tp_gather(bias):
            torch.testing.assert_close(other, bias, atol=0, rtol=0)
        self.check_save_and_load(model, final)
        self.check_resume(model, optim_manager)

    def check_gradients(self, model, reference, scale):
        # BMTrain's gradients: summed over the stage's tp_size × dp ranks, divided by their number.
        for summary in bmt.inspect.inspect_model(model, "*"):
            grad = reference[summary["name"]].grad.double() * scale
            self.assertAlmostEqual(summary["grad_mean"], grad.mean().item(), delta=1e-4 * scale, msg=summary["name"])
            self.assertAlmostEqual(summary["grad_std"], grad.std(unbiased=False).item(),
                                   delta=1e-4 * scale + 1e-4 * grad.std().item(), msg=summary["name"])

    def check_resume(self, model, optim_manager):
        """The model (bmt.save) and the OptimManager's state (one file per rank) saved now: two more
        steps of a fresh model loaded from them equal two more steps here, bit for bit."""
        path = os.path.join(tempfile.gettempdir(), f"ztrain_py_bmt_tp_{os.getppid()}")
        bmt.save(model, path + ".pt")
        torch.save(optim_manager.state_dict(), f"{path}.optim.{bmt.rank()}.pt")
        expected = [train_step(self, model, optim_manager, step) for step in (STEPS, STEPS + 1)]
        fresh = GPT()
        bmt.load(fresh, path + ".pt")
        manager, _ = trainer(fresh)
        manager.load_state_dict(torch.load(f"{path}.optim.{bmt.rank()}.pt", weights_only=True))
        self.assertEqual(manager.loss_scale, optim_manager.loss_scale)
        self.assertEqual([train_step(self, fresh, manager, step) for step in (STEPS, STEPS + 1)], expected)
        with self.assertRaisesRegex(bmt._C.Error, "the state has 2 optimizers, this manager 1"):
            manager.load_state_dict(dict(manager.state_dict(), optimizers=[{}, {}]))
        bmt.synchronize()
        os.remove(f"{path}.optim.{bmt.rank()}.pt")
        bmt.synchronize()
        if bmt.rank() == 0:
            os.remove(path + ".pt")

    def check_save_and_load(self, model, state):
        fresh, _ = check_save_and_load(self, model, state, GPT, "bmt_tp")
        # The loaded model holds this rank's rows of the vocabulary-parallel table.
        rows = VOCAB // config["tp_size"]
        torch.testing.assert_close(fresh.word_emb.weight, state["word_emb.weight"][config["tp_rank"] * rows:][:rows])
        torch.testing.assert_close(fresh.word_emb._parameters["weight"].gather_all(), state["word_emb.weight"])


class Functions(unittest.TestCase):
    def setUp(self):
        torch.manual_seed(7)  # the same full tensors on every rank
        self.tp, self.r = config["tp_size"], config["tp_rank"]

    def part(self, x, dim):
        return x.chunk(self.tp, dim=dim)[self.r].contiguous()

    def test_column_gathering_its_output(self):
        for dtype, tol in ((torch.float32, {}), (torch.float16, {"atol": 2e-2, "rtol": 1e-2})):
            x, w, b = (torch.randn(5, 6), torch.randn(4 * self.tp, 6), torch.randn(4 * self.tp))
            g = torch.randn(5, 4 * self.tp)
            xs, ws, bs = (t.to(dtype).requires_grad_() for t in (x, self.part(w, 0), self.part(b, 0)))
            out = bmt.nn.OpParallelLinear.apply(xs, ws, bs, False, True, False, None)
            self.assertEqual(out.dtype, dtype)
            ref = [t.to(dtype).float().requires_grad_() for t in (x, w, b)]
            ref_out = F.linear(*ref)
            torch.testing.assert_close(out.float(), ref_out, **tol)
            (out * g.to(dtype)).sum().backward()
            (ref_out * g.to(dtype).float()).sum().backward()
            torch.testing.assert_close(xs.grad.float(), ref[0].grad, **tol)
            torch.testing.assert_close(ws.grad.float(), self.part(ref[1].grad, 0), **tol)
            torch.testing.assert_close(bs.grad.float(), self.part(ref[2].grad, 0), **tol)

    def test_op_linear_is_linear(self):
        x, w, b = (torch.randn(2, 3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True),
                   torch.randn(5, requires_grad=True))
        out = bmt.nn.OpLinear.apply(x, w, b)
        torch.testing.assert_close(out, F.linear(x, w, b))
        grads = torch.autograd.grad(out.square().sum(), (x, w, b))
        for mine, ref in zip(grads, torch.autograd.grad(F.linear(x, w, b).square().sum(), (x, w, b))):
            torch.testing.assert_close(mine, ref)

    def test_row_splitting_its_input_and_reducing_its_output(self):
        x, w, g = torch.randn(3, 5, 4 * self.tp), torch.randn(6, 4 * self.tp), torch.randn(3, 5, 6)
        xs, ws = x.clone().requires_grad_(), self.part(w, 1).requires_grad_()
        out = bmt.nn.OpParallelLinear.apply(xs, ws, None, False, False, True, bmt.nn.ReduceType.ALL_REDUCE)
        ref = [t.clone().requires_grad_() for t in (x, w)]
        ref_out = F.linear(*ref)
        torch.testing.assert_close(out, ref_out)
        (out * g).sum().backward()
        (ref_out * g).sum().backward()
        torch.testing.assert_close(xs.grad, ref[0].grad)
        torch.testing.assert_close(ws.grad, self.part(ref[1].grad, 1))

    def test_vocabulary_parallel_cross_entropy(self):
        logits = torch.randn(9, 5 * self.tp).half()
        target = torch.tensor([0, 1, 2, -100, 4, 5 * self.tp - 1, 3, 0, -100])
        mine = self.part(logits, 1).requires_grad_()
        ref = logits.float().requires_grad_()
        for reduction in ("mean", "sum"):
            loss = bmt.loss.FusedCrossEntropy(ignore_index=-100, reduction=reduction, parallel=True)(mine, target)
            ref_loss = F.cross_entropy(ref, target, ignore_index=-100, reduction=reduction)
            self.assertEqual(loss.dtype, torch.float32)
            self.assertAlmostEqual(loss.item(), ref_loss.item(), places=5)
        loss.backward()
        ref_loss.backward()
        self.assertEqual(mine.grad.dtype, torch.float16)
        torch.testing.assert_close(mine.grad.float(), self.part(ref.grad, 1), atol=1e-3, rtol=1e-3)

    def test_sizes_that_do_not_split_are_named(self):
        if self.tp == 1:
            self.skipTest("every size splits over one rank")
        with self.assertRaisesRegex(bmt._C.Error, "out_features \\(5\\) does not divide by tp_size 2"):
            bmt.nn.ColumnParallelLinear(4, 5)
        with self.assertRaisesRegex(bmt._C.Error, "vocab_size \\(7\\) does not divide by tp_size 2"):
            bmt.nn.VPEmbedding(7, 4)

    def test_layout_follows_bmtrain(self):
        topology = config["topology"]
        self.assertEqual(topology.tp_id, bmt.rank() % self.tp)
        self.assertEqual(config["tp_rank"], topology.tp_id)
        self.assertEqual(config["tp_zero_rank"], bmt.rank() // self.tp)
        self.assertEqual(config["tp_zero_size"] * self.tp, bmt.world_size())
        self.assertEqual(config["zero_size"], bmt.world_size())
        ranks = bmt.distributed.all_gather(torch.tensor([bmt.rank()]), config["tp_comm"]).flatten().tolist()
        self.assertEqual(ranks, [topology.tp_idx * self.tp + i for i in range(self.tp)])


def init_distributed():
    """The runtime this file's tests run in (conftest.py calls it under pytest)."""
    bmt.init_distributed(seed=0, tp_size=2 if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) % 2 == 0 else 1)


if __name__ == "__main__":
    init_distributed()
    unittest.main()
