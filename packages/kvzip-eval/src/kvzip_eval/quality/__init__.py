"""The quality suite: KL at every position, words changed, multi-key retrieval.

Every measure runs the model with its KV cache passed through a format's encode + decode
(``hook.FormatCache``), next to a bf16 reference run on the same inputs.
"""
