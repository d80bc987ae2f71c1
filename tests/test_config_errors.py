"""Every config field, given a bad value, fails on construction with the value and the fix, in the
driver, before any worker starts: TrainerConfig, the Trainer's own arguments, Rollout, RewardModel and
the flags of `rlkit train` and `rlkit plan`.

Each table below must hold every field (walked with dataclasses.fields / inspect.signature / the CLI's
own flag lists), so a field added later without a check fails here until it gets one.
"""

import dataclasses
import inspect
import math
import sys
from pathlib import Path

import pytest

import rlkit
from rlkit.cli import TRAIN_KEYS, main
from rlkit.cluster import Cluster
from rlkit.hub import ModelRefError, resolve_model
from rlkit.models import tiny_lm
from rlkit.plan.cli import build_parser
from rlkit.plan.cli import main as plan_main
from rlkit.rewards import RewardModel, RewardModelError, tiny_reward_model
from rlkit.rollout import Rollout, RolloutError
from rlkit.trainer import Trainer, TrainerConfig, TrainerError

NAN = math.nan
A_FILE = "<a file>"  # replaced by the path of an existing file (a run_dir that cannot be a folder)

# field -> [(bad value, what the message must say)]
TRAINER_CONFIG_BAD = {
    "prompts_per_step": [(0, "prompts_per_step=0 must be a positive integer"), (2.5, "prompts_per_step=2.5")],
    "lr": [(-1, "lr=-1 must be a finite number > 0"), (NAN, "lr=nan must be a finite number"),
           ("1e-3", "lr='1e-3' must be a finite number")],
    "lr_warmup_steps": [(-1, "lr_warmup_steps=-1 must be an integer >= 0")],
    "lr_schedule": [("cosin", "lr_schedule='cosin': choose one of ['constant', 'cosine'] (did you mean 'cosine'?)"),
                    ("cosine", "lr_schedule='cosine' decays the learning rate over the run: set total_steps=")],
    "total_steps": [(0, "total_steps=0 must be a positive integer or None"), (2.5, "total_steps=2.5")],
    "epochs": [(0, "epochs=0 must be a positive integer")],
    "minibatches": [(True, "minibatches=True must be a positive integer")],
    "clip_low": [(1.0, "clip_low=1.0 must be a finite number >= 0 and < 1"), (-0.1, "clip_low=-0.1")],
    "clip_high": [(0.1, "clip_high=0.1 < clip_low=0.2"), (NAN, "clip_high=nan")],
    "dual_clip": [(1.0, "dual_clip=1.0 must be a finite number > 1 or None")],
    "loss_agg": [("token_mean", "loss_agg='token_mean': choose one of ['token-mean', "),
                 ("token_mean", "did you mean 'token-mean'?")],
    "loss_options": [([("tau", 1.0)], "loss_options=[('tau', 1.0)] must be a dict of the policy loss's keyword")],
    "kl_coef": [(-0.1, "kl_coef=-0.1 must be a finite number >= 0"), (math.inf, "kl_coef=inf")],
    "router_aux_coef": [(-0.01, "router_aux_coef=-0.01 must be a finite number >= 0"), (NAN, "router_aux_coef=nan")],
    "router_z_coef": [(-1, "router_z_coef=-1 must be a finite number >= 0"), ("big", "router_z_coef='big'")],
    "routing_replay": [(1, "routing_replay=1 must be True or False")],
    "freeze_vision": [("yes", "freeze_vision='yes' must be True or False")],
    "teacher": [("", "teacher='' must be a checkpoint"), (3, "teacher=3 must be a checkpoint")],
    "kl_kind": [("k7", "kl_kind='k7': choose one of ['k1', 'kl', 'abs', 'k2', 'mse', 'k3', 'low_var_kl']")],
    "kl_in_reward": [("yes", "kl_in_reward='yes' must be True or False")],
    "kl_target": [(0.1, "kl_target=0.1 adapts the KL penalty in the reward, so it needs kl_in_reward=True and "
                        "kl_coef > 0"), (-1.0, "kl_target=-1.0 must be a finite number > 0")],
    "entropy_coef": [(-1e-3, "entropy_coef=-0.001 must be a finite number >= 0")],
    "max_grad_norm": [(0, "max_grad_norm=0 must be a finite number > 0 or None")],
    "precision": [("bf16", "precision='bf16': choose one of ['fp32', 'bf16-mixed']")],
    "padding_free": [("yes", "padding_free='yes' must be True or False")],
    "micro_batch_tokens": [(0, "micro_batch_tokens=0 must be a positive integer or None"),
                           ("4k", "micro_batch_tokens='4k' must be a positive integer or None; tokens per micro-batch")],
    "lora": [(0, "LoRA r=0 must be a positive int"), ("big", "lora='big' must be a peft LoraConfig"),
             (True, "lora=True must be a peft LoraConfig")],
    "backend": [("tensorflow", "backend='tensorflow' is not a training backend; choose one of ('torch', 'megatron', "
                 "'deepspeed')"), (3, "backend=3 must be 'torch', 'megatron', 'deepspeed' or an rlkit.Backend"),
                ({"name": "deepspeed", "zero_stage": 4}, "zero_stage=4 must be one of 0, 1, 2, 3")],
    "off_policy_steps": [(-1, "off_policy_steps=-1 must be an integer >= 0"), (1.5, "off_policy_steps=1.5")],
    "offpolicy_correction": [("tsi", "offpolicy_correction='tsi': choose one of ['tis', 'mis'] (did you mean 'tis'?)")],
    "offpolicy_cap": [(0.0, "offpolicy_cap=0.0 must be a finite number > 0"), (-1, "offpolicy_cap=-1")],
    "offpolicy_level": [("seq", "offpolicy_level='seq': choose one of ['token', 'sequence']")],
    "streaming": [("on", "streaming='on' must be True or False")],
    "max_staleness": [(-1, "max_staleness=-1 must be an integer >= 0"), (1.5, "max_staleness=1.5")],
    "partial_rollouts": [(0, "partial_rollouts=0 must be True or False")],
    "stream_chunk_tokens": [(0, "stream_chunk_tokens=0 must be a positive integer")],
    "stream_stale_kv": [("yes", "stream_stale_kv='yes' must be True or False"),
                        (True, "stream_stale_kv=True keeps a running sample's keys and values when new weights land "
                               "mid-sample: it needs streaming=True and partial_rollouts=True")],
    "stream_groups": [(4, "stream_groups=4 < prompts_per_step=8"), (0, "stream_groups=0 must be a positive integer")],
    "dynamic_sampling": [("yes", "dynamic_sampling='yes' must be True or False")],
    "max_sampling_rounds": [(0, "max_sampling_rounds=0 must be a positive integer; the generation rounds")],
    "overlong_buffer": [(-1, "overlong_buffer=-1 must be an integer >= 0"), (2.5, "overlong_buffer=2.5")],
    "overlong_penalty": [(0.0, "overlong_penalty=0.0 must be a finite number > 0"), (NAN, "overlong_penalty=nan")],
    "mask_truncated": [(1, "mask_truncated=1 must be True or False")],
    "gamma": [(1.5, "gamma=1.5 must be a finite number >= 0 and <= 1")],
    "lam": [(-0.1, "lam=-0.1 must be a finite number >= 0 and <= 1")],
    "critic_lr": [(0, "critic_lr=0 must be a finite number > 0")],
    "value_clip": [(0.0, "value_clip=0.0 must be a finite number > 0 or None")],
    "train_size": [(0, "train_size=0 must be a positive integer")],
    "prompt_column": [("", "prompt_column='' must be a column name (a non-empty string)"),
                      (3, "prompt_column=3 must be a column name")],
    "seed": [(-1, "seed=-1 must be an integer >= 0"), (1.5, "seed=1.5")],
    "run_dir": [(A_FILE, "is a file; metrics go in a folder"), (3, "run_dir=3 must be a folder path")],
    "timeout_s": [(0, "timeout_s=0 must be a finite number > 0")],
    "checkpoint_every": [(-1, "checkpoint_every=-1 must be an integer >= 0"), (2.5, "checkpoint_every=2.5")],
    "max_restarts": [(-1, "max_restarts=-1 must be an integer >= 0"),
                     (2, "max_restarts=2: a restart goes on from the run's last checkpoint, and checkpoint_every=0 "
                         "writes none; set checkpoint_every=N")],
    "restart_timeout_s": [(0, "restart_timeout_s=0 must be a finite number > 0")],
    "reward_timeout_s": [(0, "reward_timeout_s=0 must be a finite number > 0")],
    "keep_samples": [(-1, "keep_samples=-1 must be an integer >= 0")],
    "eval_every": [(-1, "eval_every=-1 must be an integer >= 0"), (2.5, "eval_every=2.5")],
    "eval_k": [(0, "eval_k=0 must be a positive integer")],
    "eval_prompts": [(0, "eval_prompts=0 must be a positive integer")],
    "report_to": [("tensorbord", "report_to='tensorbord': choose one of ['tensorboard', 'mlflow', 'wandb', 'trackio', "
                               "'none'] (did you mean 'tensorboard'?)"),
                  (["wandb", "mlfow"], "report_to[1]='mlfow': choose one of"),
                  (["wandb", "mlfow"], "did you mean 'mlflow'?"),
                  (3, "report_to=3 must be a tracker name or a list of them, e.g. report_to=['tensorboard']"),
                  (["none", "wandb"], "'none' turns tracking off, so it cannot be given with trackers")],
}

