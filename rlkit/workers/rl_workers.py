"""RLWorkers: the controller's typed handle on a Trainer's worker groups, one named method per step of
the RL dataflow.

``Trainer.train_step`` calls these methods and nothing else remote; each calls the worker method of the
same name (``RLWorker.update_actor`` ...) through the group's dispatch mode, so an editor's
go-to-definition leads from the loop to the code that runs on the ranks. The same code drives the Ray
``WorkerGroup`` and the in-process ``LocalWorkerGroup`` (the protocol of ``rlkit.workers.base``).
``group.call_dp(...)`` stays public for hand-written dataflows (the tutorials).

>>> from rlkit.workers.placement import Placement
>>> from rlkit.plan import ParallelPlan
>>> w = RLWorkers.start(Placement.colocated(ParallelPlan()), cluster=None, worker_kwargs=kw)  # doctest: +SKIP
>>> w.sync_weights(); batch = w.generate(prompts, seed=0, policy_version=0)                  # doctest: +SKIP
>>> w.update_actor(batch, UpdateSettings(lr=1e-5))                                           # doctest: +SKIP
"""

from __future__ import annotations

import os
import time
import warnings
import weakref
from typing import Any

import torch

from rlkit.batch import Batch, take
from rlkit.errors import WorkerError
from rlkit.parallel.packing import balanced_order
from rlkit.rollout.base import ImagePrompt
from rlkit.workers.base import BaseWorkerGroup
from rlkit.workers.layout import SequenceLayout
from rlkit.workers.placement import Placement
from rlkit.workers.rl import WEIGHT, RLWorker, RolloutWorker, SyncReport, UpdateSettings, is_maximum
from rlkit.workers.teacher import TeacherWorker


