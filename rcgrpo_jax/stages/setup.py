"""What every stage needs from a config: the mesh, the model, the workdir; and the set-up,
restore, checkpoints and export that the training stages (sft/rctp, grpo/rcgrpo) share."""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_collections

from rcgrpo_jax.errors import UserError

if TYPE_CHECKING:  # the heavy modules load when a stage runs, not when a config is checked
    import jax
    import optax

    from rcgrpo_jax.compilation import Span
    from rcgrpo_jax.models import ModelConfig, Params
    from rcgrpo_jax.train.checkpoint import Checkpointer
    from rcgrpo_jax.train.optim import OptimConfig
    from rcgrpo_jax.train.state import TrainState


def mesh_from_config(config: ml_collections.ConfigDict):
    """Builds the (data, fsdp, tensor) mesh; one -1 entry takes the remaining devices."""
    import jax
    import numpy as np

    from rcgrpo_jax import models

    shape = list(config.mesh.shape)
    n = jax.device_count()
    if shape.count(-1) > 1:
        raise UserError(f"mesh.shape={tuple(shape)}: at most one entry may be -1")
    if -1 in shape:
        rest = int(np.prod([s for s in shape if s != -1]))
        if n % rest:
            raise UserError(f"mesh.shape={tuple(shape)} does not divide {n} devices")
        shape[shape.index(-1)] = n // rest
    if int(np.prod(shape)) != n:
        raise UserError(f"mesh.shape={tuple(shape)} uses {int(np.prod(shape))} of {n} devices")
    return models.make_mesh(shape)


def model_from_config(config: ml_collections.ConfigDict, mesh=None, hf_path: str = ""):
    """(cfg, params): the HF checkpoint at `hf_path` or model.hf_path, else a random model from
    model.arch."""
    import jax
    import jax.numpy as jnp

    from rcgrpo_jax import models

    m = config.model
    common = dict(remat=m.remat, scan_layers=bool(m.scan_layers), attention=m.attention)
    hf_path = hf_path or m.hf_path
    if hf_path:
        if not Path(hf_path).is_dir():
            raise UserError(f"model path {hf_path!r} does not exist")
        return models.load_hf(
            hf_path,
            dtype=jnp.dtype(m.param_dtype),
            mesh=mesh,
            compute_dtype=jnp.dtype(m.dtype),
            **common,
        )
    arch = dict(m.arch.to_dict(), dtype=m.dtype, param_dtype=m.param_dtype, **common)
    try:
        cfg = models.ModelConfig.from_dict(arch)
    except (TypeError, ValueError) as e:
        raise UserError(f"model.arch: {e}") from e
    return cfg, models.init_params(cfg, jax.random.key(config.seed), mesh)


def tokenizer_from_config(config: ml_collections.ConfigDict, model_path: str = ""):
    """The transformers tokenizer at `tokenizer_path`, else the one saved with the model
    (`model_path`, e.g. a previous stage's export, or model.hf_path), else one trained in the
    workdir on the environment's `tokenizer_corpus` (a model trained from scratch)."""
    path = config.tokenizer_path or model_path or config.model.hf_path
    corpus = None if path else environment(config).tokenizer_corpus()
    if corpus is not None:
        from rcgrpo_jax import distributed
        from rcgrpo_jax.envs import tiny_tokenizer

        vocab = int(config.model.arch.vocab_size)
        source = str(config.env.benchmark)

        def train(texts):
            try:
                return tiny_tokenizer.load_or_train_texts(config.workdir, texts, vocab, source)
            except ValueError as e:  # a cached tokenizer of another vocab size or environment
                raise UserError(str(e)) from None

        # Multi-process: process 0 trains and writes it; the others then load that one (or, on a
        # workdir that is not shared, train the same deterministic tokenizer themselves).
        tokenizer = train(corpus) if distributed.is_main_process() else None
        distributed.barrier("rcgrpo_tiny_tokenizer")
        return tokenizer if tokenizer is not None else train(corpus)
    if not path:
        raise UserError("no tokenizer: set tokenizer_path or model.hf_path")
    if not Path(path).is_dir():
        raise UserError(f"tokenizer path {path!r} does not exist")
    if _plain_fast_tokenizer(Path(path)):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    # imported here: AutoTokenizer pulls in transformers' model configs, and with them torch
    # where it is installed (~3 s a process), which a plain tokenizer does not need
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _plain_fast_tokenizer(directory: Path) -> bool:
    """Whether `directory` declares a plain fast tokenizer (its tokenizer.json is all of it; the
    tiny demo's, saved with every stage's export). Such a one is loaded as it was saved:
    AutoTokenizer would rebuild it as the class of the config.json beside it (transformers 5
    does so for qwen2 configs), whose pre-tokenizer splits text differently from training."""
    import json

    file = directory / "tokenizer_config.json"
    if not file.is_file():
        return False
    declared = json.loads(file.read_text()).get("tokenizer_class")
    return declared in ("TokenizersBackend", "PreTrainedTokenizerFast")


