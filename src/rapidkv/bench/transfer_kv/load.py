"""The background load of `rapidkv bench transfer-kv`: keeps P's engine busy.

`concurrency` clients, each sending plain prefill requests back to back (long
prompts from a fixed pool, `max_tokens` 1, no `kv_transfer_params`), on an
asyncio loop of its own thread, from `start()` until `stop()`. With
`--max-num-batched-tokens` 256 and two such clients P's steps are full chunks
(tens of ms) and it never runs out of work between the measured requests.

Invariant: `stop()` returns only once no request of the load is in flight
(cancelled requests are closed by httpx; P aborts them).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence


class BackgroundLoad:
    def __init__(self, base_url: str, prompts: Sequence[Sequence[int]], concurrency: int) -> None:
        if concurrency < 0 or (concurrency and not prompts):
            raise ValueError("need prompts and concurrency >= 0")
        self.base_url = base_url
        self.prompts = [list(p) for p in prompts]
        self.concurrency = concurrency
        self.done = 0
        self.errors = 0
        self.last_error = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    def start(self) -> BackgroundLoad:
        if self.concurrency:
            self._thread = threading.Thread(target=self._main, name="bench-load", daemon=True)
            self._thread.start()
            self._started.wait(10)
        return self

    def stop(self) -> None:
        if self._thread is None or self._loop is None or self._stop is None:
            return
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        self._thread = None

    def __enter__(self) -> BackgroundLoad:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        import httpx

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._started.set()
        from rapidkv.harness.client import pool_limits

        async with httpx.AsyncClient(limits=pool_limits(self.concurrency), timeout=120.0) as client:
            workers = [
                asyncio.create_task(self._client(client, i)) for i in range(self.concurrency)
            ]
            await self._stop.wait()
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def _client(self, client: object, index: int) -> None:
        from rapidkv.harness.client import acomplete_full

        i = index
        while True:
            prompt = self.prompts[i % len(self.prompts)]
            i += self.concurrency
            try:
                await acomplete_full(client, self.base_url, prompt, 1)  # type: ignore[arg-type]
                self.done += 1
            except asyncio.CancelledError:
                raise
            except Exception as e:  # counted; the load goes on
                self.errors += 1
                self.last_error = f"{type(e).__name__}: {e}"[:500]
                await asyncio.sleep(0.1)
