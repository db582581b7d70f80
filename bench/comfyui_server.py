"""A real ComfyUI, run as a server, for the tests and benches that check the node pack from outside.

    server = ComfyUIServer.start(comfyui_dir, base_dir)      # `python main.py --listen 127.0.0.1 ...`
    entry = server.run({"1": {"class_type": "UNETLoader", ...}, ...})   # POST /prompt, wait on /history
    latent = server.latent(entry, "9")                       # what a SaveLatent node wrote
    server.stop()

`unpack(archive, dest)` unpacks a ComfyUI source archive (the test fixture is ComfyUI 0.29.0's source,
../shared/comfyui-0.29.0.tar.xz or where LOWBIT_COMFYUI_ARCHIVE points: `find_archive`); `install_pack(python, base_dir)` installs the node pack the way the
README tells a user to (`python -m lowbit_pipe.comfy install`).

Run as a script, this file is the server's launcher: `python bench/comfyui_server.py COMFYUI_DIR [main.py
arguments]` runs ComfyUI's main.py after one preparation a CPU machine needs: torchvision and torchaudio
are replaced by empty stand-in packages when they cannot be imported (their registry wheels are CUDA
builds that fail beside a CPU torch; ComfyUI imports them at module level, the diffusion-model path never
calls them). Everything else is ComfyUI as it is. ComfyUI is GPL-3: it is run from its own folder, none of
its code is copied here.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import runpy
import socket
import subprocess
import sys
import tarfile
import time
import types
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


ARCHIVE_NAME = "comfyui-0.29.0.tar.xz"
ARCHIVE_ENV = "LOWBIT_COMFYUI_ARCHIVE"
# Where to get it: the pinned release's source, as ComfyUI publishes it (a .tar.gz does as well as a .tar.xz;
# the archive's top folder may have any name: unpack finds the folder holding main.py).
RELEASE = ("ComfyUI 0.29.0's source release tarball (tag v0.29.0, upstream commit 4f874c5: "
           "https://github.com/comfyanonymous/ComfyUI/archive/refs/tags/v0.29.0.tar.gz)")


def archive_candidates(name: str = ARCHIVE_NAME) -> list[Path]:
    """Where the ComfyUI source archive is looked for. LOWBIT_COMFYUI_ARCHIVE, when set, is the one place (a wrong
    path is then reported, not replaced by another copy); otherwise, in order: a `shared/` folder beside the
    checkout (where CI keeps it), beside the main checkout (for a git worktree elsewhere), inside it."""
    env = os.environ.get(ARCHIVE_ENV)
    if env:
        return [Path(env).expanduser()]
    out = [ROOT.parent / "shared" / name]
    proc = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--path-format=absolute", "--git-common-dir"],
                          capture_output=True, text=True)
    if proc.returncode == 0:
        out.append(Path(proc.stdout.strip()).parent.parent / "shared" / name)
    out.append(ROOT / "shared" / name)
    return list(dict.fromkeys(out))


def how_to_enable(name: str = ARCHIVE_NAME) -> str:
    """One line: where the archive was looked for and how to provide it."""
    env = os.environ.get(ARCHIVE_ENV)
    looked = f"{ARCHIVE_ENV}={env} names no file" if env else \
        f"none at {', '.join(str(p) for p in archive_candidates(name))}"
    return (f"no ComfyUI source archive ({looked}): to run the real-ComfyUI tests, download {RELEASE} and set "
            f"{ARCHIVE_ENV}=/path/to/that/file, or put it at {ROOT.parent / 'shared' / name}")


def find_archive(name: str = ARCHIVE_NAME) -> Path:
    """The ComfyUI source archive; FileNotFoundError saying where it was looked for and how to provide it."""
    for path in archive_candidates(name):
        if path.is_file():
            return path
    raise FileNotFoundError(how_to_enable(name))


# The archive as found, or (when there is none) the first place looked at: callers check is_file() to skip.
_CANDIDATES = archive_candidates()  # one git call at import, not two
ARCHIVE = next((p for p in _CANDIDATES if p.is_file()), _CANDIDATES[0])


# ============================================================================ torchvision / torchaudio stand-ins
class _Placeholder:
    """What an attribute of a stand-in package is: any use of it says it is a stand-in."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *a: Any, **k: Any) -> Any:
        raise RuntimeError(f"{self._name} is a stand-in (no wheel of it fits this torch on this machine)")

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self._name}.{item}")

    def __or__(self, other: Any) -> Any:  # in annotations evaluated at import: `Image.Image | None`
        return self

    __ror__ = __or__


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty packages for one top-level name (and its submodules) whose attributes are placeholders."""

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


def stub_missing(roots: tuple[str, ...] = ("torchvision", "torchaudio"), always: tuple[str, ...] = ()) -> list[str]:
    """Stand-ins for the packages of `roots` that do not import here, and for those of `always` in any case (a GPU
    machine with no network lacks PyAV's 35 MB wheel, which only video nodes use); returns the names stubbed."""
    stubbed = []
    for root in (*roots, *always):
        if root not in always:
            try:
                __import__(root)
                continue
            except Exception:  # noqa: BLE001 - a broken install (ImportError, OSError, RuntimeError) counts as missing
                pass
        for name in [n for n in sys.modules if n == root or n.startswith(root + ".")]:
            del sys.modules[name]
        sys.meta_path.insert(0, StubFinder(root))
        stubbed.append(root)
    return stubbed


# ============================================================================ fixture
def unpack(archive: Path, dest: Path) -> Path:
    """Unpack a ComfyUI source archive into `dest`; returns the ComfyUI folder (the one with main.py)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    found = [p.parent for p in dest.glob("*/main.py")] + ([dest] if (dest / "main.py").is_file() else [])
    if not found:
        raise FileNotFoundError(f"{archive}: no ComfyUI folder (main.py) in it")
    return found[0]


# ComfyUI's requirements.txt lists its essential packages first, then "#non essential dependencies:".
_NON_ESSENTIAL = "#non essential"
_TORCH_FAMILY = ("torch", "torchvision", "torchaudio")


def comfyui_requirements(comfyui: Path) -> list[str]:
    """ComfyUI's essential requirements as it pins them, without the torch family (this machine's torch stays)."""
    out = []
    for line in (comfyui / "requirements.txt").read_text().splitlines():
        line = line.strip()
        if line.lower().startswith(_NON_ESSENTIAL):
            break
        name = line.split("=")[0].split(">")[0].split("<")[0].split("~")[0].strip().lower()
        if line and not line.startswith("#") and name not in _TORCH_FAMILY:
            out.append(line)
    return out


def prepare_python(comfyui: Path, venv: Path) -> str:
    """A Python for the server as a ComfyUI user has it: a venv over this one (--system-site-packages: torch and
    what is installed here) with ComfyUI's own requirements installed as ComfyUI pins them (its comfy-kitchen pin
    included), torch held at this machine's version. Reused when it exists with the same requirements.
    Returns its python."""
    import hashlib

    import torch

    python = venv / "bin" / "python"
    wanted = comfyui_requirements(comfyui)
    stamp = hashlib.sha256("\n".join(wanted).encode()).hexdigest()[:16]
    ready = venv / ".lowbit-ready"
    if python.exists() and ready.exists() and ready.read_text() == stamp:
        return str(python)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    constraints = venv / "constraints.txt"
    constraints.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c",
                           str(constraints), *wanted], capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"installing ComfyUI's requirements into {venv} failed:\n{proc.stdout}{proc.stderr}")
    ready.write_text(stamp)
    return str(python)


def install_lowbit(python: str, extra: str = "comfy") -> str:
    """`pip install "lowbit_pipe[comfy]"` of this checkout into `python`'s environment (what the README tells a
    ComfyUI user to run); returns pip's output."""
    import torch

    constraints = Path(python).parent.parent / "constraints.txt"
    constraints.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
    proc = subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-build-isolation",
                           "-c", str(constraints), f"{ROOT}[{extra}]"], capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"pip install of lowbit_pipe[{extra}] failed:\n{proc.stdout}{proc.stderr}")
    return proc.stdout + proc.stderr


