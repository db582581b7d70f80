"""The format contract: one suite that every registered format runs, as diffusers' quantization mixins run one per
backend. The cases come from the registry (`lowbit_pipe.formats.FORMATS`): each format with every rotation it can
store, the weight granularities and activation modes that change what it stores, its per-tensor activation
statistic where it has one, and a shape that needs padding where the format pads. Every case keeps five promises:

1. quantize -> dequantize stays within the format's documented error (tests/formats/test_formats.py's bound), and equals an
   independent oracle where one exists: comfy-kitchen's eager quantizer on the weight rotated by this file's own
   Hadamard matrices; the documented grid's half step where comfy-kitchen has no quantizer (awq_w4a16, svdquant_w4a4);
2. `linear(x, q, bias)` equals `x @ dequantize(q).T + bias` within the bound its activation quantization allows,
   derived here from the documented grids (weight-only: to fp32 rounding), and returns x's dtype;
3. a model holding the layer exports through `lowbit_pipe.export` to a .safetensors file whose `.comfy_quant` record
   names the format, and the loader (`stages.load.install_state_dict`, what every file load ends in) rebuilds a layer
   whose tensors and forward are bit-identical;
4. `lowbit_pipe.teardown` of the ledger `lowbit_pipe.quantize` wrote puts the original nn.Linear back, unchanged,
   and frees the quantized layer and its tensors (weakrefs dead);
5. a stored tensor of the wrong shape or dtype in the file is refused, naming the file and the key.

A new format is run by every test here as soon as it registers, and fails until this file knows its oracle and its
activation quantizer (ACT_QUANT, the padding table).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F

import lowbit_pipe
from lowbit_pipe.errors import CheckpointError
from lowbit_pipe.files.checkpoint import load_tensors
from lowbit_pipe.formats import FORMATS, FormatSpec, QuantizedWeight, decode_record, format_for_record, get_format
from lowbit_pipe.formats.base import GRANULARITIES
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.quant.nn import QuantLinear
from lowbit_pipe.stages.load import check_file_tensors, install_state_dict

SHAPE = (64, 256)  # fits every block and group (16, 32, 64), every rotation group (128, 256)
# Formats that pad a shape their blocks do not divide (recording the logical shape) and a shape that needs it.
PADDED = {"nvfp4": (40, 200)}
HAS_CK = importlib.util.find_spec("comfy_kitchen") is not None
# How each format quantizes its input (the documented grids, docs/formats.md "Activations"): (kind, qmax).
# None: weight-only whatever the recipe says.
ACT_QUANT = {
    "int8": ("int", 127), "w4a8": ("int", 127), "w6a8": ("int", 127), "convrot_w4a4": ("int", 7),
    "fp8": ("e4m3", 448), "mxfp8": ("mx", 448), "nvfp4": ("nv", 6 * 448), "svdquant_w4a4": ("group64", 7),
    "awq_w4a16": None,
}


@dataclass(frozen=True)
class Case:
    spec: FormatSpec
    shape: tuple[int, int] = SHAPE

    @property
    def id(self) -> str:
        s = self.spec
        parts = [s.format, s.rotation, s.granularity, None if s.activations == "dynamic" else s.activations,
                 s.act_granularity and f"act_{s.act_granularity}", self.shape != SHAPE and "x".join(map(str, self.shape))]
        return "-".join(p for p in parts if p)

    @property
    def fmt(self):
        return get_format(self.spec.format)

    @property
    def weight_only(self) -> bool:
        return self.spec.activations == "none" or ACT_QUANT.get(self.spec.format, "?") is None


def _accepts(spec: FormatSpec) -> bool:
    try:
        get_format(spec.format).check_spec(spec)
    except ValueError:
        return False
    return True


def _stored_form(spec: FormatSpec) -> tuple:
    """What a spec stores: the record and the tensors' names, shapes and dtypes (of a small weight)."""
    q = get_format(spec.format).quantize(torch.linspace(-1, 1, 32 * SHAPE[1]).reshape(32, SHAPE[1]), spec)
    return json.dumps(q.record), tuple((k, tuple(t.shape), t.dtype) for k, t in q.tensors.items())


