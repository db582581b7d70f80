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
                note: str | None = None) -> dict[str, Any]:
    """An API-format graph as a UI workflow (nodes laid out in columns by depth)."""
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
                      "properties": {"Node name for S&R": kind}, "widgets_values": widgets,
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
def examples() -> dict[str, tuple[dict[str, Any], dict[str, str], str]]:
    """name -> (API graph, node titles, note). Krea 2 with its text encoder and VAE, as users run it; the last
    one runs with no text encoder (the pack's Example inputs), which is also how the tests queue it."""
    prompt = "a lighthouse on a cliff at dusk, oil painting"
    text = {"clip": {"class_type": "CLIPLoader", "inputs": {"clip_name": "qwen3vl_4b.safetensors", "type": "krea2"}},
            "pos": {"class_type": "CLIPTextEncode", "inputs": {"text": prompt, "clip": ["clip", 0]}},
            "neg": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["clip", 0]}},
            "lat": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 1024, "height": 1024, "batch_size": 1}},
            "vae": {"class_type": "VAELoader", "inputs": {"vae_name": "wan_2.1_vae.safetensors"}}}

    def sampler(model: list) -> dict[str, Any]:
        return {"ks": {"class_type": "KSampler", "inputs": {
            "model": model, "seed": 42, "steps": 28, "cfg": 4.0, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["pos", 0], "negative": ["neg", 0], "latent_image": ["lat", 0], "denoise": 1.0}},
            "dec": {"class_type": "VAEDecode", "inputs": {"samples": ["ks", 0], "vae": ["vae", 0]}},
            "img": {"class_type": "SaveImage", "inputs": {"images": ["dec", 0], "filename_prefix": "lowbit"}}}

    unet = {"unet": {"class_type": "UNETLoader", "inputs": {"unet_name": "krea2.safetensors", "weight_dtype": "default"}}}
    lora = {"class_type": "LowbitLoRA", "inputs": {"model": ["q", 0], "lora_name": "style.safetensors", "strength": 0.8}}
    out: dict[str, tuple[dict[str, Any], dict[str, str], str]] = {}
    out["lowbit_quantize_lora_purge"] = (
        {**unet, **text, "q": {"class_type": "LowbitQuantize", "inputs": {"model": ["unet", 0], "recipe": "auto",
                                                                           "overrides": ""}},
         "l": lora, **sampler(["l", 0]),
         "p": {"class_type": "LowbitPurge", "inputs": {"model": ["l", 0], "after": ["dec", 0]}}},
        {"q": "Quantize (recipe auto: krea2_nvfp4_stock)", "l": "LoRA as exact residual branches"},
        "Quantize the float Krea 2, add a LoRA as exact residual branches, sample, then Purge once the image is "
        "decoded ('after'). Queue again with another seed: Quantize re-runs by itself after a Purge. Models: "
        "diffusion_models/krea2.safetensors, text_encoders/qwen3vl_4b.safetensors, vae/wan_2.1_vae.safetensors, "
        "loras/style.safetensors (rename to yours).")
    out["lowbit_export_and_reload"] = (
        {**unet, "q": {"class_type": "LowbitQuantize", "inputs": {"model": ["unet", 0], "recipe": "krea2_nvfp4",
                                                                   "overrides": ""}},
         "x": {"class_type": "LowbitExport", "inputs": {"model": ["q", 0], "filename": "lowbit/krea2_nvfp4.safetensors"}}},
        {"x": "Export into models/diffusion_models/lowbit/"},
        "Quantize once and keep the file: Export writes models/diffusion_models/lowbit/krea2_nvfp4.safetensors, which "
        "Load Diffusion Model lists (refresh the browser). krea2_nvfp4 uses lowbit_* kinds, so it loads in a ComfyUI "
        "with this node pack; recipe krea2_nvfp4_stock writes a file stock ComfyUI loads.")
    out["lowbit_calibrated_svdquant"] = (
        {**unet, **text, "q": {"class_type": "LowbitQuantize", "inputs": {
            "model": ["unet", 0], "recipe": "krea2_svdquant", "overrides": "", "conditioning": ["pos", 0],
            "latent": ["lat", 0]}}, **sampler(["q", 0])},
        {"q": "Quantize, calibrated on this prompt"},
        "Recipes that calibrate (SVDQuant's smoothing and GPTQ, static fp8 scales) run the model on the CONDITIONING "
        "and LATENT wired into Quantize, through ComfyUI's own forward; without them, on the architecture's seeded "
        "example inputs. Calibrate on prompts like the ones you will generate.")
    out["lowbit_try_without_text_encoder"] = (
        {**unet, "ex": {"class_type": "LowbitExampleInputs", "inputs": {
            "model": ["unet", 0], "width": 512, "height": 512, "text_tokens": 64, "batch_size": 1, "seed": 0}},
         "q": {"class_type": "LowbitQuantize", "inputs": {"model": ["unet", 0], "recipe": "auto", "overrides": ""}},
         "ks": {"class_type": "KSampler", "inputs": {
             "model": ["q", 0], "seed": 42, "steps": 4, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
             "positive": ["ex", 0], "negative": ["ex", 0], "latent_image": ["ex", 1], "denoise": 1.0}},
         "sl": {"class_type": "SaveLatent", "inputs": {"samples": ["ks", 0], "filename_prefix": "latents/lowbit"}},
         "p": {"class_type": "LowbitPurge", "inputs": {"model": ["q", 0], "after": ["sl", 0]}}},
        {"ex": "Example inputs (no text encoder needed)"},
        "Quantize and sample a diffusion model with no text encoder or VAE at hand: the pack's Example inputs give "
        "seeded text states and an empty latent of the model's widths. Good for checking speed and memory; the "
        "latents are not pictures.")
    return out


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
    OUT.mkdir(parents=True, exist_ok=True)
    for name, (api, titles, note) in examples().items():
        path = OUT / f"{name}.json"
        path.write_text(json.dumps(to_workflow(api, info, titles, note), indent=1) + "\n")
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
