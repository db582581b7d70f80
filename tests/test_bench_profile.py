"""bench/forward_profile.py: the kernel-name categories its table rests on, and a CPU smoke run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


@pytest.mark.parametrize("name,expected", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "gemm"),
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "gemm"),
    ("_int8_tma_kernel", "gemm"),
    ("_fp8_gemm_kernel", "gemm"),
    ("aten::mm", "gemm"),
    ("lowbit_pipe::int8_gemm", "gemm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("_quant_rows_kernel", "quantize / rotate / decode"),
    ("_amax_down_kernel", "quantize / rotate / decode"),
    ("_nvfp4_act_kernel", "quantize / rotate / decode"),
    ("_nvfp4_decode_kernel", "quantize / rotate / decode"),
    ("triton_poi_fused__to_copy_add_mul_rms_norm_0", "fused elementwise (Inductor)"),
    ("triton_red_fused_abs_amax_div_1", "fused elementwise (Inductor)"),
    # Inductor names a kernel after the ops it fused, the quantized GEMM's custom op among them (H200 names)
    ("triton_red_fused__to_copy_abs_amax_clamp_div_fp8_gemm_gt_mul_ones_like_reciprocal_silu_view_where_6",
     "fused elementwise (Inductor)"),
    ("triton_red_fused__to_copy_abs_amax_clamp_clamp_min_div_int8_gemm_mul_round_silu_view_6",
     "fused elementwise (Inductor)"),
    ("_svdquant_act_kernel", "quantize / rotate / decode"),
    ("_mxfp8_act_kernel", "quantize / rotate / decode"),
    ("_int4_group_decode_kernel", "quantize / rotate / decode"),
    ("lowbit_pipe::float_gemm", "gemm"),
    # eager: aten's own kernels, one per op (H200 names)
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
     "elementwise (aten, eager)"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>",
     "elementwise (aten, eager)"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "elementwise (aten, eager)"),
    ("aten::copy_", "elementwise (aten, eager)"),
    ("aten::empty", "other"),
])
def test_kernel_names_fall_in_their_category(name, expected):
    from forward_profile import category

    assert category(name) == expected


def test_cpu_smoke_run_splits_the_whole_forward(tmp_path):
    from forward_profile import main

    out = tmp_path / "profile.json"
    assert main(["--device", "cpu", "--small", "--variants", "bf16", "--iters", "2", "--eager", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["wall_ms"] is None  # CUDA events only
    assert "eager (no compile)" in out.with_suffix(".md").read_text()
    assert row["variant"] == "bf16" and row["total_ms"] > 0
    assert row["ms"]["gemm"] > 0 and row["ms"]["attention"] > 0
    assert sum(row["ms"].values()) == pytest.approx(row["total_ms"])
    assert out.with_suffix(".md").read_text().count("| bf16 |") == 1
