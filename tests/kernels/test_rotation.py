"""Hadamard rotations: matrices, orientation, invertibility, hadanorm's exact identity, cache."""

from __future__ import annotations

import pytest
import torch

from lowbit_pipe.kernels import rotation

R4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float32)


@pytest.mark.parametrize("kind,n", [("convrot", 4), ("convrot", 16), ("convrot", 256), ("quarot", 2), ("quarot", 128), ("hadanorm", 64)])
def test_matrix_orthogonal_symmetric(kind, n):
    h = rotation.hadamard(kind, n)
    assert h.shape == (n, n) and h.dtype == torch.float32
    torch.testing.assert_close(h @ h.t(), torch.eye(n), atol=1e-5, rtol=0)
    assert torch.equal(h, h.t())  # symmetric: W H^T and x H pair up to the identity
    assert torch.equal((h * n**0.5).round().abs(), torch.ones(n, n))  # entries +-1/sqrt(n)


def test_convrot_matrix_is_kronecker_power_of_r4():
    expected = torch.kron(torch.kron(torch.kron(R4, R4), R4), R4) / 16.0
    assert torch.equal(rotation.hadamard("convrot", 256), expected)


def test_quarot_matrix_is_sylvester():
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    expected = torch.kron(torch.kron(h2, h2), h2) / 8**0.5
    torch.testing.assert_close(rotation.hadamard("quarot", 8), expected, atol=0, rtol=1e-7)
    # first row all ones: the DC direction hadanorm removes
    assert torch.all(rotation.hadamard("quarot", 8)[0] > 0)


@pytest.mark.parametrize("kind,n", [("convrot", 8), ("convrot", 2), ("quarot", 12), ("hadanorm", 0), ("bogus", 4)])
def test_bad_groups_rejected(kind, n):
    with pytest.raises(ValueError):
        rotation.check_group(kind, n)


@pytest.mark.parametrize("kind,group", [("convrot", 16), ("convrot", 256), ("quarot", 128), ("hadanorm", 32)])
def test_weight_rotation_roundtrip_and_linear_identity(kind, group):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 512, generator=gen)
    x = torch.randn(5, 512, generator=gen)
    w_rot = rotation.rotate_weight(w, kind, group)
    torch.testing.assert_close(rotation.unrotate_weight(w_rot, kind, group), w, atol=1e-5, rtol=0)
    # block diagonal: group j of the rotated row only depends on group j of the input
    h = rotation.hadamard(kind, group)
    torch.testing.assert_close(w_rot[:, group : 2 * group], w[:, group : 2 * group] @ h.t(), atol=1e-5, rtol=0)
    x_rot, mu = rotation.rotate_activation(x, kind, group)
    y = x_rot @ w_rot.t()
    if mu is not None:
        y = y + rotation.mean_correction(mu, rotation.group_rowsums(w, group))
    torch.testing.assert_close(y, x @ w.t(), atol=1e-4, rtol=1e-5)


def test_hadanorm_centres_each_group():
    x = torch.randn(3, 256) + 5.0  # big DC offset: plain Hadamard would put 5*sqrt(128) in coord 0
    x_rot, mu = rotation.rotate_activation(x, "hadanorm", 128)
    assert mu.shape == (3, 2)
    torch.testing.assert_close(mu, x.reshape(3, 2, 128).mean(-1))
    assert x_rot.reshape(3, 2, 128)[..., 0].abs().max() < 1e-4  # DC coordinate removed
    plain, _ = rotation.rotate_activation(x, "quarot", 128)
    assert plain.reshape(3, 2, 128)[..., 0].abs().min() > 50


def test_none_is_identity_and_applies():
    w = torch.randn(3, 10)
    assert torch.equal(rotation.rotate_weight(w, "none"), w)
    assert rotation.applies("none", 10)
    assert rotation.applies("convrot", 512) and not rotation.applies("convrot", 384)
    assert rotation.resolve_group("quarot", None) == 128 and rotation.resolve_group("convrot", None) == 256
    with pytest.raises(ValueError, match="multiple of the rotation group"):
        rotation.rotate_weight(torch.randn(2, 384), "convrot", 256)


def test_cache_and_clear():
    rotation.clear_cache()
    rotation.hadamard("convrot", 64)
    rotation.hadamard("convrot", 64, dtype=torch.bfloat16)
    assert rotation._hadamard_cpu.cache_info().currsize == 1  # one fp32 master per (kind, n)
    rotation.clear_cache()
    assert rotation._hadamard_cpu.cache_info().currsize == 0



@pytest.mark.parametrize("kind,group", [("convrot", 256), ("quarot", 128), ("convrot", 64)])
def test_rotate_groups_is_the_reference_rotation_in_the_input_dtype(kind, group):
    """The GPU paths' rotation (one matmul in x's dtype) against the fp32 reference: fp32 to rounding, bf16 to
    one rounding of each rotated value; a width the group does not divide is refused, naming the group."""
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(3, 5, 512, generator=gen) * 4
    ref, _ = rotation.rotate_activation(x, kind, group)
    torch.testing.assert_close(rotation.rotate_groups(x, kind, group), ref, rtol=1e-5, atol=1e-5)
    xb = x.bfloat16()
    yb = rotation.rotate_groups(xb, kind, group)
    assert yb.dtype == torch.bfloat16 and yb.shape == x.shape
    refb, _ = rotation.rotate_activation(xb, kind, group)
    assert float((yb.float() - refb).abs().max() / refb.abs().max()) < 2 ** -7
    with pytest.raises(ValueError, match=f"rotation group {group}"):
        rotation.rotate_groups(torch.randn(2, group + 16), kind, group)
