"""The speed table: one file per (device, torch, triton, lowbit_pipe) key, entries keyed by candidate, shape, dtype
and path; reused across runs, rebuilt by quantize.speed_refresh, written atomically; a broken file is refused
naming quantize.speed_cache. Every test points the cache at tmp_path (never the user's ~/.cache)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from lowbit_pipe.errors import RecipeError
from lowbit_pipe.formats import FormatSpec
from lowbit_pipe.measure.timing import TimingSettings, time_ms
from lowbit_pipe.plan import speed_table as st
from lowbit_pipe.plan.candidates import Candidate, spec_label

CPU = torch.device("cpu")
FAST = TimingSettings(warmup=1, reps=2)


def _needed(compiled: bool = False):
    cands = [Candidate(None), Candidate(FormatSpec("int8")), Candidate(FormatSpec("int8", rotation="convrot"))]
    return [(c, st.Entry(c.label, 16, 64, 32, "float32", compiled)) for c in cands]


def test_labels_separate_rotations_and_float():
    assert [c.label for c, _ in _needed()] == ["float", "int8", "int8+convrot"]
    assert spec_label(FormatSpec("nvfp4", rotation="convrot", rotation_group=256)) == "nvfp4+convrot/256"


def test_cache_key_names_device_and_versions_and_reuses_entries(tmp_path):
    key = st.table_key(CPU)
    assert key.torch == torch.__version__ and key.device.startswith("cpu")
    table = st.ensure(st.load(tmp_path, key), _needed(), CPU, torch.float32, timing=FAST)
    assert table.measured == 3 and table.path == tmp_path / f"speed_{key.digest()}.json"
    saved = json.loads(table.path.read_text())
    assert saved["key"]["device"] == key.device and set(saved["times_ms"]) == {e.key() for _, e in _needed()}
    again = st.ensure(st.load(tmp_path, key), _needed(), CPU, torch.float32, timing=FAST)
    assert again.measured == 0 and again.times_ms == table.times_ms  # read back, nothing timed
    # Another software version (or device) is another file: old times are never reused for it.
    other = replace(key, torch="0.0-other")
    assert other.digest() != key.digest() and st.load(tmp_path, other).times_ms == {}
    # A file whose key differs from its name's (copied by hand) is not trusted either.
    table.path.with_name(f"speed_{other.digest()}.json").write_text(table.path.read_text())
    assert st.load(tmp_path, other).times_ms == {}
    # Shape, dtype and the compiled path are parts of an entry's key.
    e = _needed()[1][1]
    assert len({e.key(), replace(e, rows=17).key(), replace(e, dtype="bfloat16").key(),
                replace(e, compiled=True).key(), replace(e, prepack=True).key()}) == 5


def test_refresh_rebuilds_and_a_broken_file_names_the_key(tmp_path):
    key = st.table_key(CPU)
    table = st.ensure(st.load(tmp_path, key), _needed(), CPU, torch.float32, timing=FAST)
    table.times_ms[_needed()[0][1].key()] = 1e9  # a stale figure
    st.save(table)
    fresh = st.ensure(st.load(tmp_path, key, refresh=True), _needed(), CPU, torch.float32, timing=FAST)
    assert fresh.measured == 3 and fresh.get(_needed()[0][1]) < 1e6
    assert not list(tmp_path.glob("*.tmp"))  # the atomic write left no temp file
    table.path.write_text("{not json")
    with pytest.raises(RecipeError, match=r"quantize.speed_cache.*speed_.*\.json"):
        st.load(tmp_path, key)


def test_cpu_timing_is_the_fastest_call_and_restores_threads():
    threads = torch.get_num_threads()
    calls = []
    ms = time_ms(lambda: calls.append(torch.get_num_threads()), CPU, TimingSettings(warmup=1, reps=3))
    assert ms >= 0 and len(calls) == 4 and calls[1:] == [1, 1, 1] and torch.get_num_threads() == threads


@pytest.mark.slow
def test_compiled_entry_times_the_compiled_layer(tmp_path):
    needed = _needed(compiled=True)[:2]
    table = st.ensure(st.load(tmp_path, st.table_key(CPU)), needed, CPU, torch.float32, timing=FAST,
                      compile_backend="aot_eager")
    assert all(table.get(e) > 0 for _, e in needed) and all("|compiled" in k for k in table.times_ms)


def test_refresh_flag_is_the_recipe_key(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "lowbit_pipe", "--refresh", "--cfg", "job"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "speed_refresh: true" in proc.stdout
