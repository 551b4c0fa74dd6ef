"""ppo_ray.py's flag and model checks, run before Ray starts: each mistake a user can make is one sentence."""

from common import prompt_sharing, rewards, routing_replay
from common.args import (UserError, check_causal_lm, check_decoder_only, check_lengths, check_model_path,
                         check_output_dir, check_packing)
from common.checkpoint import check_keep_last
from common.deepspeed_utils import load_tokenizer
from common.placement import critic_path
from common.ppo_tricks import GROUPED, KL_IN_LOSS, clip_range, uses_reference, vllm_is_band
from common.vlm import check_ppo_args, is_vision_language

# Options --async_rollouts cannot overlap generation with training under, and why.
ASYNC_CLASHES = {
    "colocate_all": "the engines sleep while the models train on the same GPUs, so nothing could generate meanwhile",
    "dynamic_sampling": "its later rounds need the first round's rewards before the step can train",
    "env_fn": "its episodes alternate with the environment a turn at a time, on the driver",
    "agent_fn": "its agents run on the driver, each request waiting for the engines' answer",
}


def check_args(args) -> None:
    """Catch flag mistakes before any worker starts."""
    check_keep_last(args.keep_last_checkpoints)
    if args.max_steps < 1:
        raise UserError(f"--max_steps {args.max_steps} runs no PPO step; give 1 or more.")
    if args.env_fn and args.agent_fn:
        raise UserError("--env_fn and --agent_fn each run the episodes; give one of them.")
    if args.env_fn or args.agent_fn:
        flag = "--env_fn" if args.env_fn else "--agent_fn"
        others = [source for source in ("reward_pretrain", "reward_fn", "remote_rm_url", "reward_weights")
                  if getattr(args, source)]
        if others:
            raise UserError(f"{flag}'s rewards score the episodes; leave out --{others[0]}, or {flag}.")
        if args.agent_fn and not args.apply_chat_template:
            raise UserError("--agent_fn's agents send chat messages, which the policy's chat template renders; add "
                            "--apply_chat_template.")
        if args.agent_fn and args.agent_timeout <= 0:
            raise UserError(f"--agent_timeout {args.agent_timeout} gives an agent no time; give the seconds an "
                            f"episode may take, e.g. 600.")
        if args.env_fn and args.max_turns < 1:
            raise UserError(f"--max_turns {args.max_turns} gives the policy no turn; give 1 or more.")
    elif args.reward_pretrain or args.reward_fn or args.remote_rm_url or not args.teacher_pretrain:
        rewards.reward_weights(args.reward_weights, args.reward_pretrain, args.reward_fn, args.remote_rm_url)
    if args.teacher_pretrain and args.teacher_coef <= 0:
        raise UserError(f"--teacher_coef {args.teacher_coef} must be above 0: it weighs the teacher's per-token "
                        f"reward (1.0 when the teacher is the only reward).")
    if args.reward_clip <= 0:
        raise UserError(f"--reward_clip {args.reward_clip} must be above 0: rewards are clipped to [-clip, clip] "
                        f"(10 is the default; a large bound such as 1e9 clips nothing).")
    if args.temperature <= 0 or not 0 < args.top_p <= 1:
        raise UserError(f"--temperature {args.temperature} --top_p {args.top_p}: the trainer's log-probs divide "
                        f"by the temperature and the policy must keep some tokens; give a temperature above 0 "
                        f"(1.0 samples the policy as it is) and a top_p in (0, 1] (evaluation is greedy anyway).")
    if args.keep_sampling_mask and args.top_p >= 1:
        raise UserError(f"--keep_sampling_mask scores tokens over the top-p support vLLM sampled from, and --top_p "
                        f"{args.top_p} samples from the whole vocabulary; give --top_p below 1 (e.g. 0.9), or leave "
                        f"the flag out.")
    if args.kl_target is not None and not (args.kl_target > 0 and args.init_kl_coef > 0):
        raise UserError(f"--kl_target {args.kl_target} with --init_kl_coef {args.init_kl_coef}: the adaptive "
                        f"controller scales the coefficient up and down from --init_kl_coef, so both must be above "
                        f"0 (e.g. --init_kl_coef 0.01 --kl_target 0.05).")
    if args.advantage_estimator in GROUPED and args.n_samples_per_prompt < 2:
        raise UserError(f"--advantage_estimator {args.advantage_estimator} compares samples of the same prompt; "
                        f"set --n_samples_per_prompt to 2 or more.")
    low, high = clip_range(args)
    if not (0 < low < 1 and high > 0):
        raise UserError(f"the policy ratio's clip range [1 - {low}, 1 + {high}] is empty or unbounded; give "
                        f"--eps_clip (or --eps_clip_low and --eps_clip_high) between 0 and 1, e.g. 0.2.")
    token_level = per_token_advantages(args)
    if args.policy_loss == "gmpo" and token_level:  # GMPO has no token-level form; GSPO has (GSPO-token)
        raise UserError(f"--policy_loss gmpo takes one advantage per response and {token_level}; use "
                        f"--advantage_estimator grpo or dr_grpo (or --init_kl_coef 0) without --teacher_pretrain, or "
                        f"--policy_loss gspo, whose GSPO-token form takes an advantage per token.")
    if args.kl_estimator == "k3-unbiased" and args.advantage_estimator not in KL_IN_LOSS:
        raise UserError(f"--kl_estimator k3-unbiased weighs k3 by pi / pi_old inside the loss, and "
                        f"--advantage_estimator {args.advantage_estimator} puts the KL into the reward, where pi is "
                        f"pi_old; use it with --advantage_estimator grpo or dr_grpo, or use --kl_estimator k3.")
    if args.off_policy_seq_mask is not None and args.off_policy_seq_mask < 0:
        raise UserError(f"--off_policy_seq_mask {args.off_policy_seq_mask} would mask responses the sampler agrees "
                        f"with; give a threshold of 0 or more nats per token (or leave it out).")
    if args.dual_clip is not None and args.policy_loss != "ppo":
        raise UserError(f"--dual_clip bounds PPO's clipped objective; leave it out with --policy_loss "
                        f"{args.policy_loss}.")
    if min(args.sapo_tau_pos, args.sapo_tau_neg) <= 0:
        raise UserError(f"SAPO's gate temperatures --sapo_tau_pos {args.sapo_tau_pos} and --sapo_tau_neg "
                        f"{args.sapo_tau_neg} must be above 0 (1.0 and 1.05 in its paper).")
    if not 0 < args.vllm_is_floor < 1:
        raise UserError(f"--vllm_is_floor {args.vllm_is_floor} must be in (0, 1): tokens whose pi_trainer / pi_vllm "
                        f"falls below it are dropped (0.5 is IcePop's).")
    if args.dual_clip is not None and args.dual_clip <= 1:
        raise UserError(f"--dual_clip {args.dual_clip} must be above 1 (3 is usual): it bounds the loss of a "
                        f"negative-advantage token at dual_clip x its advantage.")
    if not 0 <= args.overlong_buffer_len < args.generate_max_len:
        raise UserError(f"--overlong_buffer_len {args.overlong_buffer_len} must be below --generate_max_len "
                        f"{args.generate_max_len} (a quarter of it is usual).")
    if args.dynamic_sampling and args.advantage_estimator not in GROUPED:
        raise UserError(f"--dynamic_sampling drops prompts whose responses all got the same reward, which teach "
                        f"nothing only under a group baseline; use it with --advantage_estimator "
                        f"{', '.join(GROUPED)}, not {args.advantage_estimator}.")
    if args.dynamic_sampling_max_rounds < 1:
        raise UserError(f"--dynamic_sampling_max_rounds {args.dynamic_sampling_max_rounds} leaves nothing to train "
                        f"on; give 1 or more (3 is usual).")
    for flag, why in ASYNC_CLASHES.items():
        if args.async_rollouts and getattr(args, flag):
            raise UserError(f"--async_rollouts cannot be used with --{flag}: {why}; leave out one of the two.")
    check_partial_rollouts(args)
    floor, cap, (seq_low, seq_high) = vllm_is_band(args)
    if cap < 1:
        raise UserError(f"--vllm_is_cap {cap} would down-weight tokens both policies agree on; give a "
                        f"cap of 1 or more (2 is usual).")
    if not 0 < seq_low <= 1 <= seq_high:
        raise UserError(f"seq-mask-tis's band [--vllm_rs_threshold_lower {seq_low}, --vllm_rs_threshold {seq_high}] "
                        f"must hold 1, where the sampler and the trainer agree (verl's is [0.999, 1.001]).")
    rollout = args.rollout_batch_size * args.n_samples_per_prompt
    if rollout % args.train_batch_size:
        raise UserError(f"--rollout_batch_size x --n_samples_per_prompt = {rollout} responses must be a multiple "
                        f"of --train_batch_size {args.train_batch_size}.")
    for role in ("actor", "critic"):
        workers = getattr(args, f"{role}_num_workers")
        if rollout % (workers * args.micro_train_batch_size):
            raise UserError(f"{rollout} responses per step do not split into {workers} {role} worker(s) x "
                            f"--micro_train_batch_size {args.micro_train_batch_size}; change one of them.")
    check_model_path(args.pretrain)
    if not check_ppo_args(args):  # a vision-language policy is checked for what its images allow
        check_causal_lm(args.pretrain)
    routing_replay.check_flags(args)
    if args.share_prompts and args.routing_replay:
        raise UserError("--share_prompts packs each prompt once for its samples, and --routing_replay replays vLLM's "
                        "experts row by row; leave out one of the two.")
    if args.share_prompts:  # a packed row's samples must not read each other (common/prompt_sharing.py)
        check_packing(args.pretrain, "--pretrain", cuda=False, option="--share_prompts")
        prompt_sharing.check_window(args)
    if args.packing_samples:  # the reward models score padded rows
        check_packing(args.pretrain)
        if args.advantage_estimator == "gae" and critic_path(args) != args.pretrain:  # the critic trains packed
            check_packing(critic_path(args), "--critic_pretrain" if args.critic_pretrain else
                          "--reward_pretrain (where the critic starts)")
    check_output_dir(args.output_dir)
    sequence = ("--prompt_max_len + --generate_max_len", args.prompt_max_len + args.generate_max_len,
                "--prompt_max_len or --generate_max_len")
    check_lengths(args.pretrain, *sequence)
    for flag, path in [("--reward_pretrain", p) for p in args.reward_pretrain or []] + [
            ("--critic_pretrain", args.critic_pretrain)]:
        if path:
            check_model_path(path, flag)
            if not is_vision_language(path):  # a vision-language one's scalar head is common/vlm.py's
                check_decoder_only(path, flag)
            check_lengths(path, *sequence, flag)
    if args.teacher_pretrain:
        check_model_path(args.teacher_pretrain, "--teacher_pretrain")
        if not is_vision_language(args.teacher_pretrain):  # check_ppo_args took a vision-language one
            check_causal_lm(args.teacher_pretrain, "--teacher_pretrain")
        check_lengths(args.teacher_pretrain, *sequence, "--teacher_pretrain")


