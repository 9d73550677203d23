"""The layout of a job, resolved once: how many ranks, how the training ranks split (DP x TP x PP), where the rollout
engines run and how many there are, and which ranks lead. Every layout check lives here, each with its one message.

A job of W ranks:

- ``colocated`` (``rollout.placement``, the default): every rank trains and hosts a vLLM worker;
- ``separate`` with ``rollout.engine_ranks: N``: the first W - N ranks train, the last N only generate and score.

The training ranks form Megatron's groups of ``parallel.tensor_parallel x pipeline_parallel x context_parallel``
ranks (the rest is data parallel). A mixture-of-experts model's expert layers split the same ranks their own way:
each pipeline stage's ranks in groups of ``parallel.expert_parallel x expert_tensor_parallel`` (the experts divided
over the first, each expert split over the second; the rest is the experts' data parallel).

The engine ranks form engines of ``rollout.tensor_parallel`` consecutive ranks (vLLM's ``external_launcher`` groups
them so); the first rank of an engine (its *leader*) scores the engine's responses. Rank 0 is the job's leader (it
prints and writes); in a separate job the first engine rank sends every scored batch to the trainer ranks and rank 0
sends the weights to the engine ranks.

:meth:`JobTopology.resolve` builds the topology from the ``parallel`` and ``rollout`` sections and the world size
(``launch/``: the launcher's, or ``--nproc``), raising :class:`~megatron_dynamo.config.ConfigError` (one line,
naming the keys) before any rank starts; the layers below read it instead of recomputing from the config.

Plain Python: nothing here imports torch at module level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from megatron_dynamo.config import ConfigError

PLACEMENTS = ("colocated", "separate")
Role = Literal["trainer", "engine"]


# ---------------------------------------------------------------------------------------------- the checks
def check_at_least_one(key: str, value: int) -> None:
    """The one ">= 1" check of a layout number (``key`` as the user writes it: ``rollout.tensor_parallel``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}: must be >= 1, got {value!r}")


def check_divides(divisor: str, value: int, whole: str, total: int, why: str) -> None:
    """The one divisibility check: ``value`` (named ``divisor``) must divide ``total`` (named ``whole``)."""
    if total % value:
        raise ConfigError(f"{divisor} does not divide {whole} ({why})")


def check_engines(ranks: int, tensor_parallel: int, ranks_named: str | None = None,
                  tensor_parallel_key: str = "rollout.tensor_parallel") -> None:
    """``ranks`` engine ranks in engines of ``tensor_parallel`` consecutive ranks."""
    check_at_least_one(tensor_parallel_key, tensor_parallel)
    check_divides(f"{tensor_parallel_key}={tensor_parallel}", tensor_parallel, ranks_named or f"the {ranks} ranks",
                  ranks, f"every rank hosts one vLLM worker, in engines of {tensor_parallel_key} ranks")


def check_model_parallel(ranks: int, tensor_parallel: int, pipeline_parallel: int, context_parallel: int,
                         ranks_named: str | None = None) -> None:
    """``ranks`` training ranks in whole groups of tensor x pipeline x context parallel ranks."""
    for key, value in (("parallel.tensor_parallel", tensor_parallel), ("parallel.pipeline_parallel",
                                                                       pipeline_parallel),
                       ("parallel.context_parallel", context_parallel)):
        check_at_least_one(key, value)
    model_parallel = tensor_parallel * pipeline_parallel * context_parallel
    check_divides(f"parallel.tensor_parallel x pipeline_parallel x context_parallel = {model_parallel}",
                  model_parallel, ranks_named or f"world size {ranks}", ranks,
                  "the training ranks form whole model-parallel groups; the rest is data parallel")


def check_expert_layout(ranks: int, pipeline_parallel: int, expert_parallel: int, expert_tensor_parallel: int) -> None:
    """The expert layers' split of ``ranks`` training ranks: Megatron (``initialize_model_parallel``) needs
    expert_parallel x expert_tensor_parallel x pipeline_parallel to divide them, i.e. the expert groups to tile the
    ranks of each pipeline stage (the data x tensor x context parallel ranks)."""
    for key, value in (("parallel.expert_parallel", expert_parallel),
                       ("parallel.expert_tensor_parallel", expert_tensor_parallel)):
        check_at_least_one(key, value)
    experts_groups = expert_parallel * expert_tensor_parallel
    stage_ranks = ranks // pipeline_parallel
    check_divides(f"parallel.expert_parallel x expert_tensor_parallel = {experts_groups}", experts_groups,
                  f"the {stage_ranks} training ranks of each pipeline stage", stage_ranks,
                  "the expert layers split each stage's data x tensor x context parallel ranks into whole expert "
                  "groups")


def check_experts(num_experts: int, expert_parallel: int, key: str = "parallel.expert_parallel") -> None:
    """A model's experts over ``expert_parallel`` ranks (``num_experts`` 0: a dense model): each rank holds the same
    number of whole experts, and a dense model has none to split. ``key``: how the message names the number (the
    converter's ``--ep``)."""
    if expert_parallel > 1 and not num_experts:
        raise ConfigError(f"{key}: must be 1 for a dense model (no experts to split), got {expert_parallel}")
    if num_experts:
        check_divides(f"{key}={expert_parallel}", expert_parallel,
                      f"the model's {num_experts} experts", num_experts, "every expert rank holds as many experts")


