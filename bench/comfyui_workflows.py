"""The node pack's example workflows: written in ComfyUI's UI format from API-format graphs, and read back.

    python bench/comfyui_workflows.py            # regenerate lowbit_pipe/comfy/example_workflows/*.json

ComfyUI's UI lists a node pack's `example_workflows/*.json` under its templates; those files are the frontend's
workflow format (nodes with positions, sockets and `widgets_values`, links as [id, from, slot, to, slot, type]),
not the API format the HTTP API takes. Which inputs are widgets, their order and the outputs come from a
running server's /object_info, so the files match the nodes as that ComfyUI defines them. `to_api` is the
inverse the tests use to queue an example on a server. ComfyUI (GPL-3) is run from its own folder; nothing of
it is copied.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "lowbit_pipe" / "comfy" / "example_workflows"
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


def _specs(info: dict[str, Any], node: str) -> list[tuple[str, Any]]:
    """(input name, spec) in the order the UI shows them: required, then optional."""
    d = info[node]
    order = d.get("input_order") or {g: list(d["input"].get(g, {})) for g in ("required", "optional")}
    return [(name, d["input"][group][name]) for group in ("required", "optional") for name in order.get(group, [])
            if name in d["input"].get(group, {})]


def _is_widget(spec: Any) -> bool:
    kind = spec[0]
    return isinstance(kind, list) or kind in WIDGET_TYPES


def _default(spec: Any) -> Any:
    if isinstance(spec[0], list):  # a combo: its first choice
        return spec[0][0] if spec[0] else None
    return (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}).get("default")


def _widget_values(spec: Any, value: Any) -> list[Any]:
    # The frontend stores a seed widget's "control after generate" mode right after its value.
    options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    return [value, "fixed"] if options.get("control_after_generate") else [value]


def to_workflow(api: dict[str, Any], info: dict[str, Any], titles: dict[str, str] | None = None,
                note: str | None = None, models: dict[str, list[dict[str, str]]] | None = None) -> dict[str, Any]:
    """An API-format graph as a UI workflow (nodes laid out in columns by depth); `models`: node key -> the model
    files it loads ({name, url, directory}), which ComfyUI's front end offers to download when they are missing."""
    ids = {key: i + 1 for i, key in enumerate(api)}
    depth: dict[str, int] = {}

    def level(key: str) -> int:
        if key not in depth:
            links = [v[0] for v in api[key]["inputs"].values() if isinstance(v, list)]
            depth[key] = 1 + max((level(k) for k in links), default=-1)
        return depth[key]

    links, nodes, rows = [], [], {}
    out_links: dict[tuple[str, int], list[int]] = {}
    for key, node in api.items():
        kind = node["class_type"]
        inputs, widgets = [], []
        for name, spec in _specs(info, kind):
            value = node["inputs"].get(name)
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                link_id = len(links) + 1
                src_type = info[api[value[0]]["class_type"]]["output"][value[1]]
                links.append([link_id, ids[value[0]], value[1], ids[key], len(inputs), src_type])
                out_links.setdefault((value[0], value[1]), []).append(link_id)
                inputs.append({"name": name, "type": spec[0] if not isinstance(spec[0], list) else "COMBO",
                               "link": link_id})
            elif _is_widget(spec):
                widgets += _widget_values(spec, value if value is not None else _default(spec))
            elif name in node["inputs"]:
                raise ValueError(f"node {key} ({kind}): input '{name}' takes a link, got {value!r}")
        col = level(key)
        rows[col] = rows.get(col, 0) + 1
        nodes.append({"id": ids[key], "type": kind, "pos": [60 + 360 * col, 60 + 240 * (rows[col] - 1)],
                      "size": [320, 200], "flags": {}, "order": 0, "mode": 0, "inputs": inputs, "outputs": [],
                      "properties": {"Node name for S&R": kind,
                                     **({"models": models[key]} if models and key in models else {})},
                      "widgets_values": widgets,
                      **({"title": titles[key]} if titles and key in titles else {})})
    for node, key in zip(nodes, api):
        d = info[api[key]["class_type"]]
        node["outputs"] = [{"name": name, "type": kind, "links": out_links.get((key, slot), []), "slot_index": slot}
                           for slot, (name, kind) in enumerate(zip(d["output_name"], d["output"]))]
    for i, key in enumerate(sorted(api, key=level)):
        nodes[list(api).index(key)]["order"] = i
    workflow = {"last_node_id": len(nodes), "last_link_id": len(links), "nodes": nodes, "links": links,
                "groups": [], "config": {}, "extra": {"ds": {"scale": 1.0, "offset": [0, 0]}}, "version": 0.4}
    if note:
        workflow["nodes"].append({"id": len(nodes) + 1, "type": "Note", "pos": [60, 60 + 240 * max(rows.values())],
                                  "size": [700, 160], "flags": {}, "order": len(nodes), "mode": 0, "inputs": [],
                                  "outputs": [], "properties": {}, "widgets_values": [note]})
        workflow["last_node_id"] += 1
    return workflow


