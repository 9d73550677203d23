"""Training a mixture-of-experts policy: routing replay (megatron-core's RouterReplay driven per micro-batch:
``models/moe_routing.py``), the routers' metrics (``trainer/moe_update.py``, ``metrics.moe_metrics``), and the same
losses and gradients at expert parallel 2 as at 1.

References are computed here from the weights and the layer inputs (float64 where it applies: the router's logits,
softmax, top-k, the Switch load-balancing loss, an expert layer's output), never by the code under test.
"""

from __future__ import annotations

import pytest
import torch

from hf_reference import TINY_QWEN3_MOE, hf_checkpoint_state_dict, read_hf_checkpoint, reference_moe_model
from megatron_dynamo.config import ConfigError
from megatron_dynamo.parallel.topology import JobTopology
from megatron_dynamo.rollout.exchange import ScoredResponses, gather_rollout
from megatron_dynamo.rollout.rollout_batch import RolloutBatch
from megatron_dynamo.trainer.config import load_run_config
from multiproc import run_on_ranks
from test_moe_models import CPU_DEFAULT, _colocated, _parallel

EXPERTS, TOP_K, MOE_LAYERS = 8, 2, (1, 2, 3)  # tiny-qwen3-moe: layer 0 dense
AUX_COEF = 0.01


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """tiny-qwen3-moe's HF checkpoint with decisive routers (HF's init routes almost uniformly)."""
    model = reference_moe_model(TINY_QWEN3_MOE)
    directory = tmp_path_factory.mktemp("moe_ckpt")
    hf_checkpoint_state_dict(model, directory)
    return str(directory)


def samples(count: int = 4, seed: int = 1):
    """Samples of different lengths (padded micro-batches then hold padding)."""
    from megatron_dynamo.trainer.batch import Sample

    g = torch.Generator().manual_seed(seed)
    return [Sample(i, f"p{i}", tuple(torch.randint(1, 128, (5 + i % 2,), generator=g).tolist()),
                   tuple(torch.randint(1, 128, (3 + i,), generator=g).tolist()), 1.0, 1.0 - 0.5 * i)
            for i in range(count)]


# ---------------------------------------------------------------------------------------------- in the ranks
def _actor(checkpoint: str, replay: str, parallel=None, aux: float = AUX_COEF, **overrides):
    from megatron_dynamo.models.qwen_moe import MoEConfig
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig

    runtime.init_distributed(parallel or runtime.ParallelConfig(), seed=0)
    state = read_hf_checkpoint(checkpoint)
    return MegatronActor(TINY_QWEN3_MOE, optim=OptimConfig(lr=1e-3), hf_weights=state.__getitem__,
                         moe=MoEConfig(aux_loss_coef=aux, routing_replay=replay), **overrides)


def _logp_loss(denominator: float, kept: list):
    """Per-token policy-gradient-like loss (advantage x log-prob over the global token count); keeps each
    micro-batch's fp32 logits and log-probs."""

    def loss_fn(logits, mb):
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, mb.labels.unsqueeze(-1)).squeeze(-1)
        kept.append((logits.detach().clone(), logp.detach().clone()))
        weights = mb.loss_mask * mb.advantages.unsqueeze(-1)
        return -(logp * weights).sum() / denominator, {}

    return loss_fn


def _grads(actor) -> dict[str, torch.Tensor]:
    return {name: p.main_grad.detach().clone() for name, p in actor.named_parameters()}


def _run(actor, micro, routing=None, forward_only=False):
    """One forward(/backward) of ``micro``: the per-micro-batch (logits, logp) and, after a backward, the
    gradients (then zeroed)."""
    kept = []
    denominator = float(sum(mb.loss_mask.sum() for mb in micro))
    actor.forward_backward(micro, _logp_loss(denominator, kept), forward_only=forward_only, routing=routing)
    if forward_only:
        return kept, None
    grads = _grads(actor)  # summed over micro-batches (and data-parallel ranks: the schedule's finalize)
    actor.zero_grad()
    return kept, grads


