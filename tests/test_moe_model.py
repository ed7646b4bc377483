"""meshtrain's reference MoE in one process: shapes and init, the expert kernels against a
reference written here, routing, the balance loss's gradient against an explicit
``loss + coef · aux`` in plain PyTorch, loss-free bias balancing, statistics, and equivalence with
transformers' Qwen3-MoE (logits, balance loss, weights both ways).

Numerical contracts tested (fp32, CPU):

- ``grouped_mm`` and ``loop`` kernels: bitwise equal outputs and gradients (torch's CPU
  ``_grouped_mm`` runs each group's product with the same matmul as the loop); bf16 too.
- either kernel against the per-token reference below: ``|Δ| <= 1e-5 · max|reference|``
  elementwise. Each output is a sum of dot products of length ≤ 64 in another blocking order,
  whose rounding is bounded by ``n · u ≈ 64 · 6e-8 ≈ 4e-6`` of the terms' magnitude; measured
  ≤ 6e-7 over 5 seeds.
- against transformers' ``Qwen3MoeForCausalLM`` (eager attention): logits within 2e-6
  (measured 2.4e-7 at |logits| ≤ 0.7): the same routing and the same products, with attention
  and RMSNorm computed in a different order.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from meshtrain.errors import CheckpointError, PlanError
from meshtrain.lower.materialise import materialise
from meshtrain.models import GroupedExperts, MoEConfig, Router, build_moe, moe_layers, moe_stats
from meshtrain.models.moe import MoE, default_rules
from meshtrain.models.moe_hf import (
    check_moe_config,
    hf_config_from_moe,
    moe_config_from_hf,
    moe_hf_sources,
    moe_to_hf,
)
from meshtrain.recipes.pretrained import _export_target, load_pretrained
from meshtrain.spec import P
from meshtrain.spec.mesh import Mesh
from meshtrain.train.hf.load import load_hf

logging.getLogger("transformers").setLevel(logging.ERROR)


def _tokens(batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


# --- configuration, shapes, init ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"top_k": 9}, "top_k=9"),
        ({"first_dense_layers": 4}, "first_dense_layers=4"),
        ({"dense_inter": 0}, "dense_inter"),
        ({"balance": "switch"}, "balance='switch'"),
        ({"score_func": "relu"}, "score_func='relu'"),
        ({"n_experts": 0}, "n_experts=0"),
        ({"dim": 66}, "n_heads"),
    ],
)
def test_config_refuses_invalid_settings_by_name(overrides: dict, named: str) -> None:
    with pytest.raises(PlanError, match=named.replace("(", r"\(").replace("[", r"\[")):
        MoEConfig.debug(**overrides)


def test_debug_model_shapes_parameter_count_and_logical_axes() -> None:
    config = MoEConfig.debug()
    model = build_moe(config, device="meta")
    assert sum(p.numel() for p in model.parameters()) == config.num_params()
    layers = moe_layers(model)
    assert list(layers) == ["layers.1", "layers.2"]  # layer 0 is dense
    assert not hasattr(model.layers["0"].feed_forward, "router")
    experts = layers["layers.1"].experts
    assert experts.gate_up_proj.shape == (8, 64, 64) and experts.down_proj.shape == (8, 64, 32)
    from meshtrain.spec.logical import logical_axes

    assert logical_axes(experts) == {
        "gate_up_proj": ("expert", "expert_mlp", "embed"),
        "down_proj": ("expert", "embed", "expert_mlp"),
    }
    logits = build_moe(config)(_tokens())
    assert logits.shape == (2, 16, 256) and torch.isfinite(logits).all()


def test_meta_build_materialises_to_the_cpu_build() -> None:
    config = MoEConfig.debug(balance="bias", qk_norm=True)
    cpu = build_moe(config, seed=3)
    meta = materialise(build_moe(config, device="meta"), seed=3)
    cpu_state, meta_state = cpu.state_dict(keep_vars=True), meta.state_dict(keep_vars=True)
    assert list(cpu_state) == list(meta_state)
    for fqn, tensor in cpu_state.items():
        assert torch.equal(tensor, meta_state[fqn]), fqn
    for router in (ffn.router for ffn in moe_layers(meta).values()):
        assert int(router.pending_tokens.sum()) == 0 and not router.expert_bias.any()
    # depth init: the output projections' std shrinks with the block's index
    stds = [float(cpu.layers[str(i)].feed_forward.experts.down_proj.detach().std()) for i in (1, 2)]
    assert stds[0] > stds[1]


# --- the expert kernels ------------------------------------------------------------------------


def _reference_experts(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Token by token, slot by slot, written from the definition of a SwiGLU expert."""
    inter = down.shape[2]
    rows = []
    for token in range(x.shape[0]):
        total = None
        for slot in range(index.shape[1]):
            expert = int(index[token, slot])
            gate = gate_up[expert, :inter] @ x[token]
            up = gate_up[expert, inter:] @ x[token]
            term = weights[token, slot] * (down[expert] @ (F.silu(gate) * up))
            total = term if total is None else total + term
        rows.append(total)
    return torch.stack(rows)


