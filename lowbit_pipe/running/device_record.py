"""Which device a run used, as the run's own process sees it: report.json's `device`.

    device: {type: cuda, index: 0, count: 1, name: "NVIDIA H100 80GB HBM3", uuid: "GPU-8f3e...",
             physical_index: 3, total_memory_bytes: ..., cuda_visible_devices: "3"}
    device: {type: cpu, cuda_visible_devices: null}

`index` is the torch ordinal the run used (cuda:0 under a launcher that gives each job one GPU), `count` the GPUs
the process could see, `uuid` the GPU's own identity (what `nvidia-smi -L` lists), `cuda_visible_devices` the
variable as the process got it (set per job by hydra/launcher=gpus and by Ray; null when unset). `physical_index`:
the entry of CUDA_VISIBLE_DEVICES the run's ordinal maps to when that entry is an index, the ordinal itself when the
variable is unset, null when the entry is a UUID (the uuid says which GPU). Read from torch and the environment
only: it changes nothing, and on the CPU it starts nothing.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def _cuda_index(device: str | torch.device | None) -> int | None:
    """The CUDA ordinal `device` (a recipe's model.device, or a passed-in model's device) runs on; None: not CUDA."""
    if device is None:
        return None
    if isinstance(device, str) and device == "auto":
        return 0 if torch.cuda.is_available() else None
    resolved = torch.device(device)
    if resolved.type != "cuda" or not torch.cuda.is_available():
        return None
    return resolved.index if resolved.index is not None else 0


def physical_index(visible: str | None, index: int) -> int | None:
    if visible is None:
        return index
    entries = [e.strip() for e in visible.split(",")]
    entry = entries[index] if index < len(entries) else ""
    return int(entry) if entry.isdigit() else None


def _model_device(model: Any) -> torch.device | None:
    """Where a passed-in torch module's first parameter lives (a recipe with model.device unset runs there)."""
    if not isinstance(model, torch.nn.Module):
        return None
    first = next(model.parameters(), None)
    return first.device if first is not None else None


def device_record(device: str | None, model: Any = None) -> dict[str, Any]:
    """The record for a run whose recipe says model.device=`device`, on `model` when one is passed in."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    index = _cuda_index(device if device is not None else _model_device(model))
    if index is None:
        return {"type": "cpu", "cuda_visible_devices": visible}
    record: dict[str, Any] = {"type": "cuda", "index": index, "count": torch.cuda.device_count()}
    if index < record["count"]:
        props = torch.cuda.get_device_properties(index)
        uuid = str(getattr(props, "uuid", "") or "") or None
        if uuid is not None and not uuid.startswith(("GPU-", "MIG-")):
            uuid = f"GPU-{uuid}"
        record.update(name=props.name, uuid=uuid, total_memory_bytes=int(props.total_memory))
    record.update(physical_index=physical_index(visible, index), cuda_visible_devices=visible)
    return record
