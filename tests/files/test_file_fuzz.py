"""Every reader of the project against hostile and damaged files (tests/files/hostile_files.py makes them): read_header,
the lazy reader streaming uses, shard indexes and diffusers folders, the load stage, arch detection, the formats'
record and tensor readers (the loading path's and the ComfyUI pack's), the LoRA reader. Each file either loads
or ends in the project's named error (LowbitError, naming the file or layer), never a raw exception, never a
hang, never memory by the size a header claims."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from hostile_files import (
    HOSTILE_HEADERS,
    HOSTILE_RECORDS,
    Entry,
    read_entries,
    structural_mutations,
    write_entries,
    write_raw,
)
from safetensors.torch import save_file

import lowbit_pipe
from lowbit_pipe import lora
from lowbit_pipe.arch import get_arch
from lowbit_pipe.arch.detect import detect_state_dict
from lowbit_pipe.errors import FormatError, LoraError, LowbitError, RecipeError, StageError
from lowbit_pipe.files.checkpoint import read_header, shard_files
from lowbit_pipe.files.lazy import SafetensorsFiles
from lowbit_pipe.files.stream import diffusers_dir_files
from lowbit_pipe.formats import FORMATS, FormatSpec, decode_record, format_for_record
from lowbit_pipe.stages.load import load_single_file


def refused(fn, *names: str) -> LowbitError | None:
    """Run `fn`; None when it succeeds, its LowbitError (whose message holds every one of `names`) when it refuses.
    Any other exception fails the test."""
    try:
        fn()
    except LowbitError as err:
        for name in names:
            assert name in str(err), (name, str(err))
        return err
    return None


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """Small real exports: krea2 float and int8 (diffusers layout), flux1 fp8 (native layout, fused qkv)."""
    tmp = tmp_path_factory.mktemp("exports")
    out = {}
    for name, recipe, pipeline in [("float", "default", "[load,detect,export]"), ("int8", "default", None),
                                   ("fp8_native", "flux1_fp8", None)]:
        overrides = [f"export.path={tmp / name}.safetensors", f"pipeline={pipeline or '[load,detect,quantize,export]'}"]
        out[name] = Path(lowbit_pipe.run(recipe, overrides, run_dir=tmp / f"run_{name}").export_path)
    return out


def _all_readers(path: Path) -> None:
    """Each reader of a whole file, in turn, each expected to refuse it by name."""
    assert refused(lambda: read_header(path), str(path))
    assert refused(lambda: SafetensorsFiles([str(path)]).tensors(), str(path))
    assert refused(lambda: load_single_file(str(path), None, {}, torch.float32), str(path))
    assert refused(lambda: lora.parse_lora(path, torch.nn.Linear(2, 2)), str(path))


@pytest.mark.parametrize("case", list(HOSTILE_HEADERS))
def test_a_hostile_header_is_refused_by_every_reader(case, tmp_path):
    header, data, length = HOSTILE_HEADERS[case]
    _all_readers(write_raw(tmp_path / "hostile.safetensors", header, data, length))


def test_a_truncated_export_is_refused_by_every_reader(exports, tmp_path):
    """Cuts in the length, in the header and through the data (every header byte is read_header's own test)."""
    real = exports["int8"].read_bytes()
    (n,) = struct.unpack("<Q", real[:8])
    cut = tmp_path / "cut.safetensors"
    for at in [0, 3, 8, 9, 8 + n // 2, 8 + n - 1, 8 + n, 8 + n + 1, len(real) // 2, len(real) - 1]:
        cut.write_bytes(real[:at])
        _all_readers(cut)


def test_a_file_truncated_under_the_lazy_reader_is_refused_naming_the_key(exports, tmp_path):
    """Streaming reads the header first and the data much later: a file cut in between is named, not misread."""
    path = tmp_path / "moving.safetensors"
    path.write_bytes(exports["float"].read_bytes())
    files = SafetensorsFiles([str(path)])
    lazy = files.tensors()
    last = max(files.headers[0].tensors, key=lambda k: files.headers[0].tensors[k].offsets)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 8)
    with files:
        assert refused(lambda: lazy[last].materialize(), str(path), last)


def _index(folder: Path, weight_map: object) -> str:
    path = folder / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(path)


def test_a_hostile_shard_index_is_refused_naming_the_index(exports, tmp_path):
    (tmp_path / "a.safetensors").write_bytes(exports["float"].read_bytes())
    keys = list(read_header(tmp_path / "a.safetensors").tensors)
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "Krea2Transformer2DModel"}))
    whole = dict.fromkeys(keys, "a.safetensors")
    cases = {
        "a shard that is not there": ({**whole, keys[0]: "b.safetensors"}, "b.safetensors"),
        "a name that is not a string": ({**whole, keys[0]: 5}, "must be a file name"),
        "a list as name": ({**whole, keys[0]: ["a.safetensors"]}, "must be a file name"),
        "a path out of the folder": ({**whole, keys[0]: "../a.safetensors"}, "must be a file name"),
        "an absolute path": ({**whole, keys[0]: "/etc/passwd"}, "must be a file name"),
        "no entries": ({}, "weight_map"),
        "not a mapping": ([["x", "a.safetensors"]], "weight_map"),
        "a key the shard lacks": ({**whole, "ghost.weight": "a.safetensors"}, "ghost.weight"),
        "a key the index omits": ({k: v for k, v in whole.items() if k != keys[3]}, keys[3]),
    }
    for case, (weight_map, words) in cases.items():
        index = _index(tmp_path, weight_map)
        err = refused(lambda: shard_files(index), words)
        assert err is not None, case
        assert refused(lambda: load_single_file(index, None, {}, torch.float32), words), case
        assert refused(lambda: diffusers_dir_files(str(tmp_path)), words), case
    (tmp_path / "model.safetensors.index.json").write_text("{\"weight_map\": ")
    assert refused(lambda: shard_files(str(tmp_path / "model.safetensors.index.json")), "not a valid safetensors index")
    assert shard_files(_index(tmp_path, whole)) == [str(tmp_path / "a.safetensors")]