def _kernel_run(kernel: str, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    x, index, weights, gate_up, down = (t.clone() for t in inputs)
    leaves = [t.requires_grad_() for t in (x, gate_up, down)]
    if kernel == "reference":
        out = _reference_experts(x, index, weights, gate_up, down)
    else:
        experts = GroupedExperts(gate_up.shape[0], gate_up.shape[2], down.shape[2], kernel=kernel)
        experts.gate_up_proj, experts.down_proj = (
            torch.nn.Parameter(leaves[1]),
            torch.nn.Parameter(leaves[2]),
        )
        out = experts(x, index, weights)
        leaves[1:] = [experts.gate_up_proj, experts.down_proj]
    (out.float() * torch.linspace(-1, 1, out.shape[1])).sum().backward()
    return (out.detach(), *(leaf.grad for leaf in leaves))  # type: ignore[misc]


def _expert_inputs(
    seed: int,
    dtype: torch.dtype = torch.float32,
    shape: tuple[int, int, int, int] = (8, 64, 32, 32),
) -> tuple[torch.Tensor, ...]:
    """Tokens, top-2 choices, weights and expert weights; ``shape``: experts, dim, inter, tokens."""
    gen = torch.Generator().manual_seed(seed)
    (experts, dim, inter, tokens), top_k = shape, 2
    index = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    index[:4] = torch.tensor([7, 6])  # expert 0 may get no token at all: empty groups included
    tensors = (
        torch.randn(tokens, dim, generator=gen),
        index,
        torch.rand(tokens, top_k, generator=gen),
        torch.randn(experts, 2 * inter, dim, generator=gen) * 0.1,
        torch.randn(experts, dim, inter, generator=gen) * 0.1,
    )
    return tuple(t if t.dtype == torch.long else t.to(dtype) for t in tensors)


@pytest.mark.parametrize("seed", [0, 1])
def test_grouped_mm_equals_loop_bitwise_and_both_match_the_reference(seed: int) -> None:
    inputs = _expert_inputs(seed)
    grouped, looped = _kernel_run("grouped_mm", inputs), _kernel_run("loop", inputs)
    reference = _kernel_run("reference", inputs)
    for name, a, b, ref in zip(("out", "d_x", "d_gate_up", "d_down"), grouped, looped, reference):
        assert torch.equal(a, b), name
        bound = 1e-5 * float(ref.abs().max())
        assert float((a - ref).abs().max()) <= bound, name


def test_grouped_mm_equals_loop_in_bf16() -> None:
    inputs = _expert_inputs(2, torch.bfloat16, shape=(8, 16, 8, 16))  # bf16 matmuls are slow on CPU
    for name, a, b in zip("xgwd", _kernel_run("grouped_mm", inputs), _kernel_run("loop", inputs)):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), name


