"""Live migration of a streamed request from one instance to another.

- `bodies`: what the source and the destination are sent (pure);
- `splice`: the client's stream across upstreams (pure);
- `relay`: the relay that carries out a migration order (pre-copy, cut-over);
- `room`: whether the destination has room, asked before anything is sent;
- `controller`: the admin routes' orders (migrate one request, drain an
  instance and move what it decodes) on the requests being served.
"""
