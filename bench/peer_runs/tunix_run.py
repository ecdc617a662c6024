"""bench/peers.py's Tunix runner: the GRPO workload of workload.py in google-tunix.

Runs in its own virtual environment (bench/peer_runs/tunix_requirements.txt):

  python tunix_run.py --ckpt DIR --mode single|multi --max-new N --iterations K --out result.json

Single-turn: `RLCluster` + `GRPOLearner` with the vanilla rollout (Tunix's own sampler), the HF
checkpoint loaded into Tunix's Qwen2 (float32) on a mesh over this process's devices. Multi-turn:
Tunix's agentic GRPO learner with a `ToolEnvironment` that offers `next_part()`, a `ToolAgent`
with Qwen tool-call parsing and at most `TURNS` generations per trajectory.

Timing, per iteration (the first compiles; it is iteration 0 like the others'):
  update_s   `RLCluster.update_actor` (Tunix's gradient step), until the new weights are ready;
  rollout_s  the rest of the iteration: from the end of the previous update (the start of
             `learner.train` for iteration 0) to the start of this one, which is generation,
             tool steps, rewards, advantages and any log-prob pass Tunix runs before the update.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload as w  # noqa: E402

os.environ.setdefault("TQDM_DISABLE", "1")  # Tunix's trainer draws a progress bar
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # "PyTorch was not found"
warnings.filterwarnings("ignore")


def quiet() -> None:
    """Silences absl (Tunix logs through it) and the libraries' Python loggers."""
    import logging

    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)
    for name in ("absl", "jax", "flax", "orbax", "transformers", "tunix"):
        logging.getLogger(name).setLevel(logging.ERROR)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class Meter:
    """Per-iteration counters, shared by the rollout threads and the training loop."""

    def __init__(self, max_new: int):
        self.max_new = max_new
        self.lock = threading.Lock()
        self.seed = 0
        self.records: list[dict] = []
        self.debug_traj, self.debug_turns = None, 0
        self.turns: dict[int, int] = {}  # multi-turn: trajectories by number of generations
        self.out = sys.stdout  # ours; Tunix's own prints (tool-call parse errors) go to null
        self._reset()

    def _reset(self) -> None:
        self.tokens = self.generations = 0
        self.rewards: list[float] = []

    def next_seed(self) -> int:
        with self.lock:
            self.seed += 1
            return self.seed

    def count(self, tokens) -> None:
        """Tunix's vanilla sampler returns each generation cut before its EOS: a generation
        shorter than the cap ended with EOS, which the model generated too."""
        n = sum(len(t) + (len(t) < self.max_new) for t in tokens)
        with self.lock:
            self.tokens += n
            self.generations += len(tokens)

    def add_rewards(self, rewards) -> None:
        with self.lock:
            self.rewards.extend(float(r) for r in rewards)

    def close(self, rollout_s: float, update_s: float, trajectories: int) -> dict:
        with self.lock:
            rewards = self.rewards
            mean = sum(rewards) / len(rewards) if rewards else float("nan")
            rec = w.iteration_record(
                rollout_s, update_s, self.tokens, trajectories, self.generations, mean
            )
            self._reset()
        self.records.append(rec)
        i = len(self.records) - 1
        print(
            f"tunix it {i}: rollout {rollout_s:.2f}s update {update_s:.2f}s "
            f"tokens {rec['generated_tokens']} gens {rec['generations']} "
            f"reward {mean:.4f}",
            file=self.out,
            flush=True,
        )
        return rec


