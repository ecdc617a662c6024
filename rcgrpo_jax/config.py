"""The base experiment config; `configs/*.py` start from it and change what differs.

Every key a run reads is declared here (ml_collections rejects unknown overrides), with the
meaning next to it. Overrides: `--config.train.optim.lr=1e-6`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import ml_collections

STAGES = ("sft", "rctp", "grpo", "rcgrpo", "eval", "all")
BFCL_CATEGORIES = (
    "multi_turn_base",
    "multi_turn_miss_func",
    "multi_turn_miss_param",
    "multi_turn_long_context",
)


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.stage = "eval"  # one of STAGES
    c.workdir = ""  # everything a run writes goes here; empty = runs/<config name>
    c.seed = 0

    # XLA's persistent compilation cache (`compilation.py`): a program compiled once is read
    # from disk by every later run, workdir and test; "" = $JAX_COMPILATION_CACHE_DIR, else
    # $XDG_CACHE_HOME/rcgrpo_jax/xla (~/.cache/rcgrpo_jax/xla).
    c.compile = ml_collections.ConfigDict({"cache": True, "cache_dir": ""})

    # Stage `all`'s RL arms (`rl.arms.ARMS`): stage 1 (sft | rctp) x algorithm (grpo |
    # rcgrpo) x sampling (plain: one round of P x G per iteration; `_dynamic`: DAPO's dynamic
    # sampling), e.g. "rctp_rcgrpo", "sft_grpo_dynamic"; "paper" names the four plain arms,
    # "dynamic" the four dynamic ones, "grid" all eight. Every arm runs to the same budget of
    # generated trajectories (rl.max_rollouts).
    c.arms = ("paper", "sft_grpo_dynamic")
    # Stage `all`'s control arms (`rl.arms.CONTROLS`), each run beside every chosen arm it
    # controls: "shuffled" (SFT→GRPO and RCTP→RC-GRPO with rewards permuted within the batch)
    # and "lr0" (RCTP→RC-GRPO at lr = 0: its change must be exactly 0). Empty: no control.
    c.controls = ()

    # (data, fsdp, tensor); product must equal the number of devices in use, -1 fills one axis.
    # "auto": planned on the devices present (`planning.choose`): the first mesh, then
    # rl.optim.grad_accum and rl.max_rows, under which every program fits; printed in one line.
    c.mesh = ml_collections.ConfigDict({"shape": (-1, 1, 1)})
    # What the sampler reads (rollouts and evaluation): "tensor" = a compute-dtype copy of the
    # weights over the tensor axis only, one tree per layer, made once per rollout (its programs
    # slice and gather no weight); "train" = the training layout
    # itself, which under FSDP XLA gathers whole, in f32, before the decode loop
    # (`models.config.SAMPLER_WEIGHTS`).
    c.mesh.sampler_weights = "tensor"

    c.model = ml_collections.ConfigDict()
    c.model.hf_path = ""  # Hugging Face model dir (config.json + *.safetensors); "" = random init
    c.model.dtype = "bfloat16"  # compute dtype (norms/softmax accumulate in f32 regardless)
    c.model.param_dtype = "float32"  # master weights
    c.model.remat = "none"  # none | full | dots | dots_no_batch
    # False unrolls the layer loop: faster steps for a few layers, compile time grows with depth
    c.model.scan_layers = True
    # auto (per backend) | dense | flash | splash | cudnn: all but dense avoid [T, T] scores
    # (the sampler's prefill/decode run flash where splash or cudnn is set: per-row cache offsets)
    c.model.attention = "auto"
    # Apply the LM head only where the loss reads it (SFT: assistant tokens; RL: sampled ones),
    # K positions per row (bucketed): at a 152k vocabulary and a few hundred sampled tokens
    # after a 4k prompt the full head is most of the step. The same values up to f32 summation
    # order; one program per (T, K).
    c.model.gather_head = True
    c.model.chat_format = "qwen"  # qwen | llama | python: how tool calls are written and parsed
    # LoRA: rank 0 trains every weight; rank > 0 trains low-rank adapters on `targets` (any of
    # q k v o gate up down) and the reward tokens' embedding rows, the base frozen. The export
    # is merged (export/) and PEFT's adapter (export/adapter/). init: kaiming | gaussian (PEFT's).
    c.model.lora = ml_collections.ConfigDict(
        {"rank": 0, "alpha": 16.0, "targets": ("q", "k", "v", "o", "gate", "up", "down"),
         "init": "kaiming"}
    )  # fmt: skip
    # Architecture of a randomly initialised model (used only when hf_path is empty).
    c.model.arch = ml_collections.ConfigDict(
        {
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 16,
            "rope_theta": 10000.0,
            "qkv_bias": True,
            "tie_embeddings": True,
            "max_position_embeddings": 4096,
            "family": "qwen2",
        }
    )
    c.tokenizer_path = ""  # "" = model.hf_path

    c.env = ml_collections.ConfigDict()
    # The environment (`envs.register`): bfcl | synthetic | a name `env.module` registers. Its
    # options are `env.<benchmark>` (passed to its factory as keywords), for the eval stage with
    # `eval.<benchmark>` laid over them.
    c.env.benchmark = "bfcl"
    c.env.module = ""  # a module to import first, e.g. "examples.calculator_env"
    c.env.bfcl = ml_collections.ConfigDict({"categories": BFCL_CATEGORIES})  # training categories
    c.env.max_steps_per_turn = 20  # BFCL's MAXIMUM_STEP_LIMIT
    c.env.call_timeout_s = 5.0  # wall-clock limit of one simulator call: a hang ends its row only
    # num_rl > 0: a third split of tasks over names neither stage 1 nor the held-out tasks use
    # (the train split then gives those names up), for `rl.prompt_split = "rl"`.
    c.env.synthetic = ml_collections.ConfigDict(
        {"num_train": 512, "num_test": 64, "num_rl": 0, "seed": 0}
    )
    # Task difficulty (envs.synthetic.Difficulty): (min, max) user turns, folder depth,
    # distractor files per folder, chance of a follow-up turn, main task templates.
    c.env.synthetic.difficulty = ml_collections.ConfigDict(
        {
            "turns": (1, 3),
            "depth": 2,
            "distractors": 1,
            "followup": 0.6,
            "templates": ("copy_found", "move_by_content", "rename_by_ext", "clone_text"),
            "name_roles": False,  # folders, files and new names from disjoint syllables
        }
    )

    c.eval = ml_collections.ConfigDict()
    c.eval.policy = "model"  # model | ground_truth | empty
    c.eval.split = "test"  # test | train | all
    c.eval.bfcl = ml_collections.ConfigDict({"categories": BFCL_CATEGORIES})  # evaluated ones
    c.eval.max_entries = 0  # 0 = all entries of the split
    c.eval.max_new_tokens = 512  # per assistant step
    c.eval.max_len = 16384  # tokens per trajectory (prompt + all turns)
    c.eval.temperature = 0.0  # greedy
    # RL's start/end evaluations also report the mean success of `samples` rollouts per entry
    # at `sample_temperature` (0 = greedy only): a change in the policy's probabilities shows
    # there before it flips a greedy choice.
    c.eval.samples = 0
    c.eval.sample_temperature = 1.0
    c.eval.batch_size = 0  # entries decoded together (0 = all at once)
    c.eval.reward_token = ml_collections.config_dict.placeholder(int)  # None | 1 high | 0 low

    # Stage 1: SFT (golden trajectories) / RCTP (mixed quality + reward tokens), stages/sft.py.
    c.rctp = ml_collections.ConfigDict()
    c.rctp.low_per_high = 1.0  # label-0 examples kept per label-1 example (< 0: keep all)
    c.rctp.perturbations = (
        "wrong_arg", "missing_step", "extra_step", "wrong_order", "premature_stop", "foreign_call",
    )  # fmt: skip
    c.rctp.perturbations_per_entry = 1  # per kind and entry
    # Trajectories of the stage's starting policy per entry, labelled by their reward: RCTP's own
    # low-quality examples; on an environment without golden trajectories (the protocol alone,
    # docs/custom_env.md) also SFT's (its successes: rejection sampling). Not the warm start's.
    c.rctp.rollouts_per_entry = 0
    c.rctp.rollout_batch = 64
    c.rctp.heldout_entries = 0  # whole training entries kept out of the stage-1 data
    c.rctp.max_tokens = 0  # drop longer rendered trajectories (0 = no limit)
    # Fewest stored training examples of a label the stage trains on (SFT: label 1; RCTP: both)
    # before the stage refuses to train, in one line naming the counts.
    c.rctp.min_per_label = 1
    c.rctp.eval_entries = 32  # held-out entries for the controllability report (0 = skip)
    c.rctp.train_steps = 0  # stage `all`: RCTP's train.steps (0 = train.steps, as SFT)
    # Stage `all`: RCTP that stops once its reward tokens are learnt, its steps the cap. Checked
    # as train.warm_start_stop is (every `every` steps, `samples` rollouts on each of the first
    # `entries` tasks of `split`), under each token: RCTP stops at the first check where mean
    # success under <|high_reward|> minus under <|low_reward|> reaches `level` (0 = off). The
    # checks: rctp's stop_checks.jsonl and summary.json (`stop`).
    c.rctp.stop = ml_collections.ConfigDict(
        {"level": 0.0, "every": 50, "entries": 64, "samples": 4, "split": "train"}
    )

    c.train = ml_collections.ConfigDict()
    c.train.steps = 1000
    # Stage `all`: SFT steps on the golden trajectories before SFT and RCTP split, both arms then
    # continuing from that one model, as the paper's arms share one instruct model
    # (`stages/all.py`, `configs/tiny.py`); 0 = both start from the base.
    c.train.warm_start_steps = 0
    # Stage `all`: a warm start that stops on a measured quantity, warm_start_steps its cap (and
    # its learning-rate schedule's length). Every `every` steps, the mean success of `samples`
    # rollouts (eval.sample_temperature) on each of the first `entries` tasks of `split`; the
    # warm start stops at the first check that reaches `level` (0 = off: all warm_start_steps);
    # the cap itself is not a check. `split`: "train" (stage 1's own tasks) or "rl" (the
    # synthetic environment's third split, over names neither stage 1 nor the held-out tasks
    # use); never the held-out split, so the rule never sees a held-out result. The checks: the
    # warm start's stop_checks.jsonl and summary.json (`stop`).
    c.train.warm_start_stop = ml_collections.ConfigDict(
        {"level": 0.0, "every": 50, "entries": 64, "samples": 4, "split": "train"}
    )
    c.train.batch_size = 8  # packed rows per step (global)
    c.train.seq_len = 4096  # row length; examples are packed, never split
    c.train.checkpoint_every = 100
    c.train.keep_checkpoints = 3
    c.train.peak_flops = 0.0  # per-device peak FLOP/s for the MFU estimate (0 = not logged)
    c.train.optim = ml_collections.ConfigDict(
        {
            "lr": 1e-5,
            "warmup_steps": 20,
            "total_steps": 0,  # 0 = train.steps
            "weight_decay": 0.0,
            "b1": 0.9,
            "b2": 0.95,
            "eps": 1e-8,
            "clip_norm": 1.0,
            "grad_accum": 1,
            "min_lr_ratio": 0.1,
        }
    )

    # Stage 2: GRPO / RC-GRPO (stages/rl.py). One iteration = P prompts x G rollouts, then
    # epochs x minibatches fused updates over whole groups.
    c.rl = ml_collections.ConfigDict()
    c.rl.init_from = ""  # HF dir of the stage-1 policy (e.g. <workdir>/rctp/export); "" = model
    c.rl.steps = 100  # RL iterations
    c.rl.num_prompts = 8  # P
    c.rl.group_size = 8  # G
    c.rl.p_high = 0.5  # P_sample(<|high_reward|>) for RC-GRPO
    c.rl.stratified = True  # RC-GRPO: round(p_high*G) high tokens per group, both always present
    # The token every GRPO prompt carries: "none" (a model trained without reward tokens), or
    # "high" (a reward-conditioned model sampled and evaluated under <|high_reward|>: RCTP
    # without RC-GRPO's mixed-token groups).
    c.rl.grpo_token = "none"
    # Where RL's prompts come from: "train" (stage 1's tasks) or "rl" (the synthetic
    # environment's third split, `env.synthetic.num_rl`: tasks stage 1 has not memorised).
    c.rl.prompt_split = "train"
    c.rl.max_new_tokens = 256  # per assistant step
    c.rl.max_len = 16384  # tokens per trajectory = the train step's T
    c.rl.temperature = 1.0
    c.rl.top_p = 1.0
    c.rl.epochs = 1
    # The update runs each group's prompt through the model once and every rollout's rest over
    # it (`data.packing.shared_prompts`), not the prompt once per rollout: the same loss and
    # gradients up to f32 summation order, for a fraction of the FLOPs when prompts are long
    # (BFCL's 3-5k tokens, G rollouts each). One program per (prompts per group, their length
    # bucket, the rests' bucket). False: every row whole, as the reference log-probs run.
    c.rl.share_prompt = True
    c.rl.minibatches = 1  # updates per epoch; each holds num_prompts/minibatches whole groups
    # The policy loss (rl/losses.py, `@register_objective`), each name meaning TRL's loss_type
    # of that name (docs/objectives.md): dapo (token mean over the update's batch) | grpo (mean
    # over sequences of each one's token mean) | dr_grpo (sum / (sequences x rl.max_len)) |
    # gspo (one length-normalised ratio per sequence, its own clip range; sequence mean).
    c.rl.objective = "dapo"
    # The advantage estimator: any name registered with `@register_estimator` in
    # rl/advantages.py (grpo: (r - mean) / (std + eps) per group; dr_grpo: r - mean; ...).
    # "" = the objective's own (dr_grpo's for dr_grpo, grpo's for the others), so an objective
    # named alone keeps its paper's advantages.
    c.rl.estimator = ""
    # The std-normalising estimators' (r - mean) / (std + adv_eps), std with adv_std_ddof delta
    # degrees of freedom: 0 the population std (this project's measured default), 1 the sample
    # std that TRL (eps 1e-4), Tunix (eps 1e-6) and DeepSeekMath's GRPO use.
    c.rl.adv_eps = 1e-6
    c.rl.adv_std_ddof = 0
    c.rl.clip_low = 0.2
    c.rl.clip_high = 0.28
    c.rl.gspo_clip_low = 3e-4  # gspo's sequence-ratio range [1 - low, 1 + high] (the paper's)
    c.rl.gspo_clip_high = 4e-4
    c.rl.kl_beta = 0.0  # k3 KL to the initial policy
    # Control: the advantages come from the rewards permuted across the batch's rollouts (the
    # logs keep the real ones). Any gain that survives it is not from the reward signal.
    c.rl.shuffle_rewards = False
    # Dynamic sampling (DAPO): drop groups whose rewards are all equal and roll out further
    # prompts, up to dynamic_max_rounds rounds per iteration, until num_prompts groups remain.
    # Short of that, the update trains the ones it has (cut to a multiple of minibatches x
    # grad_accum), in a batch of num_prompts groups with the rest masked: one step shape.
    # Stages grpo/rcgrpo only: stage `all`'s arms each set their own (config.arms).
    c.rl.dynamic_sampling = False
    c.rl.dynamic_max_rounds = 4  # rollout rounds per iteration, the first included
    # The budget: trajectories generated over the run (every round counts). The run stops when
    # it is spent (fewer than group_size left), or after rl.steps iterations if that comes
    # first (the summary's `ended` says which). 0 = steps x num_prompts x group_size, what a
    # run without dynamic sampling makes.
    c.rl.max_rollouts = 0
    # Rollout rows the sampler holds at once (each chunk of rows its own KV cache, released
    # before the next): bounds sampler memory by this, not by P x G; the trajectories are the
    # same whatever it is. 0 = all P x G rows together.
    c.rl.max_rows = 0
    c.rl.eval_every = 10  # iterations; 0 = never (RC-GRPO evaluates with <|high_reward|>)
    # Held-out success also each time the trajectories generated first reach one of this many
    # evenly spaced points of the budget (`rl.curve`), the last the budget itself: the curve
    # every arm is compared by at equal cost. 0 = none.
    c.rl.eval_points = 0
    c.rl.checkpoint_every = 10
    c.rl.keep_checkpoints = 3
    c.rl.optim = ml_collections.ConfigDict(
        {
            "lr": 1e-6,
            "warmup_steps": 0,
            "total_steps": 0,  # 0 = steps x epochs x minibatches
            "weight_decay": 0.0,
            "b1": 0.9,
            "b2": 0.999,
            "eps": 1e-8,
            "clip_norm": 1.0,
            "grad_accum": 1,  # microbatches per update (scanned inside the step)
            "min_lr_ratio": 1.0,  # constant lr after warm-up
        }
    )

    # What runs record beyond their metrics.
    c.logging = ml_collections.ConfigDict()
    # Groups per RL iteration kept for the run report (each RL stage's trajectories.jsonl: per
    # row its conversation, reward, verdicts and advantage): the first ones generated; -1 = all.
    c.logging.report_groups = -1

    return c


def config_from_file(path: str | Path) -> ml_collections.ConfigDict:
    """The `get_config()` of a config file, as `--config=<path>` builds it. Config files are
    loaded by path, since `configs/` is a folder of files named on the command line, not a
    package."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"_rcgrpo_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def sibling_config(config_file: str | Path, name: str) -> ml_collections.ConfigDict:
    """The config of `<name>.py` in `config_file`'s folder, for a config that changes only
    what differs from another: `sibling_config(__file__, "tiny")`."""
    return config_from_file(Path(config_file).with_name(f"{name}.py"))


