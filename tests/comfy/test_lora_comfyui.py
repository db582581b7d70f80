"""LoRA files against a real ComfyUI (0.29.0, imported in a child process on the CPU; slow).

1. The export's residual LoRA file (`<stem>.lora.safetensors`): stock ComfyUI's LoRA loading on the float
   MODEL patches every weight to W + delta (the residual branches at strength 1) to fp32 rounding, with no
   "lora key not loaded"; in both key styles (native names for export.layout=comfy, peft / diffusers for
   export.layout=diffusers); FLUX.1's fused qkv / linear1 get one exact pair each, and its final
   modulation (native rows = diffusers' with the halves swapped) its rows swapped.
2. lowbit_pipe's LoRA node on a quantized file loaded by ComfyUI's "Load Diffusion Model" (comfy.ops'
   mixed-precision Linears, comfy-kitchen QuantizedTensor weights, native names): peft, kohya, diffusers
   (`transformer.`), AI-toolkit (`diffusion_model.`) and native files, and the residual file itself, give
   per layer ComfyUI's own quantized output + strength * B(A x) (fp64 oracle), Krea 2 and FLUX.1, stock
   kinds without the node pack and lowbit kinds with it.

Oracles: for the example LoRAs, the native-style file of the same seed (it names ComfyUI's module with its
full fused rows: delta = alpha / rank * up @ down, no name mapping); for the residual file, the branches
on the lowbit_pipe model (delta of each diffusers layer, placed at its rows of the native module).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from comfyui_harness import ROOT, run_child
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import lowbit_pipe
from lowbit_pipe import lora
from lowbit_pipe.lora.make_example import STYLES, example_lora

pytestmark = pytest.mark.slow

sys.path.insert(0, str(ROOT / "bench"))
from comfy_check import TINY  # noqa: E402  (tiny configs ComfyUI's model detection accepts)

CHILD = Path(__file__).with_name("comfyui_lora_child.py")
STRENGTH = 0.8
EXAMPLE = {"rank": 4, "seed": 5, "rel": 0.02}
# (arch, quantize overrides, needs the node pack): stock kinds load without it, lowbit kinds only with it.
QUANTIZED = [("krea2", ["quantize.default.format=int8"], False),
             ("flux1", ["quantize.default.format=nvfp4"], False),
             ("krea2", ["quantize.default.format=nvfp4", "quantize.default.rotation=convrot"], True),
             ("flux1", ["quantize.default.format=int8", "quantize.default.rotation=quarot"], True)]


def _native_oracle(sd: dict) -> dict[str, torch.Tensor]:
    out = {}
    for key, down in sd.items():
        if key.endswith(".lora_A.weight"):
            module = key[len("diffusion_model."): -len(".lora_A.weight")]
            up = sd[key.replace("lora_A", "lora_B")].double()
            alpha = float(sd[key.replace("lora_A.weight", "alpha")])
            out[module] = up @ down.double() * (alpha / down.shape[0])
    return out


def _branch_oracle(model, arch, config, native_rows: dict[str, int]) -> dict[str, torch.Tensor]:
    """{native module: the residual branches' delta W} of a diffusers-named lowbit_pipe model."""
    out: dict[str, torch.Tensor] = {}
    for name, stack in lora.export.residual_stacks(model).items():
        native, rows = arch.to_native(name, config)
        delta = out.setdefault(native, torch.zeros(native_rows[native], stack.in_features, dtype=torch.float64))
        d = stack.up.double() @ stack.down.double()
        if arch.keymap.is_swapped(native):  # FLUX norm_out.linear: native rows are (shift, scale), diffusers' swapped
            d = torch.cat([d[d.shape[0] // 2:], d[: d.shape[0] // 2]])
        delta[rows if rows is not None else slice(None)] += d
    return out


def _distinct_peft(model, arch, seed: int) -> dict[str, torch.Tensor]:
    """The example peft LoRA with a down of its own per diffusers module (the example shares one per fused
    native module): the residual export must then place the fused parts block-diagonally."""
    sd, _ = example_lora(model, arch, style="peft", rank=3, seed=seed, rel=0.02)
    gen = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(v.shape, generator=gen) / v.shape[1] ** 0.5 if k.endswith("lora_A.weight") else v)
            for k, v in sd.items()}


@pytest.fixture(scope="module")
def comfyui(comfyui_src) -> Path:
    return comfyui_src


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    """Files and oracles for both checks, made by lowbit_pipe in this process."""
    tmp = tmp_path_factory.mktemp("lora_cases")
    jobs = {"stock": {"weights": [], "attach": []}, "pack": {"weights": [], "attach": []}}
    summary = {"fused_pairs": {}}
    examples = {}
    for arch_id in ("krea2", "flux1"):
        floating = lowbit_pipe.run("default", [*TINY[arch_id], "pipeline=[load,detect,export]",
                                               f"export.path={tmp / f'{arch_id}_float.safetensors'}"],
                                   run_dir=tmp / f"{arch_id}_float")
        arch = floating.context.arch
        files = {}
        for style in STYLES:
            sd, meta = example_lora(floating.model, arch, style=style, **EXAMPLE)
            files[style] = tmp / f"{arch_id}_{style}.safetensors"
            save_file(sd, str(files[style]), metadata=meta)
            if style == "native":
                save_file(_native_oracle(sd), str(tmp / f"{arch_id}_example_oracle.safetensors"))
        examples[arch_id] = (floating, files)
    for i, (arch_id, overrides, pack) in enumerate(QUANTIZED):
        floating, files = examples[arch_id]
        run = lowbit_pipe.run("default", [*TINY[arch_id], "pipeline=[load,detect,quantize]", *overrides],
                              run_dir=tmp / f"q{i}")
        model, arch, config = run.model, run.context.arch, run.context.arch_config
        lora.attach(model, example_lora(model, arch, style="kohya", rank=4, seed=20 + i, rel=0.02)[0], name="k",
                    strength=0.7)
        lora.attach(model, _distinct_peft(model, arch, 30 + i), name="p", strength=0.4)
        if arch_id == "flux1":  # a float modulation whose native rows are swapped halves
            gen = torch.Generator().manual_seed(40 + i)
            lora.attach(model, {"transformer.norm_out.linear.lora_A.weight": torch.randn(2, 256, generator=gen) * 0.05,
                                "transformer.norm_out.linear.lora_B.weight": torch.randn(512, 2, generator=gen) * 0.05},
                        name="m")
        out = tmp / f"q{i}" / "export"
        figures = lowbit_pipe.export(model, out / "model.safetensors")
        float_rows = {k[: -len(".weight")]: v.shape[0] for k, v in load_file(floating.export_path).items()
                      if k.endswith(".weight") and v.dim() == 2}
        oracle = tmp / f"q{i}_residual_oracle.safetensors"
        save_file(_branch_oracle(model, arch, config, float_rows), str(oracle))
        mode = "pack" if pack else "stock"
        example_oracle = str(tmp / f"{arch_id}_example_oracle.safetensors")
        for style, path in files.items():
            jobs[mode]["attach"].append({"name": f"{arch_id} {overrides} {style}", "model": figures["path"],
                                         "lora": str(path), "strength": STRENGTH, "oracle": example_oracle})
        jobs[mode]["attach"].append({"name": f"{arch_id} {overrides} residual file", "model": figures["path"],
                                     "lora": figures["lora_path"], "strength": 1.0, "oracle": str(oracle)})
        if not pack:  # the residual file on the float MODEL through ComfyUI's own LoRA loader, both key styles
            diffusers = lowbit_pipe.export(model, out / "diffusers" / "model.safetensors", layout="diffusers")
            for style, lora_file in (("native", figures["lora_path"]), ("diffusers", diffusers["lora_path"])):
                jobs["stock"]["weights"].append({"name": f"{arch_id} {overrides} {style} keys",
                                                 "model": floating.export_path, "lora": lora_file, "strength": 1.0,
                                                 "oracle": str(oracle)})
            with safe_open(figures["lora_path"], "pt") as f:
                summary["fused_pairs"][arch_id] = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()
                                                   if ".qkv." in k or ".linear1." in k}
                summary.setdefault("keys", {})[arch_id] = list(f.keys())
            with safe_open(diffusers["lora_path"], "pt") as f:
                summary.setdefault("diffusers_keys", {})[arch_id] = list(f.keys())
        del run, model
    return {"jobs": jobs, "tmp": tmp, **summary}


@pytest.fixture(scope="module")
def results(comfyui, cases) -> dict:
    out = {}
    for mode, job in cases["jobs"].items():
        result = run_child(CHILD, {"comfyui": str(comfyui), "install_pack": mode == "pack", **job},
                           cases["tmp"] / f"child_{mode}")
        assert "error" not in result, result.get("traceback")
        out[mode] = result
    return out


def test_the_residual_file_names_the_exported_checkpoints_native_modules(cases):
    keys = cases["keys"]
    assert all(k.startswith("diffusion_model.") for ks in keys.values() for k in ks)
    assert "diffusion_model.blocks.0.attn.wq.lora_A.weight" in keys["krea2"]
    fused = cases["fused_pairs"]["flux1"]
    # kohya rank 4 (one down shared by q, k, v) + distinct peft rank 3 per part: 4 + 3 * 3 columns
    assert fused["diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"] == (13, 256)
    assert fused["diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight"] == (768, 13)
    assert fused["diffusion_model.single_blocks.0.linear1.lora_B.weight"] == (1792, 4 + 4 * 3)
    assert all(k.startswith("transformer.") for ks in cases["diffusers_keys"].values() for k in ks)


@pytest.mark.comfyui
def test_stock_comfyui_loads_the_residual_file_as_the_branches(results):
    checked = results["stock"]["weights"]
    assert len(checked) == 4
    for case in checked:
        assert case["not_loaded"] == [], case["name"]
        assert case["patch_keys"] == case["oracle_keys"], case["name"]
        if "flux1" in case["name"]:
            assert "diffusion_model.final_layer.adaLN_modulation.1.weight" in case["oracle_keys"]
        for row in case["layers"]:
            assert row["dtype"] == "torch.float32", (case["name"], row)
            # fp32 rounding of W + delta: a few ulps of the weight
            assert row["max_abs_err"] <= 4e-7 * row["max_abs_weight"] + 1e-9, (case["name"], row)
            assert row["max_abs_delta"] > 1e3 * row["max_abs_err"], (case["name"], row)


@pytest.mark.comfyui
@pytest.mark.parametrize("mode", ["stock", "pack"])
def test_the_lora_node_is_exact_on_layers_comfyui_loaded_quantized(results, mode):
    checked = results[mode]["attach"]
    assert len(checked) == 2 * (len(STYLES) + 1)
    for case in checked:
        rows = case["layers"]
        assert rows, case["name"]
        assert any(r["quantized"] for r in rows) and not any(r["is_nn_linear"] for r in rows if r["quantized"])
        if "flux1" in case["name"]:
            assert {"double_blocks.0.img_attn.qkv", "single_blocks.0.linear1"} <= {r["module"] for r in rows}
            if "residual" in case["name"]:
                assert "final_layer.adaLN_modulation.1" in {r["module"] for r in rows}
        for r in rows:
            assert r["shares_weight"], (case["name"], r)  # nothing requantized or copied
            assert r["max_abs_err"] <= 1e-6 * r["max_abs_out"] + 1e-7, (case["name"], r)
            assert r["max_abs_delta_out"] > 1e3 * r["max_abs_err"], (case["name"], r)
        assert case["forward_finite"] and case["forward_rel_change"] > 1e-4, case["name"]