def check_expert_tensor_parallel_on_cpu(expert_tensor_parallel: int) -> None:
    """Without CUDA (gloo) each expert stays whole: splitting it over ranks gathers uneven token counts, and gloo's
    all_gather takes equal-sized tensors only."""
    if expert_tensor_parallel != 1:
        raise ConfigError(f"parallel.expert_tensor_parallel: must be 1 without CUDA (gloo cannot gather the uneven "
                          f"token counts of split experts), got {expert_tensor_parallel}")


def check_placement(placement: str, engine_ranks: int, max_staleness: int, tensor_parallel: int) -> None:
    """The ``rollout`` section's placement keys on their own (the job's size is checked by :meth:`JobTopology.resolve`
    when it is known)."""
    if placement not in PLACEMENTS:
        raise ConfigError(f"rollout.placement: must be one of {PLACEMENTS}, got {placement!r}")
    if max_staleness < 0:
        raise ConfigError(f"rollout.max_staleness: must be >= 0, got {max_staleness}")
    if placement == "colocated":
        if max_staleness:
            raise ConfigError(f"rollout.max_staleness: must be 0 with placement colocated (its engines share the "
                              f"training ranks and sleep while they update: nothing can overlap), got {max_staleness}; "
                              "set placement: separate and engine_ranks")
        if engine_ranks:
            raise ConfigError(f"rollout.engine_ranks: must be 0 with placement colocated (every rank hosts an engine "
                              f"worker), got {engine_ranks}; set placement: separate")
        return
    if engine_ranks < 1:
        raise ConfigError(f"rollout.engine_ranks: must be >= 1 with placement separate (the ranks that only "
                          f"generate), got {engine_ranks}")
    check_engines(engine_ranks, tensor_parallel, f"rollout.engine_ranks={engine_ranks}")


# ---------------------------------------------------------------------------------------------- the layouts
@dataclass(frozen=True)
class TrainingLayout:
    """The training ranks (``ranks`` of them) in Megatron's layout: DP x TP x PP (x CP)."""

    ranks: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int = 1

    def __post_init__(self) -> None:
        check_model_parallel(self.ranks, self.tensor_parallel, self.pipeline_parallel, self.context_parallel)
        check_expert_layout(self.ranks, self.pipeline_parallel, self.expert_parallel, self.expert_tensor_parallel)

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    @property
    def data_parallel(self) -> int:
        return self.ranks // self.model_parallel

    def describe_experts(self) -> str:
        """`` EP=8 (expert TP 1)`` when the experts are split over ranks, else nothing (a dense model's layout)."""
        if self.expert_parallel == self.expert_tensor_parallel == 1:
            return ""
        return f" EP={self.expert_parallel} (expert TP {self.expert_tensor_parallel})"


@dataclass(frozen=True)
class EngineLayout:
    """The engines of ``world_size`` ranks (the ranks of one default process group: all of a colocated job, the
    engine ranks of a separate one), in engines of ``tensor_parallel`` consecutive ranks, seen from ``rank``."""

    rank: int
    world_size: int
    tensor_parallel: int

    def __post_init__(self) -> None:
        check_at_least_one("world size", self.world_size)
        check_engines(self.world_size, self.tensor_parallel)
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is not one of the {self.world_size} ranks")

    @classmethod
    def of_process(cls, tensor_parallel: int) -> "EngineLayout":
        """This process's layout (one rank when torch.distributed is not initialised)."""
        import torch.distributed as dist  # torch stays out of this module's import: `dynamo --help` reads it

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), tensor_parallel)
        return cls(0, 1, tensor_parallel)

    @property
    def num_engines(self) -> int:
        return self.world_size // self.tensor_parallel

    @property
    def engine_index(self) -> int:
        return self.rank // self.tensor_parallel

    @property
    def is_leader(self) -> bool:
        """The engine's first rank: it scores the engine's responses and contributes them to the exchange."""
        return self.rank % self.tensor_parallel == 0


class ParallelSection(Protocol):
    tensor_parallel: int
    pipeline_parallel: int
    context_parallel: int
    expert_parallel: int
    expert_tensor_parallel: int


class RolloutSection(Protocol):
    tensor_parallel: int
    placement: str
    engine_ranks: int