ROLLOUT_BAD = {
    "engine": [("sglang", "engine='sglang': choose one of ['auto', 'vllm', 'hf']")],
    "n": [(0, "n=0 must be a positive integer")],
    "temperature": [(-1, "temperature=-1 must be a finite number >= 0"), (NAN, "temperature=nan")],
    "top_p": [(0, "top_p=0 must be a finite number > 0 and <= 1")],
    "top_k": [(-2, "top_k=-2 must be an integer >= -1"), (2.0, "top_k=2.0")],
    "max_new_tokens": [(0, "max_new_tokens=0 must be a positive integer")],
    "stop": [([""], "stop=[''] must be non-empty strings")],
    "stop_token_ids": [(["<|im_end|>"], "stop_token_ids=['<|im_end|>'] must be token ids")],
    "ignore_eos": [(1, "ignore_eos=1 must be True or False")],
    "seed": [(-1, "seed=-1 must be an integer >= 0")],
    "tp": [(0, "tp=0 must be a positive integer or None"), (1.5, "tp=1.5")],
    "max_prompt_len": [(0, "max_prompt_len=0 must be a positive integer or None")],
    "on_long_prompt": [("truncate", "on_long_prompt='truncate': choose one of ['error', 'skip']")],
    "dtype": [("fp16", "dtype='fp16': choose one of ['auto', 'float32', 'bfloat16', 'float16']")],
    "hf_batch_size": [(0, "hf_batch_size=0 must be a positive integer or None")],
    "hf_decode": [("lean", "hf_decode='lean': choose one of ['auto', 'generate']")],
    "gpu_memory_utilization": [(1.5, "gpu_memory_utilization=1.5 must be a finite number > 0 and <= 1")],
    "kv_cache_gb": [(0, "kv_cache_gb=0 must be a finite number > 0")],
    "max_model_len": [(-5, "max_model_len=-5 must be a positive integer or None")],
    "enforce_eager": [("no", "enforce_eager='no' must be True or False")],
    "engine_kwargs": [("tensor_parallel_size=2", "engine_kwargs='tensor_parallel_size=2' must be a dict")],
    "script": [("hi", "script='hi' must be a tuple of (pattern, response) rules"),
               ((("(", "x"),), "script rule 0: pattern '(' is not a regular expression")],
    "record_routing": [("yes", "record_routing='yes' must be True or False")],
}

