"""ztrain.booster.HybridParallelPlugin (ztrain.nn's tensor-parallel linears by policy, then a
ZeRO level over the data-parallel ranks) on a small attention model against single-process
PyTorch: tp = 2 when launched with 2 or more ranks (at 4: tp 2 × dp 2), tp = 1 in one process."""
import os
import tempfile
import unittest

import torch
import torch.nn.functional as F

import ztrain
from ztrain.booster import Booster, HybridParallelPlugin

from test_booster import CLIP, LR, VOCAB, WIDTH, TinyLM, batch, check_params, reference, train

HEADS = 4


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = HEADS
        # No bias on k: its gradient is zero but for rounding (softmax ignores a shift shared by
        # every key), which AdamW would turn into steps of ±lr that no reference reproduces.
        self.q, self.k, self.v, self.o = (torch.nn.Linear(WIDTH, WIDTH, bias=name != "k") for name in "qkvo")

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.fc1, self.fc2 = torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def TinyGPT(seed=0):
    """test_booster's model with attention layers and a head of its own."""
    return TinyLM(seed, layer=Layer, tied=False)


POLICY = {"layers.*.attn.q": "column", "layers.*.attn.k": "column", "layers.*.attn.v": "column",
          "layers.*.attn.o": "row", "layers.*.fc1": "column", "layers.*.fc2": "row"}


def TiedGPT(seed=0):
    """TinyGPT with its head tied to the embedding as Hugging Face's lm_head is: a Linear sharing
    the Embedding's weight."""
    model = TinyGPT(seed)
    model.head.weight = model.embed.weight
    return model


VOCAB_POLICY = {**POLICY, "embed": "vocab", "head": "column_gathered"}


def fewer_heads(model, tp):
    for layer in model.layers:
        layer.attn.heads //= tp


TP = 2 if int(os.environ.get("ZTRAIN_TEST_WORLD_SIZE", "1")) >= 2 else 1


def boosted(zero_stage, policy=POLICY, adapt=fewer_heads, make_model=TinyGPT, wrap=None):
    model = make_model()
    booster = Booster(HybridParallelPlugin(tp_size=TP, zero_stage=zero_stage, tensor_parallel=policy, adapt=adapt,
                                           wrap=wrap), max_grad_norm=CLIP)
    model, optimizer, *_ = booster.boost(model, ztrain.optim.AdamW(model.parameters(), lr=LR))
    return booster, model, optimizer


def check_saved_file(booster, model, name, reload=None):
    """The file booster.save_model writes loads into the plain model (safetensors, no ztrain) and,
    given `reload` (-> a boosted booster and model), into another boosted model; both compute
    what `model` does."""
    path = os.path.join(tempfile.gettempdir(), f"ztrain_py_booster_{name}_{os.getppid()}.safetensors")
    try:
        booster.save_model(model, path)
        loaded = []
        if reload is not None:
            other_booster, other, _ = reload()
            other_booster.load_model(other, path)
            loaded.append(other)
        plain = TinyGPT(seed=1)
        ztrain.synchronize()
        import safetensors.torch
        plain.load_state_dict(safetensors.torch.load_file(path))
        with torch.no_grad():
            want = model(batch(5))
            for m in [plain] + loaded:
                torch.testing.assert_close(m(batch(5)), want, rtol=1e-5, atol=1e-6)
    finally:
        ztrain.synchronize()
        if ztrain.rank() == 0 and os.path.exists(path):
            os.remove(path)