def test_auto_falls_back_to_the_loop_where_grouped_mm_cannot_run() -> None:
    experts = GroupedExperts(4, dim=6, inter=6, kernel="grouped_mm")  # 24-byte fp32 rows
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    x, index, weights = torch.randn(3, 6), torch.tensor([[0, 1], [2, 3], [1, 0]]), torch.ones(3, 2)
    with pytest.raises(PlanError, match="kernel='auto'"):
        experts(x, index, weights)
    experts.kernel = "auto"
    loop = GroupedExperts(4, dim=6, inter=6, kernel="loop")
    loop.load_state_dict(experts.state_dict())
    assert torch.equal(experts(x, index, weights), loop(x, index, weights))
    wide = GroupedExperts(4, dim=8, inter=8).double()  # aligned, but fp64: the loop again
    torch.nn.init.normal_(wide.gate_up_proj)
    torch.nn.init.normal_(wide.down_proj)
    x = torch.randn(3, 8, dtype=torch.float64)
    expected = _reference_experts(x, index, weights.double(), wide.gate_up_proj, wide.down_proj)
    torch.testing.assert_close(wide(x, index, weights.double()), expected)


def test_a_slice_of_the_experts_computes_its_tokens_alone() -> None:
    """What an expert-parallel lowering relies on: a module holding experts 4..7 as local
    experts 0..3 gives the routed tokens' terms of the whole module."""
    x, index, weights, gate_up, down = _expert_inputs(3)
    whole = GroupedExperts(8, 64, 32)
    whole.gate_up_proj, whole.down_proj = torch.nn.Parameter(gate_up), torch.nn.Parameter(down)
    local = GroupedExperts(4, 64, 32)
    local.gate_up_proj = torch.nn.Parameter(gate_up[4:].clone())
    local.down_proj = torch.nn.Parameter(down[4:].clone())
    mine = index >= 4
    kept_weights = torch.where(mine, weights, torch.zeros_like(weights))
    full = whole(x, index, kept_weights)  # only experts 4..7 weigh in
    rows = mine.any(1)
    local_out = local(x[rows], (index[rows] - 4).clamp(min=0), kept_weights[rows])
    torch.testing.assert_close(local_out, full[rows], rtol=0, atol=0)


# --- routing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_weights_from_the_scores(score_func: str) -> None:
    router = Router(8, 6, 3, score_func=score_func, norm_topk_prob=True, route_scale=2.5)
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    index, weights, scores = router(x)
    logits = x @ router.weight.T
    expected = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    torch.testing.assert_close(scores, expected)
    chosen = expected.sort(-1, descending=True)
    assert torch.equal(index, chosen.indices[:, :3])
    top = chosen.values[:, :3]
    torch.testing.assert_close(weights, 2.5 * top / top.sum(-1, keepdim=True))
    assert (
        router.tokens_per_expert.tolist() == torch.bincount(index.flatten(), minlength=6).tolist()
    )


def test_router_counts_the_last_forward_or_every_forward_of_a_step() -> None:
    router = Router(dim=8, num_experts=4, top_k=2)
    torch.nn.init.normal_(router.weight)
    first, second = torch.randn(5, 8), torch.randn(3, 8)
    router(first)
    router(second)
    assert int(router.tokens_per_expert.sum()) == 3 * 2  # the last forward's
    router.begin_step()
    router(first)
    router(second)
    assert int(router.tokens_per_expert.sum()) == (5 + 3) * 2  # the step's micro-batches
    assert int(router.pending_tokens.sum()) == (5 + 3 + 5 + 3) * 2


def test_an_evaluation_between_steps_counts_nothing_and_moves_no_bias() -> None:
    """Eval-mode forwards (an evaluation after a step) used to add to the step's counts and to
    the loss-free balancing's pending counts, so the next bias update, and the training after
    it, depended on how often the run evaluated."""
    config = MoEConfig.debug(balance="bias", bias_update_rate=0.01)
    evaluated, plain = build_moe(config, seed=2), build_moe(config, seed=2)
    tokens, held_out = _tokens(batch=2, seed=5), _tokens(batch=3, seed=6)
    for model in (evaluated, plain):
        model.begin_step()
        model(tokens)
    evaluated.eval()
    with torch.no_grad():
        evaluated(held_out)
    evaluated.train()
    assert torch.equal(evaluated.expert_load(), plain.expert_load())
    for ffn, other in zip(moe_layers(evaluated).values(), moe_layers(plain).values()):
        assert torch.equal(ffn.router.tokens_per_expert, other.router.tokens_per_expert)
        assert torch.equal(ffn.last_prob_sums, other.last_prob_sums)
    evaluated.update_expert_bias()
    plain.update_expert_bias()
    for ffn, other in zip(moe_layers(evaluated).values(), moe_layers(plain).values()):
        assert torch.equal(ffn.router.expert_bias, other.router.expert_bias)


