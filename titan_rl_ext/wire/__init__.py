"""The weight wire protocol: what the trainer (``titan_rl_ext.rl``) and the serving plugin
(``vllm_titan_plugin``) both speak, in one neutral place that imports torch alone.

- ``protocol``: the routes, query values, headers and the SSE version field of the swap endpoint;
- ``weights``: the safetensors framing of a push and the per-tensor checksums both sides compare;
- ``cuda_ipc``: the JSON manifest of CUDA IPC handles for same-host pushes;
- ``collective``: the process groups and packed buckets of a broadcast push (trainer, engines and relays).

A serving deployment imports these and never the RL stack.
"""
