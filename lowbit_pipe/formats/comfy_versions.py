"""Which ComfyUI and comfy-kitchen load which `.comfy_quant` kind, and what the node pack itself needs: plain data.

One table (`KINDS`), read by the export stage's warning, `formats.is_stock_loadable`, the node pack's
registration (lowbit_pipe.comfy) and docs/comfyui.md ("Versions", with the source of every figure). It lives
with the formats because it describes their on-disk kinds; nothing here imports ComfyUI or comfy-kitchen.

The figures:

- ComfyUI: the first release whose `comfy/quant_ops.py` `QUANT_ALGOS` has the kind and whose loader reads it
  from a layer's `.comfy_quant` record (ComfyUI's git tags; asym_w4a8_int8 from its release notes).
- comfy-kitchen: the first release whose `comfy_kitchen.tensor` has the kind's layout (comfy-kitchen's git
  tags). A ComfyUI that has the entry imports that layout, so it needs at least this release.
- The node pack: ComfyUI >= 0.27.0, the first release whose mixed-precision Linear reads `quantize_input`
  from QUANT_ALGOS (`ops._load_quantized_module`, which the pack wraps, is there since 0.23.0; from 0.23.0
  to 0.26.x ComfyUI quantizes every quantized layer's input with the layer's layout, which LowbitLayout
  refuses); comfy-kitchen >= 0.2.13, the first with `QuantizedTensor.requantize_from_float` (ComfyUI's
  LoRA path on a quantized layer). With the pack, every kind in the table loads on such a ComfyUI: the pack
  registers the ones its QUANT_ALGOS lacks through LowbitLayout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

PREFIX = "lowbit_"
PACK_MIN_COMFYUI = "0.27.0"
PACK_MIN_COMFY_KITCHEN = "0.2.13"
# The Comfy Registry's `requires-comfyui` for the pack (no upper bound is known; the newest checked is in
# docs/comfyui.md).
SUPPORTED_COMFYUI = f">={PACK_MIN_COMFYUI}"
INSTALL_HINT = "install the node pack: python -m lowbit_pipe.comfy install <ComfyUI folder>"


@dataclass(frozen=True)
class KindSupport:
    """What loads one `.comfy_quant` format name."""

    kind: str
    comfyui: str | None  # first stock ComfyUI release that loads it; None: none does (the node pack only)
    comfy_kitchen: str | None  # first comfy-kitchen release with its layout; None: ComfyUI's own / no layout

    @property
    def pack_only(self) -> bool:
        return self.comfyui is None

    @property
    def newer_than_pack_floor(self) -> bool:
        """Stock ComfyUI loads it, but not every release the node pack supports does."""
        return self.comfyui is not None and version_tuple(self.comfyui) > version_tuple(PACK_MIN_COMFYUI)

    def loads_with(self) -> str:
        """One phrase: what loads this kind."""
        if self.comfyui is None:
            return (f"no stock ComfyUI; ComfyUI >= {PACK_MIN_COMFYUI} with lowbit_pipe's node pack "
                    f"(comfy-kitchen >= {PACK_MIN_COMFY_KITCHEN})")
        kitchen = f" with comfy-kitchen >= {self.comfy_kitchen}" if self.comfy_kitchen else ""
        if self.newer_than_pack_floor:
            return (f"stock ComfyUI >= {self.comfyui}{kitchen}; ComfyUI {PACK_MIN_COMFYUI} .. {self.comfyui} "
                    "(exclusive) with lowbit_pipe's node pack")
        return f"stock ComfyUI >= {self.comfyui}{kitchen}"


# Every record format name lowbit_pipe's formats write (a test checks it against them), plus float8_e5m2,
# which ComfyUI writes and lowbit_pipe reads. `lowbit_*` names are not listed: `support()` answers for them.
KINDS: dict[str, KindSupport] = {k.kind: k for k in (
    KindSupport("float8_e4m3fn", "0.4.0", None),  # ComfyUI's own fp8 layout until 0.8.0, comfy-kitchen's since
    KindSupport("float8_e5m2", "0.4.0", None),
    KindSupport("nvfp4", "0.8.0", "0.1.0"),
    KindSupport("mxfp8", "0.18.0", "0.2.8"),  # the entry exists only where comfy-kitchen has the layout
    KindSupport("int8_tensorwise", "0.27.0", "0.2.11"),  # ConvRot (`convrot: true`) read from the same release
    KindSupport("convrot_w4a4", "0.28.0", "0.2.17"),
    KindSupport("asym_w4a8_int8", "0.31.0", "0.2.27"),
    KindSupport("awq_w4a16", None, "0.2.9"),  # comfy-kitchen has the layouts; no ComfyUI release has the entry
    KindSupport("svdquant_w4a4", None, "0.2.9"),
)}


def support(kind: str) -> KindSupport | None:
    """The table's row for a record format name (`lowbit_*`: the pack only); None for a name it does not know."""
    if kind.startswith(PREFIX):
        return KindSupport(kind, None, None)
    return KINDS.get(kind)


