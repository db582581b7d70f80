"""The adapter's peft LoraConfig decides each layer's scale: alpha_pattern, rank_pattern, use_rslora, use_dora.

Oracle: peft itself. A real peft adapter with random factors is created on the tiny Krea 2 transformer,
saved the three ways users get such files (a diffusers pipeline's `save_lora_weights` with the adapter
metadata, a diffusers model's `save_lora_adapter`, peft's `save_pretrained`), loaded back through
lowbit_pipe.lora, and every layer's delta is compared with peft's own merge and forward. Metadata we
cannot read or apply is a LoraError naming the file and the field.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lowbit_pipe import lora
from lowbit_pipe.lora import LoraError

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict  # noqa: E402
from peft.tuners.lora import LoraLayer  # noqa: E402

# 12 Linears of the tiny Krea 2: to_q / to_out / ff.up 256 wide, to_k / to_v 128, ff.down 512 in.
TARGETS = r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0)|ff\.(up|down))"
CONFIGS = {
    # scale 4 on every to_q, 0.25 on block 1's ff.down, rank 2 (scale 2) on every to_k, 1 elsewhere
    "alpha_pattern": dict(r=4, lora_alpha=4, alpha_pattern={"attn.to_q": 16, r"transformer_blocks\.1\.ff\.down": 1},
                          rank_pattern={"to_k": 2}),
    # alpha / sqrt(r): 4 (rank 4) or 8 / sqrt(2) (to_v, rank 2), not alpha / r
    "rslora": dict(r=4, lora_alpha=8, use_rslora=True, rank_pattern={"to_v": 2}),
    # DoRA (peft's lora_magnitude_vector) on top of rslora and an alpha pattern: baked, checked against peft's merge
    "rslora_dora": dict(r=4, lora_alpha=8, use_rslora=True, use_dora=True, alpha_pattern={"ff.up": 3}),
}
SAVES = ("pipeline", "model", "peft")


def _lora_layers(root: nn.Module) -> dict[str, LoraLayer]:
    return {n: m for n, m in root.named_modules() if isinstance(m, LoraLayer)}


def _randomize(root: nn.Module, seed: int) -> None:
    """Trained-looking factors: B non-zero (peft starts it at 0), DoRA magnitudes off the weight norms."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in _lora_layers(root).values():
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            a.copy_(torch.randn(a.shape, generator=gen) / a.shape[1] ** 0.5)
            b.copy_(torch.randn(b.shape, generator=gen) * 0.02)
            if "default" in layer.lora_magnitude_vector:
                m = layer.lora_magnitude_vector["default"].weight
                m.mul_(1 + 0.2 * torch.randn(m.shape, generator=gen))


def _trained(model: nn.Module, kwargs: dict, how: str, directory, seed: int = 0):
    """(the model holding the peft adapter, its root for module names, the saved LoRA file)."""
    config = LoraConfig(target_modules=TARGETS, **kwargs)
    if how == "peft":
        peft_model = get_peft_model(copy.deepcopy(model), config)
        _randomize(peft_model, seed)
        peft_model.save_pretrained(str(directory))
        return peft_model, peft_model.base_model.model, directory / "adapter_model.safetensors"
    holder = copy.deepcopy(model)
    holder.add_adapter(config)
    _randomize(holder, seed)
    if how == "model":  # ModelMixin.save_lora_adapter: bare keys, bare LoraConfig in the metadata
        holder.save_lora_adapter(str(directory))
    else:  # a pipeline's save_lora_weights: `transformer.` keys and `transformer.`-prefixed LoraConfig fields
        from diffusers.loaders.lora_pipeline import Krea2LoraLoaderMixin

        Krea2LoraLoaderMixin.save_lora_weights(
            str(directory), transformer_lora_layers=get_peft_model_state_dict(holder),
            transformer_lora_adapter_metadata=holder.peft_config["default"].to_dict())
    return holder, holder, directory / "pytorch_lora_weights.safetensors"


def _peft_merged_deltas(root: nn.Module) -> dict[str, torch.Tensor]:
    """peft's own merged weight minus the base weight, per layer (LoRA and DoRA alike)."""
    out = {}
    with torch.no_grad():
        for name, layer in _lora_layers(root).items():
            before = layer.base_layer.weight.detach().clone()
            layer.merge(adapter_names=["default"])
            out[name] = layer.base_layer.weight.detach() - before
            layer.unmerge()
    return out