def test_router_ties_are_broken_the_same_way_every_time() -> None:
    router = Router(4, 8, 2)
    torch.nn.init.zeros_(router.weight)  # every score equal: all ties
    x = torch.randn(6, 4)
    first = router(x)[0]
    assert torch.equal(first, router(x)[0]) and torch.equal(first[:1], router(x[:1])[0])
    assert (first == first[0]).all()  # the same pair for every token


def test_bias_steers_the_choice_but_not_the_weights() -> None:
    router = Router(4, 4, 1, bias_balancing=True, norm_topk_prob=False)
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(0))
    x = torch.randn(10, 4, generator=torch.Generator().manual_seed(1))
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))
    index, weights, scores = router(x)
    assert (index == 2).all()
    assert torch.equal(weights[:, 0], scores[:, 2])  # the score, not score + bias


# --- balancing ---------------------------------------------------------------------------------


def _router_inputs(model: MoE) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    for ffn in moe_layers(model).values():
        ffn.router.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    return seen


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_balance_loss_trains_like_an_explicit_loss_plus_coef_times_aux(scale: float) -> None:
    """meshtrain: backward of the cross-entropy alone. Reference: the same weights with
    ``balance="none"``, and ``ce + coef · scale · Σ_layers aux`` with aux from transformers'
    ``load_balancing_loss_func`` on each layer's router logits."""
    coef, tokens = 0.05, _tokens(seed=4)
    config = MoEConfig.debug(balance="aux_loss", aux_loss_coef=coef)
    model = build_moe(config, seed=1)
    model.set_aux_loss_scale(scale)
    plain = MoE(MoEConfig.debug(balance="none"))
    plain.load_state_dict(model.state_dict())
    seen = _router_inputs(plain)

    logits = model(tokens)
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    ref_logits = plain(tokens)
    aux = sum(
        load_balancing_loss_func((F.linear(inputs, ffn.router.weight),), 8, 2)
        for inputs, ffn in zip(seen, moe_layers(plain).values())
    )
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), tokens.flatten()) + coef * scale * aux
    ref_loss.backward()

    assert torch.equal(logits, ref_logits)  # the balance loss leaves the logits alone
    torch.testing.assert_close(model.aux_loss(), aux, rtol=1e-6, atol=0)
    router_grads = 0
    for (fqn, param), ref in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=1e-5, atol=1e-8, msg=fqn)
        router_grads += "router" in fqn
    assert router_grads == 2
    # and the balance term is not negligible in the router's gradient
    alone = build_moe(MoEConfig.debug(balance="none"), seed=1)
    F.cross_entropy(alone(tokens).flatten(0, 1), tokens.flatten()).backward()
    router = "layers.1.feed_forward.router.weight"
    grads = dict(model.named_parameters())[router].grad, dict(alone.named_parameters())[router].grad
    assert float((grads[0] - grads[1]).abs().max()) > 1e-3 * scale * float(grads[1].abs().max())


def test_bias_update_from_global_counts_matches_one_process() -> None:
    """Two 'ranks' route half the batch each; the bias moved by their summed counts equals the
    bias one process moves after routing the whole batch."""
    config = MoEConfig.debug(balance="bias", bias_update_rate=0.01)
    whole, halves = build_moe(config, seed=2), [build_moe(config, seed=2) for _ in range(2)]
    tokens = _tokens(batch=4, seed=5)
    whole(tokens)
    for rank, model in enumerate(halves):
        model(tokens[2 * rank : 2 * rank + 2])
    summed = halves[0].expert_load() + halves[1].expert_load()
    assert torch.equal(summed, whole.expert_load())
    assert summed.shape == (2, 8) and int(summed[0].sum()) == 4 * 16 * 2
    expected = [0.01 * torch.sign(c.float().mean() - c.float()) for c in summed]
    whole.update_expert_bias(whole.expert_load())
    for model in halves:
        model.update_expert_bias(summed)
    for model in (whole, *halves):
        biases = [ffn.router.expert_bias for ffn in moe_layers(model).values()]
        assert all(torch.equal(b, e) for b, e in zip(biases, expected))
        assert int(model.expert_load().sum()) == 0  # counting restarts after an update
    with pytest.raises(PlanError, match="2 MoE layers"):
        whole.update_expert_bias(torch.zeros(3, 8))
    with pytest.raises(PlanError, match='balance="bias"'):
        build_moe(MoEConfig.debug()).update_expert_bias(torch.zeros(2, 8))


