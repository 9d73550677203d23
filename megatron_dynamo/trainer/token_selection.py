"""The baselines' mini-batch-wide token selections, made once per mini-batch before its update.

Fork Tokens, Clip-COV and KL-COV choose tokens over a whole mini-batch (``algorithms/baselines.py``). Each
data-parallel rank holds the old-policy log-probs and entropies of its own share only (from the old-log-prob pass,
no extra forward); one ``all_gather_object`` over the DP group gives every rank the whole mini-batch, which is put
in canonical order (sample index, then response position) so the selection does not depend on the TP/PP/DP layout
or the micro-batch plan. The random draw of Clip-COV is seeded from (trainer seed, step, mini-batch): the same on
every rank. The result goes into each micro-batch as ``selection`` (like ``old_logp``), read by the loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_dynamo.algorithms.baselines import SELECTION_LOSSES, mini_batch_selection
from megatron_dynamo.trainer.batch import token_values


def selection_seed(seed: int, step: int, mini_batch: int) -> int:
    """The seed of one mini-batch's random selection: a function of the run's seed, the step and the mini-batch
    only (never of the rank or the layout)."""
    return (int(seed) * 1_000_003 + int(step) * 10_007 + int(mini_batch)) % (2**63 - 1)


def scatter_selections(loss_cfg, plans, old: dict[int, dict[str, torch.Tensor]], last_stage: bool,
                       dp_group, seed: int, step: int) -> None:
    """Collective over ``dp_group`` (on the last pipeline stage): for every mini-batch of ``plans`` ((samples,
    micro-batches) pairs) the selection of ``loss_cfg.name`` into its micro-batches as ``selection``. ``old``: this
    rank's per-sample old-policy ``logp``/``entropy``. Other stages get zeros (they compute no loss). Nothing
    happens for a loss without selection. The loss reports the selected fraction (``actor/fork_token_frac``,
    ``actor/cov_selected_frac``)."""
    if loss_cfg.name not in SELECTION_LOSSES:
        return
    for index, (mini, micro) in enumerate(plans):
        if not last_stage:
            for mb in micro:
                mb.selection = token_values(mb)
            continue
        mine = {s.index: (old[s.index]["logp"].cpu(), old[s.index]["entropy"].cpu()) for s in mini if s.index in old}
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            parts = [None] * dist.get_world_size(dp_group)
            dist.all_gather_object(parts, mine, group=dp_group)
            mine = {k: v for part in parts for k, v in part.items()}
        order = sorted(mini, key=lambda s: s.index)
        sizes = [s.num_response_tokens for s in order]
        logp = torch.cat([mine[s.index][0].double() for s in order]) if order else torch.zeros(0)
        entropy = torch.cat([mine[s.index][1].double() for s in order]) if order else torch.zeros(0)
        advantages = torch.cat([torch.full((n,), float(s.advantage), dtype=torch.float64)
                                for s, n in zip(order, sizes)]) if order else torch.zeros(0)
        chosen = mini_batch_selection(loss_cfg, advantages, logp, entropy, selection_seed(seed, step, index))
        per_sample = dict(zip((s.index for s in order), torch.split(chosen, sizes)))
        for mb in micro:
            mb.selection = token_values(mb, per_sample)
