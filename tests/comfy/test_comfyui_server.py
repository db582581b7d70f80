"""The node pack inside a running ComfyUI server, driven through its HTTP API as a user's browser drives it.

ComfyUI 0.29.0 (../shared/comfyui-0.29.0.tar.xz or LOWBIT_COMFYUI_ARCHIVE, GPL-3, a test fixture; skipped without it), unpacked once per session and shared read-only (conftest.py comfyui_src), is
run with `main.py --cpu` from a Python as a ComfyUI user has it: a venv with ComfyUI's own pinned
requirements (comfy-kitchen 0.2.24 among them), where lowbit_pipe is installed with the README's command and
the node pack with `python -m lowbit_pipe.comfy install --base-directory`. Workflows are queued with
POST /prompt; results are read from /history and from the latents SaveLatent writes. Tiny Krea 2 / FLUX.1
models in the sizes ComfyUI detects (model=tiny_*_comfy). Slow: a server start is ~30 s on 2 cores.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import comfyui_server as cs

pytestmark = [pytest.mark.slow, pytest.mark.comfyui]

ARCHS = ("krea2", "flux1")


@dataclass
class Env:
    src: Path
    base: Path
    python: str
    server: cs.ComfyUIServer
    comfy_kitchen: tuple[str | None, str | None]  # before / after the README's pip install
    launched: dict[str, cs.ComfyUIServer] = field(default_factory=dict)  # the other servers, loading (SERVERS)


def _write_models(base: Path, tmp: Path) -> None:
    """Float tiny Krea 2 / FLUX.1 files and seeded LoRA files (peft and kohya styles) into the models folders."""
    from safetensors.torch import save_file

    import lowbit_pipe
    from lowbit_pipe.lora.make_example import example_lora

    (base / "models" / "diffusion_models").mkdir(parents=True, exist_ok=True)
    (base / "models" / "loras").mkdir(parents=True, exist_ok=True)
    for arch in ARCHS:
        result = lowbit_pipe.run("default", [f"model=tiny_{arch}_comfy", "pipeline=[load,detect,export]",
                                             f"export.path={base / 'models' / 'diffusion_models' / f'{arch}.safetensors'}"],
                                 run_dir=tmp / f"float_{arch}")
        for style in ("peft", "kohya"):
            state, meta = example_lora(result.model, result.context.arch, style=style, rank=8, seed=5, rel=0.3)
            save_file(state, str(base / "models" / "loras" / f"{arch}_{style}.safetensors"), metadata=meta or None)


# A test-only node for the stock server (no lowbit_pipe there): seeded text states of any width, so a Krea 2
# model samples without its text encoder (FLUX.1 uses stock LotusConditioning). Test infrastructure, not the pack.
TEXT_STATES_NODE = '''import torch


class LowbitTestTextStates:
    CATEGORY = "testing"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"features": ("INT", {"default": 480, "min": 1, "max": 100000}),
                             "tokens": ("INT", {"default": 8, "min": 1, "max": 4096}),
                             "seed": ("INT", {"default": 0, "min": 0, "max": 2**31})}}

    def make(self, features, tokens, seed):
        g = torch.Generator().manual_seed(seed)
        return ([[torch.randn(1, tokens, features, generator=g), {}]],)


NODE_CLASS_MAPPINGS = {"LowbitTestTextStates": LowbitTestTextStates}
'''
TEST_NODES = "lowbit_test_nodes"
# The servers besides the pack's, by fixture: their ComfyUI arguments.
SERVERS = {"stock_server": ("--cpu", "--disable-all-custom-nodes", "--whitelist-custom-nodes", TEST_NODES),
           "attention_server": ("--cpu", "--use-pytorch-cross-attention")}


def _server(comfy: Env, name: str):
    """The fixture `name`'s server: the one `comfy` launched early (or launched now), once it answers."""
    server = comfy.launched.get(name) or cs.ComfyUIServer.launch(comfy.src, comfy.base, python=comfy.python,
                                                                 args=SERVERS[name])
    comfy.launched[name] = server
    yield server.wait_ready()
    server.stop()


@pytest.fixture(scope="module")
def comfy(tmp_path_factory, comfyui_src, server_python, request) -> Env:
    root = tmp_path_factory.mktemp("comfyui")
    src = comfyui_src  # the session's shared tree, read-only: the server's own files go under --base-directory
    # ComfyUI's pinned requirements, then the README's `pip install "lowbit_pipe[comfy]"` (conftest: one per session)
    python = server_python.python
    before, after = server_python.comfy_kitchen_before, server_python.comfy_kitchen_after
    base = root / "base"
    cs.install_pack(base, python)
    (base / "custom_nodes" / TEST_NODES).mkdir(parents=True)
    (base / "custom_nodes" / TEST_NODES / "__init__.py").write_text(TEXT_STATES_NODE)
    server = cs.ComfyUIServer.launch(src, base, python=python)
    _write_models(base, root)  # while it loads (it lists the model folders at the first request, not at start)
    server.wait_ready()
    # The module's other servers that a selected test uses, launched once this one has made its database: they load
    # (~20 s of one core each) while the first tests run, which keep one core waiting on this server.
    needed = [name for name in SERVERS if any(item.path == request.path and name in item.fixturenames
                                              for item in request.session.items)]
    env = Env(src, base, python, server, (before, after),
              {name: cs.ComfyUIServer.launch(src, base, python=python, args=SERVERS[name]) for name in needed})
    yield env
    for each in (server, *env.launched.values()):
        each.stop()


