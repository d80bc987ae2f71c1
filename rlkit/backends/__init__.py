"""Training backends: which library trains the actor, reference and critic on each rank.

* ``"torch"`` (the default): rlkit's own FSDP2 x DTensor TP x ``torch.distributed.pipelining``
  (``rlkit.parallel.ParallelModel``).
* ``"megatron"``: Megatron-Core's ``GPTModel`` built from the HF checkpoint, its TP / PP (1F1B) / DDP
  (``rlkit.backends.megatron``; extra ``rlkit[megatron]``).
* ``"deepspeed"``: DeepSpeed ZeRO 0-3 on the HF model over DP, its ``PipelineModule`` for PP
  (``rlkit.backends.deepspeed``; extra ``rlkit[deepspeed]``). DeepSpeed has no tensor parallelism for
  training an HF model here: ``tp > 1`` is refused.

Every backend's model is a ``rlkit.parallel.kit.TrainingModel`` (``logprobs``, ``values``, ``train_step``,
``set_scoring``, ``set_packing``, ``iter_full_weights``, ``full_state_dict``, ``save``, ``load``, ``memory``,
``optimizer``, ``params``, ``lora``, ``last_transfer``), so the plan, the worker contract, the rollout engines,
weight sync, checkpoints and the live view stay the same above it. What each can run is one table,
``CAPABILITIES``, which the driver's checks and the workers read: no code outside this registry asks a
backend's name.

``check_backend`` runs in the driver before any worker starts; ``make_model`` on each rank.

>>> from rlkit import ParallelPlan
>>> resolve("deepspeed", ParallelPlan(dp=2, dp_shard="shard_grad_op"))
Backend(name='deepspeed', zero_stage=2)
>>> resolve(Backend("deepspeed", zero_stage=1), ParallelPlan(dp=2, dp_shard="replicate")).zero_stage
1
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from rlkit.errors import PlanError
from rlkit.plan.backend_memory import ZERO_OF_SHARDING
from rlkit.plan.topology import ParallelPlan

NAMES = ("torch", "megatron", "deepspeed")


@dataclass(frozen=True)
class Capabilities:
    """What a training backend runs (``CAPABILITIES[name]``, ``Backend.caps``).

    >>> CAPABILITIES["deepspeed"].tp, CAPABILITIES["megatron"].tp, CAPABILITIES["torch"].lora
    (False, True, True)
    """

    tp: bool                  # tensor parallelism (tp > 1)
    vpp: bool                 # virtual pipeline stages (vpp > 1)
    sharded_dp: bool          # dp_shard other than "replicate" (FSDP2; DeepSpeed's ZeRO 2-3)
    any_rank_order: bool      # plan orders other than Megatron's "tp-dp-pp"
    lora: bool                # LoRA adapters (TrainerConfig.lora)
    packing: bool             # padding-free micro-batches (TrainerConfig.padding_free, micro_batch_tokens)
    generation_layout: bool   # the actor's DTensors resharded into Rollout(tp=...), or lent to a one-rank engine
    rlkit_groups: bool        # trains on the process groups rlkit builds (else its own, in the same rank order)
    model_families: bool      # maps only the model families it knows (rlkit.backends.families), checked on the config
    precisions: tuple[str, ...] = ("fp32", "bf16-mixed")
    zero_stages_with_pp: tuple[int, ...] = ()   # DeepSpeed's ZeRO stages that its pipeline engine runs
    expert_parallel: bool = False  # ParallelPlan(ep > 1): a mixture-of-experts model's experts split over DP ranks
    router_losses: bool = False    # rlkit's MoE layer (rlkit.parallel.moe): the router's losses, routing replay, stats


CAPABILITIES: dict[str, Capabilities] = {
    "torch": Capabilities(tp=True, vpp=True, sharded_dp=True, any_rank_order=True, lora=True, packing=True,
                          generation_layout=True, rlkit_groups=True, model_families=False, expert_parallel=True,
                          router_losses=True),
    "megatron": Capabilities(tp=True, vpp=False, sharded_dp=False, any_rank_order=False, lora=False, packing=False,
                             generation_layout=False, rlkit_groups=False, model_families=True, precisions=("fp32",),
                             expert_parallel=True),
    "deepspeed": Capabilities(tp=False, vpp=False, sharded_dp=True, any_rank_order=False, lora=False, packing=False,
                              generation_layout=False, rlkit_groups=False, model_families=False,
                              zero_stages_with_pp=(0, 1)),
}
# backend -> (the module it needs, the pip extra that installs it)
REQUIRES = {"megatron": ("megatron.core", "megatron"), "deepspeed": ("deepspeed", "deepspeed")}


@dataclass(frozen=True)
class Backend:
    """A training backend and its options. ``Trainer(backend="megatron")`` is ``Backend("megatron")``.

    ``zero_stage`` (DeepSpeed only): 0-3; None takes it from the plan's ``dp_shard`` ("replicate" -> 0,
    "shard_grad_op" -> 2, "full_shard" -> 3).

    >>> Backend("deepspeed", zero_stage=1)
    Backend(name='deepspeed', zero_stage=1)
    """

    name: str = "torch"
    zero_stage: int | None = None

    @property
    def caps(self) -> Capabilities:
        """What this backend runs (``CAPABILITIES``)."""
        return CAPABILITIES[self.name]

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise PlanError(f"backend={self.name!r} is not a training backend; choose one of {NAMES}")
        if self.zero_stage is not None:
            if self.name != "deepspeed":
                raise PlanError(f"zero_stage={self.zero_stage!r} is a DeepSpeed option; use Backend('deepspeed', "
                                f"zero_stage=...) or leave zero_stage=None")
            if self.zero_stage not in (0, 1, 2, 3):
                raise PlanError(f"zero_stage={self.zero_stage!r} must be one of 0, 1, 2, 3 (DeepSpeed's ZeRO stages)")


def resolve(backend: str | Backend | None, plan: ParallelPlan) -> Backend:
    """The ``Backend`` a Trainer argument names, with DeepSpeed's ZeRO stage filled in from ``plan``."""
    if backend is None:
        backend = Backend()
    elif isinstance(backend, str):
        backend = Backend(backend)
    elif not isinstance(backend, Backend):
        raise PlanError(f"backend={backend!r} must be one of {NAMES} or an rlkit.Backend")
    if backend.name == "deepspeed" and backend.zero_stage is None:
        if plan.dp_shard not in ZERO_OF_SHARDING:
            raise PlanError(f"DeepSpeed has no dp_shard={plan.dp_shard!r}; use one of {tuple(ZERO_OF_SHARDING)} "
                            f"or name the stage: Backend('deepspeed', zero_stage=0..3)")
        backend = Backend("deepspeed", ZERO_OF_SHARDING[plan.dp_shard])
    return backend