def to_api(workflow: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    """A UI workflow as the API-format graph POST /prompt takes (Note nodes dropped); errors name the node."""
    links = {link[0]: link for link in workflow["links"]}
    api: dict[str, Any] = {}
    for node in workflow["nodes"]:
        kind = node["type"]
        if kind in ("Note", "MarkdownNote"):
            continue
        if kind not in info:
            raise KeyError(f"node {node['id']}: '{kind}' is not a node this ComfyUI has")
        inputs: dict[str, Any] = {}
        linked = {i["name"]: links[i["link"]] for i in node.get("inputs", []) if i.get("link") is not None}
        values = list(node.get("widgets_values", []))
        for name, spec in _specs(info, kind):
            if name in linked:
                link = linked[name]
                inputs[name] = [str(link[1]), link[2]]
            elif _is_widget(spec):
                if not values:
                    raise ValueError(f"node {node['id']} ({kind}): no widget value left for '{name}'")
                inputs[name] = values.pop(0)
                if len(spec) > 1 and isinstance(spec[1], dict) and spec[1].get("control_after_generate"):
                    values.pop(0)
        if values:
            raise ValueError(f"node {node['id']} ({kind}): {len(values)} widget values left over: {values}")
        api[str(node["id"])] = {"class_type": kind, "inputs": inputs}
    return api


# ------------------------------------------------------------------------------------------------ the examples
KREA2_FILES = "https://huggingface.co/Comfy-Org/Krea-2/resolve/main"  # as ComfyUI's own Krea 2 templates name them
TEXT_ENCODER = {"name": "qwen3vl_4b_fp8_scaled.safetensors", "directory": "text_encoders",
                "url": f"{KREA2_FILES}/text_encoders/qwen3vl_4b_fp8_scaled.safetensors"}
VAE = {"name": "qwen_image_vae.safetensors", "directory": "vae", "url": f"{KREA2_FILES}/vae/qwen_image_vae.safetensors"}
STYLE_LORA = {"name": "krea2_darkbrush.safetensors", "directory": "loras",
              "url": f"{KREA2_FILES}/loras/krea2_darkbrush.safetensors"}
FLOAT_MODEL = ("Load Diffusion Model: a float (bf16) Krea 2 or FLUX.1 file in models/diffusion_models, picked in "
               "the node (krea2.safetensors here). Quantize needs float weights, and no download link is offered for "
               "them: Comfy-Org/Krea-2 on Hugging Face lists Krea 2's BF16 variant. Its krea2_turbo_fp8_scaled / "
               "int8_convrot files are quantized already: Quantize refuses them; LoRA residual, 8-bit attention and "
               "Compile take them as they are.")


def examples() -> dict[str, tuple[dict[str, Any], dict[str, str], str, dict[str, list[dict[str, str]]]]]:
    """Title (the file's name: ComfyUI's template browser shows a pack's template by its file name) -> (API graph,
    node titles, note, model files per node). Krea 2 with its text encoder and VAE, as ComfyUI's own Krea 2
    templates run it (8 steps, cfg 1, the negative zeroed); the last one runs with no file but the diffusion model
    (the pack's Example inputs), which is how the tests queue it."""
    text = {"clip": {"class_type": "CLIPLoader", "inputs": {"clip_name": TEXT_ENCODER["name"], "type": "krea2"}},
            "pos": {"class_type": "CLIPTextEncode", "inputs": {"text": "a lighthouse on a cliff at dusk, monochrome "
                                                                       "ink wash style", "clip": ["clip", 0]}},
            "neg": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["pos", 0]}},
            "lat": {"class_type": "EmptyLatentImage", "inputs": {"width": 1024, "height": 1024, "batch_size": 1}},
            "vae": {"class_type": "VAELoader", "inputs": {"vae_name": VAE["name"]}}}
    files = {"clip": [TEXT_ENCODER], "vae": [VAE]}

    def sampler(model: list) -> dict[str, Any]:
        return {"ks": {"class_type": "KSampler", "inputs": {
            "model": model, "seed": 42, "steps": 8, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["pos", 0], "negative": ["neg", 0], "latent_image": ["lat", 0], "denoise": 1.0}},
            "dec": {"class_type": "VAEDecode", "inputs": {"samples": ["ks", 0], "vae": ["vae", 0]}},
            "img": {"class_type": "SaveImage", "inputs": {"images": ["dec", 0], "filename_prefix": "lowbit"}}}

    def quantize(recipe: str, **more: Any) -> dict[str, Any]:
        return {"class_type": "LowbitQuantize", "inputs": {"model": ["unet", 0], "recipe": recipe, "overrides": "",
                                                           "recipe_text": "", **more}}

    unet = {"unet": {"class_type": "UNETLoader", "inputs": {"unet_name": "krea2.safetensors", "weight_dtype": "default"}}}
    loader = {"unet": "Load Diffusion Model (float Krea 2)"}
    lora = {"class_type": "LowbitLoRA", "inputs": {"model": ["q", 0], "lora_name": STYLE_LORA["name"], "strength": 0.8}}
    out = {}
    out["Quantize, LoRA, sample, Purge (Krea 2)"] = (
        {**unet, **text, "q": quantize("auto"), "l": lora, **sampler(["l", 0]),
         "p": {"class_type": "LowbitPurge", "inputs": {"model": ["l", 0], "after": ["dec", 0]}}},
        {**loader, "q": "Quantize (recipe auto: krea2_nvfp4_stock)", "l": "LoRA as exact residual branches"},
        "Quantize the float Krea 2, add a LoRA as exact residual branches (never rounded into the 4-bit weights), "
        "sample, then Purge once the image is decoded ('after'): the summary shows on Quantize, the proof on Purge. "
        "Queue again: Quantize re-runs by itself after a Purge. The text encoder, VAE and LoRA (Comfy-Org/Krea-2) "
        "download from ComfyUI's missing-models list. " + FLOAT_MODEL,
        {**files, "l": [STYLE_LORA]})
    out["Export a quantized file (Krea 2)"] = (
        {**unet, "q": quantize("krea2_nvfp4_stock"),
         "x": {"class_type": "LowbitExport", "inputs": {"model": ["q", 0],
                                                        "filename": "lowbit/krea2_nvfp4_stock.safetensors"}},
         "p": {"class_type": "LowbitPurge", "inputs": {"model": ["q", 0], "after": ["x", 0]}}},
        {**loader, "x": "Export into models/diffusion_models/lowbit/"},
        "Quantize once and keep the file: Export writes models/diffusion_models/lowbit/krea2_nvfp4_stock.safetensors, "
        "which Load Diffusion Model lists (refresh the browser), then Purge gives the run's memory back. "
        "krea2_nvfp4_stock writes kinds stock ComfyUI loads; krea2_nvfp4 (ConvRot) loads with this node pack. "
        "Runs with the diffusion model alone. " + FLOAT_MODEL, {})
    out["Calibrated SVDQuant on your prompt (Krea 2)"] = (
        {**unet, **text, "q": quantize("krea2_svdquant", conditioning=["pos", 0], latent=["lat", 0]),
         **sampler(["q", 0]), "p": {"class_type": "LowbitPurge", "inputs": {"model": ["q", 0], "after": ["dec", 0]}}},
        {**loader, "q": "Quantize, calibrated on this prompt"},
        "Recipes that calibrate (SVDQuant's smoothing and GPTQ, static fp8 scales) run the model on the CONDITIONING "
        "and LATENT wired into Quantize, through ComfyUI's own forward; without them, on the architecture's seeded "
        "example inputs. Calibrate on prompts like the ones you will generate. The text encoder and VAE "
        "(Comfy-Org/Krea-2) download from ComfyUI's missing-models list. " + FLOAT_MODEL, files)
    out["Try the pack without a text encoder (Krea 2)"] = (
        {**unet, "ex": {"class_type": "LowbitExampleInputs", "inputs": {
            "model": ["unet", 0], "width": 512, "height": 512, "text_tokens": 64, "batch_size": 1, "seed": 0}},
         "q": quantize("auto"),
         "ks": {"class_type": "KSampler", "inputs": {
             "model": ["q", 0], "seed": 42, "steps": 4, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
             "positive": ["ex", 0], "negative": ["ex", 0], "latent_image": ["ex", 1], "denoise": 1.0}},
         "sl": {"class_type": "SaveLatent", "inputs": {"samples": ["ks", 0], "filename_prefix": "latents/lowbit"}},
         "p": {"class_type": "LowbitPurge", "inputs": {"model": ["q", 0], "after": ["ks", 0]}}},
        {**loader, "ex": "Example inputs (no text encoder needed)"},
        "Quantize and sample a diffusion model with no text encoder or VAE at hand: the pack's Example inputs give "
        "seeded text states and an empty latent of the model's widths. Good for checking speed, memory and the "
        "summary on Quantize; the latents are not pictures. Runs with the diffusion model alone. " + FLOAT_MODEL, {})
    return out


def write_examples(info: dict[str, Any], out: Path = OUT) -> list[Path]:
    """Write every example as `<title>.json` into `out`, removing example files of older names."""
    out.mkdir(parents=True, exist_ok=True)
    wanted = examples()
    for stale in out.glob("*.json"):
        if stale.stem not in wanted:
            stale.unlink()
    written = []
    for name, (api, titles, note, models) in wanted.items():
        path = out / f"{name}.json"
        path.write_text(json.dumps(to_workflow(api, info, titles, note, models), indent=1) + "\n")
        written.append(path)
    return written


def main() -> int:
    sys.path.insert(0, str(ROOT / "bench"))
    import comfyui_server as cs

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = cs.unpack(cs.find_archive(), tmp / "src")  # FileNotFoundError saying how to get it
        cs.install_pack(tmp / "base")
        server = cs.ComfyUIServer.start(src, tmp / "base", stand_ins=("av",),
                                        args=("--cpu", "--front-end-root", str(tmp)))
        try:
            info = server.object_info()
        finally:
            server.stop()
    for path in write_examples(info):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
