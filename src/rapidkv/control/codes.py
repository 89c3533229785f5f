"""Reply codes of the control plane.

Every reply carries one `Code`. The values borrow HTTP's numbers so logs read
at a glance; what each code obliges the caller to do is documented on each
reply message (`rapidkv.control.messages`). In short:

- `OK`: done as asked.
- `NOT_FOUND`: the id has not arrived yet (P never saw the request within its
  park TTL). Retry with short backoff.
- `GONE`: the id was aborted, finished or timed out. Do not retry.
- `BUSY`: admission refused (a bounded queue is full). Retry later or fall back.
- `ERROR`: the request was invalid or failed; the reply's message says why.
- `UNKNOWN_PEER`: the replier has no handshake from the sender (it restarted,
  or forgot a peer it found dead): handshake again, then retry once.
"""

from __future__ import annotations

import enum


class Code(enum.IntEnum):
    OK = 200
    UNKNOWN_PEER = 401
    NOT_FOUND = 404
    GONE = 410
    ERROR = 500
    BUSY = 503
