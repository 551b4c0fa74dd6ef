"""The mutation run (`make mutation`): break the objectives on purpose, one break at a time, and check a test notices.

A test is worth what it can catch. Each mutant below is one deliberate mistake of the kind a fork or a refactor
makes (a sign, a detach removed, a clip bound swapped, a mean for a sum, a mask dropped, a paper's default lost) in
ppo_ray.py's policy loss, rollout correction and advantages, common/ppo_tricks.py's estimators and the losses of
dpo.py, kto.py and rm.py. The script writes the mistake into the source, runs the fast tests of that file, puts the
source back, and reports each mutant killed (a test failed) or survived. It exits 1 if any survived that is not listed
in EQUIVALENT with the reason no test can tell it from the original.

    python tests/mutation.py                 # every mutant
    python tests/mutation.py --only gspo     # the mutants whose name holds "gspo"
    python tests/mutation.py --leave_out tests/test_paper_objectives.py   # the kill rate without a test file
"""

import argparse
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PPO_TESTS = ["tests/test_paper_objectives.py", "tests/test_ppo_tricks.py"]
PREFERENCE_TESTS = ["tests/test_paper_objectives.py", "tests/test_preference.py"]
TESTS = {"ppo_ray.py": PPO_TESTS, "common/ppo_tricks.py": PPO_TESTS, "dpo.py": PREFERENCE_TESTS,
         "kto.py": PREFERENCE_TESTS, "rm.py": PREFERENCE_TESTS}

