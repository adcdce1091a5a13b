#!/usr/bin/env python3
"""An independent GPT-2 (Hugging Face GPT2LMHeadModel semantics) in PyTorch, for gpt_test.cpp.

    gpt_reference.py loss  FILE TOKENS N_HEAD   prints the mean next-token loss of TOKENS
    gpt_reference.py write FILE SEED VOCAB CONTEXT D N_LAYER   writes random weights

FILE is a safetensors file with Hugging Face's names and layouts (Conv1D weights are (in, out));
TOKENS a text file with one sequence of integers per line. The file is parsed with struct, json
and numpy only (no safetensors package). The model follows transformers' modeling_gpt2.py:
pre-LayerNorm (eps 1e-5), GELU with the tanh approximation ("gelu_new"), causal softmax
attention scaled by 1/sqrt(head_dim), LM head tied to wte. Computed in float64.
"""
import json
import math
import struct
import sys

import numpy as np
import torch

DTYPES = {"F32": np.float32, "F64": np.float64, "BF16": None, "F16": np.float16}


def read(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        if info["dtype"] == "BF16":
            raw = np.frombuffer(data[b:e], dtype=np.uint16).astype(np.uint32) << 16
            arr = raw.view(np.float32)
        else:
            arr = np.frombuffer(data[b:e], dtype=DTYPES[info["dtype"]])
        out[name] = torch.from_numpy(arr.astype(np.float64).reshape(info["shape"]))
    return out


def write(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        raw = t.to(torch.float32).numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def layer_norm(x, w, b):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def loss(weights, tokens, n_head):
    x_ids, y_ids = tokens[:, :-1], tokens[:, 1:]
    t = x_ids.shape[1]
    wte = weights["transformer.wte.weight"]
    h = wte[x_ids] + weights["transformer.wpe.weight"][:t]
    i = 0
    while f"transformer.h.{i}.ln_1.weight" in weights:
        p = lambda n: weights[f"transformer.h.{i}.{n}"]
        a = layer_norm(h, p("ln_1.weight"), p("ln_1.bias")) @ p("attn.c_attn.weight") + p("attn.c_attn.bias")
        q, k, v = a.split(a.shape[-1] // 3, dim=-1)
        split = lambda z: z.view(z.shape[0], t, n_head, -1).transpose(1, 2)
        q, k, v = split(q), split(k), split(v)
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        y = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(h.shape)
        h = h + y @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
        m = gelu_new(layer_norm(h, p("ln_2.weight"), p("ln_2.bias")) @ p("mlp.c_fc.weight") + p("mlp.c_fc.bias"))
        h = h + m @ p("mlp.c_proj.weight") + p("mlp.c_proj.bias")
        i += 1
    h = layer_norm(h, weights["transformer.ln_f.weight"], weights["transformer.ln_f.bias"])
    logits = h @ wte.t()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y_ids.reshape(-1)).item()


def main():
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "loss":
        tokens = torch.tensor([[int(v) for v in line.split()] for line in open(sys.argv[3]) if line.strip()])
        print(f"loss={loss(read(path), tokens, int(sys.argv[4])):.12g}")
    elif mode == "write":
        seed, vocab, ctx, d, n_layer = (int(v) for v in sys.argv[3:8])
        g = torch.Generator().manual_seed(seed)
        r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64) * 0.05
        w = {"transformer.wte.weight": r(vocab, d), "transformer.wpe.weight": r(ctx, d)}
        for i in range(n_layer):
            pre = f"transformer.h.{i}."
            w.update({pre + "ln_1.weight": 1 + r(d), pre + "ln_1.bias": r(d),
                      pre + "attn.c_attn.weight": r(d, 3 * d), pre + "attn.c_attn.bias": r(3 * d),
                      pre + "attn.c_proj.weight": r(d, d), pre + "attn.c_proj.bias": r(d),
                      pre + "ln_2.weight": 1 + r(d), pre + "ln_2.bias": r(d),
                      pre + "mlp.c_fc.weight": r(d, 4 * d), pre + "mlp.c_fc.bias": r(4 * d),
                      pre + "mlp.c_proj.weight": r(4 * d, d), pre + "mlp.c_proj.bias": r(d)})
        w.update({"transformer.ln_f.weight": 1 + r(d), "transformer.ln_f.bias": r(d)})
        write(path, w)
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
