"""LoRA on quantized models: exact low-rank residual branches, or baked into the weights.

    handle = lora.attach(model, "style.safetensors", strength=0.8, name="style", ledger=ledger)
    handle.set_strength(0.5)                     # exact re-weight
    handle.remove()                              # every layer back to its pre-LoRA output, bit for bit
    lora.bake_files(model, [(path, 1.0)], mode="stochastic", seed=0)
    lora.save_residual_lora(model, "model.lora.safetensors", "native")   # ComfyUI names ("diffusers": peft)

`lora.set_strength(model, name, s)` / `lora.remove(model, name)` do the same by adapter name; a
removed handle's methods raise LoraRemovedError. The scale of each layer follows peft (alpha /
rank, alpha / sqrt(rank) for rslora, `alpha_pattern` / `rank_pattern` from the adapter's LoraConfig).

files.py parses and maps keys, branches.py is the typed branch list on layers, bake.py
requantizes, export.py writes the residual branches as one LoRA file named as the exported
checkpoint is (ComfyUI's native names or diffusers').
"""

from lowbit_pipe.lora.apply import (
                                    LoraHandle,
                                    LoraRemovedError,
                                    attach,
                                    attached,
                                    bake_files,
                                    load,
                                    remove,
                                    set_strength,
)
from lowbit_pipe.lora.branches import LoraBranch, LoraStack
from lowbit_pipe.lora.export import (
                                    has_residual_lora,
                                    residual_metadata,
                                    residual_pairs,
                                    residual_state_dict,
                                    save_residual_lora,
)
from lowbit_pipe.lora.files import LayerFactors, LoraData, LoraError, parse_lora

__all__ = ["LayerFactors", "LoraBranch", "LoraData", "LoraError", "LoraHandle", "LoraRemovedError", "LoraStack",
           "attach", "attached", "bake_files", "has_residual_lora", "load", "parse_lora", "remove",
           "residual_metadata", "residual_pairs", "residual_state_dict", "save_residual_lora", "set_strength"]