# RewardModel(path_or_model, tokenizer, *, batch_size, max_length, device, template, normalize)
REWARD_MODEL_BAD = {
    "path_or_model": [("/nonexistent/rm", "reward model path '/nonexistent/rm' does not exist"),
                      (42, "RewardModel(int) needs a checkpoint folder")],
    "tokenizer": [("gpt2", "tokenizer='gpt2' is not a tokenizer")],
    "batch_size": [(0, "batch_size=0 must be a positive integer")],
    "max_length": [(-1, "max_length=-1 must be a positive integer")],
    "device": [("gpu0", "device='gpu0' is not a torch device")],
    "template": [("{prompt}", "has no '{completion}' field"), ("{completion}{score}", "cannot be filled")],
    "normalize": [((0.0, 0.0), "normalize=(0.0, 0.0) must be (mean, std), finite, with std > 0"),
                  ((NAN, 1.0), "normalize=(nan, 1.0)")],
}


def _cases(table):
    return [pytest.param(field, value, expect, id=f"{field}={value!r}")
            for field, bad in table.items() for value, expect in bad]


def _value(value, tmp_path):
    if value == A_FILE:
        path = tmp_path / "not-a-folder"
        path.write_text("x")
        return str(path)
    return value


@pytest.fixture
def no_workers_start():
    """Asserts the code under test started no Ray cluster and no worker group."""
    before = Cluster.current()
    groups = len(before._groups) if before is not None else 0
    yield
    after = Cluster.current()
    assert after is before, "a cluster was started for a config that could never run"
    assert (len(after._groups) if after is not None else 0) == groups, "a worker group was started"


