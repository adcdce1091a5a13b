#!/usr/bin/env python3
"""Hugging Face transformers against ztrain-gpt, both ways (hf_interop_test.sh).

    hf_interop.py logits MODEL_DIR TEXT ZTRAIN_LOGITS
        loads a directory ztrain-gpt train wrote with GPT2LMHeadModel.from_pretrained and prints
        the largest difference between its logits of TEXT's first window and ztrain's (a
        safetensors file of `ztrain-gpt score --logits`), relative to the largest logit
    hf_interop.py make MODEL_DIR TEXT
        writes a random GPT2LMHeadModel with save_pretrained and prints its loss on TEXT, windowed
        as `ztrain-gpt score` windows it
    hf_interop.py tokenized MODEL_DIR TEXT
        loads a directory ztrain-gpt train wrote with a BPE tokenizer through AutoTokenizer and
        GPT2LMHeadModel and prints its loss on TEXT's tokens, windowed as `ztrain-gpt score` does
"""
import math
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel


def byte_tokens(path):
    with open(path, "rb") as f:
        return torch.tensor(list(f.read()), dtype=torch.long)


def logits(model_dir, text, ztrain_logits):
    model = GPT2LMHeadModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    tokens = byte_tokens(text)
    first = tokens[: model.config.n_positions].unsqueeze(0)
    with torch.no_grad():
        theirs = model(first).logits
    ours = load_file(ztrain_logits)["logits"]
    assert ours.shape == theirs.shape, f"ztrain's logits are {tuple(ours.shape)}, transformers' {tuple(theirs.shape)}"
    print(f"{((ours - theirs).abs().max() / theirs.abs().max()).item():.3e}")


def make(model_dir, text):
    torch.manual_seed(5)
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).eval()
    model.save_pretrained(model_dir, safe_serialization=True)
    print(f"{windowed_loss(model, byte_tokens(text)):.10f}")


def tokenized(model_dir, text):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = GPT2LMHeadModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with open(text, encoding="utf-8") as f:
        tokens = torch.tensor(tokenizer(f.read())["input_ids"], dtype=torch.long)
    print(f"{windowed_loss(model, tokens):.10f}")


def windowed_loss(model, tokens):
    """Mean next-token loss over windows of n_positions + 1 tokens overlapping by one."""
    window, total, count = model.config.n_positions, 0.0, 0
    with torch.no_grad():
        for begin in range(0, len(tokens) - 1, window):
            chunk = tokens[begin : begin + window + 1].unsqueeze(0)
            out = model(chunk[:, :-1], labels=None).logits
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.size(-1)).double(), chunk[0, 1:])
            total += loss.item() * (chunk.size(1) - 1)
            count += chunk.size(1) - 1
    assert math.isfinite(total)
    return total / count


if __name__ == "__main__":
    {"logits": logits, "make": make, "tokenized": tokenized}[sys.argv[1]](*sys.argv[2:])
