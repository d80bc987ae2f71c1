"""Multi-turn rollout against single-turn rollout of the same total length, on one engine.

    python bench/bench_agentic_rollout.py                       # HF engine, the tiny tool-calling model
    .venv-vllm/bin/python bench/bench_agentic_rollout.py --engine vllm

The workload: ``--prompts`` calculator questions x ``--n`` episodes on ``rlkit.tasks.calc.tiny_tool_model()``
(it calls the tool, reads the result, answers: 2 turns an episode). Multi-turn: ``run_episodes``, one batched
engine call per turn. Single-turn: the same prompts, one ``generate`` call that samples, per episode, as many
tokens as the episode's whole response (``ignore_eos``, ``max_new_tokens`` = the longest episode). Both are
timed in interleaved rounds; the table gives the median tokens per second of the tokens each produced (the
multi-turn's sampled tokens, and with the tool and template tokens) and the seconds per rollout.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import pandas as pd

    from rlkit.agent import Agent, MultiTurn, run_episodes
    from rlkit.rollout import Rollout, make_engine
    from rlkit.tasks.calc import TINY_TOOL_PROMPT, Calculator, calculator, tiny_tool_model

    path = tiny_tool_model()
    engine = make_engine(Rollout(engine=args.engine, n=args.n, max_new_tokens=96, dtype="float32", kv_cache_gb=1), path)
    agent = Agent.of(tools=[calculator], settings=MultiTurn(max_turns=3, max_tokens=240, tool_prompt=TINY_TOOL_PROMPT),
                     max_new_tokens=96)
    fmt = agent.format(engine.tokenizer)
    prompts = [fmt.render_prompt(r["prompt"]) for r in Calculator(digits=(2, 1)).dataset(n=args.prompts, seed=1)]
    run_episodes(engine, agent, prompts[:2], seed=0)  # warm-up
    rows = []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        multi = run_episodes(engine, agent, prompts, seed=r)
        t_multi = time.perf_counter() - t0
        length = int(multi.response_mask.sum(1).max())
        t0 = time.perf_counter()
        single = engine.generate(prompts, seed=r, max_new_tokens=length, ignore_eos=True)
        t_single = time.perf_counter() - t0
        sampled, total = int(multi.loss_mask.sum()), int(multi.response_mask.sum())
        rows.append({"round": r, "multi_s": t_multi, "multi_sampled_tok_s": sampled / t_multi,
                     "multi_all_tok_s": total / t_multi, "turns": sum(e["turns"] for e in multi.episodes) / len(multi.episodes),
                     "tool_s": multi.timings["tools"], "single_s": t_single,
                     "single_tok_s": int(single.response_mask.sum()) / t_single, "tokens_per_episode": length})
    df = pd.DataFrame(rows)
    print(df.round(3).to_string(index=False))
    med = df.median(numeric_only=True)
    print(f"\n{args.engine}: {args.prompts} prompts x n={args.n}, {med['turns']:.2f} turns an episode; medians of "
          f"{args.rounds} interleaved rounds:")
    print(pd.DataFrame({"rollout": ["single-turn, same length", "multi-turn (sampled tokens)", "multi-turn (all tokens)"],
                        "tokens/s": [med["single_tok_s"], med["multi_sampled_tok_s"], med["multi_all_tok_s"]],
                        "seconds": [med["single_s"], med["multi_s"], med["multi_s"]]}).round(2).to_string(index=False))
    print(f"multi-turn / single-turn tokens/s (all tokens): {med['multi_all_tok_s'] / med['single_tok_s']:.2f}; "
          f"tool time per rollout {med['tool_s'] * 1e3:.1f} ms")
    engine.close()


if __name__ == "__main__":
    main()