@pytest.fixture(scope="module")
def model():
    return tiny_lm("qwen2", size="test")


# ---- every table covers every field ------------------------------------------------------------------
@pytest.mark.parametrize("table, fields", [
    (TRAINER_CONFIG_BAD, [f.name for f in dataclasses.fields(TrainerConfig)]),
    (ROLLOUT_BAD, [f.name for f in dataclasses.fields(Rollout)]),
    (REWARD_MODEL_BAD, [p for p in inspect.signature(RewardModel.__init__).parameters if p != "self"]),
], ids=["TrainerConfig", "Rollout", "RewardModel"])
def test_every_field_has_a_bad_value_checked(table, fields):
    assert sorted(table) == sorted(fields), sorted(set(fields) ^ set(table))


# ---- TrainerConfig -----------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, expect", _cases(TRAINER_CONFIG_BAD))
def test_trainer_config_field(field, value, expect, tmp_path):
    with pytest.raises(TrainerError) as e:
        TrainerConfig(**{field: _value(value, tmp_path)})
    assert expect in str(e.value)


@pytest.mark.parametrize("field, value, expect", _cases(TRAINER_CONFIG_BAD))
def test_trainer_keyword_fails_before_any_worker(field, value, expect, tmp_path, model, no_workers_start):
    with pytest.raises(TrainerError) as e:
        Trainer(model=model, dataset=rlkit.tasks.repeat, **{field: _value(value, tmp_path)})
    assert expect in str(e.value)


def test_good_values_pass():
    TrainerConfig(clip_high=0.28, dual_clip=3.0, loss_agg="seq-mean-token-sum", kl_coef=0.05, kl_kind="k3",
                  kl_in_reward=True, kl_target=0.1, max_grad_norm=None, value_clip=None, lr_warmup_steps=0)


def test_unknown_trainer_keyword_is_named_with_the_near_miss(model, no_workers_start):
    with pytest.raises(TrainerError, match=r"unknown keyword kl_coeff=0.1; did you mean kl_coef\?"):
        Trainer(model=model, dataset=rlkit.tasks.repeat, kl_coeff=0.1)