def _cases_of(name: str) -> list[Case]:
    fmt = FORMATS[name]
    rotations: dict[tuple[str, int], str] = {}  # what is stored -> the first rotation name that stores it
    for rot in fmt.rotations:
        rotations.setdefault(fmt.input_rotation(FormatSpec(name, rotation=rot), SHAPE[1]), rot)
    base = FormatSpec(name, rotation=next(iter(rotations.values())))
    specs = [replace(base, rotation=r) for r in rotations.values()]
    specs += [replace(base, granularity=g) for g in GRANULARITIES
              if _accepts(replace(base, granularity=g)) and _stored_form(replace(base, granularity=g)) != _stored_form(base)]
    specs += [replace(base, activations=m) for m in ("static", "none") if _accepts(replace(base, activations=m))]
    specs += [replace(base, act_granularity=a) for a in fmt.act_granularities if a != "token"]
    cases = [Case(s) for s in specs]
    if name in PADDED:
        cases.append(Case(base, PADDED[name]))
    return cases


# What the exports and the one-layer calibration say about these files and runs is not under test here.
pytestmark = [pytest.mark.filterwarnings("ignore:.*stock ComfyUI:UserWarning"),
              pytest.mark.filterwarnings("ignore:calibration. too little held-out data:UserWarning")]
CASES = [c for name in sorted(FORMATS) for c in _cases_of(name)]
IDS = [c.id for c in CASES]
# Teardown and file errors run on the pipeline's shapes only (it never writes a padded layer: shape_problem).
PIPELINE_CASES = [c for c in CASES if c.shape == SHAPE]


def test_every_format_is_in_the_contract():
    """The registry drives the cases; a format without an activation entry here fails loudly, naming itself."""
    assert {c.spec.format for c in CASES} == set(FORMATS)
    assert set(ACT_QUANT) == set(FORMATS), f"add {sorted(set(FORMATS) - set(ACT_QUANT))} to ACT_QUANT"
    # the matrix is what the brief asks: every stored rotation, int8 / fp8's other granularity, nvfp4's padding
    ids = set(IDS)
    assert {"int8-none", "int8-convrot", "int8-quarot", "int8-hadanorm", "int8-none-tensor", "fp8-none-row",
            "nvfp4-none-act_tensor", "nvfp4-none-40x200", "w6a8-convrot", "int8-none-static", "awq_w4a16-none-none"} <= ids
    assert "w4a8-none" not in ids  # w4a8 stores ConvRot whatever the spec says: one case, not two


# ------------------------------------------------------------------ data


