#!/usr/bin/env python3
"""ztrain-gpt's tokenizers against the libraries that define them (tokenizer_test.sh).

    tokenizer_check.py ZTRAIN_GPT WORKDIR TEXT...

Byte-level BPE files made by Hugging Face `tokenizers` in the layouts real models use (GPT-2's
ByteLevel pre-tokenizer, with and without a prefix space; Llama 3's Split expression before a
ByteLevel step, ignore_merges and a BOS template), and one made by `ztrain-gpt tokenizer train`:
every TEXT encodes to the same ids as `tokenizers` gives, decoding them gives the same text, and
so do 300 random id sequences (invalid UTF-8 included). SentencePiece models made by `ztrain-gpt
tokenizer train` encode and decode as the `sentencepiece` library does. Prints one line per
tokenizer and text, and exits non-zero on the first mismatch.
"""
import json
import random
import subprocess
import sys
from pathlib import Path

import sentencepiece as spm
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def hf_tokenizers(corpus, work):
    """tokenizer.json files in three layouts, trained by `tokenizers` on the corpus."""
    made = {}
    for name, prefix_space in (("gpt2", False), ("gpt2_prefix_space", True)):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        tok.train([str(corpus)], trainers.BpeTrainer(vocab_size=1500, special_tokens=["<|endoftext|>"], show_progress=False,
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        made[name] = work / f"{name}.json"
        tok.save(str(made[name]))
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train([str(corpus)], trainers.BpeTrainer(vocab_size=1500, special_tokens=["<|begin_of_text|>", "<|eot_id|>"], show_progress=False,
                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", 0)])
    made["llama3"] = work / "llama3.json"
    tok.save(str(made["llama3"]))
    return made


def run(gpt, *args):
    return subprocess.run([gpt, *args], check=True, capture_output=True, text=True).stdout


def ours_encode(gpt, tokenizer, text_path, work):
    out = work / "ids.json"
    run(gpt, "tokenizer", "encode", "--tokenizer", str(tokenizer), "--input", str(text_path), "--output", str(out))
    return json.loads(out.read_text())


def ours_decode(gpt, tokenizer, id_lists, work):
    src, out = work / "decode_in.json", work / "decode_out.json"
    src.write_text(json.dumps(id_lists))
    run(gpt, "tokenizer", "decode", "--tokenizer", str(tokenizer), "--input", str(src), "--output", str(out))
    return json.loads(out.read_text())


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check(name, text_path, ref_ids, ids, ref_decode, decode, show):
    at = first_difference(ref_ids, ids)
    if at is not None:
        sys.exit(f"{name} on {text_path.name}: ids differ first at {at} of {len(ref_ids)}: reference "
                 f"{[show(i) for i in ref_ids[max(0, at - 3):at + 4]]}, ztrain {[show(i) for i in ids[max(0, at - 3):at + 4]]}")
    rng = random.Random(0)
    vocab = len(set(ref_ids)) and max(ref_ids) + 1
    samples = [ref_ids] + [[rng.randrange(vocab) for _ in range(rng.randrange(1, 12))] for _ in range(300)]
    got = decode(samples)
    wrong = [i for i, (s, g) in enumerate(zip(samples, got)) if ref_decode(s) != g]
    if wrong or len(got) != len(samples):
        i = wrong[0] if wrong else len(got)
        sys.exit(f"{name} on {text_path.name}: decode of {samples[i][:20]} differs: reference {ref_decode(samples[i])!r}, "
                 f"ztrain {got[i] if i < len(got) else None!r}")
    print(f"{name:>22} {text_path.name:>24}: {len(ids):7d} ids equal, {len(samples)} decodes equal")


def main(gpt, work, *texts):
    work = Path(work)
    texts = [Path(t) for t in texts]
    corpus = texts[0]
    files = hf_tokenizers(corpus, work)
    files["ztrain_bpe"] = work / "ztrain_bpe.json"
    run(gpt, "tokenizer", "train", "--data", str(corpus), "--vocab-size", "1500", "--out", str(files["ztrain_bpe"]))
    for name, path in files.items():
        tok = Tokenizer.from_file(str(path))
        for text_path in texts:
            text = text_path.read_bytes().decode("utf-8")
            check(name, text_path, tok.encode(text).ids, ours_encode(gpt, path, text_path, work),
                  tok.decode, lambda ids: ours_decode(gpt, path, ids, work), tok.id_to_token)
    for kind in ("sentencepiece-unigram", "sentencepiece-bpe"):
        path = work / f"{kind}.model"
        run(gpt, "tokenizer", "train", "--kind", kind, "--data", str(corpus), "--vocab-size", "1000", "--out", str(path))
        sp = spm.SentencePieceProcessor(model_file=str(path))
        for text_path in texts:
            text = text_path.read_bytes().decode("utf-8")
            ref = sp.encode(text)
            if sp.decode(ref) != text:
                sys.exit(f"{kind}: sentencepiece does not give {text_path.name} back (the model loses bytes)")
            check(kind, text_path, ref, ours_encode(gpt, path, text_path, work), sp.decode,
                  lambda ids: ours_decode(gpt, path, ids, work), sp.id_to_piece)
    print("tokenizers: 0 mismatches")


if __name__ == "__main__":
    main(*sys.argv[1:])
