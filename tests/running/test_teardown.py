"""Teardown proves itself: 20 load->quantize->lora->export->compile->teardown cycles with zero growth,
no cross-model contamination, failed runs, leaks named, the purge API and CLI."""

from __future__ import annotations

import functools
import gc
import json
import os
import subprocess
import sys
import time
import tracemalloc
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import lowbit_pipe
from lowbit_pipe.config.compose import compose_recipe
from lowbit_pipe.errors import StageError
from lowbit_pipe.purge import main as purge_main
from lowbit_pipe.purge import purge
from lowbit_pipe.quant.nn import QuantLinear
from lowbit_pipe.recipe import LoraFile
from lowbit_pipe.running.runner import Runner
from lowbit_pipe.stages import STAGES
from lowbit_pipe.stages.compile import DYNAMO_CAVEAT

ROOT = Path(__file__).resolve().parents[2]  # the checkout (not conftest's: a child process imports this file)
CAVEAT = f"torch.compile (dynamo caches, process-wide reset): {DYNAMO_CAVEAT}"
HAS_LORA = "lora" in STAGES


def _recipe(arch: str, stages: list[str], extra: tuple[str, ...] = ()):
    return compose_recipe("default", [f"model=tiny_{arch}", f"pipeline=[{','.join(stages)}]", "compile.backend=eager",
                                      *extra])


