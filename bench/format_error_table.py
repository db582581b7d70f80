"""Format error / size table: bits per weight, full Krea 2 transformer bytes, weight error.

Run on the CPU:  python bench/format_error_table.py [--out bench/results/format_errors.json]

- bits/weight: stored bytes (codes + every scale) * 8 / weights, for a 3072 x 6144 layer.
- Krea 2 bytes: diffusers `Krea2Transformer2DModel()` default config built on the meta device;
  every nn.Linear inside transformer_blocks is quantized (layers the format cannot take stay
  bf16), everything else (img_in, final_layer*, time_embed*, time_mod_proj, text_fusion*,
  txt_in*, norms, biases) is bf16; `.comfy_quant` records are counted too.
- relative error ||W_q - W|| / ||W|| on a Gaussian and a Student-t (df=3) weight of shape
  3072 x 6144, ours next to comfy-kitchen's (eager backend) on the same tensor, plus whether
  the stored tensors are bit-identical.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lowbit_pipe.formats import FormatSpec, encode_record, get_format

SHAPE = (3072, 6144)
# (label, our format, spec, comfy-kitchen layout, its kwargs, our-suffix -> its-suffix)
ROWS = [
    ("fp8 (tensor scale)", "fp8", FormatSpec("fp8", granularity="tensor"), "TensorCoreFP8Layout", {}, {"weight": "", "weight_scale": "_scale"}),
    ("int8 (row scale)", "int8", FormatSpec("int8"), "TensorWiseINT8Layout", {"per_channel": True}, {"weight": "", "weight_scale": "_scale"}),
    ("int8 + convrot", "int8", FormatSpec("int8", rotation="convrot"), "TensorWiseINT8Layout", {"per_channel": True, "convrot": True}, {"weight": "", "weight_scale": "_scale"}),
    ("nvfp4", "nvfp4", FormatSpec("nvfp4"), "TensorCoreNVFP4Layout", {}, {"weight": "", "weight_scale": "_scale", "weight_scale_2": "_scale_2"}),
    ("nvfp4 + convrot", "nvfp4", FormatSpec("nvfp4", rotation="convrot"), None, {}, {}),
    ("convrot_w4a4", "convrot_w4a4", FormatSpec("convrot_w4a4", rotation="convrot"), "TensorCoreConvRotW4A4Layout", {}, {"weight": "", "weight_scale": "_scale"}),
    ("w4a8 (asym_w4a8_int8)", "w4a8", FormatSpec("w4a8", rotation="convrot"), "AsymW4A8Int8Layout", {"bits": 4},
     {"weight": "", "weight_s_rel": "_s_rel", "weight_s_channel": "_s_channel", "weight_codebook": "_codebook"}),
    ("w6a8 (asym_w4a8_int8, 6-bit)", "w6a8", FormatSpec("w6a8", rotation="convrot"), "AsymW4A8Int8Layout", {"bits": 6},
     {"weight": "", "weight_s_rel": "_s_rel", "weight_s_channel": "_s_channel"}),
]
KEEP_FLOAT_PREFIXES = ("img_in", "final_layer", "time_embed", "time_mod_proj", "text_fusion", "txt_in")


def test_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gauss = torch.randn(*SHAPE, generator=gen) * 0.02
    torch.manual_seed(seed + 1)  # StudentT.sample takes no generator
    student = torch.distributions.StudentT(3.0).sample(SHAPE) * 0.02
    return {"gaussian": gauss, "student_t3": student}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def krea2_bytes(fmt_name: str | None, spec: FormatSpec | None) -> tuple[int, int, int]:
    """(total bytes, params, quantized weights) for the full Krea 2 transformer."""
    from diffusers import Krea2Transformer2DModel

    with torch.device("meta"):
        model = Krea2Transformer2DModel()
    total, quantized = 0, 0
    handled: set[str] = set()
    fmt = get_format(fmt_name) if fmt_name else None
    if fmt is not None:
        for name, mod in model.named_modules():
            if not isinstance(mod, torch.nn.Linear) or name.startswith(KEEP_FLOAT_PREFIXES):
                continue
            if not name.startswith("transformer_blocks"):
                continue
            out_f, in_f = mod.weight.shape
            if not fmt.supports_shape(out_f, in_f):
                continue
            q = fmt.quantize(torch.zeros(16, 256), spec)  # record shape only (content-independent)
            total += fmt.storage_bytes(out_f, in_f, spec) + encode_record(q.record).numel()
            quantized += out_f * in_f
            handled.add(f"{name}.weight")
    params = 0
    for pname, p in model.named_parameters():
        params += p.numel()
        if pname not in handled:
            total += 2 * p.numel()  # bf16
    return total, params, quantized


def ck_quantize(layout: str, w: torch.Tensor, kw: dict):
    import comfy_kitchen as ck
    from comfy_kitchen.tensor import QuantizedTensor, get_layout_class

    with ck.registry.use_backend("eager"):
        qt = QuantizedTensor.from_float(w, layout, **kw)
        sd = get_layout_class(layout).state_dict_tensors(qt._qdata, qt._params)
        return sd, qt.dequantize().float()


def same_bits(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return b is not None and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/format_errors.json")
    parser.add_argument("--no-kitchen", action="store_true", help="skip the comfy-kitchen columns")
    args = parser.parse_args()
    try:
        from importlib.metadata import version

        import comfy_kitchen  # noqa: F401

        kitchen = None if args.no_kitchen else version("comfy-kitchen")
    except ImportError:
        kitchen = None  # optional oracle: the table just loses its comfy-kitchen columns
    tensors = test_weights()
    bf16_total, params, _ = krea2_bytes(None, None)
    results = [{"label": "bf16 (reference)", "bits_per_weight": 16.0, "krea2_bytes": bf16_total}]
    for label, name, spec, layout, kw, keymap in ROWS:
        fmt = get_format(name)
        start = time.perf_counter()
        total, _, quantized = krea2_bytes(name, spec)
        row = {
            "label": label,
            "format": name,
            "spec": spec.__dict__,
            "bits_per_weight": fmt.storage_bytes(*SHAPE, spec) * 8 / (SHAPE[0] * SHAPE[1]),
            "krea2_bytes": total,
            "krea2_quantized_weights": quantized,
        }
        for dist, w in tensors.items():
            q = fmt.quantize(w, spec)
            row[f"err_{dist}"] = rel_err(fmt.dequantize(q), w)
            if kitchen and layout:
                sd, dq = ck_quantize(layout, w, kw)
                row[f"ck_err_{dist}"] = rel_err(dq[: SHAPE[0], : SHAPE[1]], w)
                row[f"bit_exact_{dist}"] = all(same_bits(q.tensors[k], sd.get(v)) for k, v in keymap.items()) and set(keymap) == set(q.tensors)
        row["seconds"] = time.perf_counter() - start
        results.append(row)

    def cell(row, key, fmt="{:.4f}"):
        return fmt.format(row[key]) if key in row else "-"

    lines = [
        f"Krea 2 transformer: {params / 1e9:.2f}B params; weights {SHAPE[0]}x{SHAPE[1]}, Gaussian and Student-t(3), std-scale 0.02",
        "",
        "| format | bits/weight | Krea 2 GB | rel.err Gaussian | ck Gaussian | rel.err Student-t3 | ck Student-t3 | bit-exact vs ck |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results:
        exact = "-"
        if "bit_exact_gaussian" in row:
            exact = "/".join("yes" if row[f"bit_exact_{d}"] else "no" for d in tensors)
        lines.append(
            f"| {row['label']} | {row['bits_per_weight']:.3f} | {row['krea2_bytes'] / 1e9:.2f} | {cell(row, 'err_gaussian')} | "
            f"{cell(row, 'ck_err_gaussian')} | {cell(row, 'err_student_t3')} | {cell(row, 'ck_err_student_t3')} | {exact} |"
        )
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": "python bench/format_error_table.py " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
        "comfy_kitchen": kitchen,
        "python": platform.python_version(),
        "device": "cpu",
        "shape": list(SHAPE),
        "krea2_params": params,
        "rows": results,
        "table_markdown": table,
    }
    out.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
