"""Files written from comfy-kitchen's QuantizedTensor state dicts load in lowbit_pipe, values intact."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

ck = pytest.importorskip("comfy_kitchen")
from comfy_kitchen.tensor import QuantizedTensor  # noqa: E402

import lowbit_pipe  # noqa: E402
from lowbit_pipe.quant.nn import QuantLinear  # noqa: E402

# layout, its `.comfy_quant` record, quantize kwargs
LAYOUTS = [
    ("TensorWiseINT8Layout", {"format": "int8_tensorwise"}, {}),
    ("TensorCoreFP8Layout", {"format": "float8_e4m3fn"}, {}),
    ("TensorCoreNVFP4Layout", {"format": "nvfp4"}, {}),
    ("TensorCoreMXFP8Layout", {"format": "mxfp8"}, {}),
    ("TensorWiseINT8Layout", {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256},
     {"convrot": True, "per_channel": True}),
]


@pytest.mark.parametrize("layout, record, kwargs", LAYOUTS)
def test_comfy_kitchen_state_dict_file_loads(tmp_path, layout, record, kwargs):
    # A float native-layout Krea 2 file, then its block linears quantized by comfy-kitchen as ComfyUI's tools do.
    base = lowbit_pipe.run("default", ["pipeline=[load,detect,export]"], run_dir=tmp_path / "float")
    state = load_file(base.export_path)
    expected = {}
    names = sorted({k[: -len(".weight")] for k in state if k.startswith("blocks.") and k.endswith(".weight")
                    and state[k].dim() == 2})
    with ck.registry.use_backend("eager"):
        for name in names:
            qt = QuantizedTensor.from_float(state.pop(f"{name}.weight"), layout, **kwargs)
            state.update(qt.state_dict(f"model.diffusion_model.{name}.weight"))  # keys weight, weight_scale, ...
            state[f"model.diffusion_model.{name}.comfy_quant"] = torch.tensor(list(json.dumps(record).encode()),
                                                                              dtype=torch.uint8)
            expected[name] = qt.dequantize().float()
    state = {(k if k.startswith("model.") else f"model.diffusion_model.{k}"): v for k, v in state.items()}
    path = tmp_path / "ck.safetensors"
    save_file(state, str(path))  # no lowbit metadata: the config comes from the keys plus model.config
    cfg = base.context.model_config
    overrides = [f"+model.config.{k}={v}" for k, v in cfg.items() if isinstance(v, int) and not isinstance(v, bool)]
    overrides.append("+model.config.axes_dims_rope=[%s]" % ",".join(str(v) for v in cfg["axes_dims_rope"]))
    result = lowbit_pipe.run("default", [f"model.path={path}", "pipeline=[load,detect]", *overrides],
                             run_dir=tmp_path / "load")
    assert result.report["detect"]["arch"] == "krea2"
    model = result.model
    native_to_diffusers = {"wq": "to_q", "wk": "to_k", "wv": "to_v", "gate": "to_gate", "wo": "to_out.0"}
    checked = 0
    for name, weight in expected.items():
        _, i, kind, leaf = name.split(".")
        module = f"transformer_blocks.{i}." + (f"attn.{native_to_diffusers[leaf]}" if kind == "attn" else f"ff.{leaf}")
        layer = model.get_submodule(module)
        assert isinstance(layer, QuantLinear), module
        torch.testing.assert_close(layer.dequantize(), weight, rtol=0, atol=0)
        checked += 1
    assert checked == len(names) > 0
