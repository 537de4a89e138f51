"""A TokenStream takes the engine's events through its public on_token callback (the engine's thread)."""

from __future__ import annotations

import asyncio

from precast.runtime.llm.handle import TokenEvent
from precast.runtime.server.llm_service import TokenStream


def test_token_stream_hands_engine_events_to_its_loop():
    async def main():
        stream = TokenStream(service=None, loop=asyncio.get_running_loop())
        ev = TokenEvent(3, "a", 0, None)
        await asyncio.to_thread(stream.on_token, ev)  # (as the engine's thread calls it)
        return ev, await asyncio.wait_for(stream.__anext__(), 5), stream.n_out

    ev, got, n_out = asyncio.run(main())
    assert got == ev and n_out == 1