def _layer_io(actor, layer: int):
    """Hooks keeping the input and output of MoE layer ``layer``'s MoELayer (the router's input: the normed
    hidden states)."""
    from megatron_dynamo.models.mappings import unwrap_model

    mlp = unwrap_model(actor.chunks[0]).decoder.layers[layer].mlp
    seen = []
    # (copies: the layer's input is changed in place after it)
    mlp.register_forward_hook(lambda module, args, output: seen.append((args[0].detach().clone(),
                                                                        output[0].detach().clone())))
    return mlp, seen


def _expert_layer_output(mlp, hidden: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The output of a Qwen3-MoE expert layer that sends each token to ``experts`` [tokens, k], in float64 from
    its weights: softmax over the k chosen router logits (norm_topk_prob), each expert a SwiGLU MLP."""
    h = hidden.reshape(-1, hidden.shape[-1]).double()
    logits = h @ mlp.router.weight.double().t()
    weights = torch.softmax(logits.gather(1, experts.long()), dim=-1)
    out = torch.zeros_like(h)
    for e, expert in enumerate(mlp.experts.local_experts):
        gate, up = (h @ expert.linear_fc1.weight.double().t()).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ expert.linear_fc2.weight.double().t()
        out += (weights * (experts == e)).sum(-1, keepdim=True) * y
    return out.reshape(hidden.shape)


def _replay_worker(rank, world_size, checkpoint):
    from megatron_dynamo.models.moe_routing import RoutingPass
    from megatron_dynamo.trainer.batch import make_micro_batches

    actor = _actor(checkpoint, "old_policy")
    micro = make_micro_batches(samples(), 2, 0, fixed_shape=False)
    recording = RoutingPass(record=True)
    recorded_run, _ = _run(actor, micro, recording, forward_only=True)
    free_run, free_grads = _run(actor, micro)
    for index, mb in enumerate(micro):
        mb.routed_experts = recording.recorded[index]
    replayed_run, _ = _run(actor, micro, forward_only=True)
    _, replayed_grads = _run(actor, micro)
    # Other experts: the next ones of each choice (still k distinct experts a token).
    mlp, seen = _layer_io(actor, 1)
    for mb, rec in zip(micro, recording.recorded.values()):
        mb.routed_experts = (rec + 1) % EXPERTS
    other_run, _ = _run(actor, micro, forward_only=True)
    expected = [_expert_layer_output(mlp, h, (rec[:, :, 0].transpose(0, 1).reshape(-1, TOP_K) + 1) % EXPERTS)
                for (h, _), rec in zip(seen, recording.recorded.values())]
    return {"recorded": recording.recorded, "recorded_run": recorded_run, "replayed_run": replayed_run,
            "free_grads": free_grads, "replayed_grads": replayed_grads, "other_run": other_run,
            "other_layer": [out for _, out in seen], "other_expected": expected}


@pytest.mark.distributed
def test_replay_reproduces_the_recorded_forward_and_keeps_the_router_gradient(checkpoint):
    (result,) = run_on_ranks(_replay_worker, 1, checkpoint)
    recorded = result["recorded"]
    assert sorted(recorded) == [0, 1] and recorded[0].shape == (2, 11, 3, TOP_K)
    assert recorded[0].dtype == torch.int16 and int(recorded[0].min()) >= 0 and int(recorded[0].max()) < EXPERTS
    assert all((r.sort(-1).values[..., 1:] > r.sort(-1).values[..., :-1]).all() for r in recorded.values())
    for (logits_a, logp_a), (logits_b, logp_b) in zip(result["recorded_run"], result["replayed_run"]):
        assert torch.equal(logits_a, logits_b) and torch.equal(logp_a, logp_b)
    free, replayed = result["free_grads"], result["replayed_grads"]
    assert free.keys() == replayed.keys()
    routers = [name for name in free if name.endswith("router.weight")]
    assert len(routers) == 3 and all(free[name].abs().max() > 0 for name in routers)
    for name in free:
        assert torch.equal(free[name], replayed[name]), name
    # Replayed other experts: the layer computes exactly what sending each token to them gives.
    for got, expected in zip(result["other_layer"], result["other_expected"]):
        assert (got.double() - expected).abs().max() < 1e-5
    changed = [(a[1] - b[1]).abs().max() for a, b in zip(result["recorded_run"], result["other_run"])]
    assert min(changed) > 1e-2


def _rollout_replay_worker(rank, world_size, checkpoint):
    """``moe.routing_replay: rollout`` through the update: the experts Megatron records (RECORD) stand in for the
    engine's, cut per response as GenerationResponse.routed_experts holds them; then other experts."""
    from megatron_dynamo.models.moe_routing import RoutingPass
    from megatron_dynamo.trainer.config import load_run_config
    from megatron_dynamo.trainer.step import StageTimer
    from megatron_dynamo.trainer.update import PolicyUpdater

    actor = _actor(checkpoint, "rollout")
    updater = PolicyUpdater(load_run_config(CPU_DEFAULT, ["moe.routing_replay=rollout", "trainer.micro_batch_size=2",
                                                          "trainer.micro_batch_tokens=0"]), actor, 0)
    batch = samples()
    micro = updater.micro_batches_for(batch)
    recording = RoutingPass(record=True)
    out = {"free": updater.forward_token_stats(micro)}  # the router's own choice
    actor.forward_backward(micro, _logp_loss(1.0, []), forward_only=True, routing=recording)
    engine = [None] * len(batch)  # [prompt + response - 1, MoE layers, k] per response
    for index, mb in enumerate(micro):
        for row, sample in enumerate(mb.sample_index.tolist()):
            if sample >= 0:
                s = batch[sample]
                engine[sample] = recording.recorded[index][row, :len(s.prompt_tokens) + len(s.response_tokens) - 1]
    for name, experts in (("same", engine), ("other", [(e + 1) % EXPERTS for e in engine])):
        for s, e in zip(batch, experts):
            s.routed_experts = e
        micro = updater.micro_batches_for(batch)
        mlp, seen = _layer_io(actor, 1)
        out[name] = updater.forward_token_stats(micro)
        mlp._forward_hooks.clear()
        layer = []
        for (hidden, got), mb in zip(seen, micro):  # real tokens only: padding rows carry no experts (-1)
            tokens = mb.routed_experts[:, :, 0].transpose(0, 1).reshape(-1, TOP_K)  # the router's order
            real = (tokens >= 0).all(-1)
            expected = _expert_layer_output(mlp, hidden, tokens.clamp(min=0)).reshape(-1, hidden.shape[-1])
            layer.append(float((got.reshape(-1, got.shape[-1]).double() - expected)[real].abs().max()))
        out[f"{name}_layer_error"] = max(layer)
        out[f"{name}_metrics"] = updater.update(batch, [s.prompt_id for s in batch], StageTimer(), 1)
    return out


@pytest.mark.distributed
def test_rollout_replay_uses_the_engines_experts(checkpoint):
    (result,) = run_on_ranks(_rollout_replay_worker, 1, checkpoint)
    # The old-log-prob pass over the engine's experts = the one routing for itself. Not bit for bit: the padding
    # positions of a micro-batch have no engine experts and go to experts spread over all E, not the router's choice,
    # which changes the row counts of the experts' GEMMs (float32 rounding of other rows: measured 4.8e-7; 0
    # without padding).
    for index in range(4):
        for stat in ("logp", "entropy"):
            assert (result["same"][index][stat] - result["free"][index][stat]).abs().max() <= 2e-6
    # Other experts: other log-probs, and the first MoE layer computes what sending each token to them gives.
    assert max((result["other"][i]["logp"] - result["same"][i]["logp"]).abs().max() for i in range(4)) > 1e-2
    assert result["same_layer_error"] < 1e-5 and result["other_layer_error"] < 1e-5
    # The update's forward runs on the weights that chose the "engine's" experts: its router agrees with all.
    assert result["same_metrics"]["moe/routing_agreement"] == 1.0
    assert result["other_metrics"]["moe/routing_agreement"] < 0.7


def _cpu_recompute() -> None:
    """Megatron's activation checkpointing saves and restores the CUDA generator's state around the recomputed
    forward; without CUDA (gloo) the CPU generator's stands in. The models have no dropout: no state is drawn."""
    from megatron.core.tensor_parallel import random as mpu_random

    mpu_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mpu_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


def _pipeline_recompute_worker(rank, world_size, checkpoint):
    """PP2 (each stage routes its own layers) with full activation recompute (the backward's recomputed forward
    must replay each micro-batch's own experts: megatron-core's REPLAY_BACKWARD)."""
    from megatron_dynamo.models.moe_routing import RoutingPass
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.batch import make_micro_batches

    _cpu_recompute()
    actor = _actor(checkpoint, "old_policy", runtime.ParallelConfig(pipeline_parallel=2),
                   recompute_granularity="selective", recompute_modules=["moe"])
    micro = make_micro_batches(samples(6), 2, 0)
    recording = RoutingPass(record=True)
    recorded_run, _ = _run(actor, micro, recording, forward_only=True)
    free_run, free_grads = _run(actor, micro)
    for index, mb in enumerate(micro):
        mb.routed_experts = recording.recorded[index][:, :mb.input_ids.shape[1]]
    replayed_run, replayed_grads = _run(actor, micro)
    return {"recorded": recording.recorded, "recorded_run": recorded_run, "replayed_run": replayed_run,
            "free_grads": free_grads, "replayed_grads": replayed_grads}


@pytest.mark.distributed
def test_replay_with_pipeline_stages_and_activation_recompute(checkpoint):
    stages = run_on_ranks(_pipeline_recompute_worker, 2, checkpoint)
    # Stage 0 holds layers 0-1 (MoE layer 0), stage 1 layers 2-3 (MoE layers 1, 2): each records its own.
    for stage, layers in zip(stages, ([0], [1, 2])):
        for recorded in stage["recorded"].values():
            assert recorded.shape[2] == 3 and sorted(set(range(3)) - set(layers)) == [
                layer for layer in range(3) if (recorded[:, :, layer] == -1).all()]
        for name, grad in stage["free_grads"].items():
            assert torch.equal(grad, stage["replayed_grads"][name]), name
    last = stages[1]
    assert len(last["recorded_run"]) == 3 and not stages[0]["recorded_run"]
    for (logits_a, logp_a), (logits_b, logp_b) in zip(last["recorded_run"], last["replayed_run"]):
        assert torch.equal(logits_a, logits_b) and torch.equal(logp_a, logp_b)


def _metrics_worker(rank, world_size, checkpoint, replay):
    from megatron_dynamo.trainer.batch import make_micro_batches
    from megatron_dynamo.trainer.moe_update import MoEUpdate

    actor = _actor(checkpoint, replay)
    micro = make_micro_batches(samples(), 2, 0, fixed_shape=False)
    seen = {layer: _layer_io(actor, layer) for layer in MOE_LAYERS}
    given = [torch.randint(0, EXPERTS, (*mb.input_ids.shape, 3, 1), generator=torch.Generator().manual_seed(i))
             for i, mb in enumerate(micro)]
    for mb, g in zip(micro, given):  # the given experts: distinct pairs (e, e + 1)
        mb.routed_experts = torch.cat([g, (g + 1) % EXPERTS], dim=-1).to(torch.int16)
    moe = MoEUpdate(actor, replay)
    moe.start()
    _, grads = _run(actor, micro, moe.training_pass(micro))
    routers = {layer: seen[layer][0].router.weight.detach().clone() for layer in MOE_LAYERS}
    inputs = {layer: [h for h, _ in seen[layer][1]] for layer in MOE_LAYERS}
    actor.config.moe_aux_loss_coeff = 0.0  # the routers read it at every call: no aux loss
    _, without_aux = _run(actor, micro)
    last = f"decoder.layers.{MOE_LAYERS[-1]}.mlp.router.weight"  # no aux loss after it reaches it another way
    lengths = [[len(s.prompt_tokens) + len(s.response_tokens) - 1 for s in group]
               for group in (samples()[:2], samples()[2:])]
    return {"metrics": moe.metrics(), "inputs": inputs, "routers": routers,
            "given": [mb.routed_experts for mb in micro], "lengths": lengths,
            "aux_grad": grads[last] - without_aux[last]}


def _reference_moe_metrics(result, replayed: bool) -> dict[str, float]:
    """The moe/* metrics from the layers' inputs and router weights, in float64."""
    out, entropy, tokens, agreement, aux = {}, 0.0, 0, 0.0, 0.0
    for index, layer in enumerate(MOE_LAYERS):
        counts = torch.zeros(EXPERTS, dtype=torch.float64)
        for h, given, lengths in zip(result["inputs"][layer], result["given"], result["lengths"]):
            logits = h.reshape(-1, h.shape[-1]).double() @ result["routers"][layer].double().t()
            probs = torch.softmax(logits, dim=-1)
            own = logits.topk(TOP_K, dim=-1).indices
            # the Switch loss of the micro-batch, on every token the router saw (padding too), own top-k
            routed = torch.zeros_like(probs).scatter(1, own, 1.0)
            aux += EXPERTS * (routed.sum(0) / (logits.shape[0] * TOP_K) * probs.mean(0)).sum() / 2 / 3
            # the real tokens, in the router's order: [s, b] flattened
            real = (torch.arange(h.shape[0]).unsqueeze(1) < torch.tensor(lengths).unsqueeze(0)).reshape(-1)
            ref = given[:, :, index].transpose(0, 1).reshape(-1, TOP_K).long()
            used = ref if replayed else own
            counts += torch.zeros_like(probs).scatter(1, used, 1.0)[real].sum(0)
            entropy += float(-(probs * probs.log()).sum(-1)[real].sum())
            tokens += int(real.sum())
            agreement += float((own.unsqueeze(-1) == ref.unsqueeze(-2)).any(-1)[real].sum())
        out[f"moe/expert_load_layer_{layer}"] = float(counts.max() / counts.mean())
    out["moe/expert_load_max_over_mean"] = max(out.values())
    out.update({"moe/router_entropy": entropy / tokens, "moe/routing_agreement": agreement / (tokens * TOP_K),
                "moe/aux_loss": float(aux)})
    return out


def _switch_loss_gradient(result, layer: int) -> torch.Tensor:
    """d/dW of the mean over micro-batches of layer ``layer``'s Switch load-balancing loss, float64 autograd."""
    weight = result["routers"][layer].double().requires_grad_(True)
    losses = []
    for h in result["inputs"][layer]:
        logits = h.reshape(-1, h.shape[-1]).double() @ weight.t()
        probs = torch.softmax(logits, dim=-1)
        routed = torch.zeros_like(probs).scatter(1, logits.topk(TOP_K, dim=-1).indices, 1.0)
        losses.append(EXPERTS * (routed.sum(0) / (logits.shape[0] * TOP_K) * probs.mean(0)).sum())
    (grad,) = torch.autograd.grad(torch.stack(losses).mean(), weight)
    return grad


@pytest.mark.distributed
@pytest.mark.parametrize("replay", ["off", "rollout"])
def test_moe_metrics_match_an_independent_computation(checkpoint, replay):
    """With replay the experts used (and so the load) are the given ones; without, the router's own; entropy,
    agreement with the given experts and the aux loss are the router's either way. The aux loss enters the
    gradient as aux_loss_coef x its mean over the micro-batches (megatron-core alone would weigh each micro-batch's
    by its token count: 22 times too much here)."""
    (result,) = run_on_ranks(_metrics_worker, 1, checkpoint, replay)
    expected = _reference_moe_metrics(result, replayed=replay != "off")
    assert result["metrics"].keys() == expected.keys()
    for key, value in expected.items():
        assert result["metrics"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    reference = AUX_COEF * _switch_loss_gradient(result, MOE_LAYERS[-1])
    assert (result["aux_grad"].double() - reference).abs().max() <= 1e-5 * reference.abs().max()


# ---------------------------------------------------------------------------------------------- EP 2 = EP 1
def _expert_parallel_worker(rank, world_size, checkpoint):
    """EP ``world_size`` (DP ``world_size`` for the dense part): rank r trains micro-batch r of the same batch
    that one EP1 rank trains whole; gradients by global name (local expert j of rank r is expert r * E/EP + j)."""
    from megatron_dynamo.models.moe_routing import RoutingPass
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.batch import make_micro_batches
    from megatron_dynamo.trainer.moe_update import MoEUpdate

    actor = _actor(checkpoint, "old_policy", runtime.ParallelConfig(expert_parallel=world_size))
    micro = make_micro_batches(samples(), 2, 0, fixed_shape=False)
    mine = micro[rank::world_size]
    denominator = float(sum(mb.loss_mask.sum() for mb in micro))
    moe = MoEUpdate(actor, "old_policy")
    moe.start()
    kept = []
    results = actor.forward_backward(mine, _loss_with_value(denominator, kept), routing=moe.training_pass(mine))
    per_rank = EXPERTS // world_size
    grads = {}
    for name, grad in _grads(actor).items():
        if ".local_experts." in name:
            head, tail = name.split(".local_experts.")
            local, rest = tail.split(".", 1)
            name = f"{head}.local_experts.{rank * per_rank + int(local)}.{rest}"
        grads[name] = grad
    loss = torch.tensor([sum(float(r["loss"]) for r in results)])
    torch.distributed.all_reduce(loss)
    metrics = moe.metrics()
    # Replay across the all-to-all: this rank's recorded experts, replayed, give the same forward.
    recording = RoutingPass(record=True)
    recorded_run, _ = _run(actor, mine, recording, forward_only=True)
    for index, mb in enumerate(mine):
        mb.routed_experts = recording.recorded[index]
    replayed_run, _ = _run(actor, mine, forward_only=True)
    replay_equal = all(torch.equal(a[0], b[0]) for a, b in zip(recorded_run, replayed_run))
    return {"loss": float(loss), "grads": grads, "metrics": metrics, "replay_equal": replay_equal}


def _loss_with_value(denominator, kept):
    inner = _logp_loss(denominator, kept)

    def loss_fn(logits, mb):
        loss, _ = inner(logits, mb)
        return loss, {"loss": loss.detach()}

    return loss_fn


@pytest.mark.distributed
def test_expert_parallel_2_gives_the_losses_and_gradients_of_1(checkpoint):
    (single,) = run_on_ranks(_expert_parallel_worker, 1, checkpoint)
    ranks = run_on_ranks(_expert_parallel_worker, 2, checkpoint)
    assert ranks[0]["loss"] == pytest.approx(single["loss"], rel=1e-6)
    grads = {**ranks[1]["grads"], **ranks[0]["grads"]}  # experts 4-7 from rank 1; the rest all-reduced, alike
    assert grads.keys() == single["grads"].keys()
    # Not bit for bit: at EP2 an expert's weight gradient is one GEMM over both ranks' tokens, at EP1 the sum of two
    # micro-batches' GEMMs (another float32 summation order), and the dense gradients take that difference back.
    # Measured: at most 3.5e-6 of a tensor's largest entry (a rarely chosen expert); 1e-5 is the bound.
    for name, expected in single["grads"].items():
        assert (grads[name] - expected).abs().max() <= 1e-5 * expected.abs().max(), name
    for key, value in single["metrics"].items():
        assert ranks[0]["metrics"][key] == pytest.approx(value, rel=1e-6), key
    assert single["replay_equal"] and all(rank["replay_equal"] for rank in ranks)


# ---------------------------------------------------------------------------------------------- the rollout side
def test_routed_experts_travel_with_the_rollout():
    experts = [torch.randint(0, EXPERTS, (n, 3, TOP_K), dtype=torch.int16) for n in (7, 9)]
    scored = ScoredResponses([1, 0], [0, 0], [(5, 6), (7, 8, 9)], [False, False], [1.0, 0.0], [None, None], experts)
    merged = gather_rollout(scored)  # one process: canonical order
    assert [tuple(t.shape) for t in merged.routed_experts] == [(9, 3, 2), (7, 3, 2)]
    assert torch.equal(merged.routed_experts[0], experts[1])
    batch = RolloutBatch(step=1, version=0, example_indices=[0, 1], prompt_tokens=[(1, 2, 3), (4, 5)], counts=[1, 1],
                         variance_ratio=1.0, responses=merged)
    back = RolloutBatch.from_tensors(batch.to_tensors())
    assert all(torch.equal(a, b) for a, b in zip(back.responses.routed_experts, merged.routed_experts))
    without = ScoredResponses([0], [0], [(1,)], [False], [1.0], [None])
    batch = RolloutBatch(step=1, version=0, example_indices=[0], prompt_tokens=[(1, 2)], counts=[1],
                         variance_ratio=1.0, responses=without)
    assert all(e is None for e in RolloutBatch.from_tensors(batch.to_tensors()).responses.routed_experts)


@pytest.mark.parametrize("overrides,message", [
    (["moe.routing_replay=always"], "moe.routing_replay: must be one of ('off', 'rollout', 'old_policy'), got "
                                    "'always'"),
])
def test_routing_replay_setting_is_checked_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_run_config(CPU_DEFAULT, overrides)
    assert str(error.value) == message


def test_routing_replay_is_refused_on_a_dense_model(tmp_path):
    from megatron_dynamo.trainer.preflight import check_model_on_layout, check_run_inputs

    run = load_run_config(CPU_DEFAULT, ["moe.routing_replay=rollout", f"trainer.output_dir={tmp_path}"])
    with pytest.raises(ConfigError) as error:
        check_run_inputs(run, local_only=True, resume=False)
    assert str(error.value) == "moe.routing_replay: must be off for a dense model (no router to replay), got 'rollout'"
    with pytest.raises(ConfigError) as error:  # the model check `dynamo launch` runs too
        check_model_on_layout(run)
    assert str(error.value).startswith("moe.routing_replay: must be off for a dense model")


def test_the_run_header_names_the_experts_split():
    assert JobTopology.resolve(2, _parallel(ep=2), _colocated()).describe() == (
        "DP 2 x TP 1 x PP 1 EP=2 (expert TP 1); 2 rollout engines of 1 rank")
    assert JobTopology.resolve(2, _parallel(), _colocated()).describe() == (
        "DP 2 x TP 1 x PP 1; 2 rollout engines of 1 rank")


def test_padding_without_experts_is_spread_over_every_expert_and_expert_rank():
    """Replay fills the tokens that carry no experts (-1: padding, a whole micro-batch that only evens out ranks) with
    k distinct experts that walk round all E: per expert the padding's load differs by at most one slot, per
    expert-parallel rank by at most one slot an expert. Real tokens keep the experts they were given."""
    from megatron_dynamo.models.moe_routing import replay_targets

    experts, k, tokens = 8, 2, 40  # 35 padding tokens: 70 slots, not a multiple of the 8 experts
    given = torch.full((tokens, k), -1, dtype=torch.int16)
    given[:5] = torch.tensor([[3, 7]] * 5, dtype=torch.int16)  # five real tokens, then padding
    targets = replay_targets(given, experts)
    assert targets.dtype == torch.int64 and torch.equal(targets[:5], torch.tensor([[3, 7]] * 5))
    padding = targets[5:]
    assert all(len(set(row.tolist())) == k for row in padding)  # a valid top-k: distinct ids
    load = torch.bincount(padding.flatten(), minlength=experts)
    assert load.max() - load.min() <= 1, load
    for expert_parallel in (2, 4):  # a rank's experts: at most one slot more each than another rank's
        per_rank = load.reshape(expert_parallel, -1).sum(1)
        assert per_rank.max() - per_rank.min() <= experts // expert_parallel, (expert_parallel, per_rank)
    # The old filler (experts 0..k-1 for every padding token) put all of it on expert rank 0.
    assert load[:k].sum() < padding.numel()
