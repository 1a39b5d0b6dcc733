"""The train stage: its config, the Trainer with its one public step, and building the drafter."""
