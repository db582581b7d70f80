#!/usr/bin/env bash
# One device call: every GPU figure this repo commits, plus the pipeline on the GPU and the CPU test
# suite under the GPU box's torch. Run from the repo root on the device (wheels installed first):
#   bash bench/gpu_suite.sh "$OUT"
set -uo pipefail
out=${1:?output dir}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/device.txt"
echo "== GPU kernel tests"; timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py 2>&1 | tail -5 | tee "$out/pytest_gpu.log"
echo "== lora overhead"; timeout 150 python3 bench/lora_overhead.py --device cuda --out "$out/lora_overhead_h200.json" 2>&1 | tee "$out/lora_overhead.log"
echo "== teardown proof"; timeout 240 python3 bench/teardown_gpu.py --out "$out/teardown_gpu_h200.json" 2>&1 | tee "$out/teardown_gpu.log"
echo "== pipeline on the GPU"
for r in krea2_nvfp4 flux1_fp8 default; do
  timeout 60 python3 -m lowbit_pipe recipe=$r model.device=cuda model.dtype=bfloat16 hydra.run.dir=/tmp/gpu_runs/$r 2>&1 | tail -14
done > "$out/pipeline_gpu.log"; cat "$out/pipeline_gpu.log"
echo "== tests under this torch"; timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_pipeline.py tests/test_recipe.py tests/test_export_load.py 2>&1 | tail -5 | tee "$out/pytest.log"
