"""ztrain.bmtrain: a GPT written as BMTrain's example writes one (DistributedModule layers,
DistributedParameters, Blocks in a TransformerBlockList, a tied embedding, AdamOffloadOptimizer,
Noam, OptimManager with loss scaling) trains on every world size it is launched with and equals
the same model in plain single-process PyTorch, step by step; bmt.save writes the plain model's
state dict and bmt.load reads it back; inspect sees the parameters, gradients and recorded
tensors of the whole model."""
import math
import os
import subprocess
import sys
import tempfile
import unittest

import torch
import torch.nn.functional as F

import ztrain.bmtrain as bmt
from bmtrain_gpt import Layernorm, check_save_and_load, reference_forward

VOCAB, DIM, HEADS, DIM_HEAD, FF, LAYERS, SEQ, BATCH, STEPS = 48, 32, 4, 8, 64, 2, 12, 4, 8


class Embedding(bmt.DistributedModule):
    def __init__(self, n, dim):
        super().__init__()
        self.weight = bmt.DistributedParameter(torch.empty(n, dim),
                                               init_method=bmt.ParameterInitializer(torch.nn.init.normal_, std=0.5))

    def forward(self, x, projection=False):
        return F.linear(x, self.weight) if projection else F.embedding(x, self.weight)


class Attention(bmt.DistributedModule):
    def __init__(self):
        super().__init__()
        self.project_q = bmt.nn.Linear(DIM, HEADS * DIM_HEAD)
        self.project_k = bmt.nn.Linear(DIM, HEADS * DIM_HEAD)
        self.project_v = bmt.nn.Linear(DIM, HEADS * DIM_HEAD)
        self.project_out = bmt.nn.Linear(HEADS * DIM_HEAD, DIM)

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, HEADS, DIM_HEAD).transpose(1, 2)
                   for p in (self.project_q, self.project_k, self.project_v))
        score = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(DIM_HEAD)
        score = score.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
        return self.project_out(torch.matmul(score, v).transpose(1, 2).reshape(b, s, -1))


class TransformerEncoder(bmt.DistributedModule):
    def __init__(self):
        super().__init__()
        self.ln_attn = Layernorm(DIM)
        self.attn = Attention()
        self.ln_ff = Layernorm(DIM)
        self.w_in = bmt.nn.Linear(DIM, FF)
        self.w_out = bmt.nn.Linear(FF, DIM)

    def forward(self, hidden, mask):
        bmt.inspect.record_tensor(hidden, "hidden")
        hidden = hidden + self.attn(self.ln_attn(hidden), mask)
        return hidden + self.w_out(torch.relu(self.w_in(self.ln_ff(hidden))))


class GPT(bmt.DistributedModule):
    def __init__(self):
        super().__init__()
        self.word_emb = Embedding(VOCAB, DIM)
        self.pos_emb = Embedding(SEQ, DIM)
        self.transformers = bmt.TransformerBlockList([bmt.Block(TransformerEncoder()) for _ in range(LAYERS)])
        self.layernorm = Layernorm(DIM)

    def forward(self, ids, pos, mask):
        out = self.transformers(self.pos_emb(pos) + self.word_emb(ids), mask)
        return self.word_emb(self.layernorm(out), projection=True)


def data(step):
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH,), generator=gen)
    targets = ids[:, 1:].masked_fill(torch.arange(SEQ)[None, :] >= lengths[:, None], -100)
    return ids[:, :-1], targets


def masks(ids):
    pos = torch.arange(SEQ).repeat(ids.shape[0], 1)
    return pos, (pos[:, None, :] <= pos[:, :, None])


def local(x):
    n = BATCH // bmt.world_size()
    return x[bmt.rank() * n:(bmt.rank() + 1) * n]


