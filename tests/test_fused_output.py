"""The fused output layer in the real Megatron actor (CPU, gloo): with ``forward_backward(output="hidden")`` the
loss gets the final hidden states and the output weight and computes logits only chunk by chunk at the response
positions; it must give the log-probs, entropies and gradients (of the hidden states entering the output layer, of
the output weight, of every parameter) of the unfused path, at TP=1, TP=2 and TP=2 with sequence parallelism,
with tied and untied embeddings."""

import pytest
import torch

from hf_reference import TINY_QWEN2, hf_state_dict
from multiproc import run_on_ranks

BATCH, SEQ = 3, 20


def _batch(vocab: int):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab, (BATCH, SEQ + 1), generator=g)
    mask = torch.zeros(BATCH, SEQ)
    mask[0, 6:] = 1
    mask[1, 9:14] = 1  # a short response, then padding
    mask[2, 3:] = 1
    from megatron_dynamo.trainer.batch import UpdateBatch

    return UpdateBatch(input_ids=ids[:, :-1], labels=ids[:, 1:], loss_mask=mask, advantages=torch.zeros(BATCH),
                       loss_weight=torch.ones(BATCH, dtype=torch.float64), sample_index=torch.arange(BATCH))


def _loss_fn(model_output, micro_batch):
    from megatron_dynamo.trainer.actor import OutputLayerInput
    from megatron_dynamo.trainer.policy_loss import response_token_stats

    # chunk_size 7: several chunks, the last one partial
    stats, _, mask = response_token_stats(model_output, micro_batch, 0.7, 7)
    weights = torch.linspace(-1.0, 2.0, stats.logp.numel())
    loss = -(stats.logp * weights).sum() / 40.0
    return loss, {"logp": stats.logp.detach(), "entropy": stats.entropy, "sum_pi2_lambda": stats.sum_pi2_lambda,
                  "loss": loss.detach(), "fused": torch.tensor(isinstance(model_output, OutputLayerInput))}


def _worker(rank, world_size, tp, sequence_parallel, tied):
    from megatron_dynamo.models.mappings import unwrap_model
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig

    runtime.init_distributed(runtime.ParallelConfig(tensor_parallel=tp, sequence_parallel=sequence_parallel), seed=0)
    state = hf_state_dict(TINY_QWEN2, tie_word_embeddings=tied)
    config = {**__import__("json").load(open(TINY_QWEN2)), "tie_word_embeddings": tied}
    actor = MegatronActor(config, optim=OptimConfig(lr=1e-3), hf_weights=state.__getitem__,
                          sequence_parallel=sequence_parallel)
    layer = unwrap_model(actor.chunks[0]).output_layer
    hidden_grads = []

    def keep_input_grad(module, args):
        # the output layer's input (the final norm's output; [S/tp, B, h] under sequence parallelism)
        args[0].register_hook(lambda g: hidden_grads.append(g.detach().clone()))

    handle = layer.register_forward_pre_hook(keep_input_grad)
    batch = _batch(actor.arch.vocab_size)
    out = {}
    for output in ("logits", "hidden"):
        hidden_grads.clear()
        (result,) = actor.forward_backward([batch], _loss_fn, output=output)
        grads = {name: p.main_grad.clone() for name, p in actor.named_parameters()}
        out[output] = {**{k: result[k].clone() for k in ("logp", "entropy", "sum_pi2_lambda", "loss", "fused")},
                       "hidden_grad": hidden_grads[0], "grads": grads}
        actor.zero_grad()
    handle.remove()
    return out


def _assert_same(a, b, rel=1e-5, atol=1e-7):
    assert a.shape == b.shape
    scale = max(a.abs().max().item(), 1e-12)
    assert (a - b).abs().max().item() <= rel * scale + atol, ((a - b).abs().max().item(), scale)


@pytest.mark.distributed
@pytest.mark.parametrize("tp,sequence_parallel,tied", [(1, False, False), (1, False, True), (2, False, True),
                                                       (2, True, False)],
                         ids=["tp1", "tp1-tied", "tp2-tied", "tp2-sp"])
def test_fused_output_layer_equals_the_logits_path(tp, sequence_parallel, tied):
    for rank_result in run_on_ranks(_worker, tp, tp, sequence_parallel, tied):
        plain, fused = rank_result["logits"], rank_result["hidden"]
        assert fused["fused"].item() and not plain["fused"].item()
        for key in ("logp", "entropy", "sum_pi2_lambda"):
            _assert_same(fused[key], plain[key])
        assert fused["loss"].item() == pytest.approx(plain["loss"].item(), rel=1e-6)
        assert plain["hidden_grad"].abs().max() > 0
        _assert_same(fused["hidden_grad"], plain["hidden_grad"])
        output_weight = [n for n in plain["grads"] if "output_layer" in n or "word_embeddings" in n]
        assert output_weight, list(plain["grads"])
        for name, grad in plain["grads"].items():
            assert grad.abs().max() > 0, name
            _assert_same(fused["grads"][name], grad)
