"""The ``vllm`` engine: the client in the actor process (``client.py``: the engine's
start, RPCs and close; ``requests.py``: requests, streaming, version stamps;
``weight_updates.py``: stage/swap/poll RPCs; ``lora_client.py``: the version-0 adapter and engine
arguments; the tested vLLM versions: the base's pipeline/vllm_versions.py) and, in
``worker/``, the extension vLLM loads into its engine-core process (the per-forward-pass lock,
staging, the swap). The worker side imports nothing from the client side. Nothing
here imports vLLM at import time: ``client.load_vllm`` does, when an engine is made.
"""
