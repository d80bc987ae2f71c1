"""Trainer: the single controller. ``train_step`` reads as the RL dataflow, one named call per step:

    sync weights -> generate -> reward -> reference / values / old log-probs -> advantages -> update

Distribution lives in the worker groups (``rlkit.workers.rl_workers.RLWorkers``, typed calls on the
``RLWorker`` of every rank of the actor's ParallelPlan); the algorithm lives in ``rlkit.algos`` as small
functions on tensors, picked by name from its registry. The inputs and their checks are in
``rlkit.inputs``, the run folder in ``rlkit.run_dir``, the settings in ``rlkit.config``.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from rlkit import inputs
from rlkit.ahead import AheadQueue
from rlkit.algos import get_algorithm, get_policy_loss, known_algorithms
from rlkit.batch import Batch
from rlkit.config import TrainerConfig
from rlkit.data import heldout_split
from rlkit.errors import RewardError, TrainerError
from rlkit.estimate import offpolicy_metrics, step_advantages
from rlkit.history import History
from rlkit.hub import resolve_checkpoint
from rlkit.interrupt import StopOnInterrupt
from rlkit.plan.topology import ParallelPlan
from rlkit.recovery import restart
from rlkit.rewards.functions import RewardFunctions
from rlkit.rollout import Rollout
from rlkit.run_dir import RunDir
from rlkit.step_batch import StepBatch
from rlkit.trainer_io import TrainerIO
from rlkit.workers.layout import SequenceLayout
from rlkit.workers.placement import Placement


class Trainer(TrainerIO):
    """RL post-training of a causal LM on a worker group (Ray, or this process for one rank).

    Args:
        model: a checkpoint folder or hub id (``rlkit.models.tiny_lm(...)`` builds one locally).
        dataset: a task from ``rlkit.tasks`` (e.g. ``rlkit.tasks.reasoning_gym("basic_arithmetic")``), or
            rows with a ``prompt`` column (another with ``prompt_column=``): a list of dicts, a DataFrame, a
            ``datasets.Dataset`` or ``DatasetDict`` (its "train" split; evaluate() uses its "test" or
            "validation" split), a path to a .jsonl/.json/.csv/.parquet file, or a hub dataset name (see
            ``rlkit.data.read_rows``). A prompt is text, or a chat (TRL's conversational format, a list of
            ``{"role", "content"}`` messages), which the model's chat template renders once, in the driver,
            with the assistant turn opened. The rows' other columns go to the reward as keywords.
        reward: ``f(prompts, completions, **columns) -> list[float]``, or a list of functions and
            ``(f, weight)`` pairs (default: the task's ``reward``).
        algorithm: a name in ``rlkit.algos.ALGORITHMS`` (grpo, drgrpo, rloo, reinforce++,
            reinforce++-baseline, ppo) or an advantage estimator's name, your own included
            (``@rlkit.algos.register_advantage``).
        plan: the actor's ParallelPlan (default: one rank).
        rollout: sampling (default ``Rollout(n=4, max_new_tokens=16)``).
        cluster: an ``rlkit.Cluster`` to run the workers on. Default: a one-rank plan (colocated) runs its
            worker in this process, without Ray (it starts in seconds, like TRL); a bigger plan runs on the
            live ``rlkit.Cluster`` of this process where it has a device per rank, else it starts an embedded
            local Ray cluster.
        placement: "colocated" (HybridEngine: one engine per DP group on the actor's workers, weights
            streamed in place), "split" (``rollout_workers`` engines on their own workers; weights
            gathered to the actor's rank 0 and sent from there over a weight channel), or an
            ``rlkit.Placement`` mapping the roles to pools by hand (the same two shapes, and a distillation
            teacher's pool of its own: ``Placement.colocated(plan, teacher=ParallelPlan(tp=2))``).
        tools: multi-turn rollouts with tools: plain typed functions with Google-style docstrings (TRL's
            convention), e.g. ``def calculator(expression: str) -> str``. The model calls them in the Hermes
            ``<tool_call>`` format, rendered by its chat template (``rlkit.agent.chat``); they run on the
            worker that generates, each call bounded by ``MultiTurn.tool_timeout_s``.
        environment: a class (or factory) making one environment per episode, with ``reset(row)`` -> the
            opening messages and ``step(message)`` -> ``rlkit.EnvStep(messages, done, reward)``
            (``rlkit.agent.environment``); its rewards add to the reward functions' (``reward`` may be None).
        max_turns: assistant turns per episode (multi-turn; shorthand for ``multi_turn=MultiTurn(max_turns=...)``).
        multi_turn: an ``rlkit.MultiTurn`` with the episode's bounds (turns, total tokens, tool timeout). Only
            the sampled tokens carry loss; tool and environment messages are in the sequence, masked out of
            the policy loss, the KL and the entropy (``batch["loss_mask"]``). Advantages are per trajectory:
            GRPO's group is a prompt's ``Rollout.n`` episodes, and the outcome reward sits on the episode's
            last sampled token (GAE runs over the sampled tokens, the messages between them skipped).
        config: a ``TrainerConfig``; keyword ``overrides`` change single fields.

    >>> import rlkit
    >>> trainer = rlkit.Trainer(model=rlkit.models.tiny_lm("qwen2", size="small"),   # doctest: +SKIP
    ...     dataset=rlkit.tasks.repeat, algorithm="grpo", plan=rlkit.ParallelPlan(dp=2),
    ...     rollout=rlkit.Rollout(engine="hf", n=8, max_new_tokens=16), lr=2e-3)
    >>> trainer.fit(steps=40).tail(1)["reward/mean"]                               # doctest: +SKIP
    """

    def __init__(self, model: str, dataset: Any, reward: Any = None, algorithm: str = "grpo",
                 plan: ParallelPlan | None = None, rollout: Rollout | None = None, cluster: Any = None,
                 config: TrainerConfig | None = None, callbacks: Sequence[Callable] = (),
                 placement: str | Placement = "colocated", rollout_workers: int = 1, tools: Sequence[Callable] | None = None,
                 environment: Any = None, max_turns: int | None = None, multi_turn: Any = None, sampler: Any = None,
                 **overrides: Any):
        # Everything is checked here, in the driver, before a worker starts: each error names the value.
        self.config = inputs.config_with(config, overrides)
        self.model_path = resolve_checkpoint(model)
        try:  # a registered name as given, else in lower case ("GRPO")
            self.algo = get_algorithm(algorithm if not isinstance(algorithm, str) or algorithm in
                                      known_algorithms() else algorithm.lower())
        except ValueError as e:
            raise TrainerError(str(e)) from None
        self.algorithm = self.algo.name
        self.policy_loss = get_policy_loss(self.algo.policy_loss)
        inputs.check_loss_options(self.config, self.policy_loss, self.algo.policy_loss)
        inputs.check_types(plan, rollout, cluster, callbacks)
        self.plan = plan or (placement.plan if isinstance(placement, Placement) else ParallelPlan())
        self.rollout = rollout or Rollout(n=4, max_new_tokens=16)
        self.callbacks = list(callbacks)
        self.placement = Placement.of(placement, self.plan, rollout_workers)
        self.agent = inputs.agent_of(tools, environment, max_turns, multi_turn, self.rollout)  # None: single-turn
        self.tokenizer = inputs.load_tokenizer(self.model_path)
        self.task, rows = inputs.rows_of(dataset, self.config.train_size, self.config.seed,
                                         self.config.prompt_column)
        self._heldout = dataset if heldout_split(dataset) else None  # a DatasetDict's test split, for evaluate()
        inputs.check_eval(self.config, self.task, self._heldout)
        self.rows = self._render(rows)
        # an environment that rewards its episodes may be the only reward
        env_only = reward is None and self.task is None and self.agent is not None and environment is not None
        self.rewards = RewardFunctions([]) if env_only else RewardFunctions.of(reward, self.task,
                                                                                self.config.reward_timeout_s)
        inputs.check_sizes(self.config, self.plan, self.rollout, self.algo)
        response_len = self.agent.response_len if self.agent is not None else self.rollout.max_new_tokens
        self.layout = SequenceLayout(inputs.longest_prompt(self.rows, self.tokenizer, self.model_path, response_len),
                                     response_len)
        inputs.check_token_budget(self.config, self.layout)
        inputs.padding_free(self.config, self.plan)  # a token budget on a dp x pp plan fails here, before workers
        self.plan.validate(model=self.model_path)
        self.teacher_path = inputs.check_teacher(self.config, self.model_path, self.placement, self.passes)
        inputs.check_lora(self.config, self.model_path, self.plan)
        inputs.check_moe(self.config, self.model_path, self.rollout)
        self.backend = inputs.check_backend(self.config, self.plan, self.model_path, self.rollout)
        inputs.check_vision(self.config, self.model_path, self.backend, self.rollout, self.agent)
        inputs.check_off_policy(self.config, self.placement)
        inputs.check_overlong(self.config, self.agent)
        inputs.check_streaming(self.config, self.placement, self.agent)
        inputs.check_generation_layout(self.rollout, self.placement, self.model_path)
        self.step = 0
        # the dataset's prompt batches (rounds of prompts_per_step rows) taken: by the steps trained, and asynchronous
        # RL's launched ahead (== step without dynamic sampling and off_policy_steps)
        self.rounds = 0
        self.sampler = inputs.sampler_of(sampler)  # which rows each round takes (rlkit.sampler)
        self._chosen: dict[int, list[int]] = {}    # its choice per round, asked once
        self.history = History()  # metrics rows, recent samples, when each phase ran
        self.kl_ctl = self.config.kl_controller()
        self.run_dir = Path(self.config.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        self.runs = RunDir(self.run_dir)
        self.cluster, self.workers = cluster, None
        self._stop: StopOnInterrupt | None = None  # fit's Ctrl-C handler while it runs
        self._ahead = AheadQueue()  # asynchronous RL: the generations in flight (rlkit.ahead)
        self._stream = self._new_stream() if self.config.streaming else None  # streaming RL (rlkit.stream)
        self.restarts: list[dict[str, Any]] = []  # fit's restarts after lost workers (max_restarts)
        self._start_workers()

    def _start_workers(self) -> None:
        from rlkit.workers.rl_workers import RLWorkers, start_finalizer

        c = self.config
        self._held = start_finalizer(self)  # this Trainer's groups: shut down when it is garbage
        # who holds the CPUs, in the cluster's "held by" reports and a notebook cell run again
        self._holder_label = (f"Trainer({self.algorithm}, {self.plan.describe().split(' =')[0]}, made "
                              f"{time.strftime('%H:%M:%S')})")
        worker_kwargs = dict(rollout=self.rollout, actor_lr=c.lr, critic_lr=c.critic_lr, max_grad_norm=c.max_grad_norm,
                             need_ref=self.passes.reference, need_critic=self.passes.values, precision=c.precision,
                             padding_free=inputs.padding_free(c, self.plan), micro_batch_tokens=c.micro_batch_tokens,
                             lora=c.lora, agent=self.agent, train_backend=self.backend, ref_path=self.teacher_path,
                             router=(c.router_aux_coef, c.router_z_coef), routing_replay=c.routing_replay,
                             freeze_vision=c.freeze_vision)
        self.workers, self.cluster = RLWorkers.start(
            self.placement, self.cluster, model_path=self.model_path, layout=self.layout,
            worker_kwargs=worker_kwargs, seed=c.seed, timeout_s=c.timeout_s, owner=self,
            interactive=inputs.interactive(), held=self._held)

    @property
    def passes(self):
        """What a step scores between ``generate`` and ``update`` (``rlkit.algos.Needs.passes``), from the config
        as it is now (a notebook may change ``trainer.config.epochs`` between steps)."""
        return self.config.passes(self.algo.needs)

    @property
    def group(self):
        """The actor's worker group (``call`` / ``call_dp`` / ``apply`` for dataflows of your own)."""
        return None if self.workers is None else self.workers.group

    @property
    def rollout_group(self):
        """The rollout workers' group in split placement (None when colocated)."""
        return None if self.workers is None else self.workers.rollout_group

    # ---- the loop --------------------------------------------------------------------------------
    def fit(self, steps: int, *, view: str = "auto"):
        """Run ``steps`` RL steps (continuing from ``self.step``); returns ``metrics``.

        Ctrl-C (Jupyter's "interrupt kernel") stops at the end of the phase or step it lands in: a step
        whose update has not begun is given up, one that has is finished and logged. The trainer keeps its
        weights, and ``fit`` continues from the step it reached. A second Ctrl-C aborts at once and tears
        the workers down (the trainer must then be made again, or loaded from a checkpoint).

        With ``checkpoint_every=N`` the run's checkpoint (``run_dir/checkpoint``) is written every N steps, and
        with ``max_restarts=R`` a worker process that dies (killed, out of memory, its node gone) does not end
        the run: the groups are torn down and started again on what the cluster has (waiting up to
        ``restart_timeout_s``), the checkpoint is loaded, and the steps after it run again, their first rows
        replaced (``trainer.restarts`` lists each restart). The R+1-th loss stops the run with the error."""
        from rlkit.errors import WorkerError
        from rlkit.widgets.live import LiveView

        self._live_workers()
        self.runs.write_config(self._state_config())
        self._open_trackers()
        live = LiveView(steps, mode=view, title=f"{self.algorithm} on {self.plan.describe()}",
                        workers=self.workers_table if self.cluster is not None else None,
                        samples=lambda: self.samples(last=1))
        stop = StopOnInterrupt()
        target = self.step + steps
        try:
            with stop:
                self._stop = stop
                while self.step < target:
                    try:
                        row = self.train_step()
                        if row is not None and self.config.checkpoint_every \
                                and self.step % self.config.checkpoint_every == 0:
                            self.save(self.checkpoint_path)
                    except WorkerError as e:
                        restart(self, e)  # raises when it may not
                        continue
                    if row is None:  # stopped before this step's update
                        break
                    live.update(row)
                    for cb in self.callbacks:
                        cb(self, row)
                    if stop.requested:
                        break
        except KeyboardInterrupt:
            self.close()
            raise KeyboardInterrupt(f"rlkit: fit aborted by a second Ctrl-C in step {self.step + 1}; the workers "
                                    f"were torn down. Make a new Trainer, or Trainer.load a checkpoint "
                                    f"(the {self.step} completed steps are in {self.run_dir})") from None
        finally:
            self._stop = None
            live.close()
            self.runs.save_plots(self.history.rows)
        if stop.requested:
            print(f"rlkit: stopped after step {self.step} (Ctrl-C); the trainer keeps its weights: trainer.fit(...) "
                  f"continues from there", file=sys.stderr, flush=True)
        return self.metrics

    def workers_table(self):
        """This trainer's ranks on the cluster (``Cluster.table()``'s rows: node and its labels, pid, memory, the
        call each is in, last heartbeat), what the live view's worker panel shows. Empty without Ray."""
        import pandas as pd

        if self.cluster is None:
            return pd.DataFrame()
        table = self.cluster.table()
        return table[table["owner"] == self._holder_label].reset_index(drop=True)

    @property
    def checkpoint_path(self) -> Path:
        """Where ``checkpoint_every`` writes the run's checkpoint, and a restart loads it from."""
        return self.run_dir / "checkpoint"

    def train_step(self) -> dict[str, float] | None:
        """One step of the dataflow, ``update(estimate(generate()))``; returns its metrics row (None when a
        Ctrl-C during ``fit`` gave the step up before its update began)."""
        batch = self.generate()
        if self._stop is not None and self._stop.requested:  # a safe point: nothing trained yet
            if self.config.off_policy_steps or self._stream is not None:  # async: the batch is trained next
                self._put_back(batch)
            return None
        return self.update(self.estimate(batch))

    def _put_back(self, batch: StepBatch) -> None:
        """An untrained batch first in line again: one-step-off's queue, or streaming's buffer (its groups)."""
        if self._stream is not None:
            self._stream.buffer[:0], self._stream.taken = self._stream.taken, []
        else:
            self._ahead.put_back(batch.step, batch.samples.generated(), batch.prompts, batch.sync)

    # ---- one step, in three calls (a notebook can run each in its own cell) ------------------------
    def generate(self, prompts: Sequence[dict[str, Any]] | None = None) -> StepBatch:
        """The rollout half of a step: the actor's weights into the engines, ``Rollout.n`` samples of each
        prompt (default: the dataset's next ``prompts_per_step`` rows), their rewards. Returns a
        ``StepBatch`` to look at (``batch.table()``), change (``drop``, ``set_rewards``) and train on.
        With ``dynamic_sampling`` (on the dataset's prompts) the groups whose rewards are all equal are
        filtered out and more rounds generated until the batch is full (``rlkit.dynamic_sampling``)."""
        if self.config.off_policy_steps and prompts is None:
            return self._generate_ahead()
        if self.config.streaming and prompts is None:
            return self._generate_stream()
        c, t, w = self.config, {}, self._live_workers()
        t_step = time.perf_counter()
        if prompts is not None:
            rows = [dict(p, _row=p.get("_row", i)) for i, p in enumerate(prompts)]
            if self.agent is not None:  # rows of your own: chats (or environment rows) rendered
                rows = [r if isinstance(r["prompt"], str) and (self.agent.environment is None or "_env_row" in r)
                        else dict(self._render([r])[0], _row=r["_row"]) for r in rows]
            else:  # chats rendered by the template, rows with pictures encoded (text and encoded rows kept)
                rows = self._render(rows)
        with _timer(t, "sync"):
            sync = w.sync_weights()
        # the dataset's rounds this step takes count once it trains (update); rows of your own take none
        backfill, rnd = (self._backfill(), self.rounds) if prompts is None else (None, None)
        while True:
            if prompts is None:
                rows, seed, rnd = self._prompts_of(rnd), self._round_seed(rnd), rnd + 1
            else:
                seed = c.seed * 100_003 + self.step
            with _timer(t, "generate"):
                samples = w.generate(rows, seed=seed, policy_version=self.step)
            with _timer(t, "reward"):
                given = self._score(samples)  # NaN: no reward
            full = (rows, samples, given) if backfill is None else backfill.offer(rows, samples, given, self.step)
            if full is not None:
                rows, samples, given = full
                break
        return StepBatch(step=self.step, prompts=rows, samples=samples, rewards=given, timings=t, sync=sync,
                         started=t_step, sampling=backfill.metrics() if backfill else {}, next_round=rnd)

    def _generate_ahead(self) -> StepBatch:
        """Asynchronous RL (``off_policy_steps = k > 0``, split placement): this step's batch, sampled while
        earlier steps trained, and one more generation launched before it returns: the round trained
        ``k`` steps from now, sampled with the weights of now (before step ``s``'s update) while the actor
        trains. So a batch is at most ``k`` policy versions old (its samples carry the version that
        generated them). Nothing is in flight at the first step (or after ``load``): its batch is
        generated on-policy. With ``dynamic_sampling`` a short batch takes the next rounds in flight
        (launching more), so those are fresher, never staler."""
        w, c = self._live_workers(), self.config
        t, t_step = {}, time.perf_counter()
        backfill = self._backfill()
        sync = None
        while True:
            entry = self._ahead.fill(w, self.step, c.off_policy_steps + 1, self._new_round)
            sync = sync or entry.sync
            with _timer(t, "wait_generate"):  # what the trainer waited for: the generation it did not hide
                samples = entry.pending.result()
            with _timer(t, "reward"):
                given = self._score(samples)
            t["generate"] = t.get("generate", 0.0) + float(samples.timing or 0.0)  # the engines' own, overlapped
            rows = entry.pending.prompts
            full = (rows, samples, given) if backfill is None else backfill.offer(rows, samples, given, self.step)
            if full is not None:
                rows, samples, given = full
                break
        return StepBatch(step=self.step, prompts=rows, samples=samples, rewards=given, timings=t,
                         sync=sync.result(self.config.timeout_s), started=t_step,
                         sampling=backfill.metrics() if backfill else {})

    def _generate_stream(self) -> StepBatch:
        """Streaming RL (``streaming=True``, split placement; ``rlkit.stream``): chunks of every running sample
        until the buffer holds ``prompts_per_step`` finished groups (scored as they finish; with dynamic
        sampling the ones whose rewards are all equal filtered out), taken oldest first; then the next chunk
        is launched, to run while this batch trains. This step's weights go out first: they land before the
        next chunk (partial rollouts), or once no sample runs (``partial_rollouts=False``)."""
        from rlkit.dynamic_sampling import SamplingError, informative_groups
        from rlkit.stream import group_batch

        w, c, st, t, t_step = self._live_workers(), self.config, self._stream, {}, time.perf_counter()
        P, dropped0 = c.prompts_per_step, st.dropped_stale
        reuse = [0, 0]  # history tokens (each prefix but its last) whose keys the engines kept; all of them
        self._stream_sync(w, t)
        st.drop_stale(self.step, c.max_staleness)  # groups that grew too old waiting in the buffer
        while len(st.buffer) < P:
            if not st.inflight:
                self._stream_launch(w)
                if not st.inflight:  # nothing runs: admission waits for the weights (partial_rollouts=False)
                    self._stream_sync(w, t)
                    continue
            future, live, version, _ = st.inflight.pop(0)
            with _timer(t, "wait_generate"):
                out = future.result(c.timeout_s) if hasattr(future, "result") else future
            done = st.merge(out["tokens"], out["logprobs"], out["reason"], version, live)
            t["generate"] = t.get("generate", 0.0) + sum(out["seconds"])  # the engines' own, overlapped
            reuse[0] += sum(out["reused"])
            reuse[1] += sum(out["history"])
            if done:
                with _timer(t, "reward"):
                    scores = self._score(group_batch(done, self.layout, self._pad_id, self.tokenizer))
                keep = set(informative_groups([i for i, g in enumerate(done) for _ in g.samples], scores)) \
                    if c.dynamic_sampling else set(range(len(done)))
                for i, g in enumerate(done):
                    g.rewards = scores[i * self.rollout.n:(i + 1) * self.rollout.n]
                st.buffer = [g for g in st.buffer if g not in done or done.index(g) in keep]
                st.filtered += len(done) - len(keep)
                if st.filtered >= c.max_sampling_rounds * P:
                    raise SamplingError(f"dynamic sampling, step {self.step + 1}: {st.filtered} finished groups had "
                                        f"all-equal rewards before the step's {P} groups that differ were in; raise "
                                        f"max_sampling_rounds (now {c.max_sampling_rounds}), or set "
                                        f"dynamic_sampling=False")
            st.drop_stale(self.step, c.max_staleness)
            self._stream_sync(w, t)
            if len(st.buffer) < P:
                self._stream_launch(w)  # this lane's next chunk, queued behind the other lane's
        groups = st.taken = st.take(P)
        samples = group_batch(groups, self.layout, self._pad_id, self.tokenizer)
        rewards = torch.cat([g.rewards for g in groups])
        crossed = torch.tensor([len(set(s.versions)) > 1 for g in groups for s in g.samples]).float().mean().item()
        sampling = {"stream/buffer_groups": float(len(st.buffer) + P), "stream/running_groups": float(len(st.running)),
                    "stream/dropped_stale": float(st.dropped_stale - dropped0), "stream/crossed_share": crossed,
                    "stream/kv_reused_share": reuse[0] / max(reuse[1], 1)}
        if c.dynamic_sampling:
            sampling["dynamic/filtered_groups"], st.filtered = float(st.filtered), 0
        self._stream_launch(w)  # the next chunks run while this batch trains
        return StepBatch(step=self.step, prompts=[g.row for g in groups], samples=samples, rewards=rewards, timings=t,
                         sync=self._stream_synced.result(c.timeout_s), started=t_step, sampling=sampling)

    def _new_stream(self):
        from rlkit.stream import Stream

        c, tok = self.config, self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self._pad_id = int(pad or 0)  # the packed batch's padding (masked out everywhere)
        return Stream(self.rollout.n, self.rollout.max_new_tokens, c.stream_chunk_tokens,
                      c.stream_groups or 2 * c.prompts_per_step)

    def _stream_sync(self, w: Any, t: dict[str, float]) -> None:
        """This step's weights to the rollout engines (behind the chunk in flight), unless they hold them, or
        with ``partial_rollouts=False`` while a sample runs."""
        st = self._stream
        if st.engine_version == self.step or (not self.config.partial_rollouts and st.running
                                              and st.engine_version >= 0):
            return
        with _timer(t, "sync"):
            self._stream_synced = w.sync_weights_async()
        st.engine_version = self.step

    def _stream_launch(self, w: Any) -> None:
        """The next chunks in flight: rounds of the dataset's rows admitted while there is room (and the engines
        hold this step's weights, with ``partial_rollouts=False``), then a chunk for each lane with none in
        flight, continuing its running samples."""
        from rlkit.rollout.base import tokenize_prompts

        st, c = self._stream, self.config
        while st.room() >= c.prompts_per_step and (c.partial_rollouts or st.engine_version == self.step):
            rnd = self.rounds
            self.rounds += 1
            rows = self._prompts_of(rnd)
            st.admit(rows, tokenize_prompts([r["prompt"] for r in rows], self.tokenizer), version=st.engine_version)
        for lane in st.idle_lanes():
            request, live = st.request(lane)
            if live:
                st.inflight.append((w.continue_async(request, c.stream_chunk_tokens, c.stream_stale_kv), live,
                                    st.engine_version, lane))

    def _backfill(self):
        """Dynamic sampling's gatherer for this step (None when it is off)."""
        from rlkit.dynamic_sampling import Backfill

        c = self.config
        return Backfill(c.prompts_per_step, c.max_sampling_rounds) if c.dynamic_sampling else None

    def _new_round(self) -> tuple[int, list[dict[str, Any]], int]:
        """Asynchronous RL: the next generation round launched, its index, its rows and its seed."""
        rnd = self.rounds
        self.rounds += 1
        return rnd, self._prompts_of(rnd), self._round_seed(rnd)

    def _round_seed(self, rnd: int) -> int:
        return self.config.seed * 100_003 + rnd

    def estimate(self, batch: StepBatch) -> StepBatch:
        """What the update needs, on the workers and here: the reference's and the old policy's
        log-probs and the critic's values (when the algorithm and config use them), then the advantages.
        In place; returns the batch (a second call does nothing)."""
        if batch.estimated:
            return batch
        t, w, s = batch.timings, self._live_workers(), batch.samples
        sent = s.tensors_only()  # what the workers' passes read (the text stays here)
        valid = torch.isfinite(batch.rewards)
        mask = s.loss_tokens
        mask *= valid[:, None].float()  # samples whose reward is NaN are skipped (counted in the row)
        scores = torch.nan_to_num(batch.rewards, nan=0.0)
        p = self.passes  # decided in one place (rlkit.algos.Needs.passes)
        if p.reference:
            with _timer(t, "ref"):
                s.ref_logprobs = w.ref_logprobs(sent)
        if p.values:
            with _timer(t, "values"):
                s.values = w.values(sent)
        if p.fused_offpolicy:  # the update weighs by pi_old / mu on its own first forward
            s.behaviour_logprobs = s.rollout_logprobs
        if p.old_logprobs:
            with _timer(t, "old_logprobs"):
                s.old_logprobs = w.old_logprobs(sent)
        sampling_logprobs = s.old_logprobs
        if p.kl_old_logprobs:  # the KL penalty in the reward needs pi_old
            with _timer(t, "old_logprobs"):
                sampling_logprobs = w.old_logprobs(sent)
        with _timer(t, "advantage"):
            batch.kl_mean = self._advantages(s, scores, mask, sampling_logprobs)
        if self.config.mask_truncated:  # cut at max_new_tokens: in the group's baseline, out of the loss
            cut = torch.tensor([r == "length" for r in s.finish_reason])
            mask *= (~cut)[:, None].float()
            s.advantages = s.advantages * mask
            batch.sampling["overlong/masked"] = float(cut.sum())
        if sampling_logprobs is not None:  # the engine against the trainer, on the tokens that carry loss
            batch.offpolicy = offpolicy_metrics(s, sampling_logprobs, mask, config=self.config)
        batch.estimated = True
        return batch

    def update(self, batch: StepBatch) -> dict[str, float]:
        """The learning half of a step: the critic's and the actor's updates on ``batch`` (estimated first
        if it was not), then the step's metrics row, logged (``metrics``, metrics.jsonl, the live view's
        and the trackers' rows). Returns the row."""
        if batch.step != self.step:
            raise TrainerError(f"this batch was generated at step {batch.step + 1} and the trainer is at step "
                               f"{self.step + 1} (a batch trains once, on the policy that sampled it); make a new "
                               f"one with trainer.generate()")
        self.estimate(batch)
        t, w = batch.timings, self._live_workers()
        settings = self.update_settings()
        critic = {}
        if self.passes.values:
            with _timer(t, "update_critic"):
                critic = w.update_critic(batch.samples.tensors_only(), settings)
        started = time.time()
        with _timer(t, "update"):
            actor = w.update_actor(batch.samples.tensors_only(), settings)
        self.history.add_phases(batch.step + 1, batch.samples.gen_window, started, time.time())
        for key in [k for k in actor if k.startswith("actor/offpolicy/")]:  # the correction taken in the update
            batch.offpolicy[key.removeprefix("actor/")] = actor.pop(key)
        self.step += 1
        if batch.next_round is not None:  # the dataset's rounds this step took (synchronous; async counts launches)
            self.rounds = batch.next_round
        row = batch.metrics_row(self.step, settings, actor, critic)
        if batch.next_round is not None or self.config.off_policy_steps or self._stream is not None:
            self.sampler.observe(batch.samples.row, batch.rewards.tolist())  # the dataset's rows (not your own)
            row.update(self.sampler.metrics())
            self._chosen = {r: rows for r, rows in self._chosen.items() if r >= self.rounds - 1}
        row.update(self.rewards.take_metrics())  # async rewards' timeouts, a judge's failures
        if self.config.eval_every and self.step % self.config.eval_every == 0:
            t0 = time.perf_counter()
            row.update(self._evaluate_in_fit())
            row["timing/eval"] = time.perf_counter() - t0
        self._log(row, batch.prompts, batch.samples, batch.rewards)
        return row

    def _live_workers(self):
        if self.workers is None:
            raise TrainerError("this Trainer was closed (trainer.close(), an aborted fit, or a newer Trainer in "
                               "this notebook took its workers); make a new Trainer, or Trainer.load a checkpoint")
        return self.workers

    # ---- the dataflow's pieces -------------------------------------------------------------------
    def _render(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Prompt rows as the engines take them: chats rendered by the chat template, with the tools (or the
        environment's opening messages) for multi-turn episodes."""
        if self.agent is not None:
            return inputs.render_episodes(rows, self.tokenizer, self.model_path, self.agent)
        return inputs.render_chats(inputs.render_images(rows, self.model_path), self.tokenizer, self.model_path)

    def _score(self, samples: Batch) -> torch.Tensor:
        """Each sample's reward: the reward functions' weighted sum (a multi-turn completion is its
        conversation, TRL's conversational format), plus what an environment returned over the episode."""
        scores = self.rewards.score(samples.columns, samples.completion)  # no functions (an environment's): zeros
        if samples.episode is not None:
            scores = scores + torch.tensor([e.get("env_reward") or 0.0 for e in samples.episode], dtype=scores.dtype)
        c = self.config
        if c.overlong_buffer:  # DAPO's soft overlong penalty on the response's length (rlkit.dynamic_sampling)
            from rlkit.dynamic_sampling import overlong_penalty

            scores = scores + overlong_penalty(samples.response_mask.sum(1), max_tokens=self.rollout.max_new_tokens,
                                               buffer=c.overlong_buffer, factor=c.overlong_penalty)
        return scores

    def _next_prompts(self) -> list[dict[str, Any]]:
        """The next round's ``prompts_per_step`` rows (not taken: ``_new_round`` takes them)."""
        return self._prompts_of(self.rounds)

    def _prompts_of(self, rnd: int) -> list[dict[str, Any]]:
        """Generation round ``rnd``'s ``prompts_per_step`` rows (0-based), as the sampler chose them (by default
        epoch by epoch in a seeded order); asked once per round, then the same rows whoever asks again."""
        if rnd not in self._chosen:
            self._chosen[rnd] = inputs.sampled_rows(self.sampler, rnd, self.config.prompts_per_step, len(self.rows),
                                                    self.config.seed)
        return [dict(self.rows[i], _row=i) for i in self._chosen[rnd]]

    def _advantages(self, samples: Batch, scores: torch.Tensor, mask: torch.Tensor,
                    sampling_logprobs: torch.Tensor | None) -> float | None:
        """``samples.advantages`` / ``.returns`` by the algorithm's estimator (``rlkit.estimate``); the mean KL."""
        return step_advantages(samples, scores, mask, config=self.config, estimator=self.algo.advantage,
                               kl_ctl=self.kl_ctl, sampling_logprobs=sampling_logprobs)

    def update_settings(self):
        """The ``UpdateSettings`` the next update takes (learning rate of this step, PPO settings, loss)."""
        return self.config.update_settings(self.step, self.policy_loss)

    # ---- results ---------------------------------------------------------------------------------
    def _log(self, row: dict[str, Any], prompts: list[dict[str, Any]], samples: Batch,
             scores: torch.Tensor) -> None:
        self.history.add_step(row, prompts, samples, scores, step=self.step, prompt_len=self.layout.prompt_len,
                              keep=self.config.keep_samples)
        # metrics.jsonl is always this trainer's history (== self.metrics), rewritten atomically: a crash
        # never leaves half a line, and a resumed run never repeats step numbers (see load)
        self.runs.write_metrics(self.history.rows)
        trackers = self._open_trackers()  # report_to: the row, and this step's samples as a table
        if trackers:
            trackers.log_metrics(row)
            shown = self.samples(last=1)  # trackers get the images' sizes as text, not thumbnails
            trackers.log_samples(shown.assign(image=shown["image"].map(str)) if "image" in shown else shown, self.step)

    def _open_trackers(self):
        """The ``report_to`` trackers, opened once per Trainer (by ``fit`` or a first ``update``), their
        config logged once."""
        if getattr(self, "_trackers", None) is None:
            from rlkit.trackers import Trackers

            self._trackers = Trackers.of(self.config.report_to, self.run_dir, step=self.step)
            self._trackers.log_config(self._state_config())
        return self._trackers

    @property
    def timeline(self):
        """When each step's generation ran on the rollout workers (the earliest start and the latest end over
        its samples, as the workers recorded them) and when its actor update ran (the driver's call): a
        DataFrame of ``step, phase, start, end`` in seconds since the epoch, for this trainer's steps.
        With ``off_policy_steps=1`` the generation of step k + 1 starts before the update of step k ends.
        """
        return self.history.timeline()

    @property
    def metrics(self):
        """One row per step (a DataFrame)."""
        return self.history.metrics()

    def samples(self, last: int | None = None, ids: bool = False):
        """Prompts, completions and rewards of recent steps (a DataFrame); with ``ids`` also each completion's
        token ids (``rlkit.widgets.live.readable_samples`` shows them where the text is not printable). Samples of
        prompts with images show them as thumbnails in Jupyter (an ``image`` column)."""
        from rlkit.widgets.samples import trainer_samples

        return trainer_samples(self.history.samples(self.step, last, ids), self.rows)

    def evaluate(self, dataset: Any = None, n: int = 64, greedy: bool | None = None, k: int = 1) -> dict[str, float]:
        """The current policy on ``n`` held-out prompts (the task's test split, the "test" / "validation" split of
        a DatasetDict, else the training rows), each sampled ``k`` times: the mean reward, the exact-match rate
        (reward == 1), and avg@k, pass@j (j = 1, 2, 4, ... k) and maj@k (``rlkit.evaluation``). ``greedy``
        (default: when ``k == 1``) decodes at temperature 0; else at the rollout's temperature. The samples are
        kept in ``trainer.eval_samples`` (a DataFrame)."""
        import pandas as pd

        from rlkit import evaluation
        from rlkit.checks import integer
        from rlkit.tasks.base import completion_text

        integer("k", k, hint="samples per held-out prompt, e.g. k=8 for pass@8", error=TrainerError)
        greedy = k == 1 if greedy is None else greedy
        if greedy and k > 1:
            raise TrainerError(f"evaluate(k={k}, greedy=True) would sample {k} identical completions per prompt: pass "
                               f"greedy=False (the rollout's temperature, {self.rollout.temperature}) or k=1")
        rows = inputs.heldout_rows(dataset, self.task, self._heldout, self.rows, n, self.config.seed + 1,
                                   self.config.prompt_column)
        held_out = rows is not self.rows
        rows = self._render(rows) if held_out else rows  # the training rows are rendered already
        rows = [dict(r, _row=i) for i, r in enumerate(rows[:n])]
        rows = rows[:len(rows) - len(rows) % self.plan.dp] or rows
        overrides = {"n": k, **({"temperature": 0.0} if greedy else {})}
        if held_out:  # its prompts may be longer than every training one: a wider layout for this call
            overrides["prompt_len"] = inputs.longest_prompt(rows, self.tokenizer, self.model_path,
                                                            self.layout.response_len)
        self.workers.sync_weights()
        if self._stream is not None:  # the chunks launched from here sample with these weights (their version)
            self._stream.engine_version = self.step
        samples = self.workers.generate(rows, seed=10**6 + self.step, policy_version=self.step, **overrides)
        scores = self._score(samples)
        ok = torch.isfinite(scores)
        out = {"reward": scores[ok].mean().item(), "exact": (scores[ok] == 1).float().mean().item(), "n": int(ok.sum())}
        # maj@k votes on answers: the task's reading of one, else a reward's (MathAnswer's), else the text
        answer_of = next((f for f in [getattr(self.task, "answer_of", None)]
                          + [getattr(fn, "answer_of", None) for fn, _ in self.rewards.fns] if f is not None),
                         lambda c: completion_text(c).strip())
        answers = [answer_of(c) for c in samples.completion]
        groups: dict[int, list[tuple[float, str]]] = {}
        for row, score, answer in zip(samples.row, scores.tolist(), answers):
            groups.setdefault(row, []).append((score if math.isfinite(score) else 0.0, answer))
        out.update(evaluation.scores(list(groups.values())))
        self.eval_samples = pd.DataFrame({"step": self.step, "row": list(samples.row),
                                          "completion": samples.completion, "answer": answers,
                                          "reward": scores.tolist()})
        if samples.episode is not None:  # multi-turn: the same episodes as training, and their tool use
            from rlkit.agent.episodes import episode_metrics

            out.update(episode_metrics(samples.episode))
        return out

    def _evaluate_in_fit(self) -> dict[str, float]:
        """``eval_every``'s scores on the held-out split, as the step's ``eval/*`` metrics."""
        c = self.config
        scores = self.evaluate(n=c.eval_prompts, k=c.eval_k)
        return {f"eval/{key}": v for key, v in scores.items() if key != "n"}

    def close(self) -> None:
        """Stop the worker groups and give their CPUs/GPUs back (the cluster stays up). Idempotent."""
        from rlkit.workers.rl_workers import shutdown_groups

        trackers, self._trackers = getattr(self, "_trackers", None), None
        if trackers is not None:
            trackers.close()  # flushed and closed; never raises
        workers, self.workers = self.workers, None
        if workers is not None:
            workers.close()
        held = getattr(self, "_held", None)
        if held is not None:
            shutdown_groups(held)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---- helpers ---------------------------------------------------------------------------------------
@contextmanager
def _timer(t: dict[str, float], name: str):
    t0 = time.perf_counter()
    yield
    t[name] = t.get(name, 0.0) + time.perf_counter() - t0


__all__ = ["RewardError", "Trainer", "TrainerConfig", "TrainerError"]
