"""Tensors of safetensors files, read only when needed: what streaming reads a 12B checkpoint with.

A `LazyTensor` knows its shape and dtype from the file header. Renaming a state dict between layouts
(arch key maps) moves them around without reading a byte; the few reshapes a key map does (rows of a
fused weight cut apart or stacked, a flattened parameter, (shift, scale) halves swapped) are recorded
and applied when `materialize()` finally reads the data, one tensor at a time.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable

import torch

from lowbit_pipe.errors import CheckpointError
from lowbit_pipe.files.checkpoint import read_header, read_tensor

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class LazyTensor:
    """A tensor to be read: `read()` gives the data; `ops` are applied after it, in order."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]
    where: str  # file [key] it comes from, for errors

    def materialize(self) -> torch.Tensor:
        t = self.read()
        if tuple(t.shape) != self.shape:
            raise CheckpointError(self.where, f"read shape {tuple(t.shape)}, expected {self.shape}")
        return t

    def _then(self, shape: tuple[int, ...], fn: Callable[[torch.Tensor], torch.Tensor], what: str) -> LazyTensor:
        return LazyTensor(tuple(int(d) for d in shape), self.dtype, lambda: fn(self.read()), f"{self.where} {what}")

    # The operations arch key maps use (see arch/keymap.py): all deferred.
    def split_rows(self, rows: list[int]) -> list[LazyTensor]:
        out, start = [], 0
        for n in rows:
            out.append(self._then((n, *self.shape[1:]), lambda t, a=start, b=start + n: t[a:b].clone(),
                                  f"rows {start}:{start + n}"))
            start += n
        return out

    @staticmethod
    def cat_rows(parts: list[LazyTensor]) -> LazyTensor:
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        return LazyTensor(shape, parts[0].dtype, lambda: torch.cat([p.materialize() for p in parts]),
                          " + ".join(p.where for p in parts))

    def reshaped(self, shape: tuple[int, ...]) -> LazyTensor:
        return self._then(shape, lambda t: t.reshape(shape), f"as {tuple(shape)}")

    def halves_swapped(self) -> LazyTensor:
        return self._then(self.shape, lambda t: torch.cat(t.chunk(2, dim=0)[::-1]), "halves swapped")


class SafetensorsFiles:
    """Open safetensors files (one, or the shards of an index) as {key: LazyTensor}; a context manager
    keeping them open while the lazy tensors are read.

    Tensors are read with plain reads into fresh memory, not through a memory map: a mapped file's touched
    pages count as the process's resident memory until it is unmapped, so reading a whole checkpoint
    through one would look (and, under memory pressure, behave) like holding all of it."""

    def __init__(self, files: list[str]):
        self.files = files
        self.headers = [read_header(f) for f in files]
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}

    def __enter__(self) -> SafetensorsFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._handles.clear()
        self._stack.close()

    def _read(self, path: str, start: int, info: Any, key: str) -> torch.Tensor:
        f = self._handles.get(path)
        if f is None:
            f = self._handles[path] = self._stack.enter_context(open(path, "rb"))  # noqa: SIM115
        return read_tensor(f, path, start, info, key)

    def tensors(self) -> dict[str, LazyTensor]:
        out = {}
        for path, header in zip(self.files, self.headers):
            for key, info in header.tensors.items():
                if info.dtype not in DTYPES:
                    raise CheckpointError(path, f"dtype {info.dtype} cannot be streamed", key)
                out[key] = LazyTensor(info.shape, DTYPES[info.dtype],
                                      lambda p=path, h=header, k=key, i=info: self._read(p, h.data_start, i, k),
                                      f"{path} [{key}]")
        return out
