"""Train state and the one generic, jitted, sharded train step shared by SFT/RCTP and RL.

Skip semantics (decided here, relied on by checkpoints and loops):
- `step` counts train-step *calls* (= batches consumed); it advances even when the update is
  skipped, so the data-iterator position, the checkpoint numbering and `step` always agree.
- A step whose loss or any gradient is non-finite, or whose loss says its batch carries no
  signal (aux `signal_max` == 0: the RL loss with no informative group), leaves `params` and
  `opt_state` bit-for-bit unchanged (the LR schedule, which lives in `opt_state`, does not
  advance either) and adds 1 to `skipped`. Applied optimizer updates = `step - skipped`. A
  zero gradient must not reach Adam: its moments would still move every weight.
- The rng advances on every call, skipped or not.

Loss protocol: `loss_fn(params, batch, rng) -> (loss, aux)` with `aux` a dict of scalars. Two aux
keys are special when accumulating over microbatches: `weight` (how much this microbatch's loss
counts, e.g. its number of loss tokens; default 1) and `tokens` (reported). The combined loss and
gradient are the `weight`-weighted means over microbatches, so a token-normalised loss stays
exactly token-normalised over the whole batch. `weight`, `tokens` and keys ending in `_sum` are
summed over microbatches, keys ending in `_max` take the maximum; every other aux value is a
`weight`-weighted mean.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rcgrpo_jax.models import sharding as msharding
from rcgrpo_jax.models.lora import join

Batch = Mapping[str, Any]
LossFn = Callable[[Any, Batch, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]
SUMMED_AUX = ("tokens", "weight")


def _summed(key: str) -> bool:
    return key in SUMMED_AUX or key.endswith("_sum")


def _maxed(key: str) -> bool:
    return key.endswith("_max")


def _accumulate(key: str, acc: jax.Array, value: jax.Array, weight: jax.Array) -> jax.Array:
    """One microbatch's aux `value` into the running `acc` by the key's rule (module docstring)."""
    if _maxed(key):
        return jnp.maximum(acc, value)
    return acc + (value if _summed(key) else weight * value)


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 []: train-step calls so far, skipped ones included
    params: Any  # float32 master weights
    opt_state: Any
    rng: jax.Array  # uint32 raw key data (plain array: checkpoints need no key-type support)
    skipped: jax.Array  # int32 []: how many of those calls were not applied (module docstring)


def _replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def state_shardings(
    optimizer: optax.GradientTransformation, param_shardings: Any, mesh: Mesh, params_like: Any
) -> TrainState:
    """Shardings of every state leaf: optimizer moments follow their params, the rest replicate.

    `params_like` gives shapes (arrays or ShapeDtypeStructs) for `optimizer.init`'s abstract trace.
    """
    opt_shapes = jax.eval_shape(optimizer.init, params_like)
    rep = _replicated(mesh)
    opt_shardings = optax.tree_map_params(
        optimizer,
        lambda _, s: s,
        opt_shapes,
        param_shardings,
        transform_non_params=lambda _: rep,
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct),
    )
    return TrainState(
        step=rep, params=param_shardings, opt_state=opt_shardings, rng=rep, skipped=rep
    )


# Jitted programs shared by every caller with the same settings (`_shared`): one program per
# shape and process, however many stages, arms or iterations build "their" step.
_PROGRAMS: dict[Hashable, Any] = {}


def _shared(key: Hashable | None, make: Callable[[], Any]) -> Any:
    """`make()`'s jitted function, made once per `key` (None: a new one every call)."""
    if key is None:
        return make()
    if key not in _PROGRAMS:
        _PROGRAMS[key] = make()
    return _PROGRAMS[key]


def _tree_key(tree: Any) -> tuple:
    """A hashable stand-in for a pytree of shardings (its structure and leaves)."""
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, tuple(leaves))


def make_init_state(
    optimizer: optax.GradientTransformation,
    *,
    mesh: Mesh,
    param_shardings: Any,
    params_like: Any,
    key: Hashable | None = None,
) -> Callable[[Any, int | jax.Array], TrainState]:
    """A jitted `(params, seed) -> TrainState` placed on `state_shardings` (compiled once; call
    it for every fresh state of the same configuration). `key`: what determines `optimizer`
    (e.g. its `OptimConfig`); every call with an equal key and shardings shares one program."""
    shardings = state_shardings(optimizer, param_shardings, mesh, params_like)

    def init(p, raw_key):
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=p,
            opt_state=optimizer.init(p),
            rng=raw_key.astype(jnp.uint32),
            skipped=jnp.zeros((), jnp.int32),
        )

    program = None if key is None else ("init", key, mesh, _tree_key(shardings))
    jitted = _shared(
        program,
        lambda: jax.jit(init, in_shardings=(param_shardings, None), out_shardings=shardings),
    )

    def fn(params: Any, seed: int | jax.Array) -> TrainState:
        key = seed if isinstance(seed, jax.Array) else jax.random.key(int(seed))
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        with msharding.use_mesh(mesh):
            return jitted(params, key)

    return fn


