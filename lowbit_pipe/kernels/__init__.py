"""Compute kernels: torch reference versions (CPU, oracles) and GPU paths. Know nothing of recipes."""

# Launch options of kernels whose arithmetic must round as torch's ops round (each op to the tensor's dtype): with
# Triton's default fp fusion, LLVM contracts a rounded multiply and the add after it into one fused multiply-add
# (one rounding), which made the gated residual unlike torch's `x + gate * y` in 10 % of outputs on an H100.
# tests/kernels/test_compiled_form.py reads the launched kernels' sm90 PTX for it.
ROUND_EACH_OP = {"enable_fp_fusion": False}
