"""Exports stock ComfyUI runs: one fp8 scale per tensor by default (per row is our kind), the
`_quantization_metadata` header beside the layers' records, header-only files from other tools."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import lowbit_pipe
from lowbit_pipe.errors import StageError
from lowbit_pipe.formats import FormatSpec, get_format, is_stock_loadable


def test_fp8_is_one_scale_per_tensor_by_default_and_per_row_is_our_kind():
    fp8 = get_format("fp8")
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    q = fp8.quantize(w, FormatSpec("fp8"))
    assert q.tensors["weight_scale"].numel() == 1 and q.record == {"format": "float8_e4m3fn"}
    assert is_stock_loadable(q.record)
    row = fp8.quantize(w, FormatSpec("fp8", granularity="row"))
    assert row.tensors["weight_scale"].shape == (64, 1)
    assert row.record == {"format": "lowbit_fp8", "lowbit_format": "fp8", "lowbit_granularity": "row"}
    assert not is_stock_loadable(row.record)
    again = fp8.from_tensors(dict(row.tensors), row.record, "x")
    assert torch.equal(fp8.dequantize(again), fp8.dequantize(row))
    # int8 keeps per-row scales by default: stock ComfyUI's int8 layout takes them.
    assert get_format("int8").quantize(w, FormatSpec("int8")).tensors["weight_scale"].shape == (64, 1)


def _export(tmp_path: Path, *overrides: str):
    return lowbit_pipe.run("flux1_fp8", ["pipeline=[load,detect,quantize,export]", *overrides],
                           run_dir=tmp_path / "export")


def test_the_quantization_metadata_header_matches_the_records(tmp_path):
    result = _export(tmp_path)
    with safe_open(result.export_path, "pt") as f:
        header = json.loads(f.metadata()["_quantization_metadata"])
        records = {k[: -len(".comfy_quant")]: json.loads(bytes(f.get_tensor(k).tolist()))
                   for k in f.keys() if k.endswith(".comfy_quant")}
        scales = [k for k in f.keys() if k.endswith(".input_scale")]
    assert header["layers"] == records and len(records) == 12  # 22 diffusers linears; native qkv / linear1 fused
    assert all(r == {"format": "float8_e4m3fn"} for r in records.values())
    assert "double_blocks.0.img_attn.qkv" in records and len(scales) == len(records)  # static fp8, as stock reads


def test_a_header_only_file_loads_like_the_full_one(tmp_path):
    result = _export(tmp_path)
    state = load_file(result.export_path)
    with safe_open(result.export_path, "pt") as f:
        meta = f.metadata()
    bare = {k: v for k, v in state.items() if not k.endswith(".comfy_quant")}  # records in the header only
    header_only = tmp_path / "header_only.safetensors"
    save_file(bare, str(header_only), metadata=meta)
    a = lowbit_pipe.run("default", [f"model.path={result.export_path}", "pipeline=[load]"], run_dir=tmp_path / "a")
    b = lowbit_pipe.run("default", [f"model.path={header_only}", "pipeline=[load]"], run_dir=tmp_path / "b")
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)

    meta["_quantization_metadata"] = meta["_quantization_metadata"].replace("float8_e4m3fn", "int8_tensorwise", 1)
    contradicting = tmp_path / "contradicting.safetensors"
    save_file(state, str(contradicting), metadata=meta)
    with pytest.raises(StageError, match="contradicts the '_quantization_metadata' header"):
        lowbit_pipe.run("default", [f"model.path={contradicting}", "pipeline=[load]"], run_dir=tmp_path / "c")


def test_dynamic_fp8_export_warns_what_stock_comfyui_computes(tmp_path):
    result = _export(tmp_path, "quantize.default.activations=dynamic")
    assert any("input scale of 1" in w["message"] for w in result.report["warnings"])
