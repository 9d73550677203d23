"""The trainer's policy: :class:`~megatron_dynamo.models.megatron_model.MegatronModel` (the model chunks and the
forward/backward through Megatron's pipeline schedules) wrapped for training: DDP and Megatron's optimizer.

Gradients are summed over micro-batches and data-parallel ranks, never averaged: the loss carries the global
normalisation (see the loss-normalisation note of ``models.megatron_model``).

The model-side names (``OutputLayerInput``, ``pad_micro_batches``, ``block_causal_mask``, ...) are re-exported
from here for the trainer's importers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_dynamo.models.megatron_model import (LossFn, MegatronModel, MicroBatch, ModelOutput, OutputLayerInput,
                                                    block_causal_mask, packed_model_inputs, pad_micro_batches)
from megatron_dynamo.models.moe_routing import RoutingPass
from megatron_dynamo.models.qwen import QwenArchitecture
from megatron_dynamo.trainer.batch import UpdateBatch

__all__ = ["LossFn", "MegatronActor", "MegatronModel", "MicroBatch", "ModelOutput", "OptimConfig",
           "OutputLayerInput", "StepResult", "block_causal_mask", "packed_model_inputs", "pad_micro_batches"]


@dataclass(frozen=True)
class OptimConfig:
    """AdamW through Megatron's optimizer (paper, Table 3: lr 1e-6, weight decay 0.01, gradient clip 1.0).

    Keys:
        lr {> 0}: the RL learning rate.
        weight_decay {>= 0}: AdamW's decoupled weight decay.
        adam_beta1 {[0, 1)}: Adam's first-moment decay.
        adam_beta2 {[0, 1)}: Adam's second-moment decay.
        adam_eps: Adam's epsilon.
        clip_grad {>= 0}: the largest gradient norm; 0: no clipping.
        use_distributed_optimizer: shard the optimizer state over the data-parallel ranks (Megatron's).
    """

    lr: float = 1e-6
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False

    def validate(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optim.{name} must lie in [0, 1), got {getattr(self, name)}")
        if self.clip_grad < 0:
            raise ValueError(f"optim.clip_grad must be >= 0 (0 disables clipping), got {self.clip_grad}")


@dataclass(frozen=True)
class StepResult:
    update_successful: bool
    grad_norm: float | None


class MegatronActor(MegatronModel):
    """A Qwen policy in Megatron-Core for the current parallel state (call ``runtime.init_distributed`` first).

    ``optim=None`` builds an inference-only model (no DDP wrapper, no optimizer), as :class:`MegatronModel` does.
    ``hf_weights(name)`` returns an HF tensor by name: when given, those weights are loaded (before the optimizer
    copies any parameter); otherwise the model keeps Megatron's seeded random initialisation.
    """

    def __init__(self, model_config: QwenArchitecture | dict | str, dtype: str = "fp32",
                 optim: OptimConfig | None = None, use_te: bool | None = None,
                 hf_weights: Callable[[str], torch.Tensor] | None = None, **config_overrides):
        if optim is not None:
            optim.validate()
        super().__init__(model_config, dtype=dtype, use_te=use_te, hf_weights=hf_weights, **config_overrides)
        self.optim_config = optim
        self.optimizer = None
        if optim is not None:
            self._wrap_for_training(optim)

    def forward_backward(self, micro_batches, loss_fn: LossFn, forward_only: bool = False,
                         output: ModelOutput = "fp32_logits", routing: RoutingPass | None = None) -> list[dict]:
        """:meth:`MegatronModel.forward_backward` on the trainer's micro-batches (:class:`UpdateBatch`): the model
        takes their tensors by name, and ``loss_fn`` gets each back as an ``UpdateBatch`` (on the model's device;
        under pipeline parallelism padded to one shape). Micro-batches given as dicts of tensors pass as they are."""
        if not micro_batches or not isinstance(micro_batches[0], UpdateBatch):
            return super().forward_backward(micro_batches, loss_fn, forward_only, output, routing)

        def update_batch_loss(model_output, tensors: dict):
            return loss_fn(model_output, UpdateBatch(**tensors))

        return super().forward_backward([mb.tensors() for mb in micro_batches], update_batch_loss, forward_only,
                                        output, routing)

    # ------------------------------------------------------------------ setup
    def _wrap_for_training(self, optim: OptimConfig) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=optim.use_distributed_optimizer)
        self.chunks = [
            DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=chunk,
                                    disable_bucketing=i > 0)
            for i, chunk in enumerate(self.chunks)]
        # Gradients are summed, never divided: the loss carries the global normalisation (module docstring).
        self.config.finalize_model_grads_func = lambda model, *args, **kwargs: finalize_model_grads(model, None)
        self.config.no_sync_func = [c.no_sync for c in self.chunks]
        if len(self.chunks) == 1:
            self.config.no_sync_func = self.config.no_sync_func[0]
        opt_config = OptimizerConfig(
            optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.adam_beta1,
            adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps, clip_grad=optim.clip_grad,
            bf16=self.config.bf16, params_dtype=self.config.params_dtype,
            use_distributed_optimizer=optim.use_distributed_optimizer)
        self.optimizer = get_megatron_optimizer(opt_config, self.chunks)
        _fuse_torch_adam(self.optimizer)

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            if hasattr(chunk, "zero_grad_buffer"):
                chunk.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    def optimizer_step(self) -> StepResult:
        """Clip gradients (optim.clip_grad), step the optimizer, and zero the gradient buffers.

        Without a loss scaler (fp32, and bf16 here) Megatron's optimizer steps on NaN/inf gradients. So this runs
        the parts of Megatron's ``step()`` itself, with a check in between: the global gradient norm (over the
        model-parallel shards) must be finite on every rank, else nothing is stepped, the weights and the
        optimizer state stay as they are, and the result says ``update_successful=False``. The norm is computed
        once and serves the clipping, as in ``ChainedOptimizer.step``."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        optimizer = self.optimizer
        if optimizer is None:
            raise RuntimeError("this actor was built without an optimizer (optim=None)")
        found_inf = bool(optimizer.prepare_grads())  # main grads ready; True only with a loss scaler
        grad_norm = float(optimizer.get_grad_norm() or 0.0)
        finite = torch.tensor([0.0 if found_inf or not math.isfinite(grad_norm) else 1.0], device=self.device)
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
        if finite.item() == 0:
            self.zero_grad()
            return StepResult(False, grad_norm)
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            params = [] if getattr(inner, "is_stub_optimizer", False) else inner.get_parameters()
            if params and inner.config.clip_grad > 0:
                clip_grad_by_total_norm_fp32(
                    params, max_norm=inner.config.clip_grad, total_norm=grad_norm,
                    use_decoupled_grad=inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        ok = optimizer.step_with_ready_grads()
        self.zero_grad()
        return StepResult(bool(ok), grad_norm)


def _fuse_torch_adam(optimizer) -> None:
    """torch's Adam/AdamW, Megatron's optimizer where neither Transformer Engine nor apex is installed, in torch's
    fused form where every parameter is on the CPU: one kernel per parameter in place of a dozen elementwise ops
    (the same update up to float rounding). GPU optimizers (TE's or apex's FusedAdam) are left as they are."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = getattr(inner, "optimizer", None)
        if not isinstance(adam, torch.optim.Adam):
            continue
        if all(p.device.type == "cpu" for group in adam.param_groups for p in group["params"]):
            adam.defaults.update(fused=True, foreach=False)
            for group in adam.param_groups:
                group.update(fused=True, foreach=False)
