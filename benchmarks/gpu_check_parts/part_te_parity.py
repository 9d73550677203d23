"""Part ``te_parity``: the Transformer-Engine layer spec against the local spec with the same HF weights
(logits and one backward's gradients, fp32 and bf16)."""

from __future__ import annotations

import traceback
from typing import Any

from benchmarks.gpu_check_parts.common import (Ctx, error_line, free_cuda, hf_state, init_megatron, rel_error,
                                               shutdown_megatron, small_qwen2)


def _grads_by_hf_name(actor) -> dict[str, Any]:
    from megatron_dynamo.models.mappings import chunk_mappings, unwrap_model

    grads = {}
    for chunk in actor.chunks:
        for mapping, param in chunk_mappings(unwrap_model(chunk), actor.arch, actor.use_te):
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is None:
                raise RuntimeError(f"{mapping.megatron_name}: no gradient after backward")
            for name, g in zip(mapping.hf_names, mapping.to_hf([grad.detach()])):
                grads[name] = g.float().cpu()
    return grads


def part_te_parity(ctx: Ctx) -> dict[str, Any]:
    import torch

    from megatron_dynamo.trainer.actor import MegatronActor

    init_megatron(ctx, seed=0)
    cfg = small_qwen2()
    state = hf_state(cfg)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (2, 257), generator=gen)
    batch = {"input_ids": ids[:, :-1].to(ctx.device()), "labels": ids[:, 1:].to(ctx.device())}

    def loss_fn(logits, mb):
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), mb["labels"].reshape(-1))
        return loss, {"logits": logits.detach().float().cpu(), "loss": loss.detach()}

    limits = {"fp32": {"logits": 5e-3, "grad_all": 2e-2, "grad_worst": 5e-2},
              "bf16": {"logits": 3e-2, "grad_all": 8e-2, "grad_worst": 0.25}}
    rows, failures = [], []
    numbers: dict[str, Any] = {"shape": "hidden 512, 8 heads / 2 KV, head_dim 64, 4 layers, vocab 4096, 2x256 tokens"}
    for dtype in ("fp32", "bf16"):
        out = {}
        try:
            for use_te in (True, False):
                actor = MegatronActor(cfg, dtype=dtype, optim=None, use_te=use_te, hf_weights=state.__getitem__)
                result = actor.forward_backward([batch], loss_fn)[0]
                out[use_te] = (result["logits"], float(result["loss"]), _grads_by_hf_name(actor))
                del actor
                free_cuda(ctx)
        except Exception as exc:  # noqa: BLE001 - the other dtype still runs
            traceback.print_exc()
            failures.append(f"{dtype}, {'TE' if use_te else 'local'} spec: {error_line(exc)}")
            free_cuda(ctx)
            continue
        (lt, loss_te, gt), (ll, loss_local, gl) = out[True], out[False]
        if set(gt) != set(gl):
            raise RuntimeError(f"gradient names differ: {sorted(set(gt) ^ set(gl))[:5]}")
        per_tensor = {name: rel_error(gt[name], gl[name]) for name in gl}
        worst = max(per_tensor, key=per_tensor.get)
        flat_te = torch.cat([gt[n].reshape(-1) for n in sorted(gl)])
        flat_local = torch.cat([gl[n].reshape(-1) for n in sorted(gl)])
        row = {"dtype": dtype, "logits rel": rel_error(lt, ll), "logits max abs": (lt - ll).abs().max().item(),
               "loss TE": loss_te, "loss local": loss_local, "grads rel (all)": rel_error(flat_te, flat_local),
               "grads rel (worst)": per_tensor[worst], "worst tensor": worst}
        rows.append(row)
        lim = limits[dtype]
        for key, value in (("logits", row["logits rel"]), ("grad_all", row["grads rel (all)"]),
                           ("grad_worst", row["grads rel (worst)"])):
            if not value <= lim[key]:  # NaN fails too
                failures.append(f"{dtype} {key} rel {value:.3g} > {lim[key]}")
    shutdown_megatron()
    numbers["limits (rel. L2 error)"] = "; ".join(f"{d}: " + ", ".join(f"{k} {v}" for k, v in lim.items())
                                                 for d, lim in limits.items())
    return {"status": "fail" if failures else "pass",
            "summary": "; ".join(failures) or "; ".join(f"{r['dtype']}: logits {r['logits rel']:.2g}, grads "
                                                         f"{r['grads rel (all)']:.2g}" for r in rows),
            "numbers": numbers, "tables": {"TE spec vs local spec": rows}}
