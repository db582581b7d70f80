"""ComfyUI and comfy-kitchen versions: the node pack registers its nodes on any ComfyUI and the loader only where
it can work (one log line otherwise), the version table, the export's warning, and `install` (base directory,
registry pyproject, example workflows).

ComfyUI here is a stand-in package written into tmp_path (a few module-level names, not ComfyUI code), imported in
a child process so each test sees a fresh `comfy`; the slow tests run the real ComfyUI 0.29.0 from
../shared/comfyui-0.29.0.tar.xz (or LOWBIT_COMFYUI_ARCHIVE; skipped without it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT

import lowbit_pipe
from lowbit_pipe.comfy import compat
from lowbit_pipe.comfy.install import PACK, PREVIOUS_SHIMS, SHIM, install, main, registry_pyproject
from lowbit_pipe.errors import LowbitError


# ---- the version table --------------------------------------------------------------------------------
def test_every_kind_the_formats_write_is_in_the_table_and_carried_by_the_layout():
    pytest.importorskip("comfy_kitchen")
    from lowbit_pipe.comfy.registry import written_kinds

    kinds = written_kinds()
    upstream = {k for k in kinds if not k.startswith(compat.PREFIX)}
    assert upstream <= set(compat.KINDS), upstream - set(compat.KINDS)
    assert {"asym_w4a8_int8", "convrot_w4a4", "awq_w4a16", "svdquant_w4a4", "mxfp8", "nvfp4"} <= upstream
    assert kinds["asym_w4a8_int8"].formats == ("w4a8", "w6a8")
    assert [k for k, kind in kinds.items() if not kind.carried()] == []


def test_version_figures():
    assert compat.version_tuple("0.2.24") == (0, 2, 24) and compat.version_tuple("v0.31.0rc1") == (0, 31, 0)
    with pytest.raises(ValueError, match="not a version"):
        compat.version_tuple("master")
    assert not compat.stock_loads("asym_w4a8_int8", "0.29.0", "0.2.40")  # ComfyUI 0.29.0 has no entry, any kitchen
    assert not compat.stock_loads("asym_w4a8_int8", "0.31.0", "0.2.24")  # the layout came with comfy-kitchen 0.2.27
    assert compat.stock_loads("asym_w4a8_int8", "0.31.0", "0.2.27")
    assert compat.stock_loads("convrot_w4a4", "0.29.0", "0.2.24") and not compat.stock_loads("convrot_w4a4", "0.27.0", "0.2.16")
    assert compat.stock_loads("int8_tensorwise", compat.PACK_MIN_COMFYUI, "0.2.16")
    assert not compat.stock_loads("lowbit_int8", "9.0.0", "9.0.0") and not compat.stock_loads("awq_w4a16", "9.0.0", "9.0.0")
    assert compat.support("lowbit_fp8").pack_only and compat.support("float8_e4m3fn").newer_than_pack_floor is False
    assert compat.support("asym_w4a8_int8").newer_than_pack_floor and compat.support("made_up") is None


def test_is_stock_loadable_follows_the_table():
    from lowbit_pipe.formats import is_stock_loadable
    from lowbit_pipe.formats.common import NOT_IN_STOCK_COMFY

    assert NOT_IN_STOCK_COMFY == ("awq_w4a16", "svdquant_w4a4")
    assert is_stock_loadable({"format": "asym_w4a8_int8", "group_size": 16})  # by some release (0.31.0)
    assert not is_stock_loadable({"format": "svdquant_w4a4"}) and not is_stock_loadable({"format": "made_up"})
    assert not is_stock_loadable({"format": "float8_e4m3fn", "lowbit_granularity": "row"})


def test_the_warning_names_kinds_versions_and_the_pack():
    w4a8 = {"format": "asym_w4a8_int8", "group_size": 16, "convrot_groupsize": 256}
    msg = compat.comfy_warning({"b.1": w4a8, "b.0": w4a8, "b.2": {"format": "int8_tensorwise"}})
    assert msg is not None and "asym_w4a8_int8: 2 layers (e.g. b.0)" in msg
    assert "stock ComfyUI >= 0.31.0 with comfy-kitchen >= 0.2.27" in msg and "install the node pack" in msg
    assert "refuses the whole file" in msg and "int8_tensorwise" not in msg
    quarot = {"format": "lowbit_int8", "lowbit_format": "int8", "lowbit_rotation": "quarot"}
    msg = compat.comfy_warning({"a": quarot, "b": {"format": "svdquant_w4a4"}})
    assert msg.startswith("stock ComfyUI refuses the whole file") and "lowbit_int8: 1 layer (e.g. a: int8 + quarot)" in msg
    assert "svdquant_w4a4" in msg and f"ComfyUI >= {compat.PACK_MIN_COMFYUI} with lowbit_pipe's node pack" in msg
    assert compat.comfy_warning({"a": {"format": "float8_e4m3fn"}, "b": {"format": "nvfp4"}}) is None


@pytest.mark.parametrize("stream", [False, True])
def test_export_warns_for_w4a8(tmp_path, stream):
    overrides = ["pipeline=[load,detect,quantize,export]", "quantize.default.format=w4a8"]
    if stream:
        source = lowbit_pipe.run("default", ["pipeline=[load,detect,export]"], run_dir=tmp_path / "float").export_path
        overrides += ["model.stream=true", f"model.path={source}"]
    result = lowbit_pipe.run("default", overrides, run_dir=tmp_path / "run")
    warned = [w["message"] for w in result.report["warnings"] if "asym_w4a8_int8" in w["message"]]
    assert len(warned) == 1 and "0.31.0" in warned[0] and "install the node pack" in warned[0]
    assert result.report["export"]["not_stock_comfy"] == []  # stock ComfyUI >= 0.31.0 loads it


# ---- the node pack's entry on ComfyUIs of every age (stand-ins in a child process) ---------------------------
ALGOS_029 = """
import torch
QUANT_ALGOS = {
    "float8_e4m3fn": {"storage_t": torch.float8_e4m3fn, "parameters": {"weight_scale", "input_scale"},
                      "comfy_tensor_layout": "TensorCoreFP8E4M3Layout"},
    "int8_tensorwise": {"storage_t": torch.int8, "parameters": {"weight_scale"},
                        "comfy_tensor_layout": "TensorWiseINT8Layout", "quantize_input": False},
}
"""
ALGOS_026 = """
import torch
QUANT_ALGOS = {"float8_e4m3fn": {"storage_t": torch.float8_e4m3fn, "parameters": {"weight_scale", "input_scale"},
                                 "comfy_tensor_layout": "TensorCoreFP8E4M3Layout"}}
