"""control: the control plane. Imports nothing from vLLM or torch.

- `codes`: the reply codes (`Code`).
- `messages`: the msgspec messages, their validation and what each reply obliges.
- `framing`: the wire (length-prefixed frames, HMAC per frame), sans-I/O.
- `server`: `RpcServer`, answering requests on a loop thread of its own.
- `client`: `RpcClient`, asking peers without blocking the caller.
- `address`: ``host:port`` control addresses.

The scheduler-side connector owns one `RpcServer` (its handler answers peers)
and one `RpcClient` (it asks them).
"""