def load(ckpt: str):
    """The HF checkpoint in Tunix's Qwen2 (float32) on a mesh over this process's devices."""
    import jax
    import jax.numpy as jnp
    from transformers import AutoTokenizer
    from tunix.models.qwen2 import model as qwen2_model
    from tunix.models.qwen2 import params as qwen2_params

    with open(os.path.join(ckpt, "config.json")) as f:
        c = json.load(f)
    rope_theta = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta")
    config = qwen2_model.ModelConfig(
        num_layers=c["num_hidden_layers"],
        vocab_size=c["vocab_size"],
        embed_dim=c["hidden_size"],
        hidden_dim=c["intermediate_size"],
        num_heads=c["num_attention_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        num_kv_heads=c["num_key_value_heads"],
        rope_theta=rope_theta,
        norm_eps=c["rms_norm_eps"],
        use_tied_embedding=c["tie_word_embeddings"],
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    )
    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((jax.device_count(), 1), ("fsdp", "tp"), axis_types=(auto, auto))
    model = qwen2_params.create_model_from_safe_tensors(ckpt, config, mesh, dtype=jnp.float32)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    return model, tokenizer, mesh


def cluster(model, tokenizer, mesh, rollout_config, iterations: int):
    import optax
    from tunix.rl import rl_cluster as rl

    optimizer = optax.chain(
        optax.clip_by_global_norm(w.MAX_GRAD_NORM),
        optax.adamw(
            w.LR, b1=w.BETAS[0], b2=w.BETAS[1], eps=w.ADAM_EPS, weight_decay=w.WEIGHT_DECAY
        ),
    )
    training = rl.RLTrainingConfig(
        actor_optimizer=optimizer,
        eval_every_n_steps=10**9,
        max_steps=iterations,
        mini_batch_size=w.P,  # one optimizer update on all P*G trajectories
    )
    roles = {rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh}
    config = rl.ClusterConfig(
        role_to_mesh=roles,
        rollout_engine="vanilla",
        training_config=training,
        rollout_config=rollout_config,
    )
    return rl.RLCluster(actor=model, reference=None, tokenizer=tokenizer, cluster_config=config)


def instrument(rl_cluster, meter: Meter, trajectories: int):
    """Fresh sampling seed and token count per rollout call; timing around the update.

    Tunix's vanilla rollout samples with `RolloutConfig.seed`, PRNGKey(0) when unset, on every
    call (tunix/generate/sampler.py, `Sampler.__call__`): the agentic learner makes one batch-1
    call per generation, so every member of a GRPO group would draw the same text. Each call
    gets its own seed here (a traced argument: no recompilation)."""
    import jax
    from flax import nnx

    rollout = rl_cluster.rollout
    generate = rollout.generate

    def seeded_generate(prompts, rollout_config, **kwargs):
        config = dataclasses.replace(rollout_config, seed=jax.random.PRNGKey(meter.next_seed()))
        out = generate(prompts, config, **kwargs)
        meter.count(out.tokens)
        return out

    rollout.generate = seeded_generate

    update_actor = rl_cluster.update_actor
    clock = {"end": time.perf_counter()}

    def timed_update_actor(*args, **kwargs):
        start = time.perf_counter()
        out = update_actor(*args, **kwargs)
        jax.block_until_ready(nnx.state(rl_cluster.actor_trainer.model))
        end = time.perf_counter()
        meter.close(start - clock["end"], end - start, trajectories)
        clock["end"] = time.perf_counter()
        return out

    rl_cluster.update_actor = timed_update_actor
    return clock


# ----------------------------------------------------------------------------- single-turn


def run_single(args, meter: Meter) -> str:
    import numpy as np
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    model, tokenizer, mesh = load(args.ckpt)
    prompts = [
        tokenizer.apply_chat_template(
            w.messages(p, False), tokenize=False, add_generation_prompt=True
        )
        for p in w.PROMPTS
    ]
    prompt_len = max(len(tokenizer.encode(p)) for p in prompts)
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=args.max_new,
        temperature=w.TEMPERATURE,
        top_p=1.0,
        top_k=None,
        max_prompt_length=prompt_len,
        kv_cache_size=prompt_len + args.max_new,
        eos_tokens=[tokenizer.eos_token_id],
    )
    rl_cluster = cluster(model, tokenizer, mesh, rollout_config, args.iterations)
    algo = grpo_learner.GRPOConfig(
        num_generations=w.G, num_iterations=1, beta=0.0, epsilon=w.CLIP_EPS
    )

    def vowel_share(prompts, completions, **kwargs):
        rewards = [w.reward(c) for c in completions]
        meter.add_rewards(rewards)
        return rewards

    learner = grpo_learner.GRPOLearner(
        rl_cluster=rl_cluster, algo_config=algo, reward_fns=vowel_share
    )
    clock = instrument(rl_cluster, meter, w.P * w.G)
    data = [{"prompts": np.array(prompts)} for _ in range(args.iterations)]
    clock["end"] = time.perf_counter()
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        learner.train(data)
    return (
        f"GRPOLearner + RLCluster, vanilla rollout (Tunix's sampler), prompts padded to "
        f"{prompt_len} tokens, KV cache {prompt_len + args.max_new}; beta=0 without a reference "
        "model; num_iterations=1 (no old-log-prob pass); loss_agg_mode sequence-mean-token-mean "
        "(Tunix's default); the vanilla sampler cuts each completion before its EOS, so the "
        "update's completions stop before EOS (EOS is not trained on); "
        "a fresh sampling seed per rollout call (Tunix's default is PRNGKey(0) every call)."
    )


