"""The settings the clarify benchmarks share (`collab_clarify`, `collab_recipes`): one warm
start, step size, KL anchor and reward set, so that their runs compare."""

# Both runs: half the contexts are follow-ups (the question already asked and answered),
# so the answer turn is trained too. Advantages are centred but not divided by the group's
# std (Dr. GRPO): when every response in a group asks, their MRs differ only by the luck of
# the futures, and std scaling turned that luck into full-size updates that garbled the
# wording of the question. A small KL penalty to the warm start (k3, per token) holds in
# place what the reward barely looks at: with w = 2 a second question scores almost as well
# as the answer (the future answers instead), and without the anchor one seed in five let
# its answer turn drift (held-out success 0.656; 0.914 with the anchor).
FOLLOWUP_SHARE = 0.5
KL_COEF = 0.02
LR = 5e-4
WARM_START_STEPS = 400
REWARDS = {
    "multiturn (w=2, S=3)": {"mode": "multiturn", "window": 2, "num_futures": 3, "token_penalty": 5e-4},
    "next-turn (w=0)": {"mode": "multiturn", "window": 0, "token_penalty": 5e-4},
}
