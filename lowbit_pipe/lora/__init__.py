"""LoRA on quantized models: exact low-rank residual branches, or baked into the weights.

    handle = lora.attach(model, "style.safetensors", strength=0.8, name="style", ledger=ledger)
    lora.set_strength(model, "style", 0.5)
    lora.remove(model, "style")                  # every layer back to its pre-LoRA output, bit for bit
    lora.bake_files(model, [(path, 1.0)], mode="stochastic", seed=0)
    lora.save_residual_lora(model, "model.lora.safetensors")

files.py parses and maps keys, branches.py is the typed branch list on layers, bake.py
requantizes, export.py writes the residual branches as one LoRA file.
"""

from lowbit_pipe.lora.apply import LoraHandle, attach, attached, bake_files, load, remove, set_strength
from lowbit_pipe.lora.branches import LoraBranch, LoraStack
from lowbit_pipe.lora.export import has_residual_lora, residual_state_dict, save_residual_lora
from lowbit_pipe.lora.files import LayerFactors, LoraData, LoraError, parse_lora

__all__ = ["LayerFactors", "LoraBranch", "LoraData", "LoraError", "LoraHandle", "LoraStack", "attach", "attached",
           "bake_files", "has_residual_lora", "load", "parse_lora", "remove", "residual_state_dict",
           "save_residual_lora", "set_strength"]
