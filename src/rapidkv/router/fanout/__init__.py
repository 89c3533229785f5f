"""Requests that are several engine requests on vLLM (a batch of prompts,
``n > 1`` with sampling), served as one sub-request per sequence and answered
as one vLLM instance answers them.

- `plan`: which requests fan out, and the sub-requests' bodies (pure);
- `merge`: their answers merged into the client's (pure);
- `relay`: the sub-requests run through the router and merged (the shell).
"""