def _peft_forward_delta(layer: LoraLayer, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return layer(x) - layer.base_layer(x)


def _own_forward_delta(layer: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return layer(x) - nn.functional.linear(x, weight, layer.bias)


@pytest.mark.parametrize("how", SAVES)
@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_every_layer_matches_peft(tiny_model, tmp_path, case, how):
    model = tiny_model("krea2")
    holder, root, path = _trained(model, CONFIGS[case], how, tmp_path / "lora")
    oracle = _peft_merged_deltas(root)
    assert len(oracle) == 12 and all(d.abs().max() > 0 for d in oracle.values())
    dora = CONFIGS[case].get("use_dora", False)

    # 1. the parsed factors: every layer's delta
    data = lora.parse_lora(path, model)
    ours = {f.module: f.delta_weight(model.get_submodule(f.module).weight) for f in data.layers}
    assert ours.keys() == oracle.keys()
    wrong = [name for name in oracle if not torch.allclose(ours[name], oracle[name], rtol=1e-4, atol=1e-7)]
    assert not wrong, f"{len(wrong)} of {len(oracle)} layers differ from peft: {wrong}"
    assert data.rslora == CONFIGS[case].get("use_rslora", False)

    # 2. attach: residual branches (forward vs peft's forward), or DoRA baked (weights vs peft's merge)
    attached = copy.deepcopy(model)
    weights = {n: attached.get_submodule(n).weight.detach().clone() for n in oracle}
    with pytest.warns(UserWarning, match="DORA") if dora else _no_warning():
        handle = lora.attach(attached, path, name="p")
    gen = torch.Generator().manual_seed(1)
    for name, peft_layer in _lora_layers(root).items():
        layer = attached.get_submodule(name)
        if dora:
            torch.testing.assert_close(layer.weight.detach() - weights[name], oracle[name], rtol=1e-4, atol=1e-6,
                                       msg=name)
            continue
        x = torch.randn(3, layer.in_features, generator=gen)
        torch.testing.assert_close(_own_forward_delta(layer, x, weights[name]), _peft_forward_delta(peft_layer, x),
                                   rtol=1e-4, atol=1e-6, msg=name)
    assert (sorted(handle.baked) if dora else sorted(handle.layers)) == sorted(oracle)

    # 3. the residual export (scale folded into lora_B) reloads to the same deltas
    if not dora:
        exported = tmp_path / "model.lora.safetensors"
        assert lora.save_residual_lora(attached, exported) > 0
        again = lora.parse_lora(exported, model)
        for f in again.layers:
            torch.testing.assert_close(f.delta_weight(), oracle[f.module], rtol=1e-4, atol=1e-7, msg=f.module)

    # 4. bake_files: the baked weight change is peft's merge
    baked = copy.deepcopy(model)
    lora.bake_files(baked, [(str(path), 1.0)])
    for name in oracle:
        torch.testing.assert_close(baked.get_submodule(name).weight.detach() - weights[name], oracle[name],
                                   rtol=1e-4, atol=1e-6, msg=name)


class _no_warning:
    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def test_pattern_key_resolves_like_peft():
    from peft.utils.other import get_pattern_key

    from lowbit_pipe.lora.peft_config import pattern_key

    patterns = ["attn.to_q", r"transformer_blocks\.1\.ff\.down", "to_k", "ff", r"blocks\.\d+\.attn\.to_out\.0", "q"]
    names = ["transformer_blocks.0.attn.to_q", "transformer_blocks.1.ff.down", "transformer_blocks.0.ff.down",
             "text_fusion.refiner_blocks.0.attn.to_k", "transformer_blocks.1.attn.to_out.0", "to_k", "ff",
             "transformer_blocks.0.ff", "transformer_blocks.0.attn.to_v", "xto_k"]
    for name in names:
        theirs = get_pattern_key(patterns, name)
        assert pattern_key(patterns, name) == (theirs if theirs in patterns else None), name


def _write(tmp_path, meta, *, rank: int = 4, dora: bool = False, name: str = "bad.safetensors"):
    key = "transformer.transformer_blocks.0.attn.to_q"
    gen = torch.Generator().manual_seed(0)
    sd = {f"{key}.lora_A.weight": torch.randn(rank, 256, generator=gen),
          f"{key}.lora_B.weight": torch.randn(256, rank, generator=gen) * 0.01}
    if dora:
        sd[f"{key}.lora_magnitude_vector"] = torch.rand(256, generator=gen) + 0.5
    path = tmp_path / name
    save_file(sd, str(path), metadata={"lora_adapter_metadata": meta if isinstance(meta, str) else json.dumps(meta)})
    return path


BAD = [
    ({"transformer.r": 4, "transformer.lora_alpha": "eight"}, r"lora_adapter_metadata: transformer\.lora_alpha\].*'eight'"),
    ({"r": 4, "lora_alpha": 4, "use_rslora": "yes"}, r"lora_adapter_metadata: use_rslora\].*expected true or false"),
    ({"r": 4, "lora_alpha": 4, "lora_bias": "maybe"}, r"lora_adapter_metadata: lora_bias\]"),
    ({"r": 4, "lora_alpha": 4, "use_dora": True}, r"lora_adapter_metadata: use_dora\].*no DoRA magnitude"),
    ({"r": 4, "lora_alpha": 4, "use_qalora": True}, r"lora_adapter_metadata: use_qalora\]"),
    ({"r": 4, "lora_alpha": 4, "kasa_config": {"x": 1}}, r"lora_adapter_metadata: kasa_config\]"),
    ({"r": 4, "lora_alpha": 4, "peft_type": "LOHA"}, r"lora_adapter_metadata: peft_type\].*not a LoRA"),
    ({"r": 8, "lora_alpha": 8}, r"lora_adapter_metadata: r\].*rank 8.*rank 4"),
    ({"r": 2, "lora_alpha": 8, "rank_pattern": {"to_q": 8}}, r"lora_adapter_metadata: rank_pattern\['to_q'\]\].*rank 8"),
    ({"r": 4, "lora_alpha": 4, "alpha_pattern": {"to_q(": 2}},
     r"lora_adapter_metadata: alpha_pattern\['to_q\('\]\].*not a valid"),
    ({"r": 4, "lora_alpha": 4, "alpha_pattern": {"to_q": "x"}}, r"lora_adapter_metadata: alpha_pattern\['to_q'\]\]"),
    ({"r": 4, "lora_alpha": 4, "alpha_pattern": [1]}, r"lora_adapter_metadata: alpha_pattern\].*expected a mapping"),
    ({"r": 4}, r"lora_adapter_metadata: lora_alpha\].*missing"),
    ("{not json", r"lora_adapter_metadata\]: .*not valid JSON"),
    ([4, 4], r"lora_adapter_metadata\]: .*expected a JSON object"),
]


@pytest.mark.parametrize("meta, match", BAD)
def test_unreadable_or_unsupported_config_names_file_and_field(tiny_model, tmp_path, meta, match):
    path = _write(tmp_path, meta)
    with pytest.raises(LoraError, match=r"bad\.safetensors \[" + match):
        lora.parse_lora(path, tiny_model("krea2"))


def test_dora_magnitude_with_use_dora_false_is_an_error(tiny_model, tmp_path):
    path = _write(tmp_path, {"r": 4, "lora_alpha": 4, "use_dora": False}, dora=True)
    with pytest.raises(LoraError, match=r"bad\.safetensors \[lora_adapter_metadata: use_dora\].*lora_magnitude_vector"):
        lora.parse_lora(path, tiny_model("krea2"))


def test_pipeline_config_of_another_component_is_not_used(tiny_model, tmp_path):
    """diffusers sorts the keys: `text_encoder.lora_alpha` comes before `transformer.lora_alpha`. The text
    encoder's config is not even validated (its use_qalora would be an error for the transformer's)."""
    meta = json.dumps({"text_encoder.r": 4, "text_encoder.lora_alpha": 1, "text_encoder.use_qalora": True,
                       "transformer.r": 4, "transformer.lora_alpha": 8, "transformer.use_rslora": True}, sort_keys=True)
    data = lora.parse_lora(_write(tmp_path, meta, name="p.safetensors"), tiny_model("krea2"))
    (f,) = data.layers
    assert f.alpha == 8.0 and f.rslora and f.scale == pytest.approx(8 / 2)


def test_alpha_override_and_unknown_fields(tiny_model, tmp_path):
    path = _write(tmp_path, {"r": 4, "lora_alpha": 4, "use_rslora": True, "alpha_pattern": {"to_q": 2},
                             "some_future_field": {"on": True}}, name="p.safetensors")
    with pytest.warns(UserWarning, match="some_future_field"):
        data = lora.parse_lora(path, tiny_model("krea2"))
    assert data.layers[0].scale == pytest.approx(2 / 2)  # alpha_pattern, rslora
    with pytest.warns(UserWarning, match="some_future_field"):
        data = lora.parse_lora(path, tiny_model("krea2"), alpha=6.0)
    assert data.layers[0].scale == pytest.approx(6 / 2)  # the override replaces alphas, rslora stays
