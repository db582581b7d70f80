"""LoRA module names in any common form -> diffusers module names (+ output rows of fused natives).

Forms: diffusers / peft (`transformer.transformer_blocks.0.attn.to_q`), AI-toolkit
(`base_model.model.` / `diffusion_model.` prefixes), ComfyUI / BFL native names
(`diffusion_model.double_blocks.0.img_attn.qkv`) and kohya (`lora_unet_double_blocks_0_img_attn_qkv`:
dots turned into underscores, resolved against the class's Linear module names in both layouts).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import TYPE_CHECKING

from lowbit_pipe.arch.keymap import SWAP_HALVES, SwapHalves

if TYPE_CHECKING:
    from lowbit_pipe.arch.base import Arch, ArchConfig

LORA_SUFFIX = re.compile(
    r"\.(lora_[AB](\.default)?\.weight|lora_(down|up|mid)\.weight|alpha|dora_scale|diff|diff_b|lokr_w[12](_[ab])?|hada_w[12]_[ab])$"
)
DOTTED_PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.", "unet.")
KOHYA_PREFIXES = ("lora_unet_", "lora_transformer_", "lycoris_")


def lora_module_name(key: str) -> str:
    """A LoRA tensor key or module name, without its LoRA suffix (`.lora_A.weight`, `.alpha`, ...)."""
    return LORA_SUFFIX.sub("", key)


def _templatize(name: str) -> str:
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "{i}", name)


@lru_cache(maxsize=None)
def _kohya_table(arch: Arch) -> tuple[tuple[re.Pattern, str, str], ...]:
    """(underscore regex, dotted template, layout) for every Linear module in diffusers and native names
    (cached per Arch: the registry's instances live as long as the process)."""
    names = arch.linear_names
    hidden = arch.config_from_dict({**arch.default_kwargs(), **arch.lora_template_kwargs()}).hidden_size
    rows: list[tuple[re.Pattern, str, str]] = []
    seen: set[tuple[str, str]] = set()
    layouts = [("diffusers", names)]
    if arch.keymap is not None:
        layouts.append(("native", [arch.keymap.module_to_native(n, hidden)[0] for n in names]))
    for layout, group in layouts:
        for t in {_templatize(n) for n in group}:
            if (t, layout) in seen:
                continue
            seen.add((t, layout))
            rx = re.escape(t.replace(".", "_")).replace(r"\{i\}", r"(\d+)")
            rows.append((re.compile(rx), t, layout))
    # Longest templates first, so `to_add_out` never resolves as a prefix of something shorter.
    return tuple(sorted(rows, key=lambda r: -len(r[1])))


def _fill(template: str, groups: tuple[str, ...]) -> str:
    it = iter(groups)
    return re.sub(r"\{i\}", lambda _: next(it), template)


def strip_lora_prefixes(name: str) -> tuple[str, bool]:
    """Name without prefixes; True when it is a kohya (underscore) name."""
    for p in KOHYA_PREFIXES:
        if name.startswith(p):
            return name[len(p):], True
    changed = True
    while changed:
        changed = False
        for p in DOTTED_PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p):], True
    return name, "." not in name and "_" in name


def resolve_lora_name(arch: Arch, key: str,
                      config: ArchConfig | None = None) -> list[tuple[str, slice | SwapHalves | None]]:
    """[(diffusers module, rows of the LoRA up matrix for it, or None)]; [] for names of no known module.
    Rows are a slice of a fused native module, or SWAP_HALVES for a native modulation whose output halves
    are swapped against diffusers' (FLUX `final_layer.adaLN_modulation.1`); `keymap.take_rows` applies them."""
    name, kohya = strip_lora_prefixes(lora_module_name(key))
    diff_set = arch.linear_names_set
    if kohya:
        for rx, template, layout in _kohya_table(arch):
            m = rx.fullmatch(name)
            if m:
                name = _fill(template, m.groups())
                if layout == "diffusers":
                    return [(name, None)]
                break
        else:
            return []
    if _templatize(name) in diff_set:
        return [(name, None)]
    if arch.keymap is None:
        return []
    targets = arch.from_native_name(name, config)
    if arch.keymap.is_swapped(name):
        # Native (shift, scale) vs diffusers (scale, shift) rows: the factor's rows with their halves exchanged.
        return [(t, SWAP_HALVES) for t, _ in targets] if all(_templatize(t) in diff_set for t, _ in targets) else []
    if all(_templatize(t) in diff_set for t, _ in targets) and targets != [(name, None)]:
        return targets
    return []
