"""Tests of the reference Llama model: shapes, masking, GQA, RoPE, counts, init, stages, names."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from meshtrain.errors import PlanError
from meshtrain.models import LOGICAL_RULES, Llama, LlamaConfig, build_llama, default_rules
from meshtrain.models.llama import _apply_rope
from meshtrain.spec.logical import named_logical_axes

DEBUG = LlamaConfig.debug()


@pytest.fixture(scope="module")
def model() -> Llama:
    return build_llama(DEBUG, seed=0)


def _tokens(batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, DEBUG.vocab_size, (batch, seq), generator=generator)


def _assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    for fqn in state_a:
        _assert_bitwise(state_a[fqn], state_b[fqn])


@torch.no_grad()
def test_forward_shapes(model: Llama) -> None:
    assert model(_tokens(2, 16)).shape == (2, 16, DEBUG.vocab_size)
    assert model(_tokens(1, DEBUG.max_seq_len)).shape == (1, DEBUG.max_seq_len, DEBUG.vocab_size)
    assert model(_tokens(3, 1)).shape == (3, 1, DEBUG.vocab_size)


def test_sequence_longer_than_max_seq_len_raises(model: Llama) -> None:
    with pytest.raises(PlanError, match="max_seq_len"):
        model(_tokens(1, DEBUG.max_seq_len + 1))


@torch.no_grad()
def test_causal_masking(model: Llama) -> None:
    tokens = _tokens(2, 16)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % DEBUG.vocab_size
    logits, changed_logits = model(tokens), model(changed)
    torch.testing.assert_close(changed_logits[:, :10], logits[:, :10], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(changed_logits[:, 10:], logits[:, 10:])


@torch.no_grad()
def test_gqa_matches_explicitly_repeated_kv_heads(model: Llama) -> None:
    attention = model.layers["0"].attention
    x = torch.randn(2, 12, DEBUG.dim, generator=torch.Generator().manual_seed(1))
    cos, sin = model.rope_cos[:12], model.rope_sin[:12]

    def heads(linear: torch.nn.Linear) -> torch.Tensor:
        return linear(x).view(2, 12, -1, DEBUG.head_dim)

    q, k = _apply_rope(heads(attention.wq), cos, sin), _apply_rope(heads(attention.wk), cos, sin)
    v = heads(attention.wv)
    group = DEBUG.n_heads // DEBUG.n_kv_heads
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    )
    expected = attention.wo(out.transpose(1, 2).reshape(2, 12, DEBUG.dim))
    torch.testing.assert_close(attention(x, cos, sin), expected, rtol=1e-6, atol=1e-6)


def test_rope_matches_complex_formulation(model: Llama) -> None:
    x = torch.randn(2, 8, 3, DEBUG.head_dim, generator=torch.Generator().manual_seed(2))
    cos, sin = model.rope_cos[:8], model.rope_sin[:8]
    freqs = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))[None, :, None, :]
    expected = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * freqs)
    torch.testing.assert_close(_apply_rope(x, cos, sin), expected.flatten(-2))


def test_num_params_debug_is_exact(model: Llama) -> None:
    assert DEBUG.num_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "ffn_dim", "known_total"),
    [("llama3_8b", 14336, 8.03e9), ("llama3_70b", 28672, 70.6e9), ("llama3_405b", 53248, 405.9e9)],
)
def test_preset_param_counts_on_meta(name: str, ffn_dim: int, known_total: float) -> None:
    config = LlamaConfig.preset(name)
    meta_model = build_llama(config, device="meta")
    assert all(p.is_meta for p in meta_model.parameters())
    assert config.ffn_dim == ffn_dim
    assert config.num_params() == sum(p.numel() for p in meta_model.parameters())
    assert config.num_params() == pytest.approx(known_total, rel=5e-3)


def test_meta_then_init_equals_direct_init_bitwise() -> None:
    direct = build_llama(DEBUG, seed=3)
    with torch.device("meta"):
        deferred = Llama(DEBUG)
    deferred = deferred.to_empty(device="cpu")
    deferred.init_weights(torch.Generator().manual_seed(3))
    _assert_same_weights(deferred, direct)
    _assert_bitwise(deferred.rope_cos, direct.rope_cos)
    _assert_bitwise(deferred.rope_sin, direct.rope_sin)
    tokens = _tokens()
    with torch.no_grad():
        _assert_bitwise(deferred(tokens), direct(tokens))


def test_init_weights_on_meta_is_a_no_op() -> None:
    meta_model = build_llama(LlamaConfig.llama3_8b(), device="meta")
    meta_model.init_weights(torch.Generator().manual_seed(0))
    assert all(p.is_meta for p in meta_model.parameters()) and meta_model.rope_cos.is_meta


def test_same_seed_same_weights_and_different_seeds_differ(model: Llama) -> None:
    _assert_same_weights(build_llama(DEBUG, seed=0), model)
    other = build_llama(DEBUG, seed=1).state_dict()
    for fqn, tensor in model.state_dict().items():
        if not fqn.endswith("norm.weight"):  # norms are all ones whatever the seed
            assert not torch.equal(tensor, other[fqn]), fqn


def test_init_statistics_are_llama_like(model: Llama) -> None:
    wq = model.layers["0"].attention.wq.weight
    assert 0.018 < wq.std().item() < 0.022
    assert wq.abs().max().item() <= 3 * 0.02
    assert model.layers["1"].feed_forward.w2.weight.std().item() < 0.02 / 2**0.5 * 1.1
    assert all(
        torch.equal(p, torch.ones_like(p)) for n, p in model.named_parameters() if "norm" in n
    )


def test_state_dict_has_stable_torchtitan_fqns(model: Llama) -> None:
    fqns = set(model.state_dict())
    assert "rope_cos" not in fqns and "rope_sin" not in fqns
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    for layer in range(DEBUG.n_layers):
        prefix = f"layers.{layer}."
        expected |= {prefix + "attention_norm.weight", prefix + "ffn_norm.weight"}
        expected |= {f"{prefix}attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")}
        expected |= {f"{prefix}feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
    assert fqns == expected


def test_logical_axes_cover_every_parameter(model: Llama) -> None:
    axes = named_logical_axes(model)
    params = dict(model.named_parameters())
    assert axes.keys() == params.keys()
    for fqn, names in axes.items():
        assert len(names) == params[fqn].dim(), fqn
    assert axes["tok_embeddings.weight"] == ("vocab", "embed")
    assert axes["output.weight"] == ("vocab", "embed")
    assert axes["norm.weight"] == ("norm",)
    assert axes["layers.1.attention.wq.weight"] == ("heads", "embed")
    assert axes["layers.1.attention.wk.weight"] == ("kv_heads", "embed")
    assert axes["layers.1.attention.wo.weight"] == ("embed", "heads")
    assert axes["layers.1.feed_forward.w3.weight"] == ("mlp", "embed")
    assert axes["layers.1.feed_forward.w2.weight"] == ("embed", "mlp")
    used = {name for names in axes.values() for name in names}
    assert used == {name for name, _ in LOGICAL_RULES}


def _stages(seed: int) -> Iterator[Llama]:
    """Two pipeline stages of the debug model: [embeddings, layer 0] and [layer 1, norm, output]."""
    first, second = build_llama(DEBUG, seed=seed), build_llama(DEBUG, seed=seed)
    first.norm = first.output = None
    del first.layers["1"]
    second.tok_embeddings = None
    del second.layers["0"]
    yield from (first, second)


@torch.no_grad()
def test_pipeline_stages_compose_to_the_full_model(model: Llama) -> None:
    first, second = _stages(seed=0)
    assert list(second.layers) == ["1"]
    assert set(second.state_dict()) == {
        fqn for fqn in model.state_dict() if fqn.startswith(("layers.1.", "norm.", "output."))
    }
    tokens = _tokens()
    hidden = first(tokens)
    assert hidden.shape == (2, 16, DEBUG.dim) and hidden.dtype == torch.float32
    _assert_bitwise(second(hidden), model(tokens))


def test_stage_initialises_like_the_same_fqns_of_the_full_model(model: Llama) -> None:
    stage = build_llama(DEBUG, device="meta")
    stage.tok_embeddings = None
    del stage.layers["0"]
    stage = stage.to_empty(device="cpu")
    stage.init_weights(torch.Generator().manual_seed(0))
    full = model.state_dict()
    for fqn, tensor in stage.state_dict().items():
        _assert_bitwise(tensor, full[fqn])


def test_init_weights_fills_the_local_shard_of_a_dtensor(model: Llama) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        sharded = build_llama(DEBUG, seed=7)
        wq = sharded.layers["0"].attention.wq
        local = distribute_tensor(wq.weight.detach(), mesh, [Shard(0)], src_data_rank=None)
        wq.weight = torch.nn.Parameter(local)
        sharded.init_weights(torch.Generator().manual_seed(0))
        half = DEBUG.dim // 2
        _assert_bitwise(wq.weight.to_local(), model.layers["0"].attention.wq.weight[half:])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"dim": 66}, "dim=66"),
        ({"n_kv_heads": 3}, "n_kv_heads=3"),
        ({"dim": 20, "n_heads": 4}, "head_dim"),
        ({"n_layers": 0}, "n_layers=0"),
        ({"vocab_size": -1}, "vocab_size=-1"),
        ({"multiple_of": 2.5}, "multiple_of=2.5"),
        ({"ffn_dim_multiplier": 0.0}, "ffn_dim_multiplier=0.0"),
        ({"norm_eps": 0}, "norm_eps=0"),
        ({"max_seq_len": True}, "max_seq_len=True"),
    ],
)
def test_bad_config_raises_plan_error_naming_the_field(
    overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(PlanError, match=field):
        dataclasses.replace(DEBUG, **overrides)


def test_presets_by_name() -> None:
    assert LlamaConfig.preset("debug") == DEBUG
    assert LlamaConfig.preset("llama3_70b") == LlamaConfig.llama3_70b()
    assert LlamaConfig.preset("debug", n_layers=4).n_layers == 4
    with pytest.raises(PlanError, match="llama3_8b"):
        LlamaConfig.preset("llama3-8b")
    with pytest.raises(PlanError, match="n_layer"):
        LlamaConfig.preset("debug", n_layer=4)


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEBUG.dim = 128  # type: ignore[misc]


def test_activation_checkpoint_wrappers_do_not_change_init(model: Llama) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped = build_llama(DEBUG, device="meta")
    for index, block in list(wrapped.layers.items()):
        wrapped.layers[index] = checkpoint_wrapper(block)
    wrapped = wrapped.to_empty(device="cpu")
    wrapped.init_weights(torch.Generator().manual_seed(0))
    wrapped_fqn = "layers.0._checkpoint_wrapped_module.attention.wq.weight"
    assert wrapped_fqn in dict(wrapped.named_parameters())
    _assert_same_weights(wrapped, model)
    with torch.no_grad():
        _assert_bitwise(wrapped(_tokens()), model(_tokens()))


def test_default_rules_map_logical_names_to_the_given_axes() -> None:
    rules = default_rules(tp="model", fsdp="data")
    assert dict(rules.logical) == {
        "vocab": "model",
        "heads": "model",
        "kv_heads": "model",
        "mlp": "model",
        "embed": None,
        "norm": None,
    }
    assert tuple(rules.fsdp) == ("data",)
    assert all(axis is None for _, axis in default_rules(tp=None).logical)


def test_default_rules_resolve_every_parameter_for_tensor_parallel(model: Llama) -> None:
    from meshtrain.spec.mesh import Mesh
    from meshtrain.spec.partition import P

    specs = default_rules().resolve(model, Mesh(("dp", "tp"), (2, 2))).specs
    assert specs.keys() == dict(model.named_parameters()).keys()
    assert specs["tok_embeddings.weight"] == P("tp") == specs["output.weight"]
    assert specs["layers.0.attention.wq.weight"] == P("tp") == specs["layers.0.attention.wk.weight"]
    assert specs["layers.0.attention.wo.weight"] == P(None, "tp")
    assert specs["layers.1.feed_forward.w1.weight"] == P("tp")
    assert specs["layers.1.feed_forward.w2.weight"] == P(None, "tp")
    assert specs["norm.weight"] == P() == specs["layers.1.ffn_norm.weight"]
    big = build_llama(LlamaConfig.llama3_405b(), device="meta")
    assert len(default_rules().resolve(big, Mesh(("dp", "tp"), (64, 8))).specs) == 1137