class HybridParallel(unittest.TestCase):
    def test_equals_one_process_at_every_zero_stage(self):
        want_losses, want_params, _ = reference(3, TinyGPT)
        for stage in (0, 1, 3):
            with self.subTest(zero_stage=stage):
                booster, model, optimizer = boosted(stage)
                layer = model.layers[0].module
                self.assertEqual(layer.attn.heads, HEADS // TP)
                self.assertIsInstance(layer.fc1, ztrain.nn.ColumnParallelLinear)
                self.assertIsInstance(layer.attn.o, ztrain.nn.RowParallelLinear)
                self.assertEqual(layer.fc1.out_features_per_partition, 4 * WIDTH // TP)
                losses = train(booster, model, optimizer, 3)
                torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
                check_params(self, model, want_params)

    def test_the_file_holds_full_tensors_and_loads_without_tp(self):
        booster, model, optimizer = boosted(1)
        train(booster, model, optimizer, 2)
        check_saved_file(booster, model, "tp")

    def test_bad_policies_are_named(self):
        with self.assertRaisesRegex(ztrain.Error, "the rule 'layers.\\*.mlp' matches no module"):
            boosted(0, policy={"layers.*.mlp": "column"})
        with self.assertRaisesRegex(ztrain.Error, "'layers.0.ln1' \\(rule 'layers.\\*.ln1'\\) is a LayerNorm"):
            boosted(0, policy={"layers.*.ln1": "column"})
        with self.assertRaisesRegex(ztrain.Error, "'layers.0.fc1' \\(rule 'layers.\\*.fc1'\\) is a Linear; the style "
                                    "'vocab' splits a torch.nn.Embedding"):
            boosted(0, policy={"layers.*.fc1": "vocab"})
        with self.assertRaisesRegex(ztrain.Error, "'embed.weight' \\(rule 'embed'\\) is shared with 'head.weight', "
                                    "which no rule splits"):
            boosted(0, policy={"embed": "vocab"}, make_model=TiedGPT)
        with self.assertRaisesRegex(ztrain.Error, "'embed.weight' \\(rule 'embed'\\) is shared with 'head.weight' "
                                    "\\(rule 'head'\\), which splits it another way"):
            boosted(0, policy={"embed": "vocab", "head": "row"}, make_model=TiedGPT)
        with self.assertRaisesRegex(ztrain.Error, "pp_style must be '1f1b', 'gpipe' or 'interleaved', got 'zbv'"):
            HybridParallelPlugin(tp_size=TP, pp_style="zbv")
        with self.assertRaisesRegex(ztrain.Error, "pp_style='interleaved' takes num_model_chunks >= 2"):
            HybridParallelPlugin(tp_size=TP, pp_style="interleaved")
        with self.assertRaisesRegex(ztrain.Error, "got pp_style='1f1b', num_model_chunks=2"):
            HybridParallelPlugin(tp_size=TP, num_model_chunks=2)
        with self.assertRaisesRegex(ztrain.Error, "the style must be one of column, column_gathered, row, vocab"):
            boosted(0, policy={"layers.*.fc1": "colum"})
        with self.assertRaisesRegex(ztrain.Error, "pp_size=2 but the runtime has 1 pipeline stages"):
            model = TinyGPT()
            Booster(HybridParallelPlugin(tp_size=TP, pp_size=2, tensor_parallel=POLICY)).boost(
                model, ztrain.optim.AdamW(model.parameters()))
        with self.assertRaisesRegex(ztrain.Error, f"tp_size=3 but the runtime's tensor-parallel groups have {TP}"):
            model = TinyGPT()
            Booster(HybridParallelPlugin(tp_size=3, tensor_parallel=POLICY)).boost(
                model, ztrain.optim.AdamW(model.parameters()))


class VocabParallelPolicy(unittest.TestCase):
    """The embedding and the head outside the units split by the policy: slices kept as
    DistributedParameters, a tied head and embedding one slice."""

    def test_tied_embedding_and_head_equal_one_process(self):
        want_losses, want_params, _ = reference(3, TiedGPT)
        del want_params["head.weight"]  # the tied head's weight is the embedding's
        for stage in (0, 1, 3):
            with self.subTest(zero_stage=stage):
                booster, model, optimizer = boosted(stage, VOCAB_POLICY, make_model=TiedGPT)
                self.assertIsInstance(model.embed, ztrain.nn.VocabParallelEmbedding)
                self.assertIsInstance(model.embed.weight, ztrain.DistributedParameter)
                self.assertIs(model.head.weight, model.embed.weight)
                self.assertEqual(tuple(model.embed.weight.full_shape), (VOCAB // TP, WIDTH))
                losses = train(booster, model, optimizer, 3)
                torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
                check_params(self, model, want_params)

    def test_an_embedding_unit_is_split_in_its_block(self):
        want_losses, want_params, _ = reference(3, TinyGPT)
        booster, model, optimizer = boosted(3, {**POLICY, "embed": "vocab"}, wrap=lambda name, module: (
            name == "embed" or isinstance(module, Layer)))
        self.assertIsInstance(model.embed, ztrain.Block)
        self.assertIsInstance(model.embed.module, ztrain.nn.VocabParallelEmbedding)
        torch.testing.assert_close(train(booster, model, optimizer, 3), want_losses, rtol=1e-5, atol=1e-6)
        check_params(self, model, want_params)

    def test_untied_head_equals_one_process_and_the_file_loads_without_tp(self):
        want_losses, want_params, _ = reference(3, TinyGPT)
        booster, model, optimizer = boosted(2, VOCAB_POLICY)
        self.assertIsNot(model.head.weight, model.embed.weight)
        torch.testing.assert_close(train(booster, model, optimizer, 3), want_losses, rtol=1e-5, atol=1e-6)
        check_params(self, model, want_params)
        check_saved_file(booster, model, "vocab", reload=lambda: boosted(3, VOCAB_POLICY))


class VocabParallel(unittest.TestCase):
    """ztrain.nn's vocabulary-parallel embedding, its tied head and the cross entropy over
    vocabulary-parallel logits against torch on the full table."""

    def test_embedding_head_and_loss_equal_the_full_table(self):
        torch.manual_seed(3)
        full = torch.nn.Embedding(12, 5)
        ids = torch.tensor([[0, 5, 6, 11], [3, 7, 1, 9]])
        targets = torch.tensor([6, 11, -100, 0, 2, 8, 5, -100])
        hidden = torch.randn(8, 5)
        table = ztrain.nn.VocabParallelEmbedding.from_embedding(full)
        rank, tp = ztrain._C._group_rank("tp"), ztrain._C._group_size("tp")
        self.assertEqual(tuple(table.weight.shape), (12 // tp, 5))
        self.assertEqual(table.weight.tp_split_dim, 0)

        ref_h = hidden.clone().requires_grad_()
        ref_loss = F.cross_entropy(F.linear(ref_h, full.weight), targets) + full(ids).square().sum()
        ref_loss.backward()
        h = hidden.clone().requires_grad_()
        logits = table.logits(h)
        self.assertEqual(tuple(logits.shape), (8, 12 // tp))
        torch.testing.assert_close(table.logits(h, gather_output=True), F.linear(hidden, full.weight))
        loss = ztrain.nn.vocab_parallel_cross_entropy(logits, targets) + table(ids).square().sum()
        loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        torch.testing.assert_close(h.grad, ref_h.grad)  # summed over the tp ranks' slices
        torch.testing.assert_close(table.weight.grad, full.weight.grad.chunk(tp)[rank])
        rows = ztrain.nn.vocab_parallel_cross_entropy(logits.detach(), targets, reduction="none")
        torch.testing.assert_close(rows, F.cross_entropy(F.linear(hidden, full.weight), targets, reduction="none"))
        with self.assertRaisesRegex(ztrain.Error, "logits of \\(rows, vocabulary slice\\)"):
            ztrain.nn.vocab_parallel_cross_entropy(logits[None], targets)
        if tp > 1:
            with self.assertRaisesRegex(ztrain.Error, "num_embeddings \\(7\\) does not divide by the 2"):
                ztrain.nn.VocabParallelEmbedding(7, 4)


def init_distributed():
    """The runtime this file's tests run in (conftest.py calls it under pytest)."""
    ztrain.init_distributed(seed=0, tp_size=TP)


if __name__ == "__main__":
    init_distributed()
    unittest.main()