"""
KITCHEN = "from comfy_kitchen.tensor import register_layout_class, get_layout_class\n"
LOADER = """
def _load_quantized_module(module, super_load, state_dict, prefix, local_metadata, strict, missing_keys,
                           unexpected_keys, error_msgs, load_extra_params=False):
    raise NotImplementedError("stand-in")
"""
# name -> (comfy/quant_ops.py or None, comfy/ops.py): what each ComfyUI age has, as far as the registration looks
COMFYUIS = {
    "0.3.x (no quant_ops)": (None, ""),
    "0.22 (no _load_quantized_module)": (ALGOS_026 + KITCHEN, ""),
    "0.26 (no quantize_input)": (ALGOS_026 + KITCHEN, LOADER),
    "0.29": (ALGOS_029 + KITCHEN, LOADER),
}
CHILD = """
import importlib.util, json, logging, sys
records = []
class Catch(logging.Handler):
    def emit(self, record):
        records.append({"logger": record.name, "level": record.levelname, "message": record.getMessage()})
logging.getLogger().addHandler(Catch())
sys.path.insert(0, sys.argv[1])
{prelude}
spec = importlib.util.spec_from_file_location("lowbit_pipe_nodes", sys.argv[2])
pack = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pack)
reg = pack.REGISTRATION
print(json.dumps({"nodes": sorted(pack.NODE_CLASS_MAPPINGS), "kinds": None if reg is None else sorted(reg.kinds),
                  "log": [r for r in records if r["logger"].startswith("lowbit_pipe")]}))