# ---------------------------------------------------------------------------------------------- graphs
def loader(arch: str, name: str | None = None) -> dict[str, Any]:
    return {"class_type": "UNETLoader", "inputs": {"unet_name": name or f"{arch}.safetensors", "weight_dtype": "default"}}


KREA2_TEXT_FEATURES = 3 * 160  # tiny_krea2_comfy: 3 text layers x 160


def sampler_nodes(arch: str, model: list, seed: int, prefix: str, *, after: list | None = None,
                  float_model: list | None = None, stock: bool = False) -> dict[str, Any]:
    """Nodes that sample `model` 2 Euler steps at 64 x 64 from a text-encoder-free conditioning (FLUX.1: stock
    LotusConditioning; Krea 2: the pack's Example inputs from `float_model`, or with `stock` the test node's
    text states and an empty latent) and save the latent."""
    p = prefix
    if arch == "krea2" and stock:
        nodes = {f"{p}c": {"class_type": "LowbitTestTextStates", "inputs": {"features": KREA2_TEXT_FEATURES,
                                                                             "tokens": 8, "seed": 0}},
                 f"{p}l": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}}
        cond, latent = [f"{p}c", 0], [f"{p}l", 0]
    elif arch == "flux1":
        nodes = {f"{p}c": {"class_type": "LotusConditioning", "inputs": {}},
                 f"{p}l": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}}
        cond, latent = [f"{p}c", 0], [f"{p}l", 0]
    else:
        nodes = {f"{p}e": {"class_type": "LowbitExampleInputs", "inputs": {
            "model": float_model or model, "width": 64, "height": 64, "text_tokens": 8, "batch_size": 1, "seed": 0}}}
        cond, latent = [f"{p}e", 0], [f"{p}e", 1]
    nodes[f"{p}k"] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": seed, "steps": 2, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
        "positive": cond, "negative": cond, "latent_image": after or latent, "denoise": 1.0}}
    nodes[f"{p}s"] = {"class_type": "SaveLatent", "inputs": {"samples": [f"{p}k", 0], "filename_prefix": f"latents/{p}"}}
    return nodes


def quantize(model: list, recipe: str = "default", overrides: str = "") -> dict[str, Any]:
    return {"class_type": "LowbitQuantize", "inputs": {"model": model, "recipe": recipe, "overrides": overrides}}


def lowbit_lora(model: list, name: str, strength: float = 1.0) -> dict[str, Any]:
    return {"class_type": "LowbitLoRA", "inputs": {"model": model, "lora_name": name, "strength": strength}}


def sample(env: Env, arch: str, model_nodes: dict[str, Any], model: list, seed: int, prefix: str,
           float_model: list | None = None) -> torch.Tensor:
    """Queue `model_nodes` + a sampler on `model`; the saved latent."""
    graph = {**model_nodes, **sampler_nodes(arch, model, seed, prefix, float_model=float_model)}
    entry = env.server.run(graph)
    return env.server.latent(entry, f"{prefix}s")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ---------------------------------------------------------------------------------------------- tests
def test_the_readme_install_keeps_comfyuis_pins_and_registers_the_nodes(comfy):
    before, after = comfy.comfy_kitchen
    assert before == "0.2.24" and after == before, f"pip install lowbit_pipe[comfy] moved comfy-kitchen {before} -> {after}"
    info = comfy.server.object_info()
    for node in ("LowbitQuantize", "LowbitLoRA", "LowbitExport", "LowbitPurge", "LowbitExampleInputs"):
        assert node in info, f"{node} not registered; server log:\n{comfy.server.log(40)}"
        assert info[node]["description"], node
    purge = info["LowbitPurge"]
    assert purge["output_node"] and "after" in purge["input"]["optional"]


@pytest.mark.parametrize("arch", ARCHS)
def test_purge_then_requeue_gives_the_quantized_result_again(comfy, arch):
    """Quantize -> LoRA -> sample -> Export -> Purge; a re-queue with a new seed samples quantized again, by itself."""
    comfy.server.free()
    lora = f"{arch}_peft.safetensors"
    m = {"m": loader(arch), "q": quantize(["m", 0]), "r": lowbit_lora(["q", 0], lora)}
    reference = sample(comfy, arch, m, ["r", 0], 2, f"ref_{arch}_", float_model=["m", 0])  # before any purge
    floating = sample(comfy, arch, {"m": loader(arch)}, ["m", 0], 2, f"flt_{arch}_")
    unlora = sample(comfy, arch, {"m": loader(arch), "q": quantize(["m", 0])}, ["q", 0], 2, f"unl_{arch}_",
                    float_model=["m", 0])

    def workflow(seed: int) -> dict[str, Any]:
        g = {**m, **sampler_nodes(arch, ["r", 0], seed, "w_", float_model=["m", 0])}
        g["x"] = {"class_type": "LowbitExport", "inputs": {"model": ["r", 0], "filename": f"lowbit/{arch}_int8.safetensors",
                                                            "overwrite": True}}  # the re-queue writes it again
        g["p"] = {"class_type": "LowbitPurge", "inputs": {"model": ["r", 0], "after": ["w_k", 0]}}
        return g

    first = comfy.server.run(workflow(1))
    text = comfy.server.texts(first, "p")[0]
    assert '"retained_bytes": 0' in text and '"unfreed": []' in text and '"proven": true' in text, text
    assert "wrote" in comfy.server.texts(first, "x")[0]
    assert (comfy.base / "models" / "diffusion_models" / "lowbit" / f"{arch}_int8.safetensors").is_file()
    second = comfy.server.run(workflow(2))  # same graph, new seed: no cache clearing by hand
    again = comfy.server.latent(second, "w_s")
    assert torch.equal(again, reference), "the re-queued workflow did not sample the quantized model again"
    assert rel(again, floating) > 1e-4 and rel(reference, unlora) > 1e-4  # quantized, with its LoRA; not float