def _weight(shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def _bias(n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(7)) * 0.1


def _input(k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """3 x 5 tokens whose sizes span three decades: a statistic taken over the wrong tokens shows as a loud error
    on the quiet ones."""
    x = torch.randn(3, 5, k, generator=torch.Generator().manual_seed(1))
    return (x * torch.logspace(-2, 1, 15).reshape(3, 5, 1)).to(dtype)


def _hadamard(kind: str, n: int) -> torch.Tensor:
    """This file's own rotation matrices, built as docs/formats.md "Rotations" says, in fp32: convrot = Kronecker
    powers of R4, quarot / hadanorm = Sylvester's, then divided by sqrt(n)."""
    h = torch.ones(1, 1)
    r4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float32)
    while h.shape[0] < n:
        h = torch.kron(h, r4) if kind == "convrot" else torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    assert h.shape[0] == n
    return h / n ** 0.5


def _stored_rotation(case: Case) -> tuple[str, int]:
    return case.fmt.input_rotation(case.spec, case.shape[1])


def _to_basis(t: torch.Tensor, kind: str, group: int, centre: bool = False) -> torch.Tensor:
    """t (rows x K) in the layer's quantized basis, in t's dtype: t . H^T per group (the documented grouped product;
    H is symmetric, so activations' t . H is the same); `centre`: hadanorm's per-group mean removed first
    (activations). fp32 for a weight, as the formats rotate it: a value on a rounding tie must round alike."""
    if kind == "none":
        return t
    g = t.reshape(*t.shape[:-1], -1, group)
    if centre and kind == "hadanorm":
        g = g - g.mean(-1, keepdim=True)
    return (g @ _hadamard(kind, group).to(t.dtype).t()).reshape(t.shape)


def _from_basis(t: torch.Tensor, kind: str, group: int) -> torch.Tensor:
    return _to_basis(t, kind, group)  # H is symmetric and orthogonal: its own inverse


def _static_amax(case: Case) -> float:
    kind, group = _stored_rotation(case)
    return float(_to_basis(_input(case.shape[1]).double(), kind, group, centre=True).abs().max())


@functools.lru_cache(maxsize=None)
def _quantized(case: Case) -> QuantizedWeight:
    fmt, spec = case.fmt, case.spec
    amax = _static_amax(case) if spec.activations == "static" else None
    return fmt.with_activations(fmt.quantize(_weight(case.shape), spec), spec.activations, amax)


# ------------------------------------------------------------------ 1. quantize -> dequantize


def _documented_bound(name: str) -> float:
    """The relative Frobenius error tests/formats/test_formats.py documents for the format (its loosest case)."""
    from test_formats import CASES as DOCUMENTED

    bounds = [b for n, _, b in DOCUMENTED if n == name]
    assert bounds, f"tests/formats/test_formats.py documents no error bound for {name}"
    return max(bounds)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_dequantize_within_the_documented_bound(case):
    w = _weight(case.shape)
    q = _quantized(case)
    assert q.format == case.spec.format and q.shape == case.shape
    dq = case.fmt.dequantize(q)
    assert dq.dtype == torch.float32 and dq.shape == case.shape and torch.isfinite(dq).all()
    err = float((dq - w).norm() / w.norm())
    assert 0 < err < _documented_bound(case.spec.format), f"{case.id}: relative error {err:.4f}"
    grid = GRID_BOUNDS.get(case.spec.format)
    if grid is not None:  # no comfy-kitchen quantizer: the documented grid's half step, element by element
        excess = (dq - w).abs() - grid(w, q)
        assert excess.max() <= 0, f"{case.id}: an element off its grid by {float(excess.max()):.3g} beyond the bound"


def _awq_half_step(w: torch.Tensor, q: QuantizedWeight) -> torch.Tensor:
    """awq_w4a16: per (row, group of 64) the grid spans [min(w, 0), max(w, 0)] in 15 steps; the scale and zero are
    rounded to bf16 and the value computed in bf16 (docs/formats.md)."""
    g = w.reshape(w.shape[0], -1, 64)
    lo, hi = g.clamp(max=0).amin(-1, keepdim=True), g.clamp(min=0).amax(-1, keepdim=True)
    step = (hi - lo) / 15
    bound = step / 2 * (1 + 2 ** -7) + 2 ** -8 * torch.maximum(lo.abs(), hi.abs()) * 2
    return bound.expand_as(g).reshape(w.shape)


def _svdquant_half_step(w: torch.Tensor, q: QuantizedWeight) -> torch.Tensor:
    """svdquant_w4a4 (no calibration, smoothing 1): W minus the stored low-rank branch, rounded to int4 per (row,
    group of 64) with scale bf16(absmax / 7). The branch itself must be the rank-R truncated SVD's, to bf16: checked
    against torch.linalg.svd here."""
    up, down = q.tensors["weight_proj_up"].double(), q.tensors["weight_proj_down"].double()
    branch = up @ down.t()
    rank = up.shape[1]
    u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
    best = (u[:, :rank] * s[:rank]) @ vh[:rank]
    assert float((branch - best).norm()) <= 2 ** -7 * float(best.norm()), "the branch is not the truncated SVD"
    assert torch.equal(q.tensors["weight_smooth_factor"].float(), torch.ones(w.shape[1]))
    resid = (w.double() - branch).reshape(w.shape[0], -1, 64)
    step = resid.abs().amax(-1, keepdim=True) / 7
    return (step / 2 * (1 + 2 ** -6) + 1e-7).expand_as(resid).reshape(w.shape).float()


GRID_BOUNDS = {"awq_w4a16": _awq_half_step, "svdquant_w4a4": _svdquant_half_step}


def _ck_rotated_basis(case: Case, w_rot: torch.Tensor) -> torch.Tensor | None:
    """comfy-kitchen's dequantized weight for a weight already in the stored (rotated) basis, or None where its
    quantizer rotates itself (convrot_w4a4, asym) or it has none."""
    from test_formats_oracle import ck_quantize

    name, gran = case.spec.format, case.spec.granularity
    if name == "int8":
        return ck_quantize("TensorWiseINT8Layout", w_rot, **({} if gran == "tensor" else {"per_channel": True}))[1]
    if name == "fp8" and gran == "row":  # a scale per row: comfy-kitchen's per-tensor quantizer, row by row
        return torch.cat([ck_quantize("TensorCoreFP8Layout", row[None])[1] for row in w_rot])
    if name == "fp8":
        return ck_quantize("TensorCoreFP8Layout", w_rot)[1]
    if name == "nvfp4":
        return ck_quantize("TensorCoreNVFP4Layout", w_rot)[1][: case.shape[0], : case.shape[1]]
    if name == "mxfp8":
        return ck_quantize("TensorCoreMXFP8Layout", w_rot)[1]
    return None


def _ck_oracle(case: Case, w: torch.Tensor) -> torch.Tensor | None:
    from test_formats_oracle import ck_quantize

    name = case.spec.format
    if name == "convrot_w4a4":
        return ck_quantize("TensorCoreConvRotW4A4Layout", w)[1]
    if name in ("w4a8", "w6a8"):
        return ck_quantize("AsymW4A8Int8Layout", w, bits=int(name[1]))[1]
    kind, group = _stored_rotation(case)
    dq_rot = _ck_rotated_basis(case, _to_basis(w, kind, group))
    return None if dq_rot is None else _from_basis(dq_rot, kind, group)


ORACLE_FORMATS = ("int8", "fp8", "nvfp4", "mxfp8", "convrot_w4a4", "w4a8", "w6a8")
ORACLE_CASES = [c for c in CASES if c.spec.format in ORACLE_FORMATS]


@pytest.mark.skipif(not HAS_CK, reason="comfy-kitchen (the `comfy` extra) is the oracle")
@pytest.mark.parametrize("case", ORACLE_CASES, ids=[c.id for c in ORACLE_CASES])
def test_dequantize_equals_comfy_kitchen(case):
    """Our dequantized weight is comfy-kitchen's for the same weight: bit for bit unrotated, to the de-rotation's
    fp rounding where this file rotated the weight for it."""
    w = _weight(case.shape)
    expected = _ck_oracle(case, w)
    ours = case.fmt.dequantize(_quantized(case))
    if _stored_rotation(case)[0] == "none" or case.spec.format in ("convrot_w4a4", "w4a8", "w6a8"):
        assert torch.equal(ours, expected), case.id
    else:
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6 * float(w.abs().max()))
    assert set(ORACLE_FORMATS) | set(GRID_BOUNDS) == set(FORMATS), "a format with neither an oracle nor a grid bound"


