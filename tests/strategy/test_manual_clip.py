"""Manual optimization's clip_gradients, deferred to the averaged gradients (strategy/manual_clip.py)."""
from __future__ import annotations

import torch

from lightning_ft.strategy.manual_clip import DeferredClip


class Plugin:
    def __init__(self) -> None:
        self.calls: list[tuple[int, float, str]] = []

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm="norm"):
        self.calls.append((id(optimizer), clip_val, getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)))


def test_recorded_in_the_step_applied_after_the_exchange_and_repeated_by_catch_ups():
    p = torch.nn.Parameter(torch.zeros(2))
    opt_d, opt_g = torch.optim.SGD([p], lr=0.1), torch.optim.SGD([p], lr=0.1)
    plugin = Plugin()
    clip = DeferredClip(plugin, lambda: [opt_d, opt_g])
    plugin.clip_gradients(opt_d, 0.5, "norm")  # what LightningModule.clip_gradients ends in
    assert plugin.calls == [] and clip.pending == {0: (0.5, "norm")}  # not on the local gradients
    clip.apply(1, opt_g)
    assert plugin.calls == []  # the generator asked for none
    clip.apply(0, opt_d)  # after the exchange (a retry applies it again to its own average)
    assert plugin.calls == [(id(opt_d), 0.5, "norm")]
    clip.stepped(0, trained=True)
    clip.stepped(1, trained=True)
    assert clip.pending == {} and clip.last == {0: (0.5, "norm")}

    restarted = DeferredClip(Plugin(), lambda: [opt_d, opt_g])  # a catch-up carries `last`
    restarted.load_state_dict(clip.state_dict())
    restarted.catch_up(0, opt_d)
    restarted.catch_up(1, opt_g)
    assert restarted._plugin.calls == [(id(opt_d), 0.5, "norm")]

    plugin.clip_gradients(opt_d, 0.5, "value")
    clip.stepped(0, trained=False)  # others trained this step: the last committed clip stays
    assert clip.last == {0: (0.5, "norm")}
    clip.stepped(0, trained=True)  # a committed step that asked for none: catch-ups clip none
    assert clip.last == {}


def test_a_lightning_optimizer_is_matched_to_its_torch_optimizer():
    p = torch.nn.Parameter(torch.zeros(2))
    opt_d, opt_g = torch.optim.SGD([p], lr=0.1), torch.optim.SGD([p], lr=0.1)
    from lightning.pytorch.core.optimizer import LightningOptimizer

    clip = DeferredClip(Plugin(), lambda: [opt_d, opt_g])
    assert clip.index(LightningOptimizer(opt_g)) == 1 and clip.index(opt_d) == 0