def test_recomputation_in_backward_counts_tokens_once() -> None:
    model = build_moe(MoEConfig.debug(balance="bias"))
    block, x = model.layers["1"], torch.randn(2, 8, 64, requires_grad=True)
    out = checkpoint(block, x, model.rope_cos, model.rope_sin, use_reentrant=False)
    once = model.expert_load().clone()
    out.sum().backward()
    assert torch.equal(model.expert_load(), once) and int(once[0].sum()) == 2 * 8 * 2


def test_stats_report_counts_ratio_and_balance_loss() -> None:
    model = build_moe(MoEConfig.debug())
    model(_tokens(seed=6))
    stats = moe_stats(model)
    for layer, ffn in moe_layers(model).items():
        counts = stats[f"moe/tokens_per_expert/{layer}"]
        assert sum(counts) == 2 * 16 * 2 and counts == ffn.router.tokens_per_expert.tolist()
        assert stats[f"moe/load_ratio/{layer}"] == pytest.approx(max(counts) / (sum(counts) / 8))
    assert stats["moe/load_ratio"] == max(stats[f"moe/load_ratio/{k}"] for k in moe_layers(model))
    assert stats["moe/balance_loss"] == pytest.approx(float(model.aux_loss()))


def test_default_rules_send_experts_to_ep_when_the_mesh_has_it() -> None:
    model = build_moe(MoEConfig.debug(), device="meta")
    fqn = "layers.1.feed_forward.experts.gate_up_proj"
    with_ep = Mesh(("dp", "ep", "tp"), (2, 2, 1), abstract=True)
    specs = default_rules(mesh=with_ep).resolve(model, with_ep).specs
    assert specs[fqn] == P("ep")
    assert specs["layers.1.feed_forward.router.weight"] == P()
    without = Mesh(("dp", "tp"), (2, 2), abstract=True)
    specs = default_rules(mesh=without).resolve(model, without).specs
    assert specs[fqn] == P() and specs["layers.1.feed_forward.shared_expert.w1.weight"] == P("tp")
    no_tp = Mesh(("dp", "ep"), (2, 2), abstract=True)
    specs = default_rules(mesh=no_tp).resolve(model, no_tp).specs
    assert specs[fqn] == P("ep") and set(specs.values()) == {P(), P("ep")}


# --- transformers' Qwen3-MoE -------------------------------------------------------------------


