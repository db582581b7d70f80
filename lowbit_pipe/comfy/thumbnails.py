"""Thumbnails of the node pack's example workflows: a drawing of the workflow's own graph (its nodes where the
workflow places them, titled as ComfyUI shows them, and its links), as the JPEG that ComfyUI's template browser
loads beside a template (`<template name>.jpg`; ComfyUI 0.29's front end asks for exactly that name). Drawn from the
workflow JSON when the pack is installed, so a thumbnail always shows the graph it stands for and no image is kept
in the source tree. Needs Pillow (ComfyUI's own requirement); `draw` returns None without it.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

SIZE = (512, 384)  # ComfyUI's template cards are 4:3
BACKGROUND = (32, 33, 38)
NODE = (58, 60, 68)
PACK_NODE = (46, 92, 74)  # the pack's own nodes stand out
NOTE = (86, 78, 44)
TITLE_TEXT = (236, 236, 236)
LINK = (150, 158, 176)
MAX_BYTES = 100 * 1024


@dataclass(frozen=True)
class Box:
    """A node as drawn: its id, title, colour and rectangle on the thumbnail."""

    node_id: int
    title: str
    colour: tuple[int, int, int]
    rect: tuple[float, float, float, float]


def node_title(node: dict[str, Any], names: dict[str, str]) -> str:
    """The title ComfyUI shows on a node: its own title, else the node type's display name, else its type."""
    return str(node.get("title") or names.get(node["type"], node["type"]))


def layout(workflow: dict[str, Any], names: dict[str, str], size: tuple[int, int] = SIZE) -> list[Box]:
    """The workflow's nodes scaled into `size` (with a margin), keeping the workflow's own placement."""
    nodes = workflow["nodes"]
    left = min(n["pos"][0] for n in nodes)
    top = min(n["pos"][1] for n in nodes)
    right = max(n["pos"][0] + n["size"][0] for n in nodes)
    bottom = max(n["pos"][1] + n["size"][1] for n in nodes)
    margin = 16
    scale = min((size[0] - 2 * margin) / (right - left), (size[1] - 2 * margin) / (bottom - top))
    dx, dy = (size[0] - (right - left) * scale) / 2, (size[1] - (bottom - top) * scale) / 2  # centred
    out = []
    for n in nodes:
        x0, y0 = dx + (n["pos"][0] - left) * scale, dy + (n["pos"][1] - top) * scale
        colour = PACK_NODE if n["type"].startswith("Lowbit") else NOTE if n["type"] == "Note" else NODE
        out.append(Box(n["id"], node_title(n, names), colour,
                       (x0, y0, x0 + n["size"][0] * scale, y0 + max(n["size"][1] * scale, 14))))
    return out


def drawable(workflow: Any) -> bool:
    """Whether `workflow` has nodes placed as ComfyUI's UI saves them (an `id`, `type`, `pos` and `size` each)."""
    nodes = workflow.get("nodes") if isinstance(workflow, dict) else None
    return bool(nodes) and all(isinstance(n, dict) and {"id", "type", "pos", "size"} <= n.keys() for n in nodes)


def draw(workflow: dict[str, Any], names: dict[str, str], size: tuple[int, int] = SIZE) -> bytes | None:
    """The thumbnail of `workflow` as JPEG bytes (under MAX_BYTES); None where Pillow is missing or the workflow has
    no placed nodes to draw."""
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        return None
    if not drawable(workflow):
        return None
    boxes = {b.node_id: b for b in layout(workflow, names, size)}
    image = Image.new("RGB", size, BACKGROUND)
    pen = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=11)
    for link in workflow.get("links", []):
        src, dst = boxes.get(link[1]), boxes.get(link[3])
        if src is not None and dst is not None:
            pen.line([(src.rect[2], src.rect[1] + 7), (dst.rect[0], dst.rect[1] + 7)], fill=LINK, width=2)
    for box in boxes.values():
        pen.rounded_rectangle(box.rect, radius=4, fill=box.colour, outline=(20, 20, 24))
        _title(pen, box, font)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=85)
    data = buffer.getvalue()
    if len(data) > MAX_BYTES:  # a flat drawing this size is a few tens of KB; never ship a heavy card image
        raise ValueError(f"thumbnail of {len(data)} bytes exceeds {MAX_BYTES}")
    return data


def _title(pen: Any, box: Box, font: Any) -> None:
    """The node's title, cut to the box's width, on its first line."""
    x0, y0, x1, _ = box.rect
    text = box.title
    while text and pen.textlength(text, font=font) > x1 - x0 - 6:
        text = text[:-2] + "…" if len(text) > 2 else ""
    if text:
        pen.text((x0 + 3, y0 + 1), text, fill=TITLE_TEXT, font=font)