@dataclass(frozen=True)
class JobTopology:
    """A job's ranks: ``parallel`` (the training ranks, the first ones) and ``rollout`` (the engine ranks, the last
    ones, seen from the first of them). Colocated, both are all ``world_size`` ranks."""

    world_size: int
    parallel: TrainingLayout
    rollout: EngineLayout

    @classmethod
    def resolve(cls, world_size: int, parallel: ParallelSection, rollout: RolloutSection,
                ranks_named: str | None = None) -> "JobTopology":
        """The topology of a job of ``world_size`` ranks with the run's ``parallel`` and ``rollout`` sections, or a
        :class:`ConfigError` naming the keys. ``ranks_named``: how the message names the job's ranks (default
        ``the W ranks``)."""
        check_at_least_one("the job's ranks", world_size)
        engine_ranks = rollout.engine_ranks if rollout.placement == "separate" else 0
        if engine_ranks >= world_size:
            raise ConfigError(f"rollout.engine_ranks={engine_ranks} must leave at least one of the job's "
                              f"{world_size} ranks to train")
        trainer_ranks = world_size - engine_ranks
        if engine_ranks:
            engines_named = f"rollout.engine_ranks={engine_ranks}"
            trainers_named = (f"the {trainer_ranks} training ranks ({world_size} ranks minus "
                              f"rollout.engine_ranks={engine_ranks})")
        else:
            engines_named = ranks_named or f"the {world_size} ranks"
            trainers_named = ranks_named or f"world size {world_size}"
        check_engines(engine_ranks or world_size, rollout.tensor_parallel, engines_named)
        check_model_parallel(trainer_ranks, parallel.tensor_parallel, parallel.pipeline_parallel,
                             parallel.context_parallel, trainers_named)
        return cls(world_size, TrainingLayout(trainer_ranks, parallel.tensor_parallel, parallel.pipeline_parallel,
                                              parallel.context_parallel, parallel.expert_parallel,
                                              parallel.expert_tensor_parallel),
                   EngineLayout(0, engine_ranks or world_size, rollout.tensor_parallel))

    @classmethod
    def engines_only(cls, world_size: int, tensor_parallel: int, ranks_named: str | None = None,
                     tensor_parallel_key: str = "rollout.tensor_parallel") -> "JobTopology":
        """A job whose every rank only generates (``dynamo eval``): ``world_size`` ranks in engines of
        ``tensor_parallel``; ``ranks_named`` and ``tensor_parallel_key`` as the command's flags name them."""
        check_at_least_one(ranks_named or "the job's ranks", world_size)
        check_engines(world_size, tensor_parallel, ranks_named, tensor_parallel_key)
        return cls(world_size, TrainingLayout(world_size), EngineLayout(0, world_size, tensor_parallel))

    def __post_init__(self) -> None:
        trainers, engines = self.parallel.ranks, self.rollout.world_size
        if not (trainers == engines == self.world_size or trainers + engines == self.world_size):
            raise ConfigError(f"{self.parallel.ranks} training ranks and {self.rollout.world_size} engine ranks do "
                              f"not make a job of {self.world_size}")

    # ------------------------------------------------------------------ placement
    @property
    def separate(self) -> bool:
        """The engines run on ranks of their own (``rollout.placement: separate``)."""
        return self.parallel.ranks < self.world_size

    @property
    def placement(self) -> str:
        return "separate" if self.separate else "colocated"

    @property
    def engine_ranks(self) -> int:
        """The ranks that only generate (0: colocated)."""
        return self.world_size - self.parallel.ranks

    @property
    def first_engine_rank(self) -> int:
        """The job rank of the first engine rank (0, colocated): in a separate job it sends every scored batch to the
        trainer ranks."""
        return self.parallel.ranks if self.separate else 0

    def role(self, rank: int) -> Role:
        return "engine" if self.separate and rank >= self.parallel.ranks else "trainer"

    def role_rank(self, rank: int) -> int:
        """``rank``'s rank within its role world (the default process group it joins)."""
        return rank - self.parallel.ranks if self.role(rank) == "engine" else rank

    # ------------------------------------------------------------------ engines
    def engine_layout(self, rank: int) -> EngineLayout | None:
        """The engine layout of job rank ``rank``, or None for a rank that hosts no engine worker (a trainer rank
        of a separate job)."""
        first = self.first_engine_rank
        if not first <= rank < first + self.rollout.world_size:
            return None
        return EngineLayout(rank - first, self.rollout.world_size, self.rollout.tensor_parallel)

    @property
    def engine_leaders(self) -> tuple[int, ...]:
        """The job ranks that lead an engine (score its responses)."""
        return tuple(range(self.first_engine_rank, self.world_size, self.rollout.tensor_parallel))

    def describe(self) -> str:
        """One line: the training layout (the experts' split where there is one) and the engines (the header of
        ``dynamo train``, ``dynamo launch``)."""
        p, r = self.parallel, self.rollout
        line = (f"DP {p.data_parallel} x TP {p.tensor_parallel} x PP {p.pipeline_parallel}{p.describe_experts()}; "
                f"{plural(r.num_engines, 'rollout engine')} of {plural(r.tensor_parallel, 'rank')}")
        if self.separate:
            first, last = self.first_engine_rank, self.world_size - 1
            line += f" on rank {first} of its own" if first == last else f" on ranks {first}-{last} of their own"
        return line


def plural(n: int, word: str) -> str:
    """``n`` and ``word``, with an s unless n is 1: "1 rank", "2 ranks", "0 steps"."""
    return f"{n} {word}{'s' if n != 1 else ''}"