# ----------------------------------------------------------------------------- multi-turn


def multi_parts(meter: Meter, tokenizer, max_new: int):
    """The tool, environment, agent and chat parser of the multi-turn workload, built on
    Tunix's `BaseTool`, `ToolEnvironment`, `ToolAgent` and `QwenChatTemplateParser`."""
    import numpy as np
    from tunix.rl.agentic.agents import agent_types, tool_agent
    from tunix.rl.agentic.environments import tool_environment
    from tunix.rl.agentic.parser.chat_template_parser import parser as chat_parser_lib
    from tunix.rl.agentic.tools import base_tool

    class NextPart(base_tool.BaseTool):
        """Returns the next part of the task."""

        def __init__(self, name: str, description: str):
            super().__init__(name, description)
            self.calls = [0]  # one instance per environment (ToolManager), so per trajectory

        def get_json_schema(self):
            return w.TOOL_DOC

        def apply(self, **kwargs):
            n, self.calls[0] = self.calls[0], self.calls[0] + 1
            return base_tool.ToolOutput(name=self.name, output=w.tool_result(n))

    def text(x) -> str:
        return str(np.asarray(x).reshape(-1)[0])

    class Env(tool_environment.ToolEnvironment):
        """Tunix's tool environment; the TURNS-th generation ends the trajectory, and is
        scored, even when it calls the tool again (Tunix scores only a 'finish')."""

        def _step_impl(self, action):
            result = super()._step_impl(action)
            if not result.done and self.step_count >= self.max_steps:
                calls = action.action if isinstance(action, agent_types.Action) else action
                last = calls[0].get("response", "") if calls else ""
                result.reward = self.reward_fn(task=self.task, action=last)
            return result

    class Agent(tool_agent.ToolAgent):
        """Tunix's ToolAgent with Qwen tool-call parsing; the system message is the one the
        tokenizer's chat template writes for `tools=[TOOL_DOC]`, and a tool's result is the
        tool message as is (ToolAgent prefixes "Tool returned result: ")."""

        def _init_messages(self, system_prompt: str) -> None:
            self._messages = [{"role": "system", "content": system_prompt}]

        def _observation_to_messages(self, observation, reward, done, info) -> None:
            if isinstance(observation, dict) and "tool_outputs" in observation:
                for call_id, output in observation["tool_outputs"].items():
                    self._messages.append(
                        {"role": "tool", "tool_call_id": call_id, "content": output or ""}
                    )
            elif isinstance(observation, dict) and "prompts" in observation:
                self._messages.append({"role": "user", "content": text(observation["prompts"])})

        def update_from_model(self, response: str, **kwargs):
            action = super().update_from_model(response, **kwargs)
            for call in action.action:  # the env scores a truncating call on the raw text
                call.setdefault("response", response)
            return action

    class Parser(chat_parser_lib.QwenChatTemplateParser):
        """Tunix's Qwen parser without its control-token sanitising, which deletes
        "\\n<tool_call>\\n", "\\n</tool_call>" and "<tool_response>\\n" from every message:
        from the template's tool instructions in the system message and from the model's own
        earlier calls, so the prompt would not be the chat template's."""

        def _parse_message(self, message) -> str:
            content = message["content"]
            return {
                "system": self._parse_system,
                "user": self._parse_user,
                "assistant": self._parse_assistant,
                "tool": self._parse_tool,
            }[message["role"]](content)

    def reward_fn(task, action) -> float:
        r = w.reward(action if isinstance(action, str) else str(action))
        meter.add_rewards([r])
        return r

    return NextPart, Env, Agent, Parser(tokenizer, enable_thinking=True), reward_fn


