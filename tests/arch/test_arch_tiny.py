"""Tiny configs of every arch: build, seeded forward, config from keys, native round trip with tensors."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import yaml
from torch import nn

import lowbit_pipe.arch as A
from lowbit_pipe.arch.generic import Generic, arch_for_model, generic_policy
from lowbit_pipe.paths import tiny_models

TINY = sorted(name[len("tiny_"):] for name in tiny_models())
# Converters without hard-coded real-size dims (FLUX.1 / Chroma's assume width 3072).
GENERIC_CONVERTERS = {
    "krea2": "convert_krea2_transformer_checkpoint_to_diffusers",
    "flux2": "convert_flux2_transformer_checkpoint_to_diffusers",
    "sd3": "convert_sd3_transformer_checkpoint_to_diffusers",
    "wan": "convert_wan_transformer_to_diffusers",
    "z_image": "convert_z_image_transformer_checkpoint_to_diffusers",
}


def load_yaml(aid: str) -> dict:
    return yaml.safe_load(tiny_models()[f"tiny_{aid}"].read_text())


def arch_of(aid: str):
    """The arch of a tiny model group: `tiny_<arch>`, or a variant of it such as `tiny_krea2_comfy`."""
    return A.get_arch(load_yaml(aid)["tiny_arch"])


@pytest.fixture(scope="module")
def tiny():
    """arch id -> seeded tiny model (eval)."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for aid in TINY:
            data = load_yaml(aid)
            torch.manual_seed(data["seed"])
            out[aid] = A.get_arch(data["tiny_arch"]).model_class()(**data["tiny_config"]).eval()
    return out


def run(arch, model, batch=2):
    """(prediction, noisy latent input): every tiny config predicts a tensor shaped like its latent."""
    inputs = arch.example_inputs(dict(model.config), batch=batch, image_tokens=16, text_tokens=8,
                                 generator=torch.Generator().manual_seed(0), dtype=torch.float32, device="cpu")
    latent = inputs["hidden_states"] if "hidden_states" in inputs else torch.stack(inputs["x"])
    with torch.no_grad():
        return arch.output_tensor(model(**inputs)), latent


def test_every_arch_has_a_tiny_config():
    assert set(TINY) >= {"krea2", "flux1", "flux2", "qwen_image", "z_image", "sd3", "chroma", "wan"}
    for aid in TINY:
        data = load_yaml(aid)
        # A model group says which tiny model it is; it never sets model.arch (that forces a file's arch),
        # model.dtype or model.device (a model passed in keeps its own).
        assert aid == data["tiny_arch"] or aid.startswith(data["tiny_arch"] + "_"), aid
        assert set(data) == {"tiny_arch", "path", "seed", "tiny_config"}


@pytest.mark.parametrize("aid", TINY)
def test_tiny_builds_detects_and_runs(tiny, aid):
    arch, model = arch_of(aid), tiny[aid]
    assert A.detect_model(model) is arch
    assert sum(p.numel() for p in model.parameters()) < 5.1e6
    out, latent = run(arch, model)  # the first call pays one-time lazy setup (rope tables, kernels)
    assert out.shape == latent.shape and torch.isfinite(out).all()
    start = time.perf_counter()
    again, _ = run(arch, model)
    assert time.perf_counter() - start < 2.0
    assert torch.equal(out, again)  # seeded inputs


@pytest.mark.parametrize("aid", TINY)
def test_tiny_config_from_keys(tiny, aid):
    arch, model = arch_of(aid), tiny[aid]
    cfg = arch.config_from_model(model)
    assert arch.config_from_keys({k: tuple(v.shape) for k, v in model.state_dict().items()}) == cfg
    assert cfg.hidden_size == cfg.num_heads * cfg.head_dim


@pytest.mark.parametrize("aid", TINY)
def test_tiny_block_linears_fit_rotation_groups(tiny, aid):
    arch, model = arch_of(aid), tiny[aid]
    odd = {n: m.in_features for n, m in model.named_modules() if isinstance(m, nn.Linear)
           and n.split(".")[0] in arch.policy.block_paths and m.in_features % 256}
    allowed = {"z_image": {682}}  # Z-Image's FFN width is int(dim * 8 / 3), fixed by the class
    assert set(odd.values()) <= allowed.get(aid, set()), odd


@pytest.mark.parametrize("aid", TINY)
def test_tiny_native_round_trip_tensors(tiny, aid):
    arch, model = arch_of(aid), tiny[aid]
    sd = model.state_dict()
    back = arch.from_native(arch.state_dict_to_native(sd))
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


@pytest.mark.parametrize("aid", sorted(GENERIC_CONVERTERS))
def test_tiny_native_loads_through_diffusers_converter(tiny, aid):
    """Our native tensors (incl. fused qkv, swapped modulation halves) are what diffusers' converter expects."""
    from diffusers.loaders import single_file_utils

    arch, model = arch_of(aid), tiny[aid]
    native = arch.state_dict_to_native(model.state_dict())
    converted = getattr(single_file_utils, GENERIC_CONVERTERS[aid])(dict(native))
    ref = model.state_dict()
    assert set(converted) == set(ref)
    for k, v in ref.items():
        assert torch.equal(converted[k], v), k


def test_flux1_native_fused_rows(tiny):
    arch, model = A.get_arch("flux1"), tiny["flux1"]
    cfg = arch.config_from_model(model)
    native = arch.state_dict_to_native(model.state_dict())
    q = model.state_dict()["single_transformer_blocks.1.attn.to_q.weight"]
    name, rows = arch.to_native("single_transformer_blocks.1.attn.to_q", cfg)
    assert name == "single_blocks.1.linear1" and torch.equal(native[name + ".weight"][rows], q)
    name, rows = arch.to_native("single_transformer_blocks.1.proj_mlp", cfg)
    assert torch.equal(native[name + ".weight"][rows], model.state_dict()["single_transformer_blocks.1.proj_mlp.weight"])
    shift_scale = native["final_layer.adaLN_modulation.1.weight"]
    scale_shift = model.state_dict()["norm_out.linear.weight"]
    assert torch.equal(shift_scale[cfg.hidden_size:], scale_shift[: cfg.hidden_size])


def test_generic_fallback_warns_and_keeps_first_and_last():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 32)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3))
            self.out = nn.Linear(32, 8)

    model = Odd()
    with pytest.warns(UserWarning, match="Odd"):
        arch = arch_for_model(model)
    assert isinstance(arch, Generic)
    assert arch.policy.keep_float == ("inp", "out") and arch.policy.block_paths == ("blocks",)
    cfg = arch.config_from_model(model)
    assert cfg.hidden_size == 32 and cfg.num_layers == 3
    assert generic_policy(nn.Identity()).keep_float == ()  # no Linear at all: no crash
    assert arch.lora_targets("transformer.blocks.0.0.lora_A.weight") == [("blocks.0.0", None)]
