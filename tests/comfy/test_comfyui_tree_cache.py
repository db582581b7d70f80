"""The shared ComfyUI tree of the real-ComfyUI tests (comfyui_harness.shared_comfyui), on a small stand-in archive:
unpacked once per archive content, reused while it is as unpacked, made again when a test changed it, and every
change named."""

from __future__ import annotations

import tarfile

import comfyui_harness
import pytest


def _archive(tmp_path, name: str = "comfyui-x.tar.xz", body: str = "x = 1\n"):
    src = tmp_path / "src" / "ComfyUI"
    (src / "comfy").mkdir(parents=True, exist_ok=True)
    (src / "comfy" / "ops.py").write_text(body)
    (src / "main.py").write_text("print('main')\n")
    archive = tmp_path / name
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(src, arcname="ComfyUI")
    return archive


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(comfyui_harness, "CACHE_ROOT", tmp_path / "cache")
    monkeypatch.setenv("LOWBIT_COMFYUI_ARCHIVE", str(_archive(tmp_path)))
    return tmp_path / "cache"


def test_one_tree_per_archive_reused_while_untouched(cache, tmp_path, monkeypatch):
    src = comfyui_harness.shared_comfyui()
    assert src.name == "ComfyUI" and (src / "comfy" / "ops.py").read_text() == "x = 1\n"
    inode = (src / "comfy" / "ops.py").stat().st_ino
    assert list((src / "comfy" / "__pycache__").glob("ops.*.pyc"))  # compiled once, when made
    (src / "comfy" / "__pycache__" / "other.cpython.pyc").write_bytes(b"\0")  # what an import may write: no change
    again = comfyui_harness.shared_comfyui()
    assert again == src and (src / "comfy" / "ops.py").stat().st_ino == inode  # not unpacked again
    assert comfyui_harness.changes(comfyui_harness.tree_of(src)) == []
    assert [p.name for p in cache.iterdir()] == [comfyui_harness.tree_of(src).name]  # no scratch folder left
    # another archive content (same name): a tree of its own
    monkeypatch.setenv("LOWBIT_COMFYUI_ARCHIVE", str(_archive(tmp_path / "b", body="x = 2\n")))
    other = comfyui_harness.shared_comfyui()
    assert other != src and (other / "comfy" / "ops.py").read_text() == "x = 2\n"


def test_a_change_is_named_and_the_tree_made_again(cache):
    src = comfyui_harness.shared_comfyui()
    home = comfyui_harness.tree_of(src)
    (src / "custom_nodes" / "pack").mkdir(parents=True)
    (src / "custom_nodes" / "pack" / "__init__.py").write_text("")
    (src / "comfy" / "ops.py").write_text("x = 3\n")
    (src / "main.py").unlink()
    assert comfyui_harness.changes(home) == [
        "added ComfyUI/custom_nodes/", "added ComfyUI/custom_nodes/pack/", "added ComfyUI/custom_nodes/pack/__init__.py",
        "changed ComfyUI/comfy/ops.py", "removed ComfyUI/main.py"]
    again = comfyui_harness.shared_comfyui()  # the changed tree is set aside, a fresh one unpacked
    assert again == src and comfyui_harness.changes(home) == []
    assert (src / "comfy" / "ops.py").read_text() == "x = 1\n" and not (src / "custom_nodes").exists()
    assert [p.name for p in cache.iterdir()] == [home.name]
