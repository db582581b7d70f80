#!/usr/bin/env bash
# Fill the git-excluded folders a ComfyUI device call carries (docs/testing.md, "On the GPU"), from the checkout's
# root, on a machine with the package index:
#   .whl_comfy/  hydra-core, omegaconf, antlr4, diffusers, comfy-kitchen for the device's Python 3.12 (comfy-kitchen
#                without its ROCm library, which would not fit the carry)
#   .carry/      the ComfyUI 0.29.0 archive (found as the tests find it: LOWBIT_COMFYUI_ARCHIVE, or shared/ beside the
#                checkout) and whl/: ComfyUI's requirements that the device's Python lacks, as wheels
# and add both to .git/info/exclude. Then: carry [".whl_comfy", ".carry"], install both wheel sets with pip
# --no-index --no-deps --target, and run `bash bench/gpu_suite.sh comfyui_...`. With the tree that is close to the
# 64 MiB a call carries: where it is refused as too large, move bench/results/ out of the working tree for the call
# (the device copies the working tree, not the index) and put it back right after, before any commit.
set -euo pipefail
archive=$(python3 -c "import sys; sys.path.insert(0, 'bench'); from comfyui_server import find_archive; print(find_archive())")
rm -rf .whl_comfy .carry
mkdir -p .whl_comfy .carry/whl
cp "$archive" .carry/comfyui-0.29.0.tar.xz
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
  -d .whl_comfy hydra-core==1.3.8 omegaconf==2.3.1 diffusers==0.42.1 comfy-kitchen==0.2.40
python3 -m pip wheel -q --no-deps -w .whl_comfy antlr4-python3-runtime==4.9.3  # no binary wheel on the index
python3 - .whl_comfy/comfy_kitchen-*.whl <<'EOF'
import sys, zipfile
from pathlib import Path

wheel = Path(sys.argv[1])
rocm = "comfy_kitchen/backends/hip/_C"
tmp = wheel.with_suffix(".tmp")
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        if item.filename.startswith(rocm):
            continue
        data = src.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(keepends=True) if not line.startswith(rocm.encode()))
        dst.writestr(item, data)
tmp.replace(wheel)
EOF
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
