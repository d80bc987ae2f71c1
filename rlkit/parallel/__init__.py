"""A ParallelPlan made real inside one process group: FSDP2 x TP x PP on an HF causal LM.

``init_distributed`` -> ``ParallelModel(model, plan)`` -> ``logprobs`` / ``train_step`` / ``save`` /
``iter_full_weights`` / ``memory``. The building blocks (``build_groups``, ``apply_tp``,
``apply_fsdp``, ``apply_ac``, ``split_stages``) are usable on their own. Works the same under
torchrun and inside Ray workers (only the standard env variables are read).
"""

from rlkit.parallel.apply import apply_ac, apply_fsdp, apply_tp, tp_plan
from rlkit.parallel.dist import free_port, init_distributed, propagate_errors
from rlkit.parallel.groups import ProcessGroups, build_generation_groups, build_groups
from rlkit.parallel.model import ParallelModel
from rlkit.parallel.stage import Stage, causal_padding_mask, split_stages, token_logprobs

__all__ = ["ParallelModel", "ProcessGroups", "Stage", "apply_ac", "apply_fsdp", "apply_tp", "build_generation_groups",
           "build_groups", "causal_padding_mask", "free_port", "init_distributed", "propagate_errors", "split_stages", "token_logprobs", "tp_plan"]
