"""The ComfyUI node pack on MODEL objects, without ComfyUI: a stand-in ModelPatcher with ComfyUI's
object-patch semantics (clone shares the model; object patches override attributes; get_model_object
reads through them) around a natively named diffusion model."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import native_module
from safetensors.torch import load_file

import lowbit_pipe
import lowbit_pipe.errors
from lowbit_pipe.arch.tiny import tiny_model_config
from lowbit_pipe.comfy.node_runs import PurgedModelError
from lowbit_pipe.comfy.nodes import (
    NODE_CLASS_MAPPINGS,
    LowbitExampleInputs,
    LowbitExport,
    LowbitLoRA,
    LowbitPurge,
    LowbitQuantize,
)
from lowbit_pipe.comfy.weight_patches import UnsupportedPatchError
from lowbit_pipe.lora.make_example import example_lora
from lowbit_pipe.quant.nn import QuantLinear


class BaseModel(torch.nn.Module):
    def __init__(self, diffusion_model: torch.nn.Module):
        super().__init__()
        self.diffusion_model = diffusion_model


class Patcher:
    """What ComfyUI's ModelPatcher offers a node: clone() shares the model, object patches on top."""

    def __init__(self, model: BaseModel, object_patches: dict | None = None):
        self.model, self.object_patches = model, dict(object_patches or {})
        self.load_device, self.offload_device, self.patches = torch.device("cpu"), torch.device("cpu"), {}

    def clone(self) -> "Patcher":
        return Patcher(self.model, self.object_patches)

    def add_object_patch(self, name: str, obj) -> None:
        self.object_patches[name] = obj

    def get_model_object(self, name: str):
        return self.object_patches[name] if name in self.object_patches else self.model.get_submodule(name)


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """Without ComfyUI (no folder_paths) a node writes its run dir under the working directory (nodes._run_dir):
    here the test's own folder, never the checkout's runs/."""
    monkeypatch.chdir(tmp_path)


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
    for name, cls in NODE_CLASS_MAPPINGS.items():
        types = cls.INPUT_TYPES()
        assert "model" in types["required"] and hasattr(cls, cls.FUNCTION) and cls.CATEGORY == "lowbit_pipe"
        assert isinstance(cls.RETURN_TYPES, tuple) and len(cls.OUTPUT_TOOLTIPS) == len(cls.RETURN_TYPES), name
        assert len(cls.DESCRIPTION) > 80, name  # ComfyUI shows it as the node's help
        for group in ("required", "optional"):
            for key, spec in types.get(group, {}).items():
                assert len(spec) == 2 and spec[1].get("tooltip"), f"{name}.{key} has no tooltip"


class LoRAAdapter:
    """ComfyUI's low-rank weight adapter as its patches carry it (comfy/weight_adapter/lora.py): `name` and the
    `weights` tuple (up, down, alpha, mid, dora_scale, reshape)."""

    name = "lora"

    def __init__(self, up, down, alpha=None, dora_scale=None):
        self.weights = (up, down, alpha, None, dora_scale, None)


def _stock_lora(model: Patcher, layers: list[str], rank: int = 4, strength: float = 0.7, alpha: float = 2.0) -> dict:
    """ComfyUI LoraLoader-style patches on `layers`; returns {layer: float delta W} (strength * alpha/rank * B A)."""
    g = torch.Generator().manual_seed(11)
    deltas = {}
    for layer in layers:
        w = model.model.diffusion_model.get_submodule(layer).weight
        up, down = torch.randn(w.shape[0], rank, generator=g) * 0.05, torch.randn(rank, w.shape[1], generator=g) * 0.05
        model.patches[f"diffusion_model.{layer}.weight"] = [(strength, LoRAAdapter(up, down, torch.tensor(alpha)), 1.0,
                                                             None, None)]
        deltas[layer] = strength * alpha / rank * (up @ down)
    return deltas