def test_a_purged_model_refuses_to_run(comfy):
    """Purge ordered before a sampler of the same MODEL: the sampler fails naming the purge, never runs float."""
    comfy.server.free()
    g = {"m": loader("flux1"), "q": quantize(["m", 0]),
         "l": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}}
    g["p"] = {"class_type": "LowbitPurge", "inputs": {"model": ["q", 0], "after": ["l", 0]}}
    g.update(sampler_nodes("flux1", ["q", 0], 3, "z_", after=["p", 0]))  # the sampler waits for the purge
    with pytest.raises(cs.PromptError, match="purged by Purge.*Purge ran before this node.*Purge's 'after' input"):
        comfy.server.run(g)


@pytest.mark.parametrize("arch", ARCHS)
def test_comfyui_lora_then_quantize_keeps_the_lora_exactly(comfy, arch):
    """A MODEL with ComfyUI's own LoRA goes into Quantize: its quantized layers carry the LoRA as branches, and
    the stock-LoRA MODEL keeps sampling with its LoRA afterwards (no crash, no lost patches)."""
    comfy.server.free()
    lora = f"{arch}_kohya.safetensors"
    stock = {"m": loader(arch), "s": {"class_type": "LoraLoaderModelOnly",
                                      "inputs": {"model": ["m", 0], "lora_name": lora, "strength_model": 0.8}}}
    with_lora = sample(comfy, arch, stock, ["s", 0], 4, f"sl_{arch}_", float_model=["m", 0])
    floating = sample(comfy, arch, {"m": loader(arch)}, ["m", 0], 4, f"sf_{arch}_")
    quantized_lora = sample(comfy, arch, {**stock, "q": quantize(["s", 0])}, ["q", 0], 4, f"sq_{arch}_",
                            float_model=["m", 0])
    quantized = sample(comfy, arch, {"m": loader(arch), "q2": quantize(["m", 0])}, ["q2", 0], 4, f"sp_{arch}_",
                       float_model=["m", 0])
    residual = sample(comfy, arch, {"m": loader(arch), "q2": quantize(["m", 0]), "r": lowbit_lora(["q2", 0], lora, 0.8)},
                      ["r", 0], 4, f"sr_{arch}_", float_model=["m", 0])
    again = sample(comfy, arch, stock, ["s", 0], 4, f"sa_{arch}_", float_model=["m", 0])
    assert torch.equal(again, with_lora), "the stock-LoRA MODEL changed after Quantize used it"
    assert rel(with_lora, floating) > 1e-3  # the LoRA does something
    # ComfyUI's LoRA became the same branches the pack's LoRA node adds from the same file.
    assert rel(quantized_lora, residual) < 1e-5, rel(quantized_lora, residual)
    assert rel(quantized_lora, quantized) > 0.3 * rel(with_lora, floating)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_exported_model_and_lora_file_load_back_in_comfyui(comfy, arch):
    """Quantize -> LoRA residual -> Export writes the model into models/diffusion_models and the branches into
    models/loras. Load Diffusion Model on the file + LoRA residual on the LoRA file samples what the node graph
    sampled; stock LoraLoaderModelOnly reads the LoRA file on the float model as the LoRA it came from."""
    comfy.server.free()
    name, strength = f"rt_{arch}", 0.8
    m = {"m": loader(arch), "q": quantize(["m", 0]), "r": lowbit_lora(["q", 0], f"{arch}_peft.safetensors", strength)}
    g = {**m, **sampler_nodes(arch, ["r", 0], 4, f"rt0_{arch}_", float_model=["m", 0]),
         "x": {"class_type": "LowbitExport", "inputs": {"model": ["r", 0], "filename": f"lowbit/{name}.safetensors"}}}
    entry = comfy.server.run(g)
    in_graph = comfy.server.latent(entry, f"rt0_{arch}_s")
    assert f"LoRA branches: loras/{name}.lora.safetensors" in comfy.server.texts(entry, "x")[0]  # relative to models/
    assert (comfy.base / "models" / "loras" / f"{name}.lora.safetensors").is_file()

    reloaded = sample(comfy, arch, {"m": loader(arch), "f": loader(arch, f"lowbit/{name}.safetensors"),
                                    "l": lowbit_lora(["f", 0], f"{name}.lora.safetensors", 1.0)},
                      ["l", 0], 4, f"rt1_{arch}_", float_model=["m", 0])
    assert rel(reloaded, in_graph) < 1e-4, rel(reloaded, in_graph)

    def stock_lora(file: str, strength_model: float) -> dict[str, Any]:
        return {"m": loader(arch), "s": {"class_type": "LoraLoaderModelOnly", "inputs": {
            "model": ["m", 0], "lora_name": file, "strength_model": strength_model}}}

    log_start = len(comfy.server.log())
    original = sample(comfy, arch, stock_lora(f"{arch}_peft.safetensors", strength), ["s", 0], 4, f"rt2_{arch}_",
                      float_model=["m", 0])
    from_export = sample(comfy, arch, stock_lora(f"{name}.lora.safetensors", 1.0), ["s", 0], 4, f"rt3_{arch}_",
                         float_model=["m", 0])
    floating = sample(comfy, arch, {"m": loader(arch)}, ["m", 0], 4, f"rt4_{arch}_")
    assert rel(original, floating) > 1e-3  # the LoRA does something
    assert rel(from_export, original) < 1e-5, rel(from_export, original)
    assert "lora key not loaded" not in comfy.server.log()[log_start:]


