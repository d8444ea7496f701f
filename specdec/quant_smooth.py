"""SmoothQuant for w8a8: the MLPs' down projections smoothed on a calibration text before they are quantized."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Text whose activations set the smoothing scales: spoken-assistant English like the product's answers, written
# here (never a benchmark prompt).
CALIBRATION_TEXT = (
    "Sure! Here is a quick answer. The water cycle moves water between the oceans, the air and the land: the sun "
    "warms the sea, vapour rises, cools into clouds and falls again as rain or snow. To boil an egg, put it in "
    "cold water, bring it to a boil, then simmer for nine minutes and cool it in ice water. In Python, reverse a "
    "list with items[::-1] or items.reverse(). Three tips for better sleep: keep a regular schedule, avoid screens "
    "an hour before bed, and keep the room cool and dark. Paris is the capital of France; it has about two million "
    "people. Would you like me to explain any of these in more detail?"
)
SMOOTHING_ALPHA = 0.5  # SmoothQuant's balance between activation and weight ranges


@torch.inference_mode()
def smooth_mlp_inputs(model: PreTrainedModel, calibration_ids: torch.Tensor, alpha: float = SMOOTHING_ALPHA) -> None:
    """SmoothQuant for each MLP's down projection, before w8a8: its input (act(gate) · up) has channels far larger
    than the rest, and one per-token scale then leaves the small ones a few int8 steps. Channel j is divided by
    s_j = max|x_j|^α / max|W_down[:, j]|^(1 − α) and W_down's column j multiplied by it; the division is folded
    into up_proj's row j, so the float model computes the same function and nothing is added at run time."""
    mlps = [m for m in model.modules() if all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj"))]
    peaks: dict[int, torch.Tensor] = {}

    def record(mlp_index: int):
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            peak = args[0].detach().abs().float().reshape(-1, args[0].shape[-1]).amax(dim=0)
            peaks[mlp_index] = torch.maximum(peaks[mlp_index], peak) if mlp_index in peaks else peak

        return hook

    handles = [mlp.down_proj.register_forward_pre_hook(record(i)) for i, mlp in enumerate(mlps)]
    try:
        model(input_ids=calibration_ids)
    finally:
        for h in handles:
            h.remove()
    for i, mlp in enumerate(mlps):
        down, up = mlp.down_proj.weight, mlp.up_proj.weight
        w_peak = down.detach().abs().float().amax(dim=0).clamp(min=1e-5)
        scale = (peaks[i].clamp(min=1e-5) ** alpha / w_peak ** (1 - alpha)).clamp(min=1e-5)
        down.copy_((down.float() * scale[None, :]).to(down.dtype))
        up.copy_((up.float() / scale[:, None]).to(up.dtype))
        if mlp.up_proj.bias is not None:
            mlp.up_proj.bias.copy_((mlp.up_proj.bias.float() / scale).to(mlp.up_proj.bias.dtype))
