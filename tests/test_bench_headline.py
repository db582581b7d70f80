"""bench/headline.py's byte count: what its weight-GB column reports for each variant."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_model_bytes_counts_wrapper_subclasses_by_their_inner_tensors():
    """torchao's quantized weights are wrapper subclasses whose nominal dtype is the float one: counted by numel x
    element_size they look unquantized. TwoTensor (torch's own test subclass, two inner tensors) shows the rule."""
    from headline import model_bytes
    from torch.testing._internal.two_tensor import TwoTensor

    layer = nn.Linear(8, 4, bias=True)
    plain = model_bytes(layer)
    assert plain == (4 * 8 + 4) * 4
    inner = torch.zeros(4, 8, dtype=torch.float16)
    layer.weight = nn.Parameter(TwoTensor(inner, inner.clone()), requires_grad=False)
    assert layer.weight.element_size() == 2  # nominal: one fp16 tensor's worth
    assert model_bytes(layer) == 2 * (4 * 8 * 2) + 4 * 4  # both inner tensors, and the fp32 bias


def test_pipeline_steps_smoke_run_times_whole_images_and_tears_down(tmp_path):
    """bench/pipeline_steps.py on tiny parts: whole images through diffusers' Krea2Pipeline (its empty negative
    prompt included), the bf16 rows always, each row's image finite and close to bf16's."""
    import json

    from pipeline_steps import main

    out = tmp_path / "steps.json"
    assert main(["--device", "cpu", "--small", "--steps", "2", "--iters", "1", "--only", "fp8, no compile",
                 "fp8 + fp8 attention, no compile", "--out", str(out)]) == 0
    rows = {r["label"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"bf16, eager", "bf16, compile stage (regional)", "fp8, no compile",
                         "fp8 + fp8 attention, no compile"}
    assert rows["bf16, eager"]["rel_err"] == 0 and all(r["s"] > 0 for r in rows.values())
    for label in ("fp8, no compile", "fp8 + fp8 attention, no compile"):
        assert 0 < rows[label]["rel_err"] < 0.1, rows[label]  # finite: a NaN image fails here
    assert "| fp8, no compile |" in out.with_suffix(".md").read_text()
