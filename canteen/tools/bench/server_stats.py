"""What the service itself counted during a run: read from the gateway's ``/status.json``
before and after (speculative decoding's draft and accepted tokens, over every worker)."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp


@dataclass(frozen=True)
class Speculation:
    draft_tokens: int
    accepted_tokens: int

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    def __sub__(self, earlier: Speculation) -> Speculation:
        return Speculation(
            self.draft_tokens - earlier.draft_tokens,
            self.accepted_tokens - earlier.accepted_tokens,
        )


async def read_speculation(url: str, admin_key: str = "") -> Speculation:
    """Totals over the workers in ``url`` (a gateway's /status.json)."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(url, headers=headers) as response:
            response.raise_for_status()
            data = await response.json()
    workers = data.get("workers", [])
    return Speculation(
        sum(int(w.get("speculative", {}).get("draft_tokens", 0)) for w in workers),
        sum(int(w.get("speculative", {}).get("accepted", 0)) for w in workers),
    )