def template_system(tokenizer) -> str:
    rendered = tokenizer.apply_chat_template(
        w.messages(w.PROMPTS[0], True), tools=[w.TOOL_DOC], tokenize=False
    )
    head = "<|im_start|>system\n"
    assert rendered.startswith(head), rendered[:80]
    return rendered[len(head) : rendered.index("<|im_end|>")]


def check_parser(parser, tokenizer, system: str) -> None:
    """Tunix's rendering of a canonical 3-turn chat must be the chat template's."""
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": w.TOOL_NAME, "arguments": {}}}],
    }
    chat, ours = w.messages(w.PROMPTS[0], True), [{"role": "system", "content": system}]
    ours.append(chat[1])
    for n in range(w.TURNS - 1):
        chat += [call, {"role": "tool", "content": w.tool_result(n)}]
        ours += [
            {"role": "assistant", "content": w.TOOL_CALL_TEXT},
            {"role": "tool", "content": w.tool_result(n)},
        ]
    want = tokenizer.apply_chat_template(
        chat, tools=[w.TOOL_DOC], tokenize=False, add_generation_prompt=True
    )
    got = parser.parse(messages=ours, add_generation_prompt=True, is_first_msg=True)
    assert got == want, (got, want)


def run_multi(args, meter: Meter) -> str:
    import numpy as np
    from tunix.generate import tokenizer_adapter
    from tunix.rl.agentic import agentic_grpo_learner as agl
    from tunix.rl.agentic import utils as agentic_utils
    from tunix.rl.rollout import base_rollout

    model, tokenizer, mesh = load(args.ckpt)
    adapter = tokenizer_adapter.TokenizerAdapter(tokenizer)
    NextPart, Env, Agent, parser, reward_fn = multi_parts(meter, tokenizer, args.max_new)
    system = template_system(tokenizer)
    check_parser(parser, tokenizer, system)
    users = [w.messages(p, True)[1]["content"] for p in w.PROMPTS]
    firsts = [
        parser.parse(
            [{"role": "system", "content": system}, {"role": "user", "content": u}],
            add_generation_prompt=True,
            is_first_msg=True,
        )
        for u in users
    ]
    prompt_len = max(len(tokenizer.encode(s)) for s in firsts)
    env_len = max(
        len(
            agentic_utils.tokenize_and_generate_masks(
                [{"role": "tool", "content": w.tool_result(n)}],
                tokenizer=adapter,
                parser=parser,
                contains_first_msg=False,
                contains_generation_msg=True,
            )[0]
        )
        for n in range(w.TURNS)
    )
    # Tunix's `max_response_length` is one budget for all the turns' tokens (the model's and
    # the tool results'), and a generation that reaches it is dropped (trajectory_collect_engine
    # `_one_step`): room for TURNS capped generations and their tool results, plus one.
    budget = w.TURNS * args.max_new + (w.TURNS - 1) * env_len + 1
    longest_context = prompt_len + (w.TURNS - 1) * (args.max_new + env_len)
    cache = next_pow2(longest_context) + args.max_new
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=budget,
        temperature=w.TEMPERATURE,
        top_p=1.0,
        top_k=None,
        max_prompt_length=prompt_len,
        kv_cache_size=cache,
        eos_tokens=[tokenizer.eos_token_id],
        return_logprobs=True,
    )
    rl_cluster = cluster(model, tokenizer, mesh, rollout_config, args.iterations)
    algo = agl.GRPOConfig(
        num_generations=w.G,
        num_iterations=1,
        beta=0.0,
        epsilon=w.CLIP_EPS,
        max_response_length=budget,
        system_prompt=system,
    )
    max_new = args.max_new

    class Learner(agl.GRPOLearner):
        """Tunix passes each generation the budget left (a new sampler shape, so a new
        compilation, per distinct value); the workload caps each generation at max_new."""

        def _model_call(self, chat_lists, env=None, max_generation_steps=None):
            cap = min(max_new, max_generation_steps or max_new)
            return super()._model_call(chat_lists, env, max_generation_steps=cap)

        def _process_results(self, trajectories, *args, **kwargs):
            for item in trajectories:
                chat = item.traj.get("conversation_text") or []
                turns = sum(m["role"] == "assistant" for m in chat)
                meter.turns[turns] = meter.turns.get(turns, 0) + 1
                if meter.debug_traj is None or turns > meter.debug_turns:
                    meter.debug_traj, meter.debug_turns = chat, turns
            return super()._process_results(trajectories, *args, **kwargs)

    learner = Learner(
        rl_cluster=rl_cluster,
        algo_config=algo,
        reward_fns=None,
        chat_parser=parser,
        agent_class=Agent,
        agent_kwargs={"tool_parser_name": "qwen", "tool_map": {w.TOOL_NAME: NextPart}},
        env_class=Env,
        env_kwargs={
            "tool_map": {w.TOOL_NAME: NextPart},
            "reward_fn": reward_fn,
            "max_steps": w.TURNS,
        },
    )
    clock = instrument(rl_cluster, meter, w.P * w.G)
    data = [{"prompts": np.array(users)} for _ in range(args.iterations)]
    clock["end"] = time.perf_counter()
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        learner.train(data)
    if args.debug and meter.debug_traj is not None:
        print(json.dumps(meter.debug_traj, indent=1, default=str), file=sys.stderr)
    turns = ", ".join(f"{n}: {meter.turns[n]}" for n in sorted(meter.turns))
    return (
        "agentic GRPOLearner (tunix.rl.agentic) + RLCluster, vanilla rollout: one batch-1 sampler "
        f"call per generation (max_concurrency {algo.max_concurrency} trajectories at once); "
        f"ToolEnvironment(max_steps={w.TURNS}) with next_part(), ToolAgent('qwen' tool parser); "
        "QwenChatTemplateParser without its control-token sanitising and a ToolAgent whose system "
        "message and tool messages are the chat template's (checked equal at start-up); each "
        f"generation capped at {max_new} new tokens; first-turn prompts padded to {prompt_len} "
        "tokens, later turns to the next power of two (Tunix's sampler), KV cache "
        f"{cache}; the update sees each trajectory as prompt + a {budget}-token response "
        "(assistant tokens, which lack their <|im_end|> since the vanilla sampler cuts it, "
        "and tool-result tokens, masked out); beta=0 without a reference model; "
        "use_rollout_logps (Tunix's default) with its trainer log-prob pass per group before the "
        "update (in rollout_s); reward = the environment's, workload.reward of the last "
        "assistant text; a fresh sampling seed per rollout call. Trajectories by number of "
        f"generations, all iterations: {{{turns}}}."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--mode", choices=("single", "multi"), required=True)
    ap.add_argument("--max-new", type=int, required=True)
    ap.add_argument("--iterations", type=int, default=w.ITERATIONS)
    ap.add_argument("--out", required=True)
    ap.add_argument("--debug", action="store_true", help="print one multi-turn trajectory")
    args = ap.parse_args()

    import importlib.metadata

    import jax
    import tunix.rl.rl_cluster  # noqa: F401  (Tunix's imports first, then silence its logging)

    quiet()
    version = importlib.metadata.version("google-tunix")
    meter = Meter(args.max_new)
    run = run_single if args.mode == "single" else run_multi
    notes = run(args, meter)
    notes += f" jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} device(s)."
    w.write_result(args.out, "Tunix", version, args.mode, args.max_new, meter.records, notes)


if __name__ == "__main__":
    main()
