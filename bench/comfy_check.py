"""Does ComfyUI's own loader read what lowbit_pipe writes, and compute what lowbit_pipe computes?

    python bench/comfy_check.py /path/to/ComfyUI [--out bench/results/comfy_check] [--archs krea2 flux1]
                                [--cases int8 nvfp4+convrot ...] [--keep DIR]

For each architecture (tiny Krea 2 and FLUX.1 in the sizes ComfyUI's detection accepts) and each format /
rotation the project writes, this exports a model with `lowbit_pipe.run(pipeline=[load,detect,quantize,export])`
(activations as stock ComfyUI computes them: fp8 static, the rest dynamic; the arch's keep-float list), then, in a
separate Python process per case (ComfyUI keeps global state), on the CPU:

1. loads the file with ComfyUI's `comfy.sd.load_diffusion_model` as it is (stock) and runs the diffusion model's
   forward on seeded inputs under `torch.inference_mode()`;
2. calls `lowbit_pipe.comfy.install_into_comfyui()` (the node pack's registration), loads and runs it again;
3. compares every quantized Linear of ComfyUI's model with lowbit_pipe's own reload of the same file
   (`lowbit_pipe.run(pipeline=[load])`, the QuantLinear of the same layer; a fused native layer such as FLUX
   `qkv` against its diffusers parts concatenated) on the same seeded input: max |comfy - ours| / max |ours|;
4. uninstalls and checks that ComfyUI is back as it was (same functions, no lowbit entries, stock refuses again).

On the CPU ComfyUI emulates the formats this device cannot compute (fp8, nvfp4) as dequantize + matmul, i.e.
weight-only; the table gives that figure and the one with the format enabled (the layer's `_full_precision_mm`
cleared, which is all "disabled" changes: what ComfyUI computes on an fp8 / nvfp4-capable GPU).

Writes `<out>.md` and `<out>.json` (command line, ComfyUI commit, per-case details). ComfyUI is GPL-3: it is
imported from SRC_DIR at run time, nothing of it is copied here.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path
from typing import Any

from lowbit_pipe.formats.common import NOT_IN_STOCK_COMFY

ROOT = Path(__file__).resolve().parent.parent

# Tiny configs ComfyUI's detection reads back as the same model (head_dim 128, Krea 2's fixed text blocks, ...).
TINY = {
    "krea2": ["model=tiny_krea2", "model.tiny_config.in_channels=64", "model.tiny_config.attention_head_dim=128",
              "model.tiny_config.num_attention_heads=2", "model.tiny_config.num_key_value_heads=2",
              "model.tiny_config.intermediate_size=768", "model.tiny_config.timestep_embed_dim=256",
              "model.tiny_config.text_hidden_dim=160", "model.tiny_config.text_num_attention_heads=20",
              "model.tiny_config.text_num_key_value_heads=20", "model.tiny_config.text_intermediate_size=512",
              "model.tiny_config.num_layerwise_text_blocks=2", "model.tiny_config.num_refiner_text_blocks=2",
              "model.tiny_config.axes_dims_rope=[32,48,48]"],
    "flux1": ["model=tiny_flux1", "model.tiny_config.in_channels=64", "model.tiny_config.attention_head_dim=128",
              "model.tiny_config.num_attention_heads=2", "model.tiny_config.axes_dims_rope=[16,56,56]"],
}

# case name -> quantize.default overrides. Activations as stock ComfyUI computes them: fp8 static, the rest dynamic.
CASES = {
    "int8": {"format": "int8"},
    "int8+convrot": {"format": "int8", "rotation": "convrot"},
    "int8+quarot": {"format": "int8", "rotation": "quarot"},
    "fp8": {"format": "fp8", "activations": "static"},
    "fp8+convrot": {"format": "fp8", "rotation": "convrot", "activations": "static"},
    "fp8 per-row": {"format": "fp8", "granularity": "row", "activations": "static"},
    "nvfp4": {"format": "nvfp4"},
    "nvfp4+convrot": {"format": "nvfp4", "rotation": "convrot"},
    "mxfp8": {"format": "mxfp8"},
    "awq_w4a16": {"format": "awq_w4a16"},
    "svdquant_w4a4": {"format": "svdquant_w4a4"},
    "convrot_w4a4": {"format": "convrot_w4a4"},
    "w4a8": {"format": "w4a8"},
    "w6a8": {"format": "w6a8"},
}

SEED = 1234
TOKENS = 24  # rows of the per-layer input


# =============================================================================================== parent
def export_case(arch: str, case: str, out_dir: Path) -> dict[str, Any]:
    import lowbit_pipe

    spec = CASES[case]
    overrides = ["pipeline=[load,detect,quantize,export]", *TINY[arch], "quantize.arch_keep_float=true",
                 *[f"quantize.default.{k}={v}" for k, v in spec.items()]]
    run_dir = out_dir / f"{arch}_{case.replace(' ', '_').replace('+', '_')}"
    t0 = time.time()
    result = lowbit_pipe.run("default", overrides, run_dir=run_dir)
    ex, qz = result.report.get("export") or {}, result.report.get("quantize") or {}
    records = _records(Path(result.export_path))
    return {"arch": arch, "case": case, "spec": spec, "overrides": overrides, "path": result.export_path,
            "status": result.status, "seconds": round(time.time() - t0, 2), "quantized_layers": ex.get("quantized_layers"),
            "not_stock_comfy": len(ex.get("not_stock_comfy") or []), "record_formats": records,
            "unfit": qz.get("unfit"), "warnings": [w.get("message") for w in result.report.get("warnings", [])]}


def _records(path: Path) -> dict[str, int]:
    """`.comfy_quant` format name -> layer count in an exported file."""
    from safetensors import safe_open

    counts: dict[str, int] = {}
    with safe_open(str(path), "pt") as f:
        for key in f.keys():
            if key.endswith(".comfy_quant"):
                fmt = json.loads(bytes(f.get_tensor(key).tolist()))["format"]
                counts[fmt] = counts.get(fmt, 0) + 1
    return counts


def comfy_commit(src: Path) -> dict[str, Any]:
    """The ComfyUI commit of SRC_DIR: git if it is a checkout, else a MANIFEST.tsv beside it (its HEAD line)."""
    try:
        sha = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=20).stdout.strip()
        if len(sha) == 40:
            return {"commit": sha, "source": "git"}
    except (OSError, subprocess.SubprocessError):
        pass
    for manifest in (src / "MANIFEST.tsv", src.parent / "MANIFEST.tsv"):
        if manifest.is_file():
            for line in manifest.read_text().splitlines()[:5]:
                if "HEAD" in line:
                    words = line.replace("(", " ").replace(")", " ").split()
                    sha = next((w for w in words if len(w) == 40 and all(c in "0123456789abcdef" for c in w)), None)
                    date = next((w for w in words if len(w) == 10 and w[4] == "-" and w[7] == "-"), None)
                    if sha:
                        return {"commit": sha, "date": date, "source": str(manifest), "line": line.lstrip("# ")}
    return {"commit": None, "source": "unknown"}


def run_child(src: Path, case: dict[str, Any], timeout: int) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(src), case["path"], out]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT),
                          env={**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    try:
        result = json.loads(Path(out).read_text())
    except (OSError, ValueError):
        result = {"child_failed": True, "returncode": proc.returncode, "stderr_tail": proc.stderr[-4000:]}
    finally:
        Path(out).unlink(missing_ok=True)
    result["child_seconds"] = round(time.time() - t0, 2)
    if proc.returncode != 0:
        result.setdefault("child_failed", True)
        result["stderr_tail"] = proc.stderr[-4000:]
    return result


def _fmt_diff(v: float | None) -> str:
    if v is None:
        return "-"
    return "0 (bit-exact)" if v == 0 else f"{v:.2e}"


MATCH = 1e-5  # max rel diff under which two computations of a layer are "the same math, up to fp32 rounding"


def verdict(case: dict[str, Any]) -> str:
    """"ok" when the expectation holds, else the problems: a stock file loads stock and (format enabled) matches
    lowbit_pipe up to fp32 rounding, and the pack leaves it as stock ComfyUI has it; a file with lowbit kinds
    is refused by stock ComfyUI (naming the kind) and loads with the pack, every layer bit-exact."""
    c = case["comfy"]
    if c.get("child_failed"):
        return "child failed: " + str(c.get("error"))
    lowbit = case["export"]["not_stock_comfy"] > 0
    stock, pack = c["stock"], c["pack"]
    problems = []
    if lowbit:
        if stock["loads"]:
            problems.append("stock ComfyUI loaded a file with lowbit kinds")
        elif "KeyError" not in stock.get("error", "") or not any(
                name in stock.get("error", "") for name in ("lowbit_", *NOT_IN_STOCK_COMFY)):
            problems.append(f"stock refused it, but not at its format lookup: {stock.get('error')}")
    elif not stock["loads"]:
        problems.append(f"stock ComfyUI refused a stock file: {stock.get('error')}")
    if not pack["loads"]:
        problems.append(f"refused with the pack: {pack.get('error')}")
    else:
        lay = pack["layers"]
        if lay.get("errors"):
            problems.append(f"{lay['errors']} layers not compared: {lay['first_error']}")
        if not pack.get("forward_finite", False):
            problems.append("forward with the pack is not finite")
        d = lay.get("max_rel_diff_enabled")
        if lowbit and d != 0:
            problems.append(f"lowbit layers not bit-exact with the pack (max rel diff {d})")
        if not lowbit and (d is None or d > MATCH):
            problems.append(f"stock kinds differ from lowbit_pipe beyond fp32 rounding (max rel diff {d})")
        if not lowbit and stock["loads"]:
            same = (lay.get("layouts") == stock["layers"].get("layouts")
                    and lay.get("max_rel_diff_cpu") == stock["layers"].get("max_rel_diff_cpu"))
            if not same:
                problems.append("the pack changed how stock kinds load or compute")
    un = c.get("uninstall", {})
    if not un.get("restored", False):
        problems.append(f"uninstall did not restore ComfyUI: {un}")
    return "ok" if not problems else "; ".join(problems)


def write_results(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        "# ComfyUI loads lowbit_pipe's exports: stock, and with the node pack's registration",
        "",
        f"`{meta['command']}`",
        "",
        f"ComfyUI {meta['comfyui']['commit']} ({meta['comfyui'].get('date') or 'date unknown'}; "
        f"source: {meta['comfyui']['source']}), comfy-kitchen {meta['comfy_kitchen']}, torch {meta['torch']}, "
        f"{meta['device']}. Tiny models in the sizes ComfyUI detects; per-layer input: seeded "
        f"randn [{TOKENS}, in_features] in the compute dtype ({meta.get('compute_dtype', 'float32')}).",
        "",
        "Columns: *stock loads* = `comfy.sd.load_diffusion_model` of the file as it is; *pack loads* = the same after "
        "`lowbit_pipe.comfy.install_into_comfyui()`; *max rel diff* = over every quantized Linear of ComfyUI's model, "
        "max |ComfyUI - lowbit_pipe| / max |lowbit_pipe| of the layer output, lowbit_pipe being its own reload of the "
        "file (QuantLinear; fused native layers against their parts concatenated). *as on this CPU*: ComfyUI as it runs "
        "here (fp8 / nvfp4 are 'disabled' on a CPU: dequantize + matmul, weight-only); *format enabled*: the same "
        "layers with the format enabled, what ComfyUI computes on an fp8- / nvfp4-capable GPU. The pack columns are "
        "the same in both modes (lowbit kinds are never disabled).",
        "",
        "Cases (`quantize.default.*`, everything else the `default` recipe with the arch's keep-float list): "
        + "; ".join(f"{name}: " + ", ".join(f"{k}={v}" for k, v in spec.items()) for name, spec in CASES.items())
        + ". Activations as stock ComfyUI computes them: fp8 static (it reads input_scale), the rest dynamic.",
        "",
        "| arch | case | records | stock loads? | stock max rel diff (as on this CPU / format enabled) "
        "| pack loads? | pack max rel diff (as on this CPU / format enabled) | layers bit-exact (pack) | forward finite | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e, c = r["export"], r["comfy"]
        recs = ", ".join(f"{k} x{v}" for k, v in sorted(e["record_formats"].items()))
        if c.get("child_failed"):
            lines.append(f"| {e['arch']} | {e['case']} | {recs} | child failed | - | - | - | - | - | {r['verdict']} |")
            continue
        s, p = c["stock"], c["pack"]
        stock_load = "yes" if s["loads"] else f"no: `{s['error']}`"
        sd = f"{_fmt_diff(s['layers'].get('max_rel_diff_cpu'))} / {_fmt_diff(s['layers'].get('max_rel_diff_enabled'))}" \
            if s["loads"] else "-"
        pd = f"{_fmt_diff(p['layers'].get('max_rel_diff_cpu'))} / {_fmt_diff(p['layers'].get('max_rel_diff_enabled'))}" \
            if p["loads"] else "-"
        exact = f"{p['layers'].get('bit_exact', 0)}/{p['layers'].get('count', 0)}" if p["loads"] else "-"
        fin = ("yes" if s.get("forward_finite") else "no") if s["loads"] else "-"
        fin += " / " + (("yes" if p.get("forward_finite") else "no") if p["loads"] else "-")
        lines.append(f"| {e['arch']} | {e['case']} | {recs} | {stock_load} | {sd} | {'yes' if p['loads'] else 'no: ' + p['error']} "
                     f"| {pd} | {exact} | {fin} | {r['verdict']} |")
    lines += ["", "Forward finite: stock / pack. Worst layer per case, uninstall reports and load logs are in the JSON.", ""]
    notes = meta.get("notes") or []
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    out.with_suffix(".md").write_text("\n".join(lines))
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--child":
        return child_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", help="ComfyUI source folder (its root: comfy/, nodes.py, ...)")
    p.add_argument("--out", default="bench/results/comfy_check", help="results path without suffix (.md and .json)")
    p.add_argument("--archs", nargs="+", default=list(TINY), choices=list(TINY))
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--keep", default=None, help="keep the exported files in this folder (default: a temporary one)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per ComfyUI child process")
    args = p.parse_args(argv)
    src = Path(args.src).resolve()
    if not (src / "comfy" / "sd.py").is_file():
        p.error(f"{src} is not a ComfyUI source folder (no comfy/sd.py)")

    import importlib.metadata

    import torch

    meta = {"command": "python bench/comfy_check.py " + " ".join(argv), "comfyui": comfy_commit(src),
            "comfyui_src": str(src), "comfy_kitchen": importlib.metadata.version("comfy-kitchen"),
            "torch": torch.__version__, "python": platform.python_version(), "device": "CPU (ComfyUI --cpu)",
            "seed": SEED, "tokens": TOKENS, "cases": CASES, "tiny_overrides": TINY,
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.keep).resolve() if args.keep else Path(tmp)
        for arch in args.archs:
            for case in args.cases:
                print(f"[{arch} / {case}] export ...", flush=True)
                ex = export_case(arch, case, out_dir)
                print(f"[{arch} / {case}] records {ex['record_formats']}; ComfyUI ...", flush=True)
                comfy = run_child(src, ex, args.timeout)
                row = {"export": ex, "comfy": comfy}
                row["verdict"] = verdict(row)
                meta.setdefault("compute_dtype", comfy.get("compute_dtype"))
                print(f"[{arch} / {case}] stock loads {comfy.get('stock', {}).get('loads')}, pack loads "
                      f"{comfy.get('pack', {}).get('loads')}, pack max rel diff "
                      f"{comfy.get('pack', {}).get('layers', {}).get('max_rel_diff_enabled')}: {row['verdict']}", flush=True)
                rows.append(row)
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    meta["notes"] = findings(rows)
    write_results(ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out), rows, meta)
    print((ROOT / args.out).with_suffix(".md").read_text() if not Path(args.out).is_absolute()
          else Path(args.out).with_suffix(".md").read_text())
    return 0 if all(r["verdict"] == "ok" for r in rows) else 1


# Why a stock kind's figures are what they are (checked against comfy-kitchen 0.2.40's eager backend and ComfyUI's
# ops.py; the numbers come from the rows).
WHY = {
    "int8": "comfy-kitchen's eager `int8_linear` multiplies the integer accumulator by (x_scale * w_scale), lowbit_pipe's "
            "reference by x_scale and then w_scale: the same codes and accumulators, fp32 rounding of the scale product",
    "fp8": "ComfyUI's CPU has no fp8 compute, so the format is 'disabled' there: dequantize + fp32 matmul, no "
           "activation quantization, while the file asks for static fp8 activations (that is the 'as on this CPU' "
           "figure). Enabled (an fp8-capable GPU, or `--supports-fp8-compute`), ComfyUI quantizes the input with the "
           "stored input_scale as lowbit_pipe does; the rest is fp32 rounding of torch's CPU scaled_mm",
    "nvfp4": "ComfyUI disables nvfp4 below compute capability 10 (every CPU, Hopper): dequantize + matmul, weight-only "
             "(the 'as on this CPU' figure). Enabled, torch's CPU scaled_mm refuses swizzled block scales "
             "('CPU does not support swizzle'), so the enabled figure is ComfyUI's own NVFP4 input quantization "
             "(its layout's from_float) times the dequantized weight in fp32: it proves the activation codes and "
             "scales equal lowbit_pipe's bit for bit, not the Blackwell GEMM's summation order",
    "mxfp8": "ComfyUI disables mxfp8 below compute capability 10 (every CPU, Hopper): dequantize + matmul, weight-only "
             "(the 'as on this CPU' figure). Enabled, torch's CPU scaled_mm refuses block-scaled operands, so the "
             "enabled figure is ComfyUI's own MXFP8 input quantization times the dequantized weight in fp32",
    "convrot_w4a4": "comfy-kitchen's eager ConvRot W4A4 and lowbit_pipe's reference agree bit for bit",
    "w4a8": "the int8 path after decoding to the int8 grid: the same scale-product rounding as int8",
}


def _group(case: str) -> str:
    return {"int8+convrot": "int8", "w6a8": "w4a8"}.get(case, case)


def findings(rows: list[dict[str, Any]]) -> list[str]:
    """The lines under the table: what the rows show, with the reason for every non-zero figure."""
    ok = [r for r in rows if not r["comfy"].get("child_failed")]
    notes = []
    lowbit = [r for r in ok if r["export"]["not_stock_comfy"] > 0]
    if lowbit:
        exact = [r for r in lowbit if r["comfy"]["pack"].get("layers", {}).get("max_rel_diff_enabled") == 0]
        kinds = sorted({k for r in lowbit for k in r["export"]["record_formats"]
                        if k.startswith("lowbit_") or k in NOT_IN_STOCK_COMFY})
        refused = [r for r in lowbit if not r["comfy"]["stock"]["loads"]]
        notes.append(f"Files with kinds stock ComfyUI lacks ({', '.join(kinds)}): stock ComfyUI refuses "
                     f"{len(refused)}/{len(lowbit)} as a "
                     "whole, at its QUANT_ALGOS lookup (KeyError naming the kind); with the pack "
                     f"{len(exact)}/{len(lowbit)} load with every quantized layer bit-exact with lowbit_pipe (LowbitLayout "
                     "runs the project's own Format.linear; fused native layers equal their diffusers parts concatenated).")
    stock = [r for r in ok if r["export"]["not_stock_comfy"] == 0 and r["comfy"]["stock"]["loads"]]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in stock:
        groups.setdefault(_group(r["export"]["case"]), []).append(r)
    for g, rs in groups.items():
        cpu = max(r["comfy"]["stock"]["layers"].get("max_rel_diff_cpu") or 0.0 for r in rs)
        en = max(r["comfy"]["stock"]["layers"].get("max_rel_diff_enabled") or 0.0 for r in rs)
        cases = sorted({r["export"]["case"] for r in rs})
        figure = f"max rel diff as on this CPU {_fmt_diff(cpu)}, format enabled {_fmt_diff(en)}"
        why = WHY.get(g, "")
        notes.append(f"{' / '.join(cases)} (stock kinds): {figure}. {why[:1].upper() + why[1:]}.")
    same = [r for r in stock if r["comfy"]["pack"]["loads"]
            and r["comfy"]["pack"]["layers"].get("layouts") == r["comfy"]["stock"]["layers"].get("layouts")
            and r["comfy"]["pack"]["layers"].get("max_rel_diff_cpu") == r["comfy"]["stock"]["layers"].get("max_rel_diff_cpu")]
    if stock:
        notes.append(f"The pack leaves stock kinds alone: {len(same)}/{len(stock)} stock files load into the same "
                     "comfy-kitchen layouts and compute the same numbers with the pack installed.")
    un = [r["comfy"].get("uninstall", {}) for r in ok]
    restored = [u for u in un if u.get("restored")]
    if un:
        n = sorted({u.get("patches_restored") for u in un})
        notes.append(f"Uninstall: {len(restored)}/{len(un)} processes got ComfyUI back exactly (the same function objects, "
                     f"no lowbit QUANT_ALGOS entries, LowbitLayout gone; {', '.join(map(str, n))} ledger entries restored "
                     "each); a file with lowbit kinds is refused again after it. A second install returned the first "
                     f"registration in {sum(1 for r in ok if r['comfy'].get('registration', {}).get('second_install_same'))}"
                     f"/{len(ok)}.")
    notes.append("Per-layer inputs: seeded randn; for a layer with a static input_scale, scaled to half its calibrated "
                 "range (beyond it the static scale clips, which is the same on both sides but says nothing).")
    for r in ok:
        for mode in ("stock", "pack"):
            m = r["comfy"][mode]
            if m["loads"] and m.get("log_problems"):
                notes.append(f"{r['export']['arch']} / {r['export']['case']} ({mode}): ComfyUI logged "
                             + "; ".join(m["log_problems"][:3]))
    failed = [r for r in rows if r["comfy"].get("child_failed")]
    for r in failed:
        notes.append(f"{r['export']['arch']} / {r['export']['case']}: the ComfyUI process failed: {r['comfy'].get('error')}")
    return notes


# =============================================================================================== child
class _Placeholder:
    def __init__(self, name: str):
        self._name = name

    def __call__(self, *a: Any, **k: Any) -> Any:
        raise RuntimeError(f"{self._name} is a stub (not installed on this CPU box)")

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self._name}.{item}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty packages for `torchvision` / `torchaudio`: comfy.sd imports them at module level, the diffusion-model
    path never uses them, and no CPU wheel of them fits this torch."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, name, path, target=None):
        if name == self.root or name.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__path__ = []

        def _getattr(item: str, _n: str = spec.name) -> Any:
            if item.startswith("__"):
                raise AttributeError(item)
            return _Placeholder(f"{_n}.{item}")

        m.__getattr__ = _getattr
        return m

    def exec_module(self, module):
        pass


def _comfy_cpu_setup(src: Path, base: Path | None = None) -> None:
    """Import ComfyUI from `src` on the CPU. `base`: ComfyUI's base directory (its --base-directory: models, input,
    output, user), else `src` itself; ComfyUI creates its input folder there at import and the Quantize node
    writes its runs under output/."""
    sys.path.insert(0, str(src))
    for root in ("torchvision", "torchaudio"):
        try:
            __import__(root)
        except Exception:  # noqa: BLE001 - a broken install counts as missing
            for name in [n for n in sys.modules if n == root or n.startswith(root + ".")]:
                del sys.modules[name]
            sys.meta_path.insert(0, _StubFinder(root))
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # read when comfy.model_management is imported
    if base is not None:  # read when folder_paths is imported
        base.mkdir(parents=True, exist_ok=True)
        comfy.cli_args.args.base_directory = str(base)


class _LogCatcher(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _problems(lines: list[str]) -> list[str]:
    keys = ("unet missing", "unet unexpected", "Missing weight", "Exception", "error")
    return [ln[:300] for ln in lines if any(k in ln for k in keys)]


def child_main(argv: list[str]) -> int:
    src, path, out = Path(argv[0]), argv[1], Path(argv[2])
    result: dict[str, Any] = {"path": path}
    try:
        with tempfile.TemporaryDirectory(prefix="comfy_base") as base:  # nothing written into the ComfyUI checked
            _child(src, path, result, Path(base))
    except BaseException as err:  # noqa: BLE001 - everything goes to the JSON
        result["child_failed"] = True
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()[-6000:]
    out.write_text(json.dumps(result, indent=1, default=str))
    return 0


def _child(src: Path, path: str, result: dict[str, Any], base: Path) -> None:
    import torch

    import lowbit_pipe
    from lowbit_pipe.comfy import install_into_comfyui

    # lowbit_pipe's own reload of the same file: the reference for every layer. Before ComfyUI's import shims:
    # diffusers reads the installed torchvision's version, which a stub has not.
    with tempfile.TemporaryDirectory() as tmp:
        ours = lowbit_pipe.run("default", [f"model.path={path}", "pipeline=[load]"], run_dir=Path(tmp) / "reload")
    from lowbit_pipe.arch import detect_model

    ref_model = ours.model
    arch = ours.context.arch or detect_model(ref_model)  # pipeline=[load] runs no detect stage
    arch_cfg = ours.context.arch_config or (arch.config_from_model(ref_model) if arch is not None else None)
    result["reference"] = {"arch": arch.id if arch is not None else None, "source": ours.report.get("load")}

    catcher = _LogCatcher()
    logging.getLogger().addHandler(catcher)
    logging.getLogger().setLevel(logging.INFO)
    _comfy_cpu_setup(src, base)
    import comfy.model_management as mm
    import comfy.ops
    import comfy.quant_ops
    import comfy.sd

    orig = {"load": comfy.ops._load_quantized_module, "save": comfy.ops._quantized_weight_state_dict,
            "algos": dict(comfy.quant_ops.QUANT_ALGOS)}

    def load(mode: str) -> dict[str, Any]:
        catcher.lines.clear()
        res: dict[str, Any] = {"loads": False}
        try:
            patcher = comfy.sd.load_diffusion_model(path)
            mm.load_models_gpu([patcher], force_full_load=True)
        except Exception as err:  # noqa: BLE001
            res["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            res["log_problems"] = _problems(catcher.lines)
            return res
        res["loads"] = True
        dm = patcher.model.diffusion_model
        cfg = patcher.model.model_config.unet_config
        res["unet_config"] = {k: v for k, v in cfg.items() if isinstance(v, (int, float, str, bool, list))}
        res["compute_dtype"] = str(patcher.model.get_dtype())
        res["forward"] = _forward(dm, cfg, torch)
        res["forward_finite"] = res["forward"].get("finite", False)
        res["layers"] = _compare_layers(dm, ref_model, arch, arch_cfg, torch)
        res["log_problems"] = _problems(catcher.lines)
        res["native_ops_log"] = next((ln for ln in catcher.lines if "Native ops" in ln), None)
        mm.unload_all_models()
        del patcher, dm
        return res

    result["stock"] = load("stock")
    reg = install_into_comfyui()
    result["registration"] = {"kinds": list(reg.kinds), "wrapped": list(reg.wrapped), "layout": reg.layout,
                              "second_install_same": install_into_comfyui() is reg}
    result["pack"] = load("pack")
    report = reg.uninstall()
    restored = (comfy.ops._load_quantized_module is orig["load"] and comfy.ops._quantized_weight_state_dict is orig["save"]
                and comfy.quant_ops.QUANT_ALGOS == orig["algos"]
                and all(v is orig["algos"][k] for k, v in comfy.quant_ops.QUANT_ALGOS.items())
                and "LowbitLayout" not in __import__("comfy_kitchen.tensor.base", fromlist=["LAYOUTS"]).LAYOUTS)
    after = load("after uninstall")
    result["uninstall"] = {"restored": restored and not report["errors"] and not report["unfreed"],
                           "patches_restored": report["patches_restored"], "errors": report["errors"],
                           "unfreed": report["unfreed"], "stock_again_loads": after["loads"],
                           "stock_again_error": after.get("error"),
                           "same_as_stock": after["loads"] == result["stock"]["loads"]}
    result["uninstall"]["restored"] = result["uninstall"]["restored"] and result["uninstall"]["same_as_stock"]
    result["compute_dtype"] = result["pack"].get("compute_dtype") or result["stock"].get("compute_dtype")


def _forward(dm: Any, cfg: dict[str, Any], torch: Any) -> dict[str, Any]:
    """The diffusion model's forward on seeded inputs under inference_mode (ComfyUI's executor)."""
    g = torch.Generator().manual_seed(SEED)
    dtype = next((p.dtype for p in dm.parameters() if p.is_floating_point()), torch.float32)
    with torch.inference_mode():
        model = cfg.get("image_model")
        if model == "krea2":
            x = torch.randn(1, cfg["channels"], 8, 8, generator=g).to(dtype)
            ctx = torch.randn(1, 6, cfg["txtlayers"] * cfg["txtdim"], generator=g).to(dtype)
            out = dm(x, torch.tensor([0.5]), ctx)
        elif model == "flux":
            x = torch.randn(1, cfg["in_channels"], 8, 8, generator=g).to(dtype)
            ctx = torch.randn(1, 6, cfg["context_in_dim"], generator=g).to(dtype)
            y = torch.randn(1, cfg["vec_in_dim"], generator=g).to(dtype) if cfg.get("vec_in_dim") else None
            kw = {"guidance": torch.tensor([3.5])} if cfg.get("guidance_embed") else {}
            out = dm(x, torch.tensor([0.5]), ctx, y=y, **kw)
        else:
            return {"skipped": f"no inputs for image_model {model!r}"}
    return {"shape": list(out.shape), "finite": bool(torch.isfinite(out).all()), "std": float(out.float().std())}


def _compare_layers(dm: Any, ref: Any, arch: Any, arch_cfg: Any, torch: Any) -> dict[str, Any]:
    """Every quantized Linear of ComfyUI's model vs lowbit_pipe's QuantLinear(s) of the same layer."""
    from comfy_kitchen.tensor import QuantizedTensor

    from lowbit_pipe.quant.nn import QuantLinear

    ref_modules = dict(ref.named_modules())
    per_layer, worst = [], {"cpu": (0.0, None), "enabled": (0.0, None)}
    g = torch.Generator().manual_seed(SEED)
    for name, module in dm.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, QuantizedTensor):
            continue
        in_f = weight.shape[1]
        x = torch.randn(TOKENS, in_f, generator=g)
        parts = arch.from_native_name(name, arch_cfg) if arch is not None else [(name, None)]
        refs = [ref_modules.get(p) for p, _ in parts]
        static = getattr(refs[0], "input_scale", None) if refs and refs[0] is not None else None
        if static is not None:  # inside the calibrated range (the static scale clips beyond it)
            x = x * (0.5 * float(static) * refs[0].format.act_qmax / float(x.abs().max()))
        x = x.to(weight.dtype)
        row: dict[str, Any] = {"layer": name, "quant_format": module.quant_format, "layout": weight._layout_cls,
                               "parts": [p for p, _ in parts]}
        if not all(isinstance(r, QuantLinear) for r in refs):
            row["error"] = f"lowbit_pipe's reload has no QuantLinear for {[p for p, _ in parts]}"
            per_layer.append(row)
            continue
        with torch.inference_mode():
            want = torch.cat([r(x.to(torch.float32)).to(torch.float32) for r in refs], dim=-1)
            if arch is not None and arch.keymap is not None and arch.keymap.is_swapped(name):
                a, b = want.chunk(2, dim=-1)
                want = torch.cat([b, a], dim=-1)
            got_cpu = module(x).to(torch.float32)
            disabled = bool(module._full_precision_mm) and not bool(getattr(module, "_full_precision_mm_config", False))
            enabled_how = "as loaded"
            if disabled:  # what ComfyUI computes where the format is enabled (fp8 / nvfp4 on a capable GPU)
                module._full_precision_mm = False
                try:
                    got_enabled = module(x).to(torch.float32)
                    enabled_how = "ComfyUI forward, format enabled"
                except (ValueError, RuntimeError) as err:
                    # torch on the CPU has no scaled_mm with swizzled (NVFP4) block scales: ComfyUI's own input
                    # quantization (its layout's from_float, with the stored input_scale), then the exact product of
                    # the two dequantized operands in fp32 (what the GPU kernel accumulates, up to summation order).
                    row["enabled_error"] = f"{type(err).__name__}: {err}"
                    qx = QuantizedTensor.from_float(x, module.layout_type, scale=getattr(module, "input_scale", None))
                    got_enabled = qx.dequantize().float() @ weight.dequantize().float().t()
                    if module.bias is not None:
                        got_enabled = got_enabled + module.bias.float()
                    enabled_how = "ComfyUI's input quantization, dequantized operands, fp32 product"
                finally:
                    module._full_precision_mm = True
            else:
                got_enabled = got_cpu
        row["enabled_how"] = enabled_how
        scale = float(want.abs().max()) or 1.0
        for mode, got in (("cpu", got_cpu), ("enabled", got_enabled)):
            d = float((got - want).abs().max()) / scale
            row[f"rel_diff_{mode}"] = d
            if d >= worst[mode][0]:
                worst[mode] = (d, name)
        row["disabled_on_cpu"] = disabled
        row["bit_exact"] = bool(torch.equal(got_enabled, want))
        per_layer.append(row)
    errors = [r for r in per_layer if "error" in r]
    return {"count": len(per_layer), "bit_exact": sum(1 for r in per_layer if r.get("bit_exact")),
            "errors": len(errors), "first_error": errors[0]["error"] if errors else None,
            "max_rel_diff_cpu": None if errors or not per_layer else worst["cpu"][0],
            "worst_layer_cpu": worst["cpu"][1],
            "max_rel_diff_enabled": None if errors or not per_layer else worst["enabled"][0],
            "worst_layer_enabled": worst["enabled"][1],
            "layouts": sorted({r["layout"] for r in per_layer}),
            "disabled_on_cpu": sum(1 for r in per_layer if r.get("disabled_on_cpu")),
            "per_layer": per_layer}


if __name__ == "__main__":
    raise SystemExit(main())
