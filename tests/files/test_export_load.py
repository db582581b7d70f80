"""Export layouts and reload: native fused layers, bad files named precisely, nothing written on failure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import lowbit_pipe
from lowbit_pipe.errors import RecipeError, StageError


def _export(tmp_path, recipe, *overrides):
    return lowbit_pipe.run(recipe, ["pipeline=[load,detect,quantize,export]", *overrides], run_dir=tmp_path / "export")


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "w4a8", "mxfp8", "awq_w4a16", "svdquant_w4a4"])
def test_flux_fused_native_layers_export_and_reload_exactly(tmp_path, fmt):
    """FLUX's native qkv / linear1 fuse several diffusers layers: quantized jointly, split back exactly."""
    # The recipe's static activations do not apply to mxfp8 (per-block) or awq_w4a16 (float activations).
    acts = "static" if fmt in ("nvfp4", "fp8", "w4a8") else "dynamic"
    first = _export(tmp_path, "flux1_fp8", f"quantize.default.format={fmt}", f"quantize.default.activations={acts}")
    with safe_open(first.export_path, "pt") as f:
        keys = set(f.keys())
        meta = json.loads(f.metadata()["lowbit_pipe"])
    assert {"double_blocks.0.img_attn.qkv.comfy_quant", "single_blocks.0.linear1.comfy_quant"} <= keys
    assert meta["layout"] == "native" and not any(k.startswith("transformer_blocks.") for k in keys)
    second = lowbit_pipe.run("flux1_fp8", [f"model.path={first.export_path}", "pipeline=[load,detect]"],
                             run_dir=tmp_path / "reload")
    assert second.report["stages"]["load"]["source"] == "native"
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_partly_float_fused_group_is_refused_by_name(tmp_path):
    with pytest.raises(StageError) as info:
        _export(tmp_path, "flux1_fp8", "quantize.default.format=nvfp4",
                "quantize.rules=[{match: single_transformer_blocks.0.proj_mlp, keep: true}]")
    assert info.value.stage == "export" and "single_blocks.0.linear1" in str(info.value)
    assert "proj_mlp" in str(info.value)
    assert not (tmp_path / "export" / "model.safetensors").exists()


def test_native_file_without_metadata_or_prefix_loads(tmp_path):
    """A plain ComfyUI-style file: `model.diffusion_model.` prefix, no lowbit metadata."""
    first = _export(tmp_path, "default")
    state = load_file(first.export_path)
    bare = tmp_path / "comfy_style.safetensors"
    save_file({f"model.diffusion_model.{k}": v for k, v in state.items()}, str(bare))
    cfg = first.context.model_config
    overrides = [f"+model.config.{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in cfg.items()
                 if k in ("in_channels", "num_layers", "attention_head_dim", "num_attention_heads",
                          "num_key_value_heads", "intermediate_size", "timestep_embed_dim", "text_hidden_dim",
                          "num_text_layers", "text_num_attention_heads", "text_num_key_value_heads",
                          "text_intermediate_size", "num_layerwise_text_blocks", "num_refiner_text_blocks")]
    overrides.append(f"+model.config.axes_dims_rope={cfg['axes_dims_rope']}".replace(" ", ""))
    second = lowbit_pipe.run("default", [f"model.path={bare}", "pipeline=[load,detect]", *overrides],
                             run_dir=tmp_path / "reload")
    assert second.report["detect"]["arch"] == "krea2"
    a, b = first.model.state_dict(), second.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _corrupt(tmp_path, edit) -> Path:
    first = _export(tmp_path, "default")
    state = load_file(first.export_path)
    with safe_open(first.export_path, "pt") as f:
        meta = f.metadata()
    edit(state)
    bad = tmp_path / "bad.safetensors"
    save_file(state, str(bad), metadata=meta)
    return bad


@pytest.mark.parametrize("edit, words", [
    (lambda s: s.__setitem__("blocks.0.attn.wq.comfy_quant",
                             torch.tensor(list(b'{"format":"int3_magic"}'), dtype=torch.uint8)), ["int3_magic"]),
    (lambda s: s.__setitem__("blocks.0.attn.wq.comfy_quant", torch.tensor(list(b'{"format":'), dtype=torch.uint8)),
     ["not valid JSON"]),
    (lambda s: s.__setitem__("blocks.0.attn.wq.weight", s["blocks.0.attn.wq.weight"][:, :128].contiguous()),
     ["blocks.0.attn.wq"]),
    (lambda s: s["first.weight"].view(-1).__setitem__(3, float("nan")), ["NaN", "first.weight"]),
    (lambda s: s["blocks.0.attn.wq.weight_scale"].view(-1).__setitem__(0, float("inf")), ["blocks.0.attn.wq"]),
])
def test_bad_files_name_file_and_key(tmp_path, edit, words):
    bad = _corrupt(tmp_path, edit)
    out = tmp_path / "out.safetensors"
    with pytest.raises(StageError) as info:
        lowbit_pipe.run("default", [f"model.path={bad}", f"export.path={out}"], run_dir=tmp_path / "run")
    message = str(info.value)
    assert info.value.stage == "load" and str(bad) in message
    for word in words:
        assert word in message, message
    assert not out.exists()


