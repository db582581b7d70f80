"""Block-diagonal Hadamard rotations shared by the formats and the GPU kernels.

Kinds (`ROTATION_KINDS`):

- ``none``: identity.
- ``convrot``: the "regular" Hadamard of ConvRot / ComfyUI: Kronecker powers of
  R4 = [[1,1,1,-1],[1,1,-1,1],[1,-1,1,1],[-1,1,1,1]] divided by sqrt(n); group
  sizes are powers of 4 (default 256). Built exactly as comfy-kitchen builds it
  (fp32 kron chain, then ``/ n**0.5``) so rotated weights are bit-identical.
- ``quarot``: the Sylvester Hadamard H_{2n} = [[H, H], [H, -H]] / sqrt(2n),
  group a power of 2 (default 128). Deterministic (no random sign flips).
- ``hadanorm``: per-group mean-centring, then the quarot matrix. Precisely,
  for an activation row x split into groups x_g (size n):
      mu_g      = mean(x_g)
      x~_g      = (x_g - mu_g * 1) @ H            (rotated, centred)
      y         = sum_g x~_g @ W~_g^T + sum_g mu_g * rowsum_g(W)
  where W~ = W @ H^T per group is the stored (rotated) weight and rowsum_g(W)
  is taken from the de-rotated dequantized weight, so the identity is exact
  for the weight that is actually stored. Because H's first row is all
  ones / sqrt(n), centring is the same as zeroing coordinate 0 of every
  rotated group (the DC term that a plain Hadamard turns into an outlier) and
  carrying it in full precision. The "scaling" step of HadaNorm (dividing by
  a per-token norm) is subsumed by the formats' per-token dynamic activation
  scale, so it is the identity here. The weight side is a plain orthogonal
  rotation: exact and invertible.

Orientation (same as comfy-kitchen): weights are rotated offline as W @ H^T per
group along in_features, activations online as x @ H per group. All three
matrices are symmetric and orthogonal (H @ H = I), so x H (W H^T)^T = x W^T and
de-rotation is W~ @ H.

Cache: Hadamard matrices live in ``functools.lru_cache``s on pure functions: the
CPU fp32 masters, and their copies per (dtype, device) for `rotate_groups` (a forward then
does no host-to-device copy); ``clear_cache()`` empties both. No other module state.
"""

from __future__ import annotations

import functools

import torch

ROTATION_KINDS = ("none", "convrot", "quarot", "hadanorm")
DEFAULT_GROUP = {"none": 0, "convrot": 256, "quarot": 128, "hadanorm": 128}

_R4 = ((1, 1, 1, -1), (1, 1, -1, 1), (1, -1, 1, 1), (-1, 1, 1, 1))


def _is_power(n: int, base: int) -> bool:
    if n < base:
        return False
    while n % base == 0:
        n //= base
    return n == 1


def check_group(kind: str, group: int) -> None:
    """Raise ValueError if `group` is not a valid size for rotation `kind`."""
    if kind not in ROTATION_KINDS:
        raise ValueError(f"unknown rotation '{kind}' (known: {list(ROTATION_KINDS)})")
    if kind == "none":
        return
    if kind == "convrot" and not _is_power(group, 4):
        raise ValueError(f"convrot group must be a power of 4 (>= 4), got {group}")
    if kind in ("quarot", "hadanorm") and not _is_power(group, 2):
        raise ValueError(f"{kind} group must be a power of 2 (>= 2), got {group}")


def resolve_group(kind: str, group: int | None) -> int:
    """The group size to use: `group`, or the kind's default when None."""
    g = DEFAULT_GROUP[kind] if group is None else int(group)
    check_group(kind, g)
    return g


def applies(kind: str, in_features: int, group: int | None = None) -> bool:
    """Whether rotation `kind` can be applied to a layer with this many input features."""
    if kind == "none":
        return True
    return in_features % resolve_group(kind, group) == 0


@functools.lru_cache(maxsize=16)
def _hadamard_cpu(kind: str, n: int) -> torch.Tensor:
    """Normalized n x n Hadamard matrix of `kind` (CPU fp32). Treat as read-only."""
    check_group(kind, n)
    if kind == "convrot":
        r4 = torch.tensor(_R4, dtype=torch.float32)
        h, size = r4, 4
        while size < n:
            h = torch.kron(h, r4)
            size *= 4
    else:  # quarot, hadanorm: Sylvester
        h = torch.ones(1, 1, dtype=torch.float32)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / (n**0.5)