# ---------------------------------------------------------------------------------------------- every export kind
def _cases() -> dict[str, dict[str, str]]:
    from comfy_check import CASES

    return CASES


@pytest.fixture(scope="module")
def stock_server(comfy):
    """The same ComfyUI and models without the node pack (only the test-only text-states node)."""
    yield from _server(comfy, "stock_server")


def test_every_export_kind_loads_and_samples_stock_and_with_the_pack(comfy, stock_server, tmp_path):
    """Each kind lowbit_pipe exports, per arch: stock ComfyUI samples it as the pack does, or refuses it at its
    format lookup; with the pack it samples what the Quantize node's own layers sample, and never the float
    result."""
    import lowbit_pipe

    comfy.server.free()
    folder = comfy.base / "models" / "diffusion_models" / "kinds"
    pack_srv = comfy.server
    rows, problems = [], []
    for arch in ARCHS:
        floating = sample_stock(stock_server, arch, loader(arch), 7, f"kf_{arch}_")
        for case, spec in _cases().items():
            name = f"{arch}_{case.replace(' ', '_').replace('+', '_')}"
            # One unpadded calibration kind for the static-scale cases: the node and the CLI then calibrate on the same
            # inputs (ComfyUI's conditioning has no text mask; the CLI's padded kinds differ from it by design).
            overrides = [f"quantize.default.{k}={v}" for k, v in spec.items()] + ["quantize.calibration.kinds=[{}]"]
            # exported at the server's torch thread count (xdist_plan): svdquant's SVD as the server's node runs it
            result = lowbit_pipe.run("default", [f"model=tiny_{arch}_comfy", "pipeline=[load,detect,quantize,export]",
                                                 f"export.path={folder / f'{name}.safetensors'}", *overrides],
                                     run_dir=tmp_path / name)
            lowbit_kinds = bool(result.report["export"]["not_stock_comfy"])
            del result
            file_model = loader(arch, f"kinds/{name}.safetensors")
            try:
                stock = sample_stock(stock_server, arch, file_model, 7, f"ks_{name}_")
                stock_error = None
            except cs.PromptError as err:
                stock, stock_error = None, str(err)
            try:
                pack = sample_stock(pack_srv, arch, file_model, 7, f"kp_{name}_")
            except cs.PromptError as err:
                problems.append(f"{name}: refused with the pack: {err}")
                continue
            node = sample_stock(pack_srv, arch, {"m": loader(arch), "q": quantize(["m", 0], "default", "\n".join(overrides))},
                                7, f"kq_{name}_", model=["q", 0])
            rows.append((arch, case, lowbit_kinds, stock_error, rel(pack, floating), rel(pack, node)))
            if not torch.isfinite(pack).all():
                problems.append(f"{name}: not finite with the pack")
            if rel(pack, floating) <= 1e-5:
                problems.append(f"{name}: the pack sampled the float result")
            if stock is not None:
                if lowbit_kinds:
                    problems.append(f"{name}: stock ComfyUI loaded a file with lowbit kinds")
                elif not torch.equal(stock, pack):
                    problems.append(f"{name}: the pack changed how stock ComfyUI computes a stock kind")
            elif "KeyError" not in stock_error:
                problems.append(f"{name}: stock ComfyUI refused it, not at its format lookup: {stock_error}")
            # The file through the pack vs the Quantize node's own layers: lowbit kinds run the same Format.linear
            # (a file quantized from diffusers modules, the node's from ComfyUI's: fp32 rounding apart, 2e-5 seen);
            # stock fp8 / nvfp4 / mxfp8 run weight-only in ComfyUI on a CPU (disabled formats: dequantize + matmul)
            # while the node quantizes activations too (up to 2.5e-3 seen); stock int8 / convrot_w4a4 run
            # comfy-kitchen's kernels.
            # svdquant_w4a4: its branch is an SVD, whose last bits differ between two processes' LAPACK runs
            # (1.7e-4 seen on FLUX.1's fused layers, 4e-6 on Krea 2). nvfp4 with activations through the pack: the
            # fp32 difference can move one activation across an FP4 rounding boundary, a step of up to 1/6 of its
            # block's amax (3.5e-4 seen on Krea 2's nvfp4+convrot with per-token scales, 0 on FLUX.1); still 10x
            # under the distance to the float result.
            weight_only_here = not lowbit_kinds and spec["format"] in ("fp8", "nvfp4", "mxfp8")
            fp4_activations = lowbit_kinds and spec["format"] in ("svdquant_w4a4", "nvfp4")
            bound = 5e-3 if weight_only_here else 1e-3 if fp4_activations else 1e-4
            if rel(pack, node) > bound:
                problems.append(f"{name}: file vs Quantize node {rel(pack, node):.2e} > {bound}")
    print("\n".join(f"{r[0]:6s} {r[1]:14s} lowbit={r[2]!s:5s} stock={'refused' if r[3] else 'ok':8s} "
                     f"vs float {r[4]:.4f}  file vs node {r[5]:.2e}" for r in rows))
    assert not problems, "\n".join(problems)