def _lora_file(path: Path, model: torch.nn.Module, rank: int = 4) -> Path:
    """A peft/diffusers-format LoRA on block 0's attn.to_q and ff.up (seeded)."""
    gen = torch.Generator().manual_seed(7)
    tensors = {}
    for name, module in model.named_modules():
        if name.startswith("transformer_blocks.0.") and name.endswith(("attn.to_q", "ff.up")):
            tensors[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=gen) * 0.01
            tensors[f"transformer.{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=gen) * 0.01
    save_file(tensors, str(path))
    return path


def _real_tensors() -> int:
    """Live torch.Tensor objects that own real (non-fake, non-meta) storage."""
    from torch._subclasses.fake_tensor import FakeTensor

    return sum(1 for o in gc.get_objects()
               if isinstance(o, torch.Tensor) and not isinstance(o, FakeTensor) and o.device.type != "meta")


def _forward(ctx) -> torch.Tensor:
    inputs = ctx.arch.example_inputs(ctx.model_config, batch=1, image_tokens=16, text_tokens=4,
                                     generator=torch.Generator().manual_seed(3), dtype=torch.float32, device="cpu")
    with torch.no_grad():
        return ctx.arch.output_tensor(ctx.model(**inputs)).clone()


# Whose host allocations count as ours: this package and the libraries it drives directly, each known by the
# folder its module was imported from (resolved), never by a word in a file's path. A clone named lowbit_pipe
# with its venv inside puts "lowbit_pipe" in the path of every torch file, and torch's allocations are not ours.
OUR_PACKAGES = ("lowbit_pipe", "diffusers", "safetensors", "omegaconf", "hydra")


def package_dirs(names: tuple[str, ...] = OUR_PACKAGES) -> tuple[Path, ...]:
    """The resolved folders the packages `names` are imported from (those installed)."""
    import importlib.util

    out = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is not None:
            out += [Path(p).resolve() for p in spec.submodule_search_locations or []]
    return tuple(out)


@functools.lru_cache(maxsize=None)
def is_ours(filename: str, dirs: tuple[Path, ...] | None = None) -> bool:
    """Whether a source file lies inside one of `dirs` (default: OUR_PACKAGES' folders). Frames without a file
    ("<frozen importlib._bootstrap>", "<string>") are nobody's."""
    path = Path(filename)
    if not path.is_absolute():
        return False
    resolved = path.resolve()
    return any(resolved.is_relative_to(d) for d in (dirs if dirs is not None else package_dirs()))


def _ours(stat: tracemalloc.StatisticDiff) -> bool:
    """Allocations made by our code (or the libraries we drive directly), not torch internals."""
    return is_ours(stat.traceback[0].filename)


@pytest.mark.slow
def test_twelve_cycles_free_everything_with_zero_growth(tmp_path, tiny_model):
    stages = ["load", "detect", "quantize"] + (["lora"] if HAS_LORA else []) + ["export", "compile"]
    rec = _recipe("krea2", stages, ("model.tiny_config.num_layers=1",))  # one block: the cycle cost is compile
    if HAS_LORA:
        rec.lora.files = [LoraFile(path=str(_lora_file(tmp_path / "lora.safetensors", tiny_model("krea2"))))]
    cycles, warmup, trace_from = 12, 2, 8  # 200 cycles without compile and export: tests/running/test_soak.py
    counts, reports, snapshots = [], [], {}
    start = time.perf_counter()
    for i in range(cycles):
        if i == trace_from:
            tracemalloc.start()
        result = Runner(rec, tmp_path / f"run{i}").run()
        ctx = result.context
        compiled = [m for m in ctx.transformer.modules() if "_compiled_call_impl" in vars(m)]
        assert len(compiled) == 1  # the block, compiled in place
        out = _forward(ctx)
        assert torch.isfinite(out).all()
        refs = [weakref.ref(ctx.model)] + [weakref.ref(m) for m in ctx.transformer.modules() if isinstance(m, QuantLinear)] \
            + [weakref.ref(m._compiled_call_impl) for m in compiled]
        del compiled
        report = lowbit_pipe.teardown(result)
        reports.append(report)
        assert result.model is None and ctx.model is None
        assert all(r() is None for r in refs), "a weakref the test took itself is still alive"
        if i >= warmup and (i % 2 == 1 or i == warmup):  # a gc scan costs ~0.3 s: every other cycle
            gc.collect()
            counts.append(_real_tensors())
        if i in (trace_from + 1, cycles - 1):
            gc.collect()
            snapshots[i] = tracemalloc.take_snapshot()
    tracemalloc.stop()
    seconds = time.perf_counter() - start
    for i, report in enumerate(reports):
        assert report["unfreed"] == [] and report["retained_bytes"] == 0 and report["errors"] == [], (i, report)
        assert report["unproven"] == [] and report["proven"], (i, report["unproven"])
        assert report["caveats"] == [CAVEAT], (i, report["caveats"])
        assert report["undone"]["module_swap"] == 8 and report["undone"]["attr_patch"] >= 1
        assert report["undone"]["cache"] == 1 and report["patches_restored"] >= 9
        assert report["objects_freed"] == report["objects_watched"] > 0
        assert report["bytes_freed"] > 5_000_000  # the float model + the packed layers
    assert len(set(r["bytes_freed"] for r in reports)) == 1  # every cycle frees exactly the same bytes
    # Zero growth: real tensors after every cycle, and host allocations of our code across the last cycles.
    assert len(set(counts)) == 1, f"live tensor count changed across cycles: {counts}"
    diff = snapshots[cycles - 1].compare_to(snapshots[trace_from + 1], "filename")
    ours = sum(s.size_diff for s in diff if _ours(s))
    total = sum(s.size_diff for s in diff)
    per_cycle = total / (cycles - 1 - trace_from - 1)
    print(f"\n{cycles} cycles in {seconds:.1f} s (lora stage: {HAS_LORA}); live tensors {counts[0]} -> {counts[-1]}; "
          f"host growth over {cycles - trace_from - 2} traced cycles: ours {ours} B, all {total} B "
          f"({per_cycle / 1024:.1f} KiB/cycle, torch.compile internals)")
    assert ours <= 16 * 1024, [str(s) for s in diff if _ours(s)][:10]
    assert per_cycle < 2 * 1024 * 1024


_FRESH = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_teardown import model_output
torch.save(model_output({arch!r}, {run_dir!r}), {out!r})
"""


def model_output(arch: str, run_dir: str) -> torch.Tensor:
    """Quantize (int8 + ConvRot rotation, so the Hadamard cache is used), compile, run; tear down."""
    rec = _recipe(arch, ["load", "detect", "quantize", "compile"], ("quantize.default.rotation=convrot",))
    result = Runner(rec, run_dir).run()
    out = _forward(result.context)
    report = lowbit_pipe.teardown(result)
    assert report["unfreed"] == [] and report["retained_bytes"] == 0, report
    return out


@pytest.mark.slow
def test_no_cross_model_contamination(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = {}
    for arch in ("krea2", "flux1"):
        code = _FRESH.format(tests=str(Path(__file__).resolve().parent), arch=arch, run_dir=str(tmp_path / f"fresh_{arch}"),
                             out=str(tmp_path / f"{arch}.pt"))
        procs[arch] = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    sequence = [model_output(arch, str(tmp_path / f"seq{i}")) for i, arch in enumerate(("krea2", "flux1", "krea2"))]
    for arch, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    fresh = {arch: torch.load(tmp_path / f"{arch}.pt") for arch in procs}
    assert torch.equal(sequence[0], fresh["krea2"])
    assert torch.equal(sequence[1], fresh["flux1"])
    assert torch.equal(sequence[2], fresh["krea2"])


def test_a_failed_stage_is_torn_down_and_proven(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the export wants a directory")
    rec = _recipe("krea2", ["load", "detect", "quantize", "export", "teardown"],
                  (f"export.path={blocker}/model.safetensors",))
    with pytest.raises(StageError) as info:
        Runner(rec, tmp_path / "run").run()
    assert info.value.stage == "export" and "not_a_dir" in str(info.value)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    td = report["teardown"]
    assert report["status"] == "failed"
    assert td["unfreed"] == [] and td["retained_bytes"] == 0 and td["errors"] == [] and td["proven"]
    assert td["undone"]["module_swap"] == 16 and td["objects_freed"] == 17  # 16 layers + the model
    assert set(td) >= {"bytes_freed", "retained_bytes", "patches_restored", "unfreed"}


def test_leaked_references_are_named_and_then_freed(tmp_path):
    result = Runner(_recipe("krea2", ["load", "detect", "quantize"]), tmp_path / "run").run()
    layer = result.model.transformer_blocks[0].attn.to_q  # the user keeps a quantized layer...
    model = result.model  # ...and the model
    nbytes = sum(t.untyped_storage().nbytes() for t in layer.buffers())
    report = lowbit_pipe.teardown(result)
    assert f"transformer_blocks.0.attn.to_q (QuantLinear) (still referenced, {nbytes} bytes)" in report["unfreed"]
    assert any(u.startswith("model (Krea2Transformer2DModel) (still referenced") for u in report["unfreed"])
    assert report["retained_bytes"] > nbytes and len(report["unfreed"]) == 2
    del layer, model
    again = purge(result)  # the purge API: idempotent, re-proves what was alive
    assert again["unfreed"] == [] and again["retained_bytes"] == 0 and again["bytes_freed"] > 0


def test_a_callers_model_is_restored_and_may_be_dropped_first(tmp_path, tiny_model):
    model = tiny_model("krea2")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    result = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,compile]", "compile.backend=eager"],
                             model=model, run_dir=tmp_path / "a")
    report = lowbit_pipe.teardown(result)
    assert report["unfreed"] == [] and report["patches_restored"] == 18
    assert all(dict(model.named_modules())[n] is m for n, m in linears.items())
    assert not any("_compiled_call_impl" in vars(m) for m in model.modules())
    assert result.model is model  # the caller's model is kept, not dropped

    # The caller drops the model before teardown: nothing to restore, everything freed.
    model2 = tiny_model("krea2")
    result = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize]"], model=model2, run_dir=tmp_path / "b")
    ref = weakref.ref(model2)
    result.model = result.context.model = None
    del model2
    gc.collect()
    assert ref() is None
    report = lowbit_pipe.teardown(result.context)
    assert report["unfreed"] == [] and report["errors"] == [] and report["objects_freed"] == 16
    assert "already dropped" in report["notes"][0]


def test_hadamard_cache_is_cleared_by_teardown(tmp_path):
    from lowbit_pipe.kernels import rotation

    rotation.rotate_groups(torch.randn(4, 512, dtype=torch.bfloat16), "convrot", 256)  # a GPU path's cached copy
    rec = _recipe("krea2", ["load", "detect", "quantize", "teardown"], ("quantize.default.rotation=convrot",))
    result = Runner(rec, tmp_path / "run").run()
    caches = {c["name"]: c for c in result.report["teardown"]["caches"]}
    assert caches["kernels.rotation (Hadamard matrices, host and device)"]["verified"]
    assert caches["kernels.rotation (Hadamard matrices, host and device)"]["entries"] >= 2
    assert rotation.cached_entries() == 0


def test_purge_cli_removes_stale_temp_files_and_reports(tmp_path, capsys):
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = run / f".model.safetensors.tmp-{dead.pid}"
    stale.write_bytes(b"\0" * 100)
    live = run / f".model.safetensors.tmp-{os.getpid()}"  # a writer that is still running: kept
    live.write_bytes(b"\0" * 10)
    old = run / ".report.json.tmp"
    old.write_text("{}")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    (run / "report.json").write_text(json.dumps({"status": "failed", "teardown": {
        "bytes_freed": 5, "retained_bytes": 0, "patches_restored": 1, "unfreed": ["x (still referenced, 4 bytes)"],
        "proven": True}}))
    assert purge_main([str(tmp_path / "runs"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)[0]
    assert sorted(Path(r["path"]).name for r in out["removed"]) == sorted([stale.name, old.name])
    assert out["bytes_removed"] == 102 and not stale.exists() and not old.exists() and live.exists()
    assert out["runs"][0]["teardown"]["unfreed"] == ["x (still referenced, 4 bytes)"]
    assert "another process" in out["live_objects"]
    assert purge_main([str(tmp_path / "runs")]) == 0
    text = capsys.readouterr().out
    assert "removed 0 stale temp file(s)" in text and "NOT clean" in text
    assert purge_main([str(tmp_path / "nope")]) == 1


_META_GLOBALS = """
import sys, types, torch
from lowbit_pipe.arch import ARCHS
for arch in ARCHS.values():
    arch.linear_names  # the meta-device template build, first thing in a fresh process
bad = sorted(f"{name}.{key}" for name, mod in list(sys.modules.items()) if isinstance(mod, types.ModuleType)
             for key, val in list(vars(mod).items()) if isinstance(val, torch.Tensor) and val.device.type == "meta")
print("\\n".join(bad))
sys.exit(1 if bad else 0)
"""


def test_meta_builds_leave_no_module_global_on_meta():
    # Importing diffusers' model modules creates module-level tensors (mag-cache ratios, an fp4 lookup
    # table); a first import inside `with torch.device("meta")` made them meta tensors for the process's life.
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _META_GLOBALS], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"module globals left on meta: {proc.stdout[-2000:]} {proc.stderr[-2000:]}"