# (name, file, the original text, what replaces it): the original must occur exactly once in the file.
MUTANTS = [
    ("ppo: max for min", "ppo_ray.py",
     "        else:\n            surrogate = torch.min(ratio * advantages,",
     "        else:\n            surrogate = torch.max(ratio * advantages,"),
    ("ppo: clip bounds swapped", "ppo_ray.py",
     "        else:\n            surrogate = torch.min(ratio * advantages, ratio.clamp(1 - clip_low, 1 + clip_high)",
     "        else:\n            surrogate = torch.min(ratio * advantages, ratio.clamp(1 - clip_high, 1 + clip_low)"),
    ("ppo: dual clip min for max", "ppo_ray.py",
     "torch.max(surrogate, dual_clip * advantages)", "torch.min(surrogate, dual_clip * advantages)"),
    ("ppo: dual clip on positive advantages", "ppo_ray.py",
     "torch.where(advantages < 0, torch.max(surrogate", "torch.where(advantages > 0, torch.max(surrogate"),
    ("all losses: log-ratio sign", "ppo_ray.py",
     "log_ratio = torch.where(valid, logprobs - old_logprobs, 0.0)",
     "log_ratio = torch.where(valid, old_logprobs - logprobs, 0.0)"),
    ("all losses: log-ratio clamp dropped", "ppo_ray.py",
     "log_ratio = torch.where(valid, logprobs - old_logprobs, 0.0).clamp(-tricks.MAX_LOG_RATIO, tricks.MAX_LOG_RATIO)",
     "log_ratio = torch.where(valid, logprobs - old_logprobs, 0.0)"),
    ("all losses: padding mask dropped", "ppo_ray.py",
     "log_ratio = torch.where(valid, logprobs - old_logprobs, 0.0)", "log_ratio = (logprobs - old_logprobs)"),
    ("all losses: sign of the loss", "ppo_ray.py",
     "return (-tricks.aggregate(surrogate,", "return (tricks.aggregate(surrogate,"),
    ("all losses: weights ignored", "ppo_ray.py",
     "surrogate = surrogate * weights", "surrogate = surrogate"),
    ("gspo: sequence ratio's detach removed", "ppo_ray.py",
     "+ seq_log_ratio.detach()", "+ seq_log_ratio"),
    ("gspo: no gradient through the tokens", "ppo_ray.py",
     "torch.where(valid, logprobs - logprobs.detach(), 0.0)", "torch.where(valid, logprobs.detach() * 0, 0.0)"),
    ("gspo: a sum for the mean log-ratio", "ppo_ray.py",
     "seq_log_ratio = tricks.masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1)",
     "seq_log_ratio = log_ratio.sum(-1, keepdim=True)"),
    ("gspo: the sequence form's mean advantage", "ppo_ray.py",
     '    if kind == "gmpo":  # one advantage per response', '    if kind in ("gmpo", "gspo"):  # one advantage'),
    ("gmpo: max for min", "ppo_ray.py",
     "bounded = sign * torch.min(sign * log_ratio", "bounded = sign * torch.max(sign * log_ratio"),
    ("gmpo: arithmetic for geometric mean", "ppo_ray.py",
     "surrogate = advantages * tricks.masked_mean(bounded, mask, dim=-1).unsqueeze(-1).exp()",
     "surrogate = advantages * tricks.masked_mean(bounded.exp(), mask, dim=-1).unsqueeze(-1)"),
    ("gmpo: clip bounds swapped", "ppo_ray.py",
     "log_ratio.clamp(-clip_low, clip_high))", "log_ratio.clamp(-clip_high, clip_low))"),
    ("cispo: detach of the weight removed", "ppo_ray.py",
     "ratio.clamp(max=1 + clip_high).detach() * advantages", "ratio.clamp(max=1 + clip_high) * advantages"),
    ("cispo: the lower clip for the upper", "ppo_ray.py",
     "ratio.clamp(max=1 + clip_high).detach()", "ratio.clamp(max=1 + clip_low).detach()"),
    ("sapo: temperatures swapped", "ppo_ray.py",
     "torch.where(advantages > 0, sapo_tau[0], sapo_tau[1])", "torch.where(advantages > 0, sapo_tau[1], sapo_tau[0])"),
    ("sapo: 2 / tau for 4 / tau", "ppo_ray.py",
     "surrogate = 4 / tau * torch.sigmoid", "surrogate = 2 / tau * torch.sigmoid"),
    ("default: gspo by tokens", "common/ppo_tricks.py",
     '"gspo": {"eps_clip_low": 3e-4, "eps_clip_high": 4e-4, "loss_agg": "seq-mean-token-mean"}',
     '"gspo": {"eps_clip_low": 3e-4, "eps_clip_high": 4e-4}'),
    ("default: gspo's clip range lost", "common/ppo_tricks.py",
     '"gspo": {"eps_clip_low": 3e-4, "eps_clip_high": 4e-4, ', '"gspo": {'),
    ("default: gmpo by tokens", "common/ppo_tricks.py",
     '"eps_clip_high": 0.4, "loss_agg": "seq-mean-token-mean"}', '"eps_clip_high": 0.4}'),
    ("default: sapo by tokens", "common/ppo_tricks.py",
     '"sapo": {"loss_agg": "seq-mean-token-mean"}', '"sapo": {}'),
    ("default: cispo's cap lost", "common/ppo_tricks.py",
     '"cispo": {"eps_clip_high": 4.0}', '"cispo": {}'),
    ("default: icepop's cap 2", "common/ppo_tricks.py",
     '"icepop": 5.0', '"icepop": 2.0'),
    ("icepop: a 0/1 weight for the ratio", "ppo_ray.py",
     "return torch.where(keep, ratio, 0.0), tricks.masked_mean((~keep).float(), mask)",
     "return keep.float(), tricks.masked_mean((~keep).float(), mask)"),
    ("icepop: the cap dropped", "ppo_ray.py",
     "keep = (ratio >= low) & (ratio <= high) & valid", "keep = (ratio >= low) & valid"),
    ("tis: the cap dropped", "ppo_ray.py",
     "weights = torch.where(valid, ratio.clamp(max=high), 0.0)", "weights = torch.where(valid, ratio, 0.0)"),
    ("seq-mask-tis: the token band for the sequence band", "ppo_ray.py",
     "(seq_ratio >= seq_band[0]) & (seq_ratio <= seq_band[1])", "(seq_ratio >= low) & (seq_ratio <= high)"),
    ("seq-mask-tis: a product for the geometric mean", "ppo_ray.py",
     "seq_ratio = tricks.masked_mean(log_ratio, mask, dim=-1).exp()", "seq_ratio = log_ratio.sum(-1).exp()"),
    ("aggregate: a sum for each response's mean", "common/ppo_tricks.py",
     "total = torch.where(mask.any(-1), masked_mean(loss, mask, dim=-1), 0.0).sum()",
     "total = torch.where(mask, loss, 0.0).sum()"),
    ("aggregate: token-mean by responses", "common/ppo_tricks.py",
     'return mask.sum() if mode == "token-mean" else mask.any(-1).sum()', "return mask.any(-1).sum()"),
    ("gae: lambda dropped", "common/ppo_tricks.py",
     "advantage = delta + gamma * lam * next_advantage", "advantage = delta + gamma * next_advantage"),
    ("gae: the value's sign", "common/ppo_tricks.py",
     "delta = rewards[:, t] + gamma * next_value - values[:, t]",
     "delta = rewards[:, t] + gamma * next_value + values[:, t]"),
    ("grpo: the variance for the std", "common/ppo_tricks.py",
     "advantages = advantages / (variance.sqrt() + eps)", "advantages = advantages / (variance + eps)"),
    ("rloo: the whole group's mean for the others'", "common/ppo_tricks.py",
     "advantages = groups - (total - groups) / (count - 1).clamp(min=1)", "advantages = groups - mean"),
    ("whiten: no std", "common/ppo_tricks.py",
     "* torch.rsqrt(masked_var(values, mask) + WHITEN_EPS)", "* 1.0"),
    ("kl penalty: its sign in the reward", "common/ppo_tricks.py",
     "return -kl_coef * torch.where(mask, kl, 0.0)", "return kl_coef * torch.where(mask, kl, 0.0)"),
    ("k3: the log-ratio's sign", "common/ppo_tricks.py",
     "k3 = torch.exp(-log_ratio) - 1 + log_ratio", "k3 = torch.exp(log_ratio) - 1 - log_ratio"),
    ("k3-unbiased: the ratio detached", "common/ppo_tricks.py",
     ".clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp() * k3", ".clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp().detach() * k3"),
    ("off-policy mask: positive advantages masked too", "common/ppo_tricks.py",
     "keep = ~((advantages < 0) & (drift > delta))", "keep = ~(drift > delta)"),
    ("advantages: reinforce++ not whitened", "ppo_ray.py",
     "    return tricks.masked_whiten(advantages, mask), returns", "    return advantages, returns"),
    ("advantages: dr_grpo divided by the std", "ppo_ray.py",
     'tricks.group_advantages(scores, n, "grpo" if estimator == "grpo" else "mean", keep=keep)',
     'tricks.group_advantages(scores, n, "grpo", keep=keep)'),
    ("dpo: cDPO's smoothing sign", "dpo.py",
     "losses = -(1 - eps) * F.logsigmoid(beta * margins) - eps * F.logsigmoid(-beta * margins)",
     "losses = -(1 - eps) * F.logsigmoid(beta * margins) + eps * F.logsigmoid(-beta * margins)"),
    ("dpo: ipo's target 1 / beta", "dpo.py", "(margins - 1 / (2 * beta)) ** 2", "(margins - 1 / beta) ** 2"),
    ("dpo: hinge without beta", "dpo.py", "torch.relu(1 - beta * margins)", "torch.relu(1 - margins)"),
    ("dpo: robust unnormalised", "dpo.py", "eps * F.logsigmoid(-beta * margins)) / (1 - 2 * eps)",
     "eps * F.logsigmoid(-beta * margins))"),
    ("dpo: rewards without beta", "dpo.py", "return losses, beta * chosen_logratios.detach()",
     "return losses, chosen_logratios.detach()"),
    ("simpo: the margin's sign", "dpo.py", "margins = chosen_rewards - rejected_rewards - gamma",
     "margins = chosen_rewards - rejected_rewards + gamma"),
    ("orpo: log-probs for log-odds", "dpo.py",
     "log_odds = (chosen - rejected) - (torch.log(-torch.expm1(chosen)) - torch.log(-torch.expm1(rejected)))",
     "log_odds = chosen - rejected"),
    ("orpo: its NLL term dropped", "dpo.py",
     'coef = 1.0 if args.loss_type == "orpo" else args.nll_loss_coef', "coef = args.nll_loss_coef"),
    ("kto: the undesirable's reference point sign", "kto.py",
     "torch.sigmoid(beta * (kl - logratios))", "torch.sigmoid(beta * (logratios - kl))"),
    ("kto: weights swapped", "kto.py",
     "return torch.where(labels, desirable_losses, undesirable_losses)",
     "return torch.where(labels, undesirable_losses, desirable_losses)"),
    ("rm: the margin's sign", "rm.py",
     "diff = chosen_rewards - rejected_rewards - (0.0 if margin is None else margin)",
     "diff = chosen_rewards - rejected_rewards + (0.0 if margin is None else margin)"),
]