# ---- the Trainer's own arguments -----------------------------------------------------------------------
def _trainer_arg_cases(tmp_path, model):
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_text("")
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((Path(model) / "config.json").read_text())
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):  # transformers would build an empty tokenizer here
        (no_tokenizer / name).write_bytes((Path(model) / name).read_bytes())
    return {
        "model": [("/nonexistent/model", "model path '/nonexistent/model' does not exist"),
                  (str(no_config), "has no config.json (it holds ['model.safetensors'])"),
                  (str(no_weights), f"model folder {str(no_weights)!r} has no weights"),
                  (str(no_tokenizer), f"model folder {str(no_tokenizer)!r} has no tokenizer"),
                  (None, "model=None is not a model reference")],
        "dataset": [([], "the dataset is empty"),
                    ("/nonexistent/rows.jsonl", "dataset file '/nonexistent/rows.jsonl' does not exist"),
                    (42, "dataset=42 (int) is not a dataset")],
        "reward": [([("not a function", 1.0)], "reward 'not a function' is not callable (a str)"),
                   (3, "reward=3 (an int) is not a reward: give f(prompts, completions, **columns)"),
                   ([3], "reward entry 3 (an int) is neither a function nor an (f, weight) pair")],
        "algorithm": [("dpo", "algorithm='dpo' is not known"), (None, "algorithm=None is not known")],
        "plan": [("dp=2", "plan='dp=2' must be an rlkit.ParallelPlan(...)")],
        "rollout": [({"n": 4}, "rollout={'n': 4} must be an rlkit.Rollout(...)")],
        "cluster": [("localhost:6379", "cluster='localhost:6379' must be an rlkit.Cluster(...)")],
        "config": [({"lr": 1.0}, "config={'lr': 1.0} must be a TrainerConfig(...)")],
        "callbacks": [([print, 42], "callbacks holds 42, which is not callable")],
        "placement": [("remote", "placement='remote': choose 'colocated' (HybridEngine) or 'split'")],
        "rollout_workers": [(0, "rollout_workers=0 must be a positive integer")],
        "tools": [("calculator", "tools='calculator' must be a list of functions"),
                  ([42], "tool 42 is not a function; give plain typed functions with docstrings")],
        "environment": [("env", "environment='env' must be a class or factory")],
        "max_turns": [(0, "max_turns=0 must be")],
        "multi_turn": [({"max_turns": 2}, "multi_turn={'max_turns': 2} must be an rlkit.MultiTurn(")],
        "sampler": [("curriculum", "sampler='curriculum' is not an rlkit.sampler.PromptSampler")],
    }


def test_trainer_arguments_fail_before_any_worker(tmp_path, model, no_workers_start):
    cases = _trainer_arg_cases(tmp_path, model)
    args = [p for p in inspect.signature(Trainer.__init__).parameters if p not in ("self", "overrides")]
    assert sorted(cases) == sorted(args), sorted(set(args) ^ set(cases))
    for field, bad in cases.items():
        for value, expect in bad:
            kw = {"model": model, "dataset": rlkit.tasks.repeat, field: value}
            if field == "dataset":
                kw["reward"] = lambda prompts, completions, **columns: [0.0] * len(prompts)
            with pytest.raises(rlkit.RlkitError) as e:
                Trainer(**kw)
            assert expect in str(e.value), (field, value, str(e.value))


def test_hub_id_offline_fails_at_once_naming_the_fix(monkeypatch, model, no_workers_start):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelRefError, match=r"model='someorg/no-such-model' is not a local folder and not in the "
                                            r"HF cache, and HF_HUB_OFFLINE is set; download it"):
        Trainer(model="someorg/no-such-model", dataset=rlkit.tasks.repeat)
    # a local folder resolves the same online or off
    assert resolve_model(model) == model


