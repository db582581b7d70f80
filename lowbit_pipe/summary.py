"""The short human summary of a run (summary.txt, printed at the end): small tables, binary units."""

from __future__ import annotations

from collections import Counter
from typing import Any


def fmt_bytes(n: float | None) -> str:
    """Bytes in binary units (KiB, MiB, GiB, TiB): one unit style everywhere a run prints sizes."""
    if n is None:
        return "-"
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    return str(n)


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """Left-aligned first column, right-aligned others."""
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in cells]


def plan_counts(plan: list[dict[str, Any]]) -> list[list[Any]]:
    """Rows (format or 'float', layers, why): quantized layers per format, float layers per reason (the
    reason's head: "w4a8 cannot store it", not each layer's width; report.json has every detail)."""
    counts = Counter((p["format"] or "float", "" if p["format"] else p["reason"].split(" (")[0]) for p in plan)
    return [[fmt, n, why] for (fmt, why), n in sorted(counts.items(), key=lambda kv: (kv[0][0] == "float", kv[0]))]


def plan_lines(plan: list[dict[str, Any]] | None, attention: dict[str, Any] | None) -> list[str]:
    """The run's Plan: layers per format (float per reason) and the planned attention with its reason
    (report.json's `plan` and `plan_attention` hold every layer's reason and options)."""
    lines = table(["layers", "count", "why float"], [[f, n, why] for f, n, why in plan_counts(plan)]) if plan else []
    if attention:
        lines.append(f"planned attention: {attention['format']} ({attention['reason']})")
    return lines


def target_lines(t: dict[str, Any] | None) -> list[str]:
    """quantize.target: what was asked, what the plan predicts, what the whole-forward check measured, the frontier."""
    if not t:
        return []
    p = t["predicted"]
    goal = t["target"]
    lines = [f"target: {goal['kind']} {goal['value']:g} ({'met' if t['met'] else 'NOT met'} as predicted; "
             f"export loads in {t['loads_in']}): predicted {p['speedup']:.3f}x the float forward "
             f"({p['time_ms']:.4g} ms), {fmt_bytes(p['bytes'])} ({p['ratio']:.3f} of float), output error {p['error']:.5f}"]
    fc = t.get("forward_check")
    if fc:
        lines.append(f"target check: measured {fc['measured_ms']:.4g} ms = {fc['measured_speedup']:.3f}x (prediction off by "
                     f"{fc['off']:+.1%}), output error {fc['measured_error']:.5f}")
    lines += table(["plan (target)", "layers"], [[k, v] for k, v in t["layers"].items()])
    sel = t.get("selection") or {}
    if sel.get("plans"):
        lines.append(f"weighed on measured figures (the plan's error probed, each uniform plan's probe): "
                     f"{'the solver plan' if sel['chosen'] == 'solver' else 'uniform ' + sel['chosen']} kept")
        lines += table(["plan", "speedup", "bytes", "error", "meets"], [
            [k, f"{v['speedup']:.3f}x", fmt_bytes(v["bytes"]), f"{v['error']:.5f}", "yes" if v["met"] else "no"]
            for k, v in sel["plans"].items()])
    att = t.get("attention") or {}
    if len(att.get("options", {})) > 1 or att.get("chosen", "bf16") != "bf16":
        lines.append(f"attention (target): {att['chosen']}, among")
        lines += table(["attention", "float forward ms", "output error", "best plan"], [
            [fmt, f"{o['forward_ms']:.4g}", f"{o['error']:.5f}",
             f"{o['predicted']['speedup']:.3f}x, error {o['predicted']['error']:.5f}" + ("" if o["met"] else " (not met)")
             if o["predicted"] else "target not reachable"] for fmt, o in att["options"].items()])
    rows = [[f"{f['speedup']:.3f}x", f"{f['time_ms']:.4g}", fmt_bytes(f["bytes"]), f"{f['error']:.5f}",
             f.get("attention", "bf16"), " ".join(f"{k}:{v}" for k, v in f["layers"].items())]
            for f in t.get("frontier", [])]
    if rows:
        lines.append(f"frontier the solver saw ({len(rows)} plans, predicted; report.json quantize.target.frontier):")
        lines += table(["speedup", "ms", "bytes", "error", "attention", "layers"], rows)
    return lines


def attention_lines(att: dict[str, Any]) -> list[str]:
    """The attention stage's lines: its format (when not the stock one) and the fused norm / RoPE kernels."""
    lines = []
    if att.get("format", "bf16") != "bf16":
        calls = ", ".join(f"{k} {v}" for k, v in (att.get("calls") or {}).items())
        lines.append(f"attention: {att['format']} on {att.get('modules', 0)} modules" +
                     (f" (calls: {calls})" if calls else "") + (f"; {att['note']}" if att.get("note") else ""))
    fused = att.get("fused_norm_rope")
    if fused:  # counts as applied (the kernels run later, when the model does: CUDA, eager)
        lines.append(f"fused norm / RoPE kernels (eager, CUDA): {fused.get('norm_modules', 0)} norm modules, "
                     f"{fused.get('rope_modules', fused.get('rope_processors', 0))} attention "
                     f"{'modules' if 'rope_modules' in fused else 'processors'}"
                     + (f" of {fused['code']}" if fused.get("code") else "")
                     + (f"; {fused['shared_input_modules']} modules quantize an input once for all its layers"
                        if fused.get("shared_input_modules") else ""))
    return lines


