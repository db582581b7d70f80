"""safetensors files: header reading with clear errors, and atomic writes."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lowbit_pipe.errors import CheckpointError
from lowbit_pipe.files.tempfiles import atomic_write_text, remove_stale, temp_path, write_error  # noqa: F401 (atomic_write_text: its callers import it from here)
from lowbit_pipe.files.tempfiles import publish as publish_file
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
                 label: str = "load: read", header: Header | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a checked file (`header`: its `read_header`, read here when not given), each read with a plain
    read into fresh memory; `console`: progress per tensor.

    Not through safetensors' `get_tensor`: it leaks two Python ints per tensor read (safetensors 0.8; about 2 KB
    per load of a 32-tensor LoRA), which a long-lived process, a ComfyUI server loading LoRAs all day, piles up
    (tests/running/test_soak.py counts it). Nor through a memory map, for lazy.py's reason."""
    path = str(path)
    header = header if header is not None else read_header(path)
    todo = keys if keys is not None else list(header.tensors)
    out = {}
    try:
        with open(path, "rb") as f:
            for key in console.progress(todo, label) if console is not None else todo:
                info = header.tensors.get(key)
                if info is None:
                    raise CheckpointError(path, "no such tensor in the file", key)
                out[key] = read_tensor(f, path, header.data_start, info, key)
    except OSError as err:
        raise CheckpointError(path, f"cannot read: {err.strerror}") from err
    return out


def read_tensor(f: Any, path: str, data_start: int, info: TensorInfo, key: str) -> torch.Tensor:
    """One tensor of an open safetensors file (`data_start`: its header's), read into fresh memory."""
    dtype = TORCH_DTYPES.get(info.dtype)
    if dtype is None:
        raise CheckpointError(path, f"dtype {info.dtype} has no torch dtype to read it as", key)
    begin, end = info.offsets
    buf = torch.empty(end - begin, dtype=torch.uint8)
    f.seek(data_start + begin)
    if end > begin and f.readinto(buf.numpy()) != end - begin:
        raise CheckpointError(path, "truncated while reading", key)
    return buf.view(dtype).reshape(info.shape)


def atomic_save(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None,
                *, inputs: tuple[str | Path, ...] = (), console: Console | None = None,
                label: str = "export: write") -> int:
    """Write `path` via a temp file + rename (StreamingWriter, so the bytes depend only on the tensors and
    the metadata, in the order given: safetensors' own writer orders metadata keys randomly); never
    overwrites one of `inputs`. Returns bytes written. `console`: progress per tensor."""
    tmp, nbytes = save_unpublished(tensors, path, metadata, inputs=inputs, console=console, label=label)
    try:
        publish_file(tmp, Path(path))
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise write_error(err, path, needed=nbytes) from err
    finally:
        tmp.unlink(missing_ok=True)  # an interrupt before the rename: no temp file stays
    return nbytes