# ------------------------------------------------------------------ 2. linear


def _act_step(case: Case, q: QuantizedWeight, xb: torch.Tensor) -> torch.Tensor:
    """Per element of the input (tokens x K, in the quantized basis), the most its activation quantization may move
    it, from the documented grids; a static scale also clamps."""
    kind, qmax = ACT_QUANT[case.spec.format]
    a = xb.abs()
    static = case.spec.activations == "static"
    tok = a.amax(-1, keepdim=True)
    if kind == "int":
        s = q.tensors["input_scale"].double() if static else tok.clamp(min=1e-10) / qmax
        return torch.maximum(s / 2 + 0 * a, a - qmax * s)
    if kind == "e4m3":  # 3 mantissa bits: half an ulp is 2^-4 of the value, 2^-10 of the scale for subnormals
        s = q.tensors["input_scale"].double() if static else tok / qmax
        return torch.maximum(torch.maximum(a * 2 ** -4, s * 2 ** -10 + 0 * a), a - qmax * s)
    if kind == "mx":  # E8M0 exponent per block of 32 of the token: scale 2^ceil(log2(block amax / 448))
        blocks = a.reshape(a.shape[0], -1, 32)
        s = torch.exp2(torch.ceil(torch.log2(blocks.amax(-1, keepdim=True).clamp(min=1e-30) / qmax)))
        return torch.maximum(blocks * 2 ** -4, s * 2 ** -10 + 0 * blocks).reshape(a.shape)
    if kind == "nv":  # global scale g (per token, per call, or static), e4m3 block scales per 16, e2m1 codes
        g = q.tensors["input_scale"].double() if static else (a.amax() if case.spec.act_granularity == "tensor" else tok) / qmax
        padded = F.pad(a, (0, -a.shape[1] % 16))  # K padded with zeros to the block, as the format pads it
        blocks = padded.reshape(a.shape[0], -1, 16)
        bmax = blocks.amax(-1, keepdim=True)
        g = g.reshape(-1, 1, 1) if g.dim() else g
        step = bmax * (17 / 96 + 1 / 16) + 7 * g * 2 ** -10 + (bmax - 6 * 448 * g).clamp(min=0)
        return step.expand_as(blocks).reshape(padded.shape)[:, : a.shape[1]]
    if kind == "group64":  # svdquant: int4 per (token, group of 64) of x / smooth (smooth 1 here)
        groups = a.reshape(a.shape[0], -1, 64)
        return (groups.amax(-1, keepdim=True).clamp(min=1e-10) / qmax / 2).expand_as(groups).reshape(a.shape)
    raise AssertionError(f"unknown activation kind {kind}")