def version_tuple(text: str) -> tuple[int, ...]:
    """"0.2.24" -> (0, 2, 24); the leading numeric part of each dot-separated field ("0.3.0rc1" -> (0, 3, 0))."""
    parts = []
    for field in str(text).strip().lstrip("v").split("."):
        m = re.match(r"\d+", field)
        if m is None:
            break
        parts.append(int(m.group()))
    if not parts:
        raise ValueError(f"not a version number: {text!r}")
    return tuple(parts)


def stock_loads(kind: str, comfyui: str, comfy_kitchen: str) -> bool:
    """Whether stock ComfyUI `comfyui` with comfy-kitchen `comfy_kitchen` loads the kind (per the table)."""
    row = support(kind)
    if row is None or row.comfyui is None:
        return False
    if version_tuple(comfyui) < version_tuple(row.comfyui):
        return False
    return row.comfy_kitchen is None or version_tuple(comfy_kitchen) >= version_tuple(row.comfy_kitchen)


def comfy_warning(records: dict[str, dict[str, Any]]) -> str | None:
    """The export's warning for layers whose kind not every ComfyUI of the pack's range loads stock:
    `records` = layer name -> its `.comfy_quant` record. None when every kind loads on stock ComfyUI >=
    PACK_MIN_COMFYUI."""
    by_kind: dict[str, list[str]] = {}
    for layer, record in records.items():
        by_kind.setdefault(str(record.get("format", "")), []).append(layer)
    parts, refused_by_all = [], False
    for kind in sorted(by_kind):
        layers = sorted(by_kind[kind])
        row = support(kind)
        if row is not None and not row.pack_only and not row.newer_than_pack_floor:
            continue
        first = records[layers[0]]
        what = _describe(first)
        example = f"{len(layers)} layer{'s' if len(layers) > 1 else ''} (e.g. {layers[0]}{what})"
        if row is None:
            parts.append(f"{kind}: {example}, a kind lowbit_pipe's version table does not know")
            refused_by_all = True
        else:
            parts.append(f"{kind}: {example}, loaded by {row.loads_with()}")
            refused_by_all = refused_by_all or row.pack_only
    if not parts:
        return None
    head = ("stock ComfyUI refuses the whole file" if refused_by_all else
            f"stock ComfyUI before the versions below refuses the whole file (the node pack supports ComfyUI "
            f"{SUPPORTED_COMFYUI})")
    return f"{head}: " + "; ".join(parts) + f"; to load it there, {INSTALL_HINT} (or load it with lowbit_pipe)"


def _describe(record: dict[str, Any]) -> str:
    """", int8 + quarot" for a lowbit record (what it is beyond its kind's name), else ""."""
    fmt = record.get("lowbit_format")
    if fmt is None:
        return ""
    extra = [f" + {record['lowbit_rotation']}"] if "lowbit_rotation" in record else []
    if "lowbit_granularity" in record:
        extra.append(f", {record['lowbit_granularity']} scales")
    return f": {fmt}{''.join(extra)}"


# ---- what the node pack needs of comfy-kitchen -------------------------------------------------------------
class IncompatibleComfyUI(TypeError):
    """The running ComfyUI or comfy-kitchen cannot take lowbit_pipe's loader registration (a TypeError, as
    `registry.install` raised for a foreign module before this class existed)."""


def check_comfy_kitchen(installed: str | None, has_requantize: bool) -> None:
    """IncompatibleComfyUI when comfy-kitchen is older than PACK_MIN_COMFY_KITCHEN (`installed`: its version,
    None when unknown; `has_requantize`: whether QuantizedTensor has requantize_from_float, the feature that
    sets the floor)."""
    too_old = not has_requantize or (installed is not None and version_tuple(installed) < version_tuple(
        PACK_MIN_COMFY_KITCHEN))
    if too_old:
        raise IncompatibleComfyUI(f"comfy-kitchen {installed or '(version unknown)'} is installed; LowbitLayout needs "
                                  f"comfy-kitchen >= {PACK_MIN_COMFY_KITCHEN} (QuantizedTensor.requantize_from_float)")
