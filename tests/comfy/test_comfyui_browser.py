"""The node pack in ComfyUI's own front end, as a user meets it: headless Chromium (Debian's package), driven by
playwright, on a ComfyUI 0.29.0 server with the pack installed the README's way.

The front end is ComfyUI's pinned `comfyui-frontend-package` (ComfyUI's requirements.txt; the server's Python gets
it from there, as tests/comfy/test_comfyui_server.py prepares it); the archive holds no front end. The test loads the UI,
finds the pack's nodes in the node library and its templates in the template browser (titles, thumbnails, the
category named as the node library names it), opens the template that needs no file but a diffusion model (a tiny
float Krea 2 saved under the template's own file name), runs it with the Run button and reads Quantize's summary and
Purge's proof on the nodes; then queues a recipe the node refuses and reads the error's first line in ComfyUI's
error panel. The browser reaches nothing but the local server (every other request is aborted).

Slow and marked `comfyui`. Skipped, with one line saying what to install, without Chromium
(`apt-get install chromium`) or playwright (`pip install ".[browser]"`), or when ComfyUI's Python has no front end.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import comfyui_server as cs
from comfyui_harness import require_archive

pytestmark = [pytest.mark.slow, pytest.mark.comfyui]

ENABLE = "apt-get install -y chromium && pip install '.[browser]' (README, Test)"
TEMPLATE = "Try the pack without a text encoder (Krea 2)"  # runs with nothing but the diffusion model
PACK_CATEGORY = "lowbit_pipe"
WAIT_MS = 60_000


def chromium() -> str | None:
    """Debian's Chromium (the distribution's package; playwright downloads no browser here)."""
    return next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)


def missing() -> str | None:
    """One line saying what is missing to run this test, or None."""
    if importlib.util.find_spec("playwright") is None:
        return f"no playwright in this Python: {ENABLE}"
    if chromium() is None:
        return f"no Chromium (chromium on PATH): {ENABLE}"
    return None


@dataclass
class Served:
    server: cs.ComfyUIServer
    url: str


@pytest.fixture(scope="module")
def served(tmp_path_factory, request) -> Served:
    require_archive()
    why = missing()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("comfyui_browser")
    src = request.getfixturevalue("comfyui_src")  # the session's shared tree, read-only (conftest.py)
    # ComfyUI's requirements (its front-end package among them) and lowbit_pipe the README's way: the session's one
    # server Python (conftest.py), which tests/comfy/test_comfyui_server.py's servers run in too
    python = request.getfixturevalue("server_python").python
    if cs.package_version(python, "comfyui-frontend-package") is None:
        pytest.skip("no comfyui-frontend-package in ComfyUI's Python (ComfyUI's requirements.txt pins it)")
    base = root / "base"
    cs.install_pack(base, python)
    _float_krea2(base / "models" / "diffusion_models" / "krea2.safetensors", root)
    server = cs.ComfyUIServer.start(src, base, python=python)
    yield Served(server, f"http://127.0.0.1:{server.port}")
    server.stop()


def _float_krea2(path: Path, work: Path) -> None:
    """A float tiny Krea 2 in ComfyUI's layout, under the name the template's Load Diffusion Model asks for."""
    import lowbit_pipe

    path.parent.mkdir(parents=True, exist_ok=True)
    lowbit_pipe.run("default", ["model=tiny_krea2_comfy", "pipeline=[load,detect,export]", f"export.path={path}"],
                    run_dir=work / "float_krea2")


def _node_text(page, node_type: str) -> str:
    """The text a node of `node_type` shows (the front end's text preview the pack's extension adds)."""
    return page.evaluate("""(type) => {
        const node = window.app.graph._nodes.find(n => n.type === type);
        const w = (node?.widgets || []).find(w => w.name === 'preview_text' || w.name === 'lowbit_text');
        return w ? String(w.value) : '';
    }""", node_type)


def test_a_user_finds_the_pack_runs_a_template_and_reads_the_summary_on_the_node(served):
    from playwright.sync_api import sync_playwright

    start = time.monotonic()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), headless=True,
                                    args=["--no-sandbox", "--disable-background-networking", "--disable-sync",
                                          "--disable-component-update", "--no-first-run"])
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 900})
            context.route("**/*", lambda route: route.continue_() if route.request.url.startswith(served.url)
                          else route.abort())  # the local server only
            page = context.new_page()
            missing_files: list[str] = []  # the pack's template files the front end asked for and did not get
            page.on("response", lambda r: missing_files.append(r.url) if r.status >= 400 and "/workflow_templates/"
                    in r.url else None)
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" and "lowbit" in m.text else None)
            page.goto(served.url + "/", wait_until="domcontentloaded")
            page.wait_for_function("() => window.app && window.app.graph && window.comfyAPI", timeout=WAIT_MS)
            _templates(page, missing_files)
            page.get_by_text(TEMPLATE, exact=True).first.click()  # opens it (and closes the browser)
            page.wait_for_function("() => window.app.graph._nodes.some(n => n.type === 'LowbitQuantize')",
                                   timeout=WAIT_MS)
            _pack_nodes(page)
            _run_template(page)
            _refusal(page)
            assert errors == [], errors
        finally:
            browser.close()
    print(f"browser test: {time.monotonic() - start:.1f} s with the server up")


def _pack_nodes(page) -> None:
    """The node library lists the pack's category; every pack node is registered under it, with the recipe list."""
    from playwright.sync_api import expect

    page.get_by_role("button", name="Node Library (n)").click()
    expect(page.get_by_text(PACK_CATEGORY, exact=True).first).to_be_visible(timeout=WAIT_MS)
    found = page.evaluate("""(category) => Object.entries(window.LiteGraph.registered_node_types)
        .filter(([k, t]) => t.nodeData?.category === category).map(([k]) => k)""", PACK_CATEGORY)
    assert {"LowbitQuantize", "LowbitLoRA", "LowbitExport", "LowbitPurge", "LowbitExampleInputs",
            "LowbitCompile"} <= set(found), found
    page.get_by_role("button", name="Node Library (n)").click()  # closed again


