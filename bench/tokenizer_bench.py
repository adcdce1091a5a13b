#!/usr/bin/env python3
"""Tokenizer throughput: ztrain-gpt's tokenizers beside the libraries that define the formats, on
the same files in one run, printed as a Markdown table.

    .venv/bin/python bench/tokenizer_bench.py [--ztrain-gpt build/apps/ztrain-gpt/ztrain-gpt]
        [--corpus data/tinyshakespeare.txt] [--vocab-size 4096] [--repeat 3]

For each tokenizer, learnt from the corpus: its training time (in-process, file reading included),
and the MB/s of encoding the corpus
as one text (the best of --repeat), by ztrain-gpt (`tokenizer encode`, which times the encode
alone, one thread) and by the library (`tokenizers` / `sentencepiece`, one call on one string;
`tokenizers` also as encode_batch over the corpus' lines, which uses every core). The ids are
checked equal, so the figures compare the same work.
"""
import argparse
import json
import os
import platform
import re
import subprocess
import tempfile
import time
from pathlib import Path

import sentencepiece as spm
import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent


def cpu_name():
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def ztrain(gpt, *args):
    return subprocess.run([gpt, *args], check=True, capture_output=True, text=True).stdout


def train_seconds(output):
    """The training time `ztrain-gpt tokenizer train` reports (the process's start left out)."""
    return float(re.search(r"in ([0-9.e+-]+) s", output).group(1))


def ztrain_encode(gpt, tokenizer, corpus, out, repeat):
    best = 0.0
    for _ in range(repeat):
        line = ztrain(gpt, "tokenizer", "encode", "--tokenizer", str(tokenizer), "--input", str(corpus), "--output", str(out))
        best = max(best, float(re.search(r"MB/s=([0-9.e+-]+)", line).group(1)))
    return best, json.loads(Path(out).read_text())


def best_rate(fn, nbytes, repeat):
    best = 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = max(best, nbytes / 1e6 / (time.perf_counter() - t0))
    return best, result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ztrain-gpt", default=str(ROOT / "build/apps/ztrain-gpt/ztrain-gpt"))
    p.add_argument("--corpus", default=str(ROOT / "data/tinyshakespeare.txt"))
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    corpus = Path(a.corpus)
    text = corpus.read_bytes().decode("utf-8")
    nbytes = len(text.encode("utf-8"))
    lines = text.splitlines(keepends=True)
    work = Path(tempfile.mkdtemp(prefix="tokenizer_bench_"))
    rows = []

    # Byte-level BPE, GPT-2 layout: learnt by tokenizers and by ztrain-gpt; each file encoded by both.
    t0 = time.perf_counter()
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.post_processor = processors.ByteLevel(trim_offsets=False)
    hf.train([str(corpus)], trainers.BpeTrainer(vocab_size=a.vocab_size, special_tokens=["<|endoftext|>"],
                                                show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_train_s = time.perf_counter() - t0
    hf.save(str(work / "hf.json"))
    z_train_s = train_seconds(ztrain(a.ztrain_gpt, "tokenizer", "train", "--data", str(corpus), "--vocab-size",
                                     str(a.vocab_size), "--out", str(work / "ztrain.json")))
    for name, path, train_s in (("BPE learnt by tokenizers", work / "hf.json", hf_train_s),
                                ("BPE learnt by ztrain-gpt", work / "ztrain.json", z_train_s)):
        tok = Tokenizer.from_file(str(path))
        ours, ids = ztrain_encode(a.ztrain_gpt, path, corpus, work / "ids.json", a.repeat)
        single, ref = best_rate(lambda: tok.encode(text).ids, nbytes, a.repeat)
        batch, enc = best_rate(lambda: tok.encode_batch(lines), nbytes, a.repeat)
        batch_ids = [i for e in enc for i in e.ids]
        assert ids == ref, f"{name}: ztrain's ids differ from tokenizers'"
        rows.append((name, len(Tokenizer.from_file(str(path)).get_vocab()), train_s, len(ids), ours, single,
                     f"{batch:.1f} ({len(batch_ids)} ids)"))

    # SentencePiece, learnt by libsentencepiece through ztrain-gpt; encoded by it and by the Python package.
    for kind in ("sentencepiece-unigram", "sentencepiece-bpe"):
        path = work / f"{kind}.model"
        train_s = train_seconds(ztrain(a.ztrain_gpt, "tokenizer", "train", "--kind", kind, "--data", str(corpus),
                                       "--vocab-size", str(a.vocab_size), "--out", str(path)))
        sp = spm.SentencePieceProcessor(model_file=str(path))
        ours, ids = ztrain_encode(a.ztrain_gpt, path, corpus, work / "ids.json", a.repeat)
        single, ref = best_rate(lambda: sp.encode(text), nbytes, a.repeat)
        assert ids == ref, f"{kind}: ztrain's ids differ from sentencepiece's"
        rows.append((f"SentencePiece {kind.split('-')[1]}", sp.get_piece_size(), train_s, len(ids), ours, single, "—"))

    print(f"{corpus.name}, {nbytes / 1e6:.2f} MB; {cpu_name()}, {os.cpu_count()} cores; tokenizers "
          f"{tokenizers.__version__}, sentencepiece {spm.__version__} (Python), libsentencepiece (Debian) in ztrain-gpt\n")
    print("| tokenizer | vocabulary | learnt in (s) | ids | ztrain-gpt MB/s (1 thread) | library MB/s (one string) "
          "| library MB/s (encode_batch of lines, all cores) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, vocab, train_s, n, ours, single, batch in rows:
        print(f"| {name} | {vocab} | {train_s:.2f} | {n} | {ours:.1f} | {single:.1f} | {batch} |")


if __name__ == "__main__":
    main()