def hadamard(kind: str, n: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The normalized Hadamard matrix used by rotation `kind` for groups of `n`."""
    if kind == "none":
        raise ValueError("rotation 'none' has no matrix")
    h = _hadamard_cpu(kind, int(n))
    return h.to(device=device or "cpu", dtype=dtype)


@functools.lru_cache(maxsize=32)
def _hadamard_on(kind: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`hadamard(kind, n)` in `dtype` on `device`, kept (a few hundred KB at most per entry)."""
    return hadamard(kind, n, device, dtype).contiguous()


def cached_entries() -> int:
    """How many Hadamard matrices the caches hold (masters and device copies)."""
    return _hadamard_cpu.cache_info().currsize + _hadamard_on.cache_info().currsize


def clear_cache() -> None:
    """Free the cached Hadamard matrices."""
    _hadamard_cpu.cache_clear()
    _hadamard_on.cache_clear()


def rotate_groups(x: torch.Tensor, kind: str, group: int) -> torch.Tensor:
    """x @ H per group of `group` along the last dim, in x's dtype: one [rows * K/group, group] x
    [group, group] matmul, so on a GPU the rotation runs on tensor cores (cuBLAS, fp32 accumulate)
    and costs about one read and one write of x. The GPU paths rotate with it before quantizing;
    bf16 rounds each rotated value once (2^-9 relative, far below an 8-bit code's step).
    `rotate_activation` is the fp32 reference of the same product."""
    k = x.shape[-1]
    _check_divisible(k, group, "activation")
    h = _hadamard_on(kind, int(group), x.dtype, x.device)
    return torch.mm(x.reshape(-1, group), h).reshape(x.shape)


def _check_divisible(features: int, group: int, what: str) -> None:
    if features % group != 0:
        raise ValueError(f"{what} has {features} features, not a multiple of the rotation group {group}")


def rotate_weight(weight: torch.Tensor, kind: str, group: int | None = None) -> torch.Tensor:
    """Offline weight rotation W @ H^T per group along in_features; fp32 [out, in]."""
    w = weight.float()
    if kind == "none":
        return w
    g = resolve_group(kind, group)
    n, k = w.shape
    _check_divisible(k, g, "weight")
    h = hadamard(kind, g, w.device)
    # Same expression as comfy-kitchen (grouped matmul with h.T) so results are bit-identical.
    return torch.matmul(w.reshape(n, k // g, g), h.T).reshape(n, k)


def unrotate_weight(weight_rot: torch.Tensor, kind: str, group: int | None = None) -> torch.Tensor:
    """Inverse of `rotate_weight`. Every H here is orthogonal and symmetric, so H^T H = H H = I and
    the inverse is the same grouped product."""
    return rotate_weight(weight_rot, kind, group)


def rotate_activation(x: torch.Tensor, kind: str, group: int | None = None,
                      centre: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Online activation rotation x @ H per group, in fp32.

    Returns (x_rot, mu): mu is None except for hadanorm, where it is the per-group
    mean [..., groups] that was removed before rotating (see `mean_correction`).
    `centre=False`: hadanorm's rotation of the whole input, no mean removed (mu None): the basis in which
    its layer output error lives, since the mean's term uses the same dequantized weight.
    """
    xf = x.float()
    if kind == "none":
        return xf, None
    g = resolve_group(kind, group)
    k = xf.shape[-1]
    _check_divisible(k, g, "activation")
    grouped = xf.reshape(*xf.shape[:-1], k // g, g)
    mu = None
    if kind == "hadanorm" and centre:
        mu = grouped.mean(dim=-1)
        grouped = grouped - mu.unsqueeze(-1)
    h = hadamard(kind, g, xf.device)
    return torch.matmul(grouped, h).reshape(xf.shape), mu


def group_rowsums(weight: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """rowsum_g(W) [out, groups] fp32: each row of the dequantized weight (ORIGINAL, unrotated basis) summed
    over each hadanorm group. Fixed by the weight: a layer computes it once (Format.derived_tensors)."""
    g = resolve_group("hadanorm", group)
    n, k = weight.shape
    return weight.float().reshape(n, k // g, g).sum(dim=-1)


def mean_correction(mu: torch.Tensor, rowsums: torch.Tensor) -> torch.Tensor:
    """hadanorm's full-precision term sum_g mu_g * rowsum_g(W): [..., out] in fp32 (`rowsums`: group_rowsums)."""
    return mu.float() @ rowsums.to(mu.device).t()


# custom op: torch.compile keeps the rotation as one node (the cached matrix stays out of the graph)
@torch.library.custom_op("lowbit_pipe::rotate_groups", mutates_args=())
def rotate_groups_op(x: torch.Tensor, kind: str, group: int) -> torch.Tensor:
    return rotate_groups(x, kind, group)


@rotate_groups_op.register_fake
def _(x, kind, group):
    return x.new_empty(x.shape)