def check_partial_rollouts(args) -> None:
    """--partial_rollouts and its knobs (common/partial_rollouts.py)."""
    knobs = [f"--{name}" for name in ("max_staleness", "partial_chunk_tokens") if getattr(args, name) is not None]
    if knobs and not args.partial_rollouts:
        raise UserError(f"{knobs[0]} sets up --partial_rollouts; add --partial_rollouts, or leave out {knobs[0]}.")
    if not args.partial_rollouts:
        return
    if not args.async_rollouts:
        raise UserError("--partial_rollouts cuts the generation --async_rollouts runs during the update; add "
                        "--async_rollouts.")
    if args.max_staleness is not None and args.max_staleness < 0:
        raise UserError(f"--max_staleness {args.max_staleness} leaves no policy to sample from; give 0 (only tokens "
                        f"of the policy each step trains) or more (1 is the default).")
    if args.partial_chunk_tokens is not None and args.partial_chunk_tokens < 1:
        raise UserError(f"--partial_chunk_tokens {args.partial_chunk_tokens} generates nothing; give the new tokens "
                        f"per engine call, 1 or more (default: a quarter of --generate_max_len).")
    if args.routing_replay:
        raise UserError("--routing_replay replays the experts vLLM routed a response to in one call, and "
                        "--partial_rollouts samples a response over several; leave out one of the two.")


