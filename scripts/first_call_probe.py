"""Where a new input shape's first call goes on the GPU (issue 33's cold start of
several buckets): the ~1 GB denoiser of the weights-once benchmark, eager, bf16,
on the H200, first and second call per new latent size, with cuDNN on, with cuDNN
off, with cuDNN attention off, and with math attention only; plus one convolution
alone at new sizes. Prints one JSON line. No mint; needs torch, diffusers and a GPU.

    python3 scripts/first_call_probe.py
"""

from __future__ import annotations

import json
import time

import torch
from diffusers import UNet2DConditionModel


def main() -> None:
    torch.manual_seed(0)
    n = 3
    unet = (
        UNet2DConditionModel(
            sample_size=64,
            in_channels=4,
            out_channels=4,
            block_out_channels=(512, 1024, 1408),
            layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D",) * (n - 1) + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (n - 1),
            cross_attention_dim=768,
            attention_head_dim=8,
            norm_num_groups=32,
        )
        .to("cuda", torch.bfloat16)
        .eval()
    )
    t = torch.tensor([10.0], device="cuda")
    e = torch.randn(1, 77, 768, device="cuda", dtype=torch.bfloat16)

    def timed(h: int) -> float:
        x = torch.randn(1, 4, h, h, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        s = time.perf_counter()
        with torch.no_grad():
            unet(x, t, encoder_hidden_states=e)
        torch.cuda.synchronize()
        return time.perf_counter() - s

    out: dict[str, object] = {"cudnn_version": torch.backends.cudnn.version()}
    # Each setting on sizes no earlier setting used: every first call is a new shape.
    out["cudnn_on"] = {h: [timed(h), timed(h)] for h in (32, 48, 64, 80)}
    torch.backends.cudnn.enabled = False
    out["cudnn_off"] = {h: [timed(h), timed(h)] for h in (40, 56, 72, 88)}
    torch.backends.cudnn.enabled = True
    torch.backends.cuda.enable_cudnn_sdp(False)
    out["cudnn_sdp_off"] = {h: [timed(h), timed(h)] for h in (36, 44, 52, 60)}
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    out["math_sdp_only"] = {h: [timed(h), timed(h)] for h in (68, 76, 84, 92)}
    conv = torch.nn.Conv2d(1024, 1024, 3, padding=1).to("cuda", torch.bfloat16)

    def conv_timed(h: int) -> float:
        x = torch.randn(1, 1024, h, h, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        s = time.perf_counter()
        with torch.no_grad():
            conv(x)
        torch.cuda.synchronize()
        return time.perf_counter() - s

    out["one_conv_cudnn"] = {h: [conv_timed(h), conv_timed(h)] for h in (12, 20, 28, 36)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
