#!/usr/bin/env python3
"""rl_calc_report.py — the numbers of tools/bench_rl_calc.sh: held-out accuracy
and tool-call success before and after RL (the evaluation's episodes at the
start and the end), the training curves, and where a step's time goes.

    python3 tools/rl_calc_report.py WORK_DIR [--plot docs/images/rl-calc.png]

Reads WORK_DIR/rl/{rollouts,metrics,eval}.jsonl.
"""

import argparse
import os

from run_metrics import jsonl_rows


def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("work")
    p.add_argument("--plot", default="")
    a = p.parse_args()
    d = os.path.join(a.work, "rl")
    ro, ev = jsonl_rows(os.path.join(d, "rollouts.jsonl")), jsonl_rows(os.path.join(d, "eval.jsonl"))
    tm = [r for r in jsonl_rows(os.path.join(d, "metrics.jsonl")) if "step_time_s" in r]
    if not ro or not ev:
        raise SystemExit(f"rl_calc_report.py: no rollouts.jsonl or eval.jsonl rows in {d}")
    first, last = ev[0], ev[-1]
    print(f"held-out problems ({int(first['eval_prompts'])}, greedy episodes): accuracy {first['eval_accuracy']:.3f} "
          f"-> {last['eval_accuracy']:.3f} (policy steps {int(first['eval_policy_step'])} -> "
          f"{int(last['eval_policy_step'])}); tool-call success {first.get('eval_env_tool_success', 0):.3f} -> "
          f"{last.get('eval_env_tool_success', 0):.3f}; tool errors a episode "
          f"{first.get('eval_env_tool_errors', 0):.3f} -> {last.get('eval_env_tool_errors', 0):.3f}; turns "
          f"{first['eval_turns_mean']:.2f} -> {last['eval_turns_mean']:.2f}")
    print("eval curve (policy step: accuracy / tool success): " + ", ".join(
        f"{int(e['eval_policy_step'])}: {e['eval_accuracy']:.3f} / {e.get('eval_env_tool_success', 0):.3f}" for e in ev))
    n = min(5, len(ro))
    print(f"training (temperature 1): reward first {n} steps {mean([r['reward_mean'] for r in ro[:n]]):.3f}, last {n} "
          f"{mean([r['reward_mean'] for r in ro[-n:]]):.3f}; tool success {mean([r.get('env_tool_success', 0) for r in ro[:n]]):.3f} "
          f"-> {mean([r.get('env_tool_success', 0) for r in ro[-n:]]):.3f}; episodes ended by the environment "
          f"{mean([r.get('episode_end_env', 0) for r in ro]):.3f}, at max_turns {mean([r.get('episode_end_max_turns', 0) for r in ro]):.3f}, "
          f"out of tokens {mean([r.get('episode_end_length', 0) for r in ro]):.3f}")
    episodes = sum(r["samples"] for r in ro)
    sampling = sum(r.get("sampling_s", 0) for r in ro)
    env_s = sum(r.get("env_s", 0) for r in ro)
    tokens = sum(r.get("generated_tokens", 0) for r in ro)
    print(f"time: {episodes} episodes over {len(ro)} steps; sampling {sampling:.1f} s ({1000 * sampling / max(episodes, 1):.1f} "
          f"ms an episode, {tokens / max(sampling, 1e-9):.0f} tokens/s), of it in the environment {env_s:.1f} s "
          f"({100 * env_s / max(sampling, 1e-9):.1f}%); waiting for weights "
          f"{sum(r.get('weights_wait_s', 0) for r in ro):.1f} s; evaluations {sum(e.get('eval_seconds', 0) for e in ev):.1f} s")
    if tm:
        print(f"trainer: {len(tm)} steps, {mean([r['step_time_s'] for r in tm]):.2f} s a step, idle waiting for rollouts "
              f"{100 * mean([r.get('rollout_wait_fraction', 0) for r in tm]):.1f}%")
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        steps = [r["step"] for r in ro]
        left.plot(steps, [r["reward_mean"] for r in ro], label="reward (temperature 1)")
        left.plot(steps, [r.get("env_tool_success", 0) for r in ro], label="tool-call success")
        left.set(xlabel="RL step", ylim=(0, 1.05), title="training episodes")
        es = [e["eval_policy_step"] for e in ev]
        right.plot(es, [e["eval_accuracy"] for e in ev], marker="o", label="accuracy (greedy)")
        right.plot(es, [e.get("eval_env_tool_success", 0) for e in ev], marker="s", label="tool-call success")
        right.set(xlabel="policy step", ylim=(0, 1.05), title="held-out episodes")
        for ax in (left, right):
            ax.legend(fontsize=8)
        fig.suptitle("calculator tool, Qwen3 template and tool calls, 97 M Qwen3-shaped model, one GPU")
        fig.tight_layout()
        fig.savefig(a.plot, dpi=100)
        print(f"plot: {a.plot}")


if __name__ == "__main__":
    main()
