"""Training backends: which library trains the actor, reference and critic on each rank.

* ``"torch"`` (the default): rlkit's own FSDP2 x DTensor TP x ``torch.distributed.pipelining``
  (``rlkit.parallel.ParallelModel``).
* ``"megatron"``: Megatron-Core's ``GPTModel`` built from the HF checkpoint, its TP / PP (1F1B) / DDP
  (``rlkit.backends.megatron``; extra ``rlkit[megatron]``).
* ``"deepspeed"``: DeepSpeed ZeRO 0-3 on the HF model over DP, its ``PipelineModule`` for PP
  (``rlkit.backends.deepspeed``; extra ``rlkit[deepspeed]``). DeepSpeed has no tensor parallelism for
  training an HF model here: ``tp > 1`` is refused.

Every backend's model offers ``ParallelModel``'s interface to the workers (``logprobs``, ``values``,
``train_step``, ``set_scoring``, ``set_packing``, ``iter_full_weights``, ``full_state_dict``, ``save``,
``load``, ``memory``, ``optimizer``, ``params``, ``lora``, ``last_transfer``), so the plan, the worker
contract, the rollout engines, weight sync, checkpoints and the live view stay the same above it.

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
    if backend.name == "torch":
        return backend
    module, extra = REQUIRES[backend.name]
    if not installed(backend.name):
        raise PlanError(f"backend={backend.name!r} needs {module}, which is not installed; install the extra: "
                        f"pip install 'rlkit[{extra}]' (or use backend='torch')")
    name = backend.name
    if lora is not None:
        raise PlanError(f"LoRA runs on backend='torch' only; backend={name!r} trains full weights (drop lora= or "
                        f"use backend='torch')")
    if padding_free:
        raise PlanError(f"padding_free=True runs on backend='torch' only; use padding_free=False with backend={name!r}")
    if rollout_tp is not None:
        raise PlanError(f"Rollout(tp={rollout_tp}) (the 3D-HybridEngine's generation layout) reshards the torch "
                        f"backend's DTensors; with backend={name!r} use Rollout(tp=None): one engine per DP group, "
                        f"synced from the full weights")
    if plan.order != "tp-dp-pp":
        raise PlanError(f"backend={name!r} lays ranks out in Megatron's order; use order='tp-dp-pp', not "
                        f"{plan.order!r}")
    if name == "megatron":
        from rlkit.backends.families import check_family

        if plan.dp_shard != "replicate" and plan.dp > 1:
            raise PlanError(f"Megatron-Core's DP replicates the weights (DDP; its distributed optimizer needs CUDA): "
                            f"dp_shard={plan.dp_shard!r} cannot run; use ParallelPlan(..., dp_shard='replicate')")
        if precision != "fp32":
            raise PlanError(f"backend='megatron' trains fp32 here (its bf16 path, Float16OptimizerWithFloat16Params, is "
                            f"not wired yet); use precision='fp32', or backend='torch' / 'deepspeed' for "
                            f"precision={precision!r}")
        if plan.vpp > 1:
            raise PlanError(f"backend='megatron' runs vpp=1 here (virtual stages are not wired yet); got vpp={plan.vpp}")
        if config is not None:
            check_family(config)
    if name == "deepspeed":
        if plan.tp > 1:
            raise PlanError(f"backend='deepspeed' cannot run tp={plan.tp}: DeepSpeed trains an HF model with ZeRO "
                            f"over DP and its PipelineModule over PP, but has no tensor parallelism for it (its "
                            f"AutoTP is for inference); use tp=1, or backend='torch' / 'megatron' for TP")
        if plan.vpp > 1:
            raise PlanError(f"backend='deepspeed' has no virtual pipeline stages; use vpp=1 (got vpp={plan.vpp})")
        if plan.pp > 1 and backend.zero_stage > 1:
            raise PlanError(f"DeepSpeed's pipeline engine runs ZeRO stage 0 or 1 only; got zero_stage="
                            f"{backend.zero_stage} with pp={plan.pp}: use Backend('deepspeed', zero_stage=1) or "
                            f"dp_shard='replicate'")
    return backend


def make_model(backend: Backend, model: Any, plan: ParallelPlan, **kwargs: Any) -> Any:
    """This rank's model under ``backend``: ``ParallelModel``'s constructor arguments (``head``, ``lr``,
    ``max_grad_norm``, ``seed``, ``eps``, ``precision``, ``groups``, ``lora``), a collective."""
    if backend.name != "torch":
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
