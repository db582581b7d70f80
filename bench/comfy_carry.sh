#!/usr/bin/env bash
# Fill the git-excluded folders a ComfyUI device call carries (docs/testing.md, "On the GPU"), from the checkout's
# root, on a machine with the package index:
#   .whl_comfy/  hydra-core, omegaconf, antlr4, diffusers, comfy-kitchen: taken from ./.whl, which
#                ../shared/device/wheels.sh fills (run it first)
#   .carry/      comfyui-0.29.0.tar.xz (from ../shared) and whl/: ComfyUI's requirements that the device's Python 3.12
#                lacks, as wheels
# and add both to .git/info/exclude. Then: carry [".whl_comfy", ".carry"], install both wheel sets with pip
# --no-index --no-deps --target, and run `bash bench/gpu_suite.sh comfyui_...`. With the tree that is close to the
# 64 MiB a call carries: where it is refused as too large, move bench/results/ out of the working tree for the call
# (the device copies the working tree, not the index) and put it back right after, before any commit.
set -euo pipefail
ls .whl/comfy_kitchen-*.whl .whl/diffusers-*.whl > /dev/null  # ../shared/device/wheels.sh first
rm -rf .whl_comfy .carry
mkdir -p .whl_comfy .carry/whl
cp .whl/antlr4_python3_runtime-*.whl .whl/comfy_kitchen-*.whl .whl/diffusers-*.whl .whl/hydra_core-*.whl \
  .whl/omegaconf-*.whl .whl_comfy/
cp ../shared/comfyui-0.29.0.tar.xz .carry/
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
# what ComfyUI 0.29.0 imports at start or while loading and sampling that the device lacks: the set the server runs
# of sessions 53-56 used (the rest is in the device's Python; PyAV, SciPy, Pillow and SentencePiece get stand-ins
# from bench/comfyui_speed.py)
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
  -d .carry/whl SQLAlchemy alembic Mako greenlet aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict \
  propcache yarl idna einops torchsde trampoline simpleeval blake3 comfy-aimdo==0.4.10 pydantic pydantic-core \
  annotated-types typing-inspection python-dotenv
for d in /.whl_comfy/ /.carry/; do
  grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
du -sh .whl_comfy .carry