def installed(name: str) -> bool:
    """Whether the library backend ``name`` needs can be imported here (without importing it)."""
    if name not in REQUIRES:
        return True
    module = REQUIRES[name][0]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def check_backend(backend: str | Backend | None, plan: ParallelPlan, config: Any = None, *, lora: Any = None,
                  padding_free: bool = False, rollout_tp: int | None = None, precision: str = "fp32") -> Backend:
    """The driver's check of a backend choice, before any worker starts: installed, the plan's layout runnable
    by it, the model family covered (``config``: the HF config), and the features it lacks not asked for.
    Returns the resolved ``Backend``; raises ``PlanError`` naming the value and the fix.

    >>> check_backend("torch", ParallelPlan(tp=2)).name
    'torch'
    >>> check_backend("deepspeed", ParallelPlan(tp=2, dp_shard="replicate"))   # doctest: +SKIP
    Traceback (most recent call last):
    rlkit.errors.PlanError: backend='deepspeed' cannot run tp=2: ...
    """
    backend = resolve(backend, plan)
    name, caps = backend.name, backend.caps
    if name in REQUIRES and not installed(name):
        module, extra = REQUIRES[name]
        raise PlanError(f"backend={name!r} needs {module}, which is not installed; install the extra: "
                        f"pip install 'rlkit[{extra}]' (or use backend='torch')")
    if lora is not None and not caps.lora:
        raise PlanError(f"LoRA runs on backend='torch' only; backend={name!r} trains full weights (drop lora= or "
                        f"use backend='torch')")
    if padding_free and not caps.packing:
        raise PlanError(f"padding_free=True runs on backend='torch' only; use padding_free=False with backend={name!r}")
    if rollout_tp is not None and not caps.generation_layout:
        raise PlanError(f"Rollout(tp={rollout_tp}) (the 3D-HybridEngine's generation layout) reshards the torch "
                        f"backend's DTensors; with backend={name!r} use Rollout(tp=None): one engine per DP group, "
                        f"synced from the full weights")
    if plan.order != "tp-dp-pp" and not caps.any_rank_order:
        raise PlanError(f"backend={name!r} lays ranks out in Megatron's order; use order='tp-dp-pp', not "
                        f"{plan.order!r}")
    if plan.dp_shard != "replicate" and plan.dp > 1 and not caps.sharded_dp:
        raise PlanError(f"Megatron-Core's DP replicates the weights (DDP; its distributed optimizer needs CUDA): "
                        f"dp_shard={plan.dp_shard!r} cannot run; use ParallelPlan(..., dp_shard='replicate')")
    if precision not in caps.precisions:
        raise PlanError(f"backend={name!r} trains {' or '.join(caps.precisions)} here (Megatron-Core's bf16 path, "
                        f"Float16OptimizerWithFloat16Params, is not wired yet); use precision='fp32', or backend="
                        f"'torch' / 'deepspeed' for precision={precision!r}")
    if plan.vpp > 1 and not caps.vpp:
        raise PlanError(f"backend={name!r} runs vpp=1 here (virtual pipeline stages are not wired yet); use vpp=1 "
                        f"(got vpp={plan.vpp})")
    if plan.ep > 1 and not caps.expert_parallel:
        have = [n for n, c in CAPABILITIES.items() if c.expert_parallel]
        raise PlanError(f"backend={name!r} cannot run ep={plan.ep}: it has no expert parallelism; use ep=1, or "
                        f"backend={' / '.join(map(repr, have))} for ep > 1")
    if plan.ep > 1 and name == "torch" and plan.dp_shard in ("hybrid_shard", "replicate"):
        raise PlanError(f"ep={plan.ep} with dp_shard={plan.dp_shard!r} is not supported on the torch backend (HSDP "
                        f"and EP both split the DP ranks); use dp_shard='full_shard' or 'shard_grad_op' with ep > 1")
    if plan.tp > 1 and not caps.tp:
        raise PlanError(f"backend={name!r} cannot run tp={plan.tp}: DeepSpeed trains an HF model with ZeRO "
                        f"over DP and its PipelineModule over PP, but has no tensor parallelism for it (its "
                        f"AutoTP is for inference); use tp=1, or backend='torch' / 'megatron' for TP")
    if plan.pp > 1 and caps.zero_stages_with_pp and backend.zero_stage not in caps.zero_stages_with_pp:
        raise PlanError(f"DeepSpeed's pipeline engine runs ZeRO stage {' or '.join(map(str, caps.zero_stages_with_pp))} "
                        f"only; got zero_stage={backend.zero_stage} with pp={plan.pp}: use Backend('deepspeed', "
                        f"zero_stage=1) or dp_shard='replicate'")
    if caps.model_families and config is not None:
        from rlkit.backends.families import check_experts, check_family

        check_family(config)
        check_experts(config, plan.ep)
    return backend


