"""TRL's side of bench/peers.py: K iterations of the shared GRPO workload (workload.py) in TRL's
`GRPOTrainer`, on CPU in float32, written out with `workload.write_result`.

    python bench/peer_runs/trl_run.py --ckpt DIR --mode single|multi --max-new N
        --iterations K --out result.json [--show]        (one command line)

One trainer step is one iteration: P prompts x G samples generated (and scored), then one AdamW
update on all P*G completions. Per step, `rollout_s` is the time inside TRL's
`_generate_and_score_completions` (generation, tool loop, rewards, advantages; no old-log-prob
pass with one update per generation) and `update_s` the rest of the step (loss, backward, clip,
optimizer), both from `time.perf_counter`.

Multi-turn uses TRL's own tool loop through `environment_factory` rather than `tools=`: a plain
tool is one callable shared by all rollouts, while the environment gives each rollout its own
`NextPart`, whose `next_part()` answers `workload.tool_result(calls so far)`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload as w  # noqa: E402

# Quiet before transformers/TRL/datasets are imported: they read these at import time.
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="model + tokenizer directory (build.py)")
    p.add_argument("--mode", choices=("single", "multi"), required=True)
    p.add_argument("--max-new", type=int, required=True, help="new tokens per generation")
    p.add_argument("--iterations", type=int, default=w.ITERATIONS)
    p.add_argument("--out", required=True, help="result file (workload.write_result)")
    p.add_argument("--show", action="store_true", help="print the first trajectory once")
    return p.parse_args(argv)


class NextPart:
    """One rollout's tool environment: TRL makes one per rollout (pooled, `reset` per batch) and
    exposes its public methods as tools, so the call counter is per trajectory."""

    def __init__(self):
        self.calls = 0

    def reset(self, **example) -> None:
        """A new trajectory: no calls yet; None leaves the prompt as it is."""
        self.calls = 0
        return None

    def next_part(self) -> str:
        """Returns the next part of the task."""
        result = w.tool_result(self.calls)
        self.calls += 1
        return result


def final_text(completion) -> str:
    """The completion's final assistant text: the string itself (non-conversational), else the
    content of the last assistant message (multi-turn: the answer after the tool calls)."""
    if isinstance(completion, str):
        return completion
    for message in reversed(completion):
        if message.get("role") == "assistant":
            return message.get("content") or ""
    return ""


def make_reward(seen: list[float]):
    """`workload.reward` as a TRL reward function; also keeps the rewards for the record."""

    def vowel_share(completions, **kwargs) -> list[float]:
        rewards = [w.reward(final_text(c)) for c in completions]
        seen.extend(rewards)
        return rewards

    return vowel_share


def dataset(multi_turn: bool):
    """The P prompts as conversational prompts, in workload order (the sampler does not shuffle)."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": w.messages(p, multi_turn)} for p in w.PROMPTS])


def completion_cap(args: argparse.Namespace) -> int:
    """TRL's max_completion_length. Single-turn: N. Multi-turn: TRL caps the whole completion
    (model tokens + tool results) at it, so it is set where it never cuts (TURNS generations of
    N plus 64 tokens per tool turn); each generate call is capped at N by generation_kwargs."""
    if args.mode == "single":
        return args.max_new
    return w.TURNS * args.max_new + 64 * (w.TURNS - 1)


def config(args: argparse.Namespace, out_dir: str):
    """GRPOConfig matching workload.py: one generation batch of P*G per step, one update on it,
    pure sampling at temperature 1, AdamW at constant LR, no KL, clip 0.2, DAPO token loss."""
    from trl import GRPOConfig

    multi = args.mode == "multi"
    return GRPOConfig(
        output_dir=out_dir,
        use_cpu=True, bf16=False, fp16=False, seed=0, data_seed=0,
        per_device_train_batch_size=w.P * w.G, gradient_accumulation_steps=1,
        num_generations=w.G, num_iterations=1, max_steps=args.iterations, shuffle_dataset=False,
        temperature=w.TEMPERATURE, top_p=1.0, top_k=0,
        max_completion_length=completion_cap(args),
        generation_kwargs={"max_new_tokens": args.max_new},
        max_tool_calling_iterations=w.TURNS - 1 if multi else None,
        learning_rate=w.LR, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=w.BETAS[0], adam_beta2=w.BETAS[1], adam_epsilon=w.ADAM_EPS,
        weight_decay=w.WEIGHT_DECAY, max_grad_norm=w.MAX_GRAD_NORM,
        beta=0.0, epsilon=w.CLIP_EPS, loss_type="dapo",
        report_to="none", save_strategy="no", eval_strategy="no", logging_strategy="no",
        disable_tqdm=True, log_level="error", dataloader_num_workers=0,
    )  # fmt: skip


