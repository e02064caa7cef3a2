"""The worker stage: claim a unit, train it (lm, sft, grpo), and the rewards and tasks it uses."""