def _format_cases() -> dict[str, tuple]:
    """Per format a real quantized layer (64 x 256), as the readers get it."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g)
    out = {}
    for name, fmt in FORMATS.items():
        q = fmt.quantize(w, FormatSpec(name))
        out[name] = (fmt, q)
    return out


def _read_layer(tensors: dict[str, torch.Tensor], record_bytes: torch.Tensor, where: str) -> None:
    """What the load stage and the ComfyUI pack do with a layer: decode the record, pick the format, read the
    tensors; an accepted layer must then dequantize to its logical shape."""
    record = decode_record(record_bytes, where)
    fmt = format_for_record(record, where)
    q = fmt.from_tensors(dict(tensors), record, where)
    assert tuple(fmt.dequantize(q).shape) == tuple(q.shape)


def _as_tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)


def test_hostile_records_are_refused_by_every_format():
    """Each hostile record, as written and with its format field set to each format's own, next to that format's
    real tensors: refused naming the layer, or (a harmless field) read into a layer that dequantizes."""
    for name, (fmt, q) in _format_cases().items():
        for case, raw in HOSTILE_RECORDS.items():
            variants = [raw]
            try:
                parsed = json.loads(raw)
            except (ValueError, RecursionError):
                parsed = None
            if isinstance(parsed, dict):
                variants.append(json.dumps({**q.record, **{k: v for k, v in parsed.items() if k != "format"}}).encode())
            for v in variants:
                refused(lambda: _read_layer(q.tensors, _as_tensor(v), "f [L]"), "f [L]")


def test_the_comfyui_pack_loader_refuses_hostile_layers_naming_them():
    """The node pack's `_load_quantized_module` (stand-ins of ComfyUI's modules, tests/comfy/test_comfy_layout.py): a
    lowbit layer with a hostile record or wrong tensors loads or is refused naming the ComfyUI layer; a record it
    cannot read at all goes to ComfyUI's own loader untouched."""
    pytest.importorskip("comfy_kitchen")
    from test_comfy_layout import _stand_ins

    from lowbit_pipe.comfy import layout, registry
    from lowbit_pipe.formats import encode_record

    rng = random.Random(27)
    quant_ops, ops, Linear, calls = _stand_ins()
    refusals = 0
    with registry.install(quant_ops, ops):
        for name, (fmt, q) in _format_cases().items():
            record = {**q.record, "format": f"lowbit_{name}", "lowbit_format": name}
            cases = [(what, tensors, encode_record(record)) for what, tensors in _tensor_mutations(q, rng)]
            for case, raw in HOSTILE_RECORDS.items():
                try:
                    parsed = json.loads(raw)
                except (ValueError, RecursionError):
                    cases.append((case, q.tensors, _as_tensor(raw)))
                    continue
                if isinstance(parsed, dict):
                    cases.append((case, q.tensors, _as_tensor(json.dumps({**parsed, **{
                        k: v for k, v in record.items() if k not in parsed}}).encode())))
            for what, tensors, rec in cases:
                layer = Linear(256, 64, bias=False)
                state = {**{k: v.clone() for k, v in tensors.items()}, "comfy_quant": rec}
                before = len(calls)
                try:
                    err = refused(lambda: layer.load_state_dict(state, strict=False))
                except KeyError:  # the stand-in of ComfyUI's own loader, handed what the pack cannot read
                    assert len(calls) > before, (name, what)
                    continue
                if err is not None:
                    assert "ComfyUI layer ''" in str(err), (name, what, str(err))
                    refusals += 1
                elif len(calls) == before:  # loaded as a lowbit layer: it must dequantize to its shape
                    assert tuple(fmt.dequantize(layout.to_quantized_weight(layer.weight)).shape) == (64, 256), (name, what)
    assert refusals > 100