def save_unpublished(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None,
                     *, inputs: tuple[str | Path, ...] = (), console: Console | None = None,
                     label: str = "export: write") -> tuple[Path, int]:
    """`atomic_save` up to the rename: (the complete, synced temp file beside `path`, its size). The caller
    publishes it (tempfiles.publish / publish_together, for files that must appear together) or removes it."""
    entries, offset = {}, 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        entries[key] = {"dtype": _ST_DTYPES.get(t.dtype, "?"), "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        entries["__metadata__"] = metadata
    header_bytes = len(json.dumps(entries, separators=(",", ":")).encode("utf-8"))
    with StreamingWriter(path, header_bytes, inputs=inputs, expected_bytes=8 + header_bytes + 7 + offset) as writer:
        items = list(tensors.items())
        for key, t in console.progress(items, label) if console is not None else items:
            writer.write(key, t)
        return writer.tmp, writer.close(metadata, publish=False)


def metadata_json(metadata: dict[str, str], key: str, path: str) -> Any:
    """A JSON value stored in the header metadata, or None."""
    if key not in metadata:
        return None
    try:
        return json.loads(metadata[key])
    except (json.JSONDecodeError, RecursionError) as err:
        raise CheckpointError(path, f"metadata '{key}' is not valid JSON ({str(err)[:200]})", key) from None


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
# safetensors dtype name -> the torch dtype a tensor of it is read as (F4 / F6 have none).
TORCH_DTYPES = {**{name: dtype for dtype, name in _ST_DTYPES.items() if dtype is not torch.float8_e8m0fnu},
                "F8_E8M0": torch.float8_e8m0fnu, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64}


@dataclass(frozen=True)
class ExportTargets:
    """The files an export to `path` may write besides its shards."""

    path: Path
    index: Path  # <stem>.safetensors.index.json, when sharded
    lora: Path  # <stem>.lora.safetensors, when the model carries LoRA residual branches


def export_targets(path: str | Path) -> ExportTargets:
    path = Path(path)
    stem = path.name.removesuffix(".safetensors")
    return ExportTargets(path, path.with_name(f"{stem}.safetensors.index.json"),
                         path.with_name(f"{stem}.lora.safetensors"))


class StreamingWriter:
    """Write a safetensors file tensor by tensor, so a file larger than memory can be written.

    The data section is written first, after a header region reserved by the caller's bound
    (`header_bytes`); the header (its JSON padded with spaces, which JSON readers skip) goes in last.
    Same atomicity as `atomic_save`: a temp file (lowbit_pipe.files.tempfiles: named so that a later write finds it
    stale once this process is gone, and removes it) renamed into place by `close()`; `abort()` (or an exception
    inside the `with`, an interrupt included) removes it, never leaving a half-written file. A write the disk
    cannot take (ENOSPC) removes the temp file and raises WriteError ("disk full", the path, bytes needed and
    free); `expected_bytes`, when the caller knows the file's size, goes into that message.
    """

    def __init__(self, path: str | Path, header_bytes: int, *, inputs: tuple[str | Path | None, ...] = (),
                 expected_bytes: int | None = None, replace: bool = True):
        self.path = Path(path)
        self.replace = replace  # False: close() refuses to replace an existing file (FileExistsError -> WriteError)
        for source in inputs:
            if source is not None and Path(source).exists() and self.path.exists() and \
                    Path(source).resolve() == self.path.resolve():
                raise CheckpointError(str(self.path), "refusing to overwrite the input file; choose another export.path")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.removed_stale = remove_stale(self.path)  # what killed writers of this path left
        self.tmp = temp_path(self.path)
        self.reserved = int(header_bytes) + (-int(header_bytes)) % 8  # data starts 8-aligned
        self.expected_bytes = expected_bytes
        self.entries: dict[str, dict[str, Any]] = {}
        self.offset = 0
        try:
            self._file = open(self.tmp, "wb")  # noqa: SIM115
            self._file.seek(8 + self.reserved)
        except OSError as err:
            self._discard()
            raise write_error(err, self.path, needed=expected_bytes) from err

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
            try:
                self._file.write(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, no copy
            except OSError as err:
                self._fail(err)
        self.entries[key] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                             "data_offsets": [self.offset, self.offset + nbytes]}
        self.offset += nbytes

    def close(self, metadata: dict[str, str] | None = None, *, publish: bool = True) -> int:
        """Write the header, publish the file (publish=False: leave the complete, synced file at `self.tmp` for
        the caller to publish); returns its size in bytes."""
        header = dict(self.entries)
        if metadata:
            header["__metadata__"] = metadata
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        if len(raw) > self.reserved:
            self.abort()
            raise CheckpointError(str(self.path), f"header of {len(raw)} bytes exceeds the {self.reserved} reserved "
                                                  "for it (a bug: the bound is computed before writing)")
        try:
            self._file.seek(0)
            self._file.write(struct.pack("<Q", self.reserved))
            self._file.write(raw + b" " * (self.reserved - len(raw)))
            self._file.flush()  # a full disk may only show here
            os.fsync(self._file.fileno())
            self._file.close()
            if not publish:
                return self.tmp.stat().st_size
            publish_file(self.tmp, self.path, replace=self.replace)
        except OSError as err:
            self._fail(err)
        except BaseException:  # an interrupt between the last write and the rename: no temp file stays
            self.abort()
            raise
        return self.path.stat().st_size

    def _fail(self, err: OSError) -> None:
        """Remove the temp file, then raise the WriteError (free space measured without it)."""
        self.abort()
        raise write_error(err, self.path, needed=self.expected_bytes, written=8 + self.reserved + self.offset) from err

    def abort(self) -> None:
        if not self._file.closed:
            try:
                self._file.close()
            except OSError as err:  # the flush of a full disk fails again: the file goes all the same
                del err
        self._discard()

    def _discard(self) -> None:
        try:
            self.tmp.unlink()
        except FileNotFoundError:
            return
