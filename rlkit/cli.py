"""The `rlkit` command: `rlkit doctor | plan | demo` (and `python -m rlkit ...`)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="rlkit", description="RL post-training of LLMs, DP/TP/PP on Ray.")
    sub = parser.add_subparsers(dest="command", metavar="{doctor,plan,demo}")
    sub.add_parser("doctor", help="check the install: versions, devices, backends")
    sub.add_parser("plan", help="print a ParallelPlan's groups, layout and costs (rlkit plan --help)",
                   add_help=False)
    demo = sub.add_parser("demo", help="the README's main job on the embedded default")
    demo.add_argument("--quick", action="store_true", help="a shorter run (for tests)")
    if argv and argv[0] == "plan":  # its own parser owns its flags
        from rlkit.plan.cli import main as plan_main

        return plan_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from rlkit.doctor import main as doctor_main

        return doctor_main()
    if args.command == "demo":
        from rlkit.demo import main as demo_main

        return demo_main(quick=args.quick)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