def sample_stock(server: cs.ComfyUIServer, arch: str, model_node: dict[str, Any], seed: int, prefix: str,
                 model: list | None = None) -> torch.Tensor:
    """Sample with nodes both servers have (Krea 2 text states from the test node)."""
    nodes = model_node if model is not None else {"m": model_node}
    graph = {**nodes, **sampler_nodes(arch, model or ["m", 0], seed, prefix, stock=True)}
    return server.latent(server.run(graph), f"{prefix}s")


# ---------------------------------------------------------------------------------------------- calibration
@pytest.mark.parametrize("arch", ARCHS)
def test_a_calibrated_recipe_in_the_quantize_node_matches_the_cli(comfy, arch, tmp_path):
    """flux1_fp8 (static fp8 activations: every layer's input_scale calibrated) run by the Quantize node on the
    ComfyUI model (the arch's example inputs in ComfyUI's layout, through ComfyUI's own forward) writes the
    input scales the CLI calibrates on the diffusers model: same seeded inputs, two implementations. One calibration
    kind without text padding: ComfyUI's conditioning has no text mask, so a padded kind differs by design."""
    from safetensors.torch import load_file

    import lowbit_pipe

    comfy.server.free()
    out = f"lowbit/calibrated_{arch}.safetensors"
    kinds = "quantize.calibration.kinds=[{image_scale: 2.25, text_scale: 2.0}]"
    g = {"m": loader(arch), "q": quantize(["m", 0], "flux1_fp8", kinds),
         "x": {"class_type": "LowbitExport", "inputs": {"model": ["q", 0], "filename": out}}}
    entry = comfy.server.run(g)
    assert "the arch's example inputs, in ComfyUI's layout" in _report_json(comfy, entry)
    node_file = load_file(str(comfy.base / "models" / "diffusion_models" / out))
    cli = lowbit_pipe.run("flux1_fp8", [f"model=tiny_{arch}_comfy", "pipeline=[load,detect,quantize,export]", kinds,
                                        f"export.path={tmp_path / 'cli.safetensors'}"], run_dir=tmp_path / "cli")
    cli_file = load_file(cli.export_path)
    scales = sorted(k for k in cli_file if k.endswith(".input_scale"))
    assert len(scales) > 10 and scales == sorted(k for k in node_file if k.endswith(".input_scale"))
    worst = max(float((node_file[k] - cli_file[k]).abs().max() / cli_file[k].abs().max()) for k in scales)
    assert worst < 1e-4, f"input scales differ from the CLI's by up to {worst:.2e}"
    codes = [k for k in scales if torch.equal(node_file[k.replace("input_scale", "weight")],
                                              cli_file[k.replace("input_scale", "weight")])]
    assert codes == scales  # the weights themselves are quantized identically


def test_quantize_calibrates_on_the_nodes_conditioning(comfy):
    """A CONDITIONING wired into Quantize is what the calibration runs on: other text states, other scales."""
    from safetensors.torch import load_file

    comfy.server.free()
    g = {"m": loader("krea2"),
         "c": {"class_type": "LowbitTestTextStates", "inputs": {"features": KREA2_TEXT_FEATURES, "tokens": 8, "seed": 3}},
         "l": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
         "q": {"class_type": "LowbitQuantize", "inputs": {"model": ["m", 0], "recipe": "flux1_fp8", "overrides": "",
                                                          "conditioning": ["c", 0], "latent": ["l", 0]}},
         "x": {"class_type": "LowbitExport", "inputs": {"model": ["q", 0], "filename": "lowbit/cond.safetensors"}},
         "q2": quantize(["m", 0], "flux1_fp8"),
         "x2": {"class_type": "LowbitExport", "inputs": {"model": ["q2", 0], "filename": "lowbit/nocond.safetensors"}}}
    entry = comfy.server.run(g)
    assert "the node's CONDITIONING and LATENT size" in _report_json(comfy, entry, "q")
    a = load_file(str(comfy.base / "models" / "diffusion_models" / "lowbit" / "cond.safetensors"))
    b = load_file(str(comfy.base / "models" / "diffusion_models" / "lowbit" / "nocond.safetensors"))
    text_layers = [k for k in a if k.endswith(".input_scale") and k.startswith("txtfusion")] or \
        [k for k in a if k.endswith(".input_scale") and "attn.wq" in k]
    assert text_layers and any(not torch.equal(a[k], b[k]) for k in text_layers)


def _report_json(env: Env, entry: dict[str, Any], node: str = "q") -> str:
    """The last report.json of the Quantize node `node` (its runs are under the output folder's lowbit_runs/)."""
    runs = sorted((env.base / "output" / "lowbit_runs").glob(f"*/*-node{node}/report.json"),
                  key=lambda p: p.stat().st_mtime)
    assert runs, f"no run report of node {node} under output/lowbit_runs"
    return runs[-1].read_text()