def init_train_state(
    params: Any,
    optimizer: optax.GradientTransformation,
    seed: int | jax.Array,
    *,
    mesh: Mesh,
    param_shardings: Any,
    key: Hashable | None = None,
) -> TrainState:
    """Fresh state (step 0, optimizer init, rng from `seed`) on `state_shardings`; `key` as
    `make_init_state`'s."""
    init = make_init_state(
        optimizer, mesh=mesh, param_shardings=param_shardings, params_like=params, key=key
    )
    return init(params, seed)


def abstract_state(state_or_shapes: TrainState, shardings: TrainState) -> TrainState:
    """ShapeDtypeStructs carrying shardings: the restore target for checkpoints."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state_or_shapes, shardings
    )


def abstract_train_state(
    optimizer: optax.GradientTransformation, param_shapes: Any, shardings: TrainState
) -> TrainState:
    """The restore target without allocating anything (e.g. `models.param_shapes(cfg)`)."""
    sds = jax.ShapeDtypeStruct
    shapes = TrainState(
        step=sds((), jnp.int32),
        params=param_shapes,
        opt_state=jax.eval_shape(optimizer.init, param_shapes),
        rng=jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))),
        skipped=sds((), jnp.int32),
    )
    return abstract_state(shapes, shardings)


def batch_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Leading (batch) dim over the data-parallel axes; axes that do not divide it are dropped.
    A scalar (a batch-wide value) is replicated."""
    axes = ("act_batch",) + (None,) * (len(shape) - 1) if shape else ()
    return NamedSharding(mesh, msharding.logical_to_spec(axes, shape, mesh))


def shard_batch(batch: Batch, mesh: Mesh) -> dict[str, jax.Array]:
    """Host-local numpy batch -> global arrays (per-host shards assembled across processes)."""
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        global_shape = (v.shape[0] * jax.process_count(),) + v.shape[1:] if v.ndim else ()
        sh = batch_sharding(mesh, global_shape) if v.ndim else _replicated(mesh)
        out[k] = jax.make_array_from_process_local_data(sh, v, global_shape)
    return out


