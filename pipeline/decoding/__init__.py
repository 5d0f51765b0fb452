"""Decoding algorithms: pure functions over small Protocols and tensors, one file per method plus
the shared sampling and verification math. Nothing here imports engines, config, data, training,
actors, jobs, Ray, vLLM or transformers, opens a file, or keeps module-global state
(tests/test_architecture.py checks it). The registry of methods is pipeline.strategies."""