def test_truncated_file_is_named(tmp_path):
    first = _export(tmp_path, "default")
    data = Path(first.export_path).read_bytes()
    bad = tmp_path / "truncated.safetensors"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(RecipeError) as info:  # the header is checked before any weight is read
        lowbit_pipe.run("default", [f"model.path={bad}"], run_dir=tmp_path / "run")
    assert str(bad) in str(info.value) and "truncated" in str(info.value) and info.value.path == "model.path"


FORMATS = ["fp8", "int8", "nvfp4", "mxfp8", "awq_w4a16", "svdquant_w4a4", "convrot_w4a4", "w4a8", "w6a8"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_exports_and_reloads_with_identical_outputs(tmp_path, fmt):
    first = _export(tmp_path, "default", f"quantize.default.format={fmt}")
    assert first.report["quantize"]["layers"] == {fmt: 16}
    second = lowbit_pipe.run("default", [f"model.path={first.export_path}", "pipeline=[load,detect]"],
                             run_dir=tmp_path / "reload")
    arch = first.context.arch
    inputs = arch.example_inputs(first.context.model_config, batch=1, image_tokens=16, text_tokens=4,
                                 generator=torch.Generator().manual_seed(3), dtype=torch.float32, device="cpu")
    with torch.no_grad():
        assert torch.equal(first.model(**inputs).sample, second.model(**inputs).sample)


def test_kinds_stock_comfy_cannot_run_are_marked_and_warned(tmp_path):
    first = _export(tmp_path, "default", "quantize.default.rotation=quarot")
    # A run's warnings go to report.json and one line on stderr.
    assert any("stock ComfyUI refuses the whole file" in w["message"] and w["stage"] == "export"
               for w in first.report["warnings"])
    assert first.report["export"]["not_stock_comfy"]
    with safe_open(first.export_path, "pt") as f:
        record = json.loads(bytes(f.get_tensor("blocks.0.attn.wq.comfy_quant").tolist()))
    assert record.get("lowbit_rotation") == "quarot" and record["format"] != "int8_tensorwise"


def test_api_quantize_then_export_without_a_recipe(tmp_path, tiny_model):
    """The single-purpose calls: quantize a diffusers model in place, export it, load it back."""
    model = tiny_model("flux1")
    stats = lowbit_pipe.quantize(model, {"default": {"format": "nvfp4"}})
    assert stats["layers"] == {"nvfp4": 22}
    out = lowbit_pipe.export(model, tmp_path / "flux_nvfp4.safetensors")
    assert out["layout"] == "comfy" and out["quantized_layers"] == 22
    again = lowbit_pipe.run("flux1_fp8", [f"model.path={out['path']}", "pipeline=[load,detect]"], run_dir=tmp_path / "r")
    a, b = model.state_dict(), again.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_residual_lora_error_writes_nothing(tmp_path):
    from lowbit_pipe.lora.make_example import example_lora  # noqa: F401  (the stage generates it)

    out = tmp_path / "m.safetensors"
    with pytest.raises(StageError, match="residual branches"):
        lowbit_pipe.run("krea2_nvfp4_lora", ["pipeline=[load,detect,quantize,lora,export]", f"export.path={out}",
                                             "export.residual_lora=error"], run_dir=tmp_path / "r")
    assert not out.exists() and not list(tmp_path.glob("*.safetensors"))


def test_same_tensors_and_metadata_give_the_same_bytes(tmp_path):
    """safetensors orders metadata keys by a randomly seeded hash map; atomic_save sorts them, so a file with
    several metadata entries (ours and ComfyUI's) is byte-identical from save to save, and still loads."""
    import hashlib

    from lowbit_pipe.files.checkpoint import atomic_save
    tensors = {"b.weight": torch.arange(6, dtype=torch.int8).reshape(2, 3), "a.bias": torch.ones(3)}
    metadata = {f"key{i}": json.dumps({"i": i, "name": "é/ü"}) for i in range(6)}
    digests = set()
    for i in range(6):
        atomic_save(tensors, tmp_path / f"m{i}.safetensors", metadata)
        digests.add(hashlib.sha256((tmp_path / f"m{i}.safetensors").read_bytes()).hexdigest())
    assert len(digests) == 1
    with safe_open(str(tmp_path / "m0.safetensors"), "pt") as f:
        assert f.metadata() == metadata
        assert torch.equal(f.get_tensor("b.weight"), tensors["b.weight"])


def test_mxfp8_block_scales_are_written_as_bytes_and_reload_exactly(tmp_path):
    """E8M0 scales go to disk as U8 (ComfyUI 0.29's own reader, the GPU path, has no F8_E8M0) and come back equal."""
    import struct

    from lowbit_pipe.quant.nn import QuantLinear

    path = tmp_path / "m.safetensors"
    result = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,export]", "quantize.default.format=mxfp8",
                                         f"export.path={path}"], run_dir=tmp_path / "run")
    raw = path.read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    scales = {k: v["dtype"] for k, v in header.items() if k.endswith(".weight_scale")}
    assert scales and set(scales.values()) == {"U8"}
    again = lowbit_pipe.run("default", [f"model.path={path}", "pipeline=[load]"], run_dir=tmp_path / "reload")
    ours = {n: m for n, m in result.model.named_modules() if isinstance(m, QuantLinear) and m.format.name == "mxfp8"}
    back = dict(again.model.named_modules())
    assert ours
    for name, layer in ours.items():
        assert torch.equal(back[name].weight_scale.view(torch.uint8), layer.weight_scale.view(torch.uint8))
        x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
        assert torch.equal(back[name](x), layer(x))
