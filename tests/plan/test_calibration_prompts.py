"""Calibration on a diffusers pipeline's own prompts (quantize.calibration_prompts): a real diffusers
Krea2Pipeline, built offline from tiny components (a Qwen3-VL text encoder, the Qwen-Image VAE, the embedded
tiny Krea 2 transformer, a word-level tokenizer), generates the prompts while the calibration hooks watch its
transformer. The oracle is a second, independent generation with our own hooks on the float model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit_pipe
from lowbit_pipe.errors import RecipeError, StageError
from lowbit_pipe.quant.nn import QuantLinear

PROMPTS = ["a red cat on the mat", "blue sky"]
SETTINGS = ["pipeline=[load,detect,quantize]", "quantize.default.activations=static", "quantize.calibration_steps=2",
            "quantize.calibration_resolution=64", "quantize.calibration_prompts=[a red cat on the mat,blue sky]"]


def tiny_krea2_pipeline():
    """diffusers' Krea2Pipeline around tiny seeded components, no download."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        Krea2Pipeline,
        Krea2Transformer2DModel,
    )
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3VLConfig, Qwen3VLModel

    torch.manual_seed(0)
    vocab = {"[PAD]": 0, "[UNK]": 1}
    for word in " ".join(PROMPTS).split():
        vocab.setdefault(word, len(vocab))
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="[PAD]", unk_token="[UNK]")
    text = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32,
                rope_scaling={"rope_type": "default", "mrope_section": [8, 4, 4], "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  num_position_embeddings=16, deepstack_visual_indexes=[])
    encoder = Qwen3VLModel(Qwen3VLConfig(text_config=text, vision_config=vision)).eval()
    transformer = Krea2Transformer2DModel(
        in_channels=16, num_layers=2, attention_head_dim=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=512, timestep_embed_dim=64, text_hidden_dim=64, num_text_layers=3, text_num_attention_heads=2,
        text_num_key_value_heads=2, text_intermediate_size=128, num_layerwise_text_blocks=1, num_refiner_text_blocks=1,
        axes_dims_rope=(16, 24, 24)).eval()
    vae = AutoencoderKLQwenImage(base_dim=16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True])
    pipe = Krea2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=encoder, tokenizer=tokenizer,
                         transformer=transformer, text_encoder_select_layers=(1, 2, 3))
    # the chat template's token counts, for this tokenizer (the pipeline's constants are the Qwen tokenizer's)
    pipe.prompt_template_encode_start_idx = len(tokenizer(pipe.prompt_template_encode_prefix).input_ids)
    pipe.prompt_template_encode_num_suffix_tokens = len(tokenizer(pipe.prompt_template_encode_suffix).input_ids)
    return pipe


def _input_amax(pipe, names: list[str]) -> dict[str, float]:
    """Our own hooks on the float transformer's linears while the pipeline generates PROMPTS as the recipe asks."""
    amax: dict[str, float] = {}
    modules = dict(pipe.transformer.named_modules())

    def hook_for(name: str):
        def hook(_module: nn.Module, args: tuple) -> None:
            amax[name] = max(amax.get(name, 0.0), float(args[0].detach().abs().max()))
        return hook

    handles = [modules[n].register_forward_pre_hook(hook_for(n)) for n in names]
    try:
        for i, prompt in enumerate(PROMPTS):
            with torch.no_grad():
                pipe(prompt=prompt, num_inference_steps=2, generator=torch.Generator().manual_seed(20_000 + i),
                     output_type="latent", height=64, width=64)
    finally:
        for h in handles:
            h.remove()
    return amax


def test_static_scales_come_from_the_pipelines_prompts(tmp_path):
    pipe = tiny_krea2_pipeline()
    pipe.set_progress_bar_config(leave=False)
    result = lowbit_pipe.run("default", SETTINGS, model=pipe, run_dir=tmp_path / "run")
    layers = {n: m for n, m in pipe.transformer.named_modules() if isinstance(m, QuantLinear) and hasattr(m, "input_scale")}
    assert len(layers) > 10
    assert result.report["quantize"]["calibration"] == {"source": "pipeline prompts", "prompts": 2, "steps": 2,
                                                        "resolution": 64, "seed": 20_000}
    assert pipe._progress_bar_config == {"leave": False}  # the pipeline's own setting, back
    lowbit_pipe.teardown(result)  # the float transformer again, for the oracle's run
    oracle = _input_amax(pipe, list(layers))
    for name, layer in layers.items():
        got = float(layer.input_scale) * 127.0  # int8: input_scale = amax / 127
        assert got == pytest.approx(oracle[name], rel=1e-6), name

    # the arch's example inputs give other scales: the prompts were what the hooks saw
    examples = lowbit_pipe.run("default", SETTINGS[:3], model=pipe, run_dir=tmp_path / "examples")
    assert examples.report["quantize"]["calibration"]["source"] == "arch example inputs"
    differ = [n for n, m in pipe.transformer.named_modules()
              if n in layers and float(m.input_scale) * 127.0 != pytest.approx(oracle[n], rel=1e-3)]
    assert len(differ) > len(layers) // 2
    lowbit_pipe.teardown(examples)


def test_gptq_hessians_come_from_the_pipelines_prompts(tmp_path):
    """GPTQ's passes each re-run the prompts on the model as it stands; its rounding beats round-to-nearest."""
    pipe = tiny_krea2_pipeline()
    result = lowbit_pipe.run("default", SETTINGS[:1] + SETTINGS[2:] + ["quantize.default.format=nvfp4",
                                                                       "quantize.gptq.enabled=true"],
                             model=pipe, run_dir=tmp_path / "run")
    report = result.report["quantize"]
    assert report["calibration"]["source"] == "pipeline prompts"
    losses = report["gptq"]["layers"]
    assert len(losses) > 10
    assert sum(v["gptq_loss"] for v in losses.values()) < sum(v["rtn_loss"] for v in losses.values())
    lowbit_pipe.teardown(result)


def test_prompts_without_a_pipeline_are_an_error_naming_the_key(tmp_path, tiny_model):
    with pytest.raises(StageError, match=r"quantize.calibration_prompts \(for activations=static\) needs a diffusers "
                                         r"pipeline.*diffusers_model"):
        lowbit_pipe.run("default", SETTINGS, model=tiny_model("krea2"), run_dir=tmp_path / "run")
    with pytest.raises(RecipeError) as info:
        lowbit_pipe.run("default", SETTINGS[:-1] + ["quantize.calibration_prompts=['a cat', ' ']"],
                        run_dir=tmp_path / "blank")
    assert info.value.path == "quantize.calibration_prompts"
