"""Our objectives against TRL's own GRPO loss code, one case per TRL `loss_type` (grpo, bnpo,
dr_grpo, dapo; GSPO as TRL spells it: grpo with importance_sampling_level="sequence"), with the
settings docs/objectives.md maps each one to.

One fixed batch (P x G rollouts, group 0 degenerate, ragged completions, old log-probs far enough
from the current ones that the clip is active, KL off) goes to a real `trl.GRPOTrainer` (built
from a `GRPOConfig` with that loss_type, on a one-layer random Qwen2 it never runs: the log-probs
it would compute are handed to it as a leaf tensor) through `GRPOTrainer._compute_loss`, and to
`objective_loss`; the advantages, the loss and its gradient w.r.t. the log-probs must agree to
1e-6 relative. trl is a test extra (requirements-test.txt); without it the tests skip, and fail
under CI=true.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import on_ci

from rcgrpo_jax.rl.losses import Objective, objective_loss, with_advantages

# TRL's GRPOConfig sets a transformers argument that transformers 5 renames: not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated")

P, G, TC = 4, 8, 12  # prompts, rollouts per prompt, completion tokens (TRL's logits_to_keep)
MAX_COMPLETION = 16  # TRL's max_completion_length: dr_grpo's constant, our norm_length
TRL_EPS = 1e-4  # TRL's advantage (r - mean) / (std + 1e-4) (`_generate_and_score_completions`)
REL = 1e-6

# id: (TRL GRPOConfig settings, our Objective): the table of docs/objectives.md
CASES = {
    "grpo": (
        dict(loss_type="grpo", epsilon=0.2, epsilon_high=0.28),
        Objective("grpo", clip_low=0.2, clip_high=0.28, adv_eps=TRL_EPS, adv_std_ddof=1),
    ),
    # our token mean is exact over microbatches: TRL's bnpo (per micro-batch) is ours when TRL
    # runs one micro-batch per update, as here
    "bnpo": (
        dict(loss_type="bnpo", epsilon=0.2, epsilon_high=0.28),
        Objective("dapo", clip_low=0.2, clip_high=0.28, adv_eps=TRL_EPS, adv_std_ddof=1),
    ),
    "dapo": (
        dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28),
        Objective("dapo", clip_low=0.2, clip_high=0.28, adv_eps=TRL_EPS, adv_std_ddof=1),
    ),
    "dr_grpo": (
        dict(loss_type="dr_grpo", scale_rewards="none", epsilon=0.2, epsilon_high=0.28),
        Objective("dr_grpo", clip_low=0.2, clip_high=0.28, norm_length=MAX_COMPLETION),
    ),
    # a clip range narrow enough for one log-ratio mean per sequence to leave it on some
    # sequences and not others
    "gspo": (
        dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.02,
             epsilon_high=0.03),
        Objective("gspo", clip_low=0.02, clip_high=0.03, adv_eps=TRL_EPS, adv_std_ddof=1),
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def trl():
    """The trl module; a skip where it is not installed, a failure under CI=true."""
    try:
        import torch  # noqa: F401
        import trl
    except ImportError as e:
        why = f"trl not installed ({e}); pip install -r requirements-test.txt"
        if on_ci():
            pytest.fail(f"CI=true: {why}", pytrace=False)
        pytest.skip(why)
    return trl


def make_batch():
    """Rollouts as our loss reads them: [P, G, 1 + TC], position 0 a prompt token (nothing
    predicts it) and 1.. the completion (TRL's completion tokens), right-padded to TC."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, TC + 1, (P, G))
    mask = np.zeros((P, G, 1 + TC), np.float32)
    mask[..., 1:] = np.arange(TC) < lengths[..., None]
    logp = np.zeros((P, G, 1 + TC), np.float32)
    logp[..., 1:] = rng.normal(-1.5, 0.5, (P, G, TC))
    old = ((logp + rng.normal(0, 0.3, logp.shape)) * mask).astype(np.float32)
    # rewards exact in float32, so a group's mean is exact: group 0 all equal (degenerate)
    rewards = rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], (P, G)).astype(np.float32)
    rewards[0] = 1.0
    assert all(np.ptp(rewards[i]) > 0 for i in range(1, P))
    batch = {"loss_mask": mask, "old_logprobs": old, "rewards": rewards}
    return batch, logp.astype(np.float32)