def package_version(python: str, name: str) -> str | None:
    proc = subprocess.run([python, "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
                          capture_output=True, text=True, timeout=120)
    return proc.stdout.strip() if proc.returncode == 0 else None


def install_pack(base_dir: Path, python: str = sys.executable) -> str:
    """`python -m lowbit_pipe.comfy install --base-directory BASE`: the README's command; returns its output."""
    base_dir.mkdir(parents=True, exist_ok=True)  # the folder a user starts ComfyUI with exists
    proc = subprocess.run([python, "-m", "lowbit_pipe.comfy", "install", "--base-directory", str(base_dir)],
                          capture_output=True, text=True, env=_env(), timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"the node pack's install failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
    return proc.stdout


def _env() -> dict[str, str]:
    # This checkout's lowbit_pipe first, whatever is installed.
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ============================================================================ the server
class PromptError(RuntimeError):
    """A queued workflow that ComfyUI refused or whose execution failed; the message is ComfyUI's."""

    def __init__(self, message: str, detail: dict[str, Any]):
        super().__init__(message)
        self.detail = detail


@dataclass
class ComfyUIServer:
    comfyui: Path
    base: Path
    port: int
    process: subprocess.Popen
    log_path: Path
    python: str = sys.executable
    queued: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, comfyui: Path, base: Path, *, python: str = sys.executable, args: tuple[str, ...] = ("--cpu",),
              timeout: float = 300.0, stand_ins: tuple[str, ...] = ()) -> ComfyUIServer:
        """Start `main.py --listen 127.0.0.1 --port P --base-directory BASE ARGS` and wait until it answers;
        `stand_ins`: packages replaced by empty stand-ins (see `stub_missing`)."""
        return cls.launch(comfyui, base, python=python, args=args, stand_ins=stand_ins).wait_ready(timeout)

    @classmethod
    def launch(cls, comfyui: Path, base: Path, *, python: str = sys.executable, args: tuple[str, ...] = ("--cpu",),
               stand_ins: tuple[str, ...] = ()) -> ComfyUIServer:
        """`start` without the wait: the server process is started and loads while the caller does other work;
        `wait_ready` before its first request."""
        base.mkdir(parents=True, exist_ok=True)
        (base / "custom_nodes").mkdir(exist_ok=True)
        port = free_port()
        log_path = base / f"server-{port}.log"
        cmd = [python, str(Path(__file__).resolve()), str(comfyui), *[a for p in stand_ins for a in ("--stand-in", p)],
               "--listen", "127.0.0.1", "--port", str(port),
               "--base-directory", str(base), *args]
        log = open(log_path, "w")  # noqa: SIM115 - the child writes to it for its whole life
        proc = subprocess.Popen(cmd, cwd=str(comfyui), stdout=log, stderr=subprocess.STDOUT, env=_env())
        log.close()
        return cls(comfyui, base, port, proc, log_path, python)

    def wait_ready(self, timeout: float = 300.0) -> ComfyUIServer:
        """Wait until the server answers (this server); stopped, with its log's tail in the error, if it exits or
        does not answer within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited ({self.process.returncode}) before it answered; log tail:\n"
                                   f"{self.log(60)}")
            try:
                self.get("/system_stats", timeout=2)
                return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"ComfyUI did not answer within {timeout:.0f} s; log tail:\n{self.log(60)}")

    def log(self, lines: int | None = None) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text if lines is None else "\n".join(text.splitlines()[-lines:])

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
        return self.process.returncode

    # ---- HTTP
    def get(self, path: str, timeout: float = 30) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=timeout) as r:
            return json.loads(r.read() or b"null")

    def post(self, path: str, data: dict[str, Any], timeout: float = 60) -> Any:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(data).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                body = r.read()
        except urllib.error.HTTPError as err:  # ComfyUI answers a refused prompt with 400 and a JSON reason
            body = err.read()
            try:
                detail = json.loads(body)
            except ValueError:
                detail = {"body": body.decode(errors="replace")}
            raise PromptError(f"POST {path}: HTTP {err.code}: {_refusal(detail)}", detail) from None
        return json.loads(body) if body else None

    def object_info(self, node: str | None = None) -> dict[str, Any]:
        return self.get(f"/object_info/{node}" if node else "/object_info")

    def free(self, *, unload_models: bool = True, free_memory: bool = True) -> None:
        """ComfyUI's own "free model and node cache" (POST /free); takes effect before the next prompt runs."""
        self.post("/free", {"unload_models": unload_models, "free_memory": free_memory})

    # ---- workflows
    def submit(self, graph: dict[str, Any]) -> str:
        prompt_id = self.post("/prompt", {"prompt": graph})["prompt_id"]
        self.queued.append(prompt_id)
        return prompt_id

    def wait(self, prompt_id: str, timeout: float = 600.0, poll: float = 0.02) -> dict[str, Any]:
        """The /history entry of a finished prompt; PromptError when its execution failed. `poll`: seconds between
        two asks (a tiny model's prompt takes ~0.1 s: a coarse poll was most of a soak cycle's time)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None:
                if entry["status"].get("status_str") == "error":
                    raise PromptError(f"prompt {prompt_id} failed: {execution_error(entry)}", entry)
                return entry
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited ({self.process.returncode}); log tail:\n{self.log(60)}")
            time.sleep(poll)
        raise TimeoutError(f"prompt {prompt_id} did not finish within {timeout:.0f} s; log tail:\n{self.log(40)}")

    def run(self, graph: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        return self.wait(self.submit(graph), timeout)

    def latent(self, entry: dict[str, Any], node: str) -> Any:
        """The latent tensor a SaveLatent node of this prompt wrote (its file under the output folder)."""
        from safetensors.torch import load_file

        files = entry["outputs"][node]["latents"]
        f = files[0]
        path = self.base / "output" / f.get("subfolder", "") / f["filename"]
        return load_file(str(path))["latent_tensor"]

    def texts(self, entry: dict[str, Any], node: str) -> list[str]:
        """The text an output node showed in the UI (its `ui.text`)."""
        return list(entry["outputs"].get(node, {}).get("text", []))


def execution_error(entry: dict[str, Any]) -> str:
    for kind, data in entry.get("status", {}).get("messages", []):
        if kind == "execution_error":
            return f"{data.get('node_type')} (node {data.get('node_id')}): {data.get('exception_type')}: " \
                   f"{data.get('exception_message', '').strip()}"
    return "no execution_error message in the history entry"


def _refusal(detail: dict[str, Any]) -> str:
    err = detail.get("error") or {}
    parts = [str(err.get("message", "")), str(err.get("details", ""))]
    for node, info in (detail.get("node_errors") or {}).items():
        for e in info.get("errors", []):
            parts.append(f"node {node} ({info.get('class_type')}): {e.get('message')}: {e.get('details')}")
    return "; ".join(p for p in parts if p)


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python bench/comfyui_server.py COMFYUI_DIR [--stand-in PKG ...] [main.py arguments]")
    comfyui = Path(argv[0]).resolve()
    argv = list(argv)
    always = []
    while len(argv) > 2 and argv[1] == "--stand-in":
        always.append(argv[2])
        del argv[1:3]
    sys.argv = [str(comfyui / "main.py"), *argv[1:]]
    sys.path.insert(0, str(comfyui))
    # ComfyUI writes comfyui_detail.log into its working directory: the base directory when one is given (the
    # ComfyUI folder stays as it was: the tests share one read-only tree), else ComfyUI's own folder.
    base = argv[argv.index("--base-directory") + 1] if "--base-directory" in argv[:-1] else None
    os.chdir(Path(base).resolve() if base else comfyui)
    # ComfyUI picks its CUDA allocator (PYTORCH_CUDA_ALLOC_CONF) from its arguments before torch is first imported,
    # as main.py does; the imports below load torch.
    import comfy.options

    comfy.options.enable_args_parsing()
    import cuda_malloc  # noqa: F401

    # diffusers and transformers note which optional packages exist at their first import (and read their
    # versions): they must see this machine as it is, not the stand-ins, which have no version to read.
    import diffusers.utils.import_utils  # noqa: F401
    import transformers.utils.import_utils  # noqa: F401

    stub_missing(always=tuple(always))
    runpy.run_path(str(comfyui / "main.py"), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
