"""Hostile and damaged safetensors files for the fuzz tests (tests/files/test_header_fuzz.py, tests/files/test_file_fuzz.py).

Three kinds, all deterministic from a seed:
- hand-made headers (`HOSTILE_HEADERS`): what safetensors' own validation refuses, one rule each;
- byte mutations of a real file's header (`header_mutations`): mostly refused by read_header;
- structural mutations (`structural_mutations`): a real file's tensors and metadata changed (a dtype, a shape, a
  key, a `.comfy_quant` record, a metadata value, NaN in a weight) and written back as a *valid* safetensors file,
  so the mutation gets past read_header and reaches the readers behind it (arch detection, the formats, the load
  stage, the LoRA reader).
`HOSTILE_RECORDS` are `.comfy_quant` record bytes of the wrong kind; `claim_file` makes a sparse file whose
header claims a huge tensor (nothing of it on disk).
"""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U8": 8, "BOOL": 8,
        "F8_E4M3": 8, "F8_E5M2": 8}


def write_raw(path: Path, header: dict | bytes, data: bytes = b"", length: int | None = None) -> Path:
    """A file of an 8-byte length (the header's own unless `length`), the header bytes (JSON of a dict), `data`."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@dataclass(frozen=True)
class Entry:
    """One tensor as stored: safetensors dtype name, shape, raw bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


def read_entries(path: Path) -> tuple[dict[str, Entry], dict[str, str]]:
    """A (valid) file's tensors as raw entries, and its metadata."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    metadata = header.pop("__metadata__", {})
    data = raw[8 + n:]
    return {k: Entry(v["dtype"], tuple(v["shape"]), data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items()}, metadata


def write_entries(path: Path, entries: dict[str, Entry], metadata: dict[str, str] | None = None) -> Path:
    """A valid safetensors file of `entries` (contiguous, in order), whatever their contents mean."""
    header: dict[str, Any] = {}
    offset = 0
    for key, e in entries.items():
        header[key] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + len(e.data)]}
        offset += len(e.data)
    if metadata is not None:
        header["__metadata__"] = metadata
    return write_raw(path, header, b"".join(e.data for e in entries.values()))


def claim_file(path: Path, key: str, shape: tuple[int, ...], dtype: str = "F32",
               metadata: dict[str, str] | None = None, others: dict[str, Entry] | None = None) -> Path:
    """A sparse file whose valid header claims `key` of `shape` (e.g. 1 GiB): the data section is a hole, so the
    file costs no disk, and any reader that allocates or reads by the claim shows in its memory."""
    entries = dict(others or {})
    header: dict[str, Any] = {}
    offset = 0
    for k, e in entries.items():
        header[k] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + len(e.data)]}
        offset += len(e.data)
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * BITS[dtype] // 8
    header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(e.data for e in entries.values()))
        f.truncate(8 + len(raw) + offset + nbytes)
    return path


F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
# name -> (header, data, length override): each breaks one of safetensors' rules.
HOSTILE_HEADERS: dict[str, tuple[dict | bytes, bytes, int | None]] = {
    "header longer than safetensors' limit": ({"x": F32}, bytes(8), 200_000_000),
    "header length past the file": ({"x": F32}, bytes(8), 4096),
    "header length of 2**64 - 1": ({"x": F32}, bytes(8), 2**64 - 1),
    "not UTF-8": (b'{"x\xff": 1}', b"", None),
    "not an object": (b'[1, 2, 3]       ', b"", None),
    "deeply nested": (b"{" + b'"a":[' * 5000 + b"]" * 5000 + b"}", b"", None),
    "duplicate key": (b'{"x": ' + json.dumps(F32).encode() + b', "x": ' + json.dumps(F32).encode() + b'}', bytes(8), None),
    "entry not an object": ({"x": 5}, b"", None),
    "entry without offsets": ({"x": {"dtype": "F32", "shape": [2]}}, bytes(8), None),
    "unknown dtype": ({"x": {**F32, "dtype": "F128"}}, bytes(8), None),
    "negative shape": ({"x": {**F32, "shape": [-2]}}, bytes(8), None),
    "float shape": ({"x": {**F32, "shape": [2.0]}}, bytes(8), None),
    "bool shape": ({"x": {**F32, "shape": [True, True]}}, bytes(8), None),
    "huge shape": ({"x": {**F32, "shape": [2**40, 2**40]}}, bytes(8), None),
    "dims past int64 with a zero": ({"x": {**F32, "shape": [2**64, 0], "data_offsets": [0, 0]}}, b"", None),
    "product past int64 with a zero": ({"x": {**F32, "shape": [2**40, 2**40, 0], "data_offsets": [0, 0]}}, b"", None),
    "offsets not matching the shape": ({"x": {**F32, "shape": [3]}}, bytes(8), None),
    "offsets reversed": ({"x": {**F32, "data_offsets": [8, 0]}}, bytes(8), None),
    "offsets past the data": ({"x": {**F32, "data_offsets": [8, 16]}}, bytes(8), None),
    "offsets past 2**64": ({"x": {**F32, "data_offsets": [2**64, 2**64 + 8]}}, bytes(8), None),
    "overlapping": ({"x": F32, "y": F32}, bytes(16), None),
    "gap": ({"x": F32, "y": {**F32, "data_offsets": [12, 20]}}, bytes(20), None),
    "trailing bytes": ({"x": F32}, bytes(12), None),
    "metadata not strings": ({"__metadata__": {"n": 3}, "x": F32}, bytes(8), None),
    "metadata not an object": ({"__metadata__": [1], "x": F32}, bytes(8), None),
    "F4 of an odd count": ({"x": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}}, bytes(1), None),
}


def header_mutations(header: bytes, rng: random.Random, count: int) -> Iterator[bytes]:
    """`count` mutations of a header's bytes: a byte replaced, dropped or doubled, or a digit changed."""
    digits = [j for j, b in enumerate(header) if chr(b).isdigit()]
    for _ in range(count):
        h = bytearray(header)
        i = rng.randrange(len(h))
        op = rng.randrange(4)
        if op == 0:
            h[i] = rng.randrange(256)
        elif op == 1:
            del h[i]
        elif op == 2:
            h.insert(i, h[i])
        else:
            h[rng.choice(digits)] = ord(str(rng.randrange(10)))
        yield bytes(h)


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