class RLWorkers:
    """The actor's ``RLWorker`` group and, in split placement, the ``RolloutWorker`` group; see the module
    docstring. Every call waits at most ``timeout_s`` seconds."""

    def __init__(self, group: BaseWorkerGroup, rollout_group: BaseWorkerGroup | None, placement: Placement,
                 layout: SequenceLayout, timeout_s: float, balance: bool = False, env_rows: bool = False,
                 teacher_group: BaseWorkerGroup | None = None):
        self.group, self.rollout_group, self.placement = group, rollout_group, placement
        self.teacher_group = teacher_group  # a teacher pool's TeacherWorker group (None: in the actor's workers)
        self.layout, self.timeout_s = layout, timeout_s
        self.balance = balance
        self.env_rows = env_rows  # multi-turn with an environment: requests carry each prompt's dataset row
        self._channel_open = False  # split placement's weight channel (opened at the first sync)
        self._receiving: Any = None  # the rollout workers' last receive_weights in flight
        self._rollout_calls: list[Any] = []  # split placement: the rollout workers' calls in flight

    # ---- start -----------------------------------------------------------------------------------
    @classmethod
    def start(cls, placement: Placement, cluster: Any, *, model_path: str, layout: SequenceLayout,
              worker_kwargs: dict[str, Any], seed: int, timeout_s: float, owner: Any = None,
              interactive: bool = False, held: list | None = None) -> tuple[RLWorkers, Any]:
        """Start the groups ``placement`` asks for; returns ``(workers, cluster)``.

        A one-rank colocated placement with no ``cluster`` runs its worker in this process (no Ray to
        start, no second interpreter, no pickling per call). Otherwise the groups run on ``cluster`` (an
        embedded local Ray cluster when None), on the pools ``placement.reserve`` makes; older owners of
        the same type (a notebook cell run again) are closed first when ``interactive`` and room is short.
        ``held`` collects the groups as they start (the owner's finalizer shuts them down).
        """
        held = [] if held is None else held
        plan, rollout = placement.plan, worker_kwargs["rollout"]
        agent = worker_kwargs.get("agent")
        env_rows = agent is not None and agent.environment is not None
        if agent is not None:  # tools and environments defined next to the driver travel by value
            from rlkit.workers.group import ship_by_value

            for obj in (*[t.fn for t in agent.tools], agent.environment):
                if obj is not None:
                    ship_by_value(obj)
        args = (model_path, plan)
        teacher_path = worker_kwargs.get("ref_path")
        if placement.teacher_plan is not None:  # the teacher scores on its own pool: no reference in the actor's
            worker_kwargs = dict(worker_kwargs, need_ref=False, ref_path=None)
        kwargs = dict(worker_kwargs, layout=layout, seed=seed,
                      colocate_rollout=placement.kind == "colocated")
        if cluster is None and placement.world_size == 1:
            from rlkit.workers.local import LocalWorkerGroup

            group = LocalWorkerGroup(plan, RLWorker, *args, **kwargs, name="rl", owner=owner)
            held.append(group)
            return cls(group, None, placement, layout, timeout_s, env_rows=env_rows), None  # one rank: nothing to balance
        from rlkit.cluster import Cluster
        from rlkit.workers.group import WorkerGroup

        if cluster is None:  # the live cluster of this process where it has room, else an embedded one
            live = Cluster.current()
            cluster = live if live is not None and live.num_devices >= placement.world_size else \
                Cluster(num_cpus=max(os.cpu_count() or 1, placement.world_size))
        # more ranks than devices: a fraction of a CPU each, with an OversubscribedWarning giving the numbers
        cpus = cluster.cpus_per_rank(placement.world_size)
        gpw = cluster.gpus_per_worker
        need = {"CPU": cpus * placement.world_size, **({"GPU": gpw * placement.world_size} if gpw else {})}
        closed = cluster.make_room(need, owner, replace_older=interactive)
        if closed:
            warnings.warn(f"rlkit: closed the earlier {', '.join(closed)} to free its workers for this one "
                          f"(a notebook cell run again?); close trainers yourself with trainer.close() to keep "
                          f"control", stacklevel=4)
        pools = placement.reserve(cluster, cpus_per_worker=cpus)
        try:
            group = WorkerGroup(cluster, plan, RLWorker, *args, **kwargs, pool=pools["actor"], owns_pool=True,
                                timeout_s=timeout_s, name="rl", owner=owner)
            held.append(group)
            rollout_group = None
            if "rollout" in pools:
                rollout_group = WorkerGroup(cluster, placement.rollout_workers, RolloutWorker, model_path,
                                            rollout=rollout, layout=layout, seed=seed,
                                            lora=worker_kwargs.get("lora"), agent=worker_kwargs.get("agent"),
                                            init_process_group=False, pool=pools["rollout"], owns_pool=True,
                                            timeout_s=timeout_s, name="rollout", owner=owner)
                held.append(rollout_group)
            teacher_group = None
            if "teacher" in pools:
                teacher_group = WorkerGroup(cluster, placement.teacher_plan, TeacherWorker, teacher_path,
                                            placement.teacher_plan, layout=layout, seed=seed,
                                            precision=worker_kwargs.get("precision", "fp32"),
                                            padding_free=bool(worker_kwargs.get("padding_free")),
                                            micro_batch_tokens=worker_kwargs.get("micro_batch_tokens"),
                                            pool=pools["teacher"],
                                            owns_pool=True, timeout_s=timeout_s, name="teacher", owner=owner)
                held.append(teacher_group)
        except BaseException:
            for g in reversed(held):
                g.shutdown(polite=False)
            for pool in pools.values():
                pool.remove()
            held.clear()
            raise
        return cls(group, rollout_group, placement, layout, timeout_s, balance=bool(worker_kwargs.get("padding_free")),
                   env_rows=env_rows, teacher_group=teacher_group), cluster

    # ---- the dataflow's calls --------------------------------------------------------------------
    def sync_weights(self) -> list[SyncReport]:
        """The actor's current weights into the rollout engines, one report per process that took part:
        streamed in place (colocated), resharded into the generation layout (``Rollout(tp=...)``), or
        gathered on the actor's rank 0 and sent from there to every rollout worker over the weight channel
        (split; ``sync_weights_async``)."""
        if self.rollout_group is None:
            return self.group.call(RLWorker.sync_weights, timeout=self.timeout_s)
        t0 = time.perf_counter()
        reports = self.sync_weights_async().result(self.timeout_s)
        # the engines' reports carry the whole sync's time: gather, channel and load
        seconds = time.perf_counter() - t0
        n = self.group.world_size  # the actor's reports first, then the engines'
        return reports[:n] + [SyncReport({**r, "seconds": seconds}) for r in reports[n:]]

    def generate(self, prompts: list[dict[str, Any]], seed: int, policy_version: int,
                 **overrides: Any) -> Batch:
        """``Rollout.n`` samples of each prompt row (``{"prompt", "_row", ...}``), one batch of the run's
        ``SequenceLayout`` in prompt order, each sample tagged with ``policy_version``; the rows'
        other columns under ``"columns"`` (what reward functions get)."""
        return self.generate_async(prompts, seed, policy_version, **overrides).result()

    def generate_async(self, prompts: list[dict[str, Any]], seed: int, policy_version: int,
                       **overrides: Any) -> PendingBatch:
        """``generate`` in flight: the engines sample while the caller goes on (split placement: the rollout
        workers, while the actor's workers train); ``.result()`` waits (bounded by ``timeout_s``)."""
        request = {"prompt": [p["prompt"] for p in prompts], "uid": list(range(len(prompts))),
                   "row": [p["_row"] for p in prompts]}
        if self.env_rows:  # the environments reset from the dataset rows, on the workers
            request["env_row"] = [p["_env_row"] for p in prompts]
        group = self.rollout_group or self.group
        method = RolloutWorker.generate if self.rollout_group is not None else RLWorker.generate
        future = group.call_dp_async(method, request, seed, **overrides)
        if self.rollout_group is not None:
            self._rollout_calls = [f for f in self._rollout_calls if not f.done()] + [future]
        return PendingBatch(self, future, prompts, policy_version)

    def continue_async(self, request: dict[str, list], max_new_tokens: int, stale_kv: bool = False) -> Any:
        """Streaming: a chunk of every running sample on the rollout workers (``RolloutWorker.continue_samples``;
        ``request``'s per-sample lists split over them), queued behind what they run; ``.result(timeout)`` is its
        dict of per-sample lists."""
        future = self.rollout_group.call_dp_async(RolloutWorker.continue_samples, request, max_new_tokens, stale_kv)
        self._rollout_calls = [f for f in self._rollout_calls if not f.done()] + [future]
        return future

    def sync_weights_async(self) -> SyncInFlight:
        """Split placement: gather the actor's weights to its rank 0 now (a collective on the actor's group,
        which waits for it), which sends them to the rollout workers over the weight channel
        (``rlkit.workers.weight_channel``) from a thread while the actor goes on; each rollout worker takes
        them behind the generations already queued there and ahead of the next. Returns the sync in flight
        (``.result()``: its reports). Colocated: ``sync_weights``, done."""
        if self.rollout_group is None:
            return SyncInFlight(self.sync_weights())
        self._open_channel()
        if self._receiving is not None and self._receiving.done():
            self._receiving.result(self.timeout_s)  # a rollout worker that died is reported as itself, not as the send
        try:
            sent = self.group.call(RLWorker.send_weights, timeout=self.timeout_s)
        except WorkerError as e:
            # a rollout worker killed mid-send shows here first, as the channel's gloo error: name the dead one
            for future in self._rollout_calls:
                death = future.death(within_s=5.0)
                if death is not None:
                    raise death from e
            raise
        self._receiving = self.rollout_group.call_async(RolloutWorker.receive_weights, sent[0][0])
        self._rollout_calls = [f for f in self._rollout_calls if not f.done()] + [self._receiving]
        return SyncInFlight([report for _, report in sent], self._receiving)

    def _open_channel(self) -> None:
        """The weight channel from the actor's rank 0 to the rollout workers, opened at the first split sync."""
        if self._channel_open:
            return
        size = self.rollout_group.world_size + 1
        address = self.group.call(RLWorker.host_weight_channel, size - 1, self.timeout_s, timeout=self.timeout_s)[0]
        sender = self.group.call_async(RLWorker.join_weight_channel)
        receivers = self.rollout_group.call_async(RolloutWorker.join_weight_channel, *address, size, self.timeout_s)
        sender.result(self.timeout_s)
        receivers.result(self.timeout_s)
        self._channel_open = True

    def ref_logprobs(self, batch: Batch) -> torch.Tensor:
        """The reference model's log-probs of the response tokens (a teacher pool's, where there is one)."""
        if self.teacher_group is not None:
            return self.teacher_group.call_dp(TeacherWorker.ref_logprobs, Batch.of(batch),
                                              timeout=self.timeout_s)["ref_logprobs"]
        return self._call_dp(RLWorker.ref_logprobs, batch)["ref_logprobs"]

    def values(self, batch: Batch) -> torch.Tensor:
        """The critic's values of the states before each response token."""
        return self._call_dp(RLWorker.values, batch)["values"]

    def old_logprobs(self, batch: Batch) -> torch.Tensor:
        """The actor's log-probs of the response tokens before this step's update (pi_old)."""
        return self._call_dp(RLWorker.actor_logprobs, batch)["logprobs"]

    def update_actor(self, batch: Batch, settings: UpdateSettings) -> dict[str, float]:
        """One update of the actor on ``batch`` (split by DP rank); its metrics averaged over DP ranks."""
        self.group.ship_code(settings.policy_loss)
        return _mean_dicts(self._call_dp(RLWorker.update_actor, batch, settings, minibatches=settings.minibatches))

    def update_critic(self, batch: Batch, settings: UpdateSettings) -> dict[str, float]:
        """One update of the critic on ``batch``; its metrics averaged over DP ranks."""
        return _mean_dicts(self._call_dp(RLWorker.update_critic, batch, settings, minibatches=settings.minibatches))

    def _call_dp(self, method: Any, batch: Batch, *args: Any, minibatches: int = 1) -> Any:
        """``group.call_dp`` with the samples dealt to DP ranks by tokens, not rows, when the workers run
        padding-free (``rlkit.parallel.packing.balanced_order``): no rank waits for one with the long
        responses. Per-sample results come back in the batch's own order."""
        batch, dp = Batch.of(batch), self.placement.plan.dp
        if not self.balance or dp == 1 or len(batch) % (dp * minibatches):
            return self.group.call_dp(method, batch, *args, timeout=self.timeout_s)
        order = balanced_order(batch.attention_mask.sum(-1).tolist(), dp, minibatches)
        out = self.group.call_dp(method, batch.take(order), *args, timeout=self.timeout_s)
        if isinstance(out, list):  # not per-sample (an update's metrics, one dict per DP rank)
            return out
        back = [0] * len(order)
        for position, row in enumerate(order):
            back[row] = position
        return take(out, back)

    # ---- state -----------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """Every rank's sharded training state into the folder ``path`` (which must exist)."""
        self.group.call(RLWorker.save, path, timeout=self.timeout_s)

    def load(self, path: str) -> None:
        """Every rank's training state from ``save``'s folder; the engines follow at the next sync."""
        self.group.call(RLWorker.load, path, timeout=self.timeout_s)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The actor's full HF-named weights (CPU), gathered from every rank's shards to the driver."""
        return self.group.call(RLWorker.full_weights, timeout=self.timeout_s)[0]

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The actor's LoRA adapters (CPU), gathered from every rank's shards to the driver."""
        return self.group.call(RLWorker.adapter_weights, timeout=self.timeout_s)[0]

    def close(self) -> None:
        """Close the workers politely (bounded), then shut the groups down. Idempotent."""
        for group in (self.teacher_group, self.rollout_group, self.group):
            if group is None:
                continue
            try:
                group.call("close", timeout=30)
            except Exception:
                pass  # a broken group is torn down below all the same
            group.shutdown()