def trl_trainer(trl, tmp_path, settings: dict):
    """A real GRPOTrainer with `settings` (its GRPOConfig: TRL's own argument handling sets
    the loss's attributes) on a one-layer random Qwen2 and an in-memory tokenizer, P x G rows
    per micro-batch, one micro-batch per update."""
    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    vocab = {"<pad>": 0, "<eos>": 1, "a": 2, "b": 3}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="a")),
        pad_token="<pad>",
        eos_token="<eos>",
    )
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(
            "qwen2", vocab_size=len(vocab), hidden_size=16, intermediate_size=32,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        )
    )  # fmt: skip
    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        bf16=False,  # float32 throughout, as ours
        beta=0.0,  # KL off: no reference model
        num_generations=G,
        per_device_train_batch_size=P * G,
        gradient_accumulation_steps=1,
        max_completion_length=MAX_COMPLETION,
        **settings,
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a b"] * P}),
        processing_class=tokenizer,
    )
    trainer.model.train()
    # set by Trainer's training loop to the micro-batches of the update: one
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def trl_advantages(rewards: np.ndarray, scale: bool):
    """TRL's group advantages as `_generate_and_score_completions` forms them (its
    sum_then_normalize branch: the group mean, TRL's own `nanstd` (sample std), + 1e-4), [P * G]
    in TRL's row order (groups contiguous)."""
    import torch
    from trl.trainer.utils import nanstd

    r = torch.from_numpy(rewards.reshape(-1))
    mean = torch.nanmean(r.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    std = nanstd(r.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    adv = r - mean
    return adv / (std + TRL_EPS) if scale else adv


def trl_loss_and_grad(trainer, batch, logp, advantages):
    """TRL's `_compute_loss` on the batch, its log-probs a leaf tensor (what
    `_get_per_token_logps_and_entropies` would return) so that the gradient is w.r.t. them."""
    import torch

    rows = P * G
    leaf = torch.tensor(logp[..., 1:].reshape(rows, TC), requires_grad=True)

    def logps(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        assert logits_to_keep == TC
        return leaf, torch.zeros_like(leaf), None  # (log-probs, entropies, aux loss)

    trainer._get_per_token_logps_and_entropies = logps
    mask = torch.tensor(batch["loss_mask"][..., 1:].reshape(rows, TC))
    inputs = {
        "prompt_ids": torch.full((rows, 2), 2, dtype=torch.long),
        "prompt_mask": torch.ones((rows, 2), dtype=torch.long),
        "completion_ids": torch.full((rows, TC), 3, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": advantages,
        "old_per_token_logps": torch.tensor(batch["old_logprobs"][..., 1:].reshape(rows, TC)),
        # what `_generate_and_score_completions` counts: the generation batch's completion
        # tokens (here one micro-batch's), dapo's normalizer
        "num_items_in_batch": mask.sum(),
    }
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    clipped = trainer._metrics["train"]["clip_ratio/region_mean"][-1]
    return float(loss.detach()), leaf.grad.numpy().reshape(P, G, TC), clipped


def our_loss_and_grad(objective: Objective, batch, logp):
    jb = with_advantages(objective, {k: jnp.asarray(v) for k, v in batch.items()})
    ent = jnp.zeros(logp.shape, jnp.float32)
    fn = jax.jit(jax.value_and_grad(lambda lp: objective_loss(objective, lp, ent, jb)[0]))
    loss, grad = fn(jnp.asarray(logp))
    return float(loss), np.asarray(grad), np.asarray(jb["advantages"])


@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradient_equal_trls(trl, tmp_path, case):
    settings, objective = CASES[case]
    batch, logp = make_batch()
    trainer = trl_trainer(trl, tmp_path, settings)
    assert trainer.loss_type == settings["loss_type"]
    their_adv = trl_advantages(batch["rewards"], settings.get("scale_rewards") != "none")
    loss, grad, adv = our_loss_and_grad(objective, batch, logp)
    # the advantages first: our estimator with the mapped ddof / eps is TRL's
    np.testing.assert_allclose(adv.reshape(-1), their_adv.numpy(), rtol=REL, atol=REL)
    assert (adv[0] == 0).all() and (their_adv[:G].numpy() == 0).all()  # the degenerate group
    their_loss, their_grad, clipped = trl_loss_and_grad(trainer, batch, logp, their_adv)
    assert 0 < clipped < 1  # the clip is active on some tokens, not all
    assert loss == pytest.approx(their_loss, rel=REL)
    assert (grad[..., 0] == 0).all()  # the prompt position: no gradient
    scale = np.abs(their_grad).max()
    assert scale > 0
    np.testing.assert_allclose(grad[..., 1:], their_grad, rtol=REL, atol=REL * scale)