def test_a_huge_record_is_refused_unparsed():
    raw = HOSTILE_RECORDS["huge"]
    err = refused(lambda: decode_record(_as_tensor(raw), "f [L]"), "f [L]", "over the 65536")
    assert isinstance(err, FormatError)


def _tensor_mutations(q, rng: random.Random):
    for key, t in q.tensors.items():
        yield f"{key} dropped", {k: v for k, v in q.tensors.items() if k != key}
        for dtype in (torch.float32, torch.uint8, torch.int32, torch.float8_e4m3fn, torch.bfloat16):
            if dtype != t.dtype:
                yield f"{key} as {dtype}", {**q.tensors, key: torch.zeros(t.shape, dtype=dtype)}
        for shape in [(), (1,), (t.shape[0] + 1, *t.shape[1:]) if t.dim() else (2,), tuple(t.shape)[::-1],
                      (*t.shape, 2), (0, *t.shape[1:]) if t.dim() else (0,)]:
            if tuple(shape) != tuple(t.shape):
                yield f"{key} shaped {shape}", {**q.tensors, key: torch.zeros(shape, dtype=t.dtype)}
        if t.is_floating_point() and t.numel():
            bad = t.clone().float()
            bad.view(-1)[rng.randrange(bad.numel())] = float(rng.choice(("nan", "inf")))
            yield f"NaN/Inf in {key}", {**q.tensors, key: bad.to(t.dtype)}
    yield "an extra tensor", {**q.tensors, "weight_junk": torch.zeros(3)}


def test_wrong_tensors_of_a_quantized_layer_are_refused_by_every_format():
    """Every format's tensors dropped, of another dtype or shape, or with NaN: refused naming the layer, or
    read into a layer that dequantizes to its shape (never a raw error in the reader or later)."""
    rng = random.Random(27)
    from lowbit_pipe.formats import encode_record

    refusals = 0
    for name, (fmt, q) in _format_cases().items():
        for what, tensors in _tensor_mutations(q, rng):
            if refused(lambda: _read_layer(tensors, encode_record(q.record), "f [L]"), "f [L]") is not None:
                refusals += 1
    assert refusals > 100


def test_a_billion_layers_is_refused_before_any_model_is_built(exports, tmp_path):
    entries, meta = read_entries(exports["float"])
    key = next(k for k in entries if k.startswith("blocks.1."))
    stray = {**entries, key.replace("blocks.1.", "blocks.1000000000."): entries[key]}
    path = write_entries(tmp_path / "stray.safetensors", stray, meta)
    start = time.monotonic()
    assert refused(lambda: load_single_file(str(path), None, {}, torch.float32), str(path), "1000000000")
    shapes = {k: e.shape for k, e in stray.items()}
    assert refused(lambda: detect_state_dict(shapes), "block index 1000000000")
    header = json.loads(meta["lowbit_pipe"])
    header["transformer_config"]["num_layers"] = 10**9
    path = write_entries(tmp_path / "claims.safetensors", entries, {**meta, "lowbit_pipe": json.dumps(header)})
    assert refused(lambda: load_single_file(str(path), None, {}, torch.float32), str(path), "num_layers")
    # streaming builds the structure from the same config: refused there too, not hung in a meta build
    with pytest.raises((RecipeError, StageError), match="num_layers"):
        lowbit_pipe.run("default", [f"model.path={path}", "model.stream=true", "pipeline=[load,detect,quantize,export]",
                                    f"export.path={tmp_path / 'out.safetensors'}"], run_dir=tmp_path / "run")
    assert time.monotonic() - start < 20