def bfcl_rl_recipe(c: ml_collections.ConfigDict) -> None:
    """The demo's RL recipe (`configs/tiny.py`; its runs against the shuffled-reward and lr-0
    controls are in docs/experiments/tiny_default.md) in the terms of a 7B/8B model on BFCL;
    the 7B and 8B configs call it. It has not been run at that size. Besides the learning rate
    and warm-up, in a 7B model's terms, three settings are not the demo's: the arms (the dynamic
    ones only), rl.minibatches and rctp.rollouts_per_entry (said below)."""
    # RL's prompts: BFCL's training split, disjoint from the held-out test split (BFCL has no
    # third split of unseen names, the synthetic demo's `rl` split).
    c.rl.prompt_split = "train"
    # Train on informative groups only (DAPO's dynamic sampling): after SFT on golden
    # trajectories most groups of 8 are all-pass or all-fail, and an update on a batch of them
    # has nearly no signal. Stage `all` runs the four dynamic arms (the paper's plain ones:
    # `--config.arms="('paper',)"`, or "('grid',)" for both); a single RL stage needs
    # `--config.rl.dynamic_sampling=True`. Up to 4 rounds of P x G rollouts per iteration, within
    # the same budget for every arm (rl.max_rollouts 0 = rl.steps x P x G trajectories), which
    # it therefore spends in between rl.steps / 4 and rl.steps iterations.
    c.arms = ("dynamic",)
    c.rl.dynamic_max_rounds = 4
    # Two epochs over each batch, so the second sees ratios != 1 and the clip bounds how far one
    # batch moves the policy. One minibatch (the demo has 2): an iteration's informative groups
    # are cut to a multiple of minibatches x grad_accum, so with 2 an iteration short of
    # 2 x grad_accum of them trains nothing (at grad_accum 8, v5e-32's, that is all P = 8).
    c.rl.epochs = 2
    c.rl.minibatches = 1
    # A fresh Adam's first updates are lr x sign(g) on every weight whatever the gradient's
    # size: warm up over 10 updates, to lr 1e-6, a tenth of stage 1's.
    c.rl.optim.warmup_steps = 10
    c.rl.optim.lr = 1e-6
    # The run report keeps 2 groups per iteration: at 7B's lengths a 100-iteration stage `all`
    # of 4 arms is then a ~24 MB page, all groups ~85 MB (docs/report.md).
    c.logging.report_groups = 2
    # RCTP's data includes 2 rollouts per entry of the stage-1 starting model (the instruct
    # model here), labelled by their reward: its failures join the low-reward examples, so that
    # <|low_reward|> produces failures like the policy's, not only scripted perturbations (its
    # successes join the high ones, which SFT's data then lacks). Off in the demo, whose warm
    # start fails mostly on names it has not seen: there its own failures among the label-0
    # examples leave <|low_reward|> where the scripted ones put it
    # (docs/experiments/tiny_default.md, "An RL recipe that does not collapse").
    c.rctp.rollouts_per_entry = 2
