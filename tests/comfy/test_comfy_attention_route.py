"""The ComfyUI override's calls through the per-shape router (lowbit_pipe.attention.crossover), as on a CUDA MODEL:
a router with stand-in paths on the CPU (no ComfyUI needed). Where the router picks the model's attention,
ComfyUI's own function runs with the call's own arguments; otherwise the chosen path, its output in ComfyUI's
layout; calls the override cannot serve never reach the router; Purge closes cuDNN's runner."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from lowbit_pipe.attention.crossover import CUDNN, AttentionRouter, Path8
from lowbit_pipe.comfy.attention import Attention8Override
from lowbit_pipe.comfy.node_runs import PurgedModelError

HEADS, DIM = 2, 64


class _Runner:
    """A path's call: records its arguments, returns q scaled (a result no other path gives)."""

    def __init__(self, factor: float) -> None:
        self.factor, self.seen = factor, []

    def __call__(self, q, k, v, sm_scale, key_mask):
        self.seen.append((tuple(q.shape), sm_scale, key_mask))
        return q * self.factor


def _override(route: str = "auto", cudnn: object = None) -> tuple[Attention8Override, dict[str, _Runner]]:
    runs = {"cudnn": _Runner(3.0), "triton": _Runner(5.0)}
    calls: Counter = Counter()
    paths = [Path8(CUDNN, "cudnn", "cudnn (test)", lambda s: None, runs["cudnn"]),
             Path8("fp8", "triton", "triton (test)", lambda s: None, runs["triton"])]
    router = AttentionRouter(paths, torch.device("cpu"), table=None, route=route, measure=False, calls=calls)
    override = Attention8Override("fp8", "test node", "7", router=router)
    router.calls = override.calls  # what device_router does: one Counter
    override.cudnn = cudnn
    return override, runs


def _qkv(tokens: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(tokens)
    return tuple(torch.randn(1, tokens, HEADS * DIM, generator=gen) for _ in range(3))  # ComfyUI's [B, N, H * D]


def _comfy_func(seen: list):
    def func(q, k, v, heads, *args, **kwargs):
        seen.append((q, heads, kwargs))
        return q + 1.0
    return func


def test_where_the_router_picks_the_models_attention_comfyuis_function_runs_the_call_as_given():
    override, runs = _override()
    q, k, v = _qkv(1024)  # below every default-rule threshold
    seen: list = []
    options = {"block_index": 0}
    out = override(_comfy_func(seen), q, k, v, HEADS, transformer_options=options)
    assert torch.equal(out, q + 1.0) and seen[0][0] is q and seen[0][2]["transformer_options"] is options
    assert not runs["cudnn"].seen and not runs["triton"].seen
    assert override.calls == Counter({"stock: faster at this shape (default rule, not measured)": 1})


def test_a_path_the_router_picks_runs_and_comes_back_in_comfyuis_layout():
    override, runs = _override()
    q, k, v = _qkv(8192)  # cuDNN's default threshold without a mask
    out = override(_comfy_func([]), q, k, v, HEADS, transformer_options={"block_index": 3}, scale=0.125)
    assert runs["cudnn"].seen == [((1, HEADS, 8192, DIM), 0.125, None)] and not runs["triton"].seen
    assert out.shape == q.shape and torch.equal(out, q * 3.0)
    assert override.calls == Counter({CUDNN: 1})


def test_a_forced_route_takes_its_kernel_at_any_shape():
    override, runs = _override(route="triton")
    q, k, v = _qkv(256)
    out = override(_comfy_func([]), q, k, v, HEADS, transformer_options={"block_index": 0})
    assert torch.equal(out, q * 5.0) and len(runs["triton"].seen) == 1
    assert override.calls == Counter({"fp8": 1})


def test_grouped_kv_heads_reach_comfyuis_function_as_given_and_the_8bit_path_repeated():
    """Krea 2's fused attention hands k / v over with their own heads and enable_gqa (skip_reshape, [B, H, N, D]):
    where the router picks the model's attention ComfyUI's function gets those very tensors (no repeat made for
    nothing); a picked 8-bit path gets k / v repeated to q's heads, in that order."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 1024, DIM, generator=gen)
    k, v = (torch.randn(1, 2, 1024, DIM, generator=gen) for _ in range(2))
    override, runs = _override()
    seen: list = []
    out = override(_comfy_func(seen), q, k, v, 4, transformer_options={"block_index": 0}, skip_reshape=True,
                   enable_gqa=True)
    assert torch.equal(out, q + 1.0) and seen[0][2]["enable_gqa"] and not runs["triton"].seen
    got: list = []

    def triton_path(q8, k8, v8, sm_scale, key_mask):
        got.append((k8, v8))
        return q8 * 5.0

    override, _ = _override(route="triton")
    override.router.paths[1].run = triton_path
    out = override(_comfy_func([]), q, k, v, 4, transformer_options={"block_index": 0}, skip_reshape=True,
                   enable_gqa=True)
    assert torch.equal(out, (q * 5.0).transpose(1, 2).reshape(1, 1024, 4 * DIM))
    assert torch.equal(got[0][0], k.repeat_interleave(2, dim=1)) and torch.equal(got[0][1], v.repeat_interleave(2, 1))


def test_calls_the_override_cannot_serve_never_reach_the_router():
    override, runs = _override(route="cudnn")
    q, k, v = _qkv(8192)
    seen: list = []
    override(_comfy_func(seen), q, k, v, HEADS, transformer_options={})  # outside the blocks (Krea 2's text fusion)
    override(_comfy_func(seen), q, k[:, :77], v[:, :77], HEADS, transformer_options={"block_index": 0})  # cross
    assert len(seen) == 2 and not runs["cudnn"].seen and not override.router.choices
    assert set(override.calls) == {"stock: outside the model's blocks (attention.arch_keep: Krea 2's text fusion)",
                                   "stock: q, k, v of different shapes (cross-attention)"}


def test_purge_closes_cudnns_runner_and_the_override_refuses_afterwards():
    class Runner:
        closed = False

        def close(self):
            self.closed = True

    cudnn = Runner()
    override, _ = _override(cudnn=cudnn)
    override.purge("12:00:00")
    assert cudnn.closed
    q, k, v = _qkv(64)
    with pytest.raises(PurgedModelError, match="test node"):
        override(_comfy_func([]), q, k, v, HEADS, transformer_options={"block_index": 0})


def test_under_torch_compile_a_routed_call_is_the_routers_op():
    """One graph, no break; the op picks and runs the path when the graph runs (its model's attention: SDPA)."""
    override, runs = _override(route="cudnn")
    q, k, v = _qkv(512)
    compiled = torch.compile(lambda q, k, v: override(_comfy_func([]), q, k, v, HEADS,
                                                      transformer_options={"block_index": 0}),
                             backend="eager", fullgraph=True)
    out = compiled(q, k, v)
    assert torch.equal(out, q * 3.0) and len(runs["cudnn"].seen) == 1
    assert override.calls[CUDNN] == 1
