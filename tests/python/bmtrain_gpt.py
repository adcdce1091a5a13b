"""What the BMTrain-style GPT tests share: the layer norm as BMTrain's example writes it, the
model as plain PyTorch over a dict of full tensors (the reference both tests train against), and
the save/load round trip."""
import math
import os
import tempfile

import torch
import torch.nn.functional as F

import ztrain.bmtrain as bmt


class Layernorm(bmt.DistributedModule):
    def __init__(self, dim):
        super().__init__()
        self.weight = bmt.DistributedParameter(torch.empty(dim), init_method=torch.nn.init.ones_)
        self.bias = bmt.DistributedParameter(torch.empty(dim), init_method=torch.nn.init.zeros_)

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias)


def reference_forward(p, ids, pos, mask, layers, heads, dim_head):
    """The GPT (learnt positions, pre-norm blocks of attention and a ReLU feed-forward, the word
    embedding tied to the output head) on a plain dict of full tensors."""
    dim = p["word_emb.weight"].shape[1]

    def ln(x, name):
        return F.layer_norm(x, (dim,), p[name + ".weight"], p[name + ".bias"])

    def linear(x, name):
        return F.linear(x, p[name + ".weight"], p[name + ".bias"])

    h = F.embedding(pos, p["pos_emb.weight"]) + F.embedding(ids, p["word_emb.weight"])
    b, s, _ = h.shape
    for i in range(layers):
        at = f"transformers.{i}."
        x = ln(h, at + "ln_attn")
        q, k, v = (linear(x, at + "attn.project_" + n).view(b, s, heads, dim_head).transpose(1, 2) for n in "qkv")
        score = (torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(dim_head)).masked_fill(~mask[:, None], float("-inf"))
        h = h + linear(torch.matmul(score.softmax(-1), v).transpose(1, 2).reshape(b, s, -1), at + "attn.project_out")
        h = h + linear(torch.relu(linear(ln(h, at + "ln_ff"), at + "w_in")), at + "w_out")
    return F.linear(ln(h, "layernorm"), p["word_emb.weight"])


def check_save_and_load(test, model, state, make_model, name):
    """bmt.save writes `state` (full tensors), bmt.load reads it into a fresh model, which it
    returns. The ranks are children of one launcher: its pid names the file they share."""
    path = os.path.join(tempfile.gettempdir(), f"ztrain_py_{name}_{os.getppid()}.pt")
    bmt.save(model, path)
    saved = torch.load(path, weights_only=True)
    test.assertEqual(sorted(saved), sorted(state))
    for key, value in state.items():
        torch.testing.assert_close(saved[key], value, atol=0, rtol=0, msg=key)
    fresh = make_model()
    bmt.load(fresh, path)
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, state[key], atol=0, rtol=0, msg=key)
    bmt.synchronize()
    if bmt.rank() == 0:
        os.remove(path)
    return fresh, saved
