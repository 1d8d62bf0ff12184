"""The vLLM worker extension and what it runs in vLLM's engine-core process:
``extension.py`` (the class vLLM mixes into its Worker), ``locked.py`` (the lock,
staging, the swap), ``layout.py`` (HF tensors -> vLLM parameters), ``steps.py``
(per-step version stamps), ``tp.py`` (tensor parallelism), ``adapter_swap.py`` (adapter swaps).
Imports nothing from the client side (actor/engines/vllm/client.py and friends).
"""
