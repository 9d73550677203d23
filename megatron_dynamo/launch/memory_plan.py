"""The memory plan of a GPU: what a rank keeps on its device, term by term, in bytes, before any rank starts.

Plain arithmetic over the architecture (:class:`~megatron_dynamo.models.qwen.QwenArchitecture`, read only) and a
:class:`Setup` (the layout and the settings that size memory); ``launch/memory_check.py`` builds the Setup from a
run's config, refuses a layout that does not fit and prints the table. The terms, per GPU:

- ``weights``: this rank's parameters in the training dtype (2 bytes in bf16): its pipeline stage's layers, their
  tensor-parallel slices (norms and routers whole), E / EP experts of every MoE layer, split over expert TP; the
  embedding on the first stage, the final norm and the output layer on the last (a tied one too when PP > 1).
- ``gradients``: Megatron's DDP gradient buffer, 4 bytes a parameter: the trainer sets ``grad_reduce_in_fp32=True``
  (``trainer/actor.py``) whatever the dtype; the buffer is whole on every rank, also with the distributed optimizer.
- ``optimizer``: Adam's m and v (fp32), plus fp32 master weights for a bf16 model: 12 bytes a parameter (8 in fp32).
  The distributed optimizer shards them over the data-parallel group: dense parameters over DP x CP, experts over the
  expert-data-parallel group. Megatron-Core 0.16 (``parallel_state.initialize_model_parallel``) builds the expert
  groups with their own rank generator: expert DP = world / (ETP x EP x PP) = TP x CP x DP / (ETP x EP).
- ``activations``: what the backward needs, for the micro-batches the schedule holds at once (:func:`in_flight`):
  1F1B (Megatron's ``forward_backward_pipelining_without_interleaving``) runs PP - s - 1 warm-up forwards on stage s
  and then one more before its first backward, so stage s holds up to PP - s; interleaved (VP chunks) holds
  2 (PP - s - 1) + (VP - 1) PP + 1 chunk micro-batches of L / (PP VP) layers; PP = 1, one. Per token of a micro-batch
  and per layer (:func:`layer_activation_bytes`).
- ``routes``: ``moe.routing_replay``: the experts of every token of the rank's mini-batch (int16 x MoE layers x
  top-k: the trainer moves all micro-batches of a mini-batch to the device at once) and Megatron's int64 replay
  targets of the micro-batches in flight.
- ``vllm weights`` / ``vllm cache``: a colocated engine's share, ``rollout.gpu_memory_utilization`` x the device:
  its weights (1 / engine TP of the model) and the rest (KV cache, its activations and graphs). Asleep during the
  update (sleep level 1 or 2 both free the GPU). Separate-engine jobs have them on the engine GPUs only.
- ``weight sync``: the largest transient: the sync streams one tensor at a time and vLLM's layer-wise reload buffers
  the full tensors of one layer (an MoE layer: all its experts) until it is complete, then builds the engine's slice
  of it; the largest unit is one decoder layer or the embedding. Separate engines: plus the 128 MiB bucket.
- ``runtime``: CUDA context, NCCL communicators, cuBLAS/cuDNN workspaces: an allowance (2 GiB), not derived.

The phases do not overlap: ``generate`` (the engine awake, the training state resident unless
``rollout.offload_training_state``), ``sync`` (engine weights awake, KV cache asleep), ``update`` (the engine
asleep). The plan's total is that of the fullest phase.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_dynamo.launch.local_activations import local_layer_bytes

if TYPE_CHECKING:  # read only; the plan imports neither torch nor Megatron
    from megatron_dynamo.models.qwen import QwenArchitecture

GiB = 2 ** 30
#: The device memory of the cluster recipes' 80 GB GPUs: an H100 80GB HBM3 reports 81,559 MiB (79.6 GiB), an
#: A100 80GB 81,920 MiB; the plan takes the smaller.
DEFAULT_DEVICE_MEMORY = 81_559 * 2 ** 20
RUNTIME_ALLOWANCE = 2 * GiB
SYNC_BUCKET_BYTES = 128 * 2 ** 20  # rollout/channel.py's BUCKET_BYTES (a test keeps them equal)
OUTPUT_CHUNK_ELEMENTS = 1 << 25  # parallel/token_chunks.py's DEFAULT_CHUNK_ELEMENTS (two fp32 chunk buffers)
PHASES = ("generate", "sync", "update")
RECOMPUTE = ("off", "selective", "full")
KERNELS = ("te", "local")  # Transformer Engine with flash attention (GPU runs); Megatron's local layers


@dataclass(frozen=True)
class Setup:
    """What sizes a GPU's memory besides the architecture. ``micro_batch_tokens``: the tokens of the largest
    micro-batch (``memory_check`` derives it from ``trainer.micro_batch_tokens`` and the longest sequence);
    ``mini_batch_tokens``: the most tokens of one mini-batch on one data-parallel rank (the routes buffer)."""

    micro_batch_tokens: int
    capacity: int = DEFAULT_DEVICE_MEMORY
    dtype: str = "bf16"
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_pipeline: int | None = None
    context_parallel: int = 1
    sequence_parallel: bool = False
    data_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int = 1
    distributed_optimizer: bool = True
    recompute: str = "off"
    separate: bool = False
    engine_tensor_parallel: int = 1
    gpu_memory_utilization: float = 0.5
    sleep_during_training: bool = True
    offload_training_state: bool = False
    routing_replay: str = "off"
    mini_batch_tokens: int = 0
    kernels: str = "te"
    sequence_length: int = 0  # "local" kernels: a micro-batch's (padded) sequence length, for the attention scores

    @property
    def dtype_bytes(self) -> int:
        return 2 if self.dtype == "bf16" else 4

    @property
    def expert_data_parallel(self) -> int:
        """Megatron-Core 0.16: world / (ETP x EP x PP), the world being TP x CP x DP x PP."""
        t, cp, dp = self.tensor_parallel, self.context_parallel, self.data_parallel
        return max(1, t * cp * dp // (self.expert_parallel * self.expert_tensor_parallel))


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    what: str
    phases: tuple[str, ...]


@dataclass(frozen=True)
class MemoryPlan:
    """One GPU's terms (``gpu`` says which: a pipeline stage's training rank, or an engine rank)."""

    gpu: str
    terms: tuple[Term, ...]
    capacity: int

    @property
    def phases(self) -> tuple[str, ...]:
        """The phases this GPU goes through (a training GPU of a separate job never generates)."""
        return tuple(phase for phase in PHASES if any(phase in t.phases for t in self.terms))

    def phase_total(self, phase: str) -> int:
        return sum(t.bytes for t in self.terms if phase in t.phases)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.phase_total)

    @property
    def total(self) -> int:
        return self.phase_total(self.peak_phase)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def largest(self) -> Term:
        """The largest term of the fullest phase (the first of equals)."""
        return max((t for t in self.terms if self.peak_phase in t.phases), key=lambda t: t.bytes)

    def term(self, name: str) -> Term:
        return next(t for t in self.terms if t.name == name)


# ------------------------------------------------------------------------------------------------- parameters
def attention_params(arch: QwenArchitecture, tp: int = 1) -> int:
    """One layer's attention on one of ``tp`` ranks: q, k, v, o (and q/k/v biases) split, the two layer norms and
    Qwen3's q/k norms whole."""
    h, qkv = arch.hidden_size, (arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.head_dim
    split = h * qkv + arch.num_attention_heads * arch.head_dim * h + (qkv if arch.qkv_bias else 0)
    return split // tp + 2 * h + (2 * arch.head_dim if arch.qk_norm else 0)


def mlp_params(arch: QwenArchitecture, moe_layer: bool, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of one layer's MLP on one rank: a SwiGLU MLP (3 h f) split over TP; or the
    router (whole), E / EP experts of 3 h f_e split over expert TP, and Qwen2-MoE's shared expert and its gate."""
    h = arch.hidden_size
    if not moe_layer:
        return 3 * h * arch.intermediate_size // tp, 0
    moe = arch.moe
    shared = 3 * h * moe.shared_expert_intermediate_size // tp + (h if moe.shared_expert_intermediate_size else 0)
    return moe.num_experts * h + shared, moe.num_experts // ep * 3 * h * moe.expert_intermediate_size // etp


def stage_layers(arch: QwenArchitecture, pp: int, stage: int) -> range:
    per = arch.num_layers // pp
    return range(stage * per, (stage + 1) * per)


def stage_params(arch: QwenArchitecture, setup: Setup, stage: int) -> tuple[int, int]:
    """(dense, expert) parameters a GPU of pipeline stage ``stage`` holds."""
    tp, pp, h, vocab = setup.tensor_parallel, setup.pipeline_parallel, arch.hidden_size, arch.vocab_size
    dense = expert = 0
    for layer in stage_layers(arch, pp, stage):
        d, e = mlp_params(arch, arch.is_moe_layer(layer), tp, setup.expert_parallel, setup.expert_tensor_parallel)
        dense, expert = dense + attention_params(arch, tp) + d, expert + e
    if stage == 0:
        dense += vocab * h // tp
    if stage == pp - 1:
        dense += h + (vocab * h // tp if not arch.tie_word_embeddings or pp > 1 else 0)
    return dense, expert


def model_params(arch: QwenArchitecture) -> int:
    """All parameters of the model (an engine's, before its TP split)."""
    layers = sum(attention_params(arch) + sum(mlp_params(arch, arch.is_moe_layer(i))) for i in range(arch.num_layers))
    return layers + arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2) + arch.hidden_size


# ------------------------------------------------------------------------------------------------ activations
def layer_activation_bytes(arch: QwenArchitecture, setup: Setup, moe_layer: bool, recompute: str = "off") -> float:
    """Bytes one layer keeps for the backward, per token of a micro-batch, on the GPU (TE spec, flash attention,
    Megatron-Core 0.16). b: 2 in bf16; t: TP; s: t under sequence parallelism, else 1; a, g, d: heads, key/value
    heads, head size; f: the FFN; E, k, f_e: experts, top-k, expert FFN; r = k x ETP / t routed copies a token.

    - attention: b (2h/s + (a + 2g) d/t + [Qwen3] (a + g) d/t + a d/t) + 4a/t: the input norm's input and output
      (TE's LayerNormLinear keeps both), q/k/v as the core attention keeps them, Qwen3's q/k norms' inputs, the core
      attention's output (linear_proj's input) and its fp32 softmax statistics (the flash/cuDNN attention).
    - dense MLP: b (2h/s + 2f/t + f/t): the pre-MLP norm's input and output, fc1's output (kept by the fused SwiGLU,
      ``bias_activation_fusion`` on GPU) and the SwiGLU's output (fc2's input).
    - MoE MLP: b 2h/s + router + r (b (h + 2 f_e/ETP + f_e/ETP) + 4): per routed copy fc1's input, fc1's output and
      the weighted SwiGLU's output, and its fp32 probability (0.16 applies the probabilities inside the experts,
      ``per_token_scale``, so the unpermute is a scatter-add that keeps nothing; the all-to-all and the permutes
      keep nothing either); router: the bool routing map (E), the softmax over all experts without
      ``norm_topk_prob`` (4E), top-k scores and indices (20k). Qwen2-MoE's shared expert: b (3 f_s/t + h/s + 1).
    - selective recompute: the core attention reruns; q/k/v stay as its checkpoint's inputs and its output as
      linear_proj's, so only the softmax statistics go (4a/t): flash attention keeps no s x s matrix to drop.
    - full recompute: the layer's input only, b h/s (plus one layer rerun at a time: :func:`stage_activations`).
    - ``setup.kernels == "local"``: Megatron's local layers, as a CPU run keeps them (``launch/local_activations.py``).

    Qwen3-30B-A3B (h 2048, a 32, g 4, d 128, E 128, k 8, f_e 768, norm_topk_prob; bf16, TP 1): attention 2 x 17,920
    + 128 B, MoE MLP 2 x 4,096 + 8 x (2 x 4,352 + 4) + 288 B: 114,112 B (111 KiB) a token a layer.
    """
    for key, value, allowed in (("recompute", recompute, RECOMPUTE), ("kernels", setup.kernels, KERNELS)):
        if value not in allowed:
            raise ValueError(f"{key} must be one of {allowed}, got {value!r}")
    b, t, h = setup.dtype_bytes, setup.tensor_parallel, arch.hidden_size
    s = t if setup.sequence_parallel else 1
    if recompute == "full":
        return b * h / s
    if setup.kernels == "local":
        return local_layer_bytes(arch, setup, moe_layer, recompute)
    a, g, d = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    attention = b * (2 * h / s + ((a + 2 * g) + (a + g if arch.qk_norm else 0) + a) * d / t)
    if recompute == "off":
        attention += 4 * a / t
    if not moe_layer:
        return attention + b * (2 * h / s + 3 * arch.intermediate_size / t)
    moe, etp = arch.moe, setup.expert_tensor_parallel
    router = moe.num_experts * (1 + (0 if moe.norm_topk_prob else 4)) + 20 * moe.top_k
    routed = moe.top_k * etp / t * (b * (h + 3 * moe.expert_intermediate_size / etp) + 4)
    shared = moe.shared_expert_intermediate_size
    shared_bytes = b * (3 * shared / t + h / s + 1) if shared else 0
    return attention + b * 2 * h / s + router + routed + shared_bytes


def in_flight(setup: Setup, stage: int) -> float:
    """Micro-batches of the whole stage whose activations stage ``stage`` holds at most (1F1B's warm-up plus one;
    interleaved: chunk micro-batches / VP)."""
    pp, vp = setup.pipeline_parallel, setup.virtual_pipeline
    if pp == 1:
        return 1
    if not vp or vp == 1:
        return pp - stage
    return (2 * (pp - stage - 1) + (vp - 1) * pp + 1) / vp


def stage_activations(arch: QwenArchitecture, setup: Setup, stage: int) -> tuple[int, float]:
    """(bytes, in flight) of the activations on a GPU of ``stage``: in flight x (the stage's layers, its output
    kept by the schedule on every stage but the last) x the micro-batch's tokens / CP; under full recompute plus
    one layer rerun whole for one micro-batch; on the last stage the final norm (input and output), the response
    positions' hidden states and the fused output layer's two fp32 chunk buffers."""
    pp, b, h = setup.pipeline_parallel, setup.dtype_bytes, arch.hidden_size
    s = setup.tensor_parallel if setup.sequence_parallel else 1
    tokens = setup.micro_batch_tokens / setup.context_parallel
    layers = [arch.is_moe_layer(i) for i in stage_layers(arch, pp, stage)]
    per_token = sum(layer_activation_bytes(arch, setup, moe, setup.recompute) for moe in layers)
    if stage < pp - 1:
        per_token += b * h / s
    count = in_flight(setup, stage)
    total = count * per_token * tokens
    if setup.recompute == "full":
        total += max(layer_activation_bytes(arch, setup, moe) for moe in layers) * tokens
    if stage == pp - 1:
        total += b * (2 * h / s + h) * tokens + 2 * 4 * OUTPUT_CHUNK_ELEMENTS
    return int(total), count


# --------------------------------------------------------------------------------------------- the other terms
def _largest_tensor(arch: QwenArchitecture, moe_layer: bool) -> int:
    """The largest single HF tensor of a decoder layer (what one all-gather of the sync assembles)."""
    h = arch.hidden_size
    moe = arch.moe
    mlp = ([moe.num_experts * h, h * moe.expert_intermediate_size, h * moe.shared_expert_intermediate_size]
           if moe_layer else [h * arch.intermediate_size])
    return max(h * arch.num_attention_heads * arch.head_dim, *mlp)


def weight_sync_bytes(arch: QwenArchitecture, setup: Setup, side: str) -> int:
    """The weight sync's largest transient on a GPU. ``side``: ``colocated`` (every rank receives the full tensors of
    one unit, a decoder layer or the embedding, which vLLM's reload buffers, then builds the engine's 1 / engine-TP
    slice; under TP > 1 the training side's all-gather holds a tensor's shards besides), ``trainer`` (separate: the
    first training rank assembles one tensor at a time and packs 128 MiB buckets), ``engine`` (separate: a bucket
    and the reload's unit)."""
    b, vocab_rows = setup.dtype_bytes, arch.vocab_size * arch.hidden_size
    units = [(vocab_rows, vocab_rows)]
    for moe_layer in {arch.is_moe_layer(i) for i in range(arch.num_layers)}:
        units.append((attention_params(arch) + sum(mlp_params(arch, moe_layer)), _largest_tensor(arch, moe_layer)))
    gathered = setup.tensor_parallel > 1
    if side == "trainer":
        return b * max(largest for _, largest in units) * (2 if gathered else 1) + SYNC_BUCKET_BYTES
    reload = max(b * full * (1 + 1 / setup.engine_tensor_parallel) for full, _ in units)
    if side == "engine":
        return int(reload) + SYNC_BUCKET_BYTES
    return int(max(b * (full * (1 + 1 / setup.engine_tensor_parallel) + (largest if gathered else 0))
                   for full, largest in units))


def routes_bytes(arch: QwenArchitecture, setup: Setup, stage: int, count: float) -> int:
    """``moe.routing_replay``: int16 experts of the mini-batch's tokens on this DP rank (all MoE layers x top-k) and
    Megatron's int64 replay targets ([tokens, k] for each MoE layer of the stage) of ``count`` micro-batches."""
    if arch.moe is None or setup.routing_replay == "off":
        return 0
    moe_layers = sum(arch.moe.layer_pattern)
    here = sum(arch.is_moe_layer(i) for i in stage_layers(arch, setup.pipeline_parallel, stage))
    k = arch.moe.top_k
    return int(setup.mini_batch_tokens * moe_layers * k * 2 + count * setup.micro_batch_tokens * k * 8 * here)


def engine_terms(arch: QwenArchitecture, setup: Setup, weight_phases: tuple[str, ...],
                 cache_phases: tuple[str, ...]) -> tuple[Term, Term]:
    """The engine's share on this GPU: its weights and the rest of the share (KV cache, its activations)."""
    b, etp = setup.dtype_bytes, setup.engine_tensor_parallel
    weights = b * model_params(arch) // etp
    share = int(setup.gpu_memory_utilization * setup.capacity)
    kv_heads = max(1, arch.num_key_value_heads // etp)
    per_token = 2 * arch.num_layers * kv_heads * arch.head_dim * b
    cache = max(0, share - weights)
    return (Term("vllm weights", weights, f"the engine's weights: 1/{etp} of {_b(model_params(arch))} parameters "
                 f"(engine TP {etp})", weight_phases),
            Term("vllm cache", cache, f"the rest of its share {setup.gpu_memory_utilization:g} x the device: KV cache "
                 f"({per_token / 1024:.0f} KB a token here, ~{cache // per_token / 1e6:.2f} M tokens), its activations",
                 cache_phases))


def _b(params: float) -> str:
    return f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.1f} M"


# ---------------------------------------------------------------------------------------------------- the plans
def training_terms(arch: QwenArchitecture, setup: Setup, stage: int) -> list[Term]:
    """Weights, gradients, optimizer state, activations and routes of a training GPU of ``stage``."""
    dense, expert = stage_params(arch, setup, stage)
    params, b = dense + expert, setup.dtype_bytes
    dp = setup.data_parallel * setup.context_parallel if setup.distributed_optimizer else 1
    edp = setup.expert_data_parallel if setup.distributed_optimizer else 1
    per = 12 if setup.dtype == "bf16" else 8
    state = ("sync", "update") if setup.offload_training_state or setup.separate else PHASES
    experts = f", {_b(expert)} of them experts" if expert else ""
    shards = f"dense 1/{dp}" + (f", experts 1/{edp}" if expert else "")
    activations, count = stage_activations(arch, setup, stage)
    tokens = f"{setup.micro_batch_tokens:,}"
    terms = [
        Term("weights", b * params, f"{setup.dtype} weights: {_b(params)} parameters{experts}", state),
        Term("gradients", 4 * params, "fp32 gradient buffer (Megatron DDP, grad_reduce_in_fp32)", state),
        Term("optimizer", per * dense // dp + per * expert // edp,
             f"{'fp32 master weights + ' if per == 12 else ''}Adam m, v ({per} B a parameter): {shards}"
             f"{' (distributed optimizer)' if setup.distributed_optimizer else ''}", state),
        Term("activations", activations, f"{count:g} micro-batch{'' if count == 1 else 'es'} of {tokens} tokens in "
             f"flight on stage {stage} of {setup.pipeline_parallel}, recompute {setup.recompute}", ("update",)),
    ]
    routes = routes_bytes(arch, setup, stage, count)
    if routes:
        terms.append(Term("routes", routes, f"routing replay ({setup.routing_replay}): int16 experts of "
                          f"{setup.mini_batch_tokens:,} tokens, int64 targets in flight", ("update",)))
    return terms


def plan_stage(arch: QwenArchitecture, setup: Setup, stage: int) -> MemoryPlan:
    """A training GPU of pipeline stage ``stage`` (colocated: with its share of the vLLM engine)."""
    terms = training_terms(arch, setup, stage)
    if setup.separate:
        terms.append(Term("weight sync", weight_sync_bytes(arch, setup, "trainer"),
                          "one tensor assembled for the engines + a 128 MiB bucket", ("sync",)))
        gpu = f"pipeline stage {stage} of {setup.pipeline_parallel} (training only)"
    else:
        awake = PHASES if not setup.sleep_during_training else ("generate", "sync")
        terms += engine_terms(arch, setup, awake, PHASES if not setup.sleep_during_training else ("generate",))
        terms.append(Term("weight sync", weight_sync_bytes(arch, setup, "colocated"),
                          "the largest unit (a layer or the embedding) buffered by vLLM's reload", ("sync",)))
        gpu = f"pipeline stage {stage} of {setup.pipeline_parallel} (training + vLLM)"
    terms.append(_runtime(("sync", "update") if setup.separate else PHASES))
    return MemoryPlan(gpu, tuple(terms), setup.capacity)


def plan_engine(arch: QwenArchitecture, setup: Setup) -> MemoryPlan:
    """An engine GPU of a separate-engine job: the engine keeps its share, no sleep."""
    terms = [*engine_terms(arch, setup, ("generate", "sync"), ("generate", "sync")),
             Term("weight sync", weight_sync_bytes(arch, setup, "engine"),
                  "a 128 MiB bucket + the largest unit buffered by vLLM's reload", ("sync",)),
             _runtime(("generate", "sync"))]
    return MemoryPlan("an engine rank (generation only)", tuple(terms), setup.capacity)


def _runtime(phases: tuple[str, ...]) -> Term:
    return Term("runtime", RUNTIME_ALLOWANCE, "CUDA context, NCCL, cuBLAS workspaces (an allowance)", phases)


def plan_gpus(arch: QwenArchitecture, setup: Setup) -> list[MemoryPlan]:
    """Every kind of GPU of the job: one plan per pipeline stage, and the engine ranks' of a separate job."""
    plans = [plan_stage(arch, setup, stage) for stage in range(setup.pipeline_parallel)]
    return plans + ([plan_engine(arch, setup)] if setup.separate else [])


def fullest(plans: list[MemoryPlan]) -> MemoryPlan:
    """The plan with the largest share of its device; of equals to 0.1% of the device, the one whose other phases are
    fuller (pipeline stage 0 of a recipe whose peak is the generation, about the same on every stage), then the
    first."""
    def key(plan: MemoryPlan) -> tuple[int, int]:
        return int(1000 * plan.total / plan.capacity), sum(map(plan.phase_total, plan.phases))

    return max(plans, key=key)