def _templates(page, missing_files: list[str]) -> None:
    """The template browser has the pack's category (named as in the node library), its titles and thumbnails."""
    from playwright.sync_api import expect

    page.wait_for_timeout(2000)  # a first visit opens the template browser by itself
    category = page.get_by_text(PACK_CATEGORY, exact=True)
    if not category.first.is_visible():
        page.get_by_role("button", name="Templates", exact=True).click()
    category.first.click(timeout=WAIT_MS)
    for title in ("Quantize, LoRA, sample, Purge (Krea 2)", "Export a quantized file (Krea 2)",
                  "Calibrated SVDQuant on your prompt (Krea 2)", TEMPLATE):
        expect(page.get_by_text(title, exact=True).first).to_be_visible(timeout=WAIT_MS)
    # The cards show each thumbnail as a blob: URL of the file fetched from the pack (404s are recorded).
    page.wait_for_function("""() => Array.from(document.querySelectorAll('img'))
        .filter(i => i.complete && i.naturalWidth === 512 && i.naturalHeight === 384).length >= 3""", timeout=WAIT_MS)
    assert missing_files == [], missing_files


def _run_template(page) -> None:
    """The runnable template's inputs as the UI has them; run it, read the texts on the nodes."""
    widgets = page.evaluate("""() => Object.fromEntries(window.app.graph._nodes.filter(n => n.type.startsWith('Lowbit'))
        .map(n => [n.type, (n.widgets || []).map(w => [w.name, w.value, w.options?.values || null])]))""")
    seed_control = [w for w in widgets["LowbitExampleInputs"] if w[1] in ("fixed", "randomize", "increment")]
    assert [w[1] for w in seed_control] == ["fixed"], widgets["LowbitExampleInputs"]  # the seeded inputs stay put
    recipes = next(w[2] for w in widgets["LowbitQuantize"] if w[0] == "recipe")
    assert recipes[0] == "auto" and "krea2_nvfp4" in recipes and not any(r.endswith("_tiny") for r in recipes)
    page.get_by_role("button", name="Run", exact=True).first.click()
    page.wait_for_function("""() => window.app.graph._nodes.some(n => n.type === 'LowbitPurge' &&
        (n.widgets || []).some(w => String(w.value).includes('"proven": true')))""", timeout=WAIT_MS * 3)
    summary = _node_text(page, "LowbitQuantize")
    assert summary.startswith("lowbit_pipe run: ok") and "recipe=krea2_nvfp4_stock" in summary, summary
    assert '"retained_bytes": 0' in _node_text(page, "LowbitPurge")


def _refusal(page) -> None:
    """A recipe the node refuses: ComfyUI's error panel ("View details") shows the one-line cause first."""
    from playwright.sync_api import expect

    page.evaluate("""() => { const q = window.app.graph._nodes.find(n => n.type === 'LowbitQuantize');
        q.widgets.find(w => w.name === 'recipe_text').value = '/etc/passwd'; }""")
    page.get_by_role("button", name="Run", exact=True).first.click()
    page.get_by_text("View details").first.click(timeout=WAIT_MS)
    cause = "recipe: '/etc/passwd' is not 'auto', a packaged recipe, a .yaml file in models/lowbit_recipes/, or YAML text"
    expect(page.get_by_text(cause).first).to_be_visible(timeout=WAIT_MS)
    assert _node_text(page, "LowbitQuantize") == ""  # no stale summary on the node that failed
