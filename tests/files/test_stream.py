"""model.stream: a checkpoint streamed file to file through quantization, one tensor at a time, gives
the very tensors the loading path exports, in bounded memory."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from safetensors import safe_open

import lowbit_pipe
from lowbit_pipe.errors import RecipeError


def _read(path: str) -> tuple[dict, dict]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _same_export(a: str, b: str) -> None:
    ta, ma = _read(a)
    tb, mb = _read(b)
    assert ta.keys() == tb.keys()
    u = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731 - bits, whatever the dtype
    assert [k for k in ta if ta[k].dtype != tb[k].dtype or not torch.equal(u(ta[k]), u(tb[k]))] == []
    assert json.loads(ma["_quantization_metadata"]) == json.loads(mb["_quantization_metadata"])
    ha, hb = json.loads(ma["lowbit_pipe"]), json.loads(mb["lowbit_pipe"])
    assert {k: v for k, v in ha.items() if k != "recipe"} == {k: v for k, v in hb.items() if k != "recipe"}


@pytest.mark.parametrize("recipe, overrides", [
    ("default", []),
    ("flux1_fp8", ["quantize.default.activations=dynamic"]),  # fused native qkv / linear1, one fp8 scale each
    ("flux1_fp8", ["quantize.default.format=nvfp4", "quantize.default.rotation=convrot",
                   "quantize.default.activations=dynamic"]),
    ("krea2_nvfp4", []),
])
def test_a_streamed_export_is_the_loaded_export(tmp_path, recipe, overrides):
    source = lowbit_pipe.run(recipe, ["pipeline=[load,detect,export]", f"export.path={tmp_path / 'float.safetensors'}"],
                             run_dir=tmp_path / "float").export_path
    common = [f"model.path={source}", "pipeline=[load,detect,quantize,export]", *overrides]
    loaded = lowbit_pipe.run(recipe, [*common, f"export.path={tmp_path / 'loaded.safetensors'}"], run_dir=tmp_path / "l")
    streamed = lowbit_pipe.run(recipe, [*common, "model.stream=true", f"export.path={tmp_path / 's.safetensors'}"],
                               run_dir=tmp_path / "s")
    assert streamed.report["export"]["streamed"] and streamed.report["quantize"]["layers"] == \
        loaded.report["quantize"]["layers"]
    _same_export(loaded.export_path, streamed.export_path)


def test_a_diffusers_folder_with_shards_streams(tmp_path, tiny_model):
    model = tiny_model("krea2")
    model.save_pretrained(tmp_path / "dir", max_shard_size="1MB")  # several shards and an index
    assert len(list((tmp_path / "dir").glob("*.safetensors"))) > 1
    common = [f"model.path={tmp_path / 'dir'}", "pipeline=[load,detect,quantize,export]"]
    loaded = lowbit_pipe.run("default", [*common, f"export.path={tmp_path / 'l.safetensors'}"], run_dir=tmp_path / "l")
    streamed = lowbit_pipe.run("default", [*common, "model.stream=true", f"export.path={tmp_path / 's.safetensors'}"],
                               run_dir=tmp_path / "s")
    _same_export(loaded.export_path, streamed.export_path)


def test_what_streaming_cannot_do_is_refused_before_any_work(tmp_path):
    for overrides, key in [(["model.stream=true"], "model.stream"),  # no model.path
                           (["model.stream=true", "model.path=x.safetensors"], "pipeline"),  # evaluate needs a forward
                           (["model.stream=true", "model.path=x.safetensors", "pipeline=[load,detect,quantize,export]",
                             "quantize.default.activations=static"], "quantize.default.activations")]:
        with pytest.raises(RecipeError) as info:
            lowbit_pipe.run("default", overrides, run_dir=tmp_path / "run")
        assert info.value.path == key, str(info.value)
    quantized = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,export]"], run_dir=tmp_path / "q").export_path
    with pytest.raises(RecipeError, match="quantized layers already") as info:  # its header says so: before the work
        lowbit_pipe.run("default", [f"model.path={quantized}", "model.stream=true",
                                    "pipeline=[load,detect,quantize,export]"], run_dir=tmp_path / "again")
    assert info.value.path == "model.stream" and not (tmp_path / "again").exists()


SMALL = {"num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 4096, "text_hidden_dim": 640,
         "text_intermediate_size": 1024, "num_text_layers": 4}


def _stream_peak(tmp_path: Path, layers: int) -> tuple[int, int]:
    """(file bytes, peak resident bytes of a fresh process streaming it to int8)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from make_checkpoint import make_checkpoint

    src = tmp_path / f"k2_{layers}.safetensors"
    figures = make_checkpoint(src, "krea2", {**SMALL, "num_layers": layers}, torch.float32)
    config = [f"+model.config.{k}={v}" for k, v in {**SMALL, "num_layers": layers}.items()]
    script = ("import resource, sys, lowbit_pipe\n"
              f"r = lowbit_pipe.run('default', sys.argv[1:], run_dir={str(tmp_path / f'run{layers}')!r})\n"
              "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n")
    proc = subprocess.run([sys.executable, "-c", script, f"model.path={src}", "model.stream=true",
                           "pipeline=[load,detect,quantize,export]", f"export.path={tmp_path / f'out{layers}.safetensors'}",
                           *config], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    src.unlink()
    return figures["bytes"], int(re.search(r"PEAK (\d+)", proc.stdout).group(1))


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_checkpoint(tmp_path):
    """Streaming a 0.6 GB checkpoint takes about the memory of streaming a 0.23 GB one of the same widths: the
    peak is one layer's working set over the process's baseline, not the model. Holding the six extra layers
    would add their 390 MB; the transient peak was measured 45-100 MB higher at 8 layers than at 2 (the larger
    under `.ci/run`, after the other slow tests), with the same resident size at the end, so the bound is 35 %."""
    small_bytes, small_peak = _stream_peak(tmp_path, 2)
    big_bytes, big_peak = _stream_peak(tmp_path, 8)
    assert big_bytes - small_bytes > 350e6
    assert big_peak - small_peak < 0.35 * (big_bytes - small_bytes), (small_peak, big_peak)


def test_checkpoint_maker_bytes_do_not_depend_on_its_threads(tmp_path):
    """bench/make_checkpoint.py makes values on several threads: the file is the same byte for byte as
    one thread's (one generator per key), so a figure measured on one machine is reproducible on another."""
    sys.path.insert(0, str(ROOT / "bench"))
    from make_checkpoint import make_checkpoint

    tiny = {**SMALL, "num_layers": 1, "intermediate_size": 512, "num_text_layers": 1}
    one = make_checkpoint(tmp_path / "one.safetensors", "krea2", tiny, torch.bfloat16, workers=1)
    many = make_checkpoint(tmp_path / "many.safetensors", "krea2", tiny, torch.bfloat16, workers=3)
    assert one["tensors"] == many["tensors"] > 20
    assert (tmp_path / "one.safetensors").read_bytes() == (tmp_path / "many.safetensors").read_bytes()


# ---- model.stream=auto: stream whenever nothing needs the model loaded -----------------------------------------
FILE = ["model.path=/models/x.safetensors"]  # decide_stream reads no file: the load stage looks at it
STREAMABLE = [*FILE, "pipeline=[load,detect,quantize,export]"]


@pytest.mark.parametrize("overrides, streams, key, words", [
    (STREAMABLE, True, None, "no stage or option needs the model loaded"),
    ([*FILE, "pipeline=[load,detect,quantize,export,teardown]"], True, None, "no stage"),
    ([*FILE, "pipeline=[load,detect,export]"], True, None, "no stage"),  # a float re-export (layout, dtype)
    (FILE, False, "pipeline", "stage 'evaluate'"),  # the default pipeline evaluates
    ([*FILE, "pipeline=[load,detect,quantize,lora,export]"], False, "pipeline", "stage 'lora'"),
    ([*FILE, "pipeline=[load,detect,quantize,compile,export]"], False, "pipeline", "stage 'compile'"),
    ([*FILE, "pipeline=[load,detect,quantize]"], False, "pipeline", "no 'export' stage"),
    ([*FILE, "pipeline=[load,quantize,export]"], False, "pipeline", "no 'detect' stage"),
    ([*STREAMABLE, "quantize.budget_ratio=0.5"], False, "quantize.budget_ratio", "calibrates on forwards"),
    ([*STREAMABLE, "quantize.gptq.enabled=true"], False, "quantize.gptq.enabled", "GPTQ"),
    ([*STREAMABLE, "+quantize.rules=[{match: '*attn*', activations: static}]"], False,
     "quantize.rules[0].activations", "static scales"),
    ([*STREAMABLE, "export.shard_bytes=1048576"], False, "export.shard_bytes", "one file"),
    ([*STREAMABLE, "model.arch=generic"], False, "model.arch", "generic"),
    (["pipeline=[load,detect,quantize,export]"], False, "model.path", "embedded tiny model"),
    ([*STREAMABLE, "model.stream=false"], False, None, "set in the recipe"),
    ([*STREAMABLE, "model.stream=true"], True, None, "set in the recipe"),
    ([*STREAMABLE, "model.stream=null"], True, None, "no stage"),
    ([*STREAMABLE, "model.stream=auto"], True, None, "no stage"),
])
def test_auto_streams_exactly_when_nothing_needs_the_model_loaded(overrides, streams, key, words):
    from lowbit_pipe.config.compose import compose_recipe
    from lowbit_pipe.plan.stream_choice import decide_stream

    choice = decide_stream(compose_recipe("default", overrides))
    assert choice.stream == streams and words in choice.reason, choice
    assert (choice.blockers[0][0] if choice.blockers else None) == key
    assert choice.line().startswith("streamed file to file" if streams else "model loaded whole")
    assert choice.as_dict()["streamed"] == streams


def test_auto_loads_what_the_caller_keeps():
    """A model handed in is loaded already; lowbit_pipe.run hands the quantized model back (result.model) unless
    the pipeline tears it down, so there auto loads it (the CLI keeps nothing: hands_back=False)."""
    from lowbit_pipe.config.compose import compose_recipe
    from lowbit_pipe.plan.stream_choice import decide_stream

    rec = compose_recipe("default", STREAMABLE)
    assert not decide_stream(rec, model_given=True).stream
    kept = decide_stream(rec, hands_back=True)
    assert not kept.stream and "result.model" in kept.reason and "teardown" in kept.reason
    torn = compose_recipe("default", [*FILE, "pipeline=[load,detect,quantize,export,teardown]"])
    assert decide_stream(torn, hands_back=True).stream


@pytest.mark.parametrize("overrides, key, words", [
    (["pipeline=[load,detect,quantize,lora,export]"], "pipeline", "stage 'lora'"),
    (["pipeline=[load,detect,quantize,export]", "model.arch=generic"], "model.arch", "generic"),
    (["pipeline=[load,detect,quantize,export]", "export.shard_bytes=1048576"], "export.shard_bytes", "one file"),
    (["pipeline=[load,quantize,export]"], "pipeline", "no 'detect' stage"),
    (["pipeline=[load,detect,quantize,export]", "model.stream=maybe"], "model.stream", "true, false or auto"),
])
def test_stream_true_names_what_prevents_it(tmp_path, overrides, key, words):
    stream = [] if any(o.startswith("model.stream=") for o in overrides) else ["model.stream=true"]
    with pytest.raises(RecipeError) as info:
        lowbit_pipe.run("default", [*overrides, *stream, "model.path=x.safetensors"], run_dir=tmp_path / "run")
    assert info.value.path == key and words in str(info.value), str(info.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("recipe, overrides", [
    ("default", ["pipeline=[load,detect,quantize,export,teardown]"]),
    ("flux1_fp8", ["pipeline=[load,detect,quantize,export,teardown]", "quantize.default.activations=dynamic",
                   "model.dtype=bfloat16"]),
    ("krea2_nvfp4", ["pipeline=[load,detect,quantize,export,teardown]", "export.layout=diffusers"]),
    ("default", ["pipeline=[load,detect,export,teardown]", "export.dtype=float16"]),  # float re-export
])
def test_auto_streamed_export_is_the_loaded_export(tmp_path, recipe, overrides, capsys):
    source = lowbit_pipe.run(recipe, ["pipeline=[load,detect,export]", f"export.path={tmp_path / 'float.safetensors'}"],
                             run_dir=tmp_path / "float").export_path
    common = [f"model.path={source}", *overrides]
    capsys.readouterr()
    auto = lowbit_pipe.run(recipe, [*common, f"export.path={tmp_path / 'auto.safetensors'}"], run_dir=tmp_path / "a")
    plan = [line for line in capsys.readouterr().out.splitlines() if line.startswith("plan:")]
    assert plan and plan[0].endswith("; streamed file to file (model.stream=auto: no stage or option needs the "
                                     "model loaded)"), plan
    assert auto.report["stream"] == {"mode": "auto", "streamed": True,
                                     "reason": "no stage or option needs the model loaded"}
    assert auto.report["export"]["streamed"]
    assert "model: streamed file to file (model.stream=auto" in (auto.run_dir / "summary.txt").read_text()
    loaded = lowbit_pipe.run(recipe, [*common, "model.stream=false", f"export.path={tmp_path / 'l.safetensors'}"],
                             run_dir=tmp_path / "l")
    assert loaded.report["stream"]["streamed"] is False and "streamed" not in loaded.report["export"]
    _same_export(loaded.export_path, auto.export_path)


def test_auto_loads_a_quantized_file_whole(tmp_path):
    """Streaming reads float checkpoints: under auto a quantized file is loaded (and re-exported as it is),
    the reason naming it; model.stream=true still refuses it."""
    quantized = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,export]"], run_dir=tmp_path / "q").export_path
    again = lowbit_pipe.run("default", [f"model.path={quantized}", "pipeline=[load,detect,export,teardown]",
                                        f"export.path={tmp_path / 'again.safetensors'}"], run_dir=tmp_path / "again")
    stream = again.report["stream"]
    assert not stream["streamed"] and "quantized layers" in stream["reason"], stream
    assert stream["blocked_by"][0]["key"] == "model.path"
    assert "model: loaded whole (model.stream=auto: model.path holds" in (again.run_dir / "summary.txt").read_text()


PEAK_CHILD = """
import resource, subprocess, sys
proc = subprocess.run([sys.executable, "-m", "lowbit_pipe", *sys.argv[1:]], capture_output=True, text=True)
sys.stdout.write(proc.stdout)
sys.stderr.write(proc.stderr)
print("PEAK", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)  # the CLI run's own peak
sys.exit(proc.returncode)
"""


def test_the_cli_streams_without_the_flag(tmp_path):
    """The CLI hands no model back, so a pipeline without teardown streams under auto (lowbit_pipe.run would load
    it: result.model), into the file the loading path writes."""
    from conftest import cli

    source = lowbit_pipe.run("default", ["pipeline=[load,detect,export]", f"export.path={tmp_path / 'f.safetensors'}"],
                             run_dir=tmp_path / "float").export_path
    common = [f"model.path={source}", "pipeline=[load,detect,quantize,export]"]
    proc = cli([*common, f"hydra.run.dir={tmp_path / 'run'}", f"export.path={tmp_path / 'cli.safetensors'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = [line for line in proc.stdout.splitlines() if line.startswith("plan:")]
    assert plan[0].endswith("; streamed file to file (model.stream=auto: no stage or option needs the model loaded)")
    assert json.loads((tmp_path / "run" / "report.json").read_text())["stream"]["streamed"]
    loaded = lowbit_pipe.run("default", common + [f"export.path={tmp_path / 'api.safetensors'}"], run_dir=tmp_path / "l")
    assert not loaded.report["stream"]["streamed"] and "result.model" in loaded.report["stream"]["reason"]
    _same_export(loaded.export_path, str(tmp_path / "cli.safetensors"))


@pytest.mark.slow
def test_the_cli_streams_a_file_larger_than_its_peak_memory_without_the_flag(tmp_path):
    """`python -m lowbit_pipe model.path=F 'pipeline=[load,detect,quantize,export]'`, no model.stream: a 1.4 GB fp32
    checkpoint (1.31 GiB) goes to int8 in well under its own size (measured: 0.61-0.66 GiB peak, the process's
    0.51 GiB after its imports plus about one layer; 3.49-3.85 GiB with model.stream=false, which holds every
    weight; docs/streaming.md), says so on its plan line and records it in report.json. 40 s on the shared
    2-core machine: slow."""
    import os

    sys.path.insert(0, str(ROOT / "bench"))
    from make_checkpoint import make_checkpoint

    shape = {**SMALL, "num_layers": 20}
    src = tmp_path / "k2.safetensors"
    size = make_checkpoint(src, "krea2", shape, torch.float32, workers=2)["bytes"]
    assert size > 1.3e9
    env = {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"]
                                                    if os.environ.get("PYTHONPATH") else "")}
    proc = subprocess.run([sys.executable, "-c", PEAK_CHILD, f"model.path={src}", "pipeline=[load,detect,quantize,export]",
                           f"export.path={tmp_path / 'out.safetensors'}", f"hydra.run.dir={tmp_path / 'run'}",
                           *[f"+model.config.{k}={v}" for k, v in shape.items()]],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    src.unlink()
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak = int(re.search(r"PEAK (\d+)", proc.stdout).group(1))
    assert "; streamed file to file (model.stream=auto: no stage or option needs the model loaded)" in proc.stdout
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["stream"]["streamed"] and report["export"]["streamed"] and report["export"]["quantized_layers"] == 160
    assert peak < 0.6 * size, (peak, size)