def test_hostile_metadata_is_refused_naming_the_field(exports, tmp_path):
    entries, meta = read_entries(exports["int8"])
    for key, value, words in [("lowbit_pipe", "[]", "not a JSON object"), ("lowbit_pipe", "not json", "not valid JSON"),
                              ("lowbit_pipe", '{"arch": 7}', "'arch'"), ("lowbit_pipe", '{"arch": "nope"}', "nope"),
                              ("lowbit_pipe", '{"transformer_config": [1]}', "transformer_config"),
                              ("lowbit_pipe", "[" * 100_000, "not valid JSON"),
                              ("_quantization_metadata", '{"layers": 5}', "'layers'"),
                              ("_quantization_metadata", '{"layers": {"x": 1}}', "without 'format'")]:
        path = write_entries(tmp_path / "meta.safetensors", entries, {**meta, key: value})
        assert refused(lambda: load_single_file(str(path), None, {}, torch.float32), str(path), words), (key, value)


def test_an_fp8_tensor_outside_a_quantized_layer_is_checked_not_crashed_on(exports, tmp_path):
    entries, meta = read_entries(exports["float"])
    e = entries["first.weight"]
    nan = Entry("F8_E4M3", e.shape, b"\x7f" * (len(e.data) // 4))
    path = write_entries(tmp_path / "fp8.safetensors", {**entries, "first.weight": nan}, meta)
    assert refused(lambda: load_single_file(str(path), None, {}, torch.float32), str(path), "NaN or Inf")


def _mutations_load(exports, tmp_path, count: int) -> tuple[int, int]:
    """Structural mutations of the int8 (diffusers) and fp8 (native, fused) exports through the load stage."""
    loaded = refusals = 0
    for name in ("int8", "fp8_native"):
        entries, meta = read_entries(exports[name])
        rng = random.Random(f"{name}{count}")
        for what, ents, md in structural_mutations(entries, meta, rng, count):
            path = write_entries(tmp_path / "m.safetensors", ents, md)
            start = time.monotonic()
            try:
                err = refused(lambda: load_single_file(str(path), None, {}, torch.float32))
            except AssertionError:
                raise
            except BaseException as exc:
                raise AssertionError(f"{name}: {what}: {type(exc).__name__}: {exc}") from exc
            assert time.monotonic() - start < 10, what
            if err is None:
                loaded += 1
            else:
                assert str(path) in str(err), (what, str(err))
                refusals += 1
    return loaded, refusals


def test_mutated_exports_load_or_are_refused_by_name(exports, tmp_path):
    loaded, refusals = _mutations_load(exports, tmp_path, 8)
    assert refusals > 4


@pytest.mark.slow
def test_many_mutated_exports_load_or_are_refused_by_name(exports, tmp_path):
    loaded, refusals = _mutations_load(exports, tmp_path, 40)
    assert refusals > 30


def test_a_hostile_file_through_the_run_is_refused_before_any_stage(tmp_path):
    """The run's preflight reads model.path's header: a hostile one is a recipe error at model.path naming the file
    and the key, before the load stage (and its error's words are read_header's)."""
    path = write_raw(tmp_path / "bad.safetensors", *HOSTILE_HEADERS["overlapping"][:2])
    with pytest.raises(RecipeError) as err:
        lowbit_pipe.run("default", [f"model.path={path}", "pipeline=[load,detect,quantize,export]",
                                    f"export.path={tmp_path / 'out.safetensors'}"], run_dir=tmp_path / "run")
    assert err.value.path == "model.path" and f"{path} [y]" in str(err.value) and "overlaps x" in str(err.value)
    assert not (tmp_path / "out.safetensors").exists()


def test_hostile_lora_files_are_refused_naming_file_and_key(tiny_model, tmp_path):
    from lowbit_pipe.lora.make_example import example_lora

    model = tiny_model("krea2")
    arch = get_arch("krea2")
    sd, _ = example_lora(model, arch, style="peft", rank=4, seed=7, alpha=4.0)
    down = next(k for k in sd if "lora_A" in k)
    up = down.replace("lora_A", "lora_B")
    nan = sd[down].clone()
    nan[0, 0] = float("nan")
    cases = {
        "NaN in a factor": ({**sd, down: nan}, "NaN or Inf"),
        "Inf in a factor": ({**sd, up: sd[up] * float("inf")}, "NaN or Inf"),
        "an integer factor": ({**sd, down: sd[down].to(torch.int32)}, "floating point"),
        "an fp8 factor": ({**sd, down: sd[down].to(torch.float8_e4m3fn)}, None),
        "ranks that differ": ({**sd, down: sd[down][:2]}, "rank"),
        "a rank of zero": ({**sd, down: sd[down][:0], up: sd[up][:, :0]}, "rank 0"),
        "a 3-D factor": ({**sd, down: sd[down][None]}, "not a Linear LoRA factor"),
        "an alpha of two values": ({**sd, down.replace("lora_A.weight", "alpha"): torch.ones(2)}, "alpha"),
        "an alpha of NaN": ({**sd, down.replace("lora_A.weight", "alpha"): torch.tensor(float("nan"))}, "NaN"),
        "a DoRA magnitude of the wrong shape": ({**sd, down.replace("lora_A.weight", "lora_magnitude_vector"):
                                                 torch.ones(3)}, "magnitude"),
    }
    for case, (state, words) in cases.items():
        path = tmp_path / "lora.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
        err = refused(lambda: lora.parse_lora(path, model, arch=arch), str(path), *([words] if words else []))
        if words is not None:
            assert isinstance(err, LoraError), case


_CLAIM_SCRIPT = r"""
import resource, sys, torch
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from hostile_files import Entry, claim_file, read_entries
from lowbit_pipe import lora
from lowbit_pipe.errors import LowbitError
from lowbit_pipe.files.lazy import SafetensorsFiles
from lowbit_pipe.stages.load import load_single_file

entries, meta = read_entries(Path(sys.argv[1]))
tmp = Path(sys.argv[3])
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
load_single_file(sys.argv[1], None, {}, torch.float32)  # warm: imports, the model class
lora.parse_lora(sys.argv[1], torch.nn.Linear(512, 512))
base = rss()
claims = {  # a GiB claimed by a key of the model, by a stray key, by a LoRA factor
    "model key": claim_file(tmp / "a.safetensors", "first.weight", (2**14, 2**14), "F32", meta,
                            {k: e for k, e in entries.items() if k != "first.weight"}),
    "stray key": claim_file(tmp / "b.safetensors", "vae.decoder.weight", (2**14, 2**14), "F32", meta, entries),
    "lora factor": claim_file(tmp / "c.safetensors", "x.lora_A.weight", (2**14, 2**14), "F32", None,
                              {"x.lora_B.weight": Entry("F32", (2, 2**14), bytes(2**17))}),
}
for what, path in claims.items():
    for reader in (lambda: load_single_file(str(path), None, {}, torch.float32),
                   lambda: SafetensorsFiles([str(path)]).tensors(),
                   lambda: lora.parse_lora(path, torch.nn.Linear(2, 2))):
        try:
            reader()
        except LowbitError as err:
            print("REFUSED", what, str(err)[:160])
print("GROWTH", rss() - base)
"""


def test_a_gibibyte_claim_costs_no_memory(exports, tmp_path):
    """Sparse files whose headers claim a 1 GiB tensor (no disk): every reader refuses or reads lazily without the
    process's peak resident memory growing by the claim (bound: 128 MiB over the warm baseline)."""
    proc = subprocess.run([sys.executable, "-c", _CLAIM_SCRIPT, str(exports["float"]), str(Path(__file__).resolve().parent),
                           str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for what in ("model key", "stray key", "lora factor"):  # the load stage and the LoRA reader refuse each
        assert f"REFUSED {what}" in proc.stdout, proc.stdout
    assert proc.stdout.count("claims 1073741824 bytes") >= 3, proc.stdout
    growth = int(proc.stdout.rsplit("GROWTH", 1)[1])
    assert growth < 128 * 2**20, (growth, proc.stdout)


@pytest.mark.slow
def test_mutated_float_checkpoints_stream_or_are_refused_by_name(exports, tmp_path):
    """model.stream=true (the lazy reader, the key map on lazy tensors, the streaming writer) on structural
    mutations of a float export: a whole export or a named error, never a raw one or a hang (a config of a
    billion layers hung the meta build here before the bound moved into inspect_file)."""
    entries, meta = read_entries(exports["float"])
    outcomes = {"exported": 0, "refused": 0}
    for i, (what, ents, md) in enumerate(structural_mutations(entries, meta, random.Random(3), 12)):
        path = write_entries(tmp_path / "m.safetensors", ents, md)
        start = time.monotonic()
        try:
            lowbit_pipe.run("default", [f"model.path={path}", "model.stream=true", "pipeline=[load,detect,quantize,export]",
                                        f"export.path={tmp_path / f'o{i}.safetensors'}"], run_dir=tmp_path / f"r{i}")
            outcomes["exported"] += 1
            assert read_header(tmp_path / f"o{i}.safetensors").tensors, what
        except LowbitError as err:
            assert str(path) in str(err) or "model." in str(err), (what, str(err))
            assert not (tmp_path / f"o{i}.safetensors").exists(), what
            outcomes["refused"] += 1
        assert time.monotonic() - start < 20, what
    assert outcomes["refused"] > 3, outcomes
