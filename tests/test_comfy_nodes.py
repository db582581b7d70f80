"""The ComfyUI node pack on MODEL objects, without ComfyUI: a stand-in ModelPatcher with ComfyUI's
object-patch semantics (clone shares the model; object patches override attributes; get_model_object
reads through them) around a natively named diffusion model."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from safetensors.torch import load_file

import lowbit_pipe
import lowbit_pipe.errors
from conftest import native_module
from lowbit_pipe.arch.tiny import tiny_model_config
from lowbit_pipe.comfy.nodes import NODE_CLASS_MAPPINGS, LowbitExport, LowbitLoRA, LowbitPurge, LowbitQuantize
from lowbit_pipe.lora.make_example import example_lora
from lowbit_pipe.nn import QuantLinear


class BaseModel(torch.nn.Module):
    def __init__(self, diffusion_model: torch.nn.Module):
        super().__init__()
        self.diffusion_model = diffusion_model


class Patcher:
    """What ComfyUI's ModelPatcher offers a node: clone() shares the model, object patches on top."""

    def __init__(self, model: BaseModel, object_patches: dict | None = None):
        self.model, self.object_patches = model, dict(object_patches or {})
        self.load_device, self.patches = torch.device("cpu"), {}

    def clone(self) -> "Patcher":
        return Patcher(self.model, self.object_patches)

    def add_object_patch(self, name: str, obj) -> None:  # noqa: ANN001
        self.object_patches[name] = obj

    def get_model_object(self, name: str):  # noqa: ANN201
        return self.object_patches[name] if name in self.object_patches else self.model.get_submodule(name)


@pytest.fixture
def krea2(tmp_path):
    """A ComfyUI-style MODEL of the tiny Krea 2 (native names), and a peft LoRA file for it."""
    exported = lowbit_pipe.run("default", ["pipeline=[load,detect,export]", f"export.path={tmp_path / 'f.safetensors'}"],
                               run_dir=tmp_path / "float")
    diffusers = exported.model
    lora_sd, _ = example_lora(diffusers, exported.context.arch, style="peft", rank=4, seed=3, rel=0.02)
    from safetensors.torch import save_file

    save_file(lora_sd, str(tmp_path / "style.safetensors"))
    return Patcher(BaseModel(native_module(load_file(exported.export_path)))), str(tmp_path / "style.safetensors")


def _layer(model: Patcher, name: str = "blocks.0.attn.wq"):
    return model.get_model_object("diffusion_model").get_submodule(name)


def test_nodes_are_registered_with_comfyui_fields():
    for cls in NODE_CLASS_MAPPINGS.values():
        assert cls.INPUT_TYPES()["required"]["model"] == ("MODEL",) or "model" in cls.INPUT_TYPES()["required"]
        assert isinstance(cls.RETURN_TYPES, tuple) and hasattr(cls, cls.FUNCTION) and cls.CATEGORY == "lowbit_pipe"


def test_quantize_lora_export_purge_on_a_comfyui_model(krea2, tmp_path):
    model, lora_file = krea2
    original = model.model.diffusion_model
    before = {k: v.clone() for k, v in original.state_dict().items()}

    (quantized, report) = LowbitQuantize().quantize(model, "default", "quantize.default.format=int8")
    assert "lowbit_pipe run: ok" in report
    assert isinstance(_layer(quantized), QuantLinear) and not isinstance(_layer(model), QuantLinear)  # upstream intact
    x = torch.randn(3, _layer(model).in_features, generator=torch.Generator().manual_seed(0))
    base_out = _layer(quantized)(x)

    (a,) = LowbitLoRA().attach(quantized, lora_file, 0.8)
    (b,) = LowbitLoRA().attach(quantized, lora_file, 0.4)  # another strength: a fresh copy, nothing requantized
    assert _layer(a).weight.data_ptr() == _layer(quantized).weight.data_ptr() == _layer(b).weight.data_ptr()
    da, db = _layer(a)(x) - base_out, _layer(b)(x) - base_out
    assert da.abs().max() > 0 and torch.allclose(da, 2 * db, rtol=1e-4, atol=1e-6)  # linear in strength
    assert torch.equal(_layer(quantized)(x), base_out)  # the quantized MODEL upstream has no branch

    path = LowbitExport().export(a, str(tmp_path / "out" / "m.safetensors"))[0]
    # A ComfyUI model carries no diffusers constructor config: a reload of a tiny one names it.
    config = [f"+model.config.{k}={v}".replace(" ", "") for k, v in tiny_model_config("krea2").items()]
    again = lowbit_pipe.run("default", [f"model.path={path}", "pipeline=[load]", *config], run_dir=tmp_path / "reload")
    assert isinstance(again.model.get_submodule("transformer_blocks.0.attn.to_q"), QuantLinear)
    assert (tmp_path / "out" / "m.lora.safetensors").is_file()  # the residual branches, never dropped

    refs = [weakref.ref(m) for t in (quantized, a, b) for m in t.get_model_object("diffusion_model").modules()
            if isinstance(m, QuantLinear)]
    (_, text) = LowbitPurge().purge(b, )
    gc.collect()
    assert '"retained_bytes": 0' in text and '"unfreed": []' in text, text
    assert all(r() is None for r in refs)  # every quantized layer of every MODEL made from the run is gone
    for t in (quantized, a, b):  # those MODELs (ComfyUI may still cache them) compute float again
        assert not any(isinstance(m, QuantLinear) or "lora" in m._modules
                       for m in t.get_model_object("diffusion_model").modules())
    after = original.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_model_with_comfyui_lora_patches_is_refused(krea2):
    model, _ = krea2
    model.patches = {"diffusion_model.blocks.0.attn.wq.weight": [object()]}
    with pytest.raises(lowbit_pipe.errors.StageError, match="LoRA twice|weight patches"):
        lowbit_pipe.run("default", ["pipeline=[load,detect,quantize]"], model=model)


def test_the_api_runs_on_a_comfyui_model_in_place_and_teardown_restores_it(krea2, tmp_path):
    model, _ = krea2
    result = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize]"], model=model, run_dir=tmp_path / "run")
    assert result.report["detect"]["names"] == "native" and isinstance(_layer(model), QuantLinear)
    report = lowbit_pipe.teardown(result)
    assert report["unfreed"] == [] and not isinstance(_layer(model), QuantLinear)


def test_install_writes_the_node_pack_entry(tmp_path):
    from lowbit_pipe.comfy.install import SHIM, install
    from lowbit_pipe.errors import LowbitError

    with pytest.raises(LowbitError, match="not a ComfyUI folder"):
        install(tmp_path)
    (tmp_path / "custom_nodes").mkdir()
    (tmp_path / "comfy").mkdir()
    path = install(tmp_path)
    assert path.read_text() == SHIM and install(tmp_path) == path  # idempotent
    path.write_text("# someone else's\n")
    with pytest.raises(LowbitError, match="--force"):
        install(tmp_path)
    assert install(tmp_path, force=True).read_text() == SHIM
    compile(SHIM, "shim", "exec")
