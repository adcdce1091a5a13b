#!/usr/bin/env python3
"""Model files between the Python package and ztrain-gpt, both ways (gpt_file_test.sh): Hugging
Face's GPT2LMHeadModel, unchanged, trained from Python under the Booster (FullyShardPlugin: each
transformer block a level-3 Block), its file ztrain.save writes at any world size.

    gpt_file.py save MODEL TEXT PY_LOGITS
        trains the model 3 steps on TEXT's bytes, writes MODEL with ztrain-gpt's config in its
        metadata, and (rank 0) the logits of TEXT's first window to PY_LOGITS
    gpt_file.py load MODEL TEXT ZTRAIN_LOGITS
        loads a file ztrain-gpt train wrote into the boosted model (other weights first) and prints
        the largest difference between its logits of TEXT's first window and ztrain-gpt's,
        relative to the largest logit
    gpt_file.py compare A B
        the same difference between two logits files
"""
import json
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

import ztrain
from ztrain.booster import Booster, FullyShardPlugin

CONFIG = dict(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2)
ZTRAIN_GPT_CONFIG = {"context": 64, "d_model": 64, "dropout": 0.0, "dtype": "fp32", "layer_norm_eps": 1e-5,
                     "n_head": 2, "n_layer": 2, "tokenizer": "bytes", "vocab_size": 256}


def boosted(seed):
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**CONFIG, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    booster = Booster(FullyShardPlugin(), max_grad_norm=1.0)
    model, optimizer, *_ = booster.boost(model, ztrain.optim.AdamW(model.parameters(), lr=1e-3))
    return booster, model.eval(), optimizer


def text_bytes(path):
    with open(path, "rb") as f:
        return torch.tensor(list(f.read()), dtype=torch.long)


def first_window_logits(model, text):
    with torch.no_grad():
        return model(text_bytes(text)[:CONFIG["n_positions"]].unsqueeze(0)).logits


def relative_difference(ours, theirs):
    assert ours.shape == theirs.shape, f"logits of {tuple(ours.shape)} and {tuple(theirs.shape)}"
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def save(model_path, text, py_logits):
    booster, model, optimizer = boosted(seed=1)
    tokens = text_bytes(text)
    index, count = ztrain.data_parallel()
    for step in range(3):
        window = tokens[(step * count + index) * 33:][:33].unsqueeze(0)
        optimizer.zero_grad()
        booster.backward(model(window, labels=window).loss, optimizer)
        optimizer.step()
    ztrain.save(model, model_path, metadata={"ztrain_gpt_config": json.dumps(ZTRAIN_GPT_CONFIG)})
    logits = first_window_logits(model, text)
    if ztrain.rank() == 0:
        save_file({"logits": logits.contiguous()}, py_logits)


def load(model_path, text, ztrain_logits):
    booster, model, _ = boosted(seed=2)
    booster.load_model(model, model_path)
    diff = relative_difference(first_window_logits(model, text), load_file(ztrain_logits)["logits"])
    ztrain.print_rank(f"{diff:.3e}")


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "compare":
        print(f"{relative_difference(load_file(args[0])['logits'], load_file(args[1])['logits']):.3e}")
    else:
        ztrain.init_distributed(seed=0)
        {"save": save, "load": load}[mode](*args)
