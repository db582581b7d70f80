"""Architecture detection from real-size meta models and their native (ComfyUI / BFL) key lists."""

from __future__ import annotations

import warnings

import pytest
import torch

import lowbit_pipe.arch as A
from lowbit_pipe.arch.detect import UnknownArchError, logical_shapes, packed_logical_shape, strip_prefix
from lowbit_pipe.formats import encode_record

ARCH_IDS = ["krea2", "flux1", "flux2", "qwen_image", "z_image", "sd3", "chroma", "wan"]
NATIVE_CONVERTERS = {  # diffusers' own single-file converters: the oracle for our native mapping
    "krea2": "convert_krea2_transformer_checkpoint_to_diffusers",
    "flux1": "convert_flux_transformer_checkpoint_to_diffusers",
    "flux2": "convert_flux2_transformer_checkpoint_to_diffusers",
    "chroma": "convert_chroma_transformer_checkpoint_to_diffusers",
    "sd3": "convert_sd3_transformer_checkpoint_to_diffusers",
    "wan": "convert_wan_transformer_to_diffusers",
    "z_image": "convert_z_image_transformer_checkpoint_to_diffusers",
}


@pytest.fixture(scope="module")
def real():
    """arch id -> (meta state dict, diffusers config) of the class defaults (real size, no memory)."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for aid in ARCH_IDS:
            arch = A.get_arch(aid)
            with torch.device("meta"):
                model = arch.model_class()()
            out[aid] = (model.state_dict(), arch.config_from_model(model))
    return out


def shapes_of(sd):
    return {k: tuple(v.shape) for k, v in sd.items()}


@pytest.mark.parametrize("aid", ARCH_IDS)
def test_real_diffusers_layout(real, aid):
    sd, cfg = real[aid]
    for prefix in ("", "transformer.", "model.diffusion_model."):
        arch, got, layout = A.detect_state_dict({prefix + k: v for k, v in shapes_of(sd).items()})
        assert (arch.id, layout) == (aid, "diffusers")
        assert got == cfg


@pytest.mark.parametrize("aid", ARCH_IDS)
def test_real_native_layout(real, aid):
    sd, cfg = real[aid]
    arch = A.get_arch(aid)
    native = shapes_of(arch.state_dict_to_native(sd))
    for prefix in ("", "model.diffusion_model.", "diffusion_model."):
        got_arch, got, layout = A.detect_state_dict({prefix + k: v for k, v in native.items()})
        assert got_arch is arch and got == cfg
        assert layout == ("diffusers" if arch.keymap is None else "native")
    assert arch.from_native(native) == shapes_of(sd)  # exact inverse


@pytest.mark.parametrize("aid", sorted(NATIVE_CONVERTERS))
def test_native_mapping_matches_diffusers_converter(real, aid):
    from diffusers.loaders import single_file_utils

    sd, _ = real[aid]
    native = A.get_arch(aid).state_dict_to_native(sd)
    converted = getattr(single_file_utils, NATIVE_CONVERTERS[aid])(dict(native))
    assert shapes_of(converted) == shapes_of(sd)


def test_krea2_real_config(real):
    c = real["krea2"][1]
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp_hidden, c.text_layers) == \
        (28, 6144, 48, 12, 128, 16384, 12)


def test_krea2_native_keys_are_comfyui_names(real):
    native = set(A.get_arch("krea2").state_dict_to_native(real["krea2"][0]))
    for key in ("first.weight", "blocks.0.attn.wq.weight", "blocks.0.attn.gate.weight", "blocks.0.attn.wo.weight",
                "blocks.0.attn.qknorm.qnorm.scale", "blocks.0.mlp.down.weight", "blocks.0.mod.lin", "blocks.0.prenorm.scale",
                "tmlp.0.weight", "tproj.1.weight", "txtfusion.projector.weight", "txtfusion.layerwise_blocks.0.attn.wq.weight",
                "txtfusion.refiner_blocks.1.mlp.up.weight", "txtmlp.1.weight", "last.linear.weight"):
        assert key in native, key


def _packed(shapes, layers, fmt="nvfp4"):
    """Shapes of a file where `layers` are stored packed 2 per byte, plus their records."""
    out, recs = dict(shapes), {}
    for layer in layers:
        n, k = shapes[layer + ".weight"]
        out[layer + ".weight"] = (n, k // 2)
        out[layer + ".weight_scale"] = (n, max(1, k // 16))
        out[layer + ".weight_scale_2"] = ()
        recs[layer] = {"format": fmt}
    return out, recs


def test_krea2_trap_packed_projector_reads_logical_shape(real):
    """`txtfusion.projector.weight` [1, 12] reads [1, 6] once packed: text layers must stay 12."""
    sd, cfg = real["krea2"]
    shapes = shapes_of(sd)
    packed, recs = _packed(shapes, ["text_fusion.projector", "transformer_blocks.0.attn.to_q", "transformer_blocks.3.ff.down"])
    assert packed["text_fusion.projector.weight"] == (1, 6)
    arch, got, _ = A.detect_state_dict(packed, recs)
    assert arch.id == "krea2" and got.text_layers == 12 and got == cfg
    # Native layout with a prefix, records keyed by prefixed native names.
    native = shapes_of(A.get_arch("krea2").state_dict_to_native(sd))
    packed, recs = _packed(native, ["txtfusion.projector", "blocks.0.attn.wq", "blocks.5.mlp.down"])
    pre = "model.diffusion_model."
    arch, got, layout = A.detect_state_dict({pre + k: v for k, v in packed.items()}, {pre + k: v for k, v in recs.items()})
    assert (arch.id, layout, got) == ("krea2", "native", cfg)


def test_comfy_quant_tensors_in_state_dict(real):
    """A state dict of tensors carries its own `.comfy_quant` records (uint8 JSON)."""
    sd, cfg = real["krea2"]
    state = {k: v for k, v in sd.items()}
    state["text_fusion.projector.weight"] = torch.empty(1, 6, dtype=torch.uint8, device="meta")
    state["text_fusion.projector.weight_scale"] = torch.empty(1, 4, device="meta")
    state["text_fusion.projector.comfy_quant"] = encode_record({"format": "nvfp4"})
    assert logical_shapes(state)["text_fusion.projector.weight"] == (1, 12)
    assert "text_fusion.projector.weight_scale" not in logical_shapes(state)
    assert A.detect_state_dict(state)[1] == cfg


def test_packed_fallback_rules():
    assert packed_logical_shape((1, 6), {"format": "nvfp4"}) == (1, 12)
    assert packed_logical_shape((1, 8), {"format": "nvfp4", "lowbit_shape": [1, 12]}) == (1, 12)  # padded
    assert packed_logical_shape((64, 96), {"format": "asym_w4a8_int8", "lowbit_bits": 6}) == (64, 128)
    assert packed_logical_shape((64, 64), {"format": "asym_w4a8_int8"}) == (64, 128)
    assert packed_logical_shape((64, 64), {"format": "convrot_w4a4"}) == (64, 128)
    assert packed_logical_shape((64, 128), {"format": "int8_tensorwise"}) == (64, 128)


def test_unknown_format_uses_fallback(real):
    sd, cfg = real["flux1"]
    packed, recs = _packed(shapes_of(sd), ["transformer_blocks.0.ff.net.2", "x_embedder"], fmt="some_future_fp4")
    recs = {k: {"format": "nvfp4", "lowbit_format": "not_registered_yet"} for k in recs}
    assert A.detect_state_dict(packed, recs)[1] == cfg


def test_strip_prefix_drops_other_components():
    state = {"model.diffusion_model.a.weight": (1, 2), "model.diffusion_model.b.weight": (1, 2),
             "first_stage_model.x": (1,), "cond_stage_model.y": (1,), "text_encoders.z": (1,)}
    stripped, prefix = strip_prefix(state)
    assert prefix == "model.diffusion_model." and set(stripped) == {"a.weight", "b.weight"}
    assert strip_prefix({"a.weight": (1,)}) == ({"a.weight": (1,)}, "")


def test_unknown_model_raises_clear_error():
    with pytest.raises(UnknownArchError, match="no known architecture"):
        A.detect_state_dict({"encoder.layer.0.weight": (4, 4), "decoder.weight": (4, 4)})
    with pytest.warns(UserWarning):
        assert A.detect_or_none({"encoder.layer.0.weight": (4, 4)}) is None


def test_detect_exclusive(real):
    """Every real-size key set matches exactly one arch in each layout."""
    for aid in ARCH_IDS:
        shapes = shapes_of(real[aid][0])
        assert [a.id for a in A.ARCHS.values() if a.detect_keys(shapes)] == [aid]
        native = shapes_of(A.get_arch(aid).state_dict_to_native(real[aid][0]))
        hits = [a.id for a in A.ARCHS.values() if a.detect_native_keys(native)]
        assert hits == ([aid] if A.get_arch(aid).keymap else []), (aid, hits)