def _mean_dicts(parts: Any) -> dict[str, float]:
    """The DP ranks' update metrics in one dict: each averaged over the ranks, by the ranks' weight in the
    loss (their loss tokens, ``rl.WEIGHT``) when they carry one, so a rank with long samples counts more."""
    parts = [p for p in (parts if isinstance(parts, list) else [parts]) if p]
    keys = {k for p in parts for k in p} - {WEIGHT}
    out = {}
    for k in sorted(keys):
        have = [p for p in parts if k in p]
        if is_maximum(k):
            out[k] = max(p[k] for p in have)
            continue
        weights = [p.get(WEIGHT, 1.0) for p in have]
        if sum(weights) <= 0:
            weights = [1.0] * len(have)
        out[k] = sum(p[k] * w for p, w in zip(have, weights)) / sum(weights)
    return out


def start_finalizer(owner: Any) -> list:
    """A list of worker groups that are shut down when ``owner`` is garbage (its ``weakref.finalize``)."""
    held: list = []
    fin = weakref.finalize(owner, shutdown_groups, held)
    fin.atexit = False
    return held


def shutdown_groups(groups: list[Any]) -> None:
    """Shut down and forget ``groups`` (a finalizer's: must not refer to their owner)."""
    while groups:
        try:
            groups.pop().shutdown(polite=False)
        except Exception:  # Ray already gone (interpreter exit, cluster shut down)
            pass


