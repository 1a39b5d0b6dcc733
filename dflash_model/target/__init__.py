"""The frozen target: loading it, finding its layers, capturing their outputs (packed rows included),
and decoding with it: greedy, speculative, batched generation."""
