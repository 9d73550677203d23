"""The memory plan against what a run keeps (issue 54, item 1): the tiny Qwen models (dense Qwen2, dense Qwen3 with
q/k norms, Qwen3-MoE) train a step on CPU with Megatron's local layers, and every tensor autograd saves for the
backward is counted by storage (``torch.autograd.graph.saved_tensors_hooks``), per decoder layer.

- Per layer and token, recompute off and selective: exactly :func:`memory_plan.layer_activation_bytes` with
  ``kernels="local"`` (what Megatron's local layers keep beside Transformer Engine's: ``launch/local_activations.py``).
- Full recompute: the layers keep nothing; the checkpoints keep each layer's input (the plan's b h a token a layer)
  and the rotary table once.
- Pipeline parallel 2, four micro-batches under 1F1B: the most bytes the layers of each stage hold at once are
  :func:`memory_plan.in_flight` micro-batches (2 on stage 0, 1 on stage 1) of the per-layer plan.
- Weights, the gradient buffer and Adam's state: the plan's terms in fp32, measured on the model's tensors.

Transformer Engine's kernels (flash attention, the fused SwiGLU), what the GPU recipes use, need a GPU; the terms both
share (norms, q/k/v, the MLP's fc1, the experts' routed copies, the router's top-k, recompute, the schedule's in-flight
count) are checked here."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from hf_reference import (TINY_QWEN2, TINY_QWEN3, TINY_QWEN3_MOE, hf_checkpoint_state_dict, hf_state_dict,
                          reference_moe_model)
from multiproc import run_on_ranks

from megatron_dynamo.launch import memory_plan as mp
from megatron_dynamo.models.qwen import load_hf_config, parse_qwen_config

SEQUENCES, LENGTH = 2, 48  # one micro-batch: 2 sequences of 48 tokens
TOKENS = SEQUENCES * LENGTH
CONFIGS = {"qwen2": TINY_QWEN2, "qwen3": TINY_QWEN3, "qwen3_moe": TINY_QWEN3_MOE}


def _state(config: str, directory: str) -> dict[str, torch.Tensor]:
    if "moe" in config:  # per-expert tensor names, as checkpoints hold them
        return hf_checkpoint_state_dict(reference_moe_model(config), directory)
    return hf_state_dict(config)


def _architecture(config: str):
    return parse_qwen_config(load_hf_config(config))


def _loss(denominator: float):
    from megatron.core import tensor_parallel

    def loss_fn(logits, mb):
        loss = (tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), mb["labels"]) * mb["loss_mask"]).sum()
        return loss / denominator, {"loss": loss.detach()}

    return loss_fn


def _micro_batch(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 128, (SEQUENCES, LENGTH + 1), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(SEQUENCES, LENGTH)}


class SavedBytes:
    """Counts the storages autograd saves in the forward (not those a backward's recompute saves), per decoder layer
    (``"other"`` outside every layer), and the most bytes the layers hold at once: a saved tensor is released when
    its graph node has run its backward."""

    def __init__(self, actor):
        self.params = {p.data_ptr() for _, p in actor.named_parameters()}
        self.by_layer: dict = collections.defaultdict(dict)
        self.live: dict[int, list[int]] = {}  # storage -> [references, bytes], saves inside layers only
        self.live_bytes = self.peak = 0
        self.layer = None
        self.calls = collections.Counter()  # forwards per layer: a storage freed in a backward is reused later
        chunk = actor.chunks[0]
        layers = [m for m in chunk.modules() if type(m).__name__ == "TransformerLayer"]
        for index, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda module, args, index=index: self._enter(index))
            layer.register_forward_hook(lambda module, args, output: setattr(self, "layer", None))
        self.layers = len(layers)

    def _enter(self, index: int) -> None:
        self.layer = index
        if torch._C._current_graph_task_id() == -1:
            self.calls[index] += 1

    def _pack(self, tensor):
        if torch._C._current_graph_task_id() != -1 or tensor.data_ptr() in self.params:
            return tensor  # a recompute inside the backward, or a parameter
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if self.layer is None:
            self.by_layer["other"][key] = size
            return tensor
        self.by_layer[self.layer][(self.calls[self.layer], key)] = size
        return _Held(self, key, size, tensor)

    def _hold(self, key: int, size: int) -> None:
        entry = self.live.setdefault(key, [0, size])
        if entry[0] == 0:
            self.live_bytes += size
            self.peak = max(self.peak, self.live_bytes)
        entry[0] += 1

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self.live[key]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: getattr(saved, "tensor", saved))

    def per_token(self, layer, micro_batches: int = 1) -> float:
        return sum(self.by_layer[layer].values()) / (micro_batches * TOKENS)


class _Held:
    def __init__(self, counter: SavedBytes, key: int, size: int, tensor):
        self.counter, self.key, self.tensor = counter, key, tensor
        counter._hold(key, size)

    def __del__(self):
        self.counter._release(self.key)


@pytest.fixture(scope="module")
def one_rank():
    from megatron_dynamo.parallel import runtime

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)
    yield
    runtime.shutdown()


def _measure(config: str, recompute: str, directory: str):
    from megatron_dynamo.models.qwen import recompute_kwargs
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig

    actor = MegatronActor(config, optim=OptimConfig(lr=1e-3), hf_weights=_state(config, directory).__getitem__,
                          **recompute_kwargs(recompute))
    counter = SavedBytes(actor)
    with counter.hooks():
        actor.forward_backward([_micro_batch(0)], _loss(TOKENS))
    return actor, counter


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_layer_keeps_what_the_plan_says(name, one_rank, tmp_path):
    config = CONFIGS[name]
    arch = _architecture(config)
    kept = {}
    for recompute in mp.RECOMPUTE:
        _, counter = _measure(config, recompute, str(tmp_path / recompute))
        kept[recompute] = counter
        if recompute == "full":
            continue
        setup = mp.Setup(micro_batch_tokens=TOKENS, dtype="fp32", recompute=recompute, kernels="local",
                         sequence_length=LENGTH)
        for layer in range(counter.layers):
            planned = mp.layer_activation_bytes(arch, setup, arch.is_moe_layer(layer), recompute)
            # To 0.1%: selective recompute's checkpoint also keeps a 4-byte scalar a micro-batch.
            assert counter.per_token(layer) == pytest.approx(planned, rel=1e-3), (name, recompute, layer)
    # Recompute off must not be what the plan for Transformer Engine says (local layers keep more): the test tells them
    # apart.
    gpu = mp.layer_activation_bytes(arch, mp.Setup(micro_batch_tokens=TOKENS, dtype="fp32"), False)
    assert kept["off"].per_token(0) > 1.15 * gpu
    # Full recompute: nothing inside the layers; outside them, each layer's input (b h a token) and, once, the
    # rotary table (fp32, d a position) beside what the embedding and the loss keep with recompute off.
    full = kept["full"]
    assert all(full.per_token(layer) == 0 for layer in range(full.layers))
    checkpoints = full.per_token("other") - kept["off"].per_token("other")
    planned = full.layers * mp.layer_activation_bytes(arch, mp.Setup(micro_batch_tokens=TOKENS, dtype="fp32"),
                                                      False, "full")
    assert checkpoints == pytest.approx(planned + 4 * arch.head_dim * LENGTH / TOKENS, rel=1e-6)


def test_weights_gradients_and_optimizer_state_are_the_plans_terms(one_rank, tmp_path):
    from megatron.core.optimizer import ChainedOptimizer

    for name in ("qwen3", "qwen3_moe"):
        config = CONFIGS[name]
        actor, _ = _measure(config, "off", str(tmp_path / name))
        actor.optimizer_step()  # Adam makes its state at the first step
        setup = mp.Setup(micro_batch_tokens=TOKENS, dtype="fp32", distributed_optimizer=False, kernels="local",
                         sequence_length=LENGTH)
        terms = {term.name: term.bytes for term in mp.training_terms(_architecture(config), setup, 0)}
        weights = sum(p.numel() * p.element_size() for _, p in actor.named_parameters())
        gradients = sum(buffer.grad_data.numel() * buffer.grad_data.element_size()
                        for chunk in actor.chunks for buffer in (*chunk.buffers, *chunk.expert_parallel_buffers))
        optimizers = (actor.optimizer.chained_optimizers if isinstance(actor.optimizer, ChainedOptimizer)
                      else [actor.optimizer])
        state = sum(value.numel() * value.element_size() for optimizer in optimizers
                    for per_param in optimizer.optimizer.state.values() for value in per_param.values()
                    if torch.is_tensor(value) and value.dim() > 0)
        assert weights == terms["weights"], name
        assert gradients == pytest.approx(terms["gradients"], rel=0.01), name  # Megatron pads its buffers
        assert state == terms["optimizer"], name


def _pipeline_worker(rank, world_size, config, state):
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig

    info = runtime.init_distributed(runtime.ParallelConfig(pipeline_parallel=2), seed=0)
    actor = MegatronActor(config, optim=OptimConfig(lr=1e-3), hf_weights=state.__getitem__)
    counter = SavedBytes(actor)
    with counter.hooks():
        actor.forward_backward([_micro_batch(seed) for seed in range(4)], _loss(4 * TOKENS))
    first = info.pp_rank * counter.layers  # this stage's layers: a contiguous run of the model's
    return {"stage": info.pp_rank, "peak": counter.peak, "layers": list(range(first, first + counter.layers)),
            "per_token": [counter.per_token(i, micro_batches=4) for i in range(counter.layers)]}


@pytest.mark.distributed
def test_each_pipeline_stage_holds_the_plans_micro_batches_in_flight(tmp_path):
    # One model: the in-flight count is the schedule's; the MoE model has a dense layer on stage 0 and MoE layers.
    name = "qwen3_moe"
    config = CONFIGS[name]
    arch = _architecture(config)
    setup = mp.Setup(micro_batch_tokens=TOKENS, dtype="fp32", pipeline_parallel=2, kernels="local",
                     sequence_length=LENGTH)
    for stage in run_on_ranks(_pipeline_worker, 2, config, _state(config, str(tmp_path))):
        assert [arch.is_moe_layer(i) for i in stage["layers"]] == \
            [arch.is_moe_layer(i) for i in mp.stage_layers(arch, 2, stage["stage"])]
        per_micro_batch = TOKENS * sum(mp.layer_activation_bytes(arch, setup, arch.is_moe_layer(i))
                                       for i in stage["layers"])
        assert stage["per_token"] == pytest.approx(
            [mp.layer_activation_bytes(arch, setup, arch.is_moe_layer(i)) for i in stage["layers"]], rel=1e-6)
        count = mp.in_flight(setup, stage["stage"])
        assert count == 2 - stage["stage"]
        # Measured 0.99 of it (2026-12-02): the issue asks for 15%; a 2% bound keeps the in-flight count honest
        # (one micro-batch more or less is 50-100%).
        assert stage["peak"] == pytest.approx(count * per_micro_batch, rel=0.02), (name, stage["stage"])


def test_local_kernels_need_the_sequence_length_and_known_values():
    arch = _architecture(TINY_QWEN3)
    with pytest.raises(ValueError, match="kernels"):
        mp.layer_activation_bytes(arch, mp.Setup(micro_batch_tokens=1, kernels="tpu"), False)
    with pytest.raises(ValueError, match="sequence_length"):
        mp.layer_activation_bytes(arch, mp.Setup(micro_batch_tokens=TOKENS, kernels="local"), False)
    longer = dataclasses.replace(mp.Setup(micro_batch_tokens=TOKENS, dtype="fp32", kernels="local"),
                                 sequence_length=2 * LENGTH)
    shorter = dataclasses.replace(longer, sequence_length=LENGTH)
    # The attention scores grow with the sequence (a x S fp32 a token), the rotary table with its positions.
    assert mp.layer_activation_bytes(arch, longer, False) - mp.layer_activation_bytes(arch, shorter, False) == \
        4 * (arch.num_attention_heads * LENGTH + 2 * arch.head_dim * LENGTH / TOKENS)
