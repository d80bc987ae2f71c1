"""The 3D-HybridEngine's generation layout: which ranks generate together, and what resharding moves.

The actor trains under a ``ParallelPlan`` (dp x tp x pp) and generates under a smaller layout on the
same ranks: tensor parallel size ``t_g`` and no pipeline (HybridFlow, arXiv 2409.19256, Sec. 5). Each
DP replica of ``tp*pp`` ranks splits into ``d = tp*pp / t_g`` *generation groups* of ``t_g`` ranks, and
every group runs one engine on its share of the replica's prompts: every rank generates.

Grouping (HybridFlow's strided grouping, so that no byte is held twice): with ``k = tp / t_g``, the
rank at training coordinates ``(dp, tp_r, pp_r)`` holds generation TP shard ``g = tp_r // k`` and
belongs to generation group ``j = tp_r % k + k * pp_r``. Its training shard -- TP chunk ``tp_r`` of its
stage's layers -- lies inside its generation shard, TP chunk ``g`` (of ``t_g``) of *all* layers. The
ranks that share a generation shard form a *micro-DP group* (``d`` ranks: every stage, every training
chunk inside ``g``); all-gathering inside it is the whole resharding.

Per rank, the HybridFlow volumes (Table 2) with ``M`` the model's bytes:
    received = (tp*pp - t_g) / (t_g * tp * pp) * M         peak parameters = M / t_g
When DP also shards the weights (FSDP, ``S = plan.dp_shard_degree``), a rank first gathers its TP
shard inside its DP group, so received = M / t_g - M / (tp * pp * S).

>>> lay = GenerationLayout(ParallelPlan(tp=2, pp=2), tp=2)
>>> lay.micro_dp, lay.generation_groups(), lay.micro_dp_groups()
(2, [[0, 1], [2, 3]], [[0, 2], [1, 3]])
>>> round(lay.received_fraction(), 4), lay.parameter_fraction()
(0.25, 0.5)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlkit.errors import PlanError
from rlkit.plan.topology import ParallelPlan, divisors

if TYPE_CHECKING:
    import pandas as pd


def valid_generation_tp(plan: ParallelPlan, model: Any = None) -> list[int]:
    """The ``t_g`` that work with ``plan`` (divisors of its tp) and, given a model, its heads.

    >>> valid_generation_tp(ParallelPlan(tp=4, pp=2), {"num_attention_heads": 6, "num_key_value_heads": 2,
    ...                                                 "num_hidden_layers": 4, "hidden_size": 96})
    [1, 2]
    """
    ok = divisors(plan.tp)
    if model is not None:
        from rlkit.plan.spec import as_spec

        spec = as_spec(model)
        ok = [t for t in ok if spec.num_attention_heads % t == 0 and spec.num_key_value_heads % t == 0]
    return ok


@dataclass(frozen=True)
class GenerationLayout:
    """Generation groups and micro-DP groups of a training ``plan`` for rollout tensor parallel ``tp``.

    >>> lay = GenerationLayout(ParallelPlan(dp=2, tp=2, pp=2), tp=1)
    >>> lay.generation_groups()[:3], lay.micro_dp_groups()
    ([[0], [1], [4]], [[0, 1, 4, 5], [2, 3, 6, 7]])
    >>> GenerationLayout(ParallelPlan(tp=2), tp=4)
    Traceback (most recent call last):
    ...
    rlkit.errors.PlanError: Rollout(tp=4) is larger than the training group tp*pp=2*1=2; choose tp in {1, 2}
    """

    plan: ParallelPlan
    tp: int = 1

    def __post_init__(self) -> None:
        t, p, tg = self.plan.tp, self.plan.pp, self.tp
        choose = "{" + ", ".join(map(str, divisors(t))) + "}"
        if isinstance(tg, bool) or not isinstance(tg, int) or tg < 1:
            raise PlanError(f"Rollout(tp={tg!r}) must be a positive integer; choose tp in {choose}")
        if tg > t * p:
            raise PlanError(f"Rollout(tp={tg}) is larger than the training group tp*pp={t}*{p}={t * p}; "
                            f"choose tp in {choose}")
        if t % tg:
            why = (f"does not divide tp*pp={t * p}" if (t * p) % tg else
                   f"divides tp*pp={t * p} but not the training tp={t}: a generation shard would not contain "
                   f"each rank's training shard, which zero-redundancy resharding needs (HybridFlow Sec. 5)")
            raise PlanError(f"Rollout(tp={tg}) {why}; choose tp in {choose}")

    def validate(self, model: Any) -> GenerationLayout:
        """Check ``tp`` against the model's attention and KV heads (each rank needs whole heads)."""
        from rlkit.plan.spec import as_spec

        spec = as_spec(model)
        for what, n in (("num_attention_heads", spec.num_attention_heads),
                        ("num_key_value_heads", spec.num_key_value_heads)):
            if n % self.tp:
                ok = "{" + ", ".join(map(str, valid_generation_tp(self.plan, model))) + "}"
                raise PlanError(f"Rollout(tp={self.tp}) does not divide {what}={n}; choose tp in {ok}")
        if 1 < self.tp < self.plan.tp and spec.vocab_size % self.plan.tp:
            # torch.chunk of a chunk is not a chunk when sizes do not divide: the splits would disagree
            raise PlanError(f"Rollout(tp={self.tp}) with training tp={self.plan.tp}: vocab_size={spec.vocab_size} "
                            f"does not divide by {self.plan.tp}, so the generation and training vocab splits "
                            f"disagree; choose tp in {{1, {self.plan.tp}}}")
        return self

    # ---- sizes ----------------------------------------------------------------------------------
    @property
    def k(self) -> int:
        """Training TP chunks inside one generation TP chunk."""
        return self.plan.tp // self.tp

    @property
    def micro_dp(self) -> int:
        """Generation groups per DP replica (HybridFlow's d_g): also the size of a micro-DP group."""
        return self.plan.tp * self.plan.pp // self.tp

    @property
    def engines(self) -> int:
        """Engines in the whole world: one per generation group."""
        return self.plan.dp * self.micro_dp

    # ---- ranks ----------------------------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """``{"dp", "group", "gen_tp"}``: the DP replica, generation group inside it, and shard."""
        c = self.plan.coords(rank)
        return {"dp": c["dp"], "group": c["tp"] % self.k + self.k * c["pp"], "gen_tp": c["tp"] // self.k}

    def rank(self, *, dp: int, group: int, gen_tp: int) -> int:
        return self.plan.rank(dp=dp, tp=gen_tp * self.k + group % self.k, pp=group // self.k)

    def generation_group(self, rank: int) -> list[int]:
        """The ``tp`` ranks of ``rank``'s engine, in generation-TP order."""
        c = self.coords(rank)
        return [self.rank(dp=c["dp"], group=c["group"], gen_tp=g) for g in range(self.tp)]

    def micro_dp_group(self, rank: int) -> list[int]:
        """The ranks holding ``rank``'s generation shard, in group order (they all-gather it)."""
        c = self.coords(rank)
        return [self.rank(dp=c["dp"], group=j, gen_tp=c["gen_tp"]) for j in range(self.micro_dp)]

    def generation_groups(self) -> list[list[int]]:
        return [self.generation_group(self.rank(dp=d, group=j, gen_tp=0))
                for d in range(self.plan.dp) for j in range(self.micro_dp)]

    def micro_dp_groups(self) -> list[list[int]]:
        return [self.micro_dp_group(self.rank(dp=d, group=0, gen_tp=g))
                for d in range(self.plan.dp) for g in range(self.tp)]

    def mesh(self) -> list[list[list[int]]]:
        """Ranks as a (dp, micro_dp, gen_tp) array: a DeviceMesh over it has the generation groups
        along its last dim and the micro-DP groups along the middle one."""
        return [[self.generation_group(self.rank(dp=d, group=j, gen_tp=0)) for j in range(self.micro_dp)]
                for d in range(self.plan.dp)]

    def prompt_slices(self, n: int) -> list[slice]:
        """How a replica's ``n`` prompts split over its generation groups (contiguous, in order, sizes
        differing by at most one): results concatenated in group order are in prompt order."""
        d = self.micro_dp
        bounds = [n * j // d for j in range(d + 1)]
        return [slice(bounds[j], bounds[j + 1]) for j in range(d)]

    def table(self) -> pd.DataFrame:
        """One row per rank: training coordinates beside generation group and shard."""
        import pandas as pd

        rows = []
        for r in range(self.plan.world_size):
            c, g = self.plan.coords(r), self.coords(r)
            rows.append({"rank": r, "dp": c["dp"], "tp": c["tp"], "pp": c["pp"],
                         "gen_group": g["dp"] * self.micro_dp + g["group"], "gen_tp": g["gen_tp"],
                         "engine_ranks": self.generation_group(r), "micro_dp_group": self.micro_dp_group(r)})
        return pd.DataFrame(rows)

    # ---- volumes (fractions of the model's bytes M) ---------------------------------------------
    def received_fraction(self, fsdp: bool = True) -> float:
        """Bytes a rank receives per resharding, over M: HybridFlow's (tp*pp - t_g)/(t_g*tp*pp), or
        with FSDP sharding (``fsdp`` and ``plan.dp_shard_degree`` > 1) 1/t_g - 1/(tp*pp*S)."""
        t, p = self.plan.tp, self.plan.pp
        s = self.plan.dp_shard_degree if fsdp and self.plan.dp > 1 else 1
        return 1 / self.tp - 1 / (t * p * s)

    def parameter_fraction(self, fsdp: bool = True) -> float:
        """Parameter bytes per rank while generating, over M: the generation shard, 1/t_g (the training
        shard lies inside it and is not held twice). With FSDP sharding (``fsdp`` and S =
        ``plan.dp_shard_degree`` > 1) the rank's FSDP shard stays allocated too: + 1/(tp*pp*S)."""
        s = self.plan.dp_shard_degree if fsdp and self.plan.dp > 1 else 1
        return 1 / self.tp + (1 / (self.plan.tp * self.plan.pp * s) if s > 1 else 0.0)

    def __repr__(self) -> str:
        return (f"GenerationLayout(train {self.plan.describe()}; generate tp={self.tp}: {self.engines} engines, "
                f"{self.micro_dp} per DP replica)")
