"""safetensors files: header reading with clear errors, and atomic writes."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from lowbit_pipe.errors import CheckpointError
from lowbit_pipe.progress import Console

# safetensors' dtypes and their bits per element (a tensor's bytes are numel x bits / 8, a whole number).
_DTYPE_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U8": 8, "BOOL": 8,
               "F8_E4M3": 8, "F8_E5M2": 8, "U16": 16, "U32": 32, "U64": 64, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6,
               "F6_E3M2": 6, "C64": 64}
_DTYPES = set(_DTYPE_BITS)
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit: a longer header is refused before it is read
MAX_COUNT = 2**63 - 1  # a dimension, element count or offset past int64 is refused (safetensors: usize overflow)


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int] = (0, 0)  # bytes [start, end) in the data section


@dataclass(frozen=True)
class Header:
    path: str
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]
    data_start: int = 0  # file offset of the data section (8 + header length)


def read_header(path: str | Path) -> Header:
    """Parse and check a safetensors header by safetensors' own rules (a JSON object of unique keys under 100 MB;
    each entry a known dtype, a shape of non-negative integers and [start, end) offsets whose length is the
    shape's bytes; the entries' data contiguous from 0 to the end of the file; `__metadata__` strings to strings).
    Errors name the file (and key); nothing is allocated by the size a header claims."""
    path = str(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(path, f"truncated: {size} bytes, not even a header length")
            (n,) = struct.unpack("<Q", head)
            first = f.read(1)
            if first != b"{":  # a safetensors header is a JSON object right after its 8-byte length
                raise CheckpointError(path, "not a safetensors file (no JSON header after the 8-byte length)")
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(path, f"corrupt header: claims {n} bytes, over safetensors' limit of "
                                            f"{MAX_HEADER_BYTES}")
            if n > size - 8:
                raise CheckpointError(path, f"truncated or corrupt: header claims {n} bytes, file has {size - 8} after the length")
            raw = first + f.read(n - 1)
    except OSError as err:
        raise CheckpointError(path, f"cannot read: {err.strerror}") from err
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise CheckpointError(path, f"corrupt header, not valid JSON ({err})") from err
    except _DuplicateKey as err:
        raise CheckpointError(path, "corrupt header: the key appears twice", err.key) from None
    if not isinstance(header, dict):
        raise CheckpointError(path, "corrupt header: not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(path, "corrupt header: __metadata__ must map strings to strings", "__metadata__")
    data_len = size - 8 - n
    tensors = {key: _tensor_info(path, key, info) for key, info in header.items()}
    _check_layout(path, tensors, data_len)
    return Header(path, dict(metadata), tensors, 8 + n)


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads keeps the last of two equal keys; safetensors refuses them, and so do we."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _tensor_info(path: str, key: str, info: Any) -> TensorInfo:
    """One header entry, checked: dtype, shape and offsets, and offsets' length == the shape's bytes."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise CheckpointError(path, "corrupt header entry: needs dtype, shape and data_offsets", key)
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise CheckpointError(path, f"unknown dtype {dtype!r}", key)
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(path, f"corrupt shape {shape!r}: must be a list of non-negative integers", key)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise CheckpointError(path, f"corrupt data_offsets {offsets!r}: must be [start, end], 0 <= start <= end", key)
    numel = 1
    for d in shape:  # in order, as safetensors' checked product: [2**40, 2**40, 0] overflows before the 0
        numel *= d
        if numel > MAX_COUNT or d > MAX_COUNT:
            raise CheckpointError(path, f"shape {shape}: element count overflows int64", key)
    if offsets[1] > MAX_COUNT:
        raise CheckpointError(path, f"corrupt data_offsets {offsets!r}: past int64", key)
    bits = numel * _DTYPE_BITS[dtype]
    if bits % 8 or offsets[1] - offsets[0] != bits // 8:
        raise CheckpointError(path, f"data_offsets {offsets[0]}..{offsets[1]} hold {offsets[1] - offsets[0]} bytes, "
                                    f"but shape {shape} of {dtype} needs {bits / 8:g}", key)
    return TensorInfo(dtype, tuple(shape), (offsets[0], offsets[1]))