# Mutants no test can kill because they do not change what the code computes, and why.
EQUIVALENT: dict[str, str] = {}


def preload() -> None:
    """Import the heavy libraries the tests use once, here: each mutant's tests run in a fork of this process, which
    imports only the project's own modules anew, from the mutated source (about 40 s saved a mutant on a busy
    machine). Nothing of the project may be imported here."""
    import deepspeed  # noqa: F401
    import pytest  # noqa: F401
    import ray  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401


def run_tests(files: list[str], timeout: int) -> tuple[bool, float]:
    """Whether the fast tests in `files` all pass, in a fork of this process, and how long they took."""
    start = time.time()
    pid = os.fork()
    if pid == 0:  # the child: pytest, quiet, its exit status for the parent
        import pytest
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.chdir(ROOT)
        os._exit(int(pytest.main(["-q", "-x", "-p", "no:cacheprovider", "-m", "not slow and not real and not extended",
                                  *files])))
    while time.time() - start < timeout:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0, time.time() - start
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)  # a mutant that hangs the tests is caught by them
    os.waitpid(pid, 0)
    return False, time.time() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run only the mutants whose name holds this text")
    parser.add_argument("--leave_out", nargs="*", default=[], help="test files not to run (to compare kill rates)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds a mutant's tests may take")
    args = parser.parse_args()
    mutants = [m for m in MUTANTS if args.only in m[0]]
    for name, path, original, _ in mutants:  # every break must apply before any is made
        count = open(os.path.join(ROOT, path)).read().count(original)
        if count != 1:
            sys.exit(f"mutant {name!r}: its original text occurs {count} times in {path}; fix the list.")
    preload()
    survivors, killed = [], 0
    for name, path, original, mutated in mutants:
        full = os.path.join(ROOT, path)
        source = open(full).read()
        files = [f for f in TESTS[path] if f not in args.leave_out]
        try:
            with open(full, "w") as f:
                f.write(source.replace(original, mutated))
            passed, seconds = run_tests(files, args.timeout)
        finally:
            with open(full, "w") as f:
                f.write(source)
        killed += not passed
        if passed:
            survivors.append(name)
        print(f"{'SURVIVED' if passed else 'killed  '} {seconds:5.1f} s  {name}", flush=True)
    print(f"\n{killed} of {len(mutants)} mutants killed ({100 * killed / max(len(mutants), 1):.0f}%)")
    unexplained = [name for name in survivors if name not in EQUIVALENT]
    for name in survivors:
        print(f"survived: {name}: {EQUIVALENT.get(name, 'no test catches it')}")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
