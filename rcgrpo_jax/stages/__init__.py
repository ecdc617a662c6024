"""The stages (sft, rctp, grpo, rcgrpo, eval, all): each composes the library layers below it
(models, sampling, envs, data, train, rl), which never import a stage."""
