"""The layer swapper: nn.Linear -> QuantLinear per a format spec, every swap through the ledger, plus the run-time
settings of the quantized layers (prepack, nvfp4_compute).

One object that both sides use: the quantize stage applies a Plan's layer part with it, and quantize.target's
solver swaps layers with it for its uniform probes (on a scratch ledger it undoes at once), so the probes run the
very layers the stage would build, without the stage handing its own code down to the planner.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from lowbit_pipe.formats import FormatSpec, QuantizedWeight
from lowbit_pipe.ledger import tensor_bytes
from lowbit_pipe.quant.nn import QuantLinear

# (weight, spec) -> its quantized tensors: a rounding other than the format's own (GPTQ's)
LayerQuantizer = Callable[[torch.Tensor, FormatSpec], QuantizedWeight]
ORIGINALS = ("keep", "cpu", "drop")  # quantize.originals: what happens to each float layer swapped out


def compute_device(name: str | None) -> torch.device | None:
    """quantize.compute_device: None (where each weight is), "auto" (the GPU when there is one), or a device."""
    if name is None:
        return None
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else None
    return torch.device(name)


@dataclass
class _WeightOn:
    """A Linear's weight and bias copied to another device: what QuantLinear.from_linear reads."""

    weight: torch.Tensor
    bias: torch.Tensor | None


def prepack_layers(root: nn.Module, ledger) -> int:
    """Set each QuantLinear's runtime tensors (Format.prepack) through the ledger; returns their bytes."""
    total = 0
    for name, module in root.named_modules():
        if isinstance(module, QuantLinear) and module.prepacked is None:
            runtime = module.prepack()
            if runtime:
                ledger.patch_attr(module, "prepacked", runtime, f"{name}.prepacked")
                total += sum(t.numel() * t.element_size() for t in runtime.values())
    return total


def set_nvfp4_compute(root: nn.Module, compute: str, ledger) -> dict[str, Any]:
    """quantize.nvfp4_compute on every nvfp4 QuantLinear (through the ledger unless "auto", the default) and what
    it resolves to on the model's device: the report's `quantize.nvfp4_compute`."""
    from lowbit_pipe.formats.nvfp4 import computes_weight_only
    from lowbit_pipe.kernels import dispatch

    layers = [(n, m) for n, m in root.named_modules() if isinstance(m, QuantLinear) and m.format.name == "nvfp4"]
    if not layers:
        return {}
    if compute != "auto":
        for name, module in layers:
            ledger.patch_attr(module, "compute", compute, f"{name}.compute")
    device = next((t.device for _, m in layers for t in m.buffers()), torch.device("cpu"))
    probe = torch.empty(0, device=device)
    weight_only = sum(computes_weight_only(m.format.activation_mode(m.qweight), m.compute, probe) for _, m in layers)
    fp8 = sum(m.compute == "fp8" for _, m in layers)
    return {"setting": compute, "device": str(device), "gpu_without_fp4": dispatch.lacks_fp4(device),
            "weight_only_layers": weight_only, "fp8_layers": fp8,
            "nvfp4_activation_layers": len(layers) - weight_only - fp8}


@dataclass(frozen=True)
class LayerSwapper:
    """How quantized layers are built and put in place: `originals` (quantize.originals), `prepack` and
    `nvfp4_compute` (the run-time settings), `device` (quantize.compute_device, resolved: where rounding runs; None
    where each weight is)."""

    originals: str = "keep"
    prepack: bool = False
    nvfp4_compute: str = "auto"
    device: torch.device | None = None

    @classmethod
    def for_config(cls, cfg: Any) -> LayerSwapper:
        """The swapper of a `quantize:` config (recipe.QuantizeConfig)."""
        return cls(cfg.originals, cfg.prepack, cfg.nvfp4_compute, compute_device(cfg.compute_device))

    def for_probes(self) -> LayerSwapper:
        """The same layers for a probe that is undone at once: originals kept, rounded where the weights are."""
        return replace(self, originals="keep", device=None)

    def build(self, linear: nn.Module, spec: FormatSpec, amax: float | None, name: str,
              quantizer: LayerQuantizer | None = None) -> QuantLinear:
        """QuantLinear.from_linear with the rounding on `device`, one layer at a time, and the result placed where the
        float layer is (a ComfyUI model waits on its offload device until it is sampled)."""
        home = linear.weight.device
        if self.device is None or self.device == home:
            return QuantLinear.from_linear(linear, spec, amax, name, quantizer)
        bias = linear.bias.detach().to(self.device) if linear.bias is not None else None
        work = _WeightOn(linear.weight.detach().to(self.device), bias)
        return QuantLinear.from_linear(work, spec, amax, name, quantizer).to(home)

    def install(self, root: nn.Module, built: dict[str, nn.Module], ledger) -> tuple[int, int]:
        """Swap each built layer in through the ledger; (bytes before, after)."""
        before = after = 0
        for name, module in built.items():
            before += tensor_bytes(root.get_submodule(name))
            after += tensor_bytes(module)
            ledger.swap_module(root, name, module, keep_original=self.originals)
        return before, after

    def runtime(self, root: nn.Module, ledger) -> dict[str, Any]:
        """The run-time settings (prepack, nvfp4_compute) on every QuantLinear under `root`, whether quantized now or
        loaded quantized: the report entries they add."""
        out: dict[str, Any] = {}
        if self.prepack:
            out["prepacked_bytes"] = prepack_layers(root, ledger)
        nvfp4 = set_nvfp4_compute(root, self.nvfp4_compute, ledger)
        if nvfp4:
            out["nvfp4_compute"] = nvfp4
        return out

    def swap(self, root: nn.Module, specs: dict[str, FormatSpec], ledger, amax: dict[str, float]) -> None:
        """Quantize and swap in every named layer at its spec (`amax`: static activations' input amax), then the
        run-time settings: what a probe of the solver runs."""
        for name in specs:
            if isinstance(root.get_submodule(name), QuantLinear):
                raise ValueError(f"layer '{name}' is already quantized")
        built = {name: self.build(root.get_submodule(name), spec, amax.get(name), name) for name, spec in specs.items()}
        self.install(root, built, ledger)
        self.runtime(root, ledger)


__all__ = ["ORIGINALS", "LayerSwapper", "compute_device", "prepack_layers", "set_nvfp4_compute"]