def ensure_reward_tokens(cfg, params, tokenizer, mesh=None):
    """Adds `<|high_reward|>`/`<|low_reward|>` to the tokenizer if absent and makes sure their
    embedding rows exist; rows created here start at the mean embedding. Returns
    (cfg, params, {reward: token id})."""
    from rcgrpo_jax import models
    from rcgrpo_jax.envs import prompts

    n_before = len(tokenizer)
    ids = prompts.add_reward_tokens(tokenizer)
    if len(tokenizer) > cfg.vocab_size:  # padded to 128 so the vocab axis still shards evenly
        return (*models.resize_vocab(cfg, params, -(-len(tokenizer) // 128) * 128), ids)
    if len(tokenizer) > n_before:  # new ids fell into the checkpoint's padded rows
        params = models.mean_init_rows(cfg, params, sorted(ids.values()), n_before)
    return cfg, params, ids


@dataclasses.dataclass(frozen=True)
class Start:
    """What a training stage starts from: its workdir, the mesh, the tokenizer and the initial
    model (cfg, params); `span` times the stage from here (wall and compile seconds)."""

    workdir: Path
    mesh: jax.sharding.Mesh
    tokenizer: Any  # a transformers tokenizer
    cfg: ModelConfig
    params: Params
    span: Span | None = None
    base_path: str = ""  # the HF directory the model came from ("" = a random init)


def start(config: ml_collections.ConfigDict, init_from: str = "") -> Start:
    """The workdir (created), mesh, tokenizer and model; `init_from` (an HF directory, e.g. a
    previous stage's export) replaces model.hf_path for both the model and the tokenizer."""
    from rcgrpo_jax import compilation

    span = compilation.Span()
    path = Path(config.workdir)
    path.mkdir(parents=True, exist_ok=True)
    mesh = mesh_from_config(config)
    tokenizer = tokenizer_from_config(config, init_from)
    cfg, params = model_from_config(config, mesh, hf_path=init_from)
    base = init_from or config.model.hf_path
    base = str(Path(base).resolve()) if base else ""
    return Start(path, mesh, tokenizer, cfg, params, span, base)


def with_reward_tokens(s: Start) -> Start:
    """`s` with the reward tokens in its tokenizer and their embedding rows in its model
    (`ensure_reward_tokens`)."""
    cfg, params, _ = ensure_reward_tokens(s.cfg, s.params, s.tokenizer, s.mesh)
    return dataclasses.replace(s, cfg=cfg, params=params)


@dataclasses.dataclass(frozen=True)
class Training:
    """A training stage's set-up: the model's optimizer (from `<section>.optim`), the state's
    shardings, the checkpointer of `<workdir>/checkpoints` and the state to start from: the
    newest restorable checkpoint's, else a fresh one. `data_state` is what that checkpoint
    stored beside the state ({} for a fresh state)."""

    workdir: Path
    mesh: jax.sharding.Mesh
    tokenizer: Any  # a transformers tokenizer
    cfg: ModelConfig
    optim: OptimConfig
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule  # the learning rate the step logs
    shardings: TrainState  # of shardings
    checkpointer: Checkpointer
    state: TrainState
    data_state: dict[str, Any]
    span: Span | None = None  # since the stage's start
    # Under LoRA (`cfg.lora`), the frozen base: the state's params are the adapters alone.
    frozen: Params | None = None
    base_path: str = ""  # the model the stage started from (a PEFT adapter's base)

    @property
    def export_dir(self) -> Path:
        return self.workdir / "export"

    def policy(self, state: TrainState) -> Params:
        """The whole param tree of `state`'s model (the adapters joined to the base)."""
        from rcgrpo_jax.models import lora

        return state.params if self.frozen is None else lora.join(state.params, self.frozen)


def lora_spec(config: ml_collections.ConfigDict, tokenizer: Any):
    """`model.lora` as a `LoraSpec` (None at rank 0), training the embedding rows of the reward
    tokens the tokenizer has."""
    from rcgrpo_jax.envs.reward_tokens import REWARD_TOKENS
    from rcgrpo_jax.models import LoraSpec

    m = config.model.lora
    if int(m.rank) == 0:
        return None
    vocab = tokenizer.get_vocab()
    ids = tuple(sorted(vocab[t] for t in REWARD_TOKENS.values() if t in vocab))
    return LoraSpec(
        rank=int(m.rank), alpha=float(m.alpha), targets=tuple(m.targets), init=str(m.init),
        token_ids=ids,
    )  # fmt: skip


def training(
    config: ml_collections.ConfigDict,
    section: ml_collections.ConfigDict,
    s: Start,
    total_steps: int,
    data_iter: Any = None,
) -> Training:
    """The optimizer, shardings, checkpointer and (restored or fresh) state of a stage whose
    settings are `section` (config.train or config.rl: optim, checkpoint_every,
    keep_checkpoints); `total_steps` optimizer updates are the schedule's default length (a
    stage of 0 steps, which exports and evaluates its start as it is, still gets a schedule of
    one). A restored checkpoint's iterator position is set on `data_iter` (when given)."""
    from rcgrpo_jax import models
    from rcgrpo_jax.models import lora
    from rcgrpo_jax.train.checkpoint import Checkpointer
    from rcgrpo_jax.train.loop import restore_or_init
    from rcgrpo_jax.train.optim import OptimConfig, make_optimizer, make_schedule
    from rcgrpo_jax.train.state import abstract_train_state, init_train_state, state_shardings

    optim = OptimConfig.from_dict(section.optim.to_dict(), default_total_steps=max(total_steps, 1))
    optimizer = make_optimizer(optim)
    cfg, params, frozen = s.cfg, s.params, None
    spec = lora_spec(config, s.tokenizer)
    if spec is not None and not s.base_path:
        raise UserError(
            "model.lora.rank > 0 adapts a trained model (model.hf_path, rl.init_from); "
            "a random init trains whole (model.lora.rank=0)"
        )
    if spec is not None:
        cfg = s.cfg.replace(lora=spec)
        params, frozen = lora.split(cfg, _with_lora(cfg, s.params, config.seed, s.mesh))
    psh = lora.split(cfg, models.param_shardings(cfg, s.mesh))[0]
    shardings = state_shardings(optimizer, psh, s.mesh, params)
    ckpt = Checkpointer(
        s.workdir / "checkpoints",
        save_every=int(section.checkpoint_every),
        keep=int(section.keep_checkpoints),
    )
    shapes = lora.split(cfg, models.param_shapes(cfg))[0]
    target = abstract_train_state(optimizer, shapes, shardings)
    fresh = lambda: init_train_state(
        params, optimizer, config.seed, mesh=s.mesh, param_shardings=psh, key=optim.init_key()
    )
    state, data_state = restore_or_init(ckpt, target, fresh, data_iter)
    return Training(
        s.workdir, s.mesh, s.tokenizer, cfg, optim, optimizer, make_schedule(optim),
        shardings, ckpt, state, data_state, s.span, frozen, s.base_path,
    )  # fmt: skip


def _with_lora(cfg: ModelConfig, params: Params, seed: int, mesh) -> Params:
    """The base's `params` with `cfg.lora`'s adapters added (`lora.init_lora`, from `seed`),
    every leaf on its sharding. `params` are donated: the base is not held twice."""
    import jax

    from rcgrpo_jax import models
    from rcgrpo_jax.models import lora

    init = jax.jit(
        lambda p, k: lora.init_lora(cfg, p, k),
        out_shardings=models.param_shardings(cfg, mesh),
        donate_argnums=0,
    )
    with models.use_mesh(mesh):
        return init(params, jax.random.key(seed))


def finish(t: Training, params: Any, summary: dict[str, Any], line: str = "") -> None:
    """Exports `params` (`t.policy(state)`: under LoRA merged, and the adapter in
    `export/adapter`) with the tokenizer as an HF directory (`t.export_dir`) and writes
    `summary` as `<workdir>/summary.json`, which marks the stage done, with the stage's wall
    and compile time (`time`) and the machine it ran on (`machine`); prints `line`, the
    stage's one end line, followed by that time.
    Every process takes part in gathering params sharded over several; process 0 alone writes;
    every process returns once the outputs exist."""
    from rcgrpo_jax import distributed, machine, models
    from rcgrpo_jax.train.metrics import write_atomic, writing

    final = params if distributed.process_count() == 1 else distributed.host_tree(params)
    if distributed.is_main_process():
        with writing(t.export_dir):
            models.save_hf(t.export_dir, t.cfg, final, tokenizer=t.tokenizer)
            if t.cfg.lora is not None:  # and the adapter alone, as PEFT reads it
                adapter = t.export_dir / "adapter"
                models.save_adapter(adapter, t.cfg, final, base_model=t.base_path)
                t.tokenizer.save_pretrained(str(adapter))
        time = None if t.span is None else t.span.summary()
        if time is not None:
            summary = {**summary, "time": time}
        summary = {**summary, "machine": machine.describe()}
        text = json.dumps(summary, indent=1, default=str) + "\n"
        write_atomic(t.workdir / "summary.json", text)
        if line:
            print(f"{line}; {t.span.describe(time)}" if time is not None else line, flush=True)
    distributed.barrier("rcgrpo_stage_outputs")


def _plain(value: Any) -> Any:
    """A config value as plain Python: sub-trees as dicts, lists as tuples (hashable, frozen)."""
    if isinstance(value, (ml_collections.ConfigDict, dict)):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    return value


def rl_rollout_settings(config: ml_collections.ConfigDict):
    """How RL's rollouts (and stage 1's policy rollouts, which sample as RL does) are drawn:
    `config.rl`'s lengths and sampling, `config.env`'s episode limits."""
    from rcgrpo_jax.rl.rollout import RolloutSettings

    rl = config.rl
    return RolloutSettings(
        chat_format=config.model.chat_format, max_new_tokens=int(rl.max_new_tokens),
        max_len=int(rl.max_len), temperature=float(rl.temperature), top_p=float(rl.top_p),
        max_steps_per_turn=int(config.env.max_steps_per_turn),
        call_timeout_s=float(config.env.call_timeout_s), max_rows=int(rl.max_rows),
        sampler_weights=str(config.mesh.sampler_weights),
    )  # fmt: skip


def environment(config: ml_collections.ConfigDict, section: str = "env"):
    """The environment `env.benchmark` names, built from the options in `env.<benchmark>`;
    `section="eval"` lays `eval.<benchmark>` over them (the eval stage's own selection).
    `env.module` is imported first, so that a user's module can register its environment."""
    from rcgrpo_jax import envs

    module = config.env.module
    if module:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            raise UserError(f"env.module={module!r} cannot be imported: {e}") from None
    name = config.env.benchmark
    try:
        factory = envs.get(name)
    except ValueError as e:
        raise UserError(f"env.benchmark: {e}") from None
    options = _plain(config.env.get(name, {}))
    if section != "env":
        options.update(_plain(config[section].get(name, {})))
    key = (name, id(factory), json.dumps(options, sort_keys=True, default=repr))
    if key not in _ENVIRONMENTS:  # one instance per set of options: stages ask for it often
        try:
            _ENVIRONMENTS[key] = factory(**options)
        except (TypeError, ValueError) as e:
            raise UserError(f"{section}.{name}: {e}") from None
    return _ENVIRONMENTS[key]


_ENVIRONMENTS: dict[tuple, Any] = {}


def golden_trajectories(config: ml_collections.ConfigDict) -> bool:
    """Whether stage 1 builds its data the built-ins' way, from tasks with ground truth
    (`golden_trajectories`, see `envs.base.Environment`); otherwise from the protocol alone."""
    return bool(getattr(environment(config), "golden_trajectories", False))


def require_stage1_sources(config: ml_collections.ConfigDict, demonstrations: bool) -> None:
    """UserError, before anything is built, when stage 1 would have no trajectories to learn
    from: on an environment with only the protocol, its data are its demonstrations
    (`Environment.demonstration`) and the starting policy's rollouts (`rctp.rollouts_per_entry`).
    `demonstrations`: a stage that trains on them alone (stage all's warm start)."""
    if golden_trajectories(config):
        return
    env, name = environment(config), config.env.benchmark
    if hasattr(env, "demonstration"):
        return
    if demonstrations:
        raise UserError(
            f"env.benchmark={name!r} has no demonstration(task): stage all's warm start "
            f"(train.warm_start_steps={config.train.warm_start_steps}) trains on "
            "demonstrations alone; set train.warm_start_steps=0 or give the environment a "
            "demonstration method (docs/custom_env.md)"
        )
    if int(config.rctp.rollouts_per_entry) <= 0:
        raise UserError(
            f"env.benchmark={name!r} gives stage {config.stage} no data: it has no "
            "demonstration(task) and rctp.rollouts_per_entry=0 (stage 1 learns from the "
            "environment's demonstrations and the starting policy's rollouts labelled by "
            "reward); set rctp.rollouts_per_entry > 0 or give the environment a demonstration "
            "method (docs/custom_env.md)"
        )


def task_entries(config: ml_collections.ConfigDict, split: str) -> list:
    """Training or held-out tasks of the configured environment."""
    return list(environment(config).tasks(split))


# The sampler keeps 2 slots of headroom and a row needs room for at least one sampled token.
PROMPT_HEADROOM = 3
_PROMPT_LENGTHS: dict[tuple, int] = {}  # (fingerprint, len(tokenizer), chat format, entry)
_FINGERPRINTS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_SAID: set[str] = set()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """What a tokenizer encodes by (its serialised vocabulary, merges and added tokens, and its
    chat template), so that the same tokenizer loaded again by a later stage of the run, from
    the model's directory or an export, shares the memos. Computed once per object: tokens added
    later (the reward tokens) are told apart by the memo's key, which holds len(tokenizer)."""
    import hashlib

    if tokenizer not in _FINGERPRINTS:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab()))
        text += str(getattr(tokenizer, "chat_template", None))
        _FINGERPRINTS[tokenizer] = hashlib.sha1(text.encode()).hexdigest()
    return _FINGERPRINTS[tokenizer]


def prompt_length(env: Any, tokenizer: Any, entry: Any, chat_format: str) -> int:
    """Tokens of `entry`'s first prompt (system prompt with a reward token, tools, first user
    turn, generation prompt): what a rollout starts from. Memoised per tokenizer content."""
    from rcgrpo_jax.envs import EpisodeSettings, prompts
    from rcgrpo_jax.envs.reward_tokens import HIGH

    cache = _PROMPT_LENGTHS
    # entry: by identity
    key = (tokenizer_fingerprint(tokenizer), len(tokenizer), chat_format, entry)
    if key not in cache:
        # the high token stands for either token (both render alike); without the token in the
        # vocabulary it is spelled in pieces, so this never undercounts a conditioned prompt
        episode = env.episode(entry, EpisodeSettings(chat_format=chat_format), reward_token=HIGH)
        cache[key] = len(prompts.prompt_ids(tokenizer, episode.messages, episode.tools))
    return cache[key]


def _prompt_length_or_none(env: Any, tokenizer: Any, entry: Any, chat_format: str) -> int | None:
    """`prompt_length`, or None when the entry's environment fails to start (a broken
    simulator or scenario): the run must not die of one environment."""
    try:
        return prompt_length(env, tokenizer, entry, chat_format)
    except Exception:
        return None


def fitting_entries(
    env: Any, entries: Sequence[Any], tokenizer: Any, chat_format: str, max_len: int, what: str
) -> list[Any]:
    """The entries whose first prompt leaves room to sample within `max_len` tokens (prompt +
    PROMPT_HEADROOM <= max_len); the others are left out, and that is said once per process and
    message on stderr. `what` names the pool and its limit, e.g. "training entries for
    rl.max_len". A trajectory that outgrows `max_len` later is truncated by the rollout."""
    room = max_len - PROMPT_HEADROOM
    lengths = [_prompt_length_or_none(env, tokenizer, e, chat_format) for e in entries]
    # An entry whose prompt cannot be built stays in: the rollout's row guard records its error.
    kept = [e for e, n in zip(entries, lengths, strict=True) if n is None or n <= room]
    dropped = len(entries) - len(kept)
    if dropped:
        longest = max(n for n in lengths if n is not None)
        note = (
            f"note: {dropped} of {len(entries)} {what}={max_len} left out: their prompts are "
            f"longer than {room} tokens (longest {longest})"
        )
        if note not in _SAID:
            _SAID.add(note)
            print(note, file=sys.stderr, flush=True)
    if entries and not kept:
        raise UserError(f"no {what}={max_len}: every prompt is longer; raise it")
    return kept
