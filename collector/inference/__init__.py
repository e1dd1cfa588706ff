"""Inference: the contract the episode loop depends on (``base``: token ids in, token ids out),
its client over vLLM servers (``vllm_client``), the local vLLM server's start and supervision
(``vllm_server``) and the wrapper that stops a server with its owner (``lifeline``).
"""