def test_recommend_unknown_model_answers_at_once_offline(monkeypatch):
    """No network here: `recommend("gpt-17")` used to spend ~23 s in hub retries. Now the reference is
    resolved first; the error names the bundled models and the local-folder option."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(rlkit.PlanError) as e:
        rlkit.plan.recommend("gpt-17", gpus=8)
    msg = str(e.value)
    assert "model='gpt-17' is not a local folder" in msg and "qwen2.5-7b" in msg and "folder" in msg


# ---- Rollout ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, expect", _cases(ROLLOUT_BAD))
def test_rollout_field(field, value, expect):
    with pytest.raises(RolloutError) as e:
        Rollout(**{field: value})
    assert expect in str(e.value)


# ---- RewardModel -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, expect", _cases(REWARD_MODEL_BAD))
def test_reward_model_field(field, value, expect):
    kw = {"path_or_model": tiny_reward_model(), field: value}
    with pytest.raises((RewardModelError, ModelRefError)) as e:  # a bad path is a model reference error
        RewardModel(**kw)
    assert expect in str(e.value)


# ---- `rlkit train` flags ---------------------------------------------------------------------------------
TRAIN_FLAG_BAD = {
    "model": [("/nonexistent/model", "model path '/nonexistent/model' does not exist"),
              ("tiny-gpt", "the tiny models are ['tiny-llama', 'tiny-qwen2', 'tiny-qwen3_moe', 'tiny-qwen2_5_vl']")],
    "task": [("chess", "task='chess': choose one of ['arithmetic', 'chat-arithmetic', 'repeat']")],
    "algorithm": [("dpo", "algorithm='dpo': choose one of")],
    "dp": [("0", "dp=0 must be a positive integer")],
    "tp": [("0", "tp=0 must be a positive integer")],
    "pp": [("0", "pp=0 must be a positive integer")],
    "micro_batches": [("0", "micro_batches=0 must be a positive integer")],
    "steps": [("0", "steps=0 must be a positive integer")],
    "n": [("0", "n=0 must be a positive integer")],
    "max_new_tokens": [("0", "max_new_tokens=0 must be a positive integer")],
    "temperature": [("-1", "temperature=-1.0 must be a finite number >= 0")],
    "engine": [("sglang", "engine='sglang': choose one of")],
    "lr": [("-1", "lr=-1.0 must be a finite number > 0"), ("nan", "lr=nan")],
    "prompts_per_step": [("0", "prompts_per_step=0 must be a positive integer")],
    "kl_coef": [("-0.1", "kl_coef=-0.1 must be a finite number >= 0")],
    "epochs": [("0", "epochs=0 must be a positive integer")],
    "minibatches": [("0", "minibatches=0 must be a positive integer")],
    "seed": [("-1", "seed=-1 must be an integer >= 0")],
    "run_dir": [(A_FILE, "is a file; metrics go in a folder")],
    "address": [("nonsense", "address='nonsense' is not 'host:port', 'ray://host:port' or 'auto'")],
    "sft_steps": [("-1", "sft_steps=-1 must be an integer >= 0")],
    "lora": [("0", "LoRA r=0 must be a positive int")],
    "backend": [("jax", "backend='jax' is not a training backend; choose one of ('torch', 'megatron', 'deepspeed')")],
    "dp_shard": [("zero9", "dp_shard='zero9' is not a sharding mode")],
    "ep": [("0", "ep=0 must be a positive integer")],
}


def test_train_flags_table_covers_every_flag():
    assert sorted(TRAIN_FLAG_BAD) == sorted(TRAIN_KEYS)


@pytest.mark.parametrize("field, value, expect", _cases(TRAIN_FLAG_BAD))
def test_train_flag(field, value, expect, tmp_path, capsys, no_workers_start):
    assert main(["train", "--" + field.replace("_", "-"), _value(value, tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlkit train: error: ") and "\n" not in err and "Traceback" not in err, err
    assert expect in err


# ---- `rlkit plan` flags ----------------------------------------------------------------------------------
PLAN_FLAG_BAD = {
    "model": [("/nonexistent/model", "model path '/nonexistent/model' does not exist")],
    "dp": [("0", "dp=0 must be a positive integer")],
    "tp": [("3", "tp=3 does not divide num_attention_heads=14")],
    "pp": [("0", "pp=0 must be a positive integer")],
    "vpp": [("0", "vpp=0 must be a positive integer")],
    "micro_batches": [("0", "micro_batches=0 must be a positive integer")],
    "schedule": [("zero-bubble", "argument --schedule: invalid choice: 'zero-bubble'")],
    "order": [("tp-xx-pp", "order='tp-xx-pp' must name each of dp, tp, pp once")],
    "dp_shard": [("zero4", "argument --dp-shard: invalid choice: 'zero4'")],
    "dp_shard_size": [("0", "dp_shard_size=0")],
    "devices_per_node": [("0", "devices_per_node=0 must be a positive integer")],
    "seq_len": [("0", "seq_len=0 must be a positive integer")],
    "micro_batch": [("0", "micro_batch=0 must be a positive integer")],
    "gpu_memory": [("lots", "cannot read a memory size from 'lots'; use bytes or a string like '80GB'")],
    "max_rows": [("0", "max_rows=0 must be a positive integer")],
    "recompute": [("some", "argument --recompute: invalid choice: 'some'")],
    "sequence_parallel": [("yes", "unrecognized arguments: yes")],   # a switch takes no value
    "eager_attention": [("yes", "unrecognized arguments: yes")],
}


def test_plan_flags_table_covers_every_flag():
    flags = [a.dest for a in build_parser()._actions if a.dest != "help"]
    assert sorted(PLAN_FLAG_BAD) == sorted(flags)


@pytest.mark.parametrize("field, value, expect", _cases(PLAN_FLAG_BAD))
def test_plan_flag(field, value, expect, capsys):
    argv = ["--model", "qwen2.5-0.5b", "--" + field.replace("_", "-"), value]
    if field == "dp_shard_size":
        argv += ["--dp", "2", "--dp-shard", "hybrid_shard"]
    try:
        code = plan_main(argv)
    except SystemExit as e:  # argparse's own usage errors (types, choices) exit 2 with the flag named
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and expect in err, err


# ---- LoRA against the model and plan: in the driver, naming the value and the fix ----------------------------
def _lora_cases():
    from peft import LoraConfig

    return [
        (dict(lora=LoraConfig(r=8, target_modules=["qkv_proj"])), "matches no linear layer of this model; its decoder "
         "layers' linear layers are ['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']"),
        (dict(lora=LoraConfig(r=8, target_modules=["q_proj", "lm_head"])), "LoRA on the embedding or lm_head is not "
         "supported"),
        (dict(lora=LoraConfig(r=8, target_modules=["q_proj"], use_dora=True)), "LoraConfig(use_dora=True) is not "
         "supported"),
        (dict(lora=LoraConfig(r=8, target_modules=["q_proj"], lora_dropout=0.1), plan=rlkit.ParallelPlan(tp=2)),
         "lora_dropout=0.1) with tp=2"),
        (dict(lora=LoraConfig(r=-2, target_modules=["q_proj"])), "r=-2 must be a positive int"),
    ]


@pytest.mark.parametrize("case", range(5))
def test_lora_errors_fail_before_any_worker(case, model, no_workers_start):
    kw, expect = _lora_cases()[case]
    with pytest.raises(TrainerError) as e:
        Trainer(model=model, dataset=rlkit.tasks.repeat, **kw)
    assert expect in str(e.value), str(e.value)


def test_lora_from_a_peft_adapter_folder_is_refused(tmp_path, model, no_workers_start):
    import shutil

    folder = tmp_path / "adapter_and_base"
    shutil.copytree(model, folder)
    (folder / "adapter_config.json").write_text("{}")
    with pytest.raises(TrainerError, match="is a peft adapter folder; LoRA training starts from a full model. "
                                           "Merge it first"):
        Trainer(model=str(folder), dataset=rlkit.tasks.repeat, lora=8)


# ---- training backends (rlkit.backends): in the driver, naming the fix -----------------------------------------
def _backend_cases():
    P = rlkit.ParallelPlan
    return [
        (dict(backend="deepspeed", plan=P(tp=2, dp_shard="replicate")), "backend='deepspeed' cannot run tp=2: DeepSpeed "
         "trains an HF model with ZeRO over DP and its PipelineModule over PP, but has no tensor parallelism for it"),
        (dict(backend=rlkit.Backend("deepspeed", zero_stage=3), plan=P(pp=2)), "DeepSpeed's pipeline engine runs ZeRO "
         "stage 0 or 1 only; got zero_stage=3 with pp=2"),
        (dict(backend="megatron", plan=P(dp=2)), "dp_shard='full_shard' cannot run; use ParallelPlan(..., "
         "dp_shard='replicate')"),
        (dict(backend="megatron", lora=8), "LoRA runs on backend='torch' only"),
        (dict(backend="deepspeed", rollout=rlkit.Rollout(tp=1, n=2, max_new_tokens=4)), "Rollout(tp=1) (the "
         "3D-HybridEngine's generation layout) reshards the torch backend's DTensors"),
        (dict(backend="deepspeed", micro_batch_tokens=64), "micro_batch_tokens=64 sizes padding-free micro-batches, "
         "which backend='deepspeed' does not run"),
        (dict(backend="megatron", plan=P(tp=2, order="dp-tp-pp")), "lays ranks out in Megatron's order; use "
         "order='tp-dp-pp'"),
        (dict(backend="megatron", precision="bf16-mixed"), "backend='megatron' trains fp32 here"),
    ]


def _moe_cases():
    P = rlkit.ParallelPlan
    moe = tiny_lm("qwen3_moe", size="test")
    return [
        (dict(plan=P(dp=2, ep=2)), None, "ep=2 needs a mixture-of-experts model, but"),
        (dict(plan=P(dp=6, ep=3), prompts_per_step=6), moe, "ep=3 does not divide num_experts=8; each EP rank holds whole experts: "
         "choose ep in {1, 2}"),
        (dict(plan=P(dp=2, ep=2), backend="deepspeed"), moe, "backend='deepspeed' cannot run ep=2: it has no "
         "expert parallelism"),
        (dict(router_aux_coef=0.01), None, "router_aux_coef=0.01 weighs a mixture-of-experts router's loss, but"),
        (dict(router_z_coef=0.001, backend="deepspeed"), moe, "router_z_coef=0.001 is computed by the torch backend's "
         "MoE layer (rlkit.parallel.moe); backend='deepspeed' trains without the router's losses"),
        (dict(backend="megatron", router_aux_coef=0.001), moe, "backend='megatron' trains without the router's losses"),
        (dict(plan=P(dp=2, ep=2, dp_shard="replicate")), moe, "ep=2 with dp_shard='replicate' is not supported on "
         "the torch backend"),
        (dict(routing_replay=True), moe, "routing_replay=True replays the experts the engine chose, so the engine "
         "must record them: set Rollout(record_routing=True)"),
        (dict(rollout=rlkit.Rollout(engine="vllm", n=2)), moe, "rlkit cannot keep a vLLM engine of one in sync"),
        (dict(rollout=rlkit.Rollout(engine="hf", n=2, record_routing=True)), None, "Rollout(record_routing=True) records "
         "which experts each token went to, but"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_moe_errors_fail_before_any_worker(case, model, no_workers_start):
    """Expert parallelism and the router's losses asked of a model or backend that cannot take them."""
    kw, path, expect = _moe_cases()[case]
    with pytest.raises(rlkit.RlkitError) as e:
        Trainer(model=path or model, dataset=rlkit.tasks.repeat, **kw)
    assert expect in str(e.value), str(e.value)