"""


def _run_pack(tmp_path: Path, quant_ops: str | None, ops: str, prelude: str = "") -> dict:
    root = tmp_path / "ComfyUI"
    (root / "comfy").mkdir(parents=True)
    (root / "custom_nodes").mkdir()
    (root / "comfy" / "__init__.py").write_text("")
    (root / "comfy" / "ops.py").write_text(ops)
    (root / "comfy" / "model_patcher.py").write_text("class ModelPatcher:\n    pass\n")  # every ComfyUI has one
    if quant_ops is not None:
        (root / "comfy" / "quant_ops.py").write_text(quant_ops)
    shim = install(root)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", CHILD.replace("{prelude}", prelude), str(root), str(shim)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("age", list(COMFYUIS))
def test_the_pack_registers_its_nodes_on_any_comfyui(tmp_path, age):
    pytest.importorskip("comfy_kitchen")
    from lowbit_pipe.comfy.nodes import NODE_CLASS_MAPPINGS

    out = _run_pack(tmp_path, *COMFYUIS[age])
    assert out["nodes"] == sorted(NODE_CLASS_MAPPINGS)
    if age == "0.29":
        assert out["log"] == [] and "asym_w4a8_int8" in out["kinds"] and "lowbit_int8" in out["kinds"]
        return
    assert out["kinds"] is None and len(out["log"]) == 1 and out["log"][0]["level"] == "WARNING"
    line = out["log"][0]["message"]
    assert f"ComfyUI >= {compat.PACK_MIN_COMFYUI}" in line and "nodes registered" in line
    missing = {"0.3.x (no quant_ops)": "comfy.quant_ops", "0.22 (no _load_quantized_module)": "_load_quantized_module",
               "0.26 (no quantize_input)": "quantize_input"}[age]
    assert missing in line


def test_the_pack_without_a_usable_comfy_kitchen(tmp_path):
    pytest.importorskip("comfy_kitchen")
    gone = _run_pack(tmp_path / "gone", *COMFYUIS["0.29"], prelude="sys.modules['comfy_kitchen'] = None")
    assert gone["kinds"] is None and len(gone["log"]) == 1 and "comfy-kitchen cannot be imported" in gone["log"][0]["message"]
    old = _run_pack(tmp_path / "old", *COMFYUIS["0.29"],
                    prelude="import comfy_kitchen.tensor as t; del t.QuantizedTensor.requantize_from_float")
    line = old["log"][0]["message"]
    assert old["kinds"] is None and len(old["log"]) == 1
    assert f"needs comfy-kitchen >= {compat.PACK_MIN_COMFY_KITCHEN}" in line and "is installed" in line
    assert "requantize_from_float" in line


def test_register_loader_reraises_an_import_error_that_is_not_about_versions(monkeypatch):
    import lowbit_pipe.comfy as package

    monkeypatch.delattr(package, "registry", raising=False)
    monkeypatch.setitem(sys.modules, "lowbit_pipe.comfy.registry", None)  # lowbit_pipe itself broken
    with pytest.raises(ImportError, match="lowbit_pipe.comfy.registry"):
        compat.register_loader()


def test_check_comfy_kitchen_names_both_versions():
    with pytest.raises(compat.IncompatibleComfyUI, match=r"comfy-kitchen 0\.2\.10 is installed.*>= 0\.2\.13"):
        compat.check_comfy_kitchen("0.2.10", True)
    compat.check_comfy_kitchen("0.2.13", True)
    compat.check_comfy_kitchen(None, True)  # a source checkout: the feature decides
    with pytest.raises(compat.IncompatibleComfyUI, match="version unknown"):
        compat.check_comfy_kitchen(None, False)
    assert issubclass(compat.IncompatibleComfyUI, TypeError)


# ---- install ---------------------------------------------------------------------------------------------------
def _comfyui(tmp_path: Path) -> Path:
    root = tmp_path / "ComfyUI"
    (root / "comfy").mkdir(parents=True)
    (root / "custom_nodes").mkdir()
    return root


def test_install_into_a_base_directory(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    assert main(["install", "--base-directory", str(base)]) == 0
    pack = base / "custom_nodes" / PACK
    assert (pack / "__init__.py").read_text() == SHIM
    assert main(["install", "--base-directory", str(tmp_path / "missing")]) == 2
    assert main(["install", str(_comfyui(tmp_path)), "--base-directory", str(base)]) == 2
    assert main(["install"]) == 2
    with pytest.raises(LowbitError, match="not a ComfyUI folder.*--base-directory"):
        install(base)


def test_the_registry_pyproject(tmp_path):
    pack = install(_comfyui(tmp_path)).parent
    data = tomllib.loads((pack / "pyproject.toml").read_text())
    project, comfy = data["project"], data["tool"]["comfy"]
    assert project["name"] == PACK and project["version"] == lowbit_pipe.__version__
    assert project["license"] == {"text": "Apache-2.0"} and project["description"]
    assert comfy["requires-comfyui"] == compat.SUPPORTED_COMFYUI == ">=0.27.0" and comfy["DisplayName"]
    with pytest.raises(LowbitError, match="not X.Y.Z"):
        registry_pyproject("0.1.0.dev3")


def test_install_copies_the_example_workflows(tmp_path):
    source = tmp_path / "workflows"
    root = _comfyui(tmp_path)
    install(root, workflow_source=source)  # no folder: nothing copied
    pack = root / "custom_nodes" / PACK
    assert not (pack / "example_workflows").exists()
    source.mkdir()
    install(root, workflow_source=source)  # empty folder: nothing either
    assert not (pack / "example_workflows").exists()
    (source / "quantize.json").write_text(json.dumps({"nodes": [1]}))
    (source / "lora.json").write_text(json.dumps({"nodes": [2]}))
    (source / "notes.txt").write_text("not a workflow")
    install(root, workflow_source=source)
    assert sorted(p.name for p in (pack / "example_workflows").iterdir()) == ["lora.json", "quantize.json"]
    assert json.loads((pack / "example_workflows" / "lora.json").read_text()) == {"nodes": [2]}
    assert [p for p in pack.rglob("*") if ".tmp-" in p.name] == []  # atomic writes leave no temp files
    (source / "broken.json").write_text("{")
    before = (pack / "pyproject.toml").stat().st_mtime_ns
    with pytest.raises(LowbitError, match="broken.json"):
        install(root, workflow_source=source)
    assert (pack / "pyproject.toml").stat().st_mtime_ns == before  # refused before writing anything


def test_install_replaces_only_its_own_entry_files(tmp_path):
    root = _comfyui(tmp_path)
    entry = root / "custom_nodes" / PACK / "__init__.py"
    entry.parent.mkdir()
    entry.write_text(PREVIOUS_SHIMS[0])  # what an earlier lowbit_pipe wrote
    assert install(root).read_text() == SHIM
    entry.write_text("# someone else's\n")
    with pytest.raises(LowbitError, match="--force"):
        install(root)
    assert entry.read_text() == "# someone else's\n"
    assert install(root, force=True).read_text() == SHIM


def test_the_package_ships_the_example_workflows():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert {"example_workflows/*.json", "web/*.js"} <= set(data["tool"]["setuptools"]["package-data"]["lowbit_pipe.comfy"])
    assert data["project"]["optional-dependencies"]["comfy"] == [f"comfy-kitchen>={compat.PACK_MIN_COMFY_KITCHEN}"]


# ---- the real ComfyUI 0.29.0 ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def comfyui_029(comfyui_src) -> Path:
    """The session's shared (read-only) ComfyUI 0.29.0 tree; skipped, saying how to enable it, without the archive."""
    assert (comfyui_src / "comfy" / "quant_ops.py").is_file(), sorted(p.name for p in comfyui_src.iterdir())
    return comfyui_src


