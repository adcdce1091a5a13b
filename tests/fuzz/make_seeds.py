#!/usr/bin/env python3
"""Writes the seed inputs of the fuzz targets into tests/fuzz/corpus/<target>/seed-*.

    .venv/bin/python tests/fuzz/make_seeds.py

Valid inputs of every kind each reader accepts, small so that the fuzzers mutate them quickly:
safetensors files (several dtypes, metadata, an empty tensor), checkpoint manifests matching the
fixed files fuzz_manifest.cpp writes (version 2 with its own SHA-256, and version 1), pipeline
boundary headers, ztrain-gpt and Hugging Face model configurations, and tokenizer.json files in
the GPT-2 and Llama 3 layouts (made with the `tokenizers` library, a test reference only).
Inputs that once failed are kept beside the seeds as crash-*, and stay.
"""
import hashlib
import json
import struct
import tempfile
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = Path(__file__).resolve().parent / "corpus"


def put(target, name, data):
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / f"seed-{name}").write_bytes(data if isinstance(data, bytes) else data.encode())


def safetensors(tensors, metadata=None):
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def compact(j):
    """As nlohmann::json::dump() writes it: no spaces, keys sorted."""
    return json.dumps(j, separators=(",", ":"), sort_keys=True)


def manifest(version):
    files = {name: hashlib.sha256(f"fuzz {name}".encode()).hexdigest()
             for name in ("model.safetensors", "optimizer.safetensors", "rng.safetensors")}
    m = {"format": "ztrain-checkpoint", "step": 4, "world": {"size": 2, "dp": 2, "tp": 1, "pp": 1},
         "extra": {"config": {"vocab_size": 256, "context": 64, "d_model": 64, "n_layer": 2, "n_head": 2,
                              "dropout": 0.0, "layer_norm_eps": 1e-05, "dtype": "fp32", "tokenizer": "bytes"}},
         "optim_manager": {"steps": 4, "skipped": 0, "schedulers": [{"kind": "cosine", "step": 4}]},
         "files": files}
    if version >= 2:
        m["version"] = version
        m["manifest_sha256"] = hashlib.sha256(compact(m).encode()).hexdigest()
    return json.dumps(m, indent=2, sort_keys=True)


def boundary(tensors, message_id=7):
    h = [0x7A50495045, message_id, len(tensors)]
    for defined, dtype, requires_grad, shape in tensors:
        h += [defined, dtype, requires_grad, len(shape), *shape]
    return struct.pack(f"<{len(h)}q", *h)


def tokenizers_json(work):
    text = work / "text.txt"
    text.write_text("Hello, world! The quick brown fox jumps over the lazy dog. " * 20 +
                    "Ünïcode: naïve café, 東京, 😀 emoji.\n\tTabs and  spaces 123 4567.\n" * 10)
    out = {}
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train([str(text)], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out["gpt2"] = tok.to_str()
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=Regex(r"(?i:'s|'t)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                                           r"|\s*[\r\n]+|\s+(?!\S)|\s+"), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train([str(text)], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|begin_of_text|>"], show_progress=False,
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", 0)])
    out["llama3"] = tok.to_str()
    return out


def main():
    f32 = struct.pack("<6f", *range(6))
    put("safetensors", "tensors", safetensors({"fc.weight": ("F32", [2, 3], f32), "fc.bias": ("BF16", [2], b"\x80\x3f" * 2),
                                               "step": ("I64", [], struct.pack("<q", 3)),
                                               "empty": ("F16", [0, 4], b"")}, {"format": "pt", "note": "seed"}))
    put("safetensors", "empty", safetensors({}))
    put("manifest", "v2", manifest(2))
    put("manifest", "v1", manifest(1))
    put("boundary", "two", boundary([(1, 6, 1, [2, 3, 4]), (0, 6, 0, [])]))
    put("boundary", "ints", boundary([(1, 4, 0, [5]), (1, 15, 1, [1, 1, 8]), (1, 11, 0, [0])]))
    config = {"vocab_size": 256, "context": 64, "d_model": 64, "n_layer": 2, "n_head": 2, "dropout": 0.0,
              "layer_norm_eps": 1e-05, "dtype": "bf16", "tokenizer": "tokenizer.json"}
    put("gpt_config", "ztrain", json.dumps(config))
    put("gpt_config", "hf", json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 50257,
                                        "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
                                        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-05,
                                        "tie_word_embeddings": True, "torch_dtype": "float32"}))
    with tempfile.TemporaryDirectory() as work:
        for name, text in tokenizers_json(Path(work)).items():
            put("tokenizer", name, text)


if __name__ == "__main__":
    main()
