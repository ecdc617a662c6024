"""The one place the reward-token codes and strings live (no dependencies, so the RL math can
read them without the environments): a rollout is conditioned on HIGH (its trajectory scored 1)
or LOW (0); NONE = no token (plain GRPO). `envs.prompts` renders them; both stages read them."""

HIGH, LOW, NONE = 1, 0, -1
REWARD_TOKENS = {HIGH: "<|high_reward|>", LOW: "<|low_reward|>"}