@pytest.mark.slow
@pytest.mark.comfyui
def test_comfyui_029_reads_the_pack_pyproject(comfyui_029, tmp_path):
    pack = install(_comfyui(tmp_path)).parent  # the pack as installed (not into the shared 0.29.0 tree, kept read-only)
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(comfyui_029)!r})
        from comfy_config import config_parser
        c = config_parser.extract_node_configuration({str(pack)!r})
        print(c.project.name, c.project.version, c.project.supported_comfyui_version)
    """)
    pytest.importorskip("pydantic_settings")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [PACK, lowbit_pipe.__version__, compat.SUPPORTED_COMFYUI]


@pytest.mark.slow
@pytest.mark.comfyui
def test_comfyui_029_loads_w4a8_and_w6a8_through_the_pack(comfyui_029, tmp_path):
    """ComfyUI 0.29.0 has no asym_w4a8_int8 entry (whatever comfy-kitchen): stock refuses the file at the format
    lookup, the pack registers the kind through LowbitLayout and every layer is bit-exact with lowbit_pipe."""
    pytest.importorskip("comfy_kitchen")
    out = tmp_path / "cc"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "comfy_check.py"), str(comfyui_029), "--archs", "krea2",
                           "--cases", "w4a8", "w6a8", "--out", str(out)], capture_output=True, text=True, timeout=1500,
                          cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)})
    # The bench's verdict (exit status 1 here) expects stock ComfyUI to load a kind any release loads stock;
    # 0.29.0 predates asym_w4a8_int8's entry, so the rows are checked here instead.
    assert out.with_suffix(".json").is_file(), proc.stderr[-3000:]
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["export"]["case"] for r in rows] == ["w4a8", "w6a8"]
    for r in rows:
        c = r["comfy"]
        assert not c["stock"]["loads"] and "KeyError: 'asym_w4a8_int8'" in c["stock"]["error"]
        assert "asym_w4a8_int8" in c["registration"]["kinds"]
        assert c["pack"]["loads"] and c["pack"]["forward_finite"]
        layers = c["pack"]["layers"]
        assert layers["max_rel_diff_enabled"] == 0 and not layers.get("errors")
        assert c["uninstall"]["restored"]


def test_install_writes_the_front_end_extension_the_locale_and_thumbnails(tmp_path):
    from lowbit_pipe.comfy.install import WORKFLOW_SOURCE

    root = _comfyui(tmp_path)
    install(root)
    pack = root / "custom_nodes" / PACK
    assert 'WEB_DIRECTORY = "./web"' in SHIM and (pack / "web" / "lowbit_pipe.js").is_file()
    script = (pack / "web" / "lowbit_pipe.js").read_text()
    assert 'const CATEGORY = "lowbit_pipe"' in script and "onExecuted" in script and "serialize = false" in script
    assert json.loads((pack / "locales" / "en" / "main.json").read_text()) == \
        {"templateWorkflows": {"category": {PACK: "lowbit_pipe"}}}  # the template browser's category name
    workflows = sorted(WORKFLOW_SOURCE.glob("*.json"))
    assert len(workflows) == 4
    from PIL import Image

    for path in workflows:
        thumb = pack / "example_workflows" / f"{path.stem}.jpg"  # the name ComfyUI's front end asks for
        assert 0 < thumb.stat().st_size < 100 * 1024, thumb
        with Image.open(thumb) as image:
            assert image.format == "JPEG" and image.size == (512, 384)
            low, high = image.convert("L").getextrema()
            assert high - low > 100  # a drawing, not a blank card
    assert PREVIOUS_SHIMS[0].count("WEB_DIRECTORY") == 0  # the entry file before this one is still ours


def test_the_example_workflows_read_as_a_user_meets_them():
    """Titles as file names (ComfyUI's template browser shows the name), model files with a download where one
    exists, Example inputs' seed fixed, Quantize's three widgets, and every link joining matching sockets."""
    from lowbit_pipe.comfy.install import WORKFLOW_SOURCE

    for path in sorted(WORKFLOW_SOURCE.glob("*.json")):
        workflow = json.loads(path.read_text())
        assert "_" not in path.stem and path.stem.endswith("(Krea 2)"), path.name
        nodes = {n["id"]: n for n in workflow["nodes"]}
        for node in nodes.values():
            for model in node["properties"].get("models", []):
                assert model["url"].startswith("https://huggingface.co/") and model["url"].endswith(model["name"])
                assert model["name"] in node["widgets_values"] and model["directory"] in ("text_encoders", "vae",
                                                                                          "loras")
            if node["type"] == "LowbitExampleInputs":
                assert node["widgets_values"][-1] == "fixed"
            if node["type"] == "LowbitQuantize":
                assert len(node["widgets_values"]) == 3 and node["widgets_values"][2] == ""
        loaders = [n for n in nodes.values() if n["type"] in ("CLIPLoader", "VAELoader", "LowbitLoRA")]
        assert all(n["properties"].get("models") for n in loaders), path.name  # nothing named only in a Note
        for link_id, src, slot, dst, dst_slot, kind in workflow["links"]:
            assert nodes[src]["outputs"][slot]["type"] == kind and link_id in nodes[src]["outputs"][slot]["links"]
            assert nodes[dst]["inputs"][dst_slot]["link"] == link_id
        assert any(n["type"] == "LowbitPurge" for n in nodes.values()), path.name