# `.comfy_quant` record bytes of the wrong kind: each must end in a FormatError / CheckpointError naming the layer.
HOSTILE_RECORDS: dict[str, bytes] = {
    "not JSON": b"{format: int8",
    "not UTF-8": b'{"format": "\xff"}',
    "a list": b"[1, 2]",
    "a string": b'"int8_tensorwise"',
    "empty": b"",
    "deeply nested": b"[" * 100_000 + b"]" * 100_000,
    "huge": _json({"format": "int8_tensorwise", "pad": "x" * 200_000}),
    "no format": _json({"fmt": "int8"}),
    "format a number": _json({"format": 8}),
    "format a dict": _json({"format": {"a": 1}}),
    "format a list": _json({"format": ["nvfp4"]}),
    "unknown format": _json({"format": "int3_magic"}),
    "lowbit_format a list": _json({"format": "lowbit_int8", "lowbit_format": ["int8"]}),
    "lowbit_shape a string": _json({"format": "nvfp4", "lowbit_shape": "64x256"}),
    "lowbit_shape short": _json({"format": "nvfp4", "lowbit_shape": [64]}),
    "lowbit_shape negative": _json({"format": "nvfp4", "lowbit_shape": [-64, 256]}),
    "lowbit_shape huge": _json({"format": "nvfp4", "lowbit_shape": [2**70, 2**70]}),
    "lowbit_shape floats": _json({"format": "nvfp4", "lowbit_shape": [63.5, 256.0]}),
    "rotation unknown": _json({"format": "lowbit_int8", "lowbit_format": "int8", "lowbit_rotation": "spin"}),
    "rotation group zero": _json({"format": "lowbit_int8", "lowbit_format": "int8", "lowbit_rotation": "quarot",
                                  "lowbit_rotation_group": 0}),
    "rotation group a string": _json({"format": "lowbit_int8", "lowbit_format": "int8", "lowbit_rotation": "quarot",
                                      "lowbit_rotation_group": "128"}),
    "rotation group huge": _json({"format": "lowbit_int8", "lowbit_format": "int8", "lowbit_rotation": "quarot",
                                  "lowbit_rotation_group": 2**62}),
    "convrot group negative": _json({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": -256}),
    "convrot group a list": _json({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": [256]}),
    "bits a string": _json({"format": "asym_w4a8_int8", "lowbit_bits": "four"}),
    "bits zero": _json({"format": "asym_w4a8_int8", "lowbit_bits": 0}),
    "group_size zero": _json({"format": "awq_w4a16", "group_size": 0}),
    "group_size a string": _json({"format": "awq_w4a16", "group_size": "64"}),
    "granularity a list": _json({"format": "nvfp4", "lowbit_act_granularity": ["tensor"]}),
    "weight-only a string": _json({"format": "int8_tensorwise", "full_precision_matrix_mult": "yes"}),
}


def record_entry(record: bytes) -> Entry:
    return Entry("U8", (len(record),), record)


def _resized(e: Entry, shape: tuple[int, ...], rng: random.Random) -> Entry:
    numel = 1
    for d in shape:
        numel *= d
    n = numel * BITS[e.dtype] // 8
    data = (e.data * (n // max(len(e.data), 1) + 1))[:n] if e.data else bytes(rng.randrange(256) for _ in range(n))
    return Entry(e.dtype, shape, data)


_FLOATS = ("F32", "F16", "BF16")
_NAN = {"F32": struct.pack("<f", float("nan")), "F16": b"\x00\x7e", "BF16": b"\xc0\x7f"}
_INF = {"F32": struct.pack("<f", float("inf")), "F16": b"\x00\x7c", "BF16": b"\x80\x7f"}


def structural_mutations(entries: dict[str, Entry], metadata: dict[str, str], rng: random.Random,
                         count: int) -> Iterator[tuple[str, dict[str, Entry], dict[str, str]]]:
    """`count` (what changed, entries, metadata) of a real file's content, each one or two changes away."""
    keys = list(entries)
    records = [k for k in keys if k.endswith(".comfy_quant")]
    for _ in range(count):
        ents, meta, said = dict(entries), dict(metadata), []
        for _ in range(rng.choice((1, 1, 2))):
            key = rng.choice(keys)
            e = ents.get(key)
            op = rng.randrange(12)
            if e is None:
                continue
            if op == 0:
                del ents[key]
                said.append(f"dropped {key}")
            elif op == 1:
                new = rng.choice(list(BITS))
                ents[key] = _resized(replace(e, dtype=new), e.shape, rng)
                said.append(f"{key} as {new}")
            elif op == 2 and e.shape:
                shape = tuple(max(0, d + rng.choice((-1, 1, 16))) if i == rng.randrange(len(e.shape)) else d
                              for i, d in enumerate(e.shape))
                ents[key] = _resized(e, shape, rng)
                said.append(f"{key} shaped {shape}")
            elif op == 3:
                shape = rng.choice(((), (1,), e.shape[::-1], (*e.shape, 1), (2, *e.shape)))
                ents[key] = _resized(e, shape, rng)
                said.append(f"{key} shaped {shape}")
            elif op == 4 and records:
                name = rng.choice(list(HOSTILE_RECORDS))
                ents[rng.choice(records)] = record_entry(HOSTILE_RECORDS[name])
                said.append(f"record: {name}")
            elif op == 5:
                layer = key.rsplit(".", 1)[0]
                ents[f"{layer}.comfy_quant"] = record_entry(rng.choice(list(HOSTILE_RECORDS.values())[7:]))
                said.append(f"record on {layer}")
            elif op == 6 and e.dtype in _FLOATS and e.data:
                at = rng.randrange(len(e.data) // len(_NAN[e.dtype])) * len(_NAN[e.dtype])
                bad = rng.choice((_NAN, _INF))[e.dtype]
                ents[key] = replace(e, data=e.data[:at] + bad + e.data[at + len(bad):])
                said.append(f"NaN/Inf in {key}")
            elif op == 7:
                parts = key.split(".")
                digits = [i for i, p in enumerate(parts) if p.isdigit()]
                if digits:
                    parts[rng.choice(digits)] = str(rng.choice((7, 10**9, 2**63)))
                else:
                    parts[-1] = rng.choice(("weight", "bias", "weight_scale", "comfy_quant", "scale"))
                del ents[key]
                ents[".".join(parts)] = e
                said.append(f"renamed {key} -> {'.'.join(parts)}")
            elif op == 8 and meta:
                mk = rng.choice(list(meta))
                meta[mk] = rng.choice(('{"layers": 5}', "[]", "not json", '{"arch": 7}', '{"transformer_config": []}',
                                       '{"arch": "krea2", "transformer_config": {"num_layers": 1000000000}}',
                                       '{"layers": {"x": 1}}', '{"layout": 3, "arch": "nope"}', "null", "1e999"))
                said.append(f"metadata {mk}: {meta[mk]}")
            elif op == 9 and meta:
                mk = rng.choice(list(meta))
                try:
                    value = json.loads(meta[mk])
                except ValueError:
                    continue
                if isinstance(value, dict) and value:
                    sub = rng.choice(list(value))
                    value[sub] = rng.choice((None, 0, -1, "x", [], {}, 2**64, [1, 2]))
                    meta[mk] = json.dumps(value)
                    said.append(f"metadata {mk}.{sub}: {value[sub]!r}")
            elif op == 10:
                ents[key + "_copy"] = e
                said.append(f"copied {key}")
            else:
                layer = key.rsplit(".", 1)[0]
                extra = f"{layer}.{rng.choice(('weight_scale_2', 'input_scale', 'weight_zeros', 'junk'))}"
                ents[extra] = Entry("F32", (), struct.pack("<f", rng.choice((1.0, 0.0, -1.0, float("nan")))))
                said.append(f"added {extra}")
        yield "; ".join(said) or "unchanged", ents, meta