def calibration_lines(q: dict[str, Any] | None) -> list[str]:
    """The held-out check of the calibration: per format, GPTQ's (or static scales') error over rounding's on the
    calibration inputs and on the held-out ones, side by side, what was kept, and the whole model's figure."""
    check = (q or {}).get("calibration_check")
    if not check:
        return []
    def gain(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"
    rows = [[fmt, r["layers"], gain(r["fit_gain"]), gain(r["held_out_gain"]), gain(r["held_out_gain_kept"]),
             ", ".join(f"{k} {n}" for k, n in r["result"].items())] for fmt, r in check["by_format"].items()]
    lines = [f"calibration check: held out {check['split']['how']}"]
    lines += table(["calibrated", "layers", "gain calibration", "gain held-out", "held-out kept", "kept"], rows)
    m = check.get("model") or {}
    if m.get("checked"):
        lines.append(f"calibration check, whole model on held-out inputs: error {m['held_out_gain']:.3f}x the "
                     f"{m['baseline']} model's -> {m['result']}")
    return lines


def format_summary(report: dict[str, Any]) -> str:
    """Stage times and memory, the layer plan, quality, export path and size, teardown."""
    lines = [f"lowbit_pipe run: {report['status']}  recipe={report['recipe'].get('name')}"]
    rows = [[name, f"{s['seconds']:.3f}" if "seconds" in s else "-", fmt_bytes(s.get("peak_host_bytes")),
             fmt_bytes(s.get("peak_device_bytes"))] for name, s in report["stages"].items()]
    lines += table(["stage", "seconds", "peak host", "peak device"], rows)
    for name, s in report["stages"].items():
        if "error" in s:
            lines.append(f"error in {name}: {s['error']}")
    det = report.get("detect")
    if det:
        lines.append(f"arch: {det['arch']}")
    st = report.get("stream")
    if st and (report["recipe"].get("model") or {}).get("path"):  # a run reading model.path: streamed or loaded
        lines.append(f"model: {'streamed file to file' if st['streamed'] else 'loaded whole'} "
                     f"(model.stream={st['mode']}: {st['reason']})")
    lines += attention_lines(report.get("attention") or {})
    lines += plan_lines(report.get("plan"), report.get("plan_attention"))
    lines += target_lines((report.get("quantize") or {}).get("target")) + calibration_lines(report.get("quantize"))
    ev = report.get("evaluate")
    if ev and "rel_error" in ev:
        extra = ""
        if ev.get("sqnr_min_db") is not None:
            extra += f"  worst layer SQNR {ev['sqnr_min_db']:.1f} dB ({ev['sqnr_worst_layer']})"
        traj = ev.get("trajectory") or {}
        if traj.get("min_cosine") is not None:
            extra += f"  trajectory cosine min {traj['min_cosine']:.5f}"
        lines.append(f"quality: rel_error {ev['rel_error']:.5f}  cosine {ev['cosine']:.6f}{extra}")
        att = ev.get("attention")
        if att:
            traj = (att.get("trajectory") or {}).get("min_cosine")
            lines.append(f"quality, 8-bit attention ({att['format']}) alone: rel_error {att['rel_error']:.5f}  cosine "
                         f"{att['cosine']:.6f}" + (f"  trajectory cosine min {traj:.5f}" if traj is not None else ""))
    elif ev:
        lines.append(f"quality: skipped ({ev.get('skipped')})")
    ex, q = report.get("export"), report.get("quantize")
    if ex:
        ratio = ""
        if q and q.get("bytes_after"):
            ratio = (f"  (quantized layers {fmt_bytes(q['bytes_before'])} -> {fmt_bytes(q['bytes_after'])}, "
                     f"{q['bytes_before'] / q['bytes_after']:.2f}x)")
        lines.append(f"export: {ex['path']}  {fmt_bytes(ex['bytes'])}{ratio}")
        if ex.get("lora_path"):
            lines.append(f"export: {ex['lora_path']}  {fmt_bytes(ex['lora_bytes'])}  (LoRA residual branches)")
    td = report.get("teardown")
    if td and "bytes_freed" in td:
        lines.append(f"teardown: freed {fmt_bytes(td['bytes_freed'])}, retained {fmt_bytes(td['retained_bytes'])}, "
                     f"{'proven' if td.get('proven') else 'not proven'}")
        for what in td.get("unfreed") or []:
            lines.append(f"  not freed: {what}")
    for w in report.get("warnings") or []:
        lines.append(f"warning ({w['stage']}): {w['message']}" + (f" (x{w['count']})" if w.get("count") else ""))
    return "\n".join(lines)
