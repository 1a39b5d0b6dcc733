"""Tests of dflash_model.fast: kernels, optimizer, compiled paths."""
