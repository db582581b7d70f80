"""Decode the float and quantized trajectories' final latents to images; PSNR, SSIM and a PNG grid.

What is real and what is substituted:
- A real diffusers pipeline passed as the model (`lowbit_pipe.run(..., model=pipe)`): its own VAE,
  latent de-normalisation (latents_mean/std or scaling/shift factor) and `patch_size`.
- Otherwise (a bare transformer, the embedded tiny models): a tiny `AutoencoderKL` built from a config
  with seeded random weights stands in for the arch's VAE. Its images are not pictures, but the
  float-vs-quantized difference still goes through a real convolutional decoder.
- Always: the latents come from our Euler sampler (lowbit_pipe.measure.sampler) with the arch's seeded text
  states, not from a tokenizer and text encoder (no downloads); both models get the same seeds.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from lowbit_pipe.measure import metrics

VAE_SEED = 0
TILE = 128  # each image is upscaled (nearest) to at least this many pixels in the grid


def tiny_vae(latent_channels: int, seed: int = VAE_SEED) -> torch.nn.Module:
    """A 2-level AutoencoderKL (x2 upsampling) with seeded weights; a stand-in decoder, see module doc."""
    from diffusers import AutoencoderKL

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels,
                            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                            block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=8, sample_size=32)
    return vae.eval()


def spatial_latent(x: torch.Tensor | Sequence[torch.Tensor], patch: int) -> torch.Tensor:
    """Any arch's latent -> (B, C, H, W).

    Packed tokens (B, N, C*p*p) with N a square are unpacked as Krea 2 / FLUX / Qwen-Image pack them
    (token (h, w), feature (c, ph, pw)); 5-D video latents and Z-Image's per-sample lists keep frame 0.
    """
    if isinstance(x, (list, tuple)):
        x = torch.stack(list(x))
    if x.dim() == 5:
        return x[:, :, 0]
    if x.dim() == 4:
        return x
    if x.dim() != 3:
        raise ValueError(f"cannot make an image latent of shape {tuple(x.shape)}")
    b, n, d = x.shape
    side = int(round(n**0.5))
    if side * side != n:
        raise ValueError(f"{n} latent tokens do not form a square grid")
    p = patch if d % (patch * patch) == 0 else 1
    c = d // (p * p)
    return x.reshape(b, side, side, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, side * p, side * p)


def _pipeline_vae(model: Any) -> tuple[torch.nn.Module | None, int]:
    from diffusers import DiffusionPipeline

    if isinstance(model, DiffusionPipeline) and getattr(model, "vae", None) is not None:
        return model.vae, int(getattr(model, "patch_size", None) or 2)
    return None, 2


@contextlib.contextmanager
def _one_thread(active: bool) -> Iterator[None]:
    """CPU convolutions (oneDNN) round differently with different thread counts, and the joblib
    launcher pins each worker to one thread: decode single-threaded so a sweep job and its rerun
    from the run dir give the very same image figures. Restores the caller's thread count."""
    threads = torch.get_num_threads()
    if active:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def decode(vae: torch.nn.Module, latent: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) latent -> (B, 3, H', W') image in [0, 1], the way diffusers pipelines decode."""
    cfg = vae.config
    param = next(vae.parameters())
    z = latent.to(param.device, param.dtype)
    shape = (1, z.shape[1], 1, 1)
    if getattr(cfg, "latents_mean", None) is not None and getattr(cfg, "latents_std", None) is not None:
        mean = torch.tensor(cfg.latents_mean).view(shape).to(z)
        std = torch.tensor(cfg.latents_std).view(shape).to(z)
        z = z * std + mean
    elif getattr(cfg, "scaling_factor", None):
        z = z / cfg.scaling_factor + (getattr(cfg, "shift_factor", None) or 0.0)
    video = hasattr(vae, "temperal_downsample")  # Qwen-Image / Wan VAEs decode (B, C, T, H, W)
    with _one_thread(z.device.type == "cpu"):
        image = vae.decode(z[:, :, None] if video else z).sample
    image = image[:, :, 0] if video else image
    return (image.float() / 2 + 0.5).clamp(0, 1).cpu()  # VaeImageProcessor.denormalize


LABEL_HEIGHT = 14  # pixels per line of text (Pillow's default bitmap font: 11 px high)
CHAR_WIDTH = 6  # its glyphs' advance, for cutting a label to its panel's width
COLUMNS = ("float", "quantized", "|difference| x8")
BACKGROUND, INK = (24, 24, 24), (235, 235, 235)


@dataclass(frozen=True)
class GridLayout:
    """Where everything of images.png goes: tiles row by row (float, quantized, difference), texts (x, y, text)."""

    size: tuple[int, int]  # (width, height)
    tiles: list[tuple[int, int]]  # top-left corner of each tile
    texts: list[tuple[int, int, str]]


def grid_layout(tile: tuple[int, int], title: str, row_labels: Sequence[str],
                columns: Sequence[str] = COLUMNS) -> GridLayout:
    """A title line (recipe, formats, steps), a header line naming the three columns, then per row a label line
    (seed, PSNR, SSIM) above its three tiles. `tile`: (width, height) of one upscaled image."""
    w, h = tile
    width = len(columns) * w

    def fit(text: str, room: int) -> str:  # cut to its panel's width
        return text if len(text) * CHAR_WIDTH <= room - 4 else text[: max(1, (room - 4) // CHAR_WIDTH - 3)] + "..."

    texts = [(2, 1, fit(title, width))]
    texts += [(c * w + 2, LABEL_HEIGHT + 1, fit(name, w)) for c, name in enumerate(columns)]
    y, tiles = 2 * LABEL_HEIGHT, []
    for label in row_labels:
        texts.append((2, y + 1, fit(label, width)))
        y += LABEL_HEIGHT
        tiles += [(c * w, y) for c in range(len(columns))]
        y += h
    return GridLayout((width, y), tiles, texts)


def save_grid(rows: list[tuple[torch.Tensor, torch.Tensor]], path: Path, title: str = "",
              row_labels: Sequence[str] | None = None) -> GridLayout:
    """One row per seed: float | quantized | |difference| x8 (clamped), each row under its label, the columns
    under their names, the whole under `title`. Images (3, H, W) in [0, 1]. Returns the layout drawn."""
    from PIL import Image, ImageDraw

    scale = max(1, TILE // rows[0][0].shape[-1])
    tiles = []
    for ref, out in rows:
        diff = ((out - ref).abs() * 8).clamp(0, 1)
        for image in (ref, out, diff):
            big = image.repeat_interleave(scale, 1).repeat_interleave(scale, 2)
            tiles.append(Image.fromarray((big.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()))
    labels = list(row_labels) if row_labels is not None else [f"row {i}" for i in range(len(rows))]
    layout = grid_layout(tiles[0].size, title, labels)
    canvas = Image.new("RGB", layout.size, BACKGROUND)
    for tile, corner in zip(tiles, layout.tiles):
        canvas.paste(tile, corner)
    draw = ImageDraw.Draw(canvas)
    for x, y, text in layout.texts:
        draw.text((x, y), text, fill=INK)
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)
    return layout


def _formats(model: torch.nn.Module) -> str:
    from lowbit_pipe.quant.nn import QuantLinear

    names = sorted({getattr(m.format, "name", "?") for m in model.modules() if isinstance(m, QuantLinear)})
    return " + ".join(names) or "no quantized layer"


def compare_images(ctx: Any, finals: list[tuple[Any, Any]], path: Path, seeds: Sequence[int] = (),
                   steps: int | None = None) -> dict[str, Any]:
    """Decode each (float, quantized) final latent pair; mean / min PSNR (peak 1) and mean SSIM. The grid is
    labelled: recipe, formats and steps above it, column names, each row's seed with its PSNR and SSIM."""
    vae, patch = _pipeline_vae(ctx.model)
    source = "pipeline" if vae is not None else "tiny AutoencoderKL (seeded stand-in)"
    psnrs, ssims, rows = [], [], []
    with torch.inference_mode():
        for ref_latent, out_latent in finals:
            ref_z, out_z = spatial_latent(ref_latent, patch), spatial_latent(out_latent, patch)
            if vae is None:
                vae = tiny_vae(ref_z.shape[1])
            ref, out = decode(vae, ref_z.float()), decode(vae, out_z.float())
            psnrs.append(metrics.psnr_db(ref, out, peak=1.0))
            ssims.append(metrics.ssim(ref, out))
            rows.append((ref[0], out[0]))
    title = f"{ctx.recipe.name}: {_formats(ctx.transformer)}" + (f", {steps} Euler steps" if steps else "")
    title += "" if source == "pipeline" else ", stand-in VAE"
    seeds = list(seeds) or list(range(len(rows)))
    row_labels = [f"seed {seed}: PSNR {p:.1f} dB, SSIM {s:.4f}" for seed, p, s in zip(seeds, psnrs, ssims)]
    layout = save_grid(rows, path, title, row_labels)
    return {"vae": source, "psnr_db": metrics.finite(sum(psnrs) / len(psnrs)) if psnrs else None,
            "min_psnr_db": metrics.finite(min(psnrs)) if psnrs else None,
            "ssim": sum(ssims) / len(ssims) if ssims else None,
            "per_seed": [{"psnr_db": metrics.finite(p), "ssim": s} for p, s in zip(psnrs, ssims)],
            "path": path.name, "labels": {"title": layout.texts[0][2], "columns": list(COLUMNS), "rows": row_labels}}
