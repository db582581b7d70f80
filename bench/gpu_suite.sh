#!/usr/bin/env bash
# The GPU figures this repo commits, in device calls of under 10 minutes each (a call has a 600 s limit).
# Run from the repo root on the GPU machine, the missing packages installed first (docs/testing.md, "GPU machine"):
#   bash bench/gpu_suite.sh kernels "$OUT"   # GPU tests (every kernel path; autotuning makes them ~6 min)
#   bash bench/gpu_suite.sh linear "$OUT"    # linear_speed with comfy-kitchen and compiled layers, host cost
#   bash bench/gpu_suite.sh headline "$OUT"  # the full-size Krea 2 forward through the recipes (+ torchao)
#   bash bench/gpu_suite.sh stream "$OUT"    # a 25.6 GB synthetic Krea 2 streamed file to file, per format
#   bash bench/gpu_suite.sh pipeline "$OUT"  # LoRA overhead, teardown proof, recipes on the GPU, CPU tests there
#   bash bench/gpu_suite.sh gptq "$OUT"      # GPTQ through the recipe on the full-size Krea 2 (int8, nvfp4)
#   bash bench/gpu_suite.sh profile "$OUT"   # the full-size forward's device time split: GEMM, attention, quantize, ...
#   bash bench/gpu_suite.sh profile_eager "$OUT"  # the same split uncompiled, with wall time (GPU idle on the host)
#   bash bench/gpu_suite.sh attention "$OUT" # 8-bit attention: its GPU tests, the kernel bench (masked shape too)
#   bash bench/gpu_suite.sh headline_attention "$OUT"  # headline rows with and without 8-bit attention, sageattention
#   bash bench/gpu_suite.sh headline_all "$OUT" [--text-valid 77]  # issue 26's item 4: every row in one process
#   bash bench/gpu_suite.sh solver_targets "$OUT" [ratio]  # quantize.target on the full-size Krea 2: speedup 1.15 / ratio 0.3
#   bash bench/gpu_suite.sh solver_speed_singles "$OUT"  # speedup 1.15 beside int8 / int8+convrot / fp8, one baseline
#   bash bench/gpu_suite.sh solver_ratio_nvfp4 "$OUT"  # krea2_nvfp4 beside a target at its bytes, NVFP4 a candidate
#   bash bench/gpu_suite.sh headline_mask "$OUT"  # the 8-bit attention rows with the pipeline's text padding mask
#   bash bench/gpu_suite.sh pipeline_steps "$OUT"  # whole 28-step 1024x1024 images through diffusers' Krea2Pipeline
#   bash bench/gpu_suite.sh attention_fold "$OUT"  # issue 43: the q/k-in-e4m3 fold's check (decides attention.fold_qk's default)
#   bash bench/gpu_suite.sh comfyui_a "$OUT" / comfyui_b "$OUT"  # issue 47: the running-server table, in two calls
#   bash bench/gpu_suite.sh comfyui_c "$OUT"  # the uncompiled pack rows again (plain patchers: no per-queue re-upload)
#   bash bench/gpu_suite.sh comfyui_d "$OUT"  # the file row beside Quantize's (dynamic VRAM kept for ComfyUI's layers)
#   bash bench/gpu_suite.sh rope "$OUT"  # the RoPE kernels' GPU tests, against .rope_before/norm_rope.py if carried,
#                                        # the candidates (rope_e4m3's rows form among them), the fold
#   bash bench/gpu_suite.sh comfyui_e "$OUT"  # the uncompiled rows after the token-major RoPE and shared activations
#   bash bench/gpu_suite.sh gqa "$OUT"   # Krea 2's grouped-query attention: repeated k / v vs SDPA's enable_gqa, per backend
#   bash bench/gpu_suite.sh modulation "$OUT"  # Krea 2's modulated norms / gated residuals: GPU test, kernels vs torch
#   bash bench/gpu_suite.sh comfyui_g "$OUT"  # the uncompiled and compiled rows after grouped k / v and the modulation
#   bash bench/gpu_suite.sh comfyui_h "$OUT"  # the modulation kernels' GPU check (gating), their bench, rope_kernels, then comfyui_g's rows
#   bash bench/gpu_suite.sh comfyui_all "$OUT"  # issue 47's item 6: every row in one server run, no profiles (~9 min)
# The comfyui parts need ComfyUI's archive and requirements carried (the device has neither, nor ../shared):
#   .carry/comfyui-0.29.0.tar.xz and .carry/whl/ (ComfyUI's requirements the device lacks, 13 MB; docs/testing.md;
#   bash bench/comfy_carry.sh fills both folders),
#   and the wheels as .whl_comfy/ = hydra-core, omegaconf, antlr4, diffusers, comfy-kitchen (43 MB): with the tree
#   that is 63 MiB of the 64 MiB a call may carry, so torchao / sageattention / cudnn-frontend stay behind.
# Seconds measured on the H200 (2026-12-03/04): kernels 221 (72 tests); linear ~80 for every row at --rep-ms 20
# without --compiled (the compiled rows add one compile each); stream: source 26-31, then int8 45, fp8 52, nvfp4 48
# per format; headline: torchao 89, each recipe variant 5-26 (72 for the LoRA one, with its recompile counts) once
# Inductor's options are not left changed by torchao (44-64 s each when they were); gptq: int8 241 at full size
# (before GPTQ's column loop became a CUDA graph), nvfp4 148 (after; it had not finished in 570 s before);
# profile, linear_speed of two formats and headline's torchao + fp8 took 235 together.
# Each part writes its logs, JSON and tables under the output dir; commit them to bench/results/.
set -uo pipefail
part=${1:?part: kernels, linear, headline, stream, pipeline, gptq, profile, profile_eager, attention, headline_attention, headline_all, solver_targets, solver_speed_singles, solver_ratio_nvfp4, headline_mask, pipeline_steps, attention_fold, rope, gqa, modulation, comfyui_a, comfyui_b, comfyui_c, comfyui_d, comfyui_e, comfyui_g, comfyui_h or comfyui_all}
out=${2:?output dir}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
# Output names carry the card that ran them (h100, h200; "gpu" for another): the device may lend either.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'H[0-9]{3}' | head -1 | tr 'A-Z' 'a-z')
card=${card:-gpu}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/device.txt"
# Steps two parts share. The modulation kernels' GPU test (with the RoPE ones) and their bench:
modulation_check() {
  timeout 90 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_gpu_kernels.py -k "modulation or rope" \
    2>&1 | tail -6 > "$out/pytest_modulation.log"; tail -3 "$out/pytest_modulation.log"
  timeout 90 python3 bench/modulation_kernels.py --out "$out/modulation_kernels_${card}" > /tmp/modulation.log 2>&1
  tail -12 "$out/modulation_kernels_${card}.md"
}
# the RoPE benches compare against .rope_before/norm_rope.py (another tree's kernels) where it is carried:
rope_before=""; [ -f .rope_before/norm_rope.py ] && rope_before="--before .rope_before/norm_rope.py"
rope_table() {
  timeout 90 python3 bench/rope_kernels.py $rope_before --out "$out/rope_kernels_${card}" > /tmp/rope_kernels.log 2>&1
  tail -12 "$out/rope_kernels_${card}.md"
}
case "$part" in
  kernels)
    # autotuning every kernel specialization dominates: 290 s for 63 tests at c23f1fe, more since
    timeout 560 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_gpu_kernels.py 2>&1 | tail -40 > "$out/pytest_gpu.log"
    tail -3 "$out/pytest_gpu.log" ;;
  linear)
    timeout 420 python3 bench/linear_speed.py --compiled --rep-ms 40 --out "$out/linear_speed_${card}.json" > "$out/linear_speed.log" 2>&1
    tail -3 "$out/linear_speed.log"
    timeout 90 python3 bench/host_cost.py --profile --out "$out/host_cost_${card}.json" > "$out/host_cost.log" 2>&1
    tail -3 "$out/host_cost.log" ;;
  headline)
    timeout 560 python3 bench/headline.py --out "$out/headline_${card}.json" > "$out/headline.log" 2>&1
    tail -25 "$out/headline.log" ;;
  stream)
    timeout 560 python3 bench/stream_bench.py --device cuda --formats int8 fp8 nvfp4 --scratch /tmp/stream \
      --out "$out/stream_${card}" > "$out/stream.log" 2>&1
    tail -12 "$out/stream.log"; rm -rf /tmp/stream ;;
  pipeline)
    timeout 150 python3 bench/lora_overhead.py --device cuda --out "$out/lora_overhead_${card}.json" > "$out/lora_overhead.log" 2>&1
    timeout 240 python3 bench/teardown_gpu.py --out "$out/teardown_gpu_${card}.json" > "$out/teardown_gpu.log" 2>&1
    for r in krea2_nvfp4 flux1_fp8 default; do
      timeout 60 python3 -m lowbit_pipe recipe=$r model.device=cuda model.dtype=bfloat16 hydra.run.dir=/tmp/gpu_runs/$r 2>&1 | tail -14
    done > "$out/pipeline_gpu.log"
    timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_pipeline.py tests/test_recipe.py \
      tests/files/test_export_load.py 2>&1 | tail -5 > "$out/pytest.log"
    tail -3 "$out/pytest.log" ;;
  gptq)
    timeout 560 python3 bench/gptq_full.py --formats int8 nvfp4 --out "$out/gptq_full_${card}.json" > "$out/gptq_full.log" 2>&1
    tail -8 "$out/gptq_full.log" ;;
  profile)
    timeout 560 python3 bench/forward_profile.py --variants bf16 fp8 int8 --out "$out/forward_profile_${card}.json" \
      > "$out/forward_profile.log" 2>&1
    tail -8 "$out/forward_profile.log" ;;
  profile_eager)
    timeout 400 python3 bench/forward_profile.py --eager --variants bf16 fp8 int8 --out "$out/forward_profile_eager_${card}.json" \
      > "$out/forward_profile_eager.log" 2>&1
    tail -8 "$out/forward_profile_eager.log" ;;
  attention)
    timeout 270 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_gpu_kernels.py tests/attention/test_gpu_attention_recipe.py \
      -k attention 2>&1 | tail -30 > "$out/pytest_attention.log"
    tail -3 "$out/pytest_attention.log"
    timeout 250 python3 bench/attention8_bench.py --shapes krea2_1024 krea2_1024_masked krea2_2048 --profile \
      --out "$out/attention8_${card}.json" > "$out/attention8_bench.log" 2>&1
    tail -20 "$out/attention8_bench.log" ;;
  headline_attention)
    # the baselines and every row with 8-bit attention (about 8 minutes; the other rows: `headline`)
    timeout 560 python3 bench/headline.py --no-torchao --only "bf16, compile" "fp8, compiled" "int8, compiled" \
      "krea2_nvfp4, fp8 compute, compiled" "bf16 + " "fp8 + fp8" "int8 + int8" "krea2_nvfp4, fp8 compute +" \
      "fp8, no compile" "int8, no compile" --out "$out/headline_attention_${card}.json" > "$out/headline_attention.log" 2>&1
    tail -25 "$out/headline_attention.log" ;;
  headline_all)
    # issue 26's item 4 in one process: bf16 eager and compiled, torchao fp8-row, sageattention on bf16, and fp8 /
    # int8 / krea2_nvfp4 (fp8 compute), each with and without 8-bit attention, compiled and not. $3: --text-valid N
    timeout 570 python3 bench/headline.py --iters 5 ${3:-} --only "bf16, compile" "torchao" "bf16 + sage" \
      "fp8, compiled" "int8, compiled" "krea2_nvfp4, fp8 compute" "fp8, no compile" "int8, no compile" "bf16 + fp8" \
      "fp8 + fp8" "int8 + int8" --out "$out/headline_all_${card}${3:+_masked}.json" > "$out/headline_all.log" 2>&1
    tail -25 "$out/headline_all.log" ;;
  solver_targets)
    # issue 28: krea2_auto_speed's speedup 1.15 ($3 unset) or ratio 0.3 ($3 = ratio) on the full-size Krea 2, one per
    # call: with the error model's 228 probe forwards each takes ~4-5 min (estimated; the speed table timed first).
    # Then, on the CPU: python bench/solver_h200.py --only tiny --from <this json> --out <this json>
    timeout 570 python3 bench/solver_h200.py --only targets --variants "auto: target.${3:-speedup}" \
      --out "$out/solver_targets_${3:-speedup}_${card}.json" > "$out/solver_targets.log" 2>&1
    tail -14 "$out/solver_targets_${3:-speedup}_${card}.md" ;;
  solver_speed_singles)
    # issue 28: speedup 1.15 beside int8 / int8+convrot / fp8 against one bf16 baseline (the comparison the target asks:
    # less error than the single format of the same measured speed). Then --only tiny --from on the CPU, as above.
    timeout 570 python3 bench/solver_h200.py --only speed_singles --out "$out/solver_speed_singles_${card}.json" \
      > "$out/solver_speed_singles.log" 2>&1
    tail -14 "$out/solver_speed_singles_${card}.md" ;;
  solver_ratio_nvfp4)
    # issue 28: krea2_nvfp4 (fp8 compute) beside a target.ratio at its bytes with NVFP4 among the candidates, one
    # bf16 baseline. Then --only tiny --from on the CPU, as above.
    timeout 570 python3 bench/solver_h200.py --only ratio_nvfp4 --out "$out/solver_ratio_nvfp4_${card}.json" \
      > "$out/solver_ratio_nvfp4.log" 2>&1
    tail -14 "$out/solver_ratio_nvfp4_${card}.md" ;;
  headline_mask)
    # the attention rows with the text padding mask diffusers' Krea2Pipeline always passes (~500 of 512 padded for a
    # short prompt; 77 valid here as in the GPU mask test)
    timeout 560 python3 bench/headline.py --no-torchao --no-sage --iters 5 --text-valid 77 --only "bf16, compile" \
      "fp8, compiled" "bf16 + fp8" "fp8 + fp8 attention, compiled" "int8, compiled" "int8 + int8 attention, compiled" \
      --out "$out/headline_mask_${card}.json" > "$out/headline_mask.log" 2>&1
    tail -14 "$out/headline_mask.log" ;;
  pipeline_steps)
    # bf16 eager and compiled always; the rows issue 26 asks the whole image for
    timeout 560 python3 bench/pipeline_steps.py --iters 1 --only "fp8, compiled" "fp8 + fp8 attention, compiled" "int8, compiled" \
      "krea2_nvfp4, fp8 compute, compiled" "fp8, no compile" --headline bench/results/headline_h200.json \
      --out "$out/pipeline_steps_${card}.json" > "$out/pipeline_steps.log" 2>&1
    tail -14 "$out/pipeline_steps.log" ;;
  attention_fold)
    timeout 300 python3 bench/attention_fold_gpu.py --out "$out/attention_fold_${card}.json" > "$out/attention_fold.log" 2>&1
    tail -30 "$out/attention_fold.log"
    timeout 250 python3 -m pytest -q -p no:cacheprovider tests/attention/test_gpu_cudnn_attention.py tests/attention/test_gpu_attention_recipe.py \
      2>&1 | tail -20 > "$out/pytest_attention_fold.log"; tail -3 "$out/pytest_attention_fold.log" ;;
  rope)
    # carry .whl (and .rope_before/, another tree's norm_rope.py, for the before / after columns)
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_gpu_kernels.py \
      tests/attention/test_gpu_cudnn_attention.py -k "rope or folded" 2>&1 | tail -8 > "$out/pytest_rope.log"
    tail -3 "$out/pytest_rope.log"
    rope_table
    timeout 120 python3 bench/rope_variants.py $rope_before --out "$out/rope_variants_${card}" > "$out/rope_variants.log" 2>&1
    grep -E "package|rows 4x64 w1" "$out/rope_variants_${card}.md" | head -24
    timeout 200 python3 bench/attention_fold_gpu.py --out "$out/attention_fold_${card}" > "$out/attention_fold.log" 2>&1
    head -16 "$out/attention_fold_${card}.md" ;;
  modulation)
    modulation_check ;;
  gqa)
    timeout 120 python3 bench/gqa_attention.py --out "$out/gqa_attention_${card}" > "$out/gqa_attention.log" 2>&1
    tail -22 "$out/gqa_attention_${card}.md" ;;
  comfyui_a|comfyui_b|comfyui_c|comfyui_d|comfyui_e|comfyui_g)
    # one warm machine: part b reuses part a's unpacked ComfyUI, float file and fp8 export under /tmp/cspeed
    if [ "$part" = comfyui_a ]; then
      rows="stock_bf16 pack_fp8 stock_fp8 pack_krea2_nvfp4 pack_fp8_compile pack_fp8_attn pack_file_nvfp4_fp8"
    elif [ "$part" = comfyui_b ]; then
      rows="stock_bf16 stock_bf16_tc stock_fp8_tc pack_int8 pack_fp8_attn_compile pack_krea2_nvfp4_compile pack_int8_compile"
    elif [ "$part" = comfyui_c ]; then
      rows="stock_bf16 pack_fp8 pack_int8 pack_krea2_nvfp4 pack_fp8_attn stock_fp8 stock_fp8_tc pack_file_nvfp4_fp8"
    elif [ "$part" = comfyui_d ]; then
      rows="stock_bf16 pack_file_nvfp4_fp8 pack_krea2_nvfp4 pack_fp8"
    elif [ "$part" = comfyui_e ]; then
      rows="stock_bf16 pack_fp8 pack_krea2_nvfp4 stock_fp8 pack_int8 pack_fp8_attn pack_fp8_compile"
    else
      rows="stock_bf16 pack_fp8 pack_fp8_attn pack_fp8_compile pack_krea2_nvfp4 pack_int8 stock_fp8"
    fi
    timeout 570 python3 bench/comfyui_speed.py --work /tmp/cspeed --archive .carry/comfyui-0.29.0.tar.xz \
      --out "$out/comfyui_speed_${card}_${part#comfyui_}" --rows $rows --profile --deadline-s 430 \
      > "$out/comfyui_speed_${part}.log" 2>&1
    tail -30 "$out/comfyui_speed_${card}_${part#comfyui_}.md" ;;
  comfyui_h)
    # the modulation kernels' GPU test gates the server rows (a kernel unlike torch's ops is not timed as the pack's
    # speed); their bench and the RoPE table on the same machine; the rows in what time is left
    modulation_check
    if grep -q failed "$out/pytest_modulation.log" || ! grep -q passed "$out/pytest_modulation.log"; then
      echo "the modulation / RoPE GPU tests did not pass: no server rows"; exit 1
    fi
    rope_table
    left=$((585 - SECONDS))
    timeout $left python3 bench/comfyui_speed.py --work /tmp/cspeed --archive .carry/comfyui-0.29.0.tar.xz \
      --out "$out/comfyui_speed_${card}_h" --rows stock_bf16 pack_fp8 pack_krea2_nvfp4 pack_fp8_compile pack_int8 \
      pack_fp8_attn stock_fp8 --profile --deadline-s $((left - 120)) > /tmp/comfyui_speed_h.log 2>&1 || tail -20 /tmp/comfyui_speed_h.log
    tail -30 "$out/comfyui_speed_${card}_h.md" ;;
  comfyui_all)
    # every row of bench/comfyui_speed.py in one server and one call: no profiled queues (a/b/c/d have them); rows
    # ~25-35 s each, the float file and two exports ~150 s
    timeout 585 python3 bench/comfyui_speed.py --work /tmp/cspeed --archive .carry/comfyui-0.29.0.tar.xz \
      --out "$out/comfyui_speed_${card}_all" --deadline-s 540 > "$out/comfyui_speed_all.log" 2>&1
    tail -24 "$out/comfyui_speed_${card}_all.md" ;;
  *) echo "unknown part '$part' (kernels, linear, headline, stream, pipeline, gptq, profile, profile_eager, attention, headline_attention, headline_all, solver_targets, solver_speed_singles, solver_ratio_nvfp4, headline_mask, pipeline_steps, attention_fold, rope, gqa, modulation, comfyui_a, comfyui_b, comfyui_c, comfyui_d, comfyui_e, comfyui_g, comfyui_h, comfyui_all)"; exit 2 ;;
esac
