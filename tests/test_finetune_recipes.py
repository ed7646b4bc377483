"""The shipped fine-tuning recipes, sized by ``meshtrain plan`` on the hardware they name: LoRA
on Llama 3 8B fits 8 × 80 GiB, QLoRA on Llama 3 70B fits 2 × 80 GiB; only adapters carry
gradients and optimizer states, and the NF4 base is a quarter of a 16-bit one."""

from __future__ import annotations

import pytest

from meshtrain.cli import main
from meshtrain.recipes import load_recipe
from meshtrain.recipes.sizing import size_recipe

GIB = 2**30


@pytest.mark.parametrize(("recipe", "world"), [("llama3_8b_lora", 8), ("llama3_70b_qlora", 2)])
def test_finetune_recipe_fits_the_devices_it_names(
    recipe: str, world: int, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torchao")  # the NF4 base
    sizing = size_recipe(load_recipe(recipe), world=world, device_memory="80GiB")
    memory = sizing.footprint.memory
    assert sizing.footprint.fits, sizing.footprint.format()
    trainable = [p for p in sizing.plan.params if p.trainable]
    frozen = [p for p in sizing.plan.params if not p.trainable]
    assert trainable and frozen
    assert all(p.fqn.endswith(("lora_A", "lora_B")) for p in trainable)
    # gradients and AdamW's two states only for the adapters: a few hundred MiB, not the base's
    assert memory.grads < 0.5 * GIB and memory.optimizer_states < 1 * GIB
    assert main(["plan", recipe, "--world", str(world), "--device-memory", "80GiB"]) == 0
    assert "fits in 80.00 GiB per device" in capsys.readouterr().out


def test_the_70b_qlora_base_is_about_35_gb() -> None:
    pytest.importorskip("torchao")
    sizing = size_recipe(load_recipe("llama3_70b_qlora"), world=1)
    nf4 = sum(p.bytes_at_rest for p in sizing.plan.params if p.storage == "nf4")
    # 4 bits per weight plus the block scales: 0.516 bytes per element
    assert 34e9 < nf4 < 37e9, nf4
    full = sizing.footprint.memory.params
    assert full < 45e9  # plus the fp32 embedding, head and norms
