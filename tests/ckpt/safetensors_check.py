#!/usr/bin/env python3
"""An independent safetensors reader and writer (struct + json + numpy) for the interop tests.

  safetensors_check.py write FILE   writes the reference tensors to FILE, laid out the way
                                    Hugging Face's writer does it (data sorted by alignment, then
                                    name), for ztrain's reader to check (SafetensorsInterop test).
  safetensors_check.py check FILE   parses FILE, which ztrain's writer wrote from the same
                                    reference tensors, validates the layout (8-byte aligned data
                                    section, tensors packed back to back in header order, sizes)
                                    and compares every tensor and the metadata bit for bit.
  safetensors_check.py dump FILE    prints the header and the first elements of every tensor.

The reference tensors below are mirrored in tests/ckpt/safetensors_test.cpp (kInteropTensors):
change both together. Exits 1 with a message on the first mismatch.
"""
import json
import os
import struct
import sys

import numpy as np

# name, dtype, shape
TENSORS = [
    ("f64", "F64", [3, 5]),
    ("f32", "F32", [17]),
    ("f16", "F16", [2, 3, 4]),
    ("bf16", "BF16", [1023]),
    ("i64", "I64", [4, 4]),
    ("i32", "I32", [7]),
    ("i16", "I16", [3, 1]),
    ("i8", "I8", [9]),
    ("u8", "U8", [2, 5]),
    ("bool", "BOOL", [11]),
    ("scalar", "F32", []),
    ("empty", "F32", [0]),
    ("empty_3d", "I64", [2, 0, 3]),
    ("i64_extremes", "I64", [4]),
    ("f32_special", "F32", [6]),
    ("h.0.attn.c_attn.weight", "F32", [2, 3]),
    ("unicode.名前", "I32", [2]),
]

# Metadata each writer puts in its file.
METADATA = {"cpp": {"format": "pt", "writer": "ztrain", "step": "42"},
            "python": {"format": "pt", "writer": "numpy", "step": "7"}}

# BF16 has no numpy dtype: it is stored as the upper 16 bits of a float32.
NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4",
         "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "u1"}
ITEMSIZE = {k: np.dtype(v).itemsize for k, v in NUMPY.items()}


def fail(msg):
    print("FAIL: " + msg, file=sys.stderr)
    sys.exit(1)


def expected(name, dtype, shape):
    """The reference values as a numpy array in the file's storage dtype (NUMPY[dtype])."""
    n = int(np.prod(shape, dtype=np.int64))
    if name == "i64_extremes":
        v = np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max, 0, -1], dtype=np.int64)
    elif name == "f32_special":
        v = np.array([np.inf, -np.inf, -0.0, 2.0 ** -140, np.finfo(np.float32).max, np.nan], dtype=np.float32)
    else:
        k = np.arange(n, dtype=np.int64)
        if dtype[0] == "F" or dtype == "BF16":
            v = ((k % 50) - 17).astype(np.float64) * 0.5  # exact in every float dtype
        elif dtype == "U8":
            v = (k * 37) % 251
        elif dtype == "BOOL":
            v = (k % 3 == 0).astype(np.uint8)
        else:
            v = (k * 37) % 251 - 125
    assert v.size == n, name
    if dtype == "BF16":
        bits = v.astype(np.float32).view(np.uint32)
        assert np.all(bits & 0xFFFF == 0), "BF16 reference values must be exact"
        return (bits >> 16).astype("<u2").reshape(shape)
    return v.astype(NUMPY[dtype]).reshape(shape)


def write(path):
    # Hugging Face's layout: data sorted by alignment (largest item first), then by name; the
    # header keys sorted by name, so header order and data order differ.
    order = sorted(TENSORS, key=lambda t: (-ITEMSIZE[t[1]], t[0]))
    header, blobs, offset = {"__metadata__": METADATA["python"]}, [], 0
    for name, dtype, shape in order:
        data = expected(name, dtype, shape).tobytes()
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, sort_keys=True, ensure_ascii=False).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)
    print("wrote %s: %d tensors, %d data bytes" % (path, len(order), offset))


def parse(path):
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        fail("%s: %d bytes, shorter than the header length" % (path, len(raw)))
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        fail("%s: header length %d runs past the end of the file (%d bytes)" % (path, n, len(raw)))
    text = raw[8:8 + n].decode("utf-8")
    if not text.startswith("{"):
        fail("%s: the header does not start with '{'" % path)
    if text.rstrip(" ") != text.rstrip():
        fail("%s: the header is padded with something other than spaces" % path)
    header = json.loads(text, object_pairs_hook=lambda pairs: pairs)  # keep the order, see duplicates
    return raw, n, header


def check(path):
    raw, n, pairs = parse(path)
    names = [k for k, _ in pairs]
    if len(set(names)) != len(names):
        fail("%s: a key appears twice in the header" % path)
    data_start = 8 + n
    if data_start % 8 != 0:
        fail("%s: the data section starts at byte %d, not a multiple of 8" % (path, data_start))
    data = raw[data_start:]
    header = dict(pairs)
    metadata = dict(header.pop("__metadata__", []))
    if metadata != METADATA["cpp"]:
        fail("%s: metadata %r, expected %r" % (path, metadata, METADATA["cpp"]))

    entries = [(k, dict(v)) for k, v in pairs if k != "__metadata__"]
    want = [t[0] for t in TENSORS]
    if [k for k, _ in entries] != want:
        fail("%s: header lists %r, expected %r in that order" % (path, [k for k, _ in entries], want))
    offset = 0
    for (name, dtype, shape), (_, e) in zip(TENSORS, entries):
        if e["dtype"] != dtype or e["shape"] != shape:
            fail("%s: %s is %s %r, expected %s %r" % (path, name, e["dtype"], e["shape"], dtype, shape))
        begin, end = e["data_offsets"]
        size = int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[dtype]
        if begin != offset or end != begin + size:
            fail("%s: %s has data_offsets [%d, %d], expected [%d, %d] (packed in header order)"
                 % (path, name, begin, end, offset, offset + size))
        got = np.frombuffer(data[begin:end], dtype=NUMPY[dtype]).reshape(shape)
        ref = expected(name, dtype, shape)
        if got.tobytes() != ref.tobytes():
            bits = "<u%d" % ITEMSIZE[dtype]  # compare bit patterns: NaN, -0.0
            i = int(np.flatnonzero(got.reshape(-1).view(bits) != ref.reshape(-1).view(bits))[0])
            fail("%s: %s differs at element %d: %r, expected %r"
                 % (path, name, i, got.reshape(-1)[i], ref.reshape(-1)[i]))
        print("ok %-24s %-4s %-10s %s" % (name, dtype, shape, got.reshape(-1)[:4]))
        offset = end
    if offset != len(data):
        fail("%s: the data section holds %d bytes, the tensors %d" % (path, len(data), offset))
    print("%s: %d tensors and the metadata match" % (path, len(entries)))


def dump(path):
    raw, n, pairs = parse(path)
    for k, v in pairs:
        print(k, dict(v))


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("write", "check", "dump"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    {"write": write, "check": check, "dump": dump}[sys.argv[1]](sys.argv[2])


if __name__ == "__main__":
    main()
