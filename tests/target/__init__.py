"""Tests of dflash_model.target: loading targets, their features, decoding."""