def match_tool_doc(trainer, tok) -> str:
    """TRL renders the tool schema from `next_part`'s signature and docstring, which gives
    `TOOL_DOC` without its empty `"required": []` and with a `"return"` entry. The checkpoint was
    fine-tuned on `TOOL_DOC`, so the prompts are rendered (and the calls parsed) with `TOOL_DOC`
    itself, through TRL's private `_env_tools`; execution still goes to each rollout's method.
    Returns a note on the rendered system prompt for the result file."""
    msgs = w.messages(w.PROMPTS[0], True)
    env_tools = getattr(trainer, "_env_tools", None)
    if isinstance(env_tools, dict) and None in env_tools:
        env_tools[None] = [w.TOOL_DOC]
    ours = tok.apply_chat_template(
        msgs, tools=[w.TOOL_DOC], add_generation_prompt=True, tokenize=False
    )  # fmt: skip
    trls = tok.apply_chat_template(
        msgs, tools=(env_tools or {}).get(None) or trainer.tools,
        chat_template=trainer.chat_template, add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    if ours == trls:
        return "multi-turn prompt rendered exactly as with tools=[TOOL_DOC]"
    return f"multi-turn prompt differs from tools=[TOOL_DOC]: {trls!r}"


class StepMeter:
    """Per-step counters, filled by the wrapped trainer methods and a TrainerCallback."""

    def __init__(self):
        self.records: list[dict] = []
        self.rewards: list[float] = []
        self.start = self.rollout_s = 0.0
        self.tokens = self.trajectories = self.generations = 0
        self.first_batch = None

    def begin(self) -> None:
        self.start, self.rollout_s = time.perf_counter(), 0.0
        self.tokens = self.trajectories = self.generations = 0
        self.rewards.clear()

    def end(self) -> dict:
        step_s = time.perf_counter() - self.start
        mean = sum(self.rewards) / len(self.rewards) if self.rewards else float("nan")
        rec = w.iteration_record(self.rollout_s, step_s - self.rollout_s, self.tokens,
                                 self.trajectories, self.generations, mean)  # fmt: skip
        self.records.append(rec)
        return rec


def instrument(trainer, meter: StepMeter) -> None:
    """Wraps the bound methods that generate: `_generate_and_score_completions` (timed; counts
    model tokens from completion_mask x tool_mask, the latter 0 on tool results) and
    `_generate_single_turn` (every generate call, tool-loop regenerations included: rows)."""
    score, single = trainer._generate_and_score_completions, trainer._generate_single_turn

    def timed_score(inputs):
        t0 = time.perf_counter()
        out = score(inputs)
        meter.rollout_s += time.perf_counter() - t0
        mask = out["completion_mask"]
        if out.get("tool_mask") is not None:
            mask = mask * out["tool_mask"]
        meter.tokens += int(mask.sum())
        meter.trajectories += int(mask.shape[0])
        if meter.first_batch is None:
            meter.first_batch = out
        return out

    def counted_single(*args, **kwargs):
        completion_ids, logprobs = single(*args, **kwargs)
        meter.generations += len(completion_ids)
        return completion_ids, logprobs

    trainer._generate_and_score_completions = timed_score
    trainer._generate_single_turn = counted_single


def callback(meter: StepMeter):
    """A TrainerCallback that brackets each optimizer step and prints one line per step."""
    from transformers import TrainerCallback

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            meter.begin()

        def on_step_end(self, args, state, control, **kwargs):
            r = meter.end()
            print(f"iter {len(meter.records)}: rollout {r['rollout_s']:.2f}s "
                  f"update {r['update_s']:.2f}s tokens {r['generated_tokens']} "
                  f"gens {r['generations']} reward {r['mean_reward']:.4f}", flush=True)  # fmt: skip

    return Steps()


def show(meter: StepMeter, tok) -> None:
    """Prints the first trajectory of the first batch (prompt, then completion with the tool
    results), special tokens kept, so one can see the calls parsed and executed."""
    b = meter.first_batch
    prompt = b["prompt_ids"][0][b["prompt_mask"][0].bool()]
    completion = b["completion_ids"][0][b["completion_mask"][0].bool()]
    print("--- first trajectory: prompt ---\n" + tok.decode(prompt))
    print("--- completion ---\n" + tok.decode(completion) + "\n--- end ---", flush=True)


def build_trainer(args: argparse.Namespace, out_dir: str, meter: StepMeter):
    """The model (float32), tokenizer and GRPOTrainer, instrumented."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import GRPOTrainer

    multi = args.mode == "multi"
    model = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.ckpt)
    trainer = GRPOTrainer(
        model=model, processing_class=tok, reward_funcs=[make_reward(meter.rewards)],
        args=config(args, out_dir), train_dataset=dataset(multi),
        environment_factory=NextPart if multi else None, callbacks=[callback(meter)],
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # its end-of-training metrics dump; one line a step
    instrument(trainer, meter)
    return trainer, tok


def notes(args: argparse.Namespace, prompt_note: str) -> str:
    """What a reader of the result must know about how TRL ran the workload."""
    parts = [
        "GRPOTrainer, transformers generate (no vLLM), CPU float32, optim=adamw_torch_fused "
        "(transformers' default), loss_type=dapo, scale_rewards=group (TRL default), beta=0",
        "rollout_s = _generate_and_score_completions (generation, tool loop, rewards, advantages; "
        "no old-logprob pass since num_iterations=1); update_s = rest of the trainer step",
    ]
    if args.mode == "multi":
        parts += [
            "tool loop via environment_factory (one NextPart per rollout), "
            f"max_tool_calling_iterations={w.TURNS - 1}; each generate call capped at "
            f"max_new_tokens={args.max_new} (generation_kwargs); TRL also caps the whole "
            f"completion (model + tool tokens) at max_completion_length={completion_cap(args)}, "
            "never reached here; the tool loop regenerates only the rows that called a tool, one "
            "generate call per turn over those rows",
            prompt_note,
        ]
    return "; ".join(parts)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    import trl
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    meter = StepMeter()
    with tempfile.TemporaryDirectory() as out_dir:
        trainer, tok = build_trainer(args, out_dir, meter)
        prompt_note = match_tool_doc(trainer, tok) if args.mode == "multi" else ""
        trainer.train()
    if args.show:
        show(meter, tok)
    w.write_result(args.out, "TRL", trl.__version__, args.mode, args.max_new, meter.records,
                   notes(args, prompt_note))  # fmt: skip


if __name__ == "__main__":
    main()