def test_quantize_lora_export_purge_on_a_comfyui_model(krea2, tmp_path, monkeypatch):
    model, lora_file = krea2
    original = model.model.diffusion_model
    before = {k: v.clone() for k, v in original.state_dict().items()}

    (quantized, report) = LowbitQuantize().quantize(model, "default", "quantize.default.format=int8", unique_id="7")
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

    monkeypatch.chdir(tmp_path)  # outside ComfyUI the node writes under the working directory
    shown = LowbitExport().export(a, "out/m.safetensors")
    assert shown["result"][0] == "out/m.safetensors"  # relative: the UI never shows the server's absolute paths
    assert "wrote out/m.safetensors" in shown["ui"]["text"][0] and str(tmp_path) not in shown["ui"]["text"][0]
    path = str(tmp_path / shown["result"][0])
    # A ComfyUI model carries no diffusers constructor config: a reload of a tiny one names it.
    config = [f"+model.config.{k}={v}".replace(" ", "") for k, v in tiny_model_config("krea2").items()]
    again = lowbit_pipe.run("default", [f"model.path={path}", "pipeline=[load]", *config], run_dir=tmp_path / "reload")
    assert isinstance(again.model.get_submodule("transformer_blocks.0.attn.to_q"), QuantLinear)

    refs = [weakref.ref(m) for t in (quantized, a, b) for m in t.get_model_object("diffusion_model").modules()
            if isinstance(m, QuantLinear)]
    assert refs
    count, other = LowbitQuantize.IS_CHANGED(unique_id="7"), LowbitQuantize.IS_CHANGED(unique_id="8")
    latent = {"samples": torch.zeros(1)}
    shown = LowbitPurge().purge(b, after=latent)
    assert shown["result"][0] is latent  # the pass-through
    text = shown["ui"]["text"][0]
    gc.collect()
    assert '"retained_bytes": 0' in text and '"unfreed": []' in text, text
    assert all(r() is None for r in refs)  # every quantized layer of every MODEL made from the run is gone
    assert LowbitQuantize.IS_CHANGED(unique_id="7") != count  # a re-queue re-runs the Quantize node
    assert LowbitQuantize.IS_CHANGED(unique_id="8") == other  # another node's run was not purged: it stays cached
    for t in (quantized, a, b):  # those MODELs (ComfyUI may still cache them) refuse to run: never a float result
        tree = t.get_model_object("diffusion_model")
        assert not any(isinstance(m, QuantLinear) or "lora" in m._modules for m in tree.modules())
        with pytest.raises(PurgedModelError, match="node 7.*purged.*Queue the workflow again"):
            tree(x)
    with pytest.raises(PurgedModelError, match="LoRA residual"):
        LowbitLoRA().attach(a, lora_file, 1.0)
    with pytest.raises(PurgedModelError, match="Export"):
        LowbitExport().export(b, "out/again.safetensors")
    assert "already purged" in LowbitPurge().purge(a)["ui"]["text"][0]
    after = original.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert _layer(model)(x).shape == (3, _layer(model).out_features)  # the float MODEL upstream still runs


def test_comfyui_lora_patches_become_exact_residual_branches(krea2):
    model, _ = krea2
    layers = ["blocks.0.attn.wq", "blocks.1.mlp.down", "first"]  # "first" stays float (Krea 2 keep-float list)
    deltas = _stock_lora(model, layers)
    (quantized, report) = LowbitQuantize().quantize(model, "default", "quantize.default.format=int8")
    (plain, _) = LowbitQuantize().quantize(Patcher(model.model), "default", "quantize.default.format=int8")
    assert "ComfyUI LoRA patches on 2 quantized layers became exact residual branches" in report
    for layer in layers[:2]:
        xin = torch.randn(5, _layer(model, layer).in_features, generator=torch.Generator().manual_seed(2))
        want = _layer(plain, layer)(xin) + xin @ deltas[layer].t()  # quantized layer + exact delta on its float input
        assert torch.allclose(_layer(quantized, layer)(xin), want, rtol=1e-5, atol=1e-6), layer
    # Patches on the quantized layers left the new MODEL (ComfyUI must not patch packed weights); the float
    # layer's patch stays ComfyUI's; the MODEL given keeps all of its own.
    assert set(quantized.patches) == {"diffusion_model.first.weight"} and len(model.patches) == 3


def test_a_comfyui_dora_patch_on_a_quantized_layer_is_refused_naming_it(krea2):
    model, _ = krea2
    _stock_lora(model, ["blocks.0.attn.wq"])
    (strength, adapter, *rest) = model.patches["diffusion_model.blocks.0.attn.wq.weight"][0]
    adapter.weights = adapter.weights[:4] + (torch.ones(1),) + adapter.weights[5:]  # a DoRA magnitude
    with pytest.raises(UnsupportedPatchError, match="blocks.0.attn.wq.weight.*DoRA.*LoRA residual"):
        LowbitQuantize().quantize(model, "default", "quantize.default.format=int8")


def test_quantize_refuses_a_model_a_lowbit_node_made(krea2):
    model, _ = krea2
    (quantized, _) = LowbitQuantize().quantize(model, "default", "quantize.default.format=int8")
    with pytest.raises(ValueError, match="already"):
        LowbitQuantize().quantize(quantized, "default", "")


