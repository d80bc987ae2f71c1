"""The `rlkit` command: `rlkit doctor | plan | train | demo` (and `python -m rlkit ...`)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="rlkit", description="RL post-training of LLMs, DP/TP/PP on Ray.")
    sub = parser.add_subparsers(dest="command", metavar="{doctor,plan,train,demo}")
    sub.add_parser("doctor", help="check the install: versions, devices, backends")
    sub.add_parser("plan", help="print a ParallelPlan's groups, layout and costs (rlkit plan --help)",
                   add_help=False)
    train = sub.add_parser("train", help="an RL run from a JSON config file and/or flags")
    _train_args(train)
    demo = sub.add_parser("demo", help="the README's main job on the embedded default")
    demo.add_argument("--quick", action="store_true", help="a shorter run (for tests)")
    demo.add_argument("--model", default=None,
                      help="a real pretrained model (see rlkit.models.available(), e.g. smollm2-135m-instruct): "
                           "GRPO on chat arithmetic, scored on held-out questions before and after")
    demo.add_argument("--steps", type=int, default=None, help="RL steps (default: 100 tiny, 30 real model)")
    if argv and argv[0] == "plan":  # its own parser owns its flags
        from rlkit.plan.cli import main as plan_main

        return plan_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from rlkit.doctor import main as doctor_main

        return doctor_main()
    if args.command == "train":
        return _train(args)
    if args.command == "demo":
        from rlkit.demo import main as demo_main
        from rlkit.demo import real_model_main

        if args.steps is not None and args.steps < 1:
            parser.error(f"--steps={args.steps} must be a positive integer")
        if args.model is not None:
            from rlkit.errors import RlkitError

            try:
                return real_model_main(args.model, steps=args.steps, quick=args.quick)
            except RlkitError as e:  # an unknown model name, a missing package: the message names the fix
                print(f"rlkit demo: error: {e}", file=sys.stderr)
                return 2
        return demo_main(quick=args.quick, steps=args.steps)
    parser.print_help()
    return 0


# flag -> (config key, type); a JSON config file may hold the same keys, flags win
TRAIN_KEYS = {"model": str, "task": str, "algorithm": str, "dp": int, "tp": int, "pp": int,
              "micro_batches": int, "steps": int, "n": int, "max_new_tokens": int, "temperature": float,
              "engine": str, "lr": float, "prompts_per_step": int, "kl_coef": float, "epochs": int,
              "minibatches": int, "seed": int, "run_dir": str, "address": str, "sft_steps": int,
              "lora": int, "backend": str, "dp_shard": str, "ep": int}


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="JSON file with any of the keys below (flags override it)")
    for key, typ in TRAIN_KEYS.items():
        p.add_argument("--" + key.replace("_", "-"), dest=key, type=typ, default=None)


def _train(args: argparse.Namespace) -> int:
    import json

    cfg = {"model": "tiny-qwen2", "task": "repeat", "algorithm": "grpo", "dp": 1, "tp": 1, "pp": 1,
           "steps": 20, "n": 8, "max_new_tokens": 16, "engine": "hf", "lr": 2e-3, "prompts_per_step": 8}
    if args.config:
        try:
            loaded = json.loads(open(args.config).read())
        except (OSError, ValueError) as e:
            print(f"rlkit train: error: cannot read --config {args.config}: {e}", file=sys.stderr)
            return 2
        if not isinstance(loaded, dict):
            print(f"rlkit train: error: --config {args.config} holds a JSON {type(loaded).__name__}; it must be "
                  f'an object like {{"steps": 20, "dp": 2}}', file=sys.stderr)
            return 2
        unknown = sorted(set(loaded) - set(TRAIN_KEYS))
        if unknown:
            print(f"rlkit train: error: unknown config keys {unknown}; known: {sorted(TRAIN_KEYS)}", file=sys.stderr)
            return 2
        wrong = [k for k, v in loaded.items() if v is not None and not isinstance(v, TRAIN_KEYS[k])
                 and not (TRAIN_KEYS[k] is float and isinstance(v, int))]
        if wrong:
            k = wrong[0]
            kind = {str: "string", int: "integer", float: "number"}[TRAIN_KEYS[k]]
            print(f"rlkit train: error: config key {k!r} is {loaded[k]!r}; it must be a JSON {kind}", file=sys.stderr)
            return 2
        cfg.update({k: v for k, v in loaded.items() if v is not None})
    cfg.update({k: v for k, v in vars(args).items() if k in TRAIN_KEYS and v is not None})
    import rlkit
    from rlkit.errors import RlkitError

    try:
        trainer_kw = _checked_train_config(cfg)  # every flag, before any model is built or worker started
        model = trainer_kw.pop("model")
        if model.startswith("tiny-"):
            model = rlkit.models.tiny_lm(model.split("-", 1)[1], size="small")
        if cfg.get("sft_steps"):
            model = rlkit.tasks.sft_warmstart(model, trainer_kw["dataset"], steps=cfg["sft_steps"])
        with rlkit.Trainer(model=model, **trainer_kw) as trainer:
            df = trainer.fit(steps=cfg["steps"])
            cols = [c for c in ("step", "reward/mean", "kl", "entropy", "response_length/mean", "timing/step")
                    if c in df.columns]
            print(df[cols].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
            print(f"run directory: {trainer.run_dir}")
    except (RlkitError, ValueError, OSError) as e:  # OSError: a model path or hub id that cannot be loaded
        print(f"rlkit train: error: {e}", file=sys.stderr)
        return 2
    return 0


def _checked_train_config(cfg: dict) -> dict:
    """The Trainer's arguments from the merged flags, each checked (raises RlkitError naming the flag)."""
    import rlkit
    from rlkit.algos import known_algorithms
    from rlkit.checks import integer
    from rlkit.errors import RlkitError
    from rlkit.hub import resolve_checkpoint
    from rlkit.models.tiny import ARCHS
    from rlkit.trainer import TrainerConfig

    tasks = {"repeat": rlkit.tasks.repeat, "arithmetic": rlkit.tasks.arithmetic,
             "chat-arithmetic": rlkit.tasks.chat_arithmetic}
    if cfg["task"] not in tasks:
        raise RlkitError(f"task={cfg['task']!r}: choose one of {sorted(tasks)}")
    if cfg["algorithm"] not in known_algorithms():
        raise RlkitError(f"algorithm={cfg['algorithm']!r}: choose one of {known_algorithms()}")
    integer("steps", cfg["steps"], hint="RL steps to run, e.g. --steps 20")
    integer("sft_steps", cfg.get("sft_steps") or 0, ge=0, hint="0: no supervised warm start")
    model = cfg["model"]
    if model.startswith("tiny-"):
        if model.split("-", 1)[1] not in ARCHS:
            raise RlkitError(f"model={model!r}: the tiny models are {['tiny-' + a for a in ARCHS]}; or pass a "
                             f"checkpoint folder or hub id")
    elif model in rlkit.models.available():  # a real model by name (converted once, then cached)
        model = rlkit.models.pretrained(model)
    else:
        model = resolve_checkpoint(model)
    plan = rlkit.ParallelPlan(dp=cfg["dp"], tp=cfg["tp"], pp=cfg["pp"], micro_batches=cfg.get("micro_batches"),
                              **({"dp_shard": cfg["dp_shard"]} if cfg.get("dp_shard") else {}),
                              **({"ep": cfg["ep"]} if cfg.get("ep") is not None else {}))
    if not model.startswith("tiny-"):
        plan.validate(model=model)
    rollout = rlkit.Rollout(engine=cfg["engine"], n=cfg["n"], max_new_tokens=cfg["max_new_tokens"],
                            temperature=cfg.get("temperature", 1.0))
    config = TrainerConfig(**{k: cfg[k] for k in ("lr", "prompts_per_step", "kl_coef", "epochs", "minibatches",
                                                  "seed", "run_dir", "lora", "backend") if cfg.get(k) is not None})
    cluster = rlkit.Cluster(cfg["address"]) if cfg.get("address") else None
    return {"model": model, "dataset": tasks[cfg["task"]], "algorithm": cfg["algorithm"], "plan": plan,
            "rollout": rollout, "config": config, "cluster": cluster}


if __name__ == "__main__":
    sys.exit(main())
