"""Files on disk: safetensors checks and atomic writes (checkpoint, tempfiles), lazy reads, diffusers <-> ComfyUI
native key layout, a checkpoint streamed file to file."""