def test_a_stock_lora_on_a_quantized_model_samples_what_the_lora_residual_node_samples(comfy):
    """ComfyUI's own LoraLoaderModelOnly after Quantize (recipe auto: Krea 2's nvfp4 + int8, FLUX.1's static fp8, the
    figures Export quotes) and on the exported file: with the pack, exact residual branches (what LoRA residual
    samples, to 1e-4), never the LoRA rounded into the quantized weights; the float model samples as before."""
    comfy.server.free()
    rows = []
    for arch in ARCHS:
        floating = sample(comfy, arch, {"m": loader(arch)}, ["m", 0], 5, f"gf_{arch}_")
        lora, out = f"{arch}_peft.safetensors", f"lowbit/stock_lora_{arch}.safetensors"

        def stock_lora(model: list, lora: str = lora) -> dict[str, Any]:
            return {"class_type": "LoraLoaderModelOnly", "inputs": {"model": model, "lora_name": lora,
                                                                   "strength_model": 0.8}}

        q = {"m": loader(arch), "q": quantize(["m", 0], "auto")}
        entry = comfy.server.run({**q, "x": {"class_type": "LowbitExport", "inputs": {"model": ["q", 0], "filename": out}}})
        assert "LoRA on this file: Without this node pack" in comfy.server.texts(entry, "x")[0]
        got = sample(comfy, arch, {**q, "s": stock_lora(["q", 0])}, ["s", 0], 5, f"gs_{arch}_", float_model=["m", 0])
        want = sample(comfy, arch, {**q, "r": lowbit_lora(["q", 0], lora, 0.8)}, ["r", 0], 5, f"gr_{arch}_",
                      float_model=["m", 0])
        f = {"m": loader(arch), "f": loader(arch, out)}
        file_got = sample(comfy, arch, {**f, "s": stock_lora(["f", 0])}, ["s", 0], 5, f"gfs_{arch}_", float_model=["m", 0])
        file_want = sample(comfy, arch, {**f, "r": lowbit_lora(["f", 0], lora, 0.8)}, ["r", 0], 5, f"gfr_{arch}_",
                           float_model=["m", 0])
        plain = sample(comfy, arch, {**f}, ["f", 0], 5, f"gfp_{arch}_", float_model=["m", 0])
        rows.append((arch, rel(got, want), rel(file_got, file_want), rel(file_want, plain)))
        assert rel(got, want) < 1e-4 and rel(file_got, file_want) < 1e-4, rows[-1]
        assert rel(file_want, plain) > 1e-3, rows[-1]  # the LoRA does something
        assert torch.equal(sample(comfy, arch, {"m": loader(arch)}, ["m", 0], 5, f"gg_{arch}_"), floating)
    print("\n".join(f"{a}: after Quantize {r1:.1e}, on the file {r2:.1e} (LoRA effect {e:.1e})" for a, r1, r2, e in rows))


# ---------------------------------------------------------------------------------------------- hostile prompts
def test_hostile_prompts_are_refused_and_leak_nothing(comfy):
    """What anyone who can reach the server may send (tests/comfy/test_hostile_inputs.py has every case against the node
    functions): each is refused, no file appears outside models/, and neither a planted secret, a system file's
    content nor an environment value reaches the error, /history or the server's log."""
    import json
    import secrets

    canary = "canary-" + secrets.token_hex(8)
    (comfy.base / "secret.yaml").write_text(f"quantize:\n  token: {canary}\n")
    env_value = os.environ["PATH"]
    export = {"class_type": "LowbitExport", "inputs": {"model": ["q", 0], "filename": "lowbit/hostile.safetensors"}}
    cases = [(quantize(["m", 0], "/etc/passwd"), "is not 'auto', a packaged recipe"),
             (quantize(["m", 0], "../../secret.yaml"), "is not a file name"),
             (quantize(["m", 0], "default", "quantize.default.format=${oc.env:PATH}"), "resolver 'oc.env'"),
             (quantize(["m", 0], "default", "hydra.searchpath=[file:///etc]"), "'hydra' is not read"),
             (quantize(["m", 0], "a: &a [1]\nb: *a\n"), "anchors and aliases")]
    for node, match in cases:
        with pytest.raises(cs.PromptError, match=match) as err:
            comfy.server.run({"m": loader("flux1"), "q": node, "x": export})
        assert canary not in str(err.value) and "root:x:0:0" not in str(err.value) and env_value not in str(err.value)
    escape = {"class_type": "LowbitExport", "inputs": {"model": ["m", 0], "filename": "../../escape"}}
    with pytest.raises(cs.PromptError, match="is not a file name"):
        comfy.server.run({"m": loader("flux1"), "x": escape})
    assert not list(comfy.base.parent.rglob("escape*")) and not list(comfy.base.rglob("hostile*"))
    seen = json.dumps(comfy.server.get("/history")) + comfy.server.log()
    assert canary not in seen and "root:x:0:0" not in seen and env_value not in seen