def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def _microbatches(batch: Batch, n: int) -> dict[str, jax.Array]:
    """[B, ...] -> [n, B/n, ...] with microbatch a = rows a, a+n, a+2n, ...: each microbatch
    stays spread over the data-parallel devices instead of living on a few of them."""

    def split(x):
        if x.ndim == 0:  # batch-wide scalars go to every microbatch
            return jnp.broadcast_to(x, (n,))
        if x.shape[0] % n:
            raise ValueError(f"batch dim {x.shape[0]} is not divisible by grad_accum={n}")
        x = x.reshape((x.shape[0] // n, n) + x.shape[1:])
        x = jnp.swapaxes(x, 0, 1)
        return msharding.constrain(x, (None, "act_batch") + (None,) * (x.ndim - 2))

    return {k: split(v) for k, v in batch.items()}


def _loss_and_grads(loss_fn: LossFn, params, batch, rng, grad_accum: int):
    """(loss, grads, aux) over the whole batch, scanning over `grad_accum` microbatches."""
    vg = jax.value_and_grad(loss_fn, has_aux=True)
    if grad_accum == 1:
        (loss, aux), grads = vg(params, batch, rng)
        return loss, grads, aux

    def body(carry, xs):
        mb, a = xs
        (loss, aux), grads = vg(params, mb, jax.random.fold_in(rng, a))
        w = jnp.asarray(aux.get("weight", 1.0), jnp.float32)
        g_acc, l_acc, aux_acc = carry
        g_acc = jax.tree.map(lambda acc, g: acc + w * g.astype(jnp.float32), g_acc, grads)
        aux_acc = {k: _accumulate(k, aux_acc[k], v, w) for k, v in _aux_with_weight(aux).items()}
        return (g_acc, l_acc + w * loss, aux_acc), None

    # weight/tokens summed, maxima kept; everything else weight-summed here and divided below.
    aux_keys = jax.eval_shape(lambda: vg(params, batch, rng)[0][1]).keys()
    init = lambda k: jnp.asarray(-jnp.inf if _maxed(k) else 0.0, jnp.float32)
    aux0 = {k: init(k) for k in {*aux_keys, "weight"}}
    g0 = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    mbs = _microbatches(batch, grad_accum)
    (g_sum, l_sum, aux_sum), _ = jax.lax.scan(
        body, (g0, jnp.zeros((), jnp.float32), aux0), (mbs, jnp.arange(grad_accum))
    )
    # no weight in any microbatch (no loss token at all): zero loss and grads, as in one batch
    w = jnp.where(aux_sum["weight"] > 0, aux_sum["weight"], 1.0)
    grads = jax.tree.map(lambda g, p: (g / w).astype(p.dtype), g_sum, params)
    aux = {k: (v if _summed(k) or _maxed(k) else v / w) for k, v in aux_sum.items()}
    return l_sum / w, grads, aux


def _aux_with_weight(aux: Mapping[str, Any]) -> dict[str, jax.Array]:
    out = {k: jnp.asarray(v, jnp.float32) for k, v in aux.items()}
    out.setdefault("weight", jnp.ones((), jnp.float32))
    return out


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    mesh: Mesh,
    shardings: TrainState,
    grad_accum: int = 1,
    schedule: optax.Schedule | None = None,
    donate: bool = True,
    outputs: Callable[[Batch], Mapping[str, jax.Array]] | None = None,
    inputs: Mapping[str, Any] | None = None,
    prepare: Callable[[Batch], Batch] | None = None,
    key: Hashable | None = None,
    frozen: Any = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """One jitted, sharded step: prepare → loss/grads (scan over microbatches) → skip-or-apply
    update.

    `shardings` is `state_shardings(...)`; the state is donated. The returned callable takes a
    host-local numpy batch (or global jax arrays) and returns (new_state, metrics) where metrics
    holds loss, grad_norm, skipped (cumulative), update_skipped (this step), tokens, lr and the
    loss_fn's aux values, all replicated scalars; and whatever `outputs(batch)` computes in the
    same program (replicated arrays of any shape: the RL step's next reward tokens). `inputs`:
    scalars added to every batch (run-time settings that would otherwise be baked into the
    program, such as the RL step's reward-token draw). `prepare(batch) -> batch`: run on the
    whole batch inside the jit before it is split into microbatches (the RL step's advantages,
    which `loss_fn` and `outputs` then read as batch fields).

    `key`: the declared settings that determine `loss_fn`, `prepare`, `optimizer`, `schedule`
    and `outputs` (e.g. the model config, the `rl.losses.Objective` and the `OptimConfig`); the
    functions themselves are not part of it, so a setting a function captures must be in `key`.
    Steps made with an equal key, mesh, shardings, grad_accum and donation share one jitted
    function, so stages and arms with the same settings compile each shape once per process.
    None: a program of its own.

    `frozen`: under LoRA, the base weights that do not train (`models.lora.split`): the state's
    params are the adapters only, `loss_fn` gets the whole tree (`models.lora.join`), and the
    base is an argument of the program (not donated, not differentiated), held by the step.
    """

    def step_fn(state: TrainState, frozen: Any, batch: Batch):
        key, sub = jax.random.split(jax.random.wrap_key_data(state.rng))
        if prepare is not None:
            batch = prepare(batch)
        loss_of = loss_fn if frozen is None else (lambda p, b, r: loss_fn(join(p, frozen), b, r))
        loss, grads, aux = _loss_and_grads(loss_of, state.params, batch, sub, grad_accum)
        grad_norm = optax.global_norm(grads)
        ok = jnp.isfinite(loss) & _all_finite(grads) & (aux.get("signal_max", 1.0) > 0)
        updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
        skipped = state.skipped + (~ok).astype(jnp.int32)
        new_state = TrainState(
            step=state.step + 1,
            params=keep(new_params, state.params),
            opt_state=keep(new_opt, state.opt_state),
            rng=jax.random.key_data(key),
            skipped=skipped,
        )
        applied = state.step - state.skipped  # updates applied before this one
        metrics = {k: jnp.asarray(v, jnp.float32) for k, v in aux.items() if k != "weight"}
        metrics.update(
            loss=loss.astype(jnp.float32),
            grad_norm=grad_norm.astype(jnp.float32),
            skipped=skipped,
            update_skipped=(~ok).astype(jnp.int32),
            tokens=jnp.asarray(aux.get("tokens", 0.0), jnp.float32),
        )
        if schedule is not None:
            metrics["lr"] = jnp.asarray(schedule(applied), jnp.float32)
        if outputs is not None:
            metrics.update(outputs(batch))
        return new_state, metrics

    rep = _replicated(mesh)
    # the caller's key, and what it does not say: which optional parts exist, the layout
    program = None if key is None else (
        "step", key, prepare is None, outputs is None, schedule is None,
        tuple(sorted(inputs or ())), mesh, _tree_key(shardings), grad_accum, donate,
        _tree_key(jax.tree.map(lambda x: x.sharding, frozen)),
    )  # fmt: skip
    jitted = _shared(
        program,
        lambda: jax.jit(
            step_fn,
            # None: the base and the batch keep their shardings (shard_batch's for the batch)
            in_shardings=(shardings, None, None),
            out_shardings=(shardings, rep),
            donate_argnums=(0,) if donate else (),
        ),
    )
    extra = shard_batch(inputs, mesh) if inputs else {}

    def step(state: TrainState, batch: Batch):
        if not all(isinstance(v, jax.Array) for v in batch.values()):
            batch = shard_batch(batch, mesh)
        with msharding.use_mesh(mesh):
            return jitted(state, frozen, {**batch, **extra})

    step.jitted = jitted  # for lowering / cost inspection / compile-count checks
    return step
