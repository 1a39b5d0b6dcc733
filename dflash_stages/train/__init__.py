"""The train stage: its config, the Trainer (its state, its one public step), its metrics log and
snapshot policy, and building the drafter."""