# ---------------------------------------------------------------------------------------------- example workflows
def test_the_packs_example_workflows_are_valid_and_the_runnable_one_runs(comfy):
    """Every example workflow the pack ships reads back into an API graph of nodes this ComfyUI has, links joining
    matching types; the one without a text encoder runs on the tiny Krea 2 (its model name swapped in)."""
    import json

    from comfyui_workflows import to_api

    comfy.server.free()
    folder = comfy.base / "custom_nodes" / "lowbit_pipe_nodes" / "example_workflows"
    files = sorted(folder.glob("*.json"))
    assert len(files) >= 4, f"the install copied {len(files)} example workflows"
    info = comfy.server.object_info()
    for path in files:
        workflow = json.loads(path.read_text())
        api = to_api(workflow, info)
        for link in workflow["links"]:
            _, src, slot, dst, _, kind = link
            target = next(n for n in workflow["nodes"] if n["id"] == dst)
            want = next(i["type"] for i in target["inputs"] if i["link"] == link[0])
            assert kind == want or "*" in (kind, want), f"{path.name}: link {link} into a {want} input"
        assert any(n["class_type"].startswith("Lowbit") for n in api.values()), path.name
    runnable = json.loads((folder / "Try the pack without a text encoder (Krea 2).json").read_text())
    api = to_api(runnable, info)
    for node in api.values():
        if node["class_type"] == "UNETLoader":
            node["inputs"]["unet_name"] = "krea2.safetensors"
        if node["class_type"] == "LowbitExampleInputs":
            node["inputs"].update(width=64, height=64, text_tokens=8)
    entry = comfy.server.run(api)
    purge = next(k for k, n in api.items() if n["class_type"] == "LowbitPurge")
    assert '"proven": true' in comfy.server.texts(entry, purge)[0]


@pytest.mark.parametrize("recipe", ["krea2_svdquant", "krea2_nvfp4_gptq"])
def test_gptq_and_svdquant_recipes_run_in_the_quantize_node(comfy, recipe):
    """The calibrated Krea 2 recipes (GPTQ Hessians, SVDQuant smoothing: several calibration passes) run inside
    ComfyUI and sample a quantized result."""
    comfy.server.free()
    floating = sample(comfy, "krea2", {"m": loader("krea2")}, ["m", 0], 9, f"cf_{recipe}_")
    got = sample(comfy, "krea2", {"m": loader("krea2"), "q": quantize(["m", 0], recipe)}, ["q", 0], 9,
                 f"cq_{recipe}_", float_model=["m", 0])
    assert torch.isfinite(got).all() and 1e-5 < rel(got, floating) < 0.05, rel(got, floating)
    report = _report_json(comfy, {}, "q")
    assert '"gptq"' in report and "in ComfyUI's layout" in report


# ---------------------------------------------------------------------------------------------- compile
@pytest.fixture(scope="module")
def attention_server(comfy):
    """The same ComfyUI, pack and models, with ComfyUI's PyTorch attention: what ComfyUI runs on a GPU. Its CPU
    default, sub-quadratic attention, asks psutil for the free memory inside every attention call, a graph break in
    ComfyUI's own code that would hide whether the pack's layers break a graph."""
    yield from _server(comfy, "attention_server")


def _first_calls(log: str, node: str) -> list[tuple[float, int, int]]:
    """(seconds, graphs, graph breaks) of each first model call the Compile node `node` reported in the log."""
    import re

    pattern = (rf"lowbit_pipe compile: Compile \(lowbit_pipe\) node {re.escape(node)}: first model call ([\d.]+) s "
               r"\(compile included: (\d+) graphs, (\d+) graph breaks\)")
    return [(float(s), int(g), int(b)) for s, g, b in re.findall(pattern, log)]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_compile_node_compiles_once_keeps_a_strength_change_and_purge_ends_it(comfy, attention_server, arch):
    """Quantize -> LoRA residual -> Compile (lowbit_pipe) -> KSampler in the server: the first call compiles one
    graph per block class with no graph break and samples what the uncompiled MODEL samples; a new LoRA strength
    (the LoRA and Compile nodes re-run) compiles nothing; Purge after it is proven, and the re-queued workflow
    compiles again (dynamo's caches were reset) and samples the same."""
    server = attention_server
    server.free()
    classes = {"krea2": 1, "flux1": 2}[arch]
    info = server.object_info("LowbitCompile")["LowbitCompile"]
    assert info["display_name"] == "Compile (lowbit_pipe)" and info["description"]

    def graph(strength: float, *, eager: bool = True, purge: bool = False) -> dict[str, Any]:
        g = {"m": loader(arch), "q": quantize(["m", 0]),
             "r": lowbit_lora(["q", 0], f"{arch}_peft.safetensors", strength),
             "c": {"class_type": "LowbitCompile", "inputs": {"model": ["r", 0], "backend": "aot_eager"}},
             **sampler_nodes(arch, ["c", 0], 6, "cc_", float_model=["m", 0])}
        if eager:
            g.update(sampler_nodes(arch, ["r", 0], 6, "ce_", float_model=["m", 0]))
        if purge:
            g["p"] = {"class_type": "LowbitPurge", "inputs": {"model": ["c", 0], "after": ["cc_k", 0]}}
        return g

    def run(g: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[float, int, int]]]:
        start = len(server.log())
        entry = server.run(g)
        return entry, _first_calls(server.log()[start:], "c")

    entry, calls = run(graph(1.0))
    assert "compiled with aot_eager at the first model call" in server.texts(entry, "c")[0]
    assert len(calls) == 1 and calls[0][1:] == (classes, 0), calls
    assert rel(server.latent(entry, "cc_s"), server.latent(entry, "ce_s")) < 1e-5

    entry, calls = run(graph(0.5))  # another strength: the LoRA node and Compile re-run
    assert len(calls) == 1 and calls[0][1:] == (0, 0), f"a strength change recompiled: {calls}"
    half = server.latent(entry, "cc_s")
    assert rel(half, server.latent(entry, "ce_s")) < 1e-5

    entry, _ = run(graph(0.5, eager=False, purge=True))
    text = server.texts(entry, "p")[0]
    assert '"proven": true' in text and '"retained_bytes": 0' in text and '"unfreed": []' in text, text
    entry, calls = run(graph(0.5, eager=False, purge=True))  # re-queued: Quantize re-runs by itself
    assert len(calls) == 1 and calls[0][1:] == (classes, 0), f"nothing compiled after the purge's reset: {calls}"
    assert rel(server.latent(entry, "cc_s"), half) < 1e-6
    assert '"proven": true' in server.texts(entry, "p")[0]
    print(f"\n{arch}: first model call {calls[0][0]:.2f} s with aot_eager on the CPU (compile included)")


