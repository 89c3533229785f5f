"""One side of a write between two network namespaces (run by test_netns_transports
under `ip netns exec`): `recv` registers a zeroed region and waits for a
notification, `send` writes a patterned region into it and notifies.

    python netns_peer.py KIND ROLE DIR OPTIONS_JSON

The two exchange their metadata and region address through files in DIR; the
receiver writes `DIR/result` ("ok" or what was wrong)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from rapidkv.kvt.transport import XferState, create_transport

NBYTES = 16 << 20
DEADLINE_S = 30.0


def wait_file(path: Path, transport) -> bytes:
    deadline = time.monotonic() + DEADLINE_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        transport.take_notifs()  # keep progressing (NIXL answers wireup only then)
        time.sleep(0.005)
    time.sleep(0.05)  # written before renamed: complete once it exists
    return path.read_bytes()


def publish(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


def main() -> int:
    kind, role, directory, options = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    pattern = (np.arange(NBYTES, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)
    buf = np.zeros(NBYTES, dtype=np.uint8) if role == "recv" else pattern.copy()
    t = create_transport(kind, role, **json.loads(options))
    t.register_memory([(buf.ctypes.data, NBYTES)])
    publish(directory / f"{role}.meta", t.local_metadata())
    publish(directory / f"{role}.addr", str(buf.ctypes.data).encode())
    other = "send" if role == "recv" else "recv"
    peer = t.add_peer(wait_file(directory / f"{other}.meta", t))
    if role == "send":
        dst = int(wait_file(directory / "recv.addr", t))
        handle = t.post_write(peer, np.array([[buf.ctypes.data, dst, NBYTES]], dtype=np.int64))
        deadline = time.monotonic() + DEADLINE_S
        while (state := t.poll(handle)) is XferState.PENDING and time.monotonic() < deadline:
            t.take_notifs()
            time.sleep(0.0005)
        if state is not XferState.DONE:
            print(f"write {state}: {t.error(handle)}", flush=True)
            return 1
        t.send_notif(peer, b"done")
        wait_file(directory / "result", t)  # keep progressing until the receiver has it
    else:
        deadline = time.monotonic() + DEADLINE_S
        while not t.take_notifs():
            if time.monotonic() > deadline:
                publish(directory / "result", b"no notification")
                return 1
            time.sleep(0.001)
        ok = np.array_equal(buf, pattern)
        publish(directory / "result", b"ok" if ok else b"region differs")
    t.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