def per_token_advantages(args) -> str | None:
    """Why this run's advantages can differ from token to token within a response, or None where each response has
    one advantage on all its tokens (a sequence-level loss such as GMPO needs that)."""
    if args.advantage_estimator == "gae":
        return "gae's advantages differ token by token"
    if args.teacher_pretrain:
        return "--teacher_pretrain adds a distillation reward of its own to each token"
    if uses_reference(args) and args.advantage_estimator not in KL_IN_LOSS:
        return (f"--advantage_estimator {args.advantage_estimator} puts the KL penalty (--init_kl_coef "
                f"{args.init_kl_coef}) into each token's reward")
    if args.gamma != 1:
        return f"--gamma {args.gamma} discounts the reward differently for each token"
    return None


def check_tokenizers(args, tokenizer) -> None:
    """Every model reads the actor's vocabulary, so every tokenizer must be the actor's; a reward model, which reads
    pairs rendered with its own chat template, needs one with --apply_chat_template."""
    for flag, path in [("--reward_pretrain", p) for p in args.reward_pretrain or []] + [
            ("--critic_pretrain", args.critic_pretrain)]:
        if path:
            rewards.check_same_tokenizer(tokenizer, load_tokenizer(path, flag), f"--pretrain {args.pretrain}",
                                         f"{flag} {path}", args.apply_chat_template and flag == "--reward_pretrain")
    if args.teacher_pretrain and (load_tokenizer(args.teacher_pretrain, "--teacher_pretrain").get_vocab()
                                  != tokenizer.get_vocab()):
        raise UserError(f"--teacher_pretrain {args.teacher_pretrain} has a different tokenizer from the policy "
                        f"--pretrain {args.pretrain}; the teacher scores the policy's own tokens, so it must share "
                        f"their vocabulary (a larger model of the same family).")