# ---------------------------------------------------------------------------------------------- soak


def _server_memory(server: cs.ComfyUIServer) -> tuple[int, int]:
    """(VmRSS bytes, open fds other than sockets) of the server process, from /proc. Sockets are the HTTP
    connections of this test's own requests: aiohttp frees a closed one when Python's collector next runs, so
    their count moves by one or two with the collector's timing, not with what the pack holds."""
    pid = server.process.pid
    rss = next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    fds = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            fds += not os.readlink(fd).startswith("socket:")
        except OSError:  # closed between the listing and the readlink
            pass
    return rss, fds


def test_soak_quantize_lora_swap_sample_purge_free_in_one_server(comfy, request):
    """`--comfy-soak-cycles` cycles (40 by default; bench/results/comfyui_soak_cpu.md holds a 200-cycle run) in the
    one server: Load -> Quantize -> LoRA a (its strength changing every cycle)
    and LoRA b (the swap) -> a 1-step sample of each -> Purge (proven) -> /free with unload. The server's RSS and
    open fds stay flat after a warm-up, each cycle samples what the same strength sampled before, and the float
    model samples bit-equal to its first result after the purges."""
    import time

    cycles = request.config.getoption("--comfy-soak-cycles")
    server = comfy.server
    server.free()
    latent = {"class_type": "EmptySD3LatentImage", "inputs": {"width": 32, "height": 32, "batch_size": 1}}

    def sampler(model: list, tag: str, start: list | None = None) -> dict[str, Any]:
        return {f"k{tag}": {"class_type": "KSampler", "inputs": {
                    "model": model, "seed": 1, "steps": 1, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
                    "positive": ["c", 0], "negative": ["c", 0], "latent_image": start or ["l", 0], "denoise": 1.0}},
                f"s{tag}": {"class_type": "SaveLatent", "inputs": {"samples": [f"k{tag}", 0],
                                                                   "filename_prefix": f"soak/{tag}"}}}

    base = {"m": loader("flux1"), "c": {"class_type": "LotusConditioning", "inputs": {}}, "l": latent}

    def run(graph: dict[str, Any], *nodes: str) -> tuple[dict[str, Any], list[torch.Tensor]]:
        prompt_id = server.submit(graph)
        entry = server.wait(prompt_id)
        out = [server.latent(entry, n) for n in nodes]
        server.post("/history", {"delete": [prompt_id]})  # ComfyUI keeps every prompt's history otherwise
        return entry, out

    def cycle(i: int) -> list[torch.Tensor]:
        strength = (1.0, 0.5)[i % 2]
        g = {**base, "q": quantize(["m", 0]), "a": lowbit_lora(["q", 0], "flux1_peft.safetensors", strength),
             "b": lowbit_lora(["q", 0], "flux1_kohya.safetensors", 0.8), **sampler(["a", 0], "a"),
             **sampler(["b", 0], "b", start=["ka", 0])}
        # One run behind both LoRA MODELs: one Purge, after both samplers (b starts from a's latent: it waits).
        g["p"] = {"class_type": "LowbitPurge", "inputs": {"model": ["a", 0], "after": ["kb", 0]}}
        entry, out = run(g, "sa", "sb")
        text = server.texts(entry, "p")[0]
        assert '"unfreed": []' in text and '"proven": true' in text and '"retained_bytes": 0' in text, text
        server.free()
        return out

    _, (floating,) = run({**base, **sampler(["m", 0], "f")}, "sf")
    warm = [cycle(i) for i in range(4)]
    rss0, fds0 = _server_memory(server)
    start, samples, peak = time.monotonic(), {}, (0, 0)
    for i in range(cycles):
        got = cycle(i)
        want = warm[i % 2]
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"cycle {i} sampled something else"
        rss, fds = _server_memory(server)
        peak = (max(peak[0], rss - rss0), max(peak[1], fds - fds0))
        samples[i] = (rss - rss0, fds - fds0)
    seconds = time.monotonic() - start
    _, (again,) = run({**base, **sampler(["m", 0], "f")}, "sf")
    print(f"{cycles} ComfyUI cycles in {seconds:.1f} s; server RSS growth {peak[0] / 2**20:+.1f} MiB, "
          f"fds {peak[1]:+d}; per cycle {samples}")
    assert torch.equal(again, floating), "the float model samples differently after the purges"
    assert rel(warm[0][0], floating) > 1e-4  # quantized with a LoRA: not the float result
    assert samples[cycles - 1][1] <= 0, f"the server holds {samples[cycles - 1][1]} more fds"
    assert samples[cycles - 1][0] < 32 * 2**20, f"server RSS grew {peak[0] / 2**20:.1f} MiB"