def _check_layout(path: str, tensors: dict[str, TensorInfo], data_len: int) -> None:
    """The entries' bytes tile the data section: in offset order each starts where the previous ended, from 0 to
    the end of the file (safetensors refuses gaps, overlaps and trailing bytes alike)."""
    at, previous = 0, None
    for key, t in sorted(tensors.items(), key=lambda kv: kv[1].offsets):
        start, end = t.offsets
        if end > data_len:
            raise CheckpointError(path, f"data offsets {start}..{end} run past the file's {data_len} data bytes "
                                        "(truncated?)", key)
        if start != at:
            what = f"overlaps {previous}" if start < at else f"leaves a gap of {start - at} bytes after " + \
                (previous or "the header")
            raise CheckpointError(path, f"data offsets {start}..{end} are not contiguous: {what}", key)
        at, previous = end, key
    if at != data_len:
        raise CheckpointError(path, f"the tensors' data ends at byte {at} but the file has {data_len} data bytes "
                                    f"({'trailing bytes' if at < data_len else 'truncated?'})")


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN / Inf in a float tensor; 1-byte floats (fp8, whose isfinite torch does not implement) through fp16,
    which holds their every value."""
    return bool(torch.isfinite(tensor.half() if tensor.element_size() == 1 else tensor).all())


def load_tensors(path: str | Path, keys: list[str] | None = None, *, console: Console | None = None,
                 label: str = "load: read") -> dict[str, torch.Tensor]:
    """Tensors of a checked file (memory-mapped by safetensors); `console`: progress per tensor."""
    path = str(path)
    out = {}
    try:
        with safe_open(path, framework="pt") as f:
            todo = keys if keys is not None else list(f.keys())
            for key in console.progress(todo, label) if console is not None else todo:
                out[key] = f.get_tensor(key)
    except CheckpointError:
        raise
    except Exception as err:  # safetensors raises its own untyped errors: name the file
        raise CheckpointError(path, f"cannot load tensors: {err}") from err
    return out


def _umask() -> int:
    """The process umask, read without changing it where Linux shows it (else set and restored at once)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _publish(tmp: Path, path: Path) -> None:
    """Give a finished temp file the permissions a new file gets (whatever created it), fsync it,
    rename it into place."""
    os.chmod(tmp, 0o666 & ~_umask())
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_save(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None,
                *, inputs: tuple[str | Path, ...] = (), console: Console | None = None,
                label: str = "export: write") -> int:
    """Write `path` via a temp file + rename (StreamingWriter, so the bytes depend only on the tensors and
    the metadata, in the order given: safetensors' own writer orders metadata keys randomly); never
    overwrites one of `inputs`. Returns bytes written. `console`: progress per tensor."""
    entries, offset = {}, 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        entries[key] = {"dtype": _ST_DTYPES.get(t.dtype, "?"), "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        entries["__metadata__"] = metadata
    with StreamingWriter(path, len(json.dumps(entries, separators=(",", ":")).encode("utf-8")),
                         inputs=inputs) as writer:
        items = list(tensors.items())
        for key, t in console.progress(items, label) if console is not None else items:
            writer.write(key, t)
        return writer.close(metadata)


def metadata_json(metadata: dict[str, str], key: str, path: str) -> Any:
    """A JSON value stored in the header metadata, or None."""
    if key not in metadata:
        return None
    try:
        return json.loads(metadata[key])
    except (json.JSONDecodeError, RecursionError) as err:
        raise CheckpointError(path, f"metadata '{key}' is not valid JSON ({str(err)[:200]})", key) from None


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        _publish(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


MAX_INDEX_BYTES = 100_000_000  # a shard index (key -> file name JSON) of a 12B model is about 100 KB


def shard_files(path: str) -> list[str]:
    """The files of a (possibly sharded) export: a .safetensors file, or an index .json naming shards. The index
    is checked against the shards' headers: each name a plain file beside the index (no folder, no `..`), each
    shard holding exactly the keys the index gives it; errors name the index and the key or shard."""
    if not path.endswith(".json"):
        return [path]
    try:
        if os.path.getsize(path) > MAX_INDEX_BYTES:
            raise CheckpointError(path, f"not a valid safetensors index (over {MAX_INDEX_BYTES} bytes)")
        index = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise CheckpointError(path, f"not a valid safetensors index ({err})") from err
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(path, "not a valid safetensors index (no 'weight_map' of tensor -> shard file)")
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name or name != Path(name).name or name in (".", ".."):
            raise CheckpointError(path, f"weight_map names shard {name!r}: must be a file name beside the index", key)
    files = sorted(set(weight_map.values()))
    folder = Path(path).parent
    held = {name: set(read_header(folder / name).tensors) for name in files}  # a missing shard: "cannot read" it
    for name, have in held.items():
        want = {k for k, v in weight_map.items() if v == name}
        if want != have:
            extra, lacking = sorted(have - want), sorted(want - have)
            raise CheckpointError(path, f"shard '{name}' does not hold what the index says: "
                                        + (f"lacks {lacking[:3]}" if lacking else f"also holds {extra[:3]}"),
                                  (lacking or extra)[0])
    return [str(folder / f) for f in files]


# E8M0 (mxfp8's block scales) is written as its bytes, U8: ComfyUI 0.29's own safetensors reader, the one it uses
# on a GPU with dynamic VRAM, has no F8_E8M0 and refuses the whole file (KeyError: 'F8_E8M0', seen on the H200);
# ComfyUI's mxfp8 loader and lowbit_pipe's view uint8 scales as E8M0 again.
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
              torch.float8_e8m0fnu: "U8"}


class StreamingWriter:
    """Write a safetensors file tensor by tensor, so a file larger than memory can be written.

    The data section is written first, after a header region reserved by the caller's bound
    (`header_bytes`); the header (its JSON padded with spaces, which JSON readers skip) goes in last.
    Same atomicity as `atomic_save`: a temp file renamed into place by `close()`; `abort()` (or an
    exception inside the `with`) removes it, never leaving a half-written file.
    """

    def __init__(self, path: str | Path, header_bytes: int, *, inputs: tuple[str | Path | None, ...] = ()):
        self.path = Path(path)
        for source in inputs:
            if source is not None and Path(source).exists() and self.path.exists() and \
                    Path(source).resolve() == self.path.resolve():
                raise CheckpointError(str(self.path), "refusing to overwrite the input file; choose another export.path")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.reserved = int(header_bytes) + (-int(header_bytes)) % 8  # data starts 8-aligned
        self.entries: dict[str, dict[str, Any]] = {}
        self.offset = 0
        self._file = open(self.tmp, "wb")
        self._file.seek(8 + self.reserved)

    def __enter__(self) -> StreamingWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            return  # the caller closes with its metadata
        self.abort()

    def write(self, key: str, tensor: torch.Tensor) -> None:
        if key in self.entries:
            raise CheckpointError(str(self.path), "tensor written twice", key)
        if tensor.dtype not in _ST_DTYPES:
            raise CheckpointError(str(self.path), f"dtype {tensor.dtype} has no safetensors name", key)
        t = tensor.detach().contiguous().cpu()
        nbytes = t.numel() * t.element_size()
        if nbytes:
            self._file.write(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, no copy
        self.entries[key] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                             "data_offsets": [self.offset, self.offset + nbytes]}
        self.offset += nbytes

    def close(self, metadata: dict[str, str] | None = None) -> int:
        """Write the header, publish the file; returns its size in bytes."""
        header = dict(self.entries)
        if metadata:
            header["__metadata__"] = metadata
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        if len(raw) > self.reserved:
            self.abort()
            raise CheckpointError(str(self.path), f"header of {len(raw)} bytes exceeds the {self.reserved} reserved "
                                                  "for it (a bug: the bound is computed before writing)")
        self._file.seek(0)
        self._file.write(struct.pack("<Q", self.reserved))
        self._file.write(raw + b" " * (self.reserved - len(raw)))
        self._file.close()
        _publish(self.tmp, self.path)
        return self.path.stat().st_size

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self.tmp.exists():
            self.tmp.unlink()