def test_ep_must_divide_dp():
    with pytest.raises(rlkit.RlkitError, match=r"ep=4 does not divide dp=2: expert parallelism is cut out of the "
                                               r"data-parallel ranks; choose ep in \[1, 2\]"):
        rlkit.ParallelPlan(dp=2, ep=4)


@pytest.mark.parametrize("case", range(8))
def test_backend_errors_fail_before_any_worker(case, model, no_workers_start):
    kw, expect = _backend_cases()[case]
    with pytest.raises(rlkit.RlkitError) as e:
        Trainer(model=model, dataset=rlkit.tasks.repeat, **kw)
    assert expect in str(e.value), str(e.value)


@pytest.mark.parametrize("name, module", [("megatron", "megatron"), ("deepspeed", "deepspeed")])
def test_a_backend_not_installed_names_its_pip_extra(name, module, model, no_workers_start, monkeypatch):
    # None in sys.modules is Python's own "this module cannot be imported": the state of a venv without it (its
    # submodules too: an earlier test may have imported them, and find_spec trusts sys.modules)
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")] + [module]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(rlkit.PlanError, match=rf"backend='{name}' needs .*, which is not installed; install the "
                                              rf"extra: pip install 'rlkit\[{name}\]'"):
        Trainer(model=model, dataset=rlkit.tasks.repeat, backend=name)


def test_megatron_refuses_a_model_family_its_weight_mapping_does_not_cover(tmp_path, model, no_workers_start):
    import shutil

    from transformers import MistralConfig, MistralForCausalLM

    folder = tmp_path / "tiny-mistral"
    MistralForCausalLM(MistralConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).save_pretrained(folder)
    for f in Path(model).glob("tokenizer*"):
        shutil.copy(f, folder)
    with pytest.raises(rlkit.PlanError, match="mistral"):
        Trainer(model=str(folder), dataset=rlkit.tasks.repeat, backend="megatron")


def test_async_rl_needs_split_placement(model, no_workers_start):
    with pytest.raises(TrainerError, match="off_policy_steps=1 generates the next batches while the actor trains, on "
                                           "rollout workers of their own: use placement='split'"):
        Trainer(model=model, dataset=rlkit.tasks.repeat, off_policy_steps=1)
