"""A model's weights moved onto transparent huge pages keep their values, objects, views and ties."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dualserve.models.huge_pages import host_mode, place_on_huge_pages

needs_thp = pytest.mark.skipif(host_mode() not in ("always", "madvise"), reason="no transparent huge pages here")


def region_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address``."""
    fields: dict[str, str] = {}
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(300, 64)
        self.proj = nn.Linear(64, 64)
        self.head = nn.Linear(64, 300, bias=False)
        self.head.weight = self.embed.weight  # one parameter, two modules
        self.register_buffer("packed", torch.randint(0, 255, (4096, 96), dtype=torch.uint8))
        self.register_buffer("half_view", self.packed[:, 32:64])  # a view into another buffer's storage


@needs_thp
def test_weights_move_with_their_values_objects_views_and_ties():
    torch.manual_seed(0)
    model = Tied()
    before = {name: t.clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    objects = {name: id(t) for name, t in [*model.named_parameters(), *model.named_buffers()]}
    held = model.proj.weight  # what a loaded graph holds: the tensor object itself
    moved = place_on_huge_pages(model, min_bytes=0)
    assert moved >= model.packed.numel()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert id(t) == objects[name]
        assert torch.equal(t, before[name]), name
    assert model.head.weight is model.embed.weight
    assert model.half_view.untyped_storage().data_ptr() == model.packed.untyped_storage().data_ptr()
    model.packed[0, 40] = 7  # still a view
    assert model.half_view[0, 8] == 7
    assert region_of(held.data_ptr()).get("THPeligible") == "1"
    assert model.proj.weight.requires_grad
    x = torch.randn(3, 64)
    assert torch.equal(model.proj(x), nn.functional.linear(x, before["proj.weight"], before["proj.bias"]))


@needs_thp
def test_each_weight_keeps_a_storage_of_its_own_size():
    """A module saved alone (a graph build's child gets one) saves its own bytes, not the mapping's."""
    model = Tied()
    place_on_huge_pages(model, min_bytes=0)
    assert model.proj.weight.untyped_storage().nbytes() == 64 * 64 * 4
    assert model.packed.untyped_storage().nbytes() == 4096 * 96


def test_small_models_and_hosts_without_huge_pages_are_left_alone(monkeypatch, tmp_path):
    model = Tied()
    address = model.packed.data_ptr()
    assert place_on_huge_pages(model) == 0  # under MIN_BYTES
    assert model.packed.data_ptr() == address
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    monkeypatch.setattr("dualserve.models.huge_pages.MODE", mode)
    assert host_mode() == "never"
    assert place_on_huge_pages(model, min_bytes=0) == 0
    assert model.packed.data_ptr() == address


@needs_thp
def test_a_loaded_model_s_weights_are_on_huge_pages(default_gguf, cache_dir):
    """``load_model`` places what it built: the served format's packed weights and the norms alike."""
    from dualserve.models.loader import load_model
    from dualserve.models.quant import Dot8Linear

    model = load_model(default_gguf, cache_dir=cache_dir, quantization="w4a16").model
    layers = [m for m in model.modules() if isinstance(m, Dot8Linear)]
    assert layers
    for t in (layers[0].packed, layers[-1].d, next(model.parameters())):
        assert region_of(t.data_ptr()).get("THPeligible") == "1"
