"""Copy-formation probe behind README "The embedded default" (issue 7): an SFT loop on the
golden data of an `sft` workdir, same optimizer family as the stage, printing every 50 steps the
held-out teacher-forced accuracy of name tokens copied from the last 12 tokens ("near", the
fixed-offset copy) / from further back ("far", the destination from the user's message).

    python -m rcgrpo_jax.main --config=configs/tiny.py --config.stage=sft --config.workdir=W
    python docs/experiments/copy_formation.py --data W --seed 1 --steps 1000 [--wd 0.1 ...]

Output: the arguments, then `step:near/far` pairs and the wall time. An ad-hoc experiment
script (not part of the package or the tests); the numbers in the README came from it.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from transformers import PreTrainedTokenizerFast

from rcgrpo_jax import models
from rcgrpo_jax.config import config_from_file
from rcgrpo_jax.data import store
from rcgrpo_jax.envs import policies, prompts, synthetic
from rcgrpo_jax.stages import setup

ap = argparse.ArgumentParser()
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--lr", type=float, default=1e-2)
ap.add_argument("--steps", type=int, default=400)
ap.add_argument("--B", type=int, default=8)
ap.add_argument("--layers", type=int, default=3)
ap.add_argument("--heads", type=int, default=4)
ap.add_argument("--kv", type=int, default=2)
ap.add_argument("--hd", type=int, default=16)
ap.add_argument("--hidden", type=int, default=64)
ap.add_argument("--mlp", type=int, default=256)
ap.add_argument("--theta", type=float, default=100.0)
ap.add_argument("--std", type=float, default=0.02)
ap.add_argument("--warmup", type=int, default=20)
ap.add_argument("--wd", type=float, default=0.0)
ap.add_argument("--b2", type=float, default=0.95)
ap.add_argument("--ctx", type=float, default=0.0)
ap.add_argument("--data", required=True, help="an sft workdir (data_report.json, export/)")
ap.add_argument("--pre", type=int, default=0)
ap.add_argument("--presyl", type=int, default=1)
ap.add_argument("--prelr", type=float, default=1e-2)
a = ap.parse_args()
tok = PreTrainedTokenizerFast.from_pretrained(a.data + "/export")
syl = np.zeros(1024, bool)
syl[[tok.convert_tokens_to_ids(s) for s in synthetic.SYLLABLES]] = True
rep = json.load(open(a.data + "/data_report.json"))
src = store.load_split(rep["dataset_dir"], "train")
recs = [src[i] for i in range(len(src))]
T = 128
recs = [r for r in recs if len(r["tokens"]) <= T]

c = config_from_file(Path(__file__).resolve().parents[2] / "configs" / "tiny.py")
test = []
for e in setup.task_entries(c, "test")[:32]:
    ids, mask = prompts.render_with_mask(tok, synthetic.play(e, policies.ground_truth).messages)
    test.append((ids, mask))
TT = max(len(i) for i, _ in test)
tx = np.zeros((len(test), TT), np.int32)
tm = np.zeros_like(tx)
tseg = np.zeros_like(tx)
for j, (ids, mask) in enumerate(test):
    tx[j, : len(ids)] = ids
    tm[j, : len(ids)] = mask
    tseg[j, : len(ids)] = 1
NEAR = np.zeros_like(tx, bool)
for j in range(tx.shape[0]):
    for t in range(tx.shape[1]):
        NEAR[j, t] = tx[j, t] in set(tx[j, max(0, t - 12) : t].tolist())
cfg = models.ModelConfig.from_dict(
    dict(
        vocab_size=1024,
        hidden_size=a.hidden,
        intermediate_size=a.mlp,
        num_layers=a.layers,
        num_heads=a.heads,
        num_kv_heads=a.kv,
        head_dim=a.hd,
        max_position_embeddings=1024,
        dtype="float32",
        param_dtype="float32",
        family="qwen2",
        qkv_bias=True,
        tie_embeddings=True,
        rope_theta=a.theta,
    )
)
params = models.init_params(cfg, jax.random.key(a.seed), None)
if a.std != 0.02:
    params = jax.tree.map(lambda p: p * (a.std / 0.02) if p.ndim >= 2 else p, params)


def adamw(lr: float, steps: int, wd: float) -> optax.GradientTransformation:
    """Clip to global norm 1, then AdamW with linear warmup and cosine decay to 0."""
    schedule = optax.warmup_cosine_decay_schedule(0, lr, a.warmup, steps, 0.0)
    return optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=a.b2, weight_decay=wd)
    )


opt = adamw(a.lr, a.steps, a.wd)
st = opt.init(params)


def loss_fn(p, x, seg, m):
    logp, _, valid = models.token_logprobs(
        cfg, p, x, jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape), seg
    )
    ww = jnp.where(m[:, 1:] > 0, 1.0, a.ctx) * valid
    return -(logp * ww).sum() / ww.sum()


def make_step(opt: optax.GradientTransformation):
    @jax.jit
    def step(p, s, x, seg, m):
        loss, g = jax.value_and_grad(loss_fn)(p, x, seg, m)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    return step


step = make_step(opt)


@jax.jit
def tf_acc(p):
    logits = models.forward(cfg, p, jnp.asarray(tx))
    pred = logits[:, :-1].argmax(-1)
    tgt = jnp.asarray(tx)[:, 1:]
    mm = jnp.asarray(tm)[:, 1:] > 0
    isn = jnp.asarray(syl)[tgt] & mm
    hit = pred == tgt
    near = jnp.asarray(NEAR)[:, 1:] & isn
    far = isn & ~near
    return (hit & near).sum() / near.sum(), (hit & far).sum() / far.sum()


rng = np.random.default_rng(a.seed)
t = time.time()
out = []
if a.pre:
    popt = adamw(a.prelr, a.pre, 1e-4)  # optax's default decay, as the README's runs had
    pst = popt.init(params)
    pstep = make_step(popt)
    vocab = np.flatnonzero(syl) if a.presyl else np.arange(16, 1024)
    for _ in range(a.pre):
        x = np.zeros((a.B, T), np.int32)
        seg = np.zeros((a.B, T), np.int32)
        mk = np.zeros((a.B, T), np.int32)
        for j in range(a.B):
            k = int(rng.integers(8, 60))
            r = rng.choice(vocab, k)
            seq = np.concatenate([r, r])
            x[j, : 2 * k] = seq
            seg[j, : 2 * k] = 1
            mk[j, k + 1 : 2 * k] = 1
        params, pst, loss = pstep(params, pst, jnp.asarray(x), jnp.asarray(seg), jnp.asarray(mk))
    out.append(("pre", round(float(loss), 2), round(float(tf_acc(params)[0]), 2)))
for i in range(a.steps):
    idx = rng.integers(0, len(recs), a.B)
    x = np.zeros((a.B, T), np.int32)
    seg = np.zeros((a.B, T), np.int32)
    mk = np.zeros((a.B, T), np.int32)
    for j, k in enumerate(idx):
        n = len(recs[k]["tokens"])
        x[j, :n] = recs[k]["tokens"]
        seg[j, :n] = 1
        mk[j, :n] = recs[k]["loss_mask"]
    params, st, loss = step(params, st, jnp.asarray(x), jnp.asarray(seg), jnp.asarray(mk))
    if (i + 1) % 50 == 0:
        near_acc, far_acc = map(float, tf_acc(params))
        out.append((i + 1, round(near_acc, 2), round(far_acc, 2)))
print(
    json.dumps(vars(a)),
    "->",
    " ".join(f"{s}:{n}/{f}" for s, n, f in out),
    f"{time.time() - t:.0f}s",
    flush=True,
)
