"""read_header against hostile and damaged safetensors files (made by tests/files/hostile_files.py): every one ends in CheckpointError naming the file
(never a raw exception, never an allocation by the size a header claims), and whatever it accepts safetensors'
own reader accepts and loads with the same dtypes and shapes."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest
import torch
from hostile_files import F32, HOSTILE_HEADERS, header_mutations, write_raw
from safetensors import safe_open
from safetensors.torch import save_file

from lowbit_pipe.errors import CheckpointError
from lowbit_pipe.files.checkpoint import read_header

_file = write_raw


def _real(tmp_path: Path) -> Path:
    """A small real file: three tensors of three dtypes and metadata, as safetensors writes it."""
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "real.safetensors"
    save_file({"a.weight": torch.randn(4, 6, generator=g), "b.scale": torch.randn(3, generator=g).half(),
               "c.codes": torch.randint(0, 255, (2, 5), generator=g, dtype=torch.uint8)}, str(path),
              metadata={"format": "pt"})
    return path


def _safetensors_accepts(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]] | None:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: (f.get_tensor(k).dtype, tuple(f.get_tensor(k).shape)) for k in f.keys()}
    except Exception:  # noqa: BLE001 - any refusal of safetensors' is a refusal
        return None


HOSTILE = HOSTILE_HEADERS


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_header_is_refused_naming_the_file(case, tmp_path):
    header, data, length = HOSTILE[case]
    path = _file(tmp_path / "hostile.safetensors", header, data, length)
    with pytest.raises(CheckpointError) as err:
        read_header(path)
    assert str(path) in str(err.value)
    if case != "duplicate key":  # serde keeps the last of two equal keys; safetensors' rules refuse the rest
        assert _safetensors_accepts(path) is None, f"{case}: safetensors accepts what read_header refuses"


def test_the_errors_say_what_is_wrong_and_where(tmp_path):
    cases = {"overlapping": "overlaps x", "gap": "gap of 4 bytes after x", "duplicate key": "[x]: corrupt header: the key",
             "offsets not matching the shape": "shape [3] of F32 needs 12", "trailing bytes": "trailing bytes",
             "header longer than safetensors' limit": "over safetensors' limit"}
    for case, words in cases.items():
        header, data, length = HOSTILE[case]
        with pytest.raises(CheckpointError) as err:
            read_header(_file(tmp_path / f"{len(words)}.safetensors", header, data, length))
        assert words in str(err.value), (case, str(err.value))


def test_contiguous_entries_in_any_key_order_are_accepted(tmp_path):
    path = _file(tmp_path / "ok.safetensors", {"y": {**F32, "data_offsets": [8, 16]}, "x": F32,
                                                "e": {"dtype": "BF16", "shape": [0, 3], "data_offsets": [16, 16]}},
                 bytes(16))
    h = read_header(path)
    assert {k: t.offsets for k, t in h.tensors.items()} == {"y": (8, 16), "x": (0, 8), "e": (16, 16)}
    assert _safetensors_accepts(path) is not None


def test_every_truncation_of_a_real_file_is_refused(tmp_path):
    real = _real(tmp_path).read_bytes()
    assert read_header(_real(tmp_path)).tensors["a.weight"].shape == (4, 6)
    cut = tmp_path / "cut.safetensors"
    for n in range(len(real)):
        cut.write_bytes(real[:n])
        with pytest.raises(CheckpointError):
            read_header(cut)


def test_mutated_headers_are_refused_cleanly_or_load_as_safetensors_loads_them(tmp_path):
    """600 seeded mutations of a real file's header bytes (a byte replaced, dropped or doubled; digits changed):
    read_header raises CheckpointError or accepts a file safetensors also loads, with its dtypes and shapes."""
    real = _real(tmp_path).read_bytes()
    (n,) = struct.unpack("<Q", real[:8])
    header, data = real[8:8 + n], real[8 + n:]
    rng = random.Random(27)
    path = tmp_path / "mutated.safetensors"
    accepted = 0
    for h in header_mutations(header, rng, 600):
        path.write_bytes(struct.pack("<Q", len(h)) + bytes(h) + data)
        try:
            ours = read_header(path)
        except CheckpointError as err:
            assert str(path) in str(err)
            continue
        theirs = _safetensors_accepts(path)
        assert theirs is not None, f"read_header accepted what safetensors refuses: {bytes(h)!r}"
        assert {k: tuple(t.shape) for k, t in ours.tensors.items()} == {k: s for k, (_, s) in theirs.items()}
        accepted += 1
    assert accepted < 600  # the mutations do damage; most are refused