__all__ = ["RLWorkers", "shutdown_groups", "start_finalizer"]


class PendingBatch:
    """A generation in flight (``RLWorkers.generate_async``); ``result()`` gives ``generate``'s batch."""

    def __init__(self, workers: RLWorkers, future: Any, prompts: list[dict[str, Any]], policy_version: int):
        self.workers, self.future, self.prompts, self.policy_version = workers, future, prompts, policy_version
        self._batch: Batch | None = None

    @classmethod
    def ready(cls, batch: Batch, prompts: list[dict[str, Any]], policy_version: int) -> PendingBatch:
        """One already generated (a checkpoint's batch in flight at save)."""
        out = cls(None, None, prompts, policy_version)
        out._batch = batch
        return out

    def done(self) -> bool:
        return self._batch is not None or self.future.done()

    def result(self) -> Batch:
        if self._batch is None:
            parts = self.future.result(self.workers.timeout_s)
            batch = Batch.cat(parts) if isinstance(parts, list) else parts
            prompts = self.prompts
            # each sample's prompt row (what reward functions get), and the policy version that sampled it
            batch.columns = {k: [_as_text(prompts[u][k]) for u in batch.uid] for k in prompts[0]
                             if k not in ("_row", "_env_row")}
            batch.policy_version = torch.full((len(batch),), int(self.policy_version), dtype=torch.long)
            self._batch = batch
        return self._batch


class SyncInFlight:
    """A sync's reports: the actor side's at once, the rollout side's when its queued load has run."""

    def __init__(self, reports: list[SyncReport], later: Any = None):
        self.reports, self.later = reports, later

    def result(self, timeout: float | None = None) -> list[SyncReport]:
        if self.later is not None:
            self.reports = self.reports + list(self.later.result(timeout))
            self.later = None
        return self.reports


def _as_text(value: Any) -> Any:
    """A column value as reward functions get it: a prompt with images (``ImagePrompt``) as its rendered text."""
    return value.text if isinstance(value, ImagePrompt) else value