def _linear_bounds(case: Case, q: QuantizedWeight, x: torch.Tensor, dq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bound, noise): how far `linear` may be from x dequantize(W)^T + b, element by element (the activation steps
    against |W| in the quantized basis, plus float rounding in the layer's compute dtype: bf16 for svdquant_w4a4,
    fp32 otherwise), and the error energy per token that rounding noise gives (each activation error uniform within
    its step: variance step^2 / 3)."""
    kind, group = _stored_rotation(case)
    x2 = x.reshape(-1, x.shape[-1])
    mags = x2.abs().double() @ dq.abs().double().t()
    slack = (2 ** -6 if case.spec.format == "svdquant_w4a4" else 1e-5) * mags + 1e-6
    if case.weight_only:
        return slack.reshape(*x.shape[:-1], -1), torch.zeros(x2.shape[0], dtype=torch.float64)
    weight = dq.double()
    if case.spec.format == "svdquant_w4a4":  # the activations meet the residual; the low-rank branch reads x as is
        weight = weight - q.tensors["weight_proj_up"].double() @ q.tensors["weight_proj_down"].double().t()
    w_b = _to_basis(weight, kind, group)
    steps = _act_step(case, q, _to_basis(x2.double(), kind, group, centre=True))
    noise = ((steps ** 2 / 3) @ (w_b ** 2).t()).sum(-1)
    return (steps @ w_b.abs().t() + slack).reshape(*x.shape[:-1], -1), noise


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_linear_is_the_dequantized_weight_within_the_activation_bound(case):
    q, fmt = _quantized(case), case.fmt
    n, k = case.shape
    x, bias = _input(k), _bias(n)
    dq = fmt.dequantize(q)
    y = fmt.linear(x, q, bias)
    assert y.dtype == x.dtype and y.shape == (3, 5, n)
    y_w = F.linear(x, dq, bias)
    err = (y.double() - y_w.double()).abs()
    bound, noise = _linear_bounds(case, q, x, dq)
    worst = float((err / bound).max())
    assert worst <= 1, f"{case.id}: |linear - x W^T - b| reaches {worst:.2f}x its bound"
    if not case.weight_only:
        # the activations really are quantized (the bound is not met by doing nothing), and no token's error is
        # louder than its steps' rounding noise allows (measured: at most 1.6x; a step twice too large gives 2.3x)
        assert float(err.max()) > 1e-5 * float(y_w.abs().max()), f"{case.id}: activations left unquantized"
        loud = float(((err.reshape(-1, n) ** 2).sum(-1) / noise).max().sqrt())
        assert loud <= 2, f"{case.id}: a token's error is {loud:.2f}x its activation rounding noise"
    yb = fmt.linear(x.bfloat16(), q, bias.bfloat16())
    assert yb.dtype == torch.bfloat16 and torch.isfinite(yb).all()
    # bf16: x, the weight, the bias and the output each rounded to 8 bits
    mags = (x.reshape(-1, k).abs().double() @ dq.abs().double().t()).reshape(bound.shape) + bias.abs().double()
    bf16_bound = bound + 2 ** -6 * mags
    assert ((yb.double() - y_w.double()).abs() <= bf16_bound).all(), f"{case.id}: bf16 input off the bound"


# ------------------------------------------------------------------ 3. export and reload


class Holder(nn.Module):
    """The smallest model that holds a layer: one Linear, named as a transformer's would be."""

    def __init__(self, n: int, k: int):
        super().__init__()
        self.proj = nn.Linear(k, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def _export(case: Case, path: Path) -> Holder:
    n, k = case.shape
    model = Holder(n, k)
    model.proj = QuantLinear(_quantized(case), _bias(n))
    out = lowbit_pipe.export(model, path)
    assert out["quantized_layers"] == 1 and Path(out["path"]) == path and path.is_file()
    return model


def _reload(path: Path, shape: tuple[int, int]) -> Holder:
    """The loader every file load ends in: the file's tensors checked, then installed into a meta-built model."""
    state = load_tensors(path)
    check_file_tensors(state, str(path))
    with torch.device("meta"):
        model = Holder(*shape)
    install_state_dict(model, state, str(path), torch.float32)
    return model


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_export_and_reload_give_the_same_layer_bit_for_bit(case, tmp_path):
    path = tmp_path / "model.safetensors"
    model = _export(case, path)
    name, fmt = case.spec.format, case.fmt
    with safe_open(str(path), "pt") as f:
        record = decode_record(f.get_tensor("proj.comfy_quant"), "proj.comfy_quant")
        summary = json.loads(f.metadata()["lowbit_pipe"])["layers"]["proj"]
    assert record == model.proj.record
    assert (record.get("lowbit_format") or record["format"]) in (name, fmt.comfy_name)  # the record names it
    assert format_for_record(record, "proj").comfy_name == fmt.comfy_name and summary["format"] == name
    back = _reload(path, case.shape)
    layer = back.proj
    assert isinstance(layer, QuantLinear) and layer.record == model.proj.record
    assert layer.format.name == name, f"{case.id}: reloaded as {layer.format.name}"
    for key, tensor in model.proj.state_dict().items():
        assert _same_bits(layer.state_dict()[key], tensor), f"{case.id}: {key} changed through the file"
    for dtype in (torch.float32, torch.bfloat16):
        x = _input(case.shape[1], dtype)
        with torch.no_grad():
            assert torch.equal(back(x), model(x)), f"{case.id}: {dtype} forward differs after the reload"


# ------------------------------------------------------------------ 4. teardown


def _choice(spec: FormatSpec) -> dict:
    keys = ("format", "rotation", "granularity", "activations", "act_granularity")
    return {k: getattr(spec, k) for k in keys if getattr(spec, k) is not None}


@pytest.mark.parametrize("case", PIPELINE_CASES, ids=[c.id for c in PIPELINE_CASES])
def test_teardown_restores_the_float_linear_and_frees_the_quantized_one(case):
    n, k = case.shape
    model = Holder(n, k)
    with torch.no_grad():
        model.proj.weight.copy_(_weight(case.shape))
        model.proj.bias.copy_(_bias(n))
    original, saved = model.proj, {key: t.clone() for key, t in model.proj.state_dict().items()}
    x = _input(k)
    with torch.no_grad():
        y_float = model(x)
    ledger = Ledger()
    calibrate = (lambda: model(x)) if case.spec.activations == "static" else None
    stats = lowbit_pipe.quantize(model, {"default": _choice(case.spec), "arch_keep_float": False}, ledger=ledger,
                                 calibrate=calibrate)
    assert stats["layers"] == {case.spec.format: 1}
    layer = model.proj
    assert isinstance(layer, QuantLinear) and layer.record == _quantized(case).record
    watched = [weakref.ref(layer)] + [weakref.ref(t) for t in layer.buffers()]
    del layer
    report = lowbit_pipe.teardown(ledger)
    assert model.proj is original and isinstance(original, nn.Linear)
    assert all(torch.equal(original.state_dict()[key], t) for key, t in saved.items())
    with torch.no_grad():
        assert torch.equal(model(x), y_float)
    alive = [r for r in watched if r() is not None]
    assert not alive, f"{case.id}: {len(alive)} of the quantized layer's objects outlive the teardown"
    assert report["errors"] == [] and report["unfreed"] == [] and report["proven"], report
    assert report["objects_freed"] >= 1 and report["patches_restored"] >= 1, report


# ------------------------------------------------------------------ 5. bad tensors in the file


def _wrong_shape(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1).repeat(2) if t.dim() == 0 else t[:-1].contiguous()


def _bad_file_cases() -> list[Case]:
    """Per format, the case storing the most tensors (a static input_scale where it takes one)."""
    out = {}
    for case in PIPELINE_CASES:
        best = out.get(case.spec.format)
        if best is None or len(_quantized(case).tensors) > len(_quantized(best).tensors):
            out[case.spec.format] = case
    return list(out.values())


BAD_FILE_CASES = _bad_file_cases()


@pytest.mark.parametrize("case", BAD_FILE_CASES, ids=[c.id for c in BAD_FILE_CASES])
@pytest.mark.parametrize("damage", ["shape", "dtype"])
def test_a_wrong_tensor_in_the_file_is_refused_naming_its_key(case, damage, tmp_path):
    good = tmp_path / "good.safetensors"
    _export(case, good)
    state = load_tensors(good)
    with safe_open(str(good), "pt") as f:
        metadata = f.metadata()
    for suffix in _quantized(case).tensors:
        key = f"proj.{suffix}"
        bad = tmp_path / f"bad_{suffix}.safetensors"
        changed = _wrong_shape(state[key]) if damage == "shape" else state[key].to(torch.float64)
        save_file({**state, key: changed}, str(bad), metadata=metadata)
        with pytest.raises(CheckpointError) as info:
            _reload(bad, case.shape)
        message = str(info.value)
        assert str(bad) in message and key in message, f"{case.id} {damage} of {key}: {message}"