class BMTrainGPT(unittest.TestCase):
    def test_training_equals_plain_pytorch(self):
        model = GPT()
        bmt.init_parameters(model)
        start = bmt.inspect.inspect_model(model, "*")
        reference = {k: v.clone().requires_grad_() for k, v in model.state_dict().items()}
        self.assertEqual(len(reference), 4 + 16 * LAYERS)  # the plain model's names; reference_forward reads each
        self.assertAlmostEqual(next(s for s in start if s["name"] == "layernorm.weight")["mean"], 1.0)

        loss_func = torch.nn.CrossEntropyLoss(ignore_index=-100)
        optimizer = bmt.optim.AdamOffloadOptimizer(model.parameters(), lr=1e-2, weight_decay=1e-2)
        lr_scheduler = bmt.lr_scheduler.Noam(optimizer, start_lr=2e-2, warmup_iter=2, end_iter=100, num_iter=0)
        optim_manager = bmt.optim.OptimManager(loss_scale=2 ** 10)
        optim_manager.add_optimizer(optimizer, lr_scheduler)
        ref_opt = torch.optim.AdamW(reference.values(), lr=1e-2, weight_decay=1e-2)
        ref_sched = bmt.lr_scheduler.Noam(ref_opt, start_lr=2e-2, warmup_iter=2, end_iter=100, num_iter=0)

        losses = []
        for step in range(STEPS):
            ids, targets = data(step)
            pos, mask = masks(ids)
            with bmt.inspect.inspect_tensor() as inspector:
                logits = model(local(ids), local(pos), local(mask))
                loss = loss_func(logits.reshape(-1, VOCAB), local(targets).reshape(-1))
                global_loss = bmt.sum_loss(loss).item()
                optim_manager.zero_grad()
                optim_manager.backward(loss)
            # The reference sees the whole batch; the ranks' equal shares average to its mean
            # when every share has as many counted tokens: weigh each rank's mean accordingly.
            ref_opt.zero_grad()
            ref_logits = reference_forward(reference, ids, pos, mask, LAYERS, HEADS, DIM_HEAD)
            per_rank = [F.cross_entropy(l.reshape(-1, VOCAB), t.reshape(-1), ignore_index=-100)
                        for l, t in zip(ref_logits.chunk(bmt.world_size()), targets.chunk(bmt.world_size()))]
            ref_loss = torch.stack(per_rank).mean()
            ref_loss.backward()
            self.assertAlmostEqual(global_loss, ref_loss.item(), delta=2e-5, msg=f"step {step}")
            if step == 0:
                self.check_inspection(model, reference, inspector, optim_manager.loss_scale)
            optim_manager.step()
            ref_opt.step()
            ref_sched.step()
            losses.append(global_loss)
        self.assertLess(losses[-1], losses[0] - 0.1, losses)
        self.assertAlmostEqual(lr_scheduler.current_lr, ref_sched.current_lr)
        final = model.state_dict()
        for name, value in reference.items():
            if name.endswith("project_k.bias"):
                continue  # its gradient is zero but for rounding (softmax ignores a shift), which Adam magnifies
            torch.testing.assert_close(final[name], value.detach(), atol=1e-5, rtol=1e-4, msg=name)
        self.check_save_and_load(model, final)

    def check_inspection(self, model, reference, inspector, scale):
        summary = {s["name"]: s for s in bmt.inspect.inspect_model(model, "*")}
        self.assertEqual(sorted(summary), sorted(reference))
        for name, p in reference.items():
            grad = p.grad.double() * scale  # the gradients are still scaled before step()
            self.assertAlmostEqual(summary[name]["grad_mean"], grad.mean().item(), delta=1e-4 * scale, msg=name)
            self.assertAlmostEqual(summary[name]["grad_std"], grad.std(unbiased=False).item(),
                                   delta=1e-4 * scale + 1e-4 * grad.std().item(), msg=name)
            self.assertAlmostEqual(summary[name]["max"], p.max().item(), places=5, msg=name)
        weights = bmt.inspect.inspect_model(model, "transformers.*.w_in.weight")
        self.assertEqual([s["name"] for s in weights], [f"transformers.{i}.w_in.weight" for i in range(LAYERS)])
        recorded = inspector.get_summary()
        self.assertEqual([s["name"] for s in recorded], [f"{i}.hidden" for i in range(LAYERS)])
        self.assertEqual(recorded[0]["shape"], (BATCH, SEQ, DIM))
        self.assertTrue(all(s["grad_std"] is not None and s["grad_std"] > 0 for s in recorded), recorded)
        table = bmt.inspect.format_summary(recorded)
        self.assertIn("0.hidden", table)
        self.assertIn("grad_mean", table.splitlines()[0])

    def check_save_and_load(self, model, state):
        fresh, saved = check_save_and_load(self, model, state, GPT, "bmt")
        # A file with a name the model lacks is refused, naming it.
        saved["extra"] = torch.zeros(1)
        path = os.path.join(tempfile.gettempdir(), f"ztrain_py_bmt_bad_{os.getppid()}.pt")
        if bmt.rank() == 0:
            torch.save(saved, path)
        bmt.synchronize()
        with self.assertRaisesRegex(bmt._C.Error, "extra"):
            bmt.load(fresh, path)
        bmt.synchronize()
        if bmt.rank() == 0:
            os.remove(path)


