"""How much each prompt's responses weigh in the loss (``dynamo.loss.prompt_weight``).

The loss is a token mean over all responses of a mini-batch, so a prompt given n_i responses by the dynamic
allocation weighs about n_i times one response: DRA moves weight between prompts as well as samples. ``equal``
separates the two (a control of issue 32: is DRA's gain variance reduction or a curriculum?): every response of
prompt i gets the weight

    w_i = n_bar / n_i,     n_bar = (responses of the step) / (prompts of the step),

so that each prompt's responses together weigh n_bar responses, what every prompt weighs under a uniform
allocation, whatever its n_i. The loss becomes the *weighted* token mean sum_t w l_t / sum_t w over the mini-batch
(the denominator weighted alike, :func:`weighted_denominator`), which is invariant to the scale of w; with equal
counts every w is exactly 1.0 and the loss is the plain token mean bit for bit. Response lengths still count as in
the token mean (a prompt with longer responses weighs more, as in GRPO). ``rollouts`` (the default) is w = 1.

The weight reaches the loss as a factor on each token's advantage after the modulation, which equals weighting the
token's PPO-clip loss because that loss is positively homogeneous in A (also under the dual clip), as
``losses.engine_importance_weights`` notes; so it is allowed only with the losses for which that holds and that
need no denominator of their own (the trainer's config checks :data:`HOMOGENEOUS_LOSSES`, and entropy_coef 0: the
entropy bonus is not weighted). Pure numpy: nothing of Megatron or vLLM.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .allocation import factorize_prompt_ids
from .config import PROMPT_WEIGHTS

#: policy losses whose per-token loss is positively homogeneous in the advantage (w l(A) = l(w A), w > 0)
HOMOGENEOUS_LOSSES = ("ppo_clip", "w_reinforce", "clip_cov")


def prompt_weights(prompt_ids: Sequence[Any], mode: str) -> np.ndarray:
    """Per response, the weight of its prompt (float64, in the given order): 1 for ``rollouts``; n_bar / n_i for
    ``equal`` (n_i: the responses of its prompt among ``prompt_ids``, n_bar their mean over the prompts)."""
    if mode not in PROMPT_WEIGHTS:
        raise ValueError(f"prompt weight mode must be one of {PROMPT_WEIGHTS}, got {mode!r}")
    codes, uniques = factorize_prompt_ids(list(prompt_ids))
    if mode == "rollouts" or codes.size == 0:
        return np.ones(codes.size, dtype=np.float64)
    counts = np.bincount(codes, minlength=len(uniques)).astype(np.float64)
    mean_count = codes.size / len(uniques)
    return mean_count / counts[codes]


def weighted_denominator(tokens: Sequence[int], weights: Sequence[float], mode: str) -> float:
    """The loss denominator of a mini-batch of responses with ``tokens`` response tokens and ``weights``: sum of
    w x tokens (``token-mean``) or of w (the sequence-mean modes); at least 1 when the mini-batch holds nothing."""
    w = np.asarray(weights, dtype=np.float64)
    total = float(np.dot(w, np.asarray(tokens, dtype=np.float64))) if mode == "token-mean" else float(w.sum())
    return total if total > 0 else 1.0


__all__ = ["HOMOGENEOUS_LOSSES", "prompt_weights", "weighted_denominator"]