def make_model(backend: Backend, model: Any, plan: ParallelPlan, **kwargs: Any) -> Any:
    """This rank's model under ``backend``: ``ParallelModel``'s constructor arguments (``head``, ``lr``,
    ``max_grad_norm``, ``seed``, ``eps``, ``precision``, ``groups``, ``lora``), a collective."""
    if backend.name in REQUIRES:
        _quiet_library()
    if backend.name == "megatron":
        from rlkit.backends.megatron import MegatronModel

        kwargs.pop("groups", None)  # Megatron builds its own (parallel_state), in the same rank order
        return MegatronModel(model, plan, **kwargs)
    if backend.name == "deepspeed":
        from rlkit.backends.deepspeed import DeepSpeedModel

        kwargs.pop("groups", None)
        return DeepSpeedModel(model, plan, zero_stage=backend.zero_stage, **kwargs)
    from rlkit.parallel import ParallelModel

    return ParallelModel(model, plan, **kwargs)


def _quiet_library() -> None:
    """Worker noise out: Megatron-Core's and DeepSpeed's advisory warnings (no Apex, CUDA_DEVICE_MAX_CONNECTIONS,
    torch's deprecation of the all-gather they call) and DeepSpeed's INFO log (its op builds, its config dump).
    Their errors still raise, and DeepSpeed's own warnings still print."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", module=r"(megatron|deepspeed)\.")
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor` is deprecated", category=FutureWarning)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


__all__ = ["NAMES", "Backend", "check_backend", "installed", "make_model", "resolve"]