class Pieces(unittest.TestCase):
    def test_adam_optimizer_is_coupled_adam_for_fp32_and_holds(self):
        torch.manual_seed(0)
        w0 = torch.randn(6, 5)
        mine, ref = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
        opt = bmt.optim.AdamOptimizer([mine], lr=0.1, weight_decay=0.05, hold_steps=2)
        torch_opt = torch.optim.Adam([ref], lr=0.1, weight_decay=0.05)
        for step in range(6):
            for p in (mine, ref):
                p.grad = torch.full_like(p, 0.3) + p.detach() * 0.1
            opt.step()
            torch_opt.param_groups[0]["lr"] = 0.0 if step < 2 else 0.1  # held steps move the moments only
            torch_opt.step()
            if step < 2:
                self.assertTrue(torch.equal(mine.detach(), w0), "hold_steps: no update yet")
        self.assertFalse(torch.equal(mine.detach(), w0))
        torch.testing.assert_close(mine.detach(), ref.detach(), atol=1e-6, rtol=1e-5)

    def test_schedules_follow_bmtrain(self):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        noam = bmt.lr_scheduler.Noam(opt, start_lr=0.4, warmup_iter=4, end_iter=10, num_iter=0)
        lrs = []
        for _ in range(6):
            lrs.append(noam.current_lr)
            noam.step()
        self.assertEqual(lrs[:4], [0.4 / 2 * i / 4 for i in range(4)])
        self.assertAlmostEqual(lrs[5], 0.4 / math.sqrt(5))
        self.assertEqual(opt.param_groups[0]["lr"], noam.current_lr)
        cosine = bmt.lr_scheduler.Cosine(opt, start_lr=1.0, warmup_iter=2, end_iter=6, num_iter=4)
        self.assertAlmostEqual(cosine.current_lr, 0.5)
        self.assertEqual(bmt.lr_scheduler.Linear(opt, 1.0, 2, 6, 5).current_lr, 0.25)
        self.assertAlmostEqual(bmt.lr_scheduler.Exponential(opt, 1.0, 0, 6, 2, gamma=0.5).current_lr, 0.25)
        self.assertEqual(bmt.lr_scheduler.NoDecay(opt, 1.0, 2, 6, 1).current_lr, 0.5)
        state = noam.state_dict()
        again = bmt.lr_scheduler.Noam(opt, start_lr=0.1, warmup_iter=1, end_iter=2)
        again.load_state_dict(state)
        self.assertEqual(again.current_lr, noam.current_lr)

    def test_fused_cross_entropy_and_recorder(self):
        logits = torch.randn(10, 7).half().requires_grad_()
        target = torch.tensor([0, 1, 2, -100, 4, 5, 6, 0, 1, 2])
        loss = bmt.loss.FusedCrossEntropy(ignore_index=-100)(logits, target)
        self.assertEqual(loss.dtype, torch.float32)
        self.assertAlmostEqual(loss.item(), F.cross_entropy(logits.float(), target).item(), places=6)
        loss.backward()
        self.assertEqual(logits.grad.dtype, torch.float16)
        recorder = bmt.utils.AverageRecorder(alpha=0.5)
        recorder.record(4.0)
        self.assertEqual(recorder.value, 4.0)
        recorder.record(2.0)
        self.assertAlmostEqual(recorder.value, (0.5 * 4.0 * 0.5 + 0.5 * 2.0) / (1 - 0.25))


class HalfProducts(unittest.TestCase):
    def test_products_of_half_tensors_on_this_cpu_multiply_in_fp32(self):
        if torch.device(bmt._C.device()).type == "cuda":
            self.skipTest("a GPU rank: placement is not mapped")
        a = torch.randn(2, 8, 16).half().requires_grad_()
        b = torch.randn(2, 16, 4).half()
        products = [(torch.bmm(a, b), b), (a @ b, b), (torch.matmul(a, b), b), (a.bmm(b), b),
                    (F.linear(a, b[0].t()), b[0])]
        for out, right in products:
            self.assertEqual(out.dtype, torch.float16)
            if bmt.placement.widened(a):
                torch.testing.assert_close(out, (a.detach().float() @ right.float()).half(), atol=0, rtol=0)
        (a @ b).float().sum().backward()
        self.assertEqual(a.grad.dtype, torch.float16)
        torch.testing.assert_close(a.grad, (torch.ones(2, 8, 4) @ b.float().transpose(1, 2)).half(), atol=1e-3,
                                   rtol=1e-3)


class RunUnchanged(unittest.TestCase):
    @unittest.skipUnless(os.environ.get("ZTRAIN_TEST_WORLD_SIZE", "1") == "1", "starts a job of its own")
    def test_a_script_that_imports_bmtrain(self):
        script = os.path.join(tempfile.mkdtemp(), "train.py")
        with open(script, "w") as f:
            f.write("import torch, bmtrain as bmt\n"
                    "from bmtrain.global_var import config\n"
                    "from bmtrain.nn import Linear\n"
                    "bmt.init_distributed(seed=1)\n"
                    "layer = bmt.Block(Linear(4, 2))\n"
                    "bmt.init_parameters(layer)\n"
                    "assert config is bmt.config and config['initialized'] and bmt.nn.Linear is Linear\n"
                    "x = torch.empty(3, 4, device='cuda').fill_(1).cuda().to('cuda:0')\n"
                    "bmt.print_rank(torch.cuda.memory_summary())\n"
                    "bmt.print_rank('ran', tuple(layer(x).shape), x.device)\n")
        out = subprocess.run([sys.executable, "-m", "ztrain.bmtrain", script], capture_output=True, text=True,
                             timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        # On a rank without a GPU, CUDA placement means the rank's device.
        self.assertIn("ran (3, 2) cpu", out.stdout)
        if not torch.cuda.is_available():
            self.assertIn("this rank runs on the CPU", out.stdout)


def init_distributed():
    """The runtime this file's tests run in (conftest.py calls it under pytest)."""
    bmt.init_distributed(seed=0)


if __name__ == "__main__":
    init_distributed()
    unittest.main()