def _tiny_qwen3_moe(layers: int) -> Qwen3MoeForCausalLM:
    """Written as a user would, from transformers' own config; routers and norms randomised so
    routing is far from uniform and norms are not all ones."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        max_position_embeddings=64,
        router_aux_loss_coef=0.01,
        attn_implementation="eager",
    )
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(std=0.5)
    return model


def _save_fused(hf: Qwen3MoeForCausalLM, directory: Path) -> None:
    hf.config.save_pretrained(directory)
    tensors = {name: t.contiguous() for name, t in hf.state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors"))


@pytest.mark.parametrize("layers", [2, 3])
def test_qwen3_moe_with_the_same_weights_gives_the_same_logits(layers: int, tmp_path: Path) -> None:
    hf = _tiny_qwen3_moe(layers)
    _save_fused(hf, tmp_path)
    config = moe_config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert (config.first_dense_layers, config.qk_norm, config.balance) == (1, True, "aux_loss")
    model = build_moe(config, device="meta").to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(1))
    report = load_hf(tmp_path, model, sources=moe_hf_sources(config))
    assert report.tensors == len(hf.state_dict())
    tokens = _tokens(seed=7)
    with torch.no_grad():
        out = hf(tokens, output_router_logits=True)
        logits = model(tokens)
    assert float((out.logits - logits).abs().max()) <= 2e-6
    stats = moe_stats(model)
    assert stats["moe/load_ratio"] > 1.25  # far from uniform routing: a real test of the choice
    for layer, router_logits in zip(moe_layers(model), out.router_logits):
        chosen = router_logits.softmax(-1).topk(2).indices
        assert (
            stats[f"moe/tokens_per_expert/{layer}"]
            == torch.bincount(chosen.flatten(), minlength=8).tolist()
        )
    if layers == 2:  # transformers pools the layers before its product; per layer they agree
        torch.testing.assert_close(model.aux_loss(), out.aux_loss, rtol=1e-6, atol=0)


def test_weights_round_trip_to_transformers_names_and_layout() -> None:
    hf = _tiny_qwen3_moe(3)
    config = moe_config_from_hf(hf.config.to_dict())
    sources = moe_hf_sources(config)
    state = hf.state_dict()
    model = MoE(config)
    with torch.no_grad():
        for fqn, param in model.named_parameters():
            name, rows = sources[fqn]
            param.copy_(state[name] if rows is None else state[name][rows])
    exported = {}
    for fqn, param in model.named_parameters():
        for name, tensor in moe_to_hf(config, fqn, param.detach()):
            exported[name] = tensor
    assert sorted(exported) == sorted(state)
    for name, tensor in exported.items():
        assert torch.equal(tensor, state[name]), name
    assert moe_config_from_hf(hf_config_from_moe(config)) == config
    back = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf_config_from_moe(config))).eval()
    back.load_state_dict(exported)
    tokens = _tokens(seed=8)
    with torch.no_grad():
        assert float((back(tokens).logits - model(tokens)).abs().max()) <= 2e-6


def test_what_qwen3_moe_cannot_hold_is_refused_by_name() -> None:
    with pytest.raises(CheckpointError, match=r"n_shared_experts=1.*sigmoid.*qk_norm=False"):
        hf_config_from_moe(MoEConfig.debug(score_func="sigmoid"))
    with pytest.raises(CheckpointError, match=r"config.json.*attention_bias"):
        moe_config_from_hf({**_tiny_qwen3_moe(2).config.to_dict(), "attention_bias": True})
    with pytest.raises(CheckpointError, match="not a parameter of meshtrain's MoE"):
        moe_to_hf(MoEConfig.debug(), "layers.1.feed_forward.w1.weight", torch.ones(1))


def test_init_from_a_qwen3_moe_directory_and_export_back(tmp_path: Path) -> None:
    """What a recipe's ``init_from`` and ``meshtrain export`` use: a bias-balanced MoE loads a
    Qwen3-MoE directory (its biases start at zero) and computes the same logits; a model of
    another shape is refused by field; the export target is Qwen3-MoE's config and names."""
    hf = _tiny_qwen3_moe(2)
    _save_fused(hf, tmp_path)
    hf_config = json.loads((tmp_path / "config.json").read_text())
    config = dataclasses.replace(moe_config_from_hf(hf_config), balance="bias")
    model = build_moe(config, seed=5)
    load_pretrained(tmp_path, model)
    tokens = _tokens(seed=9)
    with torch.no_grad():
        assert float((hf(tokens).logits - model(tokens)).abs().max()) <= 2e-6
    assert all(not ffn.router.expert_bias.any() for ffn in moe_layers(model).values())
    other = build_moe(dataclasses.replace(config, n_experts=16), device="meta")
    with pytest.raises(CheckpointError, match="n_experts = 16 here but 8 there"):
        load_pretrained(tmp_path, other)
    check_moe_config(config, hf_config, "config.json")  # balancing may differ
    table = {"name": "moe", "preset": "debug", "n_shared_experts": 0, "qk_norm": True}
    exported, rename, _ = _export_target({"model": table}, tmp_path)
    assert exported["model_type"] == "qwen3_moe" and exported["mlp_only_layers"] == [0]
    assert rename is not None
    assert [
        name for name, _ in rename("layers.2.feed_forward.experts.gate_up_proj", torch.ones(1))
    ] == ["model.layers.2.mlp.experts.gate_up_proj"]
    with pytest.raises(CheckpointError, match="n_shared_experts=1"):
        _export_target({"model": {"name": "moe", "preset": "debug"}}, tmp_path)
