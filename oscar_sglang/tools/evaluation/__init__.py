"""Accuracy harness: emulate the INT2 KV cache in transformers and score it against the
unquantised model (fidelity), and needle-in-a-haystack against OpenAI-compatible servers.

Modules: recipes (what is compared), quantizers (fake quantisers), emulation (the
AttentionInterface function), fidelity (teacher-forced KLD / top-1 / PPL), niah, report.
"""
