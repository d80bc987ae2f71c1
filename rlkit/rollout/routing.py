"""The experts a mixture-of-experts engine chose: recorded while it generates, for routing replay (R3).

``RoutingRecorder`` hooks every MoE router of a transformers model (Qwen3-MoE's ``mlp.gate``, which returns
``(logits, weights, experts)``) and keeps each forward's top-k experts. ``generate`` runs a prefill over
the left-padded prompts, then one forward per new token, so the forwards line up with the positions of
``prompt + response``: ``per_row`` cuts each sample's real tokens out, ``(tokens, layers, k)`` int16. The last
sampled token is never fed to the model, so its row is -1 (no choice recorded), as are the layers without
experts.

>>> from rlkit.models import tiny_lm, load                                    # doctest: +SKIP
>>> model, _ = load(tiny_lm("qwen3_moe"))                                    # doctest: +SKIP
>>> with RoutingRecorder(model) as rec:                                       # doctest: +SKIP
...     model(torch.tensor([[5, 6, 7]]))
>>> rec.per_row(torch.ones(1, 3, dtype=torch.long), [0])[0].shape            # doctest: +SKIP
torch.Size([3, 4, 2])
"""

from __future__ import annotations

import torch
from torch import nn

NONE = -1  # no recorded choice (padding, the last sampled token, a dense layer)


def routers(model: nn.Module) -> dict[int, nn.Module]:
    """The MoE routers of ``model`` by decoder layer: modules ``...layers.<i>.mlp.gate`` with a ``top_k``."""
    out = {}
    for name, mod in model.named_modules():
        parts = name.split(".")
        if len(parts) >= 3 and parts[-1] == "gate" and parts[-2] == "mlp" and hasattr(mod, "top_k"):
            out[int(parts[-3])] = mod
    return out


class RoutingRecorder:
    """Records the top-k experts of every routed forward of ``model`` while in a ``with`` block."""

    def __init__(self, model: nn.Module):
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts router (no layers.<i>.mlp.gate with "
                             f"a top_k): routing is recorded for MoE models only")
        self.layers = int(model.config.num_hidden_layers)
        self.k = next(iter(self.routers.values())).top_k
        self.calls: dict[int, list[torch.Tensor]] = {i: [] for i in self.routers}
        self._hooks: list = []

    def __enter__(self) -> RoutingRecorder:
        for i, mod in self.routers.items():
            self._hooks.append(mod.register_forward_hook(self._keep(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _keep(self, layer: int):
        def hook(_mod, _args, out):
            self.calls[layer].append(out[2].detach().to("cpu", torch.int16))
        return hook

    def per_row(self, prompt_mask: torch.Tensor, new_lengths: list[int]) -> list[torch.Tensor]:
        """Each row's ``(prompt tokens + new tokens, layers, k)`` choices, for a chunk whose left-padded prompts
        had ``prompt_mask`` (B, P) and whose rows kept ``new_lengths`` new tokens."""
        B, P = prompt_mask.shape
        full = torch.full((B, P + max(new_lengths, default=0), self.layers, self.k), NONE, dtype=torch.int16)
        for i, calls in self.calls.items():
            seq = torch.cat([c.view(B, -1, self.k) for c in calls], 1)[:, :full.shape[1]]  # forwards in order
            full[:, :seq.shape[1], i] = seq
        out = []
        for b in range(B):
            p = int(prompt_mask[b].sum())
            out.append(full[b, P - p:P + new_lengths[b]].clone())
        return out


__all__ = ["NONE", "RoutingRecorder", "routers"]