def test_example_inputs_fit_the_model(krea2):
    model, _ = krea2
    (conditioning, latent) = LowbitExampleInputs().make(model, 64, 32, 7, 2, 0)
    tree = model.model.diffusion_model
    assert latent["samples"].shape == (2, tree.first.in_features // 4, 4, 8)
    assert conditioning[0][0].shape == (2, 7, tree.txtfusion.projector.in_features * tree.txtmlp._modules["1"].in_features)


def test_a_model_with_comfyui_lora_patches_is_refused(krea2, tmp_path):
    model, _ = krea2
    model.patches = {"diffusion_model.blocks.0.attn.wq.weight": [object()]}
    with pytest.raises(lowbit_pipe.errors.StageError, match="LoRA twice|weight patches"):
        lowbit_pipe.run("default", ["pipeline=[load,detect,quantize]"], model=model, run_dir=tmp_path / "run")


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


def test_quantize_refuses_a_quantized_model_and_a_recipe_of_another_arch(krea2):
    import copy

    model, _ = krea2
    text = "defaults: [flux1_fp8]\nquantize:\n  rules:\n    - {match: 'double_blocks.*', keep: true}\n"
    with pytest.raises(ValueError, match=r"'<YAML text>': quantize.rules\[0\].match 'double_blocks.\*' matches no layer.*written "
                                         "for flux1; this MODEL is krea2"):
        LowbitQuantize().quantize(model, text, "")
    tree = copy.deepcopy(model.model.diffusion_model)
    lowbit_pipe.quantize(tree, {"default": {"format": "int8"}})
    with pytest.raises(ValueError, match=r"quantized already \(\d+ layers, e.g. 'blocks.*Quantize takes a float"):
        LowbitQuantize().quantize(Patcher(BaseModel(tree)), "default", "")
    assert not isinstance(_layer(model), QuantLinear)


def test_old_node_run_folders_are_pruned(tmp_path):
    import os

    from lowbit_pipe.comfy.nodes import prune_runs

    for i in range(5):
        run = tmp_path / f"2026-12-0{i + 1}" / f"10-00-00-node{i}"
        run.mkdir(parents=True)
        (run / "report.json").write_text("{}")
        os.utime(run, (1000 + i, 1000 + i))
    (tmp_path / "2026-12-01" / "notes.txt").write_text("not a run")
    removed = prune_runs(tmp_path, keep=2)
    assert [p.name for p in removed] == ["10-00-00-node0", "10-00-00-node1", "10-00-00-node2"]
    assert sorted(p.name for p in tmp_path.glob("*/*-node*")) == ["10-00-00-node3", "10-00-00-node4"]
    assert (tmp_path / "2026-12-01" / "notes.txt").exists() and not (tmp_path / "2026-12-02").exists()


def test_quantize_shows_its_summary_on_the_node_and_takes_recipe_text_over_the_list(krea2):
    model, _ = krea2
    shown = LowbitQuantize().quantize_node(model, "default", "quantize.default.format=int8", unique_id="21")
    quantized, summary = shown["result"]
    assert shown["ui"]["text"] == [summary] and summary.startswith("lowbit_pipe run: ok")  # ComfyUI's `ui` text
    assert isinstance(_layer(quantized), QuantLinear)
    text = LowbitQuantize().quantize_node(model, "default", "", recipe_text="quantize:\n  default:\n    format: fp8\n")
    assert "fp8" in text["ui"]["text"][0] and "int8" not in text["ui"]["text"][0].split("arch:")[1].split("float")[0]
    with pytest.raises(ValueError, match=r"^recipe: '/etc/passwd' is not 'auto', a packaged recipe, a \.yaml file "
                                         r"in models/lowbit_recipes/, or YAML text\npackaged recipes: default"):
        LowbitQuantize().quantize_node(model, "auto", "", recipe_text="/etc/passwd")  # the cause first, one line
    for made in (shown, text):
        LowbitPurge().purge(made["result"][0])


def test_the_recipe_list_offers_the_packaged_recipes_the_node_runs_and_still_takes_any_text():
    from lowbit_pipe.comfy.node_inputs import offered_recipes
    from lowbit_pipe.paths import packaged_recipes

    spec = LowbitQuantize.INPUT_TYPES()
    choices = spec["required"]["recipe"][0]
    assert choices[0] == "auto" and choices[1:] == offered_recipes()
    assert {"default", "flux1_fp8", "krea2_nvfp4", "krea2_nvfp4_stock", "krea2_svdquant"} <= set(choices)
    assert not any(name.endswith("_tiny") for name in choices) and "krea2_auto_speed_tiny" in packaged_recipes()
    assert "krea2_auto_speed" not in choices  # quantize.target: planned by the CLI, refused in the node
    assert "krea2_nvfp4_lora" not in choices  # sets pipeline / lora, which the node does not run
    assert spec["optional"]["recipe_text"][0] == "STRING"
    # ComfyUI skips its list check for an input VALIDATE_INPUTS takes: an older workflow's text still queues
    assert LowbitQuantize.VALIDATE_INPUTS(recipe="quantize:\n  default:\n    format: int8\n") is True
    assert LowbitQuantize.VALIDATE_INPUTS(recipe=None) is True  # a linked input is validated as None
    assert "not text" in LowbitQuantize.VALIDATE_INPUTS(recipe=3)


def test_example_inputs_seed_defaults_to_fixed_in_the_ui():
    seed = LowbitExampleInputs.INPUT_TYPES()["required"]["seed"][1]
    assert seed["control_after_generate"] == "fixed"  # ComfyUI's front end: default mode, never "randomize"
